"""What ``MmfastModel.encode_image`` and ``encode_text`` take, checked, and turned into the towers' inputs.

Images come as files, PIL images, uint8 numpy arrays (H, W, C) or uint8 tensors (C, H, W), all RGB. They are
decoded and preprocessed here as the eval pipeline does (``pil_transform``). A file is checked as training
checks it (``validate.open_image``): missing, not an image, truncated, over the decoded-pixel budget. A float
tensor is a batch the loaders preprocessed, used as it is, and must have the model's image size.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import torch

from mmfast.data.preprocessing import eval_resize
from mmfast.data.validate import open_image

log = logging.getLogger(__name__)
ON_ERROR = ("skip", "raise")  # what encode_image does with an image it cannot use
TAKES = (
    "image files (str or os.PathLike), PIL images, uint8 RGB arrays (H, W, 3), uint8 tensors (3, H, W), a list "
    "of those, or a preprocessed batch (a float tensor (N, 3, S, S))"
)


def check_on_error(on_error: str) -> None:
    """Refuse an ``on_error`` that is not one of ``ON_ERROR``."""
    if on_error not in ON_ERROR:
        raise ValueError(f"on_error must be {' or '.join(map(repr, ON_ERROR))}, got {on_error!r}")


class BadImageError(ValueError):
    """An image ``encode_image`` cannot use, with ``on_error="raise"``: ``image`` names it, ``reason`` says why."""

    def __init__(self, image: str, reason: str):
        super().__init__(f"{image}: {reason}")
        self.image, self.reason = image, reason


def text_inputs(texts) -> list[str]:
    """``encode_text``'s texts as a list of str."""
    if isinstance(texts, str):
        return [texts]
    if isinstance(texts, torch.Tensor):
        raise TypeError(
            "encode_text takes texts (a str or a list of str); token ids go to "
            "model.model.encode_text(input_ids, attention_mask)"
        )
    if texts is None or isinstance(texts, bytes | dict) or not hasattr(texts, "__iter__"):
        raise TypeError(f"encode_text takes a str or a list of str; got {type(texts).__name__}")
    texts = list(texts)
    bad = next((k for k, t in enumerate(texts) if not isinstance(t, str)), None)
    if bad is not None:
        raise TypeError(f"encode_text takes a str or a list of str; texts[{bad}] is a {type(texts[bad]).__name__}")
    return texts


def pil_transform(config: dict):
    """The eval preprocessing as PIL + torchvision give it (a PIL image -> (3, S, S) float32): the shorter side
    resized to image_size / crop_ratio and a center crop of image_size (or, for resize_mode "squash", the whole
    picture resized to image_size), with config.json's filter, mean and std."""
    from torchvision import transforms  # only this path needs it (the loaders preprocess with DALI)

    size, resize = config["image_size"], eval_resize(config)
    mode = transforms.InterpolationMode(resize["interpolation"])
    if resize["resize_mode"] == "squash":
        geometry = [transforms.Resize((size, size), interpolation=mode)]
    else:
        shorter = round(size / resize["crop_ratio"])
        geometry = [transforms.Resize(shorter, interpolation=mode), transforms.CenterCrop(size)]
    return transforms.Compose(
        [
            transforms.Lambda(_as_rgb),  # RGBA, gray or palette pictures: three channels, as the decoder gives
            *geometry,
            transforms.ToTensor(),
            transforms.Normalize(config["mean"] or (0.5,) * 3, config["std"] or (0.5,) * 3),
        ]
    )


def _as_rgb(image):
    """A PIL image in RGB (alpha dropped, as DALI's decoder drops it); a module function, so it pickles."""
    return image.convert("RGB") if getattr(image, "mode", "RGB") != "RGB" else image


def preprocessed_batch(images, size: int) -> torch.Tensor | None:
    """``images`` as a batch (N, 3, S, S) when it is a float tensor (one image (3, S, S) is a batch of one);
    None when the images come another way.

    Raises:
        ValueError: a float tensor of another shape, saying what a batch must be.
    """
    if not (isinstance(images, torch.Tensor) and images.is_floating_point()):
        return None
    batch = images.unsqueeze(0) if images.dim() == 3 else images
    if batch.dim() != 4 or tuple(batch.shape[1:]) != (3, size, size):
        raise ValueError(
            f"a float tensor is a preprocessed batch: (N, 3, {size}, {size}) (config.json's image_size), "
            f"normalized with the model's mean and std as the loaders give it; got shape {tuple(images.shape)}. "
            "Pass uint8 images (arrays (H, W, 3), tensors (3, H, W)), PIL images or files to preprocess them here"
        )
    return batch


