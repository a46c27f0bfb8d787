"""DataLoader compatibility: what code written for a ``torch.utils.data.DataLoader`` over a torchvision
``ImageFolder`` passes and expects of ``ImageLoader``, translated once: its arguments (taken, refused with
advice, or accepted as no-ops), ImageFolder datasets and their transforms (through ``transforms``), a folder
tree (``loader_from_folder``), tuple batches (``Batch``, ``dataloader_batches``) and ``loader.dataset``
(``ImageFiles``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import NamedTuple

import numpy as np
import torch

from mmfast.data.batch import IGNORE_LABEL
from mmfast.loading.transforms import agree_with_transform, options_from_transform

# Keyword arguments of ``image_pipeline`` a loader passes through (the rest of its arguments the loader sets).
PIPELINE_OPTIONS = (
    "scale",
    "ratio",
    "flip",
    "color_jitter",
    "crop_ratio",
    "resize_mode",
    "interpolation",
    "mean",
    "std",
    "hw_decoder_load",
    "memory_padding",
    "size_hint",
)
# DataLoader arguments accepted without an effect, and why (see ImageLoader's docstring).
DATALOADER_NO_OPS = {
    "persistent_workers": "the DALI pipeline and its threads live across epochs anyway",
    "timeout": "there are no worker processes to wait for; DALI raises on a failure instead of hanging",
    "multiprocessing_context": "there are no worker processes",
    "pin_memory_device": "pinned memory is for the current CUDA device",
    "in_order": "batches always come in order",
}
# DataLoader (and ImageFolder) arguments refused, with what to do instead.
DATALOADER_REFUSED = {
    "batch_sampler": "pass batch_size=, shuffle=, drop_last= (and shard_id=/num_shards= for DDP)",
    "collate_fn": (
        "batches come collated: (images, labels), or as_dict=True for {'image', 'label', 'id', 'mask'}; "
        "apply your function to each batch in the loop"
    ),
    "worker_init_fn": (
        "there are no worker processes (DALI decodes on threads); do that set-up once, before the loop"
    ),
    "generator": "pass seed=N: epoch e's order is torch.randperm seeded by N + e, as DistributedSampler's",
    "transform": (
        "the loader's own pipeline replaces it: set size=, train=, scale=, ratio=, flip=, crop_ratio= "
        "(eval resize = size / crop_ratio), interpolation=, mean=, std= (0..255 scale); "
        "loader.torchvision_transform() shows the equivalent torchvision transform"
    ),
    "target_transform": "map the labels yourself: ImageLoader(files, [f(y) for y in labels], ...)",
}


def _sampler_advice(sampler) -> str:
    """What to pass instead of ``sampler=``, in the sampler's own values where it has them."""
    if isinstance(sampler, torch.utils.data.DistributedSampler):
        advice = (
            f"pass shard_id={sampler.rank}, num_shards={sampler.num_replicas}, shuffle={sampler.shuffle}, "
            f"seed={sampler.seed} instead of sampler=DistributedSampler(...): the loader shards and shuffles "
            "itself exactly like it. Call loader.sampler.set_epoch(epoch) where you called the sampler's (without "
            "it, each iter() moves on to the next epoch)"
        )
        if sampler.drop_last:
            advice += (
                ". DistributedSampler's drop_last=True has no equivalent: the shards are filled up with "
                "repeated samples (as with drop_last=False) and batch.mask marks them"
            )
        return advice
    if isinstance(sampler, torch.utils.data.RandomSampler):
        return "pass shuffle=True (and seed=N for a reproducible order)"
    if isinstance(sampler, torch.utils.data.SequentialSampler):
        return "pass shuffle=False"
    return (
        "select the files to read instead (ImageLoader(files, labels, ...)); shuffle=True reshuffles every "
        "epoch, shard_id=/num_shards= split the data between processes"
    )


def split_options(cls_name: str, kwargs: dict) -> tuple[dict, dict]:
    """(DataLoader no-op arguments, image_pipeline options) from the extra keyword arguments; anything else
    is an error that says what to use instead."""
    no_ops, options = {}, {}
    for key, value in kwargs.items():
        if key in PIPELINE_OPTIONS:
            options[key] = value
        elif key in DATALOADER_NO_OPS:
            no_ops[key] = value
        elif key == "sampler":
            if value is not None:
                raise ValueError(f"{cls_name} takes no sampler: {_sampler_advice(value)}")
        elif key in DATALOADER_REFUSED:
            if value is not None:
                raise ValueError(f"{cls_name} takes no {key}: {DATALOADER_REFUSED[key]}")
        else:
            raise TypeError(
                f"{cls_name}() got an unexpected keyword argument '{key}'; besides its own arguments it takes "
                f"the image options {', '.join(PIPELINE_OPTIONS)} and DataLoader's "
                f"{', '.join(DATALOADER_NO_OPS)} (no effect)"
            )
    if no_ops.get("timeout", 0) < 0:
        raise ValueError("timeout option should be non-negative")
    return no_ops, options


