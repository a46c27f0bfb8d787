"""The training engine, in-process and with real processes on the CPU."""

from __future__ import annotations

import importlib.util
import json
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT, free_port, n_rows, train_cmd
from safetensors.torch import load_file

from mmfast.train.flags import parse_config
from mmfast.train.setup import LaunchError, check_process_group
from tools import prepare_data as prepare_tool
from tools import train as train_tool

FAST = ["--epochs", "1", "--batch-size", "32", "--no-progress", "--image-size", "32", "--hidden", "32"]


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln]


def _seen(run: Path, rank: int = 0) -> list[dict]:
    return _jsonl(run / f"seen_ids.rank{rank}.jsonl")


def test_run_directory_contract(prepared, tmp_path, capsys):
    out = tmp_path / "run"
    assert train_tool.main(["--data", str(prepared), "--out", str(out), "--model", "late", *FAST]) == 0
    assert "val_acc" in capsys.readouterr().out
    n_train, n_val = len(_jsonl(prepared / "train.jsonl")), len(_jsonl(prepared / "val.jsonl"))
    steps = n_train // 32  # FAST: batch 32, one epoch, the last partial batch dropped
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model"] == "late" and cfg["image_backbone"] == "resnet10" and cfg["total_steps"] == steps
    (metrics,) = _jsonl(out / "metrics.jsonl")
    for key in (
        "epoch",
        "step",
        "train_loss",
        "val_loss",
        "val_acc",
        "images_per_s",
        "data_wait_frac",
        "lr",
        "skipped_steps",
    ):
        assert key in metrics, key
    assert metrics["val_samples"] == n_val and metrics["step"] == steps
    summary = json.loads((out / "summary.json").read_text())
    for key in (
        "val_acc",
        "best_val_acc",
        "images_per_s",
        "wall_s",
        "device",
        "mixed_precision",
        "num_processes",
        "model",
    ):
        assert key in summary, key
    assert summary["num_processes"] == 1 and summary["device"] == "cpu"
    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert ckpts == [f"step-{steps:08d}"]


