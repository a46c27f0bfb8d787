"""The classification task: cross-entropy on the batch's labels, evaluation by a confusion matrix (what
processes all-reduce) and its figures (accuracy, macro-F1, per class); the best checkpoint is the one of the
highest validation accuracy."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from mmfast.data.batch import IGNORE_LABEL
from mmfast.data.dataset import PreparedDataset

# The label of a masked sample in a loader batch (a bad image, eval padding; docs/architecture.md, "Batch"):
# cross-entropy's default ignore_index. A test checks it against the loaders' own constant.


def confusion_figures(confusion: np.ndarray, class_names: list[str] | None = None) -> dict:
    """Accuracy, macro-F1 and per-class precision / recall / F1 / support.

    Args:
        confusion: (C, C) counts, rows = true class, columns = predicted class.
        class_names: C names (default: "0".."C-1").

    Returns:
        {"acc", "macro_f1", "per_class": {name: {"precision", "recall", "f1", "support"}}}. Macro-F1
        averages over the classes that occur in the split (support > 0) or are predicted: a class absent
        from both has no F1.
    """
    cm = np.asarray(confusion, dtype=np.float64)
    tp = np.diag(cm)
    support, predicted = cm.sum(1), cm.sum(0)
    precision = np.divide(tp, predicted, out=np.zeros_like(tp), where=predicted > 0)
    recall = np.divide(tp, support, out=np.zeros_like(tp), where=support > 0)
    denom = precision + recall
    f1 = np.divide(2 * precision * recall, denom, out=np.zeros_like(tp), where=denom > 0)
    present = (support > 0) | (predicted > 0)
    names = class_names or [str(i) for i in range(len(cm))]
    total = cm.sum()
    return {
        "acc": float(tp.sum() / total) if total else 0.0,
        "macro_f1": float(f1[present].mean()) if present.any() else 0.0,
        "per_class": {
            n: {"precision": float(p), "recall": float(r), "f1": float(f), "support": int(s)}
            for n, p, r, f, s in zip(names, precision, recall, f1, support, strict=True)
        },
    }


def compute_loss(logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy in fp32; masked samples (label -100: eval padding, skipped images) count for nothing."""
    return F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_LABEL, reduction=reduction)


def training_loss(out: torch.Tensor | dict, labels: torch.Tensor) -> torch.Tensor:
    """The loss of a model's training output: its logits (B, C), or a dict with the logits plus auxiliary
    per-branch logits and their weight (late fusion's branches each learn to decide alone)."""
    if not isinstance(out, dict):
        return compute_loss(out, labels)
    aux = sum(compute_loss(a, labels) for a in out["aux"])
    return compute_loss(out["logits"], labels) + out["aux_weight"] * aux


@torch.no_grad()
def evaluate(accelerator, model, loader, class_names: list[str] | None = None) -> dict:
    """Loss, accuracy, macro-F1 and per-class precision/recall over the whole split, all processes together
    (padding samples excluded)."""
    model.eval()
    c = loader.num_classes
    totals = torch.zeros(2, dtype=torch.float64, device=accelerator.device)  # loss_sum, count
    confusion = torch.zeros(c * c, dtype=torch.int64, device=accelerator.device)  # (true, predicted), flat
    for batch in loader:  # no set_epoch: the eval order is fixed, and the loader keeps its pipeline
        logits = model(batch)
        labels = batch["label"]
        keep = labels != IGNORE_LABEL
        totals[0] += compute_loss(logits[keep], labels[keep], reduction="sum")
        totals[1] += keep.sum()
        confusion += torch.bincount(labels[keep] * c + logits.argmax(1)[keep], minlength=c * c)
    model.train()
    loss_sum, count = accelerator.reduce(totals, reduction="sum").tolist()
    cm = accelerator.reduce(confusion, reduction="sum").cpu().numpy().reshape(c, c)  # note: a sync point
    figures = confusion_figures(cm, class_names)
    return {
        "val_loss": loss_sum / max(1, count),
        "val_acc": figures["acc"],
        "val_macro_f1": figures["macro_f1"],
        "val_samples": int(count),
        "val_per_class": figures["per_class"],
    }


class ClassificationTask:
    """One class per sample (``batch["label"]``), the model's output its logits (B, C); the best evaluation is
    the one of the highest ``val_acc`` (the first one when none is higher; a run without a val split keeps
    its first epoch's checkpoint as the best)."""

    best_metric = "val_acc"
    higher_is_better = True
    tracked = ("val_acc", "val_macro_f1", "val_loss")

    def __init__(self, dataset: PreparedDataset):
        if dataset.num_classes < 2:
            raise ValueError(
                f"{dataset.root} has one class ({next(iter(dataset.labels))!r}); a classifier needs two or more: "
                "prepare it with --label-column naming the column that holds the classes"
            )
        self.num_outputs = dataset.num_classes
        self.class_names = sorted(dataset.labels, key=dataset.labels.get)  # names of class ids 0..C-1

    def inputs(self, batch: dict) -> dict:
        return batch  # the models read "image", "input_ids" and "attention_mask"

    def targets(self, batch: dict) -> torch.Tensor:
        return batch["label"]  # (B,), -100 where masked

    def loss(self, output: torch.Tensor | dict, targets: torch.Tensor) -> torch.Tensor:
        return training_loss(output, targets)

    def sample_losses(self, output: torch.Tensor | dict, targets: torch.Tensor) -> torch.Tensor:
        """(B,) each sample's cross-entropy of the fused logits, without gradient (0 where masked)."""
        logits = output["logits"] if isinstance(output, dict) else output
        return compute_loss(logits.detach(), targets, reduction="none")

    def evaluate(self, accelerator, model, loader) -> dict:
        return evaluate(accelerator, model, loader, self.class_names)

    def improves(self, metrics: dict, state: dict) -> bool:
        new, best = metrics.get(self.best_metric, 0.0), state[f"best_{self.best_metric}"]
        return new > best if self.higher_is_better else new < best

    def best_figures(self, metrics: dict) -> dict:
        return {"best_val_acc": metrics.get("val_acc", 0.0), "best_val_macro_f1": metrics.get("val_macro_f1")}

    def epoch_line(self, metrics: dict) -> str:
        if "val_acc" not in metrics:
            return ""
        return (
            f" val_loss {metrics['val_loss']:.4f} val_acc {metrics['val_acc']:.4f} "
            f"macro-F1 {metrics['val_macro_f1']:.4f}"
        )

    def summary(self, last: dict, state: dict) -> dict:
        return {
            "val_acc": last.get("val_acc"),  # the last evaluation's
            "val_macro_f1": last.get("val_macro_f1"),
            "best_val_acc": state["best_val_acc"],
            "best_val_macro_f1": state.get("best_val_macro_f1"),
        }
