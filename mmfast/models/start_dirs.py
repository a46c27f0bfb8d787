"""What a model directory on disk is, read from its config files without torch: an open_clip model directory, a
Hugging Face CLIP or SigLIP directory, a timm model in timm's Hugging Face layout, or another Hugging Face model.
``mmfast-train --init-from`` (and ``--image-backbone`` / ``--text-model`` given such a directory) starts from it;
its preprocessing (image size, mean and std, the eval resize) comes from here too."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from mmfast.data.preprocessing import INTERPOLATIONS, RESIZE_MODES
from mmfast.data.tokenizer import OPEN_CLIP_CONFIG
from mmfast.util.fsutil import read_json_object

WHOLE = ("open_clip", "hf-clip", "hf-siglip")  # the kinds that hold both towers and their temperature


def start_kind(path: str | os.PathLike | None) -> str | None:
    """The kind of model a directory holds: "open_clip", "hf-clip", "hf-siglip", "timm" or "hf"; None for a
    name or a path that is not a directory."""
    if path is None or not Path(path).is_dir():
        return None
    path = Path(path)
    if (path / OPEN_CLIP_CONFIG).is_file():
        return "open_clip"
    config = read_json_object(path / "config.json")
    if "architecture" in config and "model_type" not in config:
        return "timm"
    kind = str(config.get("model_type", ""))
    if kind in ("clip", "siglip"):
        return f"hf-{kind}"
    return "hf" if config else None


def start_preprocess(path: str | os.PathLike) -> dict:
    """The preprocessing a directory's model was trained with: {"image_size", "mean", "std"} and its eval
    geometry {"interpolation", "resize_mode", "crop_ratio"}, each present when the directory says it and mmfast
    can follow it (open_clip's preprocess_cfg, a processor's preprocessor_config.json, timm's pretrained_cfg).

    Returns:
        the fields found; a geometry mmfast cannot reproduce (open_clip's "longest", a nearest-neighbour
        resize) is left out, so mmfast's own stands in.
    """
    path, kind = Path(path), start_kind(path)
    if kind == "open_clip":
        cfg = read_json_object(path / OPEN_CLIP_CONFIG)
        pre = cfg.get("preprocess_cfg", {})
        size = pre.get("size") or cfg.get("model_cfg", {}).get("vision_cfg", {}).get("image_size")
        # open_clip's defaults (its PreprocessCfg): bicubic, the shorter side resized to the size, no margin
        mode = pre.get("resize_mode", "shortest")
        return _fields(size, pre.get("mean"), pre.get("std")) | _geometry(
            pre.get("interpolation", "bicubic"), mode, 1.0 if mode == "shortest" else None
        )
    if kind == "timm":
        pre = read_json_object(path / "config.json").get("pretrained_cfg", {})
        mode = {"center": "shortest", "squash": "squash"}.get(pre.get("crop_mode", "center"))
        geometry = _geometry(pre.get("interpolation"), mode, pre.get("crop_pct"))
        return _fields((pre.get("input_size") or [None, None])[-1], pre.get("mean"), pre.get("std")) | geometry
    pre = read_json_object(path / "preprocessor_config.json")
    return _fields(_processor_size(pre), pre.get("image_mean"), pre.get("image_std")) | _processor_geometry(pre)


def _processor_size(pre: dict):
    size = pre.get("crop_size") if pre.get("do_center_crop", "crop_size" in pre) else None
    size = size or pre.get("size")
    if isinstance(size, dict):
        size = size.get("height") or size.get("shortest_edge")
    return size


def _processor_geometry(pre: dict) -> dict:
    """A Hugging Face image processor's eval geometry: CLIP's shortest edge + centre crop, or SigLIP's resize
    to height x width. Its resample is PIL's number (2: bilinear, 3: bicubic)."""
    filters = {2: "bilinear", 3: "bicubic"}
    size, crop = pre.get("size"), pre.get("crop_size")
    crops = pre.get("do_center_crop", crop is not None)
    if isinstance(size, dict) and "shortest_edge" in size:
        crop = crop.get("height") if isinstance(crop, dict) else crop
        ratio = crop / size["shortest_edge"] if crops and crop else 1.0
        return _geometry(filters.get(pre.get("resample")), "shortest", ratio)
    if isinstance(size, dict) and "height" in size and not crops:
        return _geometry(filters.get(pre.get("resample")), "squash", None)
    return _geometry(filters.get(pre.get("resample")), None, None)


def _geometry(interpolation, mode, crop_ratio) -> dict:
    """The fields mmfast can follow: a known filter, a known resize mode, a crop ratio in (0, 1]."""
    out = {"interpolation": interpolation} if interpolation in INTERPOLATIONS else {}
    if mode in RESIZE_MODES:
        out["resize_mode"] = mode
    if mode == "shortest" and isinstance(crop_ratio, int | float) and 0 < crop_ratio <= 1:
        out["crop_ratio"] = float(crop_ratio)
    return out


def start_embed_dim(path: str | os.PathLike) -> int | None:
    """The embedding width of a whole dual encoder's directory (open_clip, CLIP, SigLIP); None for another."""
    path, kind = Path(path), start_kind(path)
    if kind == "open_clip":
        return read_json_object(path / OPEN_CLIP_CONFIG).get("model_cfg", {}).get("embed_dim")
    config = read_json_object(path / "config.json")
    if kind == "hf-clip":
        return config.get("projection_dim", 512)
    if kind == "hf-siglip":
        return config.get("vision_config", {}).get("hidden_size", 768)
    return None


@dataclass(frozen=True)
class StartFlags:
    """The training flags ``start_fields`` reads, as the training configuration names them."""

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
