"""Write a model's towers as Hugging Face model directories, which stock ``transformers`` (and timm, and
sentence-transformers for the text) load without mmfast:

    OUT/hf/image/   a timm model in timm's Hugging Face layout (config.json + model.safetensors): transformers'
                    ``AutoModelForImageClassification`` and ``AutoImageProcessor`` (TimmWrapper) load it, and so
                    does ``timm.create_model("local-dir:OUT/hf/image", pretrained=True)``
    OUT/hf/text/    the text encoder (``AutoModel``), its tokenizer, and the sentence-transformers modules that
                    read it (mean of the token states, the projection, L2 normalization)
    OUT/hf/towers.json  what each folder is, the embedding width, the learned temperature (and SigLIP's bias)

A dual encoder's image folder is a classifier whose head is the image projection: its ``logits`` are the image
embedding before normalization (the head's bias is zero). The image processor resizes the shorter side to the
size / crop_ratio of mmfast's evaluation and crops the centre (or squashes the picture), with the model's filter,
mean and std.

transformers' ``VisionTextDualEncoderModel`` reads a text tower's ``pooler_output`` (BERT's [CLS] pooler), which
is not mmfast's mean over tokens, so the towers are written as separate models. A fusion classifier's towers
are written the same way without projections; its fusion head stays in ONNX / ``torch.export``.

A model whose towers both started from a pair goes back as one ``CLIPModel``: a Hugging Face CLIP as it is
(``_write_clip``), a standard open_clip CLIP mapped onto it (``mmfast.infer.export_hf_clip``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from mmfast.data.preprocessing import eval_resize
from mmfast.infer.export_hf_clip import (
    clip_processor,
    is_open_clip_clip,
    open_clip_towers,
    write_open_clip_as_clip,
)
from mmfast.infer.peer_towers import (
    FormatRefusal,
    TimmImage,
    eval_geometry,
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

FORMAT = "hf"
TOWERS_FILE = "towers.json"
# sentence-transformers' modules, as its v2 layout names them (every later version reads that layout)
_ST_MODULES = "sentence_transformers.models."


def hf_towers(model) -> tuple[TimmImage | None, object, torch.Tensor | None, torch.Tensor | None]:
    """What ``write_hf`` writes of the model: (image tower, text encoder, image projection, text projection),
    None for what it has not (a fusion classifier has no projections).

    Raises:
        FormatRefusal: a tower that transformers cannot build.
    """
    if is_open_clip_clip(model):
        open_clip_towers(model)  # refused here, before anything is written, unless both towers are CLIP's
        return None, None, None, None
    if start_kinds(model) == ("hf-clip", "hf-clip"):
        return None, None, None, None  # a CLIPModel (``_write_clip``, ``write_open_clip_as_clip``)
    refuse_starts(model, FORMAT, "open_clip")
    net = model.model
    image_proj, text_proj = projections(model, FORMAT) if model.embeds else (None, None)
    image = timm_image(model, FORMAT) if getattr(net, "image", None) is not None else None
    text = mean_pooled_text(model, FORMAT) if getattr(net, "text", None) is not None else None
    return image, text, image_proj, text_proj


def write_hf(model, out: str | os.PathLike) -> Path:
    """Write ``out`` (replaced when mmfast wrote it): ``image/``, ``text/`` and ``towers.json``.

    Args:
        model: an ``MmfastModel`` (a dual encoder, or a fusion classifier: its towers only).
        out: the directory.

    Returns:
        ``out``.

    Raises:
        FormatRefusal: a tower that transformers cannot build.
    """
    out = Path(out)
    image, text, image_proj, text_proj = hf_towers(model)
    if image is None and text is None:
        write = write_open_clip_as_clip if is_open_clip_clip(model) else _write_clip
        with file_lock(out.parent / f".{out.name}.lock"), atomic_dir(out, "mmfast hf export") as tmp:
            write(model, tmp)
            shared_modes(tmp)
        return out
    towers = {"format": "mmfast-towers/1", "model": model.config["model"]}
    with file_lock(out.parent / f".{out.name}.lock"), atomic_dir(out, "mmfast hf export") as tmp:
        if image is not None:
            _write_image(image, image_proj, model.config, tmp / "image")
            towers["image"] = "image"
        if text is not None:
            _write_text(text, text_proj, model, tmp / "text")
            towers["text"] = "text"
        if model.embeds:
            scale, bias = logit_scale_and_bias(model)
            towers |= {"embed_dim": int(image_proj.shape[0]), "loss": model.config.get("loss", "clip")}
            towers |= {"logit_scale": scale, "logit_bias": bias}
        (tmp / TOWERS_FILE).write_text(json.dumps(towers, indent=2) + "\n")
        shared_modes(tmp)
    return out


def timm_hf_config(image: TimmImage, config: dict, num_classes: int) -> dict:
    """timm's config.json of the image tower: its architecture, head width and eval preprocessing."""
    size, resized = eval_geometry(config)
    resize = eval_resize(config)
    pretrained_cfg = {
        "input_size": [3, size, size],
        "fixed_input_size": False,
        "interpolation": resize["interpolation"],
        # timm resizes to floor(size / crop_pct): a quarter pixel above the side keeps it off the boundary
        "crop_pct": size / (resized + 0.25),
        "crop_mode": "squash" if resize["resize_mode"] == "squash" else "center",
        "mean": list(config["mean"] or (0.5,) * 3),
        "std": list(config["std"] or (0.5,) * 3),
        "num_classes": num_classes,
    }
    out = {
        "architecture": image.name,
        "num_classes": num_classes,
        "num_features": image.width,
        "global_pool": "avg",
        "pretrained_cfg": pretrained_cfg,
    }
    if image.model_args:
        out["model_args"] = image.model_args
    return out


