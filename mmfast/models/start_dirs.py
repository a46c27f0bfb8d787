"""What a model directory on disk is, read from its config files without torch: an open_clip model directory, a
Hugging Face CLIP or SigLIP directory, a timm model in timm's Hugging Face layout, or another Hugging Face model.
``mmfast-train --init-from`` (and ``--image-backbone`` / ``--text-model`` given such a directory) starts from it;
its preprocessing (image size, mean and std) comes from here too."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Protocol

from mmfast.data.tokenizer import OPEN_CLIP_CONFIG
WHOLE = ("open_clip", "hf-clip", "hf-siglip")  # the kinds that hold both towers and their temperature


def start_kind(path: str | os.PathLike | None) -> str | None:
    """"open_clip", "hf-clip", "hf-siglip", "timm" or "hf" for a directory holding such a model; None for a name
    or a path that is not a directory."""
    if path is None or not Path(path).is_dir():
        return None
    path = Path(path)
    if (path / OPEN_CLIP_CONFIG).is_file():
        return "open_clip"
    config = _json(path / "config.json")
    if "architecture" in config and "model_type" not in config:
        return "timm"
    kind = str(config.get("model_type", ""))
    if kind in ("clip", "siglip"):
        return f"hf-{kind}"
    return "hf" if config else None


def start_preprocess(path: str | os.PathLike) -> dict:
    """The preprocessing a directory's model was trained with: {"image_size", "mean", "std"}, each present when
    the directory says it (open_clip's preprocess_cfg, a processor's preprocessor_config.json, timm's
    pretrained_cfg)."""
    path, kind = Path(path), start_kind(path)
    if kind == "open_clip":
        cfg = _json(path / OPEN_CLIP_CONFIG)
        pre = cfg.get("preprocess_cfg", {})
        size = pre.get("size") or cfg.get("model_cfg", {}).get("vision_cfg", {}).get("image_size")
        return _fields(size, pre.get("mean"), pre.get("std"))
    if kind == "timm":
        pre = _json(path / "config.json").get("pretrained_cfg", {})
        return _fields((pre.get("input_size") or [None, None])[-1], pre.get("mean"), pre.get("std"))
    pre = _json(path / "preprocessor_config.json")
    size = pre.get("crop_size") or pre.get("size")
    if isinstance(size, dict):
        size = size.get("height") or size.get("shortest_edge")
    return _fields(size, pre.get("image_mean"), pre.get("image_std"))


def start_embed_dim(path: str | os.PathLike) -> int | None:
    """The embedding width of a whole dual encoder's directory (open_clip, CLIP, SigLIP); None for another."""
    path, kind = Path(path), start_kind(path)
    if kind == "open_clip":
        return _json(path / OPEN_CLIP_CONFIG).get("model_cfg", {}).get("embed_dim")
    config = _json(path / "config.json")
    if kind == "hf-clip":
        return config.get("projection_dim", 512)
    if kind == "hf-siglip":
        return config.get("vision_config", {}).get("hidden_size", 768)
    return None


class StartFlags(Protocol):
    """The training flags ``start_fields`` reads (a training configuration has them)."""

    init_from: str | None
    init_proj: str | None
    image_backbone: str | None
    text_model: str | None
    image_size: int | None
    freeze_image: bool | None


def start_fields(cfg: StartFlags) -> dict:
    """The training config's fields ``--init-from`` fills: its towers and image size, unless given; the
    projections as they are (no ridge start); the image tower learning unless --freeze-image.

    Raises:
        ValueError: --init-from is not a whole dual encoder's directory, or --init-proj ridge is asked for.
    """
    if start_kind(cfg.init_from) not in WHOLE:
        raise ValueError(
            f"--init-from {cfg.init_from}: not an open_clip model directory ({OPEN_CLIP_CONFIG}) nor a Hugging "
            "Face CLIP / SigLIP directory"
        )
    if cfg.init_proj == "ridge":
        raise ValueError("--init-proj ridge: --init-from's towers bring their own projections")
    return {
        "image_backbone": cfg.image_backbone or cfg.init_from,
        "text_model": cfg.text_model or cfg.init_from,
        "image_size": cfg.image_size or start_preprocess(cfg.init_from).get("image_size"),
        "freeze_image": bool(cfg.freeze_image),
        "init_proj": "random",
    }


def _fields(size, mean, std) -> dict:
    if isinstance(size, list | tuple):
        size = size[-1]
    out = {"image_size": int(size)} if isinstance(size, int | float) and size else {}
    return out | {k: tuple(float(x) for x in v) for k, v in (("mean", mean), ("std", std)) if v and len(v) == 3}


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
