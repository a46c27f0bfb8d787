"""Build a registered model by name (``registry.MODELS``), with the encoders it declares (``modalities``)."""

from __future__ import annotations

import torch
from torch import nn

from mmfast.models.encoders import ImageEncoder, TextEncoder
from mmfast.models.registry import MODELS
from mmfast.models.start_dirs import WHOLE, start_kind
from mmfast.models.start_towers import image_tower_from, text_tower_from
from mmfast.util.voice import setting


def model_class(name: str) -> type:
    """The model class registered as ``name``.

    Raises:
        ValueError: no model of that name ("unknown model 'x'; choose from ...").
    """
    return MODELS.pick(name)


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
    text_train_layers: int | None = None,
    image_pool: str = "last",
    hidden: int = 512,
    dropout: float = 0.1,
    channels_last: bool = False,
    image_encoder: nn.Module | None = None,
    text_encoder: nn.Module | None = None,
    **kwargs,
) -> nn.Module:
    """Build a registered model with the encoders it declares.

    Args:
        name: a registered model: "early", "concat", "late", a single-modality baseline "image" / "text", the
            dual encoder "clip", or one added with ``register_model``.
        num_classes: classifier outputs (not checked for a model that declares ``classifies = False``).
        image_backbone: one of IMAGE_BACKBONES, "timm:<name>", or a directory: a timm model in timm's Hugging
            Face layout, a Hugging Face vision model, CLIP or SigLIP, or an open_clip model (``start_towers``).
        text_model: "bert-tiny"/"bert-mini" (random), "minilm" (local weights), a directory (a Hugging Face
            encoder, CLIP, or an open_clip model with a Hugging Face text tower) or a hub name.
        vocab_size: the tokenizer's size (for random text configs and a consistency check).
        image_weights: optional local state dict for the image backbone (strict).
        freeze_image, freeze_text: no gradients into that encoder.
        text_train_layers: the text encoder's top layers that train (None or -1: all; ``TextEncoder``).
        image_pool: the image encoder's pooled features, "last" or "multiscale" (``ImageEncoder``'s pool).
        channels_last: NHWC memory format for the CNN (faster convolutions on tensor cores).
        image_encoder, text_encoder: towers already built (a model directory's, rebuilt from its records),
            used instead of building them from ``image_backbone`` / ``text_model``.
        **kwargs: model-specific options (LateFusion: combine; EarlyFusion: max_grid; DualEncoder: loss,
            embed_dim).

    Returns:
        The model; its encoders are ``model.image`` / ``model.text`` (None where it declares no such modality).
        Its forward takes a batch dict and gives logits (B, C), except: "clip" gives a dict of embeddings, and
        "late" in train mode (with an ``aux_weight`` > 0) gives {"logits", "aux", "aux_weight"}, the per-branch
        logits its loss adds (``tasks.classification.training_loss``); in eval mode, logits.

    Raises:
        ValueError: unknown name, backbone or text model; mismatched weights; "bert-tiny" / "bert-mini" without
            ``vocab_size``.
    """
    cls = model_class(name)
    if getattr(cls, "classifies", True) and num_classes < 2:
        raise ValueError(f"num_classes must be >= 2, got {num_classes}")
    # A model builds only the encoders it uses (the single-modality baselines one).
    image = text = None
    if "image" in cls.modalities:
        image = image_encoder or _image_encoder(image_backbone, image_weights, freeze_image, image_pool)
    if "text" in cls.modalities:
        text = text_encoder or _text_encoder(text_model, vocab_size, freeze_text, dropout, text_train_layers)
    model = cls(image, text, num_classes, hidden=hidden, dropout=dropout, **kwargs)
    if channels_last and image is not None:
        model.image.to(memory_format=torch.channels_last)
    return model


def _image_encoder(backbone: str, weights: str | None, freeze: bool, pool: str) -> nn.Module:
    """A catalogue backbone or a timm directory (``ImageEncoder``), else the tower a model directory holds."""
    if start_kind(backbone) in (None, "timm"):
        return ImageEncoder(backbone, weights=weights, freeze=freeze, pool=pool)
    if weights is not None:
        raise ValueError(f"--image-weights {weights}: image backbone {backbone} is a directory with its weights")
    if pool != "last":
        raise ValueError(
            f"{setting('image_pool', value=pool)}: image backbone {backbone} is a CLIP, open_clip or Hugging Face "
            "tower, which pools as it was trained to; multiscale reads a CNN's stages (a catalogue backbone, "
            "timm:<name> or a timm directory): use --image-pool last"
        )
    return image_tower_from(backbone, freeze)


def _text_encoder(
    name: str, vocab_size: int | None, freeze: bool, dropout: float, train_layers: int | None
) -> nn.Module:
    """A Hugging Face encoder (``TextEncoder``), or the text tower of a CLIP / SigLIP / open_clip directory."""
    if start_kind(name) in WHOLE:
        if train_layers not in (None, -1, 0):
            raise ValueError(
                f"{setting('text_train_layers', value=str(train_layers))}: the text tower of {name} trains whole "
                "or not at all; leave the flag unset or pass 0"
            )
        return text_tower_from(name, freeze or train_layers == 0)
    return TextEncoder(name, vocab_size=vocab_size, freeze=freeze, dropout=dropout, train_layers=train_layers)
