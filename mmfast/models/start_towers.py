"""Towers that start from a model the user has on disk, offline: a Hugging Face CLIP directory (its vision and
text towers, each with its projection), a SigLIP directory's vision tower, another Hugging Face vision model,
and an open_clip model directory (its visual tower and its text tower, open_clip's own transformer or a Hugging
Face encoder, each with its projection).

A tower whose output already lies in its pair's embedding space is ``projected``: the dual encoder adds no
projection after it. Each tower keeps a ``record`` (its architecture, no weights): ``tower_from_record``
rebuilds it with random weights, which a model directory's weights then replace, without the directory it
started from. Both towers of one start carry the start's temperature (``start``), which the dual encoder takes.
"""

from __future__ import annotations

import inspect
import json
import os
import tempfile
from pathlib import Path

import torch
from torch import nn

from mmfast.models.encoders import ImageEncoder, quiet_transformers
from mmfast.models.open_clip_text import OpenClipText, check_text_cfg
from mmfast.models.start_dirs import OPEN_CLIP_CONFIG, start_kind, start_preprocess
from mmfast.util.voice import setting

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # OpenAI CLIP's normalization: a processor that names none
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
# open_clip's preferred weight files, in its own order (open_clip/factory.py's _find_checkpoint_in_dir)
OPEN_CLIP_WEIGHTS = ("open_clip_model.safetensors", "open_clip_pytorch_model.safetensors",
                     "open_clip_pytorch_model.bin", "model.safetensors", "pytorch_model.bin")  # fmt: skip


class StartTower(nn.Module):
    """A pretrained tower: trains at the encoders' learning rate; frozen (LiT), it stays in eval mode."""

    pretrained = True
    projected = True
    fmap = False  # no (B, C, h, w) feature map: early fusion cannot take it

    def __init__(self, module: nn.Module, width: int, record: dict, freeze: bool, start: dict | None):
        super().__init__()
        self.module, self.width, self.record, self.start = module, width, record, start
        self.frozen = freeze
        if freeze:
            self.requires_grad_(False)

    def train(self, mode: bool = True):
        return super().train(mode and not self.frozen)


class ImageStart(StartTower):
    """``forward(images)`` -> (embedding or pooled features (B, D), None); ``mean`` / ``std`` on the 0..1 scale;
    ``geometry``: the start's eval resize that mmfast follows (``start_preprocess``'s interpolation, resize_mode,
    crop_ratio)."""

    def __init__(self, module, width, record, freeze, start, mean, std, projected: bool = True, geometry=None):
        super().__init__(module, width, record, freeze, start)
        self.mean, self.std, self.projected = tuple(mean), tuple(std), projected
        self.geometry = dict(geometry or {})
        # position embeddings of another size are interpolated (a model without them takes no such argument)
        self.interpolates = "interpolate_pos_encoding" in inspect.signature(module.forward).parameters

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, None]:
        images = images.to(next(self.module.parameters()).dtype)
        kind = self.record["kind"]
        if kind == "open_clip":
            return self.module(images), None
        resized = self.interpolates and images.shape[-1] != self.record["size"]
        out = self.module(pixel_values=images, **({"interpolate_pos_encoding": True} if resized else {}))
        if kind == "hf-clip":
            return out.image_embeds, None
        pooled = getattr(out, "pooler_output", None)
        return (pooled if pooled is not None else out.last_hidden_state.mean(1)), None


class TextStart(StartTower):
    """``forward(input_ids, attention_mask)`` -> the caption's embedding (B, D)."""

    @property
    def max_positions(self) -> int | None:
        """The positions the tower has (a caption's longest row), when it says."""
        config = getattr(self.module, "config", None)
        return getattr(self.module, "max_positions", None) or getattr(config, "max_position_embeddings", None)

    @property
    def onnx_dynamo(self) -> bool:
        """Whether the tower's ONNX graph must go through ``torch.export`` to keep its caption length dynamic."""
        return bool(getattr(self.module, "onnx_dynamo", False))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        if self.record["kind"] == "open_clip":
            # open_clip's HFTextEncoder masks the tokenizer's pad id itself; its own transformer is causal
            return self.module(input_ids)
        return self.module(input_ids=input_ids, attention_mask=attention_mask).text_embeds


