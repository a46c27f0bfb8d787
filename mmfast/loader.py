"""DALI-backed loaders: ``ImageLoader`` (a drop-in for a torch DataLoader over image files) and
``MultimodalLoader`` (a prepared split: images from DALI joined with cached tokens by sample id).

Why the loader owns the sample order instead of DALI's shuffling reader: DALI's ``random_shuffle`` is a
shuffle buffer, not a permutation, and cannot be re-seeded per epoch, sharded evenly or resumed at a
given step. Here each epoch's order is a seeded permutation cut into per-rank lists of whole batches
(padded with -1 for DALI, whose batches have a fixed size). A file reader (``random_shuffle=False``) reads
the concatenation of several epochs' lists (a "chunk"), so one DALI pipeline serves many epochs: a
pipeline per epoch would throw away its prefetched batches at every epoch end and pay a teardown
(together ~25% of a short epoch).

Two samplings share that machinery:
- ``ImageLoader`` does what ``DataLoader(dataset, sampler=DistributedSampler(dataset, num_shards, shard_id,
  shuffle, seed))`` does (one process: what ``DataLoader(shuffle=...)`` does): the order is
  ``torch.randperm`` seeded by ``seed + epoch``, a rank's list is DistributedSampler's (the first samples of
  the order repeated so that every rank gets as many), and the last batch is partial unless ``drop_last``.
  The -1 entries DALI needs are cut off the batch before it is handed out.
- ``MultimodalLoader`` (the training engine's) keeps whole batches: a numpy permutation seeded by
  (seed, epoch), each sample at most once per epoch, the last eval batch padded (id -1, label -100), and
  ``drop_last`` keeping only whole global batches.

Resume: ``state_dict()`` carries DALI's own checkpoint of the live pipeline (reader position and the
random state of every augmentation) and the chunk it belongs to, so a resumed run yields exactly the
batches, bit for bit, that the uninterrupted one would have. Without a DALI checkpoint it starts a new
chunk at the saved epoch and step: the same samples in the same order, other augmentation draws.
"""

from __future__ import annotations

import base64
import functools
import json
import logging
import math
import os
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from mmfast.dataset import PreparedDataset
from mmfast.host_finish import HostFinisher, default_threads, ragged_iterator
from mmfast.pipelines.image import EVAL_CROP_RATIO, IMAGENET_MEAN, IMAGENET_STD, READER_NAME, image_pipeline
from mmfast.token_cache import TokenCache
from mmfast.validate import DEFAULT_MAX_PIXELS

log = logging.getLogger(__name__)
PAD_ID = -1  # sample id of the padding entries that fill the last eval batch; their label is IGNORE_LABEL
IGNORE_LABEL = -100  # torch.nn.functional.cross_entropy's default ignore_index
MAX_CHUNK_EPOCHS = 16  # epochs one file-reader pipeline serves
MAX_CHUNK_ENTRIES = 1_000_000  # ... as long as its file list stays below this many entries

# Keyword arguments of ``image_pipeline`` a loader passes through (the rest of its arguments the loader sets).
PIPELINE_OPTIONS = (
    "scale",
    "ratio",
    "flip",
    "color_jitter",
    "crop_ratio",
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
        "(eval resize = size / crop_ratio), mean=, std= (0..255 scale); loader.torchvision_transform() "
        "shows the equivalent torchvision transform"
    ),
    "target_transform": "map the labels yourself: ImageLoader(files, [f(y) for y in labels], ...)",
}
_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def epoch_order(n: int, epoch: int, seed: int, shuffle: bool) -> np.ndarray:
    """Positions 0..n-1 in the order of this epoch: a permutation seeded by (seed, epoch), same on all ranks."""
    if not shuffle:
        return np.arange(n)
    return np.random.default_rng([seed, epoch]).permutation(n)


def shard_positions(
    order: np.ndarray, batch_size: int, shard_id: int, num_shards: int, drop_last: bool
) -> np.ndarray:
    """This rank's positions for one epoch; every rank gets the same count, a multiple of batch_size.

    drop_last: keep only whole global batches (each sample at most once; the tail differs every epoch).
    Otherwise every sample appears exactly once across ranks and each rank's list is padded with -1.
    """
    n = len(order)
    if drop_last:
        per_rank = (n // (num_shards * batch_size)) * batch_size
        return order[: per_rank * num_shards][shard_id::num_shards]
    mine = order[shard_id::num_shards]
    per_rank = math.ceil(math.ceil(n / num_shards) / batch_size) * batch_size
    return np.concatenate([mine, np.full(per_rank - len(mine), -1, dtype=order.dtype)])


def distributed_sampler_indices(
    n: int, epoch: int, seed: int, shuffle: bool, rank: int, num_replicas: int
) -> np.ndarray:
    """Exactly ``list(DistributedSampler(dataset_of_n, num_replicas, rank, shuffle, seed))`` after
    ``set_epoch(epoch)`` (drop_last=False): ``torch.randperm(n)`` seeded by seed + epoch (or 0..n-1), the
    first samples repeated until every rank gets ceil(n / num_replicas), rank r taking every
    num_replicas-th from r."""
    if shuffle:
        g = torch.Generator()
        g.manual_seed(seed + epoch)
        order = torch.randperm(n, generator=g).numpy()
    else:
        order = np.arange(n)
    total = math.ceil(n / num_replicas) * num_replicas
    return np.resize(order, total)[rank::num_replicas]  # np.resize repeats the order cyclically


def _resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        )
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but CUDA is not available; pass device='cpu'")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device '{device}'; use 'cpu' or 'cuda[:N]'")
    return device


def _resolve_dtype(dtype: torch.dtype | str | None, fp16: bool | None, default: torch.dtype) -> torch.dtype:
    if dtype is not None and fp16 is not None:
        raise ValueError("pass dtype= or fp16=, not both")
    if dtype is None:
        return default if fp16 is None else (torch.float16 if fp16 else torch.float32)
    resolved = _DTYPES.get(dtype) if isinstance(dtype, str) else dtype
    if resolved not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"dtype must be torch.float32, torch.float16 or torch.bfloat16, got {dtype!r}")
    return resolved


# -- what DataLoader code passes and expects: its arguments, ImageFolder datasets and their transforms, tuple
# batches, .dataset, .sampler ------------------------------------------------------------------------------
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


def _split_options(cls_name: str, kwargs: dict) -> tuple[dict, dict]:
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


_CONVERSIONS = ("ToTensor", "PILToTensor", "ToImage", "ToPureTensor", "ConvertImageDtype", "ToDtype")


