"""DataLoader compatibility: what code written for a ``torch.utils.data.DataLoader`` over a torchvision
``ImageFolder`` passes and expects of ``ImageLoader``, translated once: its arguments (taken, refused with
advice, or accepted as no-ops), ImageFolder datasets and their transforms (``options_from_transform``), a
folder tree (``loader_from_folder``), the torchvision equivalent of the pipeline, tuple batches (``Batch``) and
``loader.dataset`` (``ImageFiles``).
"""

from __future__ import annotations

import math
import types
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from mmfast.data.preprocessing import EVAL_CROP_RATIO, IMAGENET_MEAN, IMAGENET_STD

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


_CONVERSIONS = ("ToTensor", "PILToTensor", "ToImage", "ToPureTensor", "ConvertImageDtype", "ToDtype")
INTERPOLATIONS = ("bilinear", "bicubic")  # the resizes the graph and the host finishing reproduce
# Steps of open_clip's preprocess (open_clip.transform) and what they are here: the loader decodes to RGB and
# converts to floats itself.
_OPEN_CLIP_STEPS = {"MaybeConvertMode": "rgb", "_convert_to_rgb": "rgb", "MaybeToTensor": "ToTensor"}


def _step_name(op) -> str:
    """The name a step of a transform is known by here: a torchvision class's, or the torchvision equivalent
    of an open_clip step ("rgb" for its conversion to RGB); refuses any other step."""
    plain = isinstance(op, types.FunctionType)  # open_clip's _convert_to_rgb is a function
    name = op.__name__ if plain else type(op).__name__
    module = op.__module__ if plain else type(op).__module__
    if module.split(".")[0] == "open_clip" and name in _OPEN_CLIP_STEPS:
        if name == "MaybeConvertMode" and getattr(op, "mode", "RGB") != "RGB":
            _unsupported(op, "the loader decodes to RGB")
        return _OPEN_CLIP_STEPS[name]
    if not module.startswith("torchvision.transforms"):
        _unsupported(op, "it is not a torchvision transform")
    return name


def _interpolation(op) -> str:
    """ "bilinear" or "bicubic": the resize of a RandomResizedCrop / Resize step."""
    mode = str(getattr(op.interpolation, "value", op.interpolation)).lower()
    if mode not in INTERPOLATIONS:
        _unsupported(op, "only bilinear and bicubic resizing are reproduced")
    return mode


def options_from_transform(transform) -> dict:
    """The ``ImageLoader`` arguments that make its pipeline do what a torchvision transform (v1 or v2), or
    open_clip's preprocess, does.

    Understood: train ``RandomResizedCrop(S)`` [+ ``RandomHorizontalFlip()``] [+ ``ColorJitter(j, j, j)``];
    eval ``Resize(R)`` + ``CenterCrop(S)``; bilinear or bicubic; then ``ToTensor()`` (or
    ``PILToTensor``/``ToImage`` + ``ConvertImageDtype``/``ToDtype(..., scale=True)``) and ``Normalize(mean,
    std)``. open_clip's conversions to RGB and to a tensor are the loader's own.

    Returns:
        a dict of ``train``, ``size``, ``dtype`` and the image options (scale, ratio, flip, color_jitter,
        crop_ratio, interpolation, mean, std), all set.

    Raises:
        ValueError naming the first step the pipeline cannot reproduce, and what it can.
    """
    steps = list(getattr(transform, "transforms", None) or [transform])
    found: dict = {"flip": False, "color_jitter": 0.0}
    resize = crop = None
    scale_to_unit = None  # after a float conversion: True if it divided by 255 (ToTensor), False if not
    for op in steps:
        name = _step_name(op)
        if name in ("RandomResizedCrop", "Resize"):
            interpolation = _interpolation(op)
            if found.setdefault("interpolation", interpolation) != interpolation:
                _unsupported(op, "one transform resizes with one interpolation")
        if name == "RandomResizedCrop":
            found.update(train=True, size=_square(op, op.size), scale=tuple(op.scale), ratio=tuple(op.ratio))
        elif name == "RandomHorizontalFlip":
            if op.p != 0.5:
                _unsupported(op, "the pipeline flips with probability 0.5")
            found["flip"] = True
        elif name == "ColorJitter":
            strength = _jitter_strength(op)
            if strength is not None:  # None: ColorJitter(), nothing to do
                found["color_jitter"] = strength
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
        elif name != "rgb":  # the loader decodes to RGB anyway
            _unsupported(op, "the pipeline does random-resized-crop + flip (+ color jitter) for training")
    return _finish_options(found, resize, crop, scale_to_unit)