def image_tower_from(path: str | os.PathLike, freeze: bool = False) -> ImageStart:
    """The image tower of a directory: open_clip's visual, CLIP's vision tower + projection, SigLIP's vision
    tower, or a Hugging Face vision model (``AutoModel``: its pooled output, projected later).

    Raises:
        ValueError: the directory holds no image tower mmfast can take.
    """
    kind, path = start_kind(path), Path(path)
    pre = start_preprocess(path)
    mean, std = pre.get("mean", CLIP_MEAN), pre.get("std", CLIP_STD)
    geometry = {k: pre[k] for k in ("interpolation", "resize_mode", "crop_ratio") if k in pre}
    if kind == "open_clip":
        cfg = _open_clip_cfg(path)
        visual = _open_clip_part(path, cfg, "visual")
        record = {"kind": kind, "part": "visual", "model_cfg": cfg["model_cfg"], "size": pre.get("image_size")}
        width = cfg["model_cfg"]["embed_dim"]
        return ImageStart(visual, width, record, freeze, _start(path), mean, std, geometry=geometry)
    # transformers: a slow import, only for a Hugging Face model or tokenizer
    from transformers import AutoConfig, AutoModel, CLIPVisionModelWithProjection, SiglipVisionModel

    config = AutoConfig.from_pretrained(path)
    if kind == "hf-clip":
        module = _quiet_load(CLIPVisionModelWithProjection, path, _projected(config, "vision_config"))
        width = config.projection_dim
    elif kind == "hf-siglip":
        module = _quiet_load(SiglipVisionModel, path)
        width = config.vision_config.hidden_size
    elif kind == "hf":
        module = _quiet_load(AutoModel, path)
        width = getattr(config, "hidden_size", None) or config.hidden_sizes[-1]
    else:
        given = setting("image_backbone", value=str(path))
        raise ValueError(f"{given}: not a model directory mmfast can start from")
    record = {"kind": kind, "config": module.config.to_dict(), "size": _vision_size(module.config)}
    return ImageStart(module, width, record, freeze, _start(path, kind), mean, std, kind != "hf", geometry)


def text_tower_from(path: str | os.PathLike, freeze: bool = False) -> TextStart:
    """The text tower of an open_clip directory (open_clip's own text transformer, or its Hugging Face text
    tower) or of a CLIP directory.

    Raises:
        ValueError: the directory's text tower is one mmfast cannot take (one that reads a caption padded to its
            full length: SigLIP's, a bidirectional open_clip text transformer).
    """
    kind, path = start_kind(path), Path(path)
    given = setting("text_model", value=str(path))
    if kind == "open_clip":
        cfg = _open_clip_cfg(path)
        record = {"kind": kind, "part": "text", "model_cfg": cfg["model_cfg"]}
        if not _hf_text(cfg["model_cfg"]):
            check_text_cfg(cfg["model_cfg"].get("text_cfg", {}), given)
        text = _open_clip_part(path, cfg, "text")
        if _hf_text(cfg["model_cfg"]):
            record["hf_config"] = text.config.to_dict()
        return TextStart(text, cfg["model_cfg"]["embed_dim"], record, freeze, _start(path))
    if kind == "hf-siglip":
        raise ValueError(
            f"{given}: SigLIP's text tower reads the last position of a caption padded to its full length, and "
            "mmfast pads to the longest caption of a batch; start its image tower (--image-backbone) only"
        )
    if kind != "hf-clip":
        raise ValueError(f"{given}: not a CLIP or open_clip directory")
    # transformers: a slow import, only for a Hugging Face model or tokenizer
    from transformers import AutoConfig, CLIPTextModelWithProjection

    config = _projected(AutoConfig.from_pretrained(path), "text_config")
    module = _quiet_load(CLIPTextModelWithProjection, path, config)
    record = {"kind": kind, "config": module.config.to_dict()}
    return TextStart(module, module.config.projection_dim, record, freeze, _start(path, kind))


