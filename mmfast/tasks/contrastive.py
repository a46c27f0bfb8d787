"""The contrastive task (CLIP, SigLIP): each image and its caption pulled together and every other pair of the
global batch pushed apart: all processes' samples (``global_batch.gather_features``) and a whole accumulation
window (``backward_window``: cached features). Two captions of one image, or two byte-identical captions, are
not each other's negatives; the losses themselves are ``losses``. Evaluation: retrieval recall both ways and,
with class labels, zero-shot accuracy (``retrieval``); the best checkpoint is the one of the highest mean
recall.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from mmfast.data.batch import PAD_ID
from mmfast.data.dataset import PreparedDataset
from mmfast.tasks.global_batch import all_gather_rows, cached_window_backward, gather_sizes
from mmfast.tasks.losses import contrastive_loss, create_loss
from mmfast.tasks.retrieval import (
    caption_groups,
    class_ensemble,
    class_prompts,
    known_classes,
    read_templates,
    retrieval_figures,
    zero_shot_figures,
)

PROMPT_BATCH = 256  # zero-shot prompts embedded per forward


def sample_groups(dataset: PreparedDataset) -> torch.Tensor:
    """(2, max id + 1) int64: per sample id of both splits, its image group (rows of one image file share it:
    the file's SHA-256 where the rows record one, else the original of a --max-side copy, else the path) and
    its caption group (byte-identical captions share it); -1 for an id no row has."""
    return _groups_and_variety(dataset)[0]


def _groups_and_variety(dataset: PreparedDataset) -> tuple[torch.Tensor, dict[str, tuple[int, int, int]]]:
    """``sample_groups``' table, and per split with rows its (rows, distinct images, distinct captions)."""
    images: dict[str, int] = {}
    texts: dict[str, int] = {}
    ids, groups, variety = [], [], {}
    for split in ("train", "val"):
        if dataset.split_size(split) == 0:
            continue
        start = len(groups)
        for row in dataset.iter_rows(split):
            key = row.get("sha256") or row.get("original") or row["image"]
            ids.append(row["id"])
            groups.append((images.setdefault(key, len(images)), texts.setdefault(row["text"], len(texts))))
        mine = groups[start:]
        variety[split] = (len(mine), len({g[0] for g in mine}), len({g[1] for g in mine}))
    table = np.full((2, max(ids, default=-1) + 1), -1, dtype=np.int64)
    if ids:
        table[:, np.asarray(ids)] = np.asarray(groups, dtype=np.int64).T
    return torch.from_numpy(table), variety


def check_variety(variety: dict[str, tuple[int, int, int]], root) -> None:
    """Refuse a dataset a contrastive loss cannot learn from or evaluate on. A pair is a negative only when it
    shares neither the image nor the caption, so a split whose rows all share one of them has no negative
    at all: the CLIP loss is zero and the SigLIP loss only pulls pairs together. The train split needs two
    images and two captions; a val split of two rows or more needs them to rank anything.

    Args:
        variety: per split, (rows, distinct images, distinct captions) (``_groups_and_variety``).
        root: the dataset's directory, for the message.

    Raises:
        ValueError: naming the split, what it lacks and what to do.
    """
    for split, (rows, images, captions) in variety.items():
        if split == "val" and rows < 2:
            continue
        if captions >= 2 and images >= 2:
            continue
        lacks = f"one caption for all its {rows} rows" if captions < 2 else f"one image for all its {rows} rows"
        raise ValueError(
            f"{root}: the {split} split has {lacks}, so no sample has a negative and a contrastive loss "
            f"{'cannot learn' if split == 'train' else 'cannot rank anything'}. Give each image its own caption "
            "(an image folder takes a <image>.txt caption file beside each image; without one the caption is "
            "the class name), or train a classifier on the labels (a fusion model: --model concat)"
        )


class ContrastiveTask:
    """Image-caption pairs (``batch["id"]`` says which samples share an image or a caption), the model's output
    {"image", "text", "logit_scale", "logit_bias"} (the dual encoder "clip"); trains on a dataset with labels
    or without (one class: zero-shot accuracy needs two or more). The best evaluation is the one of the highest
    ``val_mean_recall``.

    ``whole_window``: the loop hands the task each accumulation window's micro-batches together
    (``backward_window``), so every micro-batch's samples are the negatives of all the window's.

    Args:
        dataset: the prepared dataset (its rows give the image and caption groups).
        loss: "clip" or "siglip" (``--loss``: ``losses.create_loss``).
        zero_shot_templates: prompts for zero-shot evaluation (``retrieval.read_templates``; None: the default).
    """

    best_metric = "val_mean_recall"
    whole_window = True
    needs_labels = False  # a raw --data without a label column is prepared as --no-labels would (train.setup)
    config_options = ("loss", "zero_shot_templates")  # TrainConfig fields build_task passes as keywords

    def __init__(self, dataset: PreparedDataset, loss: str = "clip", zero_shot_templates: str | None = None):
        self._loss = create_loss(loss)  # ValueError for an unknown name
        self.kind = loss
        self.num_outputs = dataset.num_classes  # not read by the dual encoder (no classifier head)
        names = sorted(dataset.labels, key=dataset.labels.get)
        self.class_names = known_classes(names)
        self.templates = read_templates(zero_shot_templates) if self.class_names else None
        self.tokenizer_dir = dataset.tokenizer_dir
        # prompts are tokenized as the captions were: at most the preparation's max_length tokens
        summary = getattr(dataset, "summary", None) or {}
        self.max_length = summary.get("config", {}).get("max_length") or summary.get(
            "max_length"
        )  # None: the tokenizer's
        self.tracked = ("val_mean_recall", "val_i2t_r1", "val_t2i_r1") + (
            ("val_zero_shot_acc",) if self.class_names else ()
        )
        self._groups, variety = _groups_and_variety(dataset)  # (2, ids) on the CPU
        check_variety(variety, dataset.root)
        self._train_rows, _, self._train_captions = variety.get("train", (0, 0, 0))
        self._on_device: dict[torch.device, torch.Tensor] = {}
        self._tally: torch.Tensor | None = None  # (2,): samples with a negative, samples; since the last read

    @property
    def image_groups(self) -> torch.Tensor:
        """(max id + 1,) int64: per sample id its image group (rows of one image file share it), -1 for no row."""
        return self._groups[0]

    def groups(self, ids: torch.Tensor) -> torch.Tensor:
        """(2, B) image and caption groups of sample ids (padding: those of id 0; it never counts)."""
        if ids.device not in self._on_device:
            self._on_device[ids.device] = self._groups.to(ids.device)
        return self._on_device[ids.device][:, ids.clamp(min=0)]

    def inputs(self, batch: dict) -> dict:
        return batch  # the dual encoder reads "image", "input_ids" and "attention_mask"

    def targets(self, batch: dict) -> torch.Tensor:
        return batch["id"]  # (B,): which pairs are positives, negatives, or neither

    def loss(self, output: dict, targets: torch.Tensor) -> torch.Tensor:
        if self._tally is None or self._tally.device != targets.device:
            self._tally = torch.zeros(2, dtype=torch.int64, device=targets.device)
        return contrastive_loss(self._loss, output, targets, self.groups(targets), tally=self._tally)

    def check_step_samples(self, samples: int) -> str | None:
        """Refuse an optimizer step of fewer than two samples over all processes: its only pair is the positive,
        so the CLIP loss is zero and the SigLIP loss only pulls the pair together.

        Args:
            samples: the samples of one optimizer step, all processes and micro-batches together.

        Returns:
            A note for the user when the train split has fewer distinct captions than a step has samples (the
            model can learn at most which of them fits an image), else None.
        """
        if samples < 2:
            raise ValueError(
                f"a contrastive loss over {samples} sample per optimizer step has no negative and cannot learn: "
                "each step's batch is --batch-size x --grad-accum x processes; raise --batch-size (or "
                "--grad-accum: the window's micro-batches are one batch) to 2 or more"
            )
        if self._train_captions >= min(samples, self._train_rows):  # no caption shared, or enough for a step
            return None
        return (
            f"note: the train split's {self._train_rows} rows have {self._train_captions} distinct captions, "
            f"fewer than the {samples} samples of a step; rows that share a caption are not each other's "
            "negatives, so the model learns at most which caption fits an image (with class names as captions, "
            "--model concat trains a better classifier; give each image its own caption for a CLIP)"
        )

    def epoch_figures(self, accelerator) -> dict:
        """The share of the epoch's trained samples that had no negative in their step (over all processes: a
        collective call), and the count is started again.

        Raises:
            ValueError: no sample of the epoch had a negative (the loss taught the model nothing).
        """
        device = accelerator.device
        tally = torch.zeros(2, dtype=torch.int64, device=device) if self._tally is None else self._tally.to(device)
        with_negative, samples = (int(x) for x in accelerator.reduce(tally, reduction="sum").tolist())
        self._tally = None
        if samples == 0:
            return {}
        if with_negative == 0:
            raise ValueError(
                f"none of the epoch's {samples} samples had a negative in its step (every other pair of each "
                "step shared its image or its caption), so the contrastive loss taught the model nothing. Give "
                "the images distinct captions, or raise --batch-size / --grad-accum"
            )
        return {"no_negative_frac": round(1 - with_negative / samples, 6)}

    def backward_window(self, accelerator, model, batches: list[dict], no_sync) -> torch.Tensor:
        """Forward and backward of one accumulation window as one batch of all its samples (and every
        process's); returns the window's loss, on the device (nothing is read back). A window of one
        micro-batch is a plain forward and backward.

        Args:
            accelerator: the run's Accelerator (``device``, ``backward``).
            model: the (prepared) dual encoder.
            batches: the window's loader batches, in order.
            no_sync: a context manager factory that holds back the gradient all-reduce (DDP's ``no_sync``).
        """
        if len(batches) == 1:
            out = model(self.inputs(batches[0]))
            loss = self.loss(out, self.targets(batches[0]))
            accelerator.backward(loss)
            return loss.detach()
        ids = torch.cat([self.targets(b) for b in batches])
        inputs = [self.inputs(b) for b in batches]
        return cached_window_backward(accelerator, model, inputs, lambda out: self.loss(out, ids), no_sync)

    def evaluate(self, accelerator, model, loader) -> dict:
        """Retrieval (and zero-shot) figures of the whole split, all processes together; each sample once
        (padding and repeated ids dropped), one entry per distinct image."""
        model.eval()
        try:
            ids, labels, img, txt, zero_shot = _embed_split(model, loader)
            if ids.numel() == 0:
                return {}
            groups = self.groups(ids)
            first, text_image = caption_groups(groups[0].tolist())
            # byte-identical captions are one candidate, as they are not each other's negatives in the loss
            figures = retrieval_figures(img[first], txt, text_image.to(img.device), groups[1])
            if self.class_names:  # with a zero-shot map: its joined embeddings (models/prompt_map.py)
                class_emb = self._class_embeddings(accelerator, model, img.device)
                figures |= zero_shot_figures(zero_shot[first], labels[first], class_emb)
        finally:
            model.train()
        figures["samples"] = int(ids.numel())
        figures["images"] = len(first)
        return {f"val_{k}": v for k, v in figures.items()}

    @torch.no_grad()
    def _class_embeddings(self, accelerator, model, device: torch.device) -> torch.Tensor:
        """(C, D) prompt-ensemble embedding of each class, its prompts tokenized as the captions were; joined with
        the start text tower's where the model has a zero-shot map."""
        from mmfast.data.tokenizer import load_tokenizer  # transformers: only when a zero-shot evaluation runs

        prompts = class_prompts(self.class_names, self.templates)  # (C, T)
        flat = [p for per_class in prompts for p in per_class]
        tok = load_tokenizer(self.tokenizer_dir)
        enc = tok(flat, padding="longest", truncation=True, max_length=self.max_length, return_tensors="pt")
        net = accelerator.unwrap_model(model)
        joined = getattr(net, "prompt_map", None) is not None  # a model of another kind takes no zero_shot
        encode = functools.partial(net.encode_text, zero_shot=True) if joined else net.encode_text
        parts = []
        for s in range(0, len(flat), PROMPT_BATCH):
            ids = enc["input_ids"][s : s + PROMPT_BATCH].to(device)
            mask = enc["attention_mask"][s : s + PROMPT_BATCH].to(device)
            with accelerator.autocast():
                parts.append(encode(ids, mask).float())
        emb = torch.cat(parts).reshape(len(prompts), len(self.templates), -1)
        return class_ensemble(net, emb)

    def improves(self, metrics: dict, state: dict) -> bool:
        return metrics.get(self.best_metric, 0.0) > state["best_val_mean_recall"]

    def best_figures(self, metrics: dict) -> dict:
        return {
            "best_val_mean_recall": metrics.get("val_mean_recall", 0.0),
            "best_val_i2t_r1": metrics.get("val_i2t_r1"),
            "best_val_t2i_r1": metrics.get("val_t2i_r1"),
        }

    def epoch_line(self, metrics: dict) -> str:
        if "val_mean_recall" not in metrics:
            return ""
        line = (
            f" val mean_recall {metrics['val_mean_recall']:.2f} i2t R@1 {metrics['val_i2t_r1']:.2f} "
            f"t2i R@1 {metrics['val_t2i_r1']:.2f}"
        )
        if "val_zero_shot_acc" in metrics:
            line += f" zero-shot {metrics['val_zero_shot_acc']:.2f}"
        return line

    def summary(self, last: dict, state: dict) -> dict:
        return {
            **{k: last.get(k) for k in self.tracked},  # the last evaluation's
            "best_mean_recall": state["best_val_mean_recall"],
            "best_i2t_r1": state.get("best_val_i2t_r1"),
            "best_t2i_r1": state.get("best_val_t2i_r1"),
        }


@torch.no_grad()
def _embed_split(model, loader) -> tuple[torch.Tensor, ...]:
    """(ids, labels, image embeddings, text embeddings, zero-shot image embeddings) of every process's samples
    of the split, in id order, each id once, padding dropped. The zero-shot ones are the image embeddings
    joined with a zero-shot map's (the model's "zero_shot_image"), or the image embeddings themselves."""
    ids, labels, img, txt = [], [], [], []
    for batch in loader:  # no set_epoch: the eval order is fixed
        out = model(batch)
        ids.append(batch["id"])
        labels.append(batch["label"])
        # copies: a compiled model's next call may reuse its outputs' memory (CUDA graphs)
        img.append(torch.cat([out["image"], out.get("zero_shot_image", out["image"][:, :0])], 1).float())
        txt.append(out["text"].to(torch.float32, copy=True))
    device = next(model.parameters()).device
    # every process takes part in the gathers, one that had no batch too (with the others' widths)
    widths = (
        max(gather_sizes(int(img[0].shape[1]) if img else 0, device)),
        max(gather_sizes(int(txt[0].shape[1]) if txt else 0, device)),
    )
    meta = torch.stack([torch.cat(ids), torch.cat(labels)], 1) if ids else torch.zeros(0, 2, dtype=torch.int64)
    emb = torch.cat([torch.cat(img), torch.cat(txt)], 1) if img else torch.zeros(0, sum(widths))
    meta, emb = meta.to(device), emb.to(device)  # (N, 2) id and label, (N, 2D) image and text
    sizes = gather_sizes(meta.shape[0], device)
    meta, emb = all_gather_rows(meta, sizes), all_gather_rows(emb, sizes)
    keep = meta[:, 0] != PAD_ID
    meta, emb = meta[keep], emb[keep]
    unique, inverse = torch.unique(meta[:, 0], return_inverse=True)  # sorted ids
    first = torch.full_like(unique, meta.shape[0]).scatter_reduce_(
        0, inverse, torch.arange(meta.shape[0], device=meta.device), "amin"
    )
    meta, emb = meta[first], emb[first]
    d = widths[1]  # the model's own width; the image rows' rest: a zero-shot map's joined embedding
    img, txt, zero_shot = emb[:, :d], emb[:, widths[0] :], emb[:, d : widths[0]]
    return meta[:, 0], meta[:, 1], img, txt, zero_shot if zero_shot.shape[1] else img