def _finish_options(found: dict, resize: int | None, crop: int | None, scale_to_unit: bool | None) -> dict:
    """``options_from_transform``'s answer once every step is read: the defaults of what the transform did not
    say, and the eval geometry; refuses a transform that is neither a train nor an eval transform."""
    if scale_to_unit is None:
        raise ValueError(
            "the dataset's transform never converts the image to floats; ImageLoader's images are float: add "
            "ToTensor() (or ToDtype(torch.float32, scale=True)) and Normalize if you want them"
        )
    found.setdefault("interpolation", "bilinear")
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


def _jitter_strength(op) -> float | None:
    """``color_jitter`` of a ColorJitter that varies brightness, contrast and saturation alike; None for one
    that does nothing."""
    ranges = [op.brightness, op.contrast, op.saturation]
    if all(r is None for r in ranges) and op.hue is None:
        return None
    if op.hue not in (None, (0, 0)) or None in ranges or len({tuple(r) for r in ranges}) != 1:
        _unsupported(op, "the pipeline jitters brightness, contrast and saturation alike, not hue")
    lo, hi = ranges[0]
    if not math.isclose(1 - lo, hi - 1):
        _unsupported(op, "the jitter range must be symmetric around 1")
    return hi - 1


def _unsupported(op, why: str):
    raise ValueError(
        f"ImageLoader cannot reproduce {op!r} of the dataset's transform: {why}. It reproduces "
        "RandomResizedCrop(S) [+ RandomHorizontalFlip()] [+ ColorJitter(j, j, j)] or Resize(R) + CenterCrop(S), "
        "bilinear or bicubic, then ToTensor() and Normalize(mean, std); change the transform, or give its "
        "equivalent as ImageLoader.from_folder(root, size=..., train=..., mean=..., std=...) and accept the "
        "difference"
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


def read_dataset(dataset, labels) -> tuple[list[str], list[int], list, dict]:
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


def agree_with_transform(name: str, given, translated):
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
        # torchvision: only for a torchvision dataset, transform or backbone
        from torchvision.datasets.folder import default_loader

        path, target = self.samples[index]
        image = default_loader(path)
        return (self.transform(image) if self.transform is not None else image), target


def torchvision_equivalent(train: bool, size: int, dtype: torch.dtype, options: dict):
    """The torchvision (v2) transform doing to one PIL image what ``image_pipeline`` does with these
    ``options`` (PIPELINE_OPTIONS; mean and std in 0..255 units): train: RandomResizedCrop + flip (+ jitter);
    eval: Resize(round(size / crop_ratio)) + CenterCrop(size), or Resize((size, size)) for ``resize_mode``
    "squash", with the ``interpolation``; then normalize, as ``dtype``."""
    from torchvision.transforms import v2  # torchvision: only for a torchvision dataset, transform or backbone

    mode = v2.InterpolationMode(options.get("interpolation", "bilinear"))
    mean = [m / 255 for m in options.get("mean", IMAGENET_MEAN)]
    std = [s / 255 for s in options.get("std", IMAGENET_STD)]
    if train:
        scale, ratio = options.get("scale", (0.08, 1.0)), options.get("ratio", (3 / 4, 4 / 3))
        ops = [v2.RandomResizedCrop(size, scale, ratio, interpolation=mode)]
        if options.get("flip", True):
            ops.append(v2.RandomHorizontalFlip())
        jitter = options.get("color_jitter", 0.0)
        if jitter > 0:
            ops.append(v2.ColorJitter(brightness=jitter, contrast=jitter, saturation=jitter))
    elif options.get("resize_mode", "shortest") == "squash":
        ops = [v2.Resize((size, size), interpolation=mode)]
    else:
        shorter = round(size / options.get("crop_ratio", EVAL_CROP_RATIO))
        ops = [v2.Resize(shorter, interpolation=mode), v2.CenterCrop(size)]
    ops += [v2.ToImage(), v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean, std), v2.ToDtype(dtype)]
    return v2.Compose(ops)


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
    dataset, labels, *, batch_size, size, train, dtype, fp16, classes, pipeline_kwargs: dict
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