def _write_image(image: TimmImage, proj: torch.Tensor | None, config: dict, out: Path) -> None:
    """The timm model with the projection as its classifier (a dual encoder's), or without a classifier."""
    import timm  # only this format needs it at export time
    from safetensors.torch import save_file

    num_classes = 0 if proj is None else int(proj.shape[0])
    net = timm.create_model(image.name, pretrained=False, num_classes=num_classes, **image.model_args)
    state = dict(image.trunk)
    if proj is not None:
        head = net.pretrained_cfg.get("classifier") or "head"
        state[f"{head}.weight"] = proj
        state[f"{head}.bias"] = torch.zeros(num_classes)
    missing, unexpected = net.load_state_dict(state, strict=False)
    if missing or unexpected:  # a timm whose network differs from the one trained
        raise FormatRefusal(
            f"--format {FORMAT}: timm's {image.name} does not take the image tower's weights ({len(missing)} "
            f"missing, e.g. {missing[:2]}; {len(unexpected)} unexpected, e.g. {unexpected[:2]})"
        )
    out.mkdir()
    save_file({k: v.contiguous().clone() for k, v in net.state_dict().items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(timm_hf_config(image, config, num_classes), indent=2) + "\n")


def _write_text(text, proj: torch.Tensor | None, model, out: Path) -> None:
    """The encoder and tokenizer, and sentence-transformers' modules (mean pooling, the projection, L2 norm)."""
    from safetensors.torch import save_file  # safetensors: only when weights are read or written

    out.mkdir()
    text_config(text.config, model.tokenizer).save_pretrained(str(out))
    weights = {k: v.detach().cpu().contiguous().clone() for k, v in text.state_dict().items()}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    model.tokenizer.save_pretrained(str(out))
    width = int(text.config.hidden_size)
    modules = [("", "Transformer"), ("1_Pooling", "Pooling")]
    (out / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": int(model.config["max_length"]), "do_lower_case": False}, indent=2) + "\n"
    )
    pooling = {"word_embedding_dimension": width, "pooling_mode_mean_tokens": True}
    pooling |= {"pooling_mode_cls_token": False, "pooling_mode_max_tokens": False}
    (out / "1_Pooling").mkdir()
    (out / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=2) + "\n")
    if proj is not None:
        dense = {"in_features": width, "out_features": int(proj.shape[0]), "bias": False}
        dense["activation_function"] = "torch.nn.modules.linear.Identity"
        (out / "2_Dense").mkdir()
        (out / "2_Dense" / "config.json").write_text(json.dumps(dense, indent=2) + "\n")
        save_file({"linear.weight": proj.contiguous().clone()}, str(out / "2_Dense" / "model.safetensors"))
        modules += [("2_Dense", "Dense"), ("3_Normalize", "Normalize")]
    listing = [
        {"idx": i, "name": str(i), "path": path, "type": _ST_MODULES + kind}
        for i, (path, kind) in enumerate(modules)
    ]
    (out / "modules.json").write_text(json.dumps(listing, indent=2) + "\n")


def _write_clip(model, out: Path) -> None:
    """A dual encoder whose towers both started from a CLIP directory, as a ``CLIPModel`` with its processor:
    the image processor of mmfast's eval preprocessing and the tokenizer it trained with."""
    # transformers: a slow import, only for a Hugging Face model or tokenizer
    from transformers import CLIPConfig, CLIPModel

    net = model.model
    vision, text = net.image.module, net.text.module
    config = CLIPConfig(
        text_config=text.config.to_dict(),
        vision_config=vision.config.to_dict(),
        projection_dim=int(net.embed_dim),
        logit_scale_init_value=float(net.logit_scale.detach()),
    )
    clip = CLIPModel(config)
    state = {**vision.state_dict(), **text.state_dict(), "logit_scale": net.logit_scale.detach().reshape(())}
    clip.load_state_dict({k: v.detach().cpu() for k, v in state.items()}, strict=True)
    clip.save_pretrained(str(out))
    clip_processor(model.config).save_pretrained(str(out))
    model.tokenizer.save_pretrained(str(out))
