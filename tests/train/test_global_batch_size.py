"""--global-batch-size: the per-process batch and accumulation derived from it and the process count, so the
global batch a run trains on does not depend on how many processes it has (issue: runs that change size)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from conftest import SMALL_RUN

from mmfast.train.config import TrainConfig
from mmfast.train.resolve import apply_global_batch, resolve_batches


@pytest.mark.parametrize(
    ("g", "n", "batch", "want"),
    [
        (64, 1, 32, (32, 2)),  # one process: two micro-batches of 32
        (64, 2, 32, (32, 1)),  # two: 32 each
        (64, 4, 32, (16, 1)),  # the share is below --batch-size: the share itself
        (96, 2, 32, (24, 2)),  # 48 each: the largest divisor of 48 at most 32
        (60, 1, 64, (60, 1)),
        (7, 1, 4, (1, 7)),  # a prime share: micro-batches of one
    ],
)
def test_batch_and_accumulation_from_the_global_batch(g, n, batch, want):
    cfg = apply_global_batch(TrainConfig(global_batch_size=g, batch_size=batch), n)
    assert (cfg.batch_size, cfg.grad_accum) == want
    assert cfg.batch_size * cfg.grad_accum * n == g


def test_without_it_nothing_changes_and_wrong_ones_are_refused():
    cfg = TrainConfig(batch_size=16, grad_accum=3)
    assert apply_global_batch(cfg, 2) is cfg
    with pytest.raises(ValueError, match=r"not divisible by the 3 processes.*multiple of 3 \(e\.g\. 63 or 66\)"):
        apply_global_batch(TrainConfig(global_batch_size=64, batch_size=16), 3)
    with pytest.raises(ValueError, match="give one of them"):
        apply_global_batch(replace(cfg, global_batch_size=64), 2)
    with pytest.raises(ValueError, match=">= 1"):
        apply_global_batch(TrainConfig(global_batch_size=0), 1)


def test_the_eval_batch_is_the_micro_batch_the_flag_or_the_preset_gives():
    """resolve_batches decides every batch size of a run: the eval batch is --eval-batch-size, else the
    micro-batch before --global-batch-size divides it (the preset's 64 here, not the derived 32)."""
    cfg = resolve_batches(TrainConfig(global_batch_size=32, batch_size=64), 1)
    assert (cfg.batch_size, cfg.grad_accum, cfg.eval_batch_size) == (32, 1, 64)
    cfg = resolve_batches(TrainConfig(batch_size=16, eval_batch_size=40, grad_accum=2), 2)
    assert (cfg.batch_size, cfg.grad_accum, cfg.eval_batch_size) == (16, 2, 40)


def test_a_run_records_the_derived_batch_and_accumulation(tmp_path):
    from tools import train as train_tool

    out = tmp_path / "run"
    args = [a for a in SMALL_RUN if a not in ("--batch-size", "16")]
    argv = ["--out", str(out), "--demo-size", "96", "--epochs", "1", "--global-batch-size", "32"]
    argv += ["--batch-size", "8"]
    assert train_tool.main([*argv, *args, "--max-steps", "2"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert (config["batch_size"], config["grad_accum"], config["global_batch_size"]) == (8, 4, 32)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["global_step"] == 2


def _epoch_ids(run, ranks: int) -> dict[int, list[int]]:
    """Every sample id each epoch trained, over all segments of the run and all ranks (--record-ids)."""
    out: dict[int, list[int]] = {}
    for rank in range(ranks):
        path = run / f"seen_ids.rank{rank}.jsonl"
        if path.exists():
            for line in path.read_text().splitlines():
                r = json.loads(line)
                out.setdefault(r["epoch"], []).extend(r["ids"])
    return out


RESUMABLE = ["--epochs", "1", "--record-ids", "--mixed-precision", "no", "--model", "image", "--freeze-image"]
RESUMABLE += ["--dropout", "0", "--no-cache-decoded", "--scheduler", "constant"]


def _launch(prepared, out, n: int, *flags: str):
    """A RESUMABLE run into ``out`` on ``n`` processes (1, or 2 under torchrun)."""
    import subprocess

    from conftest import ROOT, free_port, train_cmd

    launcher = ("-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()))
    cmd = train_cmd(prepared, out, *RESUMABLE, *flags)
    cmd = [*cmd[:1], *(launcher if n == 2 else ()), *cmd[1:]]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)


GLOBAL_32 = ("--global-batch-size", "32", "--batch-size", "16")


@pytest.fixture(scope="module")
def never_stopped(prepared, tmp_path_factory):
    """The reference of both directions below: a RESUMABLE run with GLOBAL_32 that was never stopped, on one
    process (the same weights as on two: test_one_process_accumulating_and_two_processes_train_the_same_weights;
    it is read, never written, by the tests)."""
    out = tmp_path_factory.mktemp("never-stopped") / "whole"
    assert (r := _launch(prepared, out, 1, *GLOBAL_32)).returncode == 0, r.stderr[-3000:]
    return out


@pytest.mark.slow
@pytest.mark.parametrize(("first", "then"), [(1, 2), (2, 1)])
def test_a_run_stopped_on_n_processes_resumes_on_m_training_each_sample_once(
    prepared, never_stopped, tmp_path, first, then
):
    """--global-batch-size 32 with batch 16: 1 process accumulates 2, 2 processes take 16 each. Stopped after 3
    steps on ``first`` processes and resumed on ``then``: every whole global batch of the epoch trained exactly
    once, the step counter carried over, and the weights and the epoch's loss those of a run that was never
    stopped (the augmentation is each sample's own; a frozen image tower, no dropout and a constant learning
    rate, which --max-steps does not reshape, so nothing else differs); without --global-batch-size the same
    change is refused."""
    import torch
    from conftest import n_rows
    from safetensors.torch import load_file

    out = tmp_path / "run"
    first_run = _launch(prepared, out, first, *GLOBAL_32, "--max-steps", "3")
    assert first_run.returncode == 0, first_run.stderr[-3000:]
    resumed = _launch(prepared, out, then, *GLOBAL_32, "--resume", "latest")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"written by {first} processes; this run has {then}" in resumed.stdout + resumed.stderr
    steps = n_rows(prepared, "train") // 32  # whole global batches of an epoch
    ids = _epoch_ids(out, 2)[0]
    assert len(ids) == len(set(ids)) == steps * 32, (len(ids), len(set(ids)), steps)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["global_step"] == steps and summary["num_processes"] == then
    whole, resumed_w = (load_file(d / "model-last" / "model.safetensors") for d in (never_stopped, out))
    for key in whole:
        assert torch.allclose(resumed_w[key], whole[key], rtol=1e-4, atol=1e-6), key
    losses = [json.loads(ln)["train_loss"] for d in (never_stopped, out) for ln in open(d / "metrics.jsonl")]
    assert losses[-1] == pytest.approx(losses[0], rel=1e-4), losses

    out = tmp_path / "fixed"  # a per-process batch: the process count must not change
    assert _launch(prepared, out, first, "--batch-size", "16", "--max-steps", "3").returncode == 0
    refused = _launch(prepared, out, then, "--batch-size", "16", "--resume", "latest")
    assert refused.returncode != 0 and "num_processes" in refused.stderr


def _step_ids(run, ranks: int) -> dict[tuple[int, int], set[int]]:
    """{(epoch, optimizer step): the sample ids trained in it, over all ranks and micro-batches}."""
    out: dict[tuple[int, int], set[int]] = {}
    for rank in range(ranks):
        path = run / f"seen_ids.rank{rank}.jsonl"
        for line in path.read_text().splitlines() if path.exists() else []:
            r = json.loads(line)
            out.setdefault((r["epoch"], r["step"]), set()).update(i for i in r["ids"] if i >= 0)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("images", ["--no-cache-decoded", "--cache-decoded"], ids=["streamed", "decoded"])
def test_one_process_accumulating_and_two_processes_train_the_same_weights(prepared, tmp_path, images):
    """The same seed on 1 process (batch 16, accumulation 2) and on 2 (batch 16 each), two epochs, the images
    streamed through DALI or cut from the decoded ones in memory: every step trains the same 32 samples, with
    the same pixels (each sample's augmentation drawn from (seed, epoch, id): mmfast/loading/draws.py), and
    the final weights agree to float32 tolerance. A frozen image tower (its batch norm in eval mode) and no
    dropout: nothing else differs between the layouts."""
    import subprocess

    import torch
    from conftest import ROOT, free_port, train_cmd
    from safetensors.torch import load_file

    def launch(out, n: int, *flags: str):
        launcher = ("-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()))
        cmd = train_cmd(prepared, out, "--epochs", "2", "--record-ids", "--mixed-precision", "no", *flags)
        cmd += ["--model", "image", "--freeze-image", "--dropout", "0", "--seed", "3", "--lr", "3e-3", images]
        cmd = [*cmd[:1], *(launcher if n == 2 else ()), *cmd[1:]]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)

    one, two = tmp_path / "one", tmp_path / "two"
    assert (r := launch(one, 1, "--grad-accum", "2")).returncode == 0, r.stderr[-3000:]
    assert (r := launch(two, 2)).returncode == 0, r.stderr[-3000:]
    steps_one, steps_two = _step_ids(one, 1), _step_ids(two, 2)
    assert len(steps_one) >= 10 and steps_one == steps_two
    assert all(len(ids) == 32 for ids in steps_one.values())
    a, b = load_file(one / "model-last" / "model.safetensors"), load_file(two / "model-last" / "model.safetensors")
    assert a.keys() == b.keys()
    assert [k for k in a if not k.startswith("image.")], sorted(a)  # layers that trained, beside the frozen tower
    for key in a:
        assert torch.allclose(a[key], b[key], rtol=1e-4, atol=1e-6), (key, float((a[key] - b[key]).abs().max()))


@pytest.mark.slow
def test_with_batch_norm_training_one_process_accumulating_and_two_processes_end_with_the_same_weights(
    prepared, tmp_path
):
    """The default model and tiny preset with every layer training (ResNet-10's batch norm normalizes each
    micro-batch by its own statistics): 1 process (batch 16, accumulation 2) and 2 (16 each), two epochs. Each
    step's two micro-batches are the same samples in both layouts (a rank's k-th batch is the order's
    (k x 2 + rank)-th), and the running statistics move once a step by the mean of its micro-batches' updates
    on every process. With one torch thread per process in both layouts (the 1-process run on one core, the
    2-process run on two: the thread count changes the float sums' order, which batch norm and AdamW amplify),
    every tensor of the final weights is bit for bit the same: parameters, batch norm's running mean and
    variance, and its batch count, which is the optimizer steps; both processes end with the same weights."""
    import os
    import subprocess

    import torch
    from conftest import ROOT, free_port, train_cmd
    from safetensors.torch import load_file

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two CPU cores")

    def launch(out, n: int, *flags: str):
        launcher = ("-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()))
        cmd = train_cmd(prepared, out, "--epochs", "2", "--record-ids", "--mixed-precision", "no", *flags)
        cmd += ["--dropout", "0", "--seed", "3", "--lr", "3e-3", "--no-cache-decoded"]
        cmd = [*cmd[:1], *(launcher if n == 2 else ()), *cmd[1:]]
        pin = set(cores[:n])  # one core a process: torch takes one thread each (setup.usable_cores)
        pinned = lambda: os.sched_setaffinity(0, pin)  # noqa: E731  (run in the child before it starts)
        return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, preexec_fn=pinned)

    one, two = tmp_path / "one", tmp_path / "two"
    assert (r := launch(one, 1, "--grad-accum", "2")).returncode == 0, r.stderr[-3000:]
    assert (r := launch(two, 2)).returncode == 0, r.stderr[-3000:]
    assert (two / "weights.rank0.sha256").read_text() == (two / "weights.rank1.sha256").read_text()
    steps = json.loads((one / "summary.json").read_text())["global_step"]
    assert steps >= 10 and json.loads((two / "summary.json").read_text())["global_step"] == steps
    a, b = load_file(one / "model-last" / "model.safetensors"), load_file(two / "model-last" / "model.safetensors")
    assert a.keys() == b.keys()
    counts = [k for k in a if k.endswith("num_batches_tracked")]
    assert counts and all(int(a[k]) == int(b[k]) == steps for k in counts)
    variances = [k for k in a if k.endswith("running_var")]
    assert variances and all(not torch.allclose(a[k], torch.ones_like(a[k])) for k in variances)  # they moved
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


def test_a_resume_that_changes_the_global_batch_names_it_alone_with_the_flag_to_pass():
    """The per-process batch, accumulation and process count follow from the global batch: a resume that
    changes or leaves out the checkpoint's --global-batch-size is refused by that one line, not by its
    consequences, and no value reads as a bare None."""
    from mmfast.train.elastic import without_elastic
    from mmfast.train.resume_rules import resume_differences

    saved = {"task": "clip", "global_batch_size": 32, "num_processes": 2, "grad_accum": 1, "batch_size": 16}
    for given, shown in ((64, "64"), (None, "not set")):
        now = {**saved, "global_batch_size": given, "num_processes": 1, "grad_accum": 4}
        lines = without_elastic(resume_differences(saved, now), saved, now)
        assert lines == [
            f"global_batch_size: 32 -> {shown} (pass --global-batch-size 32: each process's batch follows from it)"
        ]
    fixed = {"task": "clip", "num_processes": 2, "grad_accum": 1, "batch_size": 16}  # no global batch
    lines = without_elastic(resume_differences(fixed, {**fixed, "num_processes": 1}), fixed, {})
    assert lines == ["num_processes: 2 -> 1"]