def options_from_transform(transform) -> dict:
    """The ``ImageLoader`` arguments that make its pipeline do what a torchvision transform (v1 or v2) does.

    Understood: train ``RandomResizedCrop(S)`` [+ ``RandomHorizontalFlip()``] [+ ``ColorJitter(j, j, j)``];
    eval ``Resize(R)`` + ``CenterCrop(S)``; then ``ToTensor()`` (or ``PILToTensor``/``ToImage`` +
    ``ConvertImageDtype``/``ToDtype(..., scale=True)``) and ``Normalize(mean, std)``, bilinear resizing.

    Returns:
        a dict of ``train``, ``size``, ``dtype`` and the image options (scale, ratio, flip, color_jitter,
        crop_ratio, mean, std), all set.

    Raises:
        ValueError naming the first step the pipeline cannot reproduce, and what it can.
    """
    steps = list(getattr(transform, "transforms", None) or [transform])
    found: dict = {"flip": False, "color_jitter": 0.0}
    resize = crop = None
    scale_to_unit = None  # after a float conversion: True if it divided by 255 (ToTensor), False if not
    for op in steps:
        name = type(op).__name__
        if not type(op).__module__.startswith("torchvision.transforms"):
            _unsupported(op, "it is not a torchvision transform")
        if name in ("RandomResizedCrop", "Resize") and "bilinear" not in str(op.interpolation).lower():
            _unsupported(op, "only bilinear resizing is reproduced")
        if name == "RandomResizedCrop":
            found.update(train=True, size=_square(op, op.size), scale=tuple(op.scale), ratio=tuple(op.ratio))
        elif name == "RandomHorizontalFlip":
            if op.p != 0.5:
                _unsupported(op, "the pipeline flips with probability 0.5")
            found["flip"] = True
        elif name == "ColorJitter":
            ranges = [op.brightness, op.contrast, op.saturation]
            if all(r is None for r in ranges) and op.hue is None:
                continue  # ColorJitter(): nothing to do
            if op.hue not in (None, (0, 0)) or None in ranges or len({tuple(r) for r in ranges}) != 1:
                _unsupported(op, "the pipeline jitters brightness, contrast and saturation alike, not hue")
            lo, hi = ranges[0]
            if not math.isclose(1 - lo, hi - 1):
                _unsupported(op, "the jitter range must be symmetric around 1")
            found["color_jitter"] = hi - 1
        elif name == "Resize":
            size = [op.size] if isinstance(op.size, int) else list(op.size)
            if len(size) != 1 or op.max_size is not None:
                _unsupported(op, "only Resize(int) (the shorter side) is reproduced")
            resize = size[0]
        elif name == "CenterCrop":
            crop = _square(op, op.size)
        elif name in _CONVERSIONS:
            target = getattr(op, "dtype", torch.float32 if name == "ToTensor" else None)
            if isinstance(target, dict) or (target is not None and not target.is_floating_point):
                _unsupported(op, "only float conversions are reproduced")
            if target is not None:
                if scale_to_unit is None:
                    scale_to_unit = name in ("ToTensor", "ConvertImageDtype") or bool(getattr(op, "scale", False))
                found["dtype"] = target
        elif name == "Normalize":
            if scale_to_unit is None:
                _unsupported(op, "Normalize needs a float tensor: put ToTensor() before it")
            unit = 255.0 if scale_to_unit else 1.0
            found["mean"] = tuple(float(m) * unit for m in _three(op, op.mean))
            found["std"] = tuple(float(s) * unit for s in _three(op, op.std))
        else:
            _unsupported(op, "the pipeline does random-resized-crop + flip (+ color jitter) for training")
    if scale_to_unit is None:
        raise ValueError(
            "the dataset's transform never converts the image to floats; ImageLoader's images are float: add "
            "ToTensor() (or ToDtype(torch.float32, scale=True)) and Normalize if you want them"
        )
    if "mean" not in found:  # no Normalize: 0..1 values after ToTensor, 0..255 after an unscaled conversion
        found["mean"], found["std"] = (0.0,) * 3, (255.0 if scale_to_unit else 1.0,) * 3
    if found.get("train"):
        if resize is not None or crop is not None:
            raise ValueError("the dataset's transform resizes or crops after RandomResizedCrop; not reproduced")
        return found
    if resize is None or crop is None or crop > resize or found["flip"] or found["color_jitter"]:
        raise ValueError(
            "the dataset's transform is neither RandomResizedCrop(S) [+ flip, jitter] (training) nor "
            "Resize(R) + CenterCrop(S) with R >= S (evaluation): the two the pipeline reproduces"
        )
    return {**found, "train": False, "size": crop, "crop_ratio": crop / resize}


def _unsupported(op, why: str):
    raise ValueError(
        f"ImageLoader cannot reproduce {op!r} of the dataset's transform: {why}. It reproduces "
        "RandomResizedCrop(S) [+ RandomHorizontalFlip()] [+ ColorJitter(j, j, j)] or Resize(R) + CenterCrop(S), "
        "then ToTensor() and Normalize(mean, std); change the transform, or give its equivalent as "
        "ImageLoader.from_folder(root, size=..., train=..., mean=..., std=...) and accept the difference"
    )


def _square(op, size) -> int:
    size = [size] if isinstance(size, int) else list(size)
    if len(size) not in (1, 2) or (len(size) == 2 and size[0] != size[1]):
        _unsupported(op, "only square outputs are produced")
    return int(size[0])


def _three(op, values) -> list:
    values = list(values) if isinstance(values, list | tuple) else [values]
    if len(values) == 1:
        values = values * 3
    if len(values) != 3:
        _unsupported(op, "RGB images have 3 channels")
    return values