def test_no_flag_run_generates_the_demo_set_and_trains(tmp_path, monkeypatch):
    """The quickstart's path (demo generation + preparation + training), on a smaller demo set."""
    monkeypatch.setenv("MMFAST_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    assert train_tool.main(["--demo-size", "200", "--epochs", "1", "--no-progress"]) == 0
    summary = json.loads((tmp_path / "runs" / "latest" / "summary.json").read_text())
    assert summary["model"] == "concat" and summary["preset"] == "tiny"
    prepared = next((tmp_path / "cache" / "prepared").iterdir())
    assert json.loads((prepared / "prepare.json").read_text())["counts"]["accepted"] == 200


def _weights(run: Path) -> dict[str, torch.Tensor]:
    (ckpt,) = sorted((run / "checkpoints").iterdir())[-1:]
    return load_file(ckpt / "model.safetensors")


def test_accumulating_4x16_equals_one_step_of_64(prepared, tmp_path):
    # No batch-norm coupling (frozen CNN keeps its statistics), no dropout, no augmentation randomness.
    common = [
        "--data",
        str(prepared),
        "--epochs",
        "1",
        "--max-steps",
        "1",
        "--no-progress",
        "--image-size",
        "32",
        "--hidden",
        "32",
        "--freeze-image",
        "--dropout",
        "0",
        "--no-augment",
        "--mixed-precision",
        "no",
        "--lr",
        "0.01",
    ]
    assert train_tool.main([*common, "--out", str(tmp_path / "a"), "--batch-size", "64"]) == 0
    assert train_tool.main([*common, "--out", str(tmp_path / "b"), "--batch-size", "16", "--grad-accum", "4"]) == 0
    a, b = _weights(tmp_path / "a"), _weights(tmp_path / "b")
    assert train_tool.main([*common, "--out", str(tmp_path / "c"), "--batch-size", "16", "--grad-accum", "1"]) == 0
    init = _weights(tmp_path / "c")
    diff = torch.cat([(a[k].float() - b[k].float()).abs().flatten() for k in a])
    differs = max((a[k].float() - init[k].float()).abs().max().item() for k in a)
    # Adam's first step is about lr * sign(grad): float rounding can flip the update of the rare entries whose
    # gradient is near zero (up to lr); every other entry must agree. A different batch, or a step per
    # micro-batch, moves most weights by about lr (0.01).
    off = (diff > 1e-4).float().mean().item()
    assert off < 1e-3 and diff.median().item() < 1e-6, (off, diff.max().item())
    assert differs > 1e-3, differs


@pytest.mark.slow
def test_last_partial_accumulation_window_of_an_epoch_is_stepped(prepared, tmp_path):
    # about 240 train samples / 32 = 7 micro-batches; with accumulation 3 the windows are 3 + 3 + 1.
    assert n_rows(prepared, "train") // 32 == 7
    out = tmp_path / "run"
    assert (
        train_tool.main(
            ["--data", str(prepared), "--out", str(out), "--grad-accum", "3", "--epochs", "2", *FAST[2:]]
        )
        == 0
    )
    assert [m["step"] for m in _jsonl(out / "metrics.jsonl")] == [3, 6]
    assert json.loads((out / "config.json").read_text())["total_steps"] == 6


@pytest.mark.slow
def test_resume_mid_epoch_reproduces_the_uninterrupted_run(prepared, tmp_path):
    args = [
        "--data",
        str(prepared),
        "--epochs",
        "2",
        "--batch-size",
        "32",
        "--no-progress",
        "--image-size",
        "32",
        "--hidden",
        "32",
        "--checkpoint-every",
        "3",
        "--keep-checkpoints",
        "10",
        "--record-ids",
    ]
    full = tmp_path / "full"
    assert train_tool.main([*args, "--out", str(full)]) == 0
    # A run that "died" after step 3 (mid-epoch 0): its directory holds only the step-3 checkpoint.
    part = tmp_path / "part"
    (part / "checkpoints").mkdir(parents=True)
    shutil.copy(full / ".mmfast-run", part / ".mmfast-run")
    shutil.copytree(full / "checkpoints" / "step-00000003", part / "checkpoints" / "step-00000003")
    state = json.loads((part / "checkpoints" / "step-00000003" / "trainer_state.json").read_text())
    assert state["epoch"] == 0 and state["loader"][0]["step"] == 3
    assert train_tool.main([*args, "--out", str(part), "--resume", "latest"]) == 0
    full_batches = [r["ids"] for r in _seen(full)]
    assert [r["ids"] for r in _seen(part)] == full_batches[3:]  # exactly the remaining samples, in order
    a, b = _jsonl(full / "metrics.jsonl"), _jsonl(part / "metrics.jsonl")
    assert b[-1]["val_loss"] == pytest.approx(a[-1]["val_loss"], rel=1e-5)
    assert b[0]["train_loss"] == pytest.approx(a[0]["train_loss"], rel=1e-5)  # epoch stats were carried over
    wa, wb = _weights(full), _weights(part)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_bad_flags_and_unreadable_data(tmp_path, capsys, prepared):
    assert train_tool.main(["--model", "mid", "--out", str(tmp_path)]) == 2
    assert "--model must be early, concat, late, image, text or clip" in capsys.readouterr().err
    assert train_tool.main(["--cpu-resize", "opencv", "--out", str(tmp_path)]) == 2
    assert "--cpu-resize must be torch or dali" in capsys.readouterr().err
    assert train_tool.main(["--data", str(tmp_path / "none"), "--out", str(tmp_path / "r"), "--no-progress"]) == 2
    assert "no such prepared directory" in capsys.readouterr().err
    cfg = tmp_path / "c.yaml"
    cfg.write_text("epochs: 2\nlearning_rate: 0.1\n")
    assert train_tool.main(["--config", str(cfg)]) == 2
    assert "unknown keys ['learning_rate']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train_tool.main(["--epochs", "two"])
    assert train_tool.main(["--data", str(prepared), "--out", str(tmp_path / "r"), "--resume", str(tmp_path)]) == 2
    assert "not an intact mmfast checkpoint" in capsys.readouterr().err
    argv = ["--data", str(prepared), "--out", str(tmp_path / "r"), "--resume", str(tmp_path / "r" / "step-9")]
    assert train_tool.main(argv) == 2  # a path that is not there, in a run with no checkpoint
    assert "step-9: no such checkpoint; " in (err := capsys.readouterr().err) and "has no checkpoint yet" in err
    assert train_tool.main(
        ["--data", str(prepared), "--mixed-precision", "fp16", "--out", str(tmp_path / "h")]
    ) == (0 if torch.cuda.is_available() else 2)
    m = tmp_path / "m.jsonl"
    m.write_bytes(b"\xff\xfe garbage\n")
    assert train_tool.main(["--data", str(m), "--out", str(tmp_path / "r2"), "--no-progress"]) == 2
    assert "no usable rows" in capsys.readouterr().err


def test_config_file_values_and_flag_precedence(tmp_path):
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"epochs": 3, "lr": 0.5, "grad-accum": 2}))
    cfg = parse_config(["--config", str(f), "--lr", "0.1"])
    assert (cfg.epochs, cfg.lr, cfg.grad_accum) == (3, 0.1, 2)