def tower_from_record(record: dict, modality: str, pool: str = "last") -> nn.Module:
    """A tower rebuilt from its ``record`` with random weights (a model directory's replace them), offline; a
    timm tower pools as ``pool`` says (``ImageEncoder``)."""
    if record["kind"] == "timm":
        return ImageEncoder(f"timm:{record['architecture']}", model_args=record.get("model_args"), pool=pool)
    if record["kind"] == "open_clip":
        with tempfile.TemporaryDirectory(prefix="mmfast-open_clip-") as tmp:
            module = _open_clip_part(Path(tmp), {"model_cfg": record["model_cfg"]}, record["part"], record)
        width = record["model_cfg"]["embed_dim"]
        if modality == "image":
            return ImageStart(module, width, record, False, None, CLIP_MEAN, CLIP_STD)
        return TextStart(module, width, record, False, None)
    # transformers: a slow import, only for a Hugging Face model or tokenizer
    from transformers import (
        AutoConfig,
        AutoModel,
        CLIPTextModelWithProjection,
        CLIPVisionModelWithProjection,
        SiglipVisionModel,
    )

    spec = dict(record["config"])
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    if modality == "text":
        module = CLIPTextModelWithProjection(config)
        return TextStart(module, config.projection_dim, record, False, None)
    cls = {"hf-clip": CLIPVisionModelWithProjection, "hf-siglip": SiglipVisionModel}.get(record["kind"])
    module = cls(config) if cls is not None else AutoModel.from_config(config)
    width = (
        config.projection_dim if record["kind"] == "hf-clip"
        else getattr(config, "hidden_size", None) or config.hidden_sizes[-1]
    )  # fmt: skip
    return ImageStart(module, width, record, False, None, CLIP_MEAN, CLIP_STD, projected=record["kind"] != "hf")


def _start(path: Path, kind: str | None = None) -> dict:
    """The start both towers of one directory share: its path and the temperature (and bias) it learned."""
    scale, bias = None, None
    if kind in ("hf-clip", "hf-siglip"):
        config = json.loads((path / "config.json").read_text())
        scale = _checkpoint_scalar(path, "logit_scale")
        bias = _checkpoint_scalar(path, "logit_bias")
        scale = scale if scale is not None else config.get("logit_scale_init_value")
    elif kind is None:  # open_clip
        scale, bias = _checkpoint_scalar(path, "logit_scale"), _checkpoint_scalar(path, "logit_bias")
    return {"path": str(path.resolve()), "logit_scale": scale, "logit_bias": bias}


def _checkpoint_scalar(path: Path, key: str) -> float | None:
    """A 0-dim (or 1-element) tensor of the directory's weights, by name; None when absent."""
    from safetensors import safe_open  # safetensors: only when weights are read or written

    for name in (*OPEN_CLIP_WEIGHTS[:2], "model.safetensors"):
        if (path / name).is_file():
            with safe_open(str(path / name), "pt") as f:
                return float(f.get_tensor(key).reshape(-1)[0]) if key in f.keys() else None
    return None


def _vision_size(config) -> int | None:
    size = getattr(config, "image_size", None)
    size = size or getattr(getattr(config, "vision_config", None), "image_size", None)
    return int(size) if isinstance(size, int) else None


def _projected(config, part: str):
    """A CLIP config's tower config, with the pair's projection width (a tower's own may keep its default)."""
    tower = getattr(config, part)
    tower.projection_dim = config.projection_dim
    return tower