def _read_dataset(dataset, labels) -> tuple[list[str], list[int], list, dict]:
    """(files, labels, classes, ``options_from_transform`` of its transform) of an ImageFolder /
    DatasetFolder or a Subset of one."""
    base, indices = dataset, None
    if isinstance(dataset, torch.utils.data.Subset):
        base, indices = dataset.dataset, list(dataset.indices)
    if not (hasattr(base, "samples") and hasattr(base, "classes")):
        raise TypeError(
            f"ImageLoader reads image files: pass files and labels, a torchvision ImageFolder / DatasetFolder "
            f"(or a Subset of one), or use ImageLoader.from_folder(root); got {type(dataset).__name__}"
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


def _agree(name: str, given, translated):
    """An argument given both ways must say the same as the dataset's transform."""
    if given is None:
        return translated
    same = given == translated
    if isinstance(given, int | float | tuple | list) and isinstance(translated, int | float | tuple | list):
        same = np.shape(given) == np.shape(translated) and np.allclose(given, translated)
    if not same:
        raise ValueError(f"{name}={given!r}, but the dataset's transform says {translated!r}; pass one of them")
    return given


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
        from torchvision.datasets.folder import default_loader

        path, target = self.samples[index]
        image = default_loader(path)
        return (self.transform(image) if self.transform is not None else image), target


class ShardSampler:
    """``loader.sampler``: what DataLoader code expects of a (Distributed)Sampler.

    ``len()`` = samples this process yields per epoch (DistributedSampler's ``num_samples``), iteration =
    their indices into ``loader.dataset`` for the current epoch, ``set_epoch(e)`` = ``loader.set_epoch(e)``,
    and DistributedSampler's ``num_replicas``, ``rank``, ``shuffle``, ``seed``, ``epoch``.
    """

    def __init__(self, loader: ImageLoader):
        self._ref = weakref.ref(loader)  # not a reference: a cycle would keep the loader's DALI pipeline alive

    @property
    def _loader(self) -> ImageLoader:
        loader = self._ref()
        if loader is None:
            raise ReferenceError("the loader of this sampler no longer exists")
        return loader

    num_replicas = property(lambda self: self._loader.num_shards)
    rank = property(lambda self: self._loader.shard_id)
    shuffle = property(lambda self: self._loader.shuffle)
    seed = property(lambda self: self._loader.seed)
    epoch = property(lambda self: self._loader.epoch)
    drop_last = False  # DistributedSampler's: shards are always filled up (see Batch.mask)

    @property
    def num_samples(self) -> int:
        return len(self)

    @property
    def total_size(self) -> int:
        return len(self) * self._loader.num_shards

    def __len__(self) -> int:
        return self._loader._samples_per_rank()

    def __iter__(self) -> Iterator[int]:
        if self._loader.wds_shards:
            raise TypeError("the WebDataset reader shards and shuffles inside DALI: no index list to show")
        loader = self._loader
        if not loader._dataloader_sampling:
            return iter(int(p) for p in loader._positions(loader.epoch) if p >= 0)
        n, epoch = len(loader.files), loader.epoch
        return iter(
            distributed_sampler_indices(n, epoch, self.seed, self.shuffle, self.rank, self.num_replicas).tolist()
        )

    def set_epoch(self, epoch: int) -> None:
        self._loader.set_epoch(epoch)


def torchvision_equivalent(train: bool, size: int, dtype: torch.dtype, options: dict):
    """The torchvision (v2) transform doing to one PIL image what ``image_pipeline`` does with these
    ``options`` (PIPELINE_OPTIONS; mean and std in 0..255 units): train: RandomResizedCrop + flip (+ jitter);
    eval: Resize(round(size / crop_ratio)) + CenterCrop(size); then normalize, as ``dtype``."""
    from torchvision.transforms import v2

    mean = [m / 255 for m in options.get("mean", IMAGENET_MEAN)]
    std = [s / 255 for s in options.get("std", IMAGENET_STD)]
    if train:
        ops = [v2.RandomResizedCrop(size, options.get("scale", (0.08, 1.0)), options.get("ratio", (3 / 4, 4 / 3)))]
        if options.get("flip", True):
            ops.append(v2.RandomHorizontalFlip())
        jitter = options.get("color_jitter", 0.0)
        if jitter > 0:
            ops.append(v2.ColorJitter(brightness=jitter, contrast=jitter, saturation=jitter))
    else:
        ops = [v2.Resize(round(size / options.get("crop_ratio", EVAL_CROP_RATIO))), v2.CenterCrop(size)]
    ops += [v2.ToImage(), v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean, std), v2.ToDtype(dtype)]
    return v2.Compose(ops)


class _TorchvisionFinisher(HostFinisher):
    """The host finishing with torchvision's eval geometry: ``Resize(R)`` makes the longer side
    ``int(R * long / short)`` (truncated) and ``CenterCrop(S)`` starts at ``int(round((H - S) / 2))``. The
    graph's arithmetic (``HostFinisher``) rounds both, which moves half of all images by up to a pixel
    against torchvision's output (measured: 0.02-0.11 mean difference, normalized). The train path, a
    random crop resized to S x S, is the same in both."""

    def _resize(self, x: torch.Tensor) -> torch.Tensor:
        s, r = self.size, self.resize_shorter
        if r is None:
            return super()._resize(x)
        h, w = x.shape[-2:]
        size = (int(r * h / w), r) if w <= h else (r, int(r * w / h))  # torchvision's (H, W)
        if (h, w) != size:
            x = F.interpolate(x, size=size, mode="bilinear", antialias=True, align_corners=False)
        top, left = int(round((size[0] - s) / 2.0)), int(round((size[1] - s) / 2.0))
        return x[..., top : top + s, left : left + s]


