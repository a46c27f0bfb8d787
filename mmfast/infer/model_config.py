"""A model directory's config.json: what it records of a run (``model_config``) and the checks it must pass to
be loaded (``read_config``; its files against checksums.json: ``verify_model_dir``), with the error those raise
(``ModelDirError``)."""

from __future__ import annotations

import json
import logging
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from mmfast.data.preprocessing import EVAL_CROP_RATIO, INTERPOLATIONS, RESIZE_MODES
from mmfast.data.tokenizer import load_tokenizer
from mmfast.models import model_class
from mmfast.models.catalog import IMAGE_POOLS
from mmfast.models.encoders import RANDOM_TEXT_CONFIGS, pools_stages
from mmfast.tasks.retrieval import read_templates
from mmfast.util.fsutil import file_sha256

log = logging.getLogger(__name__)

FORMAT = "mmfast-model/1"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
CHECKSUMS_FILE = "checksums.json"  # {relative path: SHA-256} of the files load_model reads
REMEDY = "copy the model directory again whole from its run (RUN/model, or RUN/model-last), or retrain"


class ModelDirError(ValueError):
    """A model directory that cannot be used: a file missing, damaged, not matching the others, or weights that
    are not finite. The message names the file and what to do."""


def one_line(e: BaseException, most: int = 300) -> str:
    """An exception's message on one line, cut to ``most`` characters."""
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= most else text[: most - 3] + "..."


@dataclass(frozen=True)
class ModelConfig:
    """The run's model slice (``train/slices.py``): what builds the model and its task, and what the model
    directory records of the run. Its fields are the training configuration's of the same name and type; a
    whole configuration stands for it too. It lives here, below ``train/``, as the record ``model_config``
    writes."""

    model: str
    image_backbone: str | None
    text_model: str | None
    image_weights: str | None
    image_size: int | None
    hidden: int | None
    combine: str
    freeze_image: bool | None
    freeze_text: bool | None
    text_train_layers: int | None
    image_pool: str | None
    dropout: float
    task: str | None
    loss: str | None
    embed_dim: int | None
    zero_shot_templates: str | None
    channels_last: bool | None
    eval_batch_size: int | None


def model_options(config: dict) -> dict:
    """The model's own options (its class's ``config_options``: late fusion's combine, the dual encoder's loss
    and embed_dim) that config.json records, as ``build_model`` takes them."""
    names = getattr(model_class(config["model"]), "config_options", ())
    return {name: config[name] for name in names if name in config}