def _quiet_load(cls, path: Path, config=None):
    with quiet_transformers():  # its load report lists the other tower's weights, left out on purpose
        return cls.from_pretrained(str(path), **({"config": config} if config is not None else {}))


def _open_clip_cfg(path: Path) -> dict:
    cfg = json.loads((path / OPEN_CLIP_CONFIG).read_text(encoding="utf-8"))
    if "model_cfg" not in cfg:
        raise ValueError(f"{path / OPEN_CLIP_CONFIG}: has no 'model_cfg'; not an open_clip model directory")
    return cfg


def _open_clip_part(path: Path, cfg: dict, part: str, record: dict | None = None) -> nn.Module:
    """open_clip's ``visual`` or ``text`` tower of the model ``cfg`` describes, with the directory's weights
    (random weights when rebuilt from a ``record``: ``path`` is then an empty temp directory)."""
    try:
        # open_clip: optional (mmfast[peers]), only for an open_clip directory
        from open_clip.model import _build_text_tower, _build_vision_tower
    except ImportError as e:
        raise ValueError(f"{path}: an open_clip model needs open_clip (pip install 'mmfast[peers]')") from e
    model_cfg = cfg["model_cfg"]
    quick_gelu = bool(model_cfg.get("quick_gelu", False))
    if part == "visual":
        vision = dict(model_cfg["vision_cfg"], timm_model_pretrained=False)
        module = _build_vision_tower(model_cfg["embed_dim"], vision, quick_gelu)
    elif not _hf_text(model_cfg):
        module = OpenClipText(_build_text_tower(model_cfg["embed_dim"], model_cfg.get("text_cfg", {}), quick_gelu))
    else:
        text_cfg = dict(model_cfg["text_cfg"], hf_model_pretrained=False)
        if record is not None:  # the text encoder's architecture, as recorded
            (path / "config.json").write_text(json.dumps(record["hf_config"]))
        text_cfg["hf_model_name"] = _hf_config_dir(path, text_cfg["hf_model_name"])
        with quiet_transformers():
            module = _build_text_tower(model_cfg["embed_dim"], text_cfg, quick_gelu)
    if record is None:
        _load_part(module, path, part)
    return module


def _hf_text(model_cfg: dict) -> bool:
    """Whether an open_clip model's text tower is a Hugging Face encoder (else open_clip's own transformer)."""
    return bool(model_cfg.get("text_cfg", {}).get("hf_model_name"))


def _hf_config_dir(path: Path, name: str) -> str:
    """Where the text encoder's config.json is: the directory itself when it holds one (as mmfast's export and
    open_clip's push_to_hf_hub write it), else ``hf_model_name`` as the checkpoint names it."""
    return str(path) if (path / "config.json").is_file() else name


def _load_part(module: nn.Module, path: Path, part: str) -> None:
    # open_clip: optional (mmfast[peers]), only for an open_clip directory
    from open_clip.factory import load_state_dict

    weights = next((path / n for n in OPEN_CLIP_WEIGHTS if (path / n).is_file()), None)
    if weights is None:
        raise ValueError(f"{path}: no open_clip weights ({', '.join(OPEN_CLIP_WEIGHTS)})")
    state = load_state_dict(str(weights))
    prefix = f"{part}."
    if isinstance(module, OpenClipText):  # CLIP keeps its text tower's tensors at the top (CustomTextCLIP: text.)
        module = module.tower
        custom = any(k.startswith(prefix) for k in state)
        prefix = prefix if custom else ""
        state = {k: v for k, v in state.items() if custom or not k.startswith(("visual.", "logit_"))}
    own = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
    own.pop("transformer.embeddings.position_ids", None)  # older transformers kept it in the weights
    try:
        module.load_state_dict(own, strict=True)
    except RuntimeError as e:
        raise ValueError(f"{weights}: its {part} weights do not fit {path / OPEN_CLIP_CONFIG}: {e}") from e