class ImageLoader:
    """A drop-in for ``torch.utils.data.DataLoader`` over image files, decoded and augmented by DALI.

    Loops written for a DataLoader over a torchvision ``ImageFolder`` run unchanged: batches are
    ``(images, labels)`` tuples (``Batch``: ``images`` (B, 3, S, S) float32, ``labels`` (B,) int64), the last
    batch is partial unless ``drop_last``, ``len()``, ``.dataset`` (``classes``, ``class_to_idx``,
    ``samples``, ``targets``, ``len()``), ``.batch_size``, ``.sampler`` (``set_epoch``, ``len()``) and
    ``.drop_last`` mean what they mean there, and each ``iter()`` starts a new epoch (also after a
    ``break``). With ``shard_id``/``num_shards`` each process gets exactly the samples that
    ``DistributedSampler(dataset, num_shards, shard_id, shuffle, seed)`` gives it, in its order.

    Args:
        files: image paths, or a torchvision ``ImageFolder`` / ``DatasetFolder`` (or a ``Subset`` of one), so
            ``DataLoader(dataset, ...)`` becomes ``ImageLoader(dataset, ...)``: its files, labels and classes,
            and its transform turned into size/train/crop/normalization arguments (``options_from_transform``;
            a step the pipeline cannot reproduce is an error naming it). ``from_folder`` reads a folder tree.
        labels: one integer label per file (default: zeros); with a dataset, DataLoader's positional
            ``batch_size`` may stand here.
        ids: one unique integer sample id per file (default: 0..n-1).
        batch_size: samples per batch on this process.
        shuffle: a new order every epoch: ``torch.randperm`` seeded by ``seed + epoch``.
        drop_last: drop this process's last batch if it is incomplete (DataLoader's ``drop_last``).
        num_workers: DALI CPU threads (default and 0: all cores); no processes are started.
        pin_memory: CPU batches in pinned (page-locked) memory, so ``.cuda(non_blocking=True)`` copies
            asynchronously; no effect on batches that are on the GPU already or without CUDA.
        train: random resized crop + flip (train) or resize + center crop (eval); default: ``shuffle``.
        size: output side in pixels. Eval resizes the shorter side to ``round(size / crop_ratio)`` first
            (``crop_ratio`` 0.875: 224 -> 256, like ``Resize(256)`` + ``CenterCrop(224)``).
        dtype: torch.float32 (default), torch.float16 or torch.bfloat16 (or their names).
        device: where batches go: "cpu" or "cuda[:N]" (default: the current CUDA device, decoding there;
            else the CPU).
        seed: seed of the order and of the augmentations.
        shard_id, num_shards: this process's rank and the number of processes (DDP:
            ``torch.distributed.get_rank()`` and ``get_world_size()``); default 0 and 1.
        accelerator: take shard_id, num_shards and device from an ``accelerate.Accelerator``.
        as_dict: batches as dicts ``{"image", "label", "id", "mask"}`` instead of ``Batch`` tuples.
        classes: class names, ``classes[label]`` (default: 0..max label); ``from_folder`` sets the folders'.
        fp16: the older way to say dtype=torch.float16 (True) or torch.float32 (False).
        prefetch: DALI prefetch queue depth (default 2); ``prefetch_factor`` sets the same.
        wds_shards: read these WebDataset tars instead of ``files``, through mmfast's index files (by default
            the ``.idx`` beside each tar, as ``mmfast.wds.write_wds`` writes them); ``files``/``labels``/``ids``
            still describe the samples, and no file of ``files`` is opened. DALI then shards and shuffles (a
            shuffle buffer that runs on across epochs; ``set_epoch`` does not re-seed it), unlike
            DistributedSampler.
        wds_index: the index file of each of ``wds_shards`` (``mmfast.inputs.wds``: a prepared directory
            holds those of the user's shards).
        on_bad_image: what to do with an image that is missing or cannot be decoded: "skip" (log it, count
            it in ``skipped``, and serve a masked sample in its place: id -1, label -100, mask False, so batch
            sizes and the other samples' order stay the same on every rank) or "error" (raise, naming the
            file).
        file_stats: (size, mtime_ns) of each file when it was validated; files that differ now are decoded
            again at start-up (MultimodalLoader passes what tools/prepare_data.py recorded).
        max_pixels: decoded-pixel budget per image, checked from the header of every file that is checked
            again at start-up (one over it is a bad image): what bounds the decoder's memory.
        cpu_resize: who resizes, flips and normalizes the decoded crops when decoding on the CPU: "torch"
            (the consuming thread, ``mmfast.host_finish``; about 2x faster, and the eval path reproduces
            torchvision's Resize + CenterCrop pixels) or "dali" (in the graph). The GPU path always does it
            in DALI.
        finish_threads: threads finishing each batch on the host (``cpu_resize="torch"``), the consuming
            one included (default: ``host_finish.default_threads(num_threads)``).
        **options: ``image_pipeline`` options (scale, ratio, flip, color_jitter, crop_ratio, mean, std in
            0..255 units, hw_decoder_load, memory_padding, size_hint) and DataLoader's arguments that have
            nothing to do here, accepted without effect: persistent_workers (the pipeline lives across
            epochs anyway), timeout (no workers to wait for), multiprocessing_context, pin_memory_device,
            in_order. ``sampler``, ``batch_sampler``, ``collate_fn``, ``worker_init_fn``, ``generator`` are
            refused (unless None) with what to pass instead, and any other name is a TypeError.

    Padding under sharding: when ``num_shards`` does not divide the dataset, the first samples of the epoch's
    order are repeated to fill up the shards (at most one per process, at its end), exactly as
    DistributedSampler does (so an accuracy over all ranks equals the DataLoader version's, repeats
    included); ``batch.mask`` is False for the repeats, so
    ``(correct & mask).sum()`` and ``mask.sum()`` summed over ranks count each sample once (their total is
    ``len(loader.dataset)``).
    """

    _default_dtype = torch.float32
    _dataloader_sampling = True  # DistributedSampler's order and shards, partial last batches (see module doc)

    def __init__(
        self,
        files: Sequence[str] | torch.utils.data.Dataset,
        labels: Sequence[int] | None = None,
        *,
        ids: Sequence[int] | None = None,
        batch_size: int | None = 64,
        shuffle: bool | None = False,
        drop_last: bool = False,
        num_workers: int | None = None,
        pin_memory: bool = False,
        train: bool | None = None,
        size: int | None = None,
        dtype: torch.dtype | str | None = None,
        device: str | torch.device | None = None,
        seed: int = 0,
        shard_id: int | None = None,
        num_shards: int | None = None,
        accelerator=None,
        as_dict: bool = False,
        classes: Sequence | None = None,
        fp16: bool | None = None,
        prefetch: int | None = None,
        prefetch_factor: int | None = None,
        wds_shards: Sequence[str] | None = None,
        wds_index: Sequence[str] | None = None,
        on_bad_image: str = "skip",
        file_stats: Sequence[tuple[int, int]] | None = None,
        max_pixels: int = DEFAULT_MAX_PIXELS,
        cpu_resize: str = "torch",
        finish_threads: int | None = None,
        **options,
    ):
        self.dataloader_options, pipeline_kwargs = _split_options(type(self).__name__, options)
        folder = files if isinstance(files, torch.utils.data.Dataset) else None
        if folder is not None:  # DataLoader(dataset, ...) -> ImageLoader(dataset, ...)
            if isinstance(labels, int) and not isinstance(labels, bool):  # DataLoader's positional batch_size
                if batch_size not in (64, labels):
                    raise TypeError(f"batch size given twice: {labels} and batch_size={batch_size}")
                batch_size, labels = labels, None
            files, labels, folder_classes, found = _read_dataset(folder, labels)
            classes = folder_classes if classes is None else classes
            size, train = _agree("size", size, found.pop("size")), _agree("train", train, found.pop("train"))
            found_dtype = found.pop("dtype")  # yours wins: an output format, not what the pipeline does
            dtype = found_dtype if dtype is None and fp16 is None else dtype
            pipeline_kwargs.update({k: _agree(k, pipeline_kwargs.get(k), v) for k, v in found.items()})
        size = 224 if size is None else size
        if batch_size is None:
            raise ValueError(
                "batch_size=None (one unbatched sample at a time) is not supported; pass a batch size"
            )
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if accelerator is not None:
            shard_id = accelerator.process_index if shard_id is None else shard_id
            num_shards = accelerator.num_processes if num_shards is None else num_shards
            device = accelerator.device if device is None else device
        shard_id, num_shards = shard_id or 0, 1 if num_shards is None else num_shards
        if num_shards < 1 or not 0 <= shard_id < num_shards:
            raise ValueError(f"shard_id must be in [0, num_shards={num_shards}), got {shard_id}")
        if size < 8:
            raise ValueError(f"size must be >= 8 pixels, got {size}")
        if num_workers is not None and num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        if prefetch is not None and prefetch_factor is not None:
            raise ValueError("pass prefetch= or prefetch_factor=, not both (both set DALI's prefetch queue depth)")
        prefetch = prefetch_factor if prefetch_factor is not None else prefetch
        if prefetch is not None and prefetch < 1:
            raise ValueError(f"prefetch must be >= 1, got {prefetch}")
        self.files = [str(f) for f in files]
        n = len(self.files)
        if n == 0:
            raise ValueError("no image files given")
        self.labels = np.asarray(labels if labels is not None else np.zeros(n), dtype=np.int64)
        self.ids = np.asarray(ids if ids is not None else np.arange(n), dtype=np.int64)
        if len(self.labels) != n or len(self.ids) != n:
            raise ValueError(f"{n} files but {len(self.labels)} labels and {len(self.ids)} ids")
        if len(np.unique(self.ids)) != n or self.ids.min() < 0 or self.ids.max() > np.iinfo(np.int32).max:
            raise ValueError("ids must be unique, non-negative int32 values")
        self._id_sorter = np.argsort(self.ids)
        self.batch_size = batch_size
        self.shuffle = bool(shuffle)
        self.drop_last = drop_last
        self.train = self.shuffle if train is None else train
        self.size = size
        self.device = _resolve_device(device)
        self.dtype = _resolve_dtype(dtype, fp16, self._default_dtype)
        self.fp16 = self.dtype == torch.float16
        self.num_threads = num_workers or os.cpu_count() or 1
        self.num_workers = num_workers or 0  # DataLoader's attribute, as given
        self.pin_memory = pin_memory
        # Pinning needs CUDA; DataLoader ignores the flag without it, and so does this loader.
        self._pin = bool(pin_memory) and self.device.type == "cpu" and torch.cuda.is_available()
        self.as_dict = as_dict
        self.seed = seed
        self.shard_id, self.num_shards = shard_id, num_shards
        self.prefetch = 2 if prefetch is None else prefetch
        self.prefetch_factor = self.prefetch
        self.pipeline_kwargs = pipeline_kwargs
        if cpu_resize not in ("torch", "dali"):
            raise ValueError(f"cpu_resize must be 'torch' or 'dali', got '{cpu_resize}'")
        self._finisher = None
        if self.device.type != "cuda" and cpu_resize == "torch":
            mean, std = pipeline_kwargs.get("mean", IMAGENET_MEAN), pipeline_kwargs.get("std", IMAGENET_STD)
            shorter = None if self.train else self._eval_resize()
            finisher = _TorchvisionFinisher if self._dataloader_sampling else HostFinisher
            threads = default_threads(self.num_threads) if finish_threads is None else finish_threads
            self._finisher = finisher(size, mean, std, self.fp16, resize_shorter=shorter, threads=threads)
            self._finisher.dtype = self.dtype  # it allocates its output in this dtype (bfloat16 too)
        if on_bad_image not in ("skip", "error"):
            raise ValueError(f"on_bad_image must be 'skip' or 'error', got '{on_bad_image}'")
        self.on_bad_image = on_bad_image
        self.bad: dict[int, str] = {}  # position in files -> why it is skipped
        self.max_pixels = max_pixels
        self.wds_shards = [str(p) for p in wds_shards] if wds_shards else None
        self.wds_index = (
            [str(p) for p in wds_index]
            if wds_index
            else [str(Path(p).with_suffix(".idx")) for p in self.wds_shards or []]
        )
        for tar, idx in zip(self.wds_shards or [], self.wds_index, strict=True):
            if not Path(tar).is_file() or not Path(idx).is_file():
                raise FileNotFoundError(
                    f"{tar}: WebDataset shard or its index {idx} missing; re-run tools/prepare_data.py"
                )
        if not self.wds_shards:  # files are stat'ed; a shard's samples were checked when it was prepared
            self._check_files(file_stats)
        if drop_last and n < batch_size * num_shards:
            raise ValueError(
                f"{n} samples cannot fill one batch of {batch_size} on each of {num_shards} processes "
                "with drop_last=True; lower the batch size"
            )
        # its transform is made when first used: importing torchvision's transforms takes seconds
        make_transform = functools.partial(torchvision_equivalent, self.train, size, self.dtype, pipeline_kwargs)
        self.dataset = ImageFiles(self.files, self.labels, classes, make_transform) if folder is None else folder
        self.classes = list(classes) if classes is not None else self.dataset.classes
        self.epoch = 0
        self.step = 0  # batches of the current epoch already delivered
        self._stream: _Stream | None = None  # the live DALI iterator and the position of its next batch
        self._restore: tuple | None = None  # (epoch, step, chunk, DALI checkpoint) set by load_state_dict
        self._keep_position = False  # a restored position the next iter() continues from
        self._generation = 0  # bumped by each iter(): an older, abandoned iterator stops
        self._sampler: ShardSampler | None = None

    @classmethod
    def from_folder(
        cls, root: str | os.PathLike, *, is_valid_file=None, allow_empty: bool = False, **kwargs
    ) -> ImageLoader:
        """Loader over an ImageFolder tree ``root/<class>/**/<image>``, found by torchvision's own
        ``ImageFolder`` (its class discovery, extensions, order and errors), which becomes ``loader.dataset``.

        Args:
            root: the folder.
            is_valid_file, allow_empty: as ImageFolder takes them.
            **kwargs: ``ImageLoader``'s arguments.
        """
        from torchvision.datasets import ImageFolder

        folder = ImageFolder(str(root), is_valid_file=is_valid_file, allow_empty=allow_empty)
        if not folder.samples:
            raise ValueError(f"{root}: no image files in its class folders")
        files, labels = zip(*folder.samples, strict=True)
        loader = cls(list(files), list(labels), classes=folder.classes, **kwargs)
        folder.transform = loader.torchvision_transform()
        loader.dataset = folder
        return loader

    def torchvision_transform(self):
        """The torchvision transform that does what this loader's pipeline does to one image (PIL image in,
        normalized (3, S, S) tensor of ``dtype`` out). The CPU eval path reproduces its pixels (up to rare
        rounding of one 8-bit level); the train path draws its own random crops and flips."""
        return torchvision_equivalent(self.train, self.size, self.dtype, self.pipeline_kwargs)

    def _eval_resize(self) -> int:
        """Eval: the shorter side before the centre crop."""
        return round(self.size / self.pipeline_kwargs.get("crop_ratio", EVAL_CROP_RATIO))

    @property
    def sampler(self) -> ShardSampler:
        """This process's share of each epoch, as DataLoader code reads it (``len``, ``set_epoch``)."""
        if self._sampler is None:
            self._sampler = ShardSampler(self)
        return self._sampler

    @property
    def batch_sampler(self) -> torch.utils.data.BatchSampler:
        """DataLoader's ``batch_sampler``: ``sampler`` cut into this loader's batches (code that inspects a
        loader, like Lightning's, reads it)."""
        return torch.utils.data.BatchSampler(self.sampler, self.batch_size, self.drop_last)

    # -- the epoch protocol ------------------------------------------------------------------------------
    def __len__(self) -> int:
        """Batches per epoch on this process (the same on every process)."""
        if self.wds_shards:
            per_shard = math.ceil(len(self.files) / self.num_shards)  # DALI pads every shard to the largest
            return per_shard // self.batch_size if self.drop_last else math.ceil(per_shard / self.batch_size)
        if self._dataloader_sampling:
            per_rank = math.ceil(len(self.files) / self.num_shards)
            return per_rank // self.batch_size if self.drop_last else math.ceil(per_rank / self.batch_size)
        return len(self._positions(0)) // self.batch_size

    def _samples_per_rank(self) -> int:
        """This process's share of an epoch: DistributedSampler's ``num_samples`` (with ``drop_last`` the
        loader delivers the whole batches of it); MultimodalLoader: its whole batches."""
        if self._dataloader_sampling or (self.wds_shards and not self.drop_last):
            return math.ceil(len(self.files) / self.num_shards)
        return len(self) * self.batch_size

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order the next ``iter()`` uses (``loader.sampler.set_epoch`` does the same).

        Setting the epoch the loader is already at keeps a position restored by ``load_state_dict`` (so a
        mid-epoch resume survives the usual ``set_epoch`` call at the top of the loop); otherwise the next
        ``iter()`` starts that epoch from its first batch.
        """
        if not self._dataloader_sampling:  # MultimodalLoader: keep whatever position the epoch is at
            if epoch != self.epoch:
                self.epoch, self.step = epoch, 0
            return
        if epoch != self.epoch or not self._keep_position:
            self.epoch, self.step, self._keep_position = epoch, 0, False

    def state_dict(self) -> dict:
        """Position for an exact resume: the epoch, the batches of it already delivered, and DALI's
        checkpoint of the pipeline that will deliver the next one."""
        chunk, ck = None, None
        stream = self._stream
        if stream is not None and stream.at(self.epoch, self.step):
            chunk, ck = stream.chunk, stream.it.checkpoints()[0]  # its state after the last batch returned
        elif self._restore is not None and self._restore[:2] == (self.epoch, self.step):
            chunk, ck = self._restore[2:]
        if isinstance(ck, bytes | bytearray):  # kept as text so the state is JSON-serializable
            ck = "b64:" + base64.b64encode(ck).decode("ascii")
        return {
            "epoch": self.epoch,
            "step": self.step,
            "seed": self.seed,
            "num_samples": len(self.files),
            "num_shards": self.num_shards,
            "shard_id": self.shard_id,
            "batch_size": self.batch_size,
            "chunk": chunk,
            "dali_checkpoint": ck,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore a position from ``state_dict()`` (same data, seed, batch size and process count); the
        next ``iter()`` continues from it."""
        for key, mine in (
            ("seed", self.seed),
            ("num_samples", len(self.files)),
            ("num_shards", self.num_shards),
            ("batch_size", self.batch_size),
        ):
            if state[key] != mine:
                raise ValueError(f"cannot resume loader: {key} was {state[key]}, now {mine}")
        self.epoch, self.step = int(state["epoch"]), int(state["step"])
        self._stream, self._restore, self._keep_position = None, None, True
        ck = state.get("dali_checkpoint")
        if ck and state.get("chunk") is not None and state.get("shard_id", self.shard_id) == self.shard_id:
            if isinstance(ck, str) and ck.startswith("b64:"):
                ck = base64.b64decode(ck[4:])
            self._restore = (self.epoch, self.step, state["chunk"], ck)

    def _positions(self, epoch: int) -> np.ndarray:
        """Positions in ``files`` that this process reads in ``epoch``, -1 filling up the last DALI batch."""
        n = len(self.files)
        if not self._dataloader_sampling:
            order = epoch_order(n, epoch, self.seed, self.shuffle)
            return shard_positions(order, self.batch_size, self.shard_id, self.num_shards, self.drop_last)
        mine = distributed_sampler_indices(n, epoch, self.seed, self.shuffle, self.shard_id, self.num_shards)
        whole = len(self) * self.batch_size
        return np.concatenate([mine[:whole], np.full(max(0, whole - len(mine)), -1, dtype=mine.dtype)])

    def _chunk_epochs(self) -> int:
        """Epochs per file-reader pipeline: many for small datasets, fewer when the list gets long."""
        return max(1, min(MAX_CHUNK_EPOCHS, MAX_CHUNK_ENTRIES // max(1, len(self) * self.batch_size)))

    def _open_stream(self, epoch: int, step: int) -> _Stream:
        """A DALI iterator whose next batch is batch ``step`` of ``epoch``."""
        restore = self._restore if self._restore is not None and self._restore[:2] == (epoch, step) else None
        self._restore = None
        if self.wds_shards:
            if restore is not None:
                return _Stream(self._build_iterator(None, 0, restore[3]), {"wds": True}, epoch, step)
            stream = _Stream(self._build_iterator(None, 0), {"wds": True}, epoch, 0)
            for _ in range(step):  # no checkpoint: re-read and drop what was already delivered
                next(stream.it)
            stream.step = step
            return stream
        chunk = (
            restore[2] if restore is not None else {"start": epoch, "offset": step, "epochs": self._chunk_epochs()}
        )
        parts = [self._positions(chunk["start"] + k) for k in range(chunk["epochs"])]
        parts[0] = parts[0][chunk["offset"] * self.batch_size :]
        it = self._build_iterator(np.concatenate(parts), chunk["start"], restore[3] if restore else None)
        return _Stream(it, chunk, epoch, step)

    def _build_iterator(self, positions: np.ndarray | None, seed_epoch: int, checkpoint: bytes | None = None):
        from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

        pipe = self._pipeline(positions, seed_epoch, checkpoint)
        if self.wds_shards:
            policy = LastBatchPolicy.DROP if self.drop_last else LastBatchPolicy.PARTIAL
        else:
            policy = LastBatchPolicy.DROP  # never used: the lists are whole batches
        kwargs = {
            "reader_name": READER_NAME,
            "auto_reset": False,
            "last_batch_policy": policy,
            "prepare_first_batch": False,
        }
        if self._finisher is not None:  # ragged crops, finished on the host in _batches
            return ragged_iterator(pipe, **kwargs)
        return DALIGenericIterator(pipe, ["image", "id"], **kwargs)

    def _pipeline(self, positions: np.ndarray | None, seed_epoch: int, checkpoint: bytes | None = None):
        """The DALI graph reading ``positions`` (None: the WebDataset shards), defined but not built.

        Defining checks every operator's argument names without touching CUDA, so tests define the GPU
        ("mixed") graph on machines without a GPU.
        """
        if self.wds_shards:
            source = {
                "source": "wds",
                "wds_paths": self.wds_shards,
                "wds_index_paths": self.wds_index,
                "wds_shard_id": self.shard_id,
                "wds_num_shards": self.num_shards,
                "wds_shuffle": self.shuffle,
            }
        else:
            pad_file = self._pad_file()
            source = {
                "source": "files",
                "files": [self.files[p] if p >= 0 and p not in self.bad else pad_file for p in positions],
                "ids": [int(self.ids[p]) if p >= 0 and p not in self.bad else PAD_ID for p in positions],
            }
        cuda = self.device.type == "cuda"
        return image_pipeline(
            **source,
            train=self.train,
            size=self.size,
            decode_device="mixed" if cuda else "cpu",
            fp16=self.fp16,  # bfloat16: the graph emits float32, converted in __iter__
            finish_on_host=self._finisher is not None,
            **self.pipeline_kwargs,
            batch_size=self.batch_size,
            num_threads=self.num_threads,
            device_id=self.device.index if cuda else None,
            seed=int(np.random.default_rng([self.seed, seed_epoch, self.shard_id]).integers(2**31)),
            prefetch_queue_depth=self.prefetch,
            enable_checkpointing=True,
            checkpoint=checkpoint,
        )

    @property
    def skipped(self) -> list[dict]:
        """The samples served masked because their image is missing or undecodable."""
        return [{"id": int(self.ids[p]), "image": self.files[p], "reason": r} for p, r in sorted(self.bad.items())]

    def _mark_bad(self, positions: list[int], reasons: list[str]) -> None:
        for p, reason in zip(positions, reasons, strict=True):
            if self.on_bad_image == "error":
                raise ValueError(
                    f"{self.files[p]}: {reason}. Fix or remove it and re-run tools/prepare_data.py, "
                    "or pass on_bad_image='skip'"
                )
            log.warning("skipping %s (sample id %d): %s", self.files[p], self.ids[p], reason)
            self.bad[p] = reason
        if len(self.bad) == len(self.files):
            raise ValueError("every image is missing or undecodable; nothing to load")

    def _check_files(self, file_stats: Sequence[tuple[int, int]] | None) -> None:
        """At start-up: stat every file; decode again the ones that changed since they were validated."""
        from mmfast.validate import check_images

        suspects = []
        for p, path in enumerate(self.files):
            try:
                st = os.stat(path)
            except OSError:
                suspects.append(p)
                continue
            if file_stats is not None and (st.st_size, st.st_mtime_ns) != tuple(file_stats[p]):
                suspects.append(p)
            elif st.st_size == 0:
                suspects.append(p)
        if suspects:
            checks = check_images([self.files[p] for p in suspects], self.num_threads, max_pixels=self.max_pixels)
            bad = [(p, c.reason) for p, c in zip(suspects, checks, strict=True) if not c.ok]
            if bad:
                self._mark_bad(*map(list, zip(*bad, strict=True)))

    def _pad_file(self) -> str:
        """A decodable file to stand in for padding and skipped samples (their ids are -1)."""
        return next(f for p, f in enumerate(self.files) if p not in self.bad)

    def _recover(self, error: RuntimeError) -> _Stream:
        """DALI failed on a batch: find the file(s) it could not read among the next batches, mark them,
        and reopen the stream at the same position. Re-raises when no file is to blame."""
        from mmfast.validate import check_images

        if self.wds_shards:
            raise RuntimeError(
                f"DALI failed reading the WebDataset shards ({error}); re-run tools/prepare_data.py (a shard "
                "may have changed since it was indexed)"
            ) from error
        window = self._positions(self.epoch)[self.step * self.batch_size :][
            : (self.prefetch + 2) * self.batch_size
        ]
        todo = [int(p) for p in window if p >= 0 and p not in self.bad]
        checks = check_images([self.files[p] for p in todo], self.num_threads)
        bad = [(p, c.reason) for p, c in zip(todo, checks, strict=True) if not c.ok]
        if not bad:
            raise error
        self._mark_bad(*map(list, zip(*bad, strict=True)))
        self._stream = None
        return self._open_stream(self.epoch, self.step)

    def _lookup(self, ids: np.ndarray) -> np.ndarray:
        """Positions in ``files`` of the given sample ids (-1 stays -1)."""
        found = self._id_sorter[np.searchsorted(self.ids, ids, sorter=self._id_sorter).clip(0, len(self.ids) - 1)]
        return np.where(ids >= 0, found, -1)

    def _batches(self, generation: int | None = None) -> Iterator[tuple[torch.Tensor, np.ndarray, int]]:
        """(images on the DALI output device, sample ids as numpy, the batch's index in the epoch) for the
        rest of the current epoch; whole DALI batches (B, ...).

        Counts a batch as delivered (``self.step``) when it is handed out, so a consumer that stops early
        leaves the loader at the right position. ``generation``: stop when another ``iter()`` has begun.
        """
        n = len(self)
        if self.step >= n:  # restored at the very end of an epoch
            self.epoch, self.step = self.epoch + 1, 0
            return
        if self._stream is None or not self._stream.at(self.epoch, self.step):
            self._stream = self._open_stream(self.epoch, self.step)
        stream = self._stream
        while self.step < n:
            if generation is not None and generation != self._generation:
                return  # an abandoned iterator: the loader has moved on
            try:
                out = next(stream.it)  # DALI's iterator returns one dict per pipeline; we run one pipeline
            except RuntimeError as e:  # DALI aborts the whole pipeline on one file it cannot read
                stream = self._stream = self._recover(e)
                continue
            out = out[0]
            if self._finisher is not None:
                images = self._finisher.finish(out)  # (B, 3, S, S)
            else:
                images = out["image"]  # (B, 3, S, S)
            ids = out["id"].view(-1).numpy().astype(np.int64)  # the reader's labels stay on the host
            step = self.step
            stream.step += 1
            self.step += 1
            yield images, ids, step
        self._end_epoch()

    def _end_epoch(self) -> None:
        """The logical epoch is over; the stream moves on to the next one (or ends with its chunk)."""
        stream = self._stream
        if stream is not None and stream.at(self.epoch, len(self)):
            stream.epoch, stream.step = stream.epoch + 1, 0
            if "wds" in stream.chunk:
                stream.it.reset()  # DALI's reader epoch ended with ours
            elif stream.epoch >= stream.chunk["start"] + stream.chunk["epochs"]:
                self._stream = None  # the chunk is consumed
        self.epoch, self.step = self.epoch + 1, 0

    def __iter__(self) -> Iterator[Batch | dict[str, torch.Tensor]]:
        """One epoch of batches: the epoch ``set_epoch`` selected, else the one after the last; a restored
        position (``load_state_dict``) continues, and an epoch left by a ``break`` is not resumed."""
        if self.step >= len(self):  # the last batch was taken, but the loop never asked for more
            self._end_epoch()
        elif self.step > 0 and not self._keep_position:  # an earlier loop stopped mid-epoch
            self.epoch, self.step = self.epoch + 1, 0
        self._keep_position = False
        self._generation += 1
        return self._epoch(self._generation)

    def _epoch(self, generation: int) -> Iterator[Batch | dict[str, torch.Tensor]]:
        n, per_rank, b = len(self.files), self._samples_per_rank(), self.batch_size
        for images, ids, step in self._batches(generation):
            if per_rank - step * b < len(ids):  # DataLoader's partial last batch: cut DALI's filler off
                images, ids = images[: per_rank - step * b], ids[: per_rank - step * b]
            pos = self._lookup(ids)
            labels = np.where(pos >= 0, self.labels[pos], IGNORE_LABEL)
            mask = ids >= 0  # not a skipped image ...
            if not self.wds_shards:  # ... nor a repeat that fills up a shard
                mask &= self.shard_id + (step * b + np.arange(len(ids))) * self.num_shards < n
            if images.dtype != self.dtype:  # bfloat16 from a graph that emits float32
                images = images.to(self.dtype)
            tensors = [images, torch.from_numpy(labels), torch.from_numpy(ids), torch.from_numpy(mask)]
            if self._pin:
                tensors = [t.pin_memory() for t in tensors]
            images, labels, ids, mask = (t.to(self.device, non_blocking=True) for t in tensors)
            if self.as_dict:
                yield {"image": images, "label": labels, "id": ids, "mask": mask}
            else:
                yield Batch.of(images, labels, ids, mask)


def wds_split(root: Path, split: str) -> tuple[list[str], list[str]]:
    """(tars, index files) of a split's WebDataset source in a prepared directory: mmfast's export
    (``mmfast.wds``) or the user's shards it was prepared from (``mmfast.inputs.wds``).

    Raises:
        FileNotFoundError: no WebDataset source for the split.
        ValueError: a user's shard changed (size or mtime) since preparation.
    """
    wds = root / "wds"
    listing = wds / f"{split}.json"
    if not listing.is_file():
        raise FileNotFoundError(f"{listing}: no WebDataset shards; run tools/prepare_data.py --format wds")
    info = json.loads(listing.read_text())
    if "tars" not in info:  # an export by an older mmfast
        info["tars"], info["index"] = [f"{s}.tar" for s in info["shards"]], [f"{s}.idx" for s in info["shards"]]
    tars = [str(wds / t) for t in info["tars"]]  # the user's shards are absolute paths, and stay so
    index = [str(wds / i) for i in info["index"]]
    for tar, want in zip(tars, info.get("stats", []), strict=False):
        try:
            st = os.stat(tar)
        except OSError as e:
            raise FileNotFoundError(f"{tar}: WebDataset shard missing ({e.strerror}); restore it") from None
        if [st.st_size, st.st_mtime_ns] != list(want):
            raise ValueError(
                f"{tar}: changed since preparation (size or mtime); re-run tools/prepare_data.py to index it again"
            )
    return tars, index


class _Stream:
    """A DALI iterator and the (epoch, step) of the batch it will return next."""

    def __init__(self, it, chunk: dict, epoch: int, step: int):
        self.it, self.chunk, self.epoch, self.step = it, chunk, epoch, step

    def at(self, epoch: int, step: int) -> bool:
        return (self.epoch, self.step) == (epoch, step)


class MultimodalLoader(ImageLoader):
    """One split of a prepared dataset: DALI images joined with cached tokens by sample id.

    Batches: ``{"image": (B, 3, S, S), "input_ids": (B, L), "attention_mask": (B, L), "label": (B,),
    "id": (B,)}`` on the training device, L = the longest caption in the batch. Padding samples of the
    last eval batch have id -1, label -100 and an all-zero attention mask.

    Args:
        data_dir: a directory written by tools/prepare_data.py, or a ``PreparedDataset`` of one.
        split: "train" or "val".
        batch_size: per process, as in Accelerate.
        shuffle, drop_last, train: default True for "train", False otherwise.
        accelerator: take shard_id / num_shards / device from an ``accelerate.Accelerator``.
        source: "files" (the split's image files) or "wds" (its WebDataset shards, see ``mmfast.wds``).
        **kwargs: the rest of ``ImageLoader``'s arguments (default dtype here: float16).

    Unlike ``ImageLoader``, it keeps whole batches and its own sampling (see the module docstring): the
    training engine relies on both.
    """

    _default_dtype = torch.float16
    _dataloader_sampling = False

    def __init__(
        self,
        data_dir: str | os.PathLike | PreparedDataset,
        split: str = "train",
        batch_size: int = 64,
        *,
        shuffle: bool | None = None,
        drop_last: bool | None = None,
        accelerator=None,
        source: str = "files",
        **kwargs,
    ):
        # Opening verifies every file of the directory against prepare.json (pass a PreparedDataset to
        # share one verification between the train and val loaders).
        if kwargs.get("as_dict") is False:
            raise ValueError("MultimodalLoader's batches are always dicts (as_dict=False is ImageLoader's)")
        dataset = data_dir if isinstance(data_dir, PreparedDataset) else PreparedDataset(data_dir)
        if accelerator is not None:
            kwargs.setdefault("shard_id", accelerator.process_index)
            kwargs.setdefault("num_shards", accelerator.num_processes)
            kwargs.setdefault("device", accelerator.device)
        if source == "files" and dataset.summary.get("input_kind") == "wds":
            source = "wds"  # the images are in the user's WebDataset shards only
        if source == "wds":
            kwargs["wds_shards"], kwargs["wds_index"] = wds_split(dataset.root, split)
        elif source != "files":
            raise ValueError(f"unknown source '{source}'; choose from 'files', 'wds'")
        # A WebDataset source needs only ids and labels: read as arrays (bytes a row, not a dict of Python
        # objects: what keeps a 10M-row split's loader small); the files source needs each row's file.
        table = dataset.root / "wds" / f"{split}.rows.npy"
        rows = None if source == "wds" and table.is_file() else dataset.rows(split)
        if rows is None:
            ids_labels = np.load(table)  # (N, 2) int64: id, class id
            images = [str(table)] * len(ids_labels)  # one shared string: the samples are named by the index
        else:
            ids_labels = np.array([(r["id"], r["label"]) for r in rows], dtype=np.int64).reshape(-1, 2)
            images = [r["image"] for r in rows]
        if not len(ids_labels):
            raise ValueError(f"{dataset.root / (split + '.jsonl')}: split '{split}' is empty")
        is_train = split == "train"
        kwargs.setdefault("max_pixels", dataset.max_pixels)
        if rows is not None and all("size" in r and "mtime_ns" in r for r in rows):
            kwargs.setdefault("file_stats", [(r["size"], r["mtime_ns"]) for r in rows])
        super().__init__(
            images,
            ids_labels[:, 1],
            ids=ids_labels[:, 0],
            batch_size=batch_size,
            shuffle=is_train if shuffle is None else shuffle,
            drop_last=is_train if drop_last is None else drop_last,
            **kwargs,
        )
        self.dataset = dataset
        self.tokens = TokenCache(dataset.tokens_dir, split)
        if len(self.tokens) != len(ids_labels) or self.tokens.first_id != ids_labels[0, 0]:
            raise ValueError(
                f"token cache {dataset.tokens_dir}/{split} (rows {len(self.tokens)}, first id "
                f"{self.tokens.first_id}) does not match {split}.jsonl (rows {len(ids_labels)}, first id "
                f"{ids_labels[0, 0]}); re-run tools/prepare_data.py"
            )
        self.texts = [r["text"] for r in rows] if rows is not None else None  # None: not read (WebDataset)
        self.num_classes = dataset.num_classes

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for images, ids, _ in self._batches():
            pos = self._lookup(ids)
            labels = np.where(pos >= 0, self.labels[pos], IGNORE_LABEL)
            text = self.tokens.gather(ids)  # pinned on CUDA machines, so the copies below are asynchronous
            if images.dtype != self.dtype:  # bfloat16 from a graph that emits float32
                images = images.to(self.dtype)
            if self._pin:
                images = images.pin_memory()
            yield {
                "image": images.to(self.device, non_blocking=True),
                "input_ids": text["input_ids"].to(self.device, non_blocking=True),
                "attention_mask": text["attention_mask"].to(self.device, non_blocking=True),
                "label": torch.from_numpy(labels).to(self.device, non_blocking=True),
                "id": torch.from_numpy(ids).to(self.device, non_blocking=True),
            }
