"""Where a training change goes: a new model is one registered class, a new objective one registered task, and
the loop only calls them; ``mmfast-train --help`` lists the built-in names without importing torch or DALI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT, n_rows
from safetensors.torch import load_file
from torch import nn

from mmfast.models import BUILTIN_MODELS, build_model, register_model
from mmfast.tasks import BUILTIN_TASKS, ClassificationTask, build_task, classification, register_task
from mmfast.train import parse_config, train
from mmfast.train.config import choices, help_choices

SMALL = ["--image-size", "32", "--hidden", "32", "--no-progress"]
FORWARDS: list[bool] = []  # ToyText's forward calls: model.training of each


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln]


class ToyText(nn.Module):
    """A model from outside the package: the text encoder's pooled output through one linear layer."""

    modalities = ("text",)

    def __init__(self, image, text, num_classes: int, hidden: int = 512, dropout: float = 0.1):
        super().__init__()
        assert image is None  # it declared text only: no image encoder is built for it
        self.text = text
        self.head = nn.Linear(text.width, num_classes)

    def forward(self, batch: dict) -> torch.Tensor:
        FORWARDS.append(self.training)
        return self.head(self.text(batch["input_ids"], batch["attention_mask"]))


class SmoothedTask:
    """An objective from outside the package: label-smoothed cross-entropy, the best checkpoint the one of the
    lowest smoothed validation loss. Composition: the batch's parts come from the classification task."""

    tracked = ("val_smoothed_loss",)
    losses: list[float] = []

    def __init__(self, dataset):
        self.base = ClassificationTask(dataset)
        self.num_outputs = self.base.num_outputs

    def inputs(self, batch):
        return self.base.inputs(batch)

    def targets(self, batch):
        return self.base.targets(batch)

    def loss(self, output, targets):
        loss = F.cross_entropy(output.float(), targets, ignore_index=-100, label_smoothing=0.2)
        SmoothedTask.losses.append(loss.item())
        return loss

    @torch.no_grad()
    def evaluate(self, accelerator, model, loader) -> dict:
        model.eval()
        total, count = 0.0, 0
        for batch in loader:
            keep = batch["label"] != -100
            logits = model(batch)[keep]
            total += F.cross_entropy(logits.float(), batch["label"][keep], label_smoothing=0.2, reduction="sum")
            count += int(keep.sum())
        model.train()
        return {"val_smoothed_loss": float(total) / count, "val_samples": count}

    def improves(self, metrics: dict, state: dict) -> bool:
        best = state["best_val_smoothed_loss"]
        return best is None or metrics["val_smoothed_loss"] < best

    def best_figures(self, metrics: dict) -> dict:
        return {"best_val_smoothed_loss": metrics.get("val_smoothed_loss")}

    def epoch_line(self, metrics: dict) -> str:
        return f" smoothed {metrics['val_smoothed_loss']:.4f}" if "val_smoothed_loss" in metrics else ""

    def summary(self, last: dict, state: dict) -> dict:
        return {"val_smoothed_loss": last.get("val_smoothed_loss"), "best": state["best_val_smoothed_loss"]}


@pytest.fixture
def toy_model():
    """ToyText registered as "toy-text" for one test (other tests see the built-in registry)."""
    from mmfast.models import MODELS

    register_model("toy-text")(ToyText)
    yield "toy-text"
    del MODELS["toy-text"]


@pytest.fixture
def smoothed_task():
    """SmoothedTask registered as "smoothed" for one test."""
    from mmfast.tasks import TASKS

    register_task("smoothed")(SmoothedTask)
    yield "smoothed"
    del TASKS["smoothed"]


