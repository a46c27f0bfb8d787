"""The training configuration: one dataclass, filled from defaults < a YAML/JSON file < command-line flags."""

from __future__ import annotations

import argparse
import json
from dataclasses import MISSING, asdict, dataclass, fields, replace
from pathlib import Path


@dataclass(frozen=True)
class TrainConfig:
    data: str | None = None  # prepared dir, raw manifest / image folder, or None for the built-in demo set
    out: str = "runs/latest"
    model: str = "concat"  # early | concat | late
    preset: str = "tiny"
    image_backbone: str | None = None  # None: from the preset
    image_weights: str | None = None
    text_model: str | None = None  # None: from the preset
    image_size: int | None = None  # None: from the preset
    hidden: int | None = None
    combine: str = "mean"  # late fusion: mean | learned
    freeze_image: bool = False
    freeze_text: bool = False
    epochs: int = 6
    max_steps: int | None = None  # optimizer steps; stops early when reached
    batch_size: int = 64  # per process
    eval_batch_size: int | None = None
    grad_accum: int = 1
    lr: float = 2e-3
    weight_decay: float = 0.05
    warmup_frac: float = 0.1
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
    resume: str | None = None  # PATH or "latest"
    on_bad_image: str = "skip"  # skip: log, count and mask a missing/undecodable image; error: stop
    max_nan_steps: int = 20  # consecutive non-finite losses before the run stops
    demo_size: int = 2000
    tokenizer: str | None = None  # used when --data is raw (prepared on the fly)
    max_length: int = 32
    profile: bool = False  # time phases with honest GPU syncs, sample utilization, write profile.json/png
    profile_interval: float = 0.2  # seconds between utilization samples
    tensorboard: bool = False
    progress: bool = True
    record_ids: bool = False  # write the sample ids each process trained on (seen_ids.rank<R>.jsonl)

    def __post_init__(self):
        checks = [
            (
                self.model in ("early", "concat", "late"),
                f"--model must be early, concat or late, got '{self.model}'",
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
            (
                self.cpu_resize in ("torch", "dali"),
                f"--cpu-resize must be torch or dali, got '{self.cpu_resize}'",
            ),
            (self.epochs >= 1, f"--epochs must be >= 1, got {self.epochs}"),
            (self.batch_size >= 1, f"--batch-size must be >= 1, got {self.batch_size}"),
            (self.grad_accum >= 1, f"--grad-accum must be >= 1, got {self.grad_accum}"),
            (self.lr > 0, f"--lr must be > 0, got {self.lr}"),
            (self.max_steps is None or self.max_steps >= 1, f"--max-steps must be >= 1, got {self.max_steps}"),
            (0 <= self.warmup_frac < 1, f"--warmup-frac must be in [0, 1), got {self.warmup_frac}"),
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
        help_ = f"(default: {default})"
        if f.type in ("bool",) or isinstance(default, bool):
            p.add_argument(_flag(f.name), dest=f.name, action=argparse.BooleanOptionalAction, help=help_)
        elif isinstance(default, int) and not isinstance(default, bool):
            p.add_argument(_flag(f.name), dest=f.name, type=int, help=help_)
        elif isinstance(default, float):
            p.add_argument(_flag(f.name), dest=f.name, type=float, help=help_)
        elif "int" in str(f.type):
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


def resolve_preset(cfg: TrainConfig) -> TrainConfig:
    """The configuration with every "from the preset" field (None) filled in: what config.json records."""
    from mmfast.models import get_preset

    preset = get_preset(cfg.preset)
    return replace(
        cfg,
        image_backbone=cfg.image_backbone or preset.image_backbone,
        text_model=cfg.text_model or preset.text_model,
        image_size=cfg.image_size or preset.image_size,
        hidden=cfg.hidden or preset.hidden,
        eval_batch_size=cfg.eval_batch_size or cfg.batch_size,
    )
