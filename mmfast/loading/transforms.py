"""torchvision transforms and the image pipeline's options, both ways: a dataset's transform read as
``image_pipeline`` options (``options_from_transform``: a step the pipeline cannot reproduce is an error
naming it), an argument checked against it (``agree_with_transform``), and the torchvision transform that does
what a loader's pipeline does (``torchvision_equivalent``). The drop-in (``dropin``) and ``CaptionLoader`` use
them.
"""

from __future__ import annotations

import math
import types

import numpy as np
import torch

from mmfast.data.preprocessing import EVAL_CROP_RATIO, IMAGENET_MEAN, IMAGENET_STD

_CONVERSIONS = ("ToTensor", "PILToTensor", "ToImage", "ToPureTensor", "ConvertImageDtype", "ToDtype")
INTERPOLATIONS = ("bilinear", "bicubic")  # the resizes the graph and the host finishing reproduce
# Steps of open_clip's preprocess (open_clip.transform) and what they are here: the loader decodes to RGB and
# converts to floats itself.
_OPEN_CLIP_STEPS = {"MaybeConvertMode": "rgb", "_convert_to_rgb": "rgb", "MaybeToTensor": "ToTensor"}
# open_clip's random steps, added by its trainer's --aug-cfg color_jitter_prob and gray_scale_prob
OPEN_CLIP_AUGMENTATIONS = ("color_jitter", "gray_scale")


REPRODUCED = (
    "RandomResizedCrop(S) [+ RandomHorizontalFlip()] [+ ColorJitter(j, j, j)], Resize(R) + CenterCrop(S) or "
    "Resize((S, S)), bilinear or bicubic, then ToTensor() and Normalize(mean, std)"
)


class UnsupportedTransform(ValueError):
    """A step of a transform the image pipeline cannot reproduce: ``step`` names it, ``why`` says why, and the
    message what is reproduced and ``advice``."""

    def __init__(self, step: str, why: str, advice: str | None = None):
        self.step, self.why = step, why
        advice = advice or (
            "change the transform, or give the loader its equivalent (size=, train=, mean=, std=) in its place "
            "and accept the difference"
        )
        super().__init__(
            f"the image pipeline cannot reproduce {step} of the transform: {why}. It reproduces {REPRODUCED}; "
            f"{advice}"
        )


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
    if module.split(".")[0] == "open_clip":
        if name in OPEN_CLIP_AUGMENTATIONS:
            _unsupported(op, "an open_clip augmentation the pipeline does not draw")
        _unsupported(op, "an open_clip resize or crop the pipeline does not do (resize_mode 'longest')")
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
    eval ``Resize(R)`` + ``CenterCrop(S)``, or ``Resize((S, S))`` (``resize_mode`` "squash"); bilinear or
    bicubic; then ``ToTensor()`` (or ``PILToTensor``/``ToImage`` + ``ConvertImageDtype``/``ToDtype(...,
    scale=True)``) and ``Normalize(mean, std)``. open_clip's conversions to RGB and to a tensor are the loader's
    own.

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
            if resize is not None or crop is not None:  # the pipeline resizes once, then crops
                _unsupported(op, "one Resize, before the CenterCrop, is reproduced")
            size = [op.size] if isinstance(op.size, int) else list(op.size)
            if op.max_size is not None or len(size) not in (1, 2) or (len(size) == 2 and size[0] != size[1]):
                _unsupported(
                    op, "only Resize(int) (the shorter side) and Resize((S, S)) (squashed) are reproduced"
                )
            if len(size) == 2:
                found["resize_mode"] = "squash"  # the whole picture to S x S, no crop
            resize = size[0]
        elif name == "CenterCrop":
            if crop is not None:
                _unsupported(op, "one CenterCrop is reproduced")
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
            raise UnsupportedTransform("a resize or crop after RandomResizedCrop", "the crop is the last resize")
        return found
    if found.get("resize_mode") == "squash" and crop in (None, resize) and not found["flip"]:
        if not found["color_jitter"]:  # Resize((S, S)), a centre crop of S or none: the picture squashed
            return {**found, "train": False, "size": resize}
    if resize is None or crop is None or crop > resize or found["flip"] or found["color_jitter"]:
        raise UnsupportedTransform(
            "the geometry",
            "it is neither a training crop nor an evaluation resize and centre crop with R >= S, nor "
            "Resize((S, S))",
        )
    if found.get("resize_mode") == "squash":
        raise UnsupportedTransform(
            "Resize((S, S)) followed by a smaller crop", "the squashed picture is the last resize"
        )
    # "shortest" said: a resize_mode given beside the transform must agree with it (agree_with_transform)
    return {**found, "train": False, "size": crop, "crop_ratio": crop / resize, "resize_mode": "shortest"}


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
    raise UnsupportedTransform(_shown(op), why)


def _shown(op) -> str:
    """A step as a reader knows it: its repr where its class writes one, else its module and name (open_clip's
    steps print as "<... object at 0x...>")."""
    kind = op if isinstance(op, types.FunctionType) else type(op)
    if kind is not op and type(op).__repr__ is not object.__repr__:
        return repr(op)
    return f"{kind.__module__}.{kind.__qualname__}"


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