def test_unconnected_launch_is_refused():
    check_process_group(2, "2")
    check_process_group(1, None)
    with pytest.raises(LaunchError, match="did not form one process group"):
        check_process_group(1, "2")


@pytest.mark.slow
def test_two_process_cpu_launch_shards_and_agrees(prepared, tmp_path):
    out = tmp_path / "ddp"
    torchrun = ("-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()))
    cmd = train_cmd(prepared, out, "--epochs", "2", "--record-ids", launcher=torchrun)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r0, r1 = _seen(out, 0), _seen(out, 1)
    n_train = n_rows(prepared, "train")
    steps = n_train // 32  # an epoch's steps: global batch 2 x 16, the last partial one dropped
    assert len(r0) == len(r1) == 2 * steps  # the same number of steps on both ranks
    for epoch in (0, 1):
        a = [i for r in r0 if r["epoch"] == epoch for i in r["ids"]]
        b = [i for r in r1 if r["epoch"] == epoch for i in r["ids"]]
        # disjoint shards covering all whole global batches (train drops the last partial one)
        seen = set(a) | set(b)
        assert not set(a) & set(b) and len(seen) == steps * 32 and seen <= set(range(n_train))
    assert (out / "weights.rank0.sha256").read_text() == (out / "weights.rank1.sha256").read_text()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_processes"] == 2 and summary["global_step"] == 2 * steps
    metrics = _jsonl(out / "metrics.jsonl")
    assert len(metrics) == 2  # only rank 0 writes run files: one line per epoch, not one per process
    assert metrics[-1]["val_samples"] == n_rows(prepared, "val")  # gathered from both ranks, padding excluded
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [f"step-{s:08d}" for s in (steps, 2 * steps)]


def _wait_for_steps(seen: Path, steps: int, timeout_s: float = 300) -> None:
    """Until a run's --record-ids file holds ``steps`` steps (or ``timeout_s`` passes): the moment to stop it."""
    deadline = time.time() + timeout_s
    while time.time() < deadline and (not seen.exists() or len(seen.read_text().splitlines()) < steps):
        time.sleep(0.05)


@pytest.mark.slow
def test_sigterm_writes_a_checkpoint_and_resume_continues_exactly(prepared, tmp_path):
    out = tmp_path / "run"
    base = train_cmd(prepared, out, "--epochs", "2", "--record-ids", "--mixed-precision", "no")
    proc = subprocess.Popen(base, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_steps(out / "seen_ids.rank0.jsonl", 4)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err[-2000:]
    (ckpt,) = [p for p in (out / "checkpoints").iterdir()]
    state = json.loads((ckpt / "trainer_state.json").read_text())
    done = len(_seen(out))
    steps = n_rows(prepared, "train") // 16  # an epoch (batch 16)
    assert state["global_step"] == done and 4 <= done < steps
    resumed = subprocess.run([*base, "--resume", "latest"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    rows = _seen(out)
    for epoch in (0, 1):
        ids = [i for r in rows if r["epoch"] == epoch for i in r["ids"]]
        assert len(ids) == len(set(ids)) == steps * 16  # nothing lost, nothing repeated
    assert json.loads((out / "summary.json").read_text())["global_step"] == 2 * steps


@pytest.mark.slow
def test_sigint_to_torchrun_checkpoints_both_processes_and_says_interrupted_once(prepared, tmp_path):
    """A SIGINT to the launcher: both processes stop at one step and write one checkpoint; "interrupted" is said
    once, not once a process (torchrun's own traceback and status 1 are its own, as the distributed guide says)."""
    out = tmp_path / "run"
    torchrun = ("-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()))
    cmd = train_cmd(prepared, out, "--epochs", "2", "--record-ids", launcher=torchrun)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_steps(out / "seen_ids.rank1.jsonl", 2)
    proc.send_signal(signal.SIGINT)
    said, err = proc.communicate(timeout=300)
    assert [ln.strip() for ln in (said + err).splitlines()].count("interrupted") == 1, err[-3000:]
    (ckpt,) = [p for p in (out / "checkpoints").iterdir()]
    assert json.loads((ckpt / "trainer_state.json").read_text())["global_step"] >= 2


def test_training_without_a_val_split(demo_manifest, tmp_path, capsys):
    from mmfast.prepare.core import PrepareConfig, prepare_dataset

    data = tmp_path / "p"
    prepare_dataset(PrepareConfig(source=str(demo_manifest), out=str(data), val_fraction=0.0, progress=False))
    assert train_tool.main(["--data", str(data), "--out", str(tmp_path / "r"), *FAST]) == 0
    assert "no val split" in capsys.readouterr().out
    (m,) = _jsonl(tmp_path / "r" / "metrics.jsonl")
    assert "val_acc" not in m and m["step"] == 300 // 32


@pytest.mark.gpu
def test_gpu_training_end_to_end_in_fp16(prepared, tmp_path):
    out = tmp_path / "run"
    assert (
        train_tool.main(
            [
                "--data",
                str(prepared),
                "--out",
                str(out),
                "--epochs",
                "2",
                "--batch-size",
                "32",
                "--channels-last",
                "--no-progress",
            ]
        )
        == 0
    )
    summary = json.loads((out / "summary.json").read_text())
    assert summary["device"].startswith("cuda") and summary["mixed_precision"] == "fp16"
    metrics = _jsonl(out / "metrics.jsonl")
    assert len(metrics) == 2 and all(m["train_loss"] == m["train_loss"] for m in metrics)


def test_pretrained_text_model_needs_its_own_tokenizer(prepared, demo_manifest, tmp_path, capsys, minilm_dir):
    # the demo set was tokenized with its own small WordPiece vocabulary: refuse MiniLM on it
    assert (
        train_tool.main(["--data", str(prepared), "--out", str(tmp_path / "a"), "--text-model", "minilm", *FAST])
        == 2
    )
    assert "prepare it with --tokenizer minilm (mmfast-prepare SOURCE --out DIR --tokenizer minilm)" in (
        capsys.readouterr().err
    )
    # a raw manifest is prepared on the fly with the model's own tokenizer, so this trains
    assert (
        train_tool.main(
            [
                "--data",
                str(demo_manifest),
                "--out",
                str(tmp_path / "b"),
                "--text-model",
                "minilm",
                "--max-steps",
                "2",
                *FAST,
            ]
        )
        == 0
    )
    prep = json.loads((tmp_path / "b" / "prepared" / "prepare.json").read_text())
    assert prep["tokenizer"] == minilm_dir and prep["vocab_size"] == 30522
    # what the message says works: prepared with --tokenizer minilm (the --text-model name), it trains
    assert prepare_tool.main([str(demo_manifest), "--out", str(tmp_path / "m"), "--tokenizer", "minilm"]) == 0
    flags = ["--out", str(tmp_path / "c"), "--text-model", "minilm", "--max-steps", "2", *FAST]
    tracked = ["--encoder-lr", "1e-5", "--warmup-frac", "0", "--report-to", "tensorboard", "--log-every", "1"]
    assert train_tool.main(["--data", str(tmp_path / "m"), *flags, *tracked]) == 0
    if importlib.util.find_spec("tensorboard"):  # the pretrained encoder's own lr is logged beside the heads'
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(tmp_path / "c" / "mmfast"))
        events.Reload()
        heads, encoder = (events.Scalars(f"train/{t}")[0].value for t in ("lr", "lr_encoder"))
        lr = json.loads((tmp_path / "c" / "config.json").read_text())["lr"]
        assert encoder / heads == pytest.approx(1e-5 / lr, rel=1e-3) and 0 < encoder < heads  # one schedule


def test_eval_every_evaluates_every_nth_epoch_and_the_last(prepared, tmp_path, monkeypatch):
    from mmfast.tasks import classification

    accs = iter([0.6, 0.4])
    real, calls = classification.evaluate, []

    def scripted(*args, **kwargs):  # the real evaluation, with the accuracy of a run that peaks at epoch 1
        calls.append(1)
        return {**real(*args, **kwargs), "val_acc": next(accs)}

    monkeypatch.setattr(classification, "evaluate", scripted)
    out = tmp_path / "run"
    flags = ["--epochs", "3", "--eval-every", "2", *FAST[2:]]
    assert train_tool.main(["--data", str(prepared), "--out", str(out), *flags]) == 0
    rows = _jsonl(out / "metrics.jsonl")
    assert [("val_acc" in m) for m in rows] == [False, True, True] and len(calls) == 2  # epochs 1 and the last
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["val_acc"], summary["best_val_acc"], summary["best_epoch"]) == (0.4, 0.6, 1)
    # --max-steps ending the run inside the first epoch: that epoch is the last, so it is evaluated
    accs, out = iter([0.5]), tmp_path / "short"
    flags = ["--epochs", "3", "--eval-every", "5", "--max-steps", "4", *FAST[2:]]
    assert train_tool.main(["--data", str(prepared), "--out", str(out), *flags]) == 0
    (row,) = _jsonl(out / "metrics.jsonl")
    assert row["step"] == 4 and row["val_acc"] == 0.5 and len(calls) == 3
    # an evaluation at 0.0 still replaces the epoch that was not evaluated as the best
    accs, out = iter([0.0, 0.0]), tmp_path / "zero"
    flags = ["--epochs", "3", "--eval-every", "2", *FAST[2:]]
    assert train_tool.main(["--data", str(prepared), "--out", str(out), *flags]) == 0
    assert json.loads((out / "summary.json").read_text())["best_epoch"] == 1
    with pytest.raises(ValueError, match="--eval-every must be >= 1, got 0"):
        parse_config(["--data", str(prepared), "--eval-every", "0"])


def test_a_run_stopped_before_its_first_evaluation_reports_no_best_figures(prepared, tmp_path, monkeypatch):
    """Stopped (as by SIGTERM) in epoch 1 of an --eval-every 2 run: epoch 0 holds the best place, but nothing
    was evaluated, so summary.json's best figures are None, not 0.0."""
    from mmfast.train.engine import EpochRunner

    def stop_in_epoch_1(self) -> bool:  # two steps into the second epoch (one optimizer step a batch)
        return self.state["global_step"] >= len(self.loader) + 2

    monkeypatch.setattr(EpochRunner, "stop_requested", stop_in_epoch_1)
    out = tmp_path / "run"
    flags = ["--epochs", "3", "--eval-every", "2", *FAST[2:]]
    assert train_tool.main(["--data", str(prepared), "--out", str(out), *flags]) == 130
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] and summary["best_epoch"] == 0
    assert (summary["val_acc"], summary["best_val_acc"], summary["best_val_macro_f1"]) == (None, None, None)


def test_a_stop_signal_on_the_last_step_writes_the_checkpoint_it_names(prepared, tmp_path, monkeypatch, capsys):
    """SIGTERM arriving on the step --max-steps ends an epoch at: the run stops before fit()'s evaluation and
    checkpoint, so the step's own checkpoint is written where the signal was taken, as the message says."""
    from mmfast.train.engine import EpochRunner

    def stop_at_step_3(self) -> bool:
        return self.state["global_step"] >= 3

    monkeypatch.setattr(EpochRunner, "stop_requested", stop_at_step_3)
    out = tmp_path / "run"
    flags = ["--data", str(prepared), "--out", str(out), *FAST[2:], "--max-steps", "3"]
    assert train_tool.main(flags) == 130
    assert "stop signal: checkpoint written at step 3" in capsys.readouterr().out
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-00000003"]
    monkeypatch.undo()
    assert train_tool.main([*flags, "--resume", "latest"]) == 0  # nothing left to train: it ends
    assert "step-00000003 (epoch 0, step 3)" in capsys.readouterr().out


def test_best_checkpoint_is_kept_and_summary_names_best_and_last(prepared, tmp_path, monkeypatch):
    from mmfast.tasks import classification

    accs = iter([0.5, 0.9, 0.7])
    real = classification.evaluate

    def scripted(*args, **kwargs):  # the real evaluation, with the accuracy of a run that peaks at epoch 1
        return {**real(*args, **kwargs), "val_acc": next(accs)}

    monkeypatch.setattr(classification, "evaluate", scripted)
    out = tmp_path / "run"
    flags = ["--epochs", "3", "--keep-checkpoints", "1", *FAST[2:]]
    assert train_tool.main(["--data", str(prepared), "--out", str(out), *flags]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["val_acc"], summary["best_val_acc"], summary["best_epoch"]) == (0.7, 0.9, 1)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000014", "step-00000021"]
    assert summary["best_checkpoint"].endswith("step-00000014")
    m = _jsonl(out / "metrics.jsonl")[-1]
    assert 0 <= m["val_macro_f1"] <= 1 and set(m["val_per_class"]) == set(
        json.loads((prepared / "labels.json").read_text())
    )
    assert sum(c["support"] for c in m["val_per_class"].values()) == len(_jsonl(prepared / "val.jsonl"))


def test_the_image_encoders_normalization_reaches_the_loader(prepared, tmp_path, monkeypatch):
    from mmfast.train import data

    seen = []

    class Spy(data.MultimodalLoader):
        @classmethod
        def from_options(cls, dataset, split, options, **kwargs):  # the engine's one way to make its loaders
            seen.append((options.mean, options.std))
            return super().from_options(dataset, split, options, **kwargs)

    monkeypatch.setattr(data, "MultimodalLoader", Spy)
    out = tmp_path / "run"
    flags = ["--image-backbone", "efficientnet-lite0", "--freeze-image", "--max-steps", "1", *FAST[2:]]
    assert train_tool.main(["--data", str(prepared), "--out", str(out), *flags]) == 0
    assert seen and all(m == (127.5,) * 3 and s == (127.5,) * 3 for m, s in seen)  # Lite0's 0.5 / 0.5, in 0..255


def test_a_pretrained_encoder_named_by_flag_brings_its_own_learning_rate():
    """The tiny preset's recipe (lr 2e-3) is for encoders from scratch: a pretrained encoder named by flag
    (all-MiniLM by --text-model) trains at its own rate instead, and the run says so."""
    from mmfast.train.flags import parse_config
    from mmfast.train.report import encoder_lr_note
    from mmfast.train.resolve import resolve_preset

    def resolved(*argv):
        given = parse_config(list(argv))
        cfg = resolve_preset(given)
        return cfg.lr, cfg.encoder_lr, encoder_lr_note(given, cfg)

    lr, enc, note = resolved("--model", "late", "--text-model", "minilm")
    assert (lr, enc) == (2e-3, 5e-5) and "lr 5e-05" in note and "--encoder-lr" in note
    assert resolved("--image-backbone", "efficientnet-lite0")[:2] == (2e-3, 1e-4)
    assert resolved("--image-backbone", "efficientnet-lite0", "--text-model", "minilm")[1] == 5e-5  # the lower
    assert resolved() == (2e-3, 2e-3, None)  # nothing pretrained: one rate
    assert resolved("--text-model", "minilm", "--encoder-lr", "1e-4") == (2e-3, 1e-4, None)  # the user's word
    assert resolved("--preset", "minilm", "--text-model", "bert-base-uncased")[1:] == (5e-5, None)  # the recipe's


def test_a_resume_with_more_epochs_says_the_schedule_now_spans_them(prepared, tmp_path, capsys):
    """The schedule is the resumed run's: more --epochs stretch it, and the learning rate may rise again. The
    run says so once, naming both settings; a resume with the same ones says nothing of it."""
    from mmfast.train.run import _schedule_change

    flags = ["--data", str(prepared), "--out", str(tmp_path / "run"), *FAST[2:], "--max-steps", "2"]
    assert train_tool.main([*flags, "--epochs", "1"]) == 0
    capsys.readouterr()
    assert train_tool.main([*flags[:-2], "--epochs", "2", "--max-steps", "3", "--resume", "latest"]) == 0
    said = capsys.readouterr().out
    assert "the learning-rate schedule now spans 3 steps (--epochs 2, --max-steps 3; " in said, said
    assert "the checkpoint's run had --epochs 1, --max-steps 2)" in said, said
    assert _schedule_change({"epochs": 2, "max_steps": None}, {"epochs": 2, "max_steps": None}, 10) is None


def test_skipped_jsonl_keeps_what_was_listed_before_a_resume(tmp_path):
    """A resumed run's loaders start with no skipped image: skipped.jsonl still lists those skipped before the
    resume, each once, by id, with the ones found since."""
    from accelerate import Accelerator

    from mmfast.train.report import write_skipped

    acc = Accelerator(cpu=True)
    write_skipped(acc, tmp_path, [{"id": 7, "image": "/d/7.jpg", "reason": "missing file"}])
    write_skipped(acc, tmp_path, [{"id": 2, "image": "/d/2.jpg", "reason": "not an image"}])  # after a resume
    write_skipped(acc, tmp_path, [{"id": 2, "image": "/d/2.jpg", "reason": "not an image"}])  # the next epoch
    rows = [json.loads(line) for line in (tmp_path / "skipped.jsonl").read_text().splitlines()]
    assert [(r["id"], r["reason"]) for r in rows] == [(2, "not an image"), (7, "missing file")]