def read_dataset(dataset, labels) -> tuple[list[str], list[int], list, dict]:
    """(files, labels, classes, ``options_from_transform`` of its transform) of an ImageFolder /
    DatasetFolder or a Subset of one."""
    base, indices = dataset, None
    if isinstance(dataset, torch.utils.data.Subset):
        base, indices = dataset.dataset, list(dataset.indices)
    if not (hasattr(base, "samples") and hasattr(base, "classes")):
        raise TypeError(
            f"ImageLoader reads image files: pass files and labels, a torchvision ImageFolder / DatasetFolder "
            f"(or a Subset of one), or use ImageLoader.from_folder(root); got {type(dataset).__name__}. For "
            "images with captions, CaptionLoader(files, captions, tokenizer=..., transform=...) batches both, "
            "and batch.ids finds each sample's other fields (docs/guides/dropin-loader.md)"
        )
    if labels is not None:
        raise TypeError("ImageLoader(dataset, ...) takes its labels from the dataset; pass no labels")
    if getattr(base, "target_transform", None) is not None:
        raise ValueError(f"ImageLoader takes no target_transform: {DATALOADER_REFUSED['target_transform']}")
    read = getattr(base, "loader", None)
    if read is not None and getattr(read, "__name__", "") not in (
        "default_loader",
        "pil_loader",
        "accimage_loader",
    ):
        raise ValueError(
            f"the dataset reads its files with {read!r}; ImageLoader decodes them itself (as RGB) and cannot "
            "reproduce another loader"
        )
    if getattr(base, "transform", None) is None:
        raise ValueError(
            "the dataset has no transform (a DataLoader could not batch its PIL images); give it one, or use "
            "ImageLoader.from_folder(root, size=..., train=...)"
        )
    samples = base.samples if indices is None else [base.samples[i] for i in indices]
    files, targets = [str(path) for path, _ in samples], [int(t) for _, t in samples]
    return files, targets, list(base.classes), options_from_transform(base.transform)


class _ImagesLabels(NamedTuple):
    images: torch.Tensor  # (B, 3, S, S) normalized
    labels: torch.Tensor  # (B,) int64


class Batch(_ImagesLabels):
    """An ``ImageLoader`` batch: ``(images, labels)``, what a DataLoader over an ImageFolder yields, so
    ``images, target = batch`` works; plus two attributes that tuple unpacking leaves out:

    ``ids``: (B,) int64 sample ids (-1 for a skipped, undecodable image).
    ``mask``: (B,) bool, True for the samples to count: False for the repeated samples that fill up the
    shards when ``num_shards`` does not divide the dataset (DistributedSampler repeats the first samples of
    the order the same way: at most one per process, at its end) and for skipped images (label -100).
    Summed over all processes it counts every sample once.
    """

    @classmethod
    def of(cls, images, labels, ids, mask) -> Batch:
        batch = cls(images, labels)
        batch.ids, batch.mask = ids, mask
        return batch

    def __getattr__(self, name: str):  # only reached when the attribute is missing
        if name in ("ids", "mask"):
            raise AttributeError(
                f"this batch was rebuilt from its two items (by a device-transfer helper?) and lost '{name}': "
                "read it before, or create the loader with as_dict=True"
            )
        raise AttributeError(name)


def dataloader_batches(loader, generation: int) -> Iterator[Batch | dict[str, torch.Tensor]]:
    """The rest of an ``ImageLoader``'s epoch as DataLoader code takes it: the reader's whole batches
    (``loader.raw_batches``) with DataLoader's partial last batch cut off, each sample's ``mask``, on the
    loader's device (pinned first where it pins), as ``Batch`` tuples or dicts (``as_dict``). ``generation``:
    the ``iter()`` they belong to."""
    layout, b = loader.layout, loader.batch_size
    n, per_rank = loader.sampling.epoch_size(layout), loader.sampling.samples_per_rank(layout, loader.source)
    for images, ids, pos, step in loader.raw_batches(generation):
        if per_rank - step * b < len(ids):  # DataLoader's partial last batch: cut DALI's filler off
            keep = per_rank - step * b
            images, ids, pos = images[:keep], ids[:keep], pos[:keep]
        labels = np.where(pos >= 0, loader.labels[pos], IGNORE_LABEL)
        mask = ids >= 0  # not a skipped image ...
        if loader.source.ordered_by_loader:  # ... nor a repeat that fills up a shard
            mask &= loader.shard_id + (step * b + np.arange(len(ids))) * loader.num_shards < n
        if images.dtype != loader.dtype:  # bfloat16 from a graph that emits float32
            images = images.to(loader.dtype)
        tensors = [images, torch.from_numpy(labels), torch.from_numpy(ids), torch.from_numpy(mask)]
        if loader.pins_memory:
            tensors = [t.pin_memory() for t in tensors]
        images, labels, ids, mask = (t.to(loader.device, non_blocking=True) for t in tensors)
        if loader.as_dict:
            yield {"image": images, "label": labels, "id": ids, "mask": mask}
        else:
            yield Batch.of(images, labels, ids, mask)