def test_a_model_registered_from_outside_trains_with_the_real_loop(prepared, tmp_path, toy_model):
    """--model names a class registered here; the factory builds the encoders it declares; two optimizer
    steps run, the evaluation uses it, its weights are the checkpoint's, and classification's summary and
    metrics keys are what they always were."""
    FORWARDS.clear()
    out = tmp_path / "run"
    flags = ["--data", str(prepared), "--out", str(out), "--model", "toy-text", "--max-steps", "2"]
    summary = train(parse_config([*flags, "--batch-size", "16", "--eval-batch-size", "32", *SMALL]))
    n_val = n_rows(prepared, "val")
    assert FORWARDS == [True, True] + [False] * -(-n_val // 32)  # 2 micro-batches, then the val split
    assert summary["global_step"] == 2 and summary["model"] == "toy-text" and summary["best_epoch"] == 0
    (step,) = (out / "checkpoints").iterdir()
    weights = load_file(step / "model.safetensors")
    assert weights["head.weight"].shape == (len(json.loads((prepared / "labels.json").read_text())), 128)
    assert not any(k.startswith("image") for k in weights)
    assert list(json.loads((out / "summary.json").read_text())) == [
        *("val_acc", "val_macro_f1", "best_val_acc", "best_val_macro_f1", "best_epoch", "best_checkpoint"),
        *("images_per_s", "wall_s", "device", "mixed_precision", "num_processes", "model", "preset"),
        *("image_backbone", "text_model", "global_step", "epochs_done", "skipped_steps", "skipped_samples"),
        *("interrupted", "run_dir", "hardware_choices", "images"),
    ]
    (m,) = _jsonl(out / "metrics.jsonl")
    assert list(m) == [
        *("epoch", "step", "epoch_complete", "train_loss", "images_per_s", "data_wait_frac", "phase_s"),
        *("val_loss", "val_acc", "val_macro_f1", "val_samples", "val_per_class", "eval_precision", "lr"),
        *("skipped_steps", "skipped_samples"),
    ]
    assert m["val_samples"] == n_val and summary["best_val_acc"] == m["val_acc"]


def test_a_task_registered_from_outside_owns_the_loss_the_figures_and_the_best(
    prepared, tmp_path, monkeypatch, smoothed_task
):
    """--task names a task registered here: its loss is the one trained on (classification's is never called),
    its evaluation's figures are the epoch's, its "best" (lowest, not highest) picks the kept checkpoint, and
    its summary figures are summary.json's."""

    def never(*args, **kwargs):
        raise AssertionError("the loop called the classification task's loss")

    monkeypatch.setattr(classification, "compute_loss", never)
    monkeypatch.setattr(SmoothedTask, "losses", [])
    scripted = iter([0.9, 0.5, 0.7])  # a run whose evaluation is best (lowest) at epoch 1
    real = SmoothedTask.evaluate

    def evaluate(self, *args):
        figures = real(self, *args)
        return {**figures, "real": figures["val_smoothed_loss"], "val_smoothed_loss": next(scripted)}

    monkeypatch.setattr(SmoothedTask, "evaluate", evaluate)
    out = tmp_path / "run"
    batch = n_rows(prepared, "train") // 2  # two optimizer steps an epoch
    flags = ["--data", str(prepared), "--out", str(out), "--task", "smoothed", "--epochs", "3"]
    summary = train(parse_config([*flags, "--batch-size", str(batch), "--keep-checkpoints", "1", *SMALL]))
    assert len(SmoothedTask.losses) == 6 and all(0 < x < 10 for x in SmoothedTask.losses)
    metrics = _jsonl(out / "metrics.jsonl")
    assert [m["val_smoothed_loss"] for m in metrics] == [0.9, 0.5, 0.7] and all(m["real"] > 0 for m in metrics)
    assert [m["train_loss"] for m in metrics] == pytest.approx(
        [sum(SmoothedTask.losses[i : i + 2]) / 2 for i in (0, 2, 4)]
    )
    assert not any(k.startswith(("val_acc", "val_macro")) for m in metrics for k in m)
    assert (summary["val_smoothed_loss"], summary["best"], summary["best_epoch"]) == (0.7, 0.5, 1)
    assert "val_acc" not in summary and "best_val_acc" not in summary
    assert summary["best_checkpoint"].endswith("step-00000004")
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000004", "step-00000006"]
    assert json.loads((out / "config.json").read_text())["task"] == "smoothed"


def test_the_loop_modules_only_call_the_task():
    """Nothing of classification in the loop, its set-up and its outputs: the loss, the figures and the
    batch's labels are the task's."""
    train_dir = ROOT / "mmfast" / "train"
    for name in ("engine", "run", "data", "optim", "report", "stop"):
        source = (train_dir / f"{name}.py").read_text()
        for word in ("cross_entropy", "confusion", "accuracy", "val_acc", "macro_f1", '"label"', "classification"):
            assert word not in source, (name, word)


def test_the_registries_name_a_missing_model_or_task_and_take_new_ones(toy_model, smoothed_task):
    with pytest.raises(ValueError, match="unknown model 'mid'; choose from early, concat, late, image, text, "):
        build_model("mid", 3)
    with pytest.raises(ValueError, match="unknown task 'ranking'; choose from classification, "):
        build_task("ranking", None)
    assert parse_config(["--model", "toy-text"]).model == "toy-text"  # the live registry, not --help's list
    with pytest.raises(
        ValueError, match="--model must be early, concat, late, image, text, clip or toy-text, got 'mid'"
    ):
        parse_config(["--model", "mid"])
    assert parse_config(["--task", "smoothed"]).task == "smoothed"
    with pytest.raises(ValueError, match="already registered"):
        register_model("concat")(ToyText)
    with pytest.raises(ValueError, match="declare modalities"):
        register_model("no-modalities")(nn.Linear)
    with pytest.raises(ValueError, match="already registered"):
        register_task("classification")(SmoothedTask)


def test_the_names_help_lists_are_the_registries_and_the_loaders_own():
    """--help reads torch-free lists; in a fresh interpreter (nothing registered from outside) they equal the
    live registries and the loaders' tuples."""
    code = (
        "from mmfast.models import BUILTIN_MODELS, MODELS\n"
        "from mmfast.tasks import BUILTIN_TASKS, TASKS\n"
        "print(tuple(MODELS) == BUILTIN_MODELS, tuple(TASKS) == BUILTIN_TASKS)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert res.stdout.split() == ["True", "True"], res.stderr[-2000:]
    shown, live = help_choices(), choices()
    assert shown.keys() == live.keys()
    for name in shown.keys() - {"model", "task"}:
        assert shown[name] == live[name], name
    assert (
        live["model"][: len(BUILTIN_MODELS)] == BUILTIN_MODELS
        and live["task"][: len(BUILTIN_TASKS)] == BUILTIN_TASKS
    )


@pytest.mark.parametrize(
    "command, flags",
    [("train", "['--help']"), ("profile_run", "['--help']"), ("profile_run", "['--steps', '2', '--help']")],
)
def test_train_and_profile_help_import_neither_torch_nor_dali(command, flags):
    script = (
        f"import sys\nfrom mmfast.cli import {command}\ntry:\n    {command}.main({flags})\nexcept SystemExit:\n"
        "    pass\nprint('torch' in sys.modules, any(m.startswith('nvidia.dali') for m in sys.modules))\n"
    )
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "usage:" in res.stdout and res.stdout.split()[-2:] == ["False", "False"]