def model_config(
    cfg: ModelConfig, dataset, model: nn.Module, weights: str, tokenizer_dir: Path | None = None
) -> dict:
    """config.json of a run's model directory.

    Args:
        cfg: the run's resolved model slice.
        dataset: the PreparedDataset it trained on.
        model: the (unwrapped) network, for the normalization its image encoder expects.
        weights: "best" or "last".
        tokenizer_dir: the tokenizer it trained with (default: the dataset's).
    """
    image, text = getattr(model, "image", None), getattr(model, "text", None)
    geometry = getattr(image, "geometry", {})  # a start's eval resize (``ImageStart``); {}: mmfast's own
    prep = dataset.summary.get("config", {})
    # a pretrained text model's architecture, so load_model needs neither its package nor the hub
    hf_text = getattr(text, "model", None)
    text_config = (
        hf_text.config.to_dict() if hf_text is not None and cfg.text_model not in RANDOM_TEXT_CONFIGS else None
    )
    # a tower started from a directory (models/start_towers.py): what rebuilds it without that directory
    records = {f"{name}_tower": getattr(t, "record", None) for name, t in (("image", image), ("text", text))}
    cls = model_class(cfg.model)
    # the model's own value where it has one (an embedding width a pretrained tower set), else the config's
    options = {name: getattr(model, name, getattr(cfg, name)) for name in getattr(cls, "config_options", ())}
    task = getattr(cfg, "task", None) or getattr(cls, "task", "classification")
    # a contrastive model's zero-shot prompts, read now: the file they came from may be gone when it is used
    templates = (
        {"zero_shot_templates": read_templates(getattr(cfg, "zero_shot_templates", None))}
        if task == "contrastive"
        else {}
    )
    prompt_map = getattr(model, "prompt_map", None)  # a zero-shot map's shapes (models/prompt_map.py)
    return {
        "format": FORMAT,
        "weights": weights,
        "model": cfg.model,
        "task": task,
        "num_classes": dataset.num_classes,
        "class_names": sorted(dataset.labels, key=dataset.labels.get),
        "image_backbone": cfg.image_backbone,
        # the tower's own pooling (``ImageEncoder``'s); absent: the last map's, as before --image-pool
        **({"image_pool": image.pool} if pools_stages(image) else {}),
        "text_model": cfg.text_model,
        **({"text_config": text_config} if text_config is not None else {}),
        **{k: v for k, v in records.items() if v is not None},
        "vocab_size": len(load_tokenizer(tokenizer_dir or dataset.tokenizer_dir)),
        "hidden": cfg.hidden,
        "dropout": cfg.dropout,
        **options,
        **templates,
        **({"zero_shot_map": prompt_map.describe()} if prompt_map is not None else {}),
        "image_size": cfg.image_size,
        # eval: the shorter side resized to image_size / crop_ratio, then cropped (or squashed to the size),
        # with this filter: mmfast's own, or what the start's config says (``start_preprocess``)
        "crop_ratio": geometry.get("crop_ratio", EVAL_CROP_RATIO),
        "interpolation": geometry.get("interpolation", "bilinear"),
        "resize_mode": geometry.get("resize_mode", "shortest"),
        # 0..1 scale; the loader takes them x255
        "mean": list(image.mean) if image is not None else None,
        "std": list(image.std) if image is not None else None,
        "max_length": int(prep.get("max_length") or dataset.summary.get("max_length")),
        "eval_batch_size": cfg.eval_batch_size,
        "max_pixels": dataset.max_pixels,
    }


def _number(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _positive_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _rgb(v) -> bool:
    return v is None or (isinstance(v, list) and len(v) == 3 and all(_number(x) for x in v))


def _templates(v) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(t, str) and t.count("{}") == 1 for t in v)


def _map_record(v) -> bool:
    if not isinstance(v, dict) or v.get("kind") != "kernel":
        return False
    if not re.fullmatch(r"tower|copy|layers:[1-9][0-9]*", str(v.get("text_start"))):
        return False
    sizes = all(_positive_int(v.get(k)) for k in ("rows", "width", "text_width"))
    return sizes and _number(v.get("gamma")) and _number(v.get("weight")) and 0 < v["weight"] <= 1


# config.json's fields: what each must be (the test, and its words for the error)
_FIELDS = {
    "model": (lambda v: isinstance(v, str), "a model name"),
    "num_classes": (_positive_int, "a positive integer"),
    "class_names": (lambda v: isinstance(v, list) and all(isinstance(n, str) for n in v), "a list of names"),
    "image_backbone": (lambda v: isinstance(v, str), "an image backbone name"),
    "text_model": (lambda v: isinstance(v, str), "a text model name"),
    "vocab_size": (_positive_int, "a positive integer"),
    "hidden": (_positive_int, "a positive integer"),
    "dropout": (lambda v: _number(v) and 0 <= v < 1, "a number in [0, 1)"),
    "image_size": (_positive_int, "a positive integer"),
    "mean": (_rgb, "3 numbers (or null)"),
    "std": (_rgb, "3 numbers (or null)"),
    "max_length": (_positive_int, "a positive integer"),
}
_OPTIONAL_FIELDS = {
    "task": (lambda v: isinstance(v, str), "a task name"),
    "eval_batch_size": (lambda v: v is None or _positive_int(v), "a positive integer"),
    "max_pixels": (lambda v: v is None or _positive_int(v), "a positive integer"),
    "text_config": (lambda v: isinstance(v, dict) and isinstance(v.get("model_type"), str), "a model config"),
    "embed_dim": (_positive_int, "a positive integer"),
    "image_pool": (lambda v: v in IMAGE_POOLS, " or ".join(IMAGE_POOLS)),
    "loss": (lambda v: isinstance(v, str), "a loss name"),
    "zero_shot_templates": (_templates, "a list of templates, each with one {}"),
    "zero_shot_map": (_map_record, "a zero-shot map's record"),
    "image_tower": (lambda v: isinstance(v, dict) and isinstance(v.get("kind"), str), "a tower record"),
    "text_tower": (lambda v: isinstance(v, dict) and isinstance(v.get("kind"), str), "a tower record"),
    "crop_ratio": (lambda v: _number(v) and 0 < v <= 1, "a number in (0, 1]"),
    "interpolation": (lambda v: v in INTERPOLATIONS, " or ".join(INTERPOLATIONS)),
    "resize_mode": (lambda v: v in RESIZE_MODES, " or ".join(RESIZE_MODES)),
}