def image_inputs(images) -> list:
    """``images`` one by one: each a path, a PIL image or a uint8 numpy array (H, W) or (H, W, C).

    Raises:
        TypeError: an input of another type, or an array or tensor that is not uint8.
        ValueError: a uint8 array or tensor of a shape that is no image.
    """
    if _is_one_image(images):
        return [images]
    if isinstance(images, np.ndarray | torch.Tensor):
        return _arrays(images, "images", several=True)
    if images is None or isinstance(images, bytes | dict) or not hasattr(images, "__iter__"):
        raise TypeError(f"encode_image takes {TAKES}; got {type(images).__name__}")
    items = []
    for k, item in enumerate(images):
        if _is_one_image(item):
            items.append(item)
        elif isinstance(item, np.ndarray | torch.Tensor):
            items += _arrays(item, f"images[{k}]", several=False)
        else:
            raise TypeError(f"encode_image: images[{k}] is a {type(item).__name__}; it takes {TAKES}")
    return items


def _is_one_image(x) -> bool:
    return isinstance(x, str | os.PathLike) or hasattr(x, "getpixel")  # a file, or a PIL image


def _arrays(a: np.ndarray | torch.Tensor, where: str, several: bool) -> list[np.ndarray]:
    """The (H, W) or (H, W, C) uint8 arrays of a numpy array (H, W[, C]) or (N, H, W, C), or of a uint8 tensor
    (C, H, W) or (N, C, H, W) as torchvision.io.read_image gives them."""
    tensor = isinstance(a, torch.Tensor)
    kind, layout = ("tensor", "(3, H, W)") if tensor else ("array", "(H, W, 3)")
    if tensor and a.is_floating_point():  # a float tensor on its own is a batch (preprocessed_batch)
        raise TypeError(f"encode_image: {where} is a float tensor; stack preprocessed images into one batch")
    if a.dtype not in (np.uint8, torch.uint8):
        raise TypeError(f"encode_image: {where} is a {a.dtype} {kind}; an image {kind} holds uint8 RGB {layout}")
    hwc = a.detach().cpu().movedim(-3, -1).numpy() if tensor and a.dim() >= 3 else np.asarray(a)
    if hwc.ndim == 2 or (hwc.ndim == 3 and hwc.shape[-1] in (1, 3, 4)):
        return [hwc]
    if several and hwc.ndim == 4 and hwc.shape[-1] in (1, 3, 4):
        return list(hwc)
    many = f" (or images: (N, {layout[1:]})" if several else ""
    shape = tuple(a.shape)
    raise ValueError(f"encode_image: {where} is a uint8 {kind} of shape {shape}; an image is {layout}{many}")


def _rgb(item, max_pixels: int):
    """(the item as an RGB PIL image, "") or (None, why it cannot be used)."""
    from PIL import Image  # PIL: only when an image is opened here

    if isinstance(item, str | os.PathLike):
        image, check = open_image(item, max_pixels)
        return image, check.reason
    if isinstance(item, np.ndarray):  # (H, W) or (H, W, C)
        gray = item.ndim == 3 and item.shape[-1] == 1
        return Image.fromarray(np.ascontiguousarray(item[..., 0] if gray else item)).convert("RGB"), ""
    try:
        return item.convert("RGB"), ""  # a PIL image opened lazily reads its file now
    except (OSError, ValueError) as e:
        return None, f"the PIL image cannot be read: {e}"


def _name(item, k: int) -> str:
    """An input as messages name it: a file by its path, anything else by its position."""
    return os.fsdecode(item) if isinstance(item, str | os.PathLike) else f"images[{k}]"


def encode_images(
    encode, items: list, config: dict, *, batch_size: int, max_pixels: int, on_error: str
) -> tuple[list[torch.Tensor], list[int], list[dict]]:
    """``encode`` (a batch (B, 3, S, S) -> (B, D)) over ``image_inputs``' items, ``batch_size`` at a time.

    Returns:
        (the embeddings of the usable items, a tensor per batch, in order; their positions in ``items``; the
        skipped items, each {"index", "image", "reason"}).

    Raises:
        BadImageError: with ``on_error="raise"``, the first item that cannot be used.
    """
    tf = pil_transform(config)
    out, kept, skipped = [], [], []
    for start in range(0, len(items), batch_size):
        tensors = []
        for k in range(start, min(start + batch_size, len(items))):
            image, reason = _rgb(items[k], max_pixels)
            if image is None:
                if on_error == "raise":
                    raise BadImageError(_name(items[k], k), reason)
                log.warning("encode_image: skipping %s: %s", _name(items[k], k), reason)
                skipped.append({"index": k, "image": _name(items[k], k), "reason": reason})
                continue
            tensors.append(tf(image))  # (3, S, S)
            kept.append(k)
        if tensors:
            out.append(encode(torch.stack(tensors)))
    return out, kept, skipped
