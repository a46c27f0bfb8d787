"""A run's values decided once, before anything is built: the preset's fields filled in (``resolve_preset``:
what config.json records), then every batch size from the process count (``resolve_batches``)."""

from __future__ import annotations

from dataclasses import replace

from mmfast.models.catalog import get_preset
from mmfast.models.registry import MODELS
from mmfast.models.start_dirs import StartFlags, start_embed_dim, start_fields
from mmfast.train.config import PRESET_FIELDS, TrainConfig


def resolve_preset(cfg: TrainConfig) -> TrainConfig:
    """The configuration with every "from the preset" field (None) filled in: what config.json records. A
    preset whose recipe has no encoder learning rate (its encoders train from scratch) gives a pretrained
    encoder named by flag that encoder's own (``pretrained_encoder_lr``), not the new layers' ``--lr``."""
    from mmfast.models.encoders import pretrained_encoder_lr  # torch: only once a config is resolved

    cfg = replace(cfg, preset=cfg.preset or default_preset(cfg))
    if cfg.init_from is not None:  # --init-from's towers and image size (models/start_dirs.py)
        flags = StartFlags(
            cfg.init_from, cfg.init_proj, cfg.image_backbone, cfg.text_model, cfg.image_size, cfg.freeze_image
        )
        cfg = replace(cfg, **start_fields(flags))
    preset = get_preset(cfg.preset)
    filled = {
        name: getattr(preset, name) if getattr(cfg, name) is None else getattr(cfg, name) for name in PRESET_FIELDS
    }
    if filled["encoder_lr"] is None:  # a recipe for encoders from scratch: a pretrained one named by flag
        own = pretrained_encoder_lr(filled["image_backbone"], cfg.image_weights, filled["text_model"])
        filled["encoder_lr"] = filled["lr"] if own is None else own
    filled["task"] = cfg.task or getattr(MODELS[cfg.model], "task", "classification")
    if cfg.init_proj is None and not hasattr(MODELS[cfg.model], "image_proj_start"):
        filled["init_proj"] = (
            "random"  # a preset's start is for the dual encoder; another model has no projections
        )
    # the preset's pooling and top layers are for its own towers: another tower (a directory's pools as it was
    # trained to; a CLIP / open_clip text tower trains whole) pools its last map, and all its layers train
    if cfg.image_pool is None and filled["image_backbone"] != preset.image_backbone:
        filled["image_pool"] = "last"
    if cfg.text_train_layers is None and filled["text_model"] != preset.text_model:
        filled["text_train_layers"] = None
    filled["zero_shot_map"] = _zero_shot_map(cfg, filled)
    # a tower that brings its projection sets the width (models/start_dirs.py); else 256
    starts = [start_embed_dim(filled[name]) for name in ("image_backbone", "text_model")]
    filled["embed_dim"] = cfg.embed_dim or next((w for w in starts if w), 256)
    return replace(cfg, **filled)


def default_preset(cfg: TrainConfig) -> str:
    """--preset when none is given: the model's (``default_preset``), or for a run from --init-from the recipe its
    starts were tested with (``start_preset``: the default's was chosen for its own towers)."""
    model = MODELS[cfg.model]
    if cfg.init_from is not None and hasattr(model, "start_preset"):
        return model.start_preset
    return getattr(model, "default_preset", "tiny")


def _zero_shot_map(cfg: TrainConfig, filled: dict) -> str:
    """--zero-shot-map as the run uses it: kernel needs a dual encoder whose image tower is locked (the map reads
    its features as training starts). Where it cannot work, the preset's kernel becomes none, and a flag's is
    refused before anything is built.

    Raises:
        ValueError: --zero-shot-map kernel given for another model or a training image tower.
    """
    kind = filled["zero_shot_map"]
    dual = hasattr(MODELS[cfg.model], "image_proj_start")
    if kind != "kernel" or (dual and filled["freeze_image"]):
        return kind
    if cfg.zero_shot_map is None:  # the preset's, on a run it cannot serve
        return "none"
    needs = "a locked image tower (--freeze-image)" if dual else "a dual encoder (--model clip)"
    raise ValueError(
        f"--zero-shot-map kernel maps the image tower's features as training starts, so it needs {needs}; "
        "or pass --zero-shot-map none"
    )


def resolve_batches(cfg: TrainConfig, num_processes: int) -> TrainConfig:
    """``cfg`` with the batch sizes the run trains and evaluates with, decided here and nowhere else: the eval
    batch (--eval-batch-size, else the micro-batch that --batch-size or the preset gives), then
    --global-batch-size's per-process batch and accumulation (``apply_global_batch``).

    Raises:
        ValueError: as ``apply_global_batch``.
    """
    cfg = replace(cfg, eval_batch_size=cfg.eval_batch_size or cfg.batch_size)
    return apply_global_batch(cfg, num_processes)


def apply_global_batch(cfg: TrainConfig, num_processes: int) -> TrainConfig:
    """``cfg`` with ``--global-batch-size G`` turned into a per-process batch and accumulation: each of the N
    processes takes G / N samples per optimizer step, in micro-batches of the largest divisor of G / N that is
    at most ``--batch-size`` (so the run's global batch does not depend on N: 64 on 1 process is 32 x 2, on 2
    processes 32 each). Unchanged without ``--global-batch-size``.

    Raises:
        ValueError: N does not divide G (naming the nearest multiples), or --grad-accum given as well.
    """
    g = cfg.global_batch_size
    if g is None:
        return cfg
    if g < 1:
        raise ValueError(f"--global-batch-size must be >= 1, got {g}")
    if cfg.grad_accum != 1:
        raise ValueError("--global-batch-size decides --grad-accum: give one of them")
    if g % num_processes:
        lo, hi = g - g % num_processes, g + num_processes - g % num_processes
        near = f"{lo} or {hi}" if lo else str(hi)
        raise ValueError(
            f"--global-batch-size {g} is not divisible by the {num_processes} processes of this run; use a "
            f"multiple of {num_processes} (e.g. {near})"
        )
    per = g // num_processes
    cap = min(cfg.batch_size or per, per)
    batch = max(d for d in range(1, cap + 1) if per % d == 0)
    return replace(cfg, batch_size=batch, grad_accum=per // batch)
