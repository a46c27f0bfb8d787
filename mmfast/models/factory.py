"""Build a registered model by name, with the encoders it declares (``modalities``). Importing this module
registers the built-in models (``fusion``, then ``dual``)."""

from __future__ import annotations

from torch import nn

# The built-in models register themselves when their modules are imported: in catalog.BUILTIN_MODELS' order.
from mmfast.models import fusion  # noqa: F401  isort: skip
from mmfast.models import dual  # noqa: F401  isort: skip
from mmfast.models.encoders import ImageEncoder, TextEncoder
from mmfast.models.registry import MODELS


def model_class(name: str) -> type:
    """The model class registered as ``name``.

    Raises:
        ValueError: no model of that name ("unknown model 'x'; choose from ...").
    """
    if name not in MODELS:
        raise ValueError(f"unknown model '{name}'; choose from {', '.join(MODELS)}")
    return MODELS[name]


def build_model(
    name: str,
    num_classes: int,
    *,
    image_backbone: str = "resnet50",
    text_model: str = "bert-tiny",
    vocab_size: int | None = None,
    image_weights: str | None = None,
    freeze_image: bool = False,
    freeze_text: bool = False,
    hidden: int = 512,
    dropout: float = 0.1,
    channels_last: bool = False,
    **kwargs,
) -> nn.Module:
    """Build a registered model with the encoders it declares.

    Args:
        name: a registered model: "early", "concat", "late", a single-modality baseline "image" / "text", the
            dual encoder "clip", or one added with ``register_model``.
        num_classes: classifier outputs (not checked for a model that declares ``classifies = False``).
        image_backbone: one of IMAGE_BACKBONES.
        text_model: "bert-tiny"/"bert-mini" (random), "minilm" (local weights), a directory or hub name.
        vocab_size: the tokenizer's size (for random text configs and a consistency check).
        image_weights: optional local state dict for the image backbone (strict).
        freeze_image, freeze_text: no gradients into that encoder.
        channels_last: NHWC memory format for the CNN (faster convolutions on tensor cores).
        **kwargs: model-specific options (LateFusion: combine; EarlyFusion: max_grid; DualEncoder: loss,
            embed_dim).

    Returns:
        The model; its encoders are ``model.image`` / ``model.text`` (None where it declares no such modality).

    Raises:
        ValueError: unknown name, backbone or text model; mismatched weights.
    """
    cls = model_class(name)
    if getattr(cls, "classifies", True) and num_classes < 2:
        raise ValueError(f"num_classes must be >= 2, got {num_classes}")
    # A model builds only the encoders it uses (the single-modality baselines one).
    image = (
        ImageEncoder(image_backbone, weights=image_weights, freeze=freeze_image)
        if "image" in cls.modalities
        else None
    )
    text = (
        TextEncoder(text_model, vocab_size=vocab_size, freeze=freeze_text, dropout=dropout)
        if "text" in cls.modalities
        else None
    )
    model = cls(image, text, num_classes, hidden=hidden, dropout=dropout, **kwargs)
    if channels_last and image is not None:
        import torch

        model.image.to(memory_format=torch.channels_last)
    return model
