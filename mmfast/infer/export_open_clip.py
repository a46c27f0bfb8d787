"""Write a dual encoder as an open_clip model directory, which open_clip's own factory loads:

    model, _, preprocess = open_clip.create_model_and_transforms("local-dir:OUT/open_clip")
    tokenizer = open_clip.get_tokenizer("local-dir:OUT/open_clip")

The directory holds ``open_clip_config.json`` (a ``CustomTextCLIP``: a timm image tower and a Hugging Face text
tower, each with a bias-free linear projection, the text read by the mean of its token states),
``open_clip_model.safetensors``, the tokenizer and the text encoder's ``config.json``.

open_clip reads the text encoder's architecture from the path in ``text_cfg.hf_model_name``: this directory's
absolute path, so a moved copy needs that field changed, or given again to the factory (models-in-and-out.md).
Its eval transform resizes the shorter side to the image size and crops the centre; mmfast's evaluation resizes
it to size / crop_ratio first (a tighter centre), unless the model started from a checkpoint that crops none.
open_clip cannot express that ratio: ``preprocess_cfg`` records the rest (size, mean, std, the filter and resize
mode), and the pixels of mmfast's own preprocessing give the same embeddings in both.

A model started from an open_clip directory goes back under that directory's config. With open_clip's own text
transformer there are no tokenizer files: open_clip builds its SimpleTokenizer, and the context length is
mmfast's max_length (the positional embeddings cut to it), so both cut a long caption at the same token.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from mmfast.data.preprocessing import eval_resize
from mmfast.infer.peer_towers import (
    INSTEAD,
    OPEN_CLIP_TEXT_TYPES,
    FormatRefusal,
    logit_scale_and_bias,
    mean_pooled_text,
    projections,
    refuse_starts,
    start_kinds,
    text_config,
    timm_image,
)
from mmfast.util.fsutil import atomic_dir, shared_modes
from mmfast.util.locks import file_lock

FORMAT = "open_clip"
CONFIG_FILE = "open_clip_config.json"
WEIGHTS_FILE = "open_clip_model.safetensors"


def open_clip_config(model, out: Path) -> dict:
    """``open_clip_config.json`` of the model, written to live at ``out`` (its text tower's config is there).

    Raises:
        FormatRefusal: a tower open_clip cannot build.
    """
    if start_kinds(model) == ("open_clip", "open_clip"):
        return _started_config(model, out)
    refuse_starts(model, FORMAT, "hf")
    image_proj, _ = projections(model, FORMAT)
    image = timm_image(model, FORMAT)
    if image.model_args:
        raise FormatRefusal(
            f"--format {FORMAT}: open_clip builds a timm image tower by name only, and image backbone "
            f"'{model.config['image_backbone']}' is timm's {image.name} with {image.model_args}; {INSTEAD}, or "
            f"--format hf"
        )
    text = mean_pooled_text(model, FORMAT)
    if text.config.model_type not in OPEN_CLIP_TEXT_TYPES:
        raise FormatRefusal(
            f"--format {FORMAT}: open_clip's Hugging Face text tower takes {', '.join(OPEN_CLIP_TEXT_TYPES)} "
            f"models, not '{text.config.model_type}' (text model '{model.config['text_model']}'); {INSTEAD}, or "
            f"--format hf"
        )
    scale, bias = logit_scale_and_bias(model)
    config = model.config
    size = int(config["image_size"])
    model_cfg = {
        "embed_dim": int(image_proj.shape[0]),
        "custom_text": True,
        "init_logit_scale": scale,
        **({"init_logit_bias": bias} if bias is not None else {}),
        "vision_cfg": {
            "image_size": size,
            "timm_model_name": image.name,
            "timm_model_pretrained": False,
            "timm_pool": "avg",
            "timm_proj": "linear",
            "timm_proj_bias": False,
        },
        "text_cfg": {
            "context_length": int(config["max_length"]),
            "hf_model_name": str(out.resolve()),
            "hf_tokenizer_name": str(out.resolve()),
            "hf_model_pretrained": False,
            "hf_proj_type": "linear",
            "hf_pooler_type": "mean_pooler",
        },
    }
    return {"model_cfg": model_cfg, "preprocess_cfg": _preprocess(config)}


def _preprocess(config: dict) -> dict:
    """open_clip's preprocess_cfg of the model's eval preprocessing: all of it, but a crop ratio below 1
    (module docstring)."""
    resize = eval_resize(config)
    return {
        "size": int(config["image_size"]),
        "mean": list(config["mean"] or (0.5,) * 3),
        "std": list(config["std"] or (0.5,) * 3),
        "interpolation": resize["interpolation"],
        "resize_mode": resize["resize_mode"],
    }


def _started_config(model, out: Path) -> dict:
    """The config of a model whose towers both started from an open_clip directory: that model's, its text
    tower's architecture read from ``out``, its temperature and preprocessing as trained here."""
    model_cfg = json.loads(json.dumps(model.model.image.record["model_cfg"]))  # a copy
    scale, bias = logit_scale_and_bias(model)
    model_cfg["init_logit_scale"] = scale
    model_cfg.pop("init_logit_bias", None)
    model_cfg |= {"init_logit_bias": bias} if bias is not None else {}
    text_cfg = model_cfg.setdefault("text_cfg", {})
    if _own_text(model):  # open_clip's own tokenizer: it cuts captions where mmfast's token cache does
        text_cfg["context_length"] = _context_length(model)
        return {"model_cfg": model_cfg, "preprocess_cfg": _preprocess(model.config)}
    text_cfg = dict(text_cfg, hf_model_name=str(out.resolve()), hf_tokenizer_name=str(out.resolve()))
    model_cfg["text_cfg"] = dict(text_cfg, context_length=int(model.config["max_length"]))
    return {"model_cfg": model_cfg, "preprocess_cfg": _preprocess(model.config)}


def _own_text(model) -> bool:
    """Whether the text tower is open_clip's own transformer (``OpenClipText``), not a Hugging Face encoder."""
    return hasattr(model.model.text.module, "tower")


def _context_length(model) -> int:
    """The rows open_clip's tokenizer makes for the export: mmfast's max_length, at most the start's context."""
    return min(int(model.config["max_length"]), int(model.model.text.module.tower.context_length))


def _own_text_state(model) -> dict:
    """open_clip's text transformer's tensors under its names: ``text.`` in a ``CustomTextCLIP``, at the top in a
    ``CLIP``; the positional embeddings cut to the export's context length."""
    state = dict(model.model.text.module.tower.state_dict())
    state["positional_embedding"] = state["positional_embedding"][: _context_length(model)]
    prefix = "text." if model.model.image.record["model_cfg"].get("custom_text") else ""
    return {f"{prefix}{k}": v for k, v in state.items()}


def open_clip_state(model) -> dict:
    """The network's weights under ``CustomTextCLIP``'s names."""
    if start_kinds(model) == ("open_clip", "open_clip"):
        net = model.model
        state = {f"visual.{k}": v for k, v in net.image.module.state_dict().items()}
        if _own_text(model):
            return _with_temperature(model, state | _own_text_state(model))
        state |= {f"text.{k}": v for k, v in net.text.module.state_dict().items()}
        return _with_temperature(model, state)
    image_proj, text_proj = projections(model, FORMAT)
    image, text = timm_image(model, FORMAT), mean_pooled_text(model, FORMAT)
    state = {f"visual.trunk.{k}": v for k, v in image.trunk.items()}
    state["visual.head.proj.weight"] = image_proj
    state |= {f"text.transformer.{k}": v.detach().cpu() for k, v in text.state_dict().items()}
    state["text.proj.weight"] = text_proj
    return _with_temperature(model, state)


def _with_temperature(model, state: dict) -> dict:
    """``state`` with the learned temperature (and SigLIP's bias), every tensor a CPU copy of its own."""
    _, bias = logit_scale_and_bias(model)
    state["logit_scale"] = model.model.logit_scale.reshape(())
    if bias is not None:
        state["logit_bias"] = model.model.logit_bias.reshape(())
    return {k: v.detach().cpu().contiguous().clone() for k, v in state.items()}


def write_open_clip(model, out: str | os.PathLike, home: str | os.PathLike | None = None) -> Path:
    """Write ``out`` (replaced when mmfast wrote it) as an open_clip model directory.

    Args:
        model: an ``MmfastModel`` holding a dual encoder.
        out: the directory.
        home: where the directory will be read from, when it is written elsewhere first and moved there (its
            config names that folder: module docstring); default ``out``.

    Returns:
        ``out``.

    Raises:
        FormatRefusal: the model, or a tower of it, is not one open_clip builds.
    """
    from safetensors.torch import save_file  # safetensors: only when weights are read or written

    out = Path(out)
    config = open_clip_config(model, Path(home or out))  # refusals before anything is written
    state = open_clip_state(model)
    own = start_kinds(model)[1] is not None and _own_text(model)  # open_clip's tokenizer: nothing more to write
    text = None if own else _hf_text_config(model)
    with file_lock(out.parent / f".{out.name}.lock"), atomic_dir(out, "mmfast open_clip export") as tmp:
        save_file(state, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        if text is not None:
            text_config(text, model.tokenizer).save_pretrained(str(tmp))  # config.json: what hf_model_name reads
            model.tokenizer.save_pretrained(str(tmp))
        shared_modes(tmp)
    return out


def _hf_text_config(model):
    """The Hugging Face text encoder's config (a started open_clip model's, or mmfast's own encoder's)."""
    return model.model.text.module.config if start_kinds(model)[1] else mean_pooled_text(model, FORMAT).config
