"""The baseline mmfast is measured against: what most users run today. A torch DataLoader whose workers
decode with PIL and augment with torchvision.transforms.v2, tokenizing captions on the fly in the collate
function. Used by the benchmarks (tools/bench_*.py), never by training."""

from __future__ import annotations

import os

import torch

from mmfast.data.dataset import PreparedDataset
from mmfast.data.preprocessing import IMAGENET_MEAN, IMAGENET_STD


def pil_transform(size: int, scale: tuple[float, float] = (0.08, 1.0)):
    """Random resized crop + flip + normalize to float16 CHW: the same augmentation as mmfast's train graph."""
    from torchvision.transforms import v2

    return v2.Compose(
        [
            v2.RandomResizedCrop(size, scale=scale, antialias=True),
            v2.RandomHorizontalFlip(),
            v2.ToImage(),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize([m / 255 for m in IMAGENET_MEAN], [s / 255 for s in IMAGENET_STD]),
            v2.ToDtype(torch.float16),
        ]
    )


class PilDataset(torch.utils.data.Dataset):
    """Rows of a prepared split: (image tensor, caption, label)."""

    def __init__(self, rows: list[dict], transform):
        self.rows, self.transform = rows, transform

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int):
        from PIL import Image

        row = self.rows[i]
        with Image.open(row["image"]) as im:
            return self.transform(im.convert("RGB")), row["text"], row["label"]


def images_collate(items):
    """Stack images and labels only (the images-only baseline: no text)."""
    images, _, labels = zip(*items, strict=True)
    return {"image": torch.stack(images), "label": torch.tensor(labels)}


class TokenizingCollate:
    """Stack images and tokenize the batch's captions on the fly (padded to the longest)."""

    def __init__(self, tokenizer, max_length: int):
        self.tokenizer, self.max_length = tokenizer, max_length

    def __call__(self, items):
        images, texts, labels = zip(*items, strict=True)
        enc = self.tokenizer(
            list(texts), truncation=True, max_length=self.max_length, padding="longest", return_tensors="pt"
        )
        return {
            "image": torch.stack(images),
            "input_ids": enc["input_ids"],
            "attention_mask": enc["attention_mask"],
            "label": torch.tensor(labels),
        }


def baseline_loader(
    data_dir: str | os.PathLike,
    batch_size: int,
    size: int,
    num_workers: int | None = None,
    scale: tuple[float, float] = (0.08, 1.0),
    max_length: int = 32,
    text: bool = True,
):
    """DataLoader over a prepared train split with num_workers = cores and pin_memory on CUDA; ``text``
    tokenizes the captions in the collate function (else images and labels only)."""
    from mmfast.data.tokenizer import load_tokenizer

    dataset = PreparedDataset(data_dir, verify=False)  # the benchmark verified it once already, or needs not
    rows = dataset.rows("train")
    tok = load_tokenizer(dataset.tokenizer_dir)
    return torch.utils.data.DataLoader(
        PilDataset(rows, pil_transform(size, scale)),
        batch_size=batch_size,
        shuffle=True,
        num_workers=num_workers if num_workers is not None else (os.cpu_count() or 1),
        pin_memory=torch.cuda.is_available(),
        drop_last=True,
        persistent_workers=True,
        collate_fn=TokenizingCollate(tok, max_length) if text else images_collate,
    )