def read_config(model_dir: str | os.PathLike) -> dict:
    """A model directory's config.json, checked: JSON, every field there and of its type, one class name per
    classifier output.

    Raises:
        ModelDirError: naming config.json and the field.
    """
    path = Path(model_dir) / CONFIG_FILE
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # UnicodeDecodeError is a ValueError
        raise ModelDirError(f"{path}: not readable JSON ({one_line(e)}); {REMEDY}") from None
    if not isinstance(config, dict):
        raise ModelDirError(f"{path}: not a JSON object; {REMEDY}")
    missing = [k for k in _FIELDS if k not in config]
    if missing:
        raise ModelDirError(f"{path}: missing {', '.join(map(repr, missing))}; {REMEDY}")
    for key, (ok, what) in {**_FIELDS, **_OPTIONAL_FIELDS}.items():
        if key in config and not ok(config[key]):
            raise ModelDirError(f"{path}: {key!r} must be {what}, got {json.dumps(config[key])[:80]}; {REMEDY}")
    names, n = config["class_names"], config["num_classes"]
    if len(names) != n or len(set(names)) != n:
        raise ModelDirError(
            f"{path}: 'class_names' holds {len(names)} names ({len(set(names))} distinct) for the classifier's "
            f"{n} outputs ('num_classes'); {REMEDY}"
        )
    return config


def verify_model_dir(model_dir: str | os.PathLike) -> None:
    """Check a model directory's files against its checksums.json; one written before mmfast wrote checksums
    has none, and passes (``load_model`` still checks that its weights are finite).

    Raises:
        ModelDirError: a listed file is missing or not the bytes that were written, or checksums.json is
            unreadable.
    """
    model_dir = Path(model_dir)
    path = model_dir / CHECKSUMS_FILE
    if not path.exists():
        log.warning(
            "%s: no %s, so its files cannot be checked (written before mmfast wrote checksums, or the file was "
            "removed); loading it unchecked",
            model_dir,
            CHECKSUMS_FILE,
        )
        return
    try:
        sums = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelDirError(f"{path}: unreadable ({one_line(e)}); {REMEDY}") from None
    if not isinstance(sums, dict) or not isinstance(sums.get(WEIGHTS_FILE), str):
        raise ModelDirError(f"{path}: does not list {WEIGHTS_FILE}'s checksum; {REMEDY}")
    for rel, want in sorted(sums.items()):
        f = model_dir / rel
        try:
            got = file_sha256(f)
        except OSError as e:  # missing, a directory, no permission
            raise ModelDirError(f"{f}: cannot be read ({e.strerror}), yet {path} lists it; {REMEDY}") from None
        if got != want:
            edited = (
                f"; if you edited it on purpose, delete {path} to load it unchecked" if rel == CONFIG_FILE else ""
            )
            raise ModelDirError(f"{f}: is corrupt (checksum mismatch with {CHECKSUMS_FILE}); {REMEDY}{edited}")
