"""The slices of a run's configuration that its builders take: one frozen dataclass per concern, each holding
only the fields its builders read, named as ``TrainConfig`` names them.

``TrainConfig`` stays the flat record the command line and ``train()`` take. ``slices`` cuts the resolved
record once (in ``train/run.py``), and each builder is typed with its slice. A slice's fields are
``TrainConfig`` fields of the same name and type, so a whole ``TrainConfig`` still stands where a slice is
asked for (a test, a notebook). A value several builders read (the seed, the image size) sits in each of
their slices, copied from the one resolved record.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from mmfast.infer.model_config import ModelConfig
from mmfast.train.config import TrainConfig
from mmfast.train.hardware import resolve_text_padding


@dataclass(frozen=True)
class DataConfig:
    """What a run trains on, and how a raw ``--data`` (or the demo set) is prepared on the fly
    (``setup.resolve_data``, ``setup.check_data_exists``)."""

    data: str | list[str] | None
    out: str | None
    resume: str | None
    demo_size: int
    tokenizer: str | None
    max_length: int
    text_model: str | None
    task: str | None
    progress: bool


@dataclass(frozen=True)
class LoaderConfig:
    """How the run's loaders make batches (``train/data.py``): the batch sizes, the augmentation, the order
    and the sources' mix, where images come from, the caption width (``text_padding`` resolved: never
    ``auto``) and the DALI threads."""

    batch_size: int | None
    eval_batch_size: int | None
    epochs: int | None
    seed: int
    image_size: int | None
    augment: bool | None
    crop_scale_min: float
    color_jitter: float
    cpu_resize: str
    cache_decoded: bool
    text_padding: str
    num_threads: int | None
    on_bad_image: str
    verify_files: bool
    data: str | list[str] | None
    data_weights: str | None
    samples_per_epoch: int | None
    source: str
    shard_cache: str | None
    cache_limit: str
    store_timeout: float


@dataclass(frozen=True)
class FeatureConfig(LoaderConfig):
    """--feature-cache (``train/features.py``): the loader's fields (its views are the train loader's
    augmentation) and the cache's own."""

    model: str
    feature_cache: str | None
    feature_views: int | None
    feature_cache_dir: str | None
    out: str | None  # a raw --data is prepared into OUT/prepared: its default cache is named after the input
    dist_timeout: float  # how long a process waits for another run's build of the same cache


@dataclass(frozen=True)
class CompileConfig:
    """The compiled step (``hardware.compile_options``, ``check_compile_fits``, ``choices_made``): whether and
    how the model is compiled, the caption width it is compiled for, and what a CUDA graph must fit."""

    compile: bool
    compile_mode: str
    text_padding: str
    channels_last: bool | None
    grad_accum: int
    task: str | None


@dataclass(frozen=True)
class ProcessConfig:
    """How this process joins the run (``setup.make_accelerator``): the precision, the trackers, the project
    directory and how long it waits for the others."""

    mixed_precision: str
    out: str | None
    report_to: str | None
    tensorboard: bool
    dist_timeout: float
    rendezvous_timeout: float


@dataclass(frozen=True)
class OptimConfig:
    """The optimizer and its schedule (``optim.total_steps``, ``optim.build_optimizer``): the steps, the
    learning rates and their warm-up, probe and decay, the AdamW kernels."""

    epochs: int | None
    max_steps: int | None
    grad_accum: int
    lr: float | None
    encoder_lr: float | None
    weight_decay: float
    warmup_frac: float | None
    probe_frac: float | None
    scheduler: str
    optimizer_impl: str


@dataclass(frozen=True)
class LoopConfig:
    """The training loop (``engine.EpochRunner`` and its ``report.StepLog``): the epochs and their accumulation
    windows, clipping, the log lines, the checkpoints and evaluations, the stop on non-finite steps, and what a
    profile or a debugging run records."""

    epochs: int | None
    grad_accum: int
    grad_clip: float
    max_nan_steps: int
    log_every: int
    progress: bool
    checkpoint_every: int
    keep_checkpoints: int
    checkpoints: bool
    eval_every: int
    record_ids: bool
    profile: bool
    compile_mode: str
    dist_timeout: float


@dataclass(frozen=True)
class ReportConfig:
    """What a run's reports name of its set-up (``report.summarize``, ``report.write_profile``,
    ``report.encoder_lr_note``): the run directory, the model, the batch, the compiled step and the recipe's
    learning rates."""

    out: str | None
    checkpoints: bool
    model: str
    preset: str | None
    image_backbone: str | None
    text_model: str | None
    image_size: int | None
    batch_size: int | None
    grad_accum: int
    channels_last: bool | None
    compile: bool
    compile_mode: str
    text_padding: str
    optimizer_impl: str
    lr: float | None
    encoder_lr: float | None


@dataclass(frozen=True)
class RunConfig:
    """The run around the loop (``short_profile.time_steps``): where it writes, its seed, the projections'
    start, the zero-shot map, the steps it takes, the stop signal's grace and the profile's sampling."""

    out: str | None
    seed: int
    init_proj: str | None
    zero_shot_map: str | None
    max_steps: int | None
    stop_grace: float
    profile: bool
    profile_interval: float


SLICES = (
    DataConfig,
    LoaderConfig,
    ProcessConfig,
    OptimConfig,
    FeatureConfig,
    CompileConfig,
    ModelConfig,
    LoopConfig,
    ReportConfig,
    RunConfig,
)


def cut(kind: type, cfg: TrainConfig):
    """The ``kind`` slice of ``cfg``: its fields taken by name, ``text_padding``'s ``auto`` settled by the
    compiled step's choice (``hardware.resolve_text_padding``, handed the ``CompileConfig`` slice)."""
    part = kind(**{f.name: getattr(cfg, f.name) for f in fields(kind)})
    if getattr(part, "text_padding", None) != "auto":
        return part
    compiled = part if kind is CompileConfig else cut(CompileConfig, cfg)
    return replace(part, text_padding=resolve_text_padding(compiled))


@dataclass(frozen=True)
class Slices:
    """Every slice of one resolved configuration (``slices``)."""

    data: DataConfig
    loader: LoaderConfig
    processes: ProcessConfig
    optim: OptimConfig
    features: FeatureConfig
    compile: CompileConfig
    model: ModelConfig
    loop: LoopConfig
    report: ReportConfig
    run: RunConfig


def slices(cfg: TrainConfig) -> Slices:
    """``cfg`` cut into the slices its builders take."""
    return Slices(*(cut(kind, cfg) for kind in SLICES))
