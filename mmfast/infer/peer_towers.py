"""What a peer library (open_clip, transformers, timm, sentence-transformers) can build of a trained model's
towers, and the towers' weights under that library's names. The formats of ``mmfast-export`` ask here; a tower
a format cannot express is refused (``FormatRefusal``), naming the tower, the format and what to use instead.

An image tower is built by a timm name: a ``timm:<name>`` backbone and EfficientNet-Lite0 are timm models, and
torchvision's ResNets have timm's names and tensors (ResNet-10 is timm's ResNet-18 with one block a stage).
A text tower is a Hugging Face encoder read by the mean of its token states, as ``TextEncoder`` reads it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from torch import nn

from mmfast.data.preprocessing import EVAL_CROP_RATIO
from mmfast.models.encoders import pools_stages
from mmfast.tasks.registry import LOSSES

# torchvision's ResNets as timm builds them: its name and the keyword arguments that give the same network
TORCHVISION_IN_TIMM = {
    "resnet10": ("resnet18", {"layers": [1, 1, 1, 1]}),
    "resnet18": ("resnet18", {}),
    "resnet34": ("resnet34", {}),
    "resnet50": ("resnet50", {}),
    "resnet101": ("resnet101", {}),
}
# The Hugging Face text models open_clip's HFTextEncoder builds (open_clip/hf_configs.py's arch_dict)
OPEN_CLIP_TEXT_TYPES = ("bert", "roberta", "xlm-roberta", "mt5", "m2m_100")
INSTEAD = "export it with --format onnx or --format torch, which hold any network"


class FormatRefusal(ValueError):
    """A model, or a tower of it, that a format's library cannot build; the message names it and what to do."""


@dataclass(frozen=True)
class TimmImage:
    """An image tower as timm builds it: ``timm.create_model(name, **model_args)`` without its classifier holds
    ``trunk`` (timm's tensor names), whose pooled features are ``width`` wide."""

    name: str
    model_args: dict = field(default_factory=dict)
    trunk: dict = field(default_factory=dict)
    width: int = 0


def start_kinds(model) -> tuple[str | None, str | None]:
    """Where the (image, text) towers started when from a pretrained pair's directory ("hf-clip", "open_clip",
    ...: ``mmfast.models.start_towers``); None for a tower of mmfast's own kinds."""
    kinds = []
    for tower in encoders(model):
        record = getattr(tower, "record", None) if getattr(tower, "projected", False) else None
        kinds.append(record["kind"] if record else None)
    return kinds[0], kinds[1]


def refuse_starts(model, fmt: str, native: str) -> None:
    """Refuse a model whose towers started from a pretrained pair that ``fmt``'s library cannot build.

    Raises:
        FormatRefusal: naming the tower, where it started and the format that holds it (``native``).
    """
    for name, kind in zip(("image", "text"), start_kinds(model), strict=True):
        if kind is not None:
            raise FormatRefusal(
                f"--format {fmt}: the {name} tower started from a {kind} model, which {fmt} cannot build; "
                f"export it with --format {native}, onnx or torch"
            )


def encoders(model) -> tuple[nn.Module | None, nn.Module | None]:
    """The (image, text) encoders of an ``MmfastModel``'s network (None for one it does not have)."""
    net = model.model
    return getattr(net, "image", None), getattr(net, "text", None)


def timm_image(model, fmt: str) -> TimmImage:
    """The model's image tower as a timm model.

    Raises:
        FormatRefusal: the tower is not one timm builds by name.
    """
    image, _ = encoders(model)
    backbone = model.config["image_backbone"]
    if image is None:
        raise FormatRefusal(f"--format {fmt}: a '{model.config['model']}' model has no image tower")
    if not hasattr(image, "net"):
        raise FormatRefusal(f"--format {fmt}: image tower '{backbone}' is not a timm model; {INSTEAD}")
    if pools_stages(image):
        raise FormatRefusal(
            f"--format {fmt}: the image tower pools its stages too (--image-pool {image.pool}), which a timm "
            f"model built by name does not; {INSTEAD}, or train with --image-pool last (as --preset "
            "clip-lite0-minilm does) for a model that goes to open_clip and transformers"
        )
    trunk = {k: v.detach().cpu() for k, v in image.net.state_dict().items()}
    if getattr(image, "timm", False):
        name = getattr(image.net, "pretrained_cfg", {}).get("architecture") or backbone.removeprefix("timm:")
        args = (getattr(image, "record", None) or {}).get("model_args") or {}  # a timm directory's arguments
        return TimmImage(name, dict(args), trunk, image.width)
    if backbone not in TORCHVISION_IN_TIMM:
        raise FormatRefusal(f"--format {fmt}: image backbone '{backbone}' has no timm name; {INSTEAD}")
    name, args = TORCHVISION_IN_TIMM[backbone]
    return TimmImage(name, dict(args), trunk, image.width)


def mean_pooled_text(model, fmt: str) -> nn.Module:
    """The model's text tower: the Hugging Face encoder (``transformers.PreTrainedModel``) whose token states,
    averaged over the caption's tokens, are the tower's features.

    Raises:
        FormatRefusal: the model has no such text tower.
    """
    _, text = encoders(model)
    hf = getattr(text, "model", None)
    if text is None or not hasattr(hf, "config") or not hasattr(hf, "save_pretrained"):
        raise FormatRefusal(
            f"--format {fmt}: text tower '{model.config['text_model']}' is not a Hugging Face encoder; {INSTEAD}"
        )
    return hf


def projections(model, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A dual encoder's (image, text) projection matrices (D, C_img) and (D, C_txt).

    Raises:
        FormatRefusal: the model is not a dual encoder with a linear projection per tower.
    """
    net = model.model
    image_proj, text_proj = getattr(net, "image_proj", None), getattr(net, "text_proj", None)
    if not model.embeds or not isinstance(image_proj, nn.Linear) or not isinstance(text_proj, nn.Linear):
        raise FormatRefusal(
            f"--format {fmt} holds image-text dual encoders; a '{model.config['model']}' model is a classifier: "
            f"its towers go to --format hf, the whole network to --format onnx or torch"
        )
    return image_proj.weight.detach().cpu(), text_proj.weight.detach().cpu()


def logit_scale_and_bias(model) -> tuple[float, float | None]:
    """A dual encoder's learned log-temperature, and its bias (None for a loss that learns none: CLIP)."""
    net = model.model
    learns_bias = LOSSES.pick(model.config.get("loss", "clip")).init_logit_bias is not None
    bias = float(net.logit_bias.detach()) if learns_bias else None
    return float(net.logit_scale.detach()), bias


def eval_geometry(config: dict) -> tuple[int, int]:
    """(side S, resized shorter side R) of the model's eval preprocessing: resize to R, then centre-crop S."""
    size = int(config["image_size"])
    return size, round(size / config.get("crop_ratio", EVAL_CROP_RATIO))


def text_config(config, tokenizer) -> object:
    """A copy of a text encoder's config that names the tokenizer's pad id (a peer masks padding by it)."""
    config = copy.deepcopy(config)
    config.pad_token_id = tokenizer.pad_token_id
    return config
