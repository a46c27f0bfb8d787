"""--wise-ft ALPHA (mmfast/train/wise_ft.py): a run ends with ALPHA of its trained weights plus the rest of its
start's, every trained tensor; each checkpoint carries the start, so a resumed run mixes with the first start."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import tools.train as train_tool
from mmfast.train.resume_rules import resume_differences

ARGS = ["--model", "clip", "--preset", "tiny", "--init-proj", "ridge", "--embed-dim", "16", "--epochs", "2"]
ARGS += ["--batch-size", "32", "--image-size", "32", "--no-progress", "--mixed-precision", "no"]
ARGS += ["--keep-checkpoints", "10"]


def _train(prepared: Path, out: Path, *extra: str) -> Path:
    assert train_tool.main(["--data", str(prepared), "--out", str(out), *ARGS, *extra]) == 0
    return out


def _checkpoints(run: Path) -> list[Path]:
    return sorted((run / "checkpoints").iterdir())


def _last(run: Path) -> dict[str, torch.Tensor]:
    return load_file(_checkpoints(run)[-1] / "model.safetensors")


def _start(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The start a checkpoint carries: Accelerate's second registered object (the scheduler is the first)."""
    state = torch.load(checkpoint / "custom_checkpoint_1.pkl", weights_only=True)
    return state["tensors"]


def test_a_run_ends_with_its_share_of_the_trained_weights_and_the_rest_of_its_start(prepared, tmp_path, capsys):
    trained = _last(_train(prepared, tmp_path / "trained"))  # --wise-ft 1, the preset's: the trained ones alone
    mixed_run = _train(prepared, tmp_path / "mixed", "--wise-ft", "0.25")
    assert "--wise-ft 0.25: the weights are 0.25 x the trained + 0.75 x the start's" in capsys.readouterr().out
    mixed, start = _last(mixed_run), _start(_checkpoints(mixed_run)[-1])
    # the start is the weights before the first step: a run whose steps move nothing ends with them
    still = _last(_train(prepared, tmp_path / "still", "--lr", "1e-12", "--encoder-lr", "0"))
    assert {"image_proj.weight", "text_proj.weight"} <= set(start) and set(start) < set(mixed)
    for name, s in start.items():
        if not name.endswith(("running_mean", "running_var")):  # batch norm's move with every forward pass
            assert torch.allclose(s, still[name], atol=1e-8), name
        assert torch.allclose(mixed[name], 0.25 * trained[name] + 0.75 * s, atol=1e-6), name
    assert all(not torch.equal(trained[n], start[n]) for n in ("image_proj.weight", "text_proj.weight"))
    assert any(n.endswith("running_var") for n in start)  # the trained tower's statistics are mixed too
    assert all(torch.equal(mixed[n], trained[n]) for n in mixed if n not in start)  # locked or integer tensors
    # what users load is the mixed model, and the last evaluation scored it
    saved = load_file(mixed_run / "model-last" / "model.safetensors")  # keys under "model."
    model_last = {k.removeprefix("model."): v for k, v in saved.items()}
    assert {"image_proj.weight", "text_proj.weight"} <= set(model_last)
    assert all(torch.equal(model_last[n], mixed[n]) for n in start if n in model_last)
    metrics = [json.loads(x) for x in (mixed_run / "metrics.jsonl").read_text().splitlines()]
    trained_metrics = [json.loads(x) for x in (tmp_path / "trained" / "metrics.jsonl").read_text().splitlines()]
    figures = [k for k in metrics[-1] if k.startswith("val_") and "samples" not in k and "images" not in k]
    assert len(figures) >= 8
    assert [metrics[0][k] for k in figures] == [trained_metrics[0][k] for k in figures]  # not mixed yet
    assert [metrics[-1][k] for k in figures] != [trained_metrics[-1][k] for k in figures]


@pytest.mark.slow
def test_a_resumed_run_mixes_with_its_first_start(prepared, tmp_path):
    full = _train(prepared, tmp_path / "full", "--wise-ft", "0.5")
    # A run that "died" after its first epoch: its directory holds only that checkpoint.
    first = _checkpoints(full)[0]
    part = tmp_path / "part"
    (part / "checkpoints").mkdir(parents=True)
    shutil.copy(full / ".mmfast-run", part / ".mmfast-run")
    shutil.copytree(first, part / "checkpoints" / first.name)
    _train(prepared, part, "--wise-ft", "0.5", "--resume", "latest")
    a, b = _last(full), _last(part)
    assert all(torch.equal(a[k], b[k]) for k in a)  # mixed with the epoch-1 weights, they would differ
    # resumed at its end, a run is not mixed again: its model directory holds its last checkpoint's weights
    _train(prepared, full, "--wise-ft", "0.5", "--resume", "latest")
    again = {k.removeprefix("model."): v for k, v in load_file(full / "model-last" / "model.safetensors").items()}
    assert {"image_proj.weight", "text_proj.weight"} <= set(again)
    assert all(torch.equal(again[k], a[k]) for k in a if k in again)


def test_the_share_is_checked_and_an_earlier_run_resumes_as_unmixed(prepared, tmp_path, capsys):
    for bad in ("0", "1.5", "nan"):
        assert train_tool.main(["--data", str(prepared), "--out", str(tmp_path / bad), "--wise-ft", bad]) == 2
        assert "--wise-ft must be" in capsys.readouterr().err
    # a checkpoint written before --wise-ft existed ended with its trained weights: 1 resumes it, 0.5 does not
    assert resume_differences({"task": "clip"}, {"task": "clip", "wise_ft": 1.0}) == []
    assert resume_differences({"task": "clip"}, {"task": "clip", "wise_ft": 0.5}) == ["wise_ft: 1.0 -> 0.5"]