class ImageFiles(torch.utils.data.Dataset):
    """``loader.dataset`` of an ``ImageLoader`` built from files: what code written for a DataLoader over an
    ImageFolder reads from ``loader.dataset``.

    Attributes as ImageFolder has them: ``samples`` (and ``imgs``), ``targets``, ``classes``,
    ``class_to_idx``, ``transform``; ``len()``, and ``dataset[i]`` = (image, target) decoded with PIL through
    ``transform`` (the torchvision equivalent of the loader's pipeline), so ``Subset(loader.dataset, ...)``
    works in a plain DataLoader.
    """

    def __init__(self, files: Sequence[str], labels: Sequence[int], classes: Sequence | None, make_transform=None):
        self.samples = list(zip(files, (int(x) for x in labels), strict=True))
        self.imgs = self.samples
        self.targets = [t for _, t in self.samples]
        if classes is None:
            classes = list(range(max(self.targets, default=-1) + 1))
        self.classes = list(classes)
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}
        self.root = None
        self._transform, self._make_transform = None, make_transform

    @property
    def transform(self):
        if self._transform is None and self._make_transform is not None:
            self._transform = self._make_transform()
        return self._transform

    @transform.setter
    def transform(self, transform) -> None:
        self._transform, self._make_transform = transform, None

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        # torchvision: only for a torchvision dataset, transform or backbone
        from torchvision.datasets.folder import default_loader

        path, target = self.samples[index]
        image = default_loader(path)
        return (self.transform(image) if self.transform is not None else image), target


class DatasetArgs(NamedTuple):
    """What ``ImageLoader(dataset, ...)`` takes from a torchvision dataset, merged with the arguments given."""

    files: list[str]
    labels: list[int]
    classes: list
    batch_size: int
    size: int
    train: bool
    dtype: torch.dtype | str | None


def from_dataset(
    dataset, labels, batch_size, size, train, dtype, fp16, classes, pipeline_kwargs: dict
) -> DatasetArgs:
    """``DataLoader(dataset, ...)`` -> ``ImageLoader(dataset, ...)``: the dataset's files, labels, classes and
    transform (as loader arguments; ``pipeline_kwargs`` is updated with its image options). An argument given
    both ways must agree with the transform, except ``dtype`` (an output format: the caller's wins)."""
    if isinstance(labels, int) and not isinstance(labels, bool):  # DataLoader's positional batch_size
        if batch_size not in (64, labels):
            raise TypeError(f"batch size given twice: {labels} and batch_size={batch_size}")
        batch_size, labels = labels, None
    files, labels, folder_classes, found = read_dataset(dataset, labels)
    size = agree_with_transform("size", size, found.pop("size"))
    train = agree_with_transform("train", train, found.pop("train"))
    found_dtype = found.pop("dtype")
    dtype = found_dtype if dtype is None and fp16 is None else dtype
    pipeline_kwargs.update({k: agree_with_transform(k, pipeline_kwargs.get(k), v) for k, v in found.items()})
    return DatasetArgs(
        files, labels, folder_classes if classes is None else classes, batch_size, size, train, dtype
    )


def loader_from_folder(cls, root, is_valid_file, allow_empty: bool, kwargs: dict):
    """``cls.from_folder``: a loader over torchvision's own ``ImageFolder`` of ``root`` (its class discovery,
    extensions, order and errors), which becomes ``loader.dataset`` with the loader's transform."""
    from torchvision.datasets import ImageFolder  # torchvision: only to read a folder tree

    folder = ImageFolder(str(root), is_valid_file=is_valid_file, allow_empty=allow_empty)
    if not folder.samples:
        raise ValueError(f"{root}: no image files in its class folders")
    files, labels = zip(*folder.samples, strict=True)
    loader = cls(list(files), list(labels), classes=folder.classes, **kwargs)
    folder.transform = loader.torchvision_transform()
    loader.dataset = folder
    return loader
