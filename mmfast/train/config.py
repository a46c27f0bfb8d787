"""The training configuration: one dataclass, filled from defaults < a YAML/JSON file < command-line flags."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import MISSING, asdict, dataclass, fields, replace
from pathlib import Path


@dataclass(frozen=True)
class TrainConfig:
    data: str | None = None  # prepared dir, raw manifest / image folder, or None for the built-in demo set
    out: str | None = None  # None: runs/latest, an earlier run there is moved aside (runs/latest.old-<time>)
    overwrite: bool = False  # --out holds an earlier run: move it aside (never deleted) and start afresh
    model: str = "concat"  # early | concat | late, or a single-modality baseline: image | text
    preset: str = "tiny"
    image_backbone: str | None = None  # None: from the preset
    image_weights: str | None = None
    text_model: str | None = None  # None: from the preset
    image_size: int | None = None  # None: from the preset
    hidden: int | None = None
    combine: str = "mean"  # late fusion: mean | learned
    freeze_image: bool | None = None  # None: from the preset
    freeze_text: bool = False
    epochs: int | None = None  # None: from the preset
    max_steps: int | None = None  # optimizer steps; stops early when reached
    batch_size: int | None = None  # per process; None: from the preset
    eval_batch_size: int | None = None
    grad_accum: int = 1
    lr: float | None = None  # new layers and encoders trained from scratch; None: from the preset
    encoder_lr: float | None = None  # pretrained encoders; None: from the preset
    weight_decay: float = 0.05
    warmup_frac: float | None = None  # None: from the preset
    probe_frac: float | None = None  # share of steps with pretrained encoders still; None: from the preset
    scheduler: str = "cosine"  # a transformers.get_scheduler name: cosine | linear | constant_with_warmup | ...
    grad_clip: float = 1.0
    mixed_precision: str = "auto"  # auto | fp16 | bf16 | no
    channels_last: bool = False
    compile: bool = False
    seed: int = 0
    num_threads: int | None = None  # DALI threads per process (default: cores / processes)
    cpu_resize: str = "torch"  # without a GPU: resize + normalize on the consuming thread (torch) or in DALI
    dropout: float = 0.1
    augment: bool = True  # random resized crop + flip on the train split (else resize + center crop)
    crop_scale_min: float = 0.35
    color_jitter: float = 0.0
    checkpoint_every: int = 0  # optimizer steps; 0: at the end of each epoch only
    keep_checkpoints: int = 2
    checkpoints: bool = True  # off: no checkpoint is written (a throwaway run, e.g. tools/profile.py)
    resume: str | None = None  # PATH or "latest"
    on_bad_image: str = "skip"  # skip: log, count and mask a missing/undecodable image; error: stop
    source: str = "files"  # images from the files (files) or the prepared dir's WebDataset export (wds)
    max_nan_steps: int = 20  # consecutive non-finite losses before the run stops
    demo_size: int = 2000
    tokenizer: str | None = None  # used when --data is raw (prepared on the fly)
    max_length: int = 32
    profile: bool = False  # time phases with honest GPU syncs, sample utilization, write profile.json/png
    profile_interval: float = 0.2  # seconds between utilization samples
    tensorboard: bool = False
    progress: bool = True
    record_ids: bool = False  # write the sample ids each process trained on (seen_ids.rank<R>.jsonl)
    dist_timeout: float = 600.0  # seconds a process waits for the others in a collective before it stops

    def __post_init__(self):
        floats = (
            "lr",
            "encoder_lr",
            "weight_decay",
            "warmup_frac",
            "probe_frac",
            "grad_clip",
            "dropout",
            "crop_scale_min",
            "color_jitter",
            "profile_interval",
            "dist_timeout",
        )
        for name in floats:
            value = getattr(self, name)
            if value is None:  # filled from the preset by resolve_preset
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise ValueError(f"{_flag(name)} must be a finite number, got {value!r}")
        positive_ints = ("grad_accum", "keep_checkpoints", "max_nan_steps", "demo_size", "max_length")
        for name in positive_ints:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{_flag(name)} must be an integer, got {value!r}")
        for name in (
            "epochs",
            "batch_size",
            "max_steps",
            "image_size",
            "hidden",
            "eval_batch_size",
            "num_threads",
        ):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{_flag(name)} must be an integer >= 1, got {value!r}")
        checks = [
            (
                self.model in ("early", "concat", "late", "image", "text"),
                f"--model must be early, concat, late, image or text, got '{self.model}'",
            ),
            (
                self.mixed_precision in ("auto", "fp16", "bf16", "no"),
                f"--mixed-precision must be auto, fp16, bf16 or no, got '{self.mixed_precision}'",
            ),
            (self.combine in ("mean", "learned"), f"--combine must be mean or learned, got '{self.combine}'"),
            (
                self.on_bad_image in ("skip", "error"),
                f"--on-bad-image must be skip or error, got '{self.on_bad_image}'",
            ),
            (self.source in ("files", "wds"), f"--source must be files or wds, got '{self.source}'"),
            (
                self.cpu_resize in ("torch", "dali"),
                f"--cpu-resize must be torch or dali, got '{self.cpu_resize}'",
            ),
            (self.grad_accum >= 1, f"--grad-accum must be >= 1, got {self.grad_accum}"),
            (self.lr is None or 0 < self.lr <= 10, f"--lr must be in (0, 10], got {self.lr}"),
            (
                self.encoder_lr is None or 0 <= self.encoder_lr <= 10,
                f"--encoder-lr must be in [0, 10], got {self.encoder_lr}",
            ),
            (
                self.probe_frac is None or 0 <= self.probe_frac < 1,
                f"--probe-frac must be in [0, 1), got {self.probe_frac}",
            ),
            (self.weight_decay >= 0, f"--weight-decay must be >= 0, got {self.weight_decay}"),
            (self.grad_clip >= 0, f"--grad-clip must be >= 0 (0: no clipping), got {self.grad_clip}"),
            (0 <= self.dropout < 1, f"--dropout must be in [0, 1), got {self.dropout}"),
            (0 <= self.color_jitter <= 1, f"--color-jitter must be in [0, 1], got {self.color_jitter}"),
            (self.profile_interval > 0, f"--profile-interval must be > 0, got {self.profile_interval}"),
            (self.dist_timeout > 0, f"--dist-timeout must be > 0 seconds, got {self.dist_timeout}"),
            (self.max_nan_steps >= 1, f"--max-nan-steps must be >= 1, got {self.max_nan_steps}"),
            (self.demo_size >= 10, f"--demo-size must be >= 10, got {self.demo_size}"),
            (self.max_length >= 3, f"--max-length must be >= 3, got {self.max_length}"),
            (self.image_size is None or self.image_size >= 8, f"--image-size must be >= 8, got {self.image_size}"),
            (self.max_steps is None or self.max_steps >= 1, f"--max-steps must be >= 1, got {self.max_steps}"),
            (
                self.warmup_frac is None or 0 <= self.warmup_frac < 1,
                f"--warmup-frac must be in [0, 1), got {self.warmup_frac}",
            ),
            (0 < self.crop_scale_min <= 1, f"--crop-scale-min must be in (0, 1], got {self.crop_scale_min}"),
            (self.keep_checkpoints >= 1, f"--keep-checkpoints must be >= 1, got {self.keep_checkpoints}"),
            (self.checkpoint_every >= 0, f"--checkpoint-every must be >= 0, got {self.checkpoint_every}"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def build_parser() -> argparse.ArgumentParser:
    """argparse mirror of TrainConfig; every default is SUPPRESS so only flags the user gave are set."""
    p = argparse.ArgumentParser(
        prog="train.py",
        description="Train an image+text fusion model with mmfast.",
        argument_default=argparse.SUPPRESS,
    )
    p.add_argument("--config", help="YAML or JSON file with the same keys as the flags (flags win)")
    for f in fields(TrainConfig):
        default = None if f.default is MISSING else f.default
        help_ = f"(default: {'from the preset' if default is None and f.name in PRESET_FIELDS else default})"
        kind = str(f.type)
        if "bool" in kind:
            p.add_argument(_flag(f.name), dest=f.name, action=argparse.BooleanOptionalAction, help=help_)
        elif "float" in kind:
            p.add_argument(_flag(f.name), dest=f.name, type=float, help=help_)
        elif "int" in kind:
            p.add_argument(_flag(f.name), dest=f.name, type=int, help=help_)
        else:
            p.add_argument(_flag(f.name), dest=f.name, help=help_)
    return p


def load_config_file(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--config {path}: no such file")
    text = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        import yaml

        data = yaml.safe_load(text) or {}
    else:
        data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping of keys to values")
    data = {k.replace("-", "_"): v for k, v in data.items()}
    known = {f.name for f in fields(TrainConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"--config {path}: unknown keys {unknown}; valid keys: {sorted(known)}")
    return data


def parse_config(argv: list[str] | None) -> TrainConfig:
    """Resolve the configuration from a file (optional) and flags."""
    ns = vars(build_parser().parse_args(argv))
    file_values = load_config_file(ns.pop("config")) if "config" in ns else {}
    try:
        return TrainConfig(**{**file_values, **ns})
    except TypeError as e:
        raise ValueError(f"bad configuration: {e}") from e


def config_dict(cfg: TrainConfig) -> dict:
    return asdict(cfg)


# Settings a resumed run may change (applied from the resume on, and recorded in config.json's segments).
# Every other field must equal the checkpoint's, or the resumed run would not continue the same training.
MAY_CHANGE_ON_RESUME = frozenset(
    {
        "data",  # the path may move; the data's fingerprint must match (checked separately)
        "out",
        "resume",
        "overwrite",
        "epochs",
        "max_steps",
        "checkpoint_every",
        "keep_checkpoints",
        "checkpoints",
        "profile",
        "profile_interval",
        "tensorboard",
        "progress",
        "record_ids",
        "num_threads",
        "eval_batch_size",
        "max_nan_steps",
        "on_bad_image",
        "compile",
        "dist_timeout",
        "mixed_precision",  # compared as resolved by Accelerate (auto -> bf16/fp16/no), not as written
    }
)


def resume_differences(saved: dict, now: dict) -> list[str]:
    """The must-match settings in which ``now`` differs from the checkpoint's ``saved`` run, as
    "name: saved -> now" lines (empty when the run may resume)."""
    keys = sorted((set(saved) | set(now)) - MAY_CHANGE_ON_RESUME)
    return [f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in keys if saved.get(k) != now.get(k)]


PRESET_FIELDS = (
    "image_backbone",
    "text_model",
    "image_size",
    "hidden",
    "lr",
    "encoder_lr",
    "epochs",
    "warmup_frac",
    "freeze_image",
    "probe_frac",
    "batch_size",
)


def resolve_preset(cfg: TrainConfig) -> TrainConfig:
    """The configuration with every "from the preset" field (None) filled in: what config.json records."""
    from mmfast.models import get_preset

    preset = get_preset(cfg.preset)
    filled = {
        name: getattr(preset, name) if getattr(cfg, name) is None else getattr(cfg, name) for name in PRESET_FIELDS
    }
    if filled["encoder_lr"] is None:
        filled["encoder_lr"] = filled["lr"]
    resolved = replace(cfg, **filled)
    return replace(resolved, eval_batch_size=cfg.eval_batch_size or resolved.batch_size)
