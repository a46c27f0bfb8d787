"""mmfast-profile --steps N (mmfast/train/short_profile.py): N timed optimizer steps after the warm-up, and
nothing else a run does: no evaluation, ridge pass, val loader, checkpoint, metrics, summary or model
directory."""

from __future__ import annotations

import json

import pytest

import mmfast.train.data as train_data
import mmfast.train.warm_start as warm_start
from mmfast.tasks.classification import ClassificationTask
from mmfast.tasks.contrastive import ContrastiveTask
from tests.conftest import n_rows
from tools import profile_run as profile_tool

ONLY_THE_PROFILE = {".mmfast-run", ".mmfast-run.lock", "profile.json", "profile.png"}
CLIP = ["--model", "clip", "--preset", "clip-lite0-minilm", "--image-backbone", "resnet10"]
CLIP += ["--text-model", "bert-tiny", "--embed-dim", "16"]


@pytest.fixture
def extras(monkeypatch) -> dict[str, list]:
    """What a profile must not do, counted as it happens: evaluations, ridge passes, loaders built by split."""
    seen: dict[str, list] = {"evaluations": [], "ridge": [], "splits": []}
    for task in (ClassificationTask, ContrastiveTask):
        real_eval = task.evaluate

        def evaluate(self, *args, _real=real_eval, **kwargs):
            seen["evaluations"].append(type(self).__name__)
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(task, "evaluate", evaluate)
    real_ridge, real_loader = warm_start.ridge_start, train_data.MultimodalLoader.from_options

    def ridge_start(*args, **kwargs):
        seen["ridge"].append(1)
        return real_ridge(*args, **kwargs)

    def loader(dataset, split, *args, **kwargs):
        seen["splits"].append(split)
        return real_loader(dataset, split, *args, **kwargs)

    monkeypatch.setattr(warm_start, "ridge_start", ridge_start)
    monkeypatch.setattr(train_data.MultimodalLoader, "from_options", loader)  # the engine's one way to make them
    return seen


@pytest.mark.parametrize("model", ["concat", "clip"])
def test_a_profile_of_5_steps_times_5_steps_and_writes_only_its_profile(prepared, tmp_path, capsys, extras, model):
    """--steps 5 of a classifier and of a clip preset (whose recipe starts with --init-proj ridge, here with the
    zero-shot map too): the profile counts exactly 5 optimizer steps after 5 of warm-up, across an epoch's end
    when the epoch is shorter, and the run evaluates nothing, fits no ridge map nor zero-shot map, builds no val
    loader and leaves nothing but the profile."""
    out = tmp_path / "profile"
    batch = 32 if model == "concat" else 16
    flags = ["--data", str(prepared), "--out", str(out), "--image-size", "32", "--batch-size", str(batch)]
    flags += ["--hidden", "32", "--epochs", "1"] if model == "concat" else [*CLIP, "--zero-shot-map", "kernel"]
    if model == "concat":
        assert n_rows(prepared, "train") // batch < 10  # the 10 steps cross an epoch's end
    assert profile_tool.main([*flags, "--steps", "5"]) == 0
    printed = capsys.readouterr().out
    assert {p.name for p in out.iterdir()} == ONLY_THE_PROFILE
    report = json.loads((out / "profile.json").read_text())
    assert (report["warmup"]["steps"], report["steps"], report["samples"]) == (5, 5, 5 * batch)
    assert report["phase_calls"]["optimizer"] == 5
    assert extras["evaluations"] == [] and "eval" not in report["phase_s"]
    assert extras["splits"] == ["train"]  # no val loader
    assert extras["ridge"] == []
    if model == "clip":  # the preset's ridge start is skipped, and the output says so
        assert printed.count("projections start at random") == 1  # in the report, not in the start line too
        assert any("--init-proj ridge" in note for note in report["notes"])
        assert any("--zero-shot-map kernel" in note for note in report["notes"])
        assert "zero-shot map: kernel ridge" not in printed  # the fit's line: no pass was made
    else:
        assert "notes" not in report
    assert "5 steps," in printed and "verdict:" in printed


def test_a_profile_refuses_a_resume_and_a_step_count_below_one(prepared, tmp_path, capsys):
    flags = ["--data", str(prepared), "--out", str(tmp_path / "p")]
    for extra, said in (
        (["--steps", "0"], "--steps must be >= 1"),
        (["--warmup", "-1"], "--warmup >= 0"),
        (["--resume", "latest"], "leave out --resume"),
    ):
        assert profile_tool.main([*flags, *extra]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and said in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "p").exists()
