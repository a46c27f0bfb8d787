"""The settings chosen for the hardware (mmfast/train/hardware.py, #31 item 1): bf16 where the GPU has it, fp16
+ GradScaler where it has not, NHWC for a CNN on CUDA, AdamW's fused kernel on CUDA; each overridable, and a
run records what it chose. GPUs are faked: a compute capability reported by a patched torch.cuda."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch

from mmfast.train import hardware
from mmfast.train.config import TrainConfig
from mmfast.train.hardware import optimizer_kwargs, resolve_channels_last, resolve_mixed_precision
from mmfast.train.optim import build_optimizer


@pytest.fixture
def gpu(monkeypatch):
    """A fake CUDA device of a given compute capability: ``gpu((9, 0))``."""

    def fake(capability: tuple[int, int]) -> None:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)

    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    return fake


@pytest.mark.parametrize(("capability", "want"), [((9, 0), "bf16"), ((8, 0), "bf16"), ((7, 5), "fp16")])
def test_auto_precision_is_bf16_where_the_gpu_has_it_and_fp16_elsewhere(gpu, capability, want):
    gpu(capability)  # H100/H200 9.0, A100 8.0, T4 7.5
    assert resolve_mixed_precision("auto", cuda=True) == want
    assert resolve_mixed_precision("fp16", cuda=True) == "fp16"  # a flag wins
    assert resolve_mixed_precision("no", cuda=True) == "no"


def test_auto_precision_on_the_cpu_and_the_launchers_choice(monkeypatch, gpu):
    for native, want in ((True, "bf16"), (False, "no")):
        monkeypatch.setattr(hardware, "cpu_has_fast_bf16", lambda native=native: native)
        assert resolve_mixed_precision("auto", cuda=False) == want
    gpu((9, 0))
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")  # accelerate launch --mixed_precision fp16
    assert resolve_mixed_precision("auto", cuda=True) == "fp16"
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        resolve_mixed_precision("auto", cuda=False)
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        resolve_mixed_precision("fp16", cuda=False)


def test_channels_last_for_a_cnn_on_cuda_unless_told():
    assert resolve_channels_last(None, "cuda", "resnet50", "concat") is True
    assert resolve_channels_last(None, "cuda", "efficientnet-lite0", "clip") is True
    assert resolve_channels_last(None, "cpu", "resnet50", "concat") is False
    assert resolve_channels_last(None, "cuda", "timm:vit_small_patch16_224", "concat") is False  # not a CNN
    assert resolve_channels_last(None, "cuda", "resnet50", "text") is False  # no image tower runs
    assert resolve_channels_last(False, "cuda", "resnet50", "concat") is False
    assert resolve_channels_last(True, "cpu", "resnet18", "image") is True


@pytest.mark.parametrize(
    ("impl", "device", "fused", "foreach"),
    [("auto", "cuda", True, None), ("auto", "cpu", None, True), ("foreach", "cuda", None, True),
     ("for-loop", "cpu", None, False), ("fused", "cpu", True, None)],
)  # fmt: skip
def test_the_optimizer_kernels_follow_the_device_and_the_flag(impl, device, fused, foreach):
    assert optimizer_kwargs(impl, device) == {
        k: v for k, v in (("fused", fused), ("foreach", foreach)) if v is not None
    }
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    optimizer, _ = build_optimizer(
        TrainConfig(optimizer_impl=impl, lr=1e-3, warmup_frac=0.0, probe_frac=0.0), model, 10, device
    )
    assert bool(optimizer.defaults.get("fused")) == bool(fused)
    (model(torch.randn(2, 4)) ** 2).sum().backward()  # not a plain sum: its gradient in the norm weight is 0
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.step()  # every kernel runs here (fused AdamW has a CPU kernel too)
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    with pytest.raises(ValueError, match="--optimizer-impl"):
        optimizer_kwargs("apex", device)


def test_the_profiler_names_the_flag_a_compute_bound_gpu_run_leaves_off():
    """A compute-bound GPU run on fp16 where bf16 runs natively, NCHW and uncompiled: the advice names
    --mixed-precision bf16, --channels-last and --compile; with them on, none of the three."""
    from mmfast.train.profiler import verdict

    gpu = {"gpu": {"gpu_util": {"mean": 97.0}}, "cpu_util_mean": 30.0}
    off = {"mixed_precision": "fp16", "cuda_bf16": True, "channels_last": False, "compile": False}
    steps = verdict({"data_wait_frac": 0.01, "utilization": gpu, "settings": off})["next_steps"]
    for flag in ("--mixed-precision bf16", "--channels-last", "--compile"):
        assert any(flag in s for s in steps), (flag, steps)
    on = {"mixed_precision": "bf16", "cuda_bf16": True, "channels_last": True, "compile": True}
    steps = verdict({"data_wait_frac": 0.01, "utilization": gpu, "settings": on})["next_steps"]
    assert not any(flag in s for s in steps for flag in ("--mixed-precision", "--channels-last", "--compile"))


@pytest.mark.slow
def test_a_compiled_run_trains_the_weights_an_eager_one_does(prepared, tmp_path):
    """--compile on the CPU (inductor, static shapes: the captions padded to buckets): three steps give the
    weights of the same run uncompiled (the whole model within 1% of its norm, each tensor within 10%: fused
    kernels round otherwise, and Adam's first steps amplify it on tiny gradients), and the model directory
    loads (its keys without the compiler's prefix); summary.json records the compiled step and the caption
    width."""
    import json
    import subprocess

    from conftest import ROOT, train_cmd
    from safetensors.torch import load_file

    def run(out, *flags):
        cmd = train_cmd(prepared, out, "--model", "image", "--dropout", "0", "--max-steps", "3", "--epochs", "1")
        cmd += ["--mixed-precision", "no", "--scheduler", "constant", *flags]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)

    assert (r := run(tmp_path / "eager")).returncode == 0, r.stderr[-3000:]
    assert (r := run(tmp_path / "compiled", "--compile")).returncode == 0, r.stderr[-3000:]
    # compiled with static shapes: its captions padded to buckets (the eager run's to each batch's longest)
    chosen = [
        json.loads((tmp_path / d / "summary.json").read_text())["hardware_choices"] for d in ("eager", "compiled")
    ]
    assert [(c["compile_mode"], c["text_padding"], c["cuda_graphs"]) for c in chosen] == [
        (None, "longest", False),
        ("default", "buckets", False),
    ], chosen
    eager = load_file(tmp_path / "eager" / "model-last" / "model.safetensors")
    compiled = load_file(tmp_path / "compiled" / "model-last" / "model.safetensors")
    assert eager.keys() == compiled.keys()
    # Adam's first steps amplify fused kernels' noise most on the BatchNorm biases, which start at zero: their
    # norm is the three steps alone (4-5% apart on the host-drawn crops). The whole model within 1%, each
    # tensor within 10%: a step lost or mangled on any tensor moves it by its whole norm.
    floats = [k for k in eager if eager[k].is_floating_point()]
    drifts = {k: float((compiled[k] - eager[k]).norm() / eager[k].norm().clamp(min=1e-12)) for k in floats}
    assert max(drifts.values()) < 0.1, max(drifts.items(), key=lambda kv: kv[1])
    whole = sum(float((compiled[k] - eager[k]).norm()) ** 2 for k in floats) ** 0.5
    assert whole / sum(float(eager[k].norm()) ** 2 for k in floats) ** 0.5 < 1e-2
    import mmfast

    assert mmfast.load_model(tmp_path / "compiled" / "model-last").config["model"] == "image"


@pytest.mark.parametrize(("impl", "model"), [("foreach", "concat"), ("fused", "concat"), ("fused", "clip")])
def test_the_loop_reads_the_loss_back_at_log_lines_not_per_micro_batch(
    prepared, tmp_path, monkeypatch, capsys, impl, model
):
    """#31 item 3: a run of 4-micro-batch windows reads a tensor back to the host (``item``, ``tolist``,
    ``bool``, ``float``, ``int``) from the loop's code at most once per optimizer step (the gradient norm's
    finiteness) plus its log lines and the epoch's end, not once per micro-batch; with a fused AdamW (CUDA's
    default), which skips a non-finite step on the device, not even once per step: only at the log lines (the
    loss, the skips) and the epoch's end; the contrastive objective's windows (their features cached, the loss
    of the four micro-batches together) too. The loss it prints and records is still the micro-batches'
    mean."""
    import inspect
    import json

    from conftest import SMALL_RUN

    from tools import train as train_tool

    loop_files = ("mmfast/train/engine.py", "mmfast/train/report.py", "mmfast/train/source_tally.py")
    loop_files += ("mmfast/tasks/classification.py", "mmfast/tasks/contrastive.py", "mmfast/tasks/global_batch.py")
    loop_files += ("mmfast/tasks/losses.py",)
    reads: list[str] = []
    for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
        real = getattr(torch.Tensor, name)

        def counted(self, *a, _real=real, _name=name, **k):
            caller = inspect.currentframe().f_back.f_code.co_filename.replace("\\", "/")
            if caller.endswith(loop_files):
                reads.append(f"{_name} {caller.rsplit('/', 1)[-1]}:{inspect.currentframe().f_back.f_lineno}")
            return _real(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)
    out = tmp_path / "run"
    flags = [
        *(f for f in SMALL_RUN if f != "--no-progress"),
        "--batch-size",
        "4",
        "--grad-accum",
        "4",
        "--epochs",
        "1",
        "--log-every",
        "5",
    ]
    flags += ["--mixed-precision", "no", "--no-checkpoints", "--optimizer-impl", impl, "--model", model]
    flags += ["--preset", "tiny"] if model == "clip" else []
    assert train_tool.main(["--data", str(prepared), "--out", str(out), *flags]) == 0
    monkeypatch.undo()
    metrics = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    steps, logs = metrics["step"], metrics["step"] // 5
    micro_batches = len((prepared / "train.jsonl").read_text().splitlines()) // 4
    assert micro_batches >= 4 * (steps - 1) and steps >= 10
    per_step = steps if impl == "foreach" else 0
    assert len(reads) <= per_step + 3 * logs + 5, (len(reads), steps, sorted(set(reads)))
    assert len(reads) < (micro_batches if impl == "foreach" else steps)
    printed = [float(x) for x in re.findall(r"step \d+/\d+: loss (\S+)", capsys.readouterr().out)]
    assert len(printed) == logs and all(0 < x < 10 for x in printed)
    assert 0 < metrics["train_loss"] < 10


def test_a_fused_adamw_skips_a_non_finite_step_on_the_device_leaving_everything_as_it_was(cpu_accelerator):
    """#31 item 3: the step the loop takes without reading the gradient norm back (CUDA's fused AdamW, here its
    CPU kernel, through Accelerate's wrapper): NaN gradients leave the parameters, both moments and the step
    count exactly as they were, weight decay included; a finite step after it moves them. A foreach AdamW
    cannot skip so: the loop checks its norm on the host."""
    from mmfast.train.optim import skips_on_device, step_unless_non_finite

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    cfg = TrainConfig(optimizer_impl="fused", lr=1e-2, weight_decay=0.1, warmup_frac=0.0, probe_frac=0.0)
    optimizer, _ = build_optimizer(cfg, model, 10, "cpu")
    model, optimizer = cpu_accelerator.prepare(model, optimizer)
    assert skips_on_device(optimizer, cpu_accelerator)
    x = torch.randn(8, 4)

    def step(scale: float) -> float:
        (model(x) ** 2).sum().mul(scale).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        skipped = step_unless_non_finite(optimizer, norm)
        optimizer.zero_grad(set_to_none=True)
        return float(skipped)

    def snapshot() -> list[torch.Tensor]:
        state = [v for p in model.parameters() for v in optimizer.optimizer.state[p].values()]
        return [t.detach().clone() for t in [*model.parameters(), *state]]

    assert step(1.0) == 0.0  # a first step: the moments exist
    before = snapshot()
    assert step(float("nan")) == 1.0
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(), strict=True))
    assert not hasattr(optimizer.optimizer, "found_inf")  # left as a plain optimizer for the next step
    assert step(1.0) == 0.0
    assert not all(torch.equal(a, b) for a, b in zip(before, snapshot(), strict=True))
    foreach, _ = build_optimizer(replace(cfg, optimizer_impl="foreach"), model, 10, "cpu")
    assert not skips_on_device(foreach, cpu_accelerator)


@pytest.mark.parametrize("impl", ["fused", "foreach"])
def test_a_gradscaler_skip_is_counted_for_a_fused_adamw_too(cpu_accelerator, impl):
    """fp16's GradScaler skips a step of inf/NaN gradients; with a fused AdamW (CUDA's default) it hands the
    kernel ``found_inf`` and calls the step anyway, so Accelerate's ``step_was_skipped`` says False and the run
    counted no skip and never stopped at --max-nan-steps. ``scaled_step_skipped`` sees it from the scale the
    scaler lowered, on the device, for either kernel (the scaler here on the CPU: the same code path)."""
    from accelerate.optimizer import AcceleratedOptimizer

    from mmfast.train.optim import scaled_step_skipped

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    cfg = TrainConfig(optimizer_impl=impl, lr=1e-2, warmup_frac=0.0, probe_frac=0.0)
    scaler = torch.amp.GradScaler("cpu")
    optimizer = AcceleratedOptimizer(build_optimizer(cfg, model, 10, "cpu")[0], scaler=scaler)
    x = torch.randn(8, 4)
    said = []
    for scale in (1.0, float("nan"), 1.0):
        scaler.scale((model(x) ** 2).sum() * scale).backward()
        before = model.weight.detach().clone()
        skipped = scaled_step_skipped(optimizer, scaler)
        optimizer.zero_grad()
        said.append((float(skipped), torch.equal(before, model.weight), optimizer.step_was_skipped))
    assert [s[:2] for s in said] == [(0.0, False), (1.0, True), (0.0, False)]  # skipped: the weights kept
    assert said[1][2] is (impl == "foreach")  # what Accelerate alone would have counted
