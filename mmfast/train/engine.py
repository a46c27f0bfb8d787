"""The training loop, plain and visible: Accelerate owns processes, devices and mixed precision; this file
owns the data path and what Accelerate leaves open for a non-torch loader (sharding, epoch ends, the last
accumulation window, the scheduler's length, resume).
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import math
import os
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from mmfast.data.dataset import PreparedDataset
from mmfast.infer.model_dir import write_run_models
from mmfast.loading.decoded import default_budget
from mmfast.loading.image_loader import IGNORE_LABEL
from mmfast.loading.multimodal import MultimodalLoader
from mmfast.models import build_model
from mmfast.tasks.classification import confusion_figures
from mmfast.train.checkpoint import (
    CheckpointError,
    checkpoint_dir,
    load_checkpoint,
    read_trainer_state,
    resolve_resume,
    save_checkpoint,
)
from mmfast.train.config import TrainConfig, encoder_lr_note, resolve_preset, resume_differences
from mmfast.train.heartbeat import Heartbeat
from mmfast.train.profiler import StepTimer, UtilizationSampler, build_report, plot_report
from mmfast.train.rundir import RunDirError, RunDirPlan, claim_run_dir, plan_run_dir, read_tree, snapshot_tokenizer
from mmfast.train.setup import (
    all_processes_ok,
    check_data_exists,
    check_tokenizer_matches,
    cpu_has_fast_bf16,
    make_accelerator,
    processes_per_machine,
    resolve_data,
)
from mmfast.util.fsutil import atomic_write_json

log = logging.getLogger(__name__)
PROFILE_WARMUP_STEPS = 5  # micro-batches left out of a profile's figures (when the run has more)
DEFAULT_OUT = "runs/latest"


class NonFiniteLossError(RuntimeError):
    pass


def compute_loss(logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy in fp32; masked samples (label -100: eval padding, skipped images) count for nothing."""
    return F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_LABEL, reduction=reduction)


def training_loss(out: torch.Tensor | dict, labels: torch.Tensor) -> torch.Tensor:
    """The loss of a model's training output: its logits (B, C), or a dict with the logits plus auxiliary
    per-branch logits and their weight (late fusion's branches each learn to decide alone)."""
    if not isinstance(out, dict):
        return compute_loss(out, labels)
    aux = sum(compute_loss(a, labels) for a in out["aux"])
    return compute_loss(out["logits"], labels) + out["aux_weight"] * aux


def make_scheduler(optimizer, name: str, warmup: int, total: int, probe: int = 0):
    """A transformers schedule (``get_scheduler``: linear warmup, then cosine/linear/... decay) per optimizer
    step; parameter groups marked ``"pretrained"`` stay at lr 0 for the first ``probe`` steps (a linear-probe
    warm start: the new layers learn on fixed features before the encoders move)."""
    from transformers import get_scheduler

    try:
        scheduler = get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=total)
    except ValueError as e:
        raise ValueError(f"--scheduler {name}: {e}") from None
    if probe > 0:
        for i, group in enumerate(optimizer.param_groups):
            if group.get("pretrained"):
                base = scheduler.lr_lambdas[i]
                scheduler.lr_lambdas[i] = lambda step, base=base: 0.0 if step < probe else base(step)
        # The constructor already applied step 0's factors, before the probe existed: apply them again.
        for group, factor, base in zip(
            optimizer.param_groups, scheduler.lr_lambdas, scheduler.base_lrs, strict=True
        ):
            group["lr"] = base * factor(scheduler.last_epoch)
        scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
    return scheduler


def initial_state() -> dict:
    """The trainer state of a run that has not taken a step (what a checkpoint's trainer_state.json holds)."""
    return {
        "epoch": 0,
        "global_step": 0,
        "best_val_acc": 0.0,
        "best_val_macro_f1": None,
        "best_epoch": None,
        "best_step": None,
        "epoch_stats": None,
        "loader": None,
        "skipped_steps": 0,
    }


def param_groups(
    model: torch.nn.Module, weight_decay: float, lr: float, encoder_lr: float | None = None
) -> list[dict]:
    """Optimizer groups: pretrained encoders at ``encoder_lr``, everything else (heads, fusion layers, encoders
    trained from scratch) at ``lr``; no weight decay on biases and norm weights (1-d parameters). Empty groups
    (a frozen encoder) are left out."""
    pretrained = {
        id(p)
        for enc in (getattr(model, "image", None), getattr(model, "text", None))
        if enc is not None and getattr(enc, "pretrained", False)
        for p in enc.parameters()
    }
    groups: dict[tuple[bool, bool], list] = {}
    for p in model.parameters():
        if p.requires_grad:
            groups.setdefault((id(p) in pretrained, p.ndim > 1), []).append(p)
    return [
        {
            "params": params,
            "lr": (encoder_lr if encoder_lr is not None else lr) if is_pre else lr,
            "weight_decay": weight_decay if decays else 0.0,
            "pretrained": is_pre,
        }
        for (is_pre, decays), params in sorted(groups.items())
    ]


_SAME_STOP_S = 2.0  # a second stop signal within this many seconds of the first is the same stop


class _StopFlag:
    """SIGTERM/SIGINT set a flag; the loop writes a checkpoint at the next optimizer step and exits. A run that
    does not get there within ``grace`` seconds (stuck in a read, a collective, native code), or a second
    signal, exits at once without a new checkpoint, printing every thread's stack: a scheduler's or
    ``timeout``'s stop always ends the run."""

    def __init__(self, grace: float):
        self.signum = None
        self.grace = grace
        self._old = {}
        self._timer: threading.Timer | None = None

    def __enter__(self):
        for s in (signal.SIGTERM, signal.SIGINT):
            self._old[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.signum is not None:
            # the same stop may come twice at once: a terminal's Ctrl-C reaches the whole process group, and
            # a launcher (torchrun, accelerate) forwards it to its ranks as well
            if time.monotonic() - self._first > _SAME_STOP_S:
                self._give_up(f"a second stop signal ({signal.Signals(signum).name})")
            return
        self.signum, self._first = signum, time.monotonic()
        self._timer = threading.Timer(self.grace, self._give_up, [f"no step ended within {self.grace:g} s"])
        self._timer.daemon = True
        self._timer.start()

    def _give_up(self, why: str) -> None:
        print(
            f"mmfast-train: {why} of the stop signal: exiting without a new checkpoint (an earlier one resumes "
            "with --resume latest); where each thread was:",
            file=sys.stderr,
            flush=True,
        )
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        os._exit(128 + (self.signum or signal.SIGTERM))

    def __exit__(self, *exc):
        if self._timer is not None:
            self._timer.cancel()
        for s, h in self._old.items():
            signal.signal(s, h)


def train(cfg: TrainConfig) -> dict:
    """Run training as configured; returns the summary (also written to ``<out>/summary.json``).

    Can be called several times in one process (tests, notebooks): Accelerate's process-wide state is
    reset when a run ends, so the next run may choose another mixed precision.
    """
    from accelerate.state import AcceleratorState, GradientState

    try:
        return _train(cfg)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def build_loaders(
    cfg: TrainConfig, accelerator, dataset: PreparedDataset, norm: tuple[tuple, tuple] | None = None
) -> tuple[MultimodalLoader, MultimodalLoader | None, dict[str, str]]:
    """This process's train loader (its shard, augmented), val loader (None without a val split), and why
    a split's images are streamed rather than held in memory ({split: reason}, ``images_note``).

    ``norm``: (mean, std) on the 0..1 scale that the image encoder expects (default: ImageNet's).
    """
    threads = cfg.num_threads or max(1, (os.cpu_count() or 1) // processes_per_machine(accelerator))
    extra = {"mean": tuple(255 * m for m in norm[0]), "std": tuple(255 * v for v in norm[1])} if norm else {}
    common = dict(
        **extra,
        on_bad_image=cfg.on_bad_image,
        verify_files=cfg.verify_files,
        source=cfg.source,
        accelerator=accelerator,
        size=cfg.image_size,
        seed=cfg.seed,
        num_workers=threads,
        fp16=accelerator.device.type == "cuda",
    )
    # A dataset prepared with --val-fraction 0 has an empty val split: train without evaluation.
    has_val = dataset.split_size("val") > 0
    cached, streamed = _cache_budgets(cfg, accelerator, dataset, has_val)
    train_loader = MultimodalLoader(
        dataset,
        "train",
        cfg.batch_size,
        train=cfg.augment,
        scale=(cfg.crop_scale_min, 1.0),
        color_jitter=cfg.color_jitter,
        cpu_resize=cfg.cpu_resize,
        cache_decoded=cached.get("train", False),
        **common,
    )
    if not has_val:
        return train_loader, None, streamed
    val_loader = MultimodalLoader(
        dataset, "val", cfg.eval_batch_size, cache_decoded=cached.get("val", False), **common
    )
    return train_loader, val_loader, streamed


def _cache_budgets(
    cfg: TrainConfig, accelerator, dataset: PreparedDataset, has_val: bool
) -> tuple[dict[str, int], dict[str, str]]:
    """The splits whose images are decoded once and held in memory (``--cache-decoded``), each with the
    bytes it may take, and why the others are streamed. Train first, then val, while their decoded pixels fit
    together in half the memory available, shared by this machine's processes (each holds its own copy).
    Never on a GPU (nvJPEG decodes there), from WebDataset shards, with DALI finishing, or for a train split
    with colour jitter or read in one epoch only."""
    splits = ["train"] + (["val"] if has_val else [])
    why = None
    if not cfg.cache_decoded:
        why = "--no-cache-decoded"
    elif accelerator.device.type == "cuda":
        why = "the GPU decodes them (nvJPEG)"
    elif cfg.cpu_resize != "torch":
        why = "--cpu-resize dali"
    elif dataset.source_for("train", cfg.source).name != "files":
        why = "read from WebDataset shards"
    if why:
        return {}, dict.fromkeys(splits, why)
    left = default_budget() // processes_per_machine(accelerator)
    budgets, streamed = {}, {}
    for split in splits:
        if split == "train" and cfg.color_jitter > 0:
            streamed[split] = "--color-jitter is applied while streaming"
            continue
        if split == "train" and cfg.epochs == 1:  # and the cache's first epoch decodes whole images
            streamed[split] = "one epoch reads each image once"
            continue
        need = dataset.decoded_bytes(split, left)
        if need is None:
            streamed[split] = f"decoded, they would not fit in the {left / 2**20:.0f} MiB left of half the memory"
            continue
        budgets[split], left = left, left - need  # the loader's own guard gets all that is left
        log.info("%s images: decoded once, held in memory (%.0f MiB)", split, need / 2**20)
    for split, reason in streamed.items():
        log.info("streaming the %s images: %s", split, reason)
    return budgets, streamed


def images_note(loaders: dict[str, MultimodalLoader | None], streamed: dict[str, str]) -> str:
    """The summary's line on how each split's images were served: held in memory (how much) or streamed
    (why)."""
    parts = []
    for split, loader in loaders.items():
        if loader is None:
            continue
        if loader.cache_decoded:
            parts.append(f"{split} decoded once, {loader.cached_bytes / 2**20:.0f} MiB in memory")
        else:
            parts.append(f"{split} streamed ({streamed.get(split, 'did not fit in its memory budget')})")
    return "; ".join(parts)


def run_identity(cfg: TrainConfig, accelerator, dataset: PreparedDataset) -> dict:
    """What a checkpoint must agree with to be resumed: the config, the process layout, the data."""
    return {
        **asdict(cfg),
        "num_processes": accelerator.num_processes,
        "mixed_precision_resolved": accelerator.mixed_precision,
        "data_fingerprint": dataset.fingerprint,
    }


def _claim(cfg: TrainConfig, accelerator, default_out: bool):
    """Plan (every process, read-only) and claim (main process) the run directory; find the checkpoint.

    Returns:
        (the run dir lock or None on other processes, the checkpoint to resume or None).
    """
    run_dir = Path(cfg.out)
    plan = plan_run_dir(run_dir, resume=cfg.resume is not None, overwrite=cfg.overwrite, default_out=default_out)
    # An explicit --resume PATH is always resolved (and verified); "latest" only looks in an earlier run.
    explicit = cfg.resume is not None and cfg.resume != "latest"
    resume_from = resolve_resume(cfg.resume, run_dir) if plan.action == "resume" or explicit else None
    if plan.action == "resume" and resume_from is None:
        # --resume latest on a run that never wrote a checkpoint: nothing to continue; keep it, aside.
        plan = RunDirPlan("move-aside", run_dir)
    lock, err = None, None
    accelerator.wait_for_everyone()  # every process has looked before the main process changes anything
    if accelerator.is_main_process:
        try:
            lock, moved_to = claim_run_dir(plan)
            if moved_to is not None:
                accelerator.print(f"the earlier run in {run_dir} was moved to {moved_to}")
        except (RunDirError, OSError) as e:
            err = e
    if not all_processes_ok(accelerator, err is None):
        if err is not None:
            raise err
        raise RunDirError(f"the main process could not claim --out {run_dir} (see its message)")
    return lock, resume_from


def _train(cfg: TrainConfig) -> dict:
    t_start = time.perf_counter()
    default_out = cfg.out is None
    given, cfg = cfg, replace(resolve_preset(cfg), out=cfg.out or DEFAULT_OUT)
    accelerator = make_accelerator(cfg)
    if note := encoder_lr_note(given, cfg):
        accelerator.print(note)
    heartbeat = Heartbeat(accelerator.process_index, accelerator.num_processes)
    lock, failed = None, True
    try:
        check_data_exists(cfg)  # the cheaper mistake first: before --out is looked at
        lock, resume_from = _claim(cfg, accelerator, default_out)
        summary = _run(cfg, accelerator, resume_from, t_start)
        failed = False
        return summary
    except RuntimeError as e:
        if accelerator.num_processes > 1 and _is_collective_failure(e):
            raise heartbeat.explain(e, cfg.dist_timeout) from e
        heartbeat.report_failure(e)
        raise
    except Exception as e:  # tell the other processes why this one stops, then stop
        heartbeat.report_failure(e)
        raise
    finally:
        heartbeat.close()
        if lock is not None and failed:  # a run that wrote nothing leaves nothing behind
            if (restored := lock.release_unused()) is not None:
                accelerator.print(f"the earlier run is back in {restored} (this one stopped before it began)")
        elif lock is not None:
            lock.release()


def _is_collective_failure(e: RuntimeError) -> bool:
    """gloo/NCCL errors of a collective whose peer died or timed out (they carry no exception type)."""
    msg = str(e).lower()
    return any(w in msg for w in ("timed out", "timeout", "connection closed", "connection reset", "gloo", "nccl"))


def _run(cfg: TrainConfig, accelerator, resume_from: Path | None, t_start: float) -> dict:
    run_dir = Path(cfg.out)
    from accelerate.utils import set_seed

    set_seed(cfg.seed)
    dataset = PreparedDataset(resolve_data(cfg, accelerator))
    tokenizer_files = read_tree(dataset.tokenizer_dir)  # the one opened, whatever becomes of the dataset
    identity = run_identity(cfg, accelerator, dataset)
    _check_resumable(resume_from, identity)
    check_tokenizer_matches(cfg.text_model, dataset.root)
    model = _build_model(cfg, dataset)
    # The loaders normalize with what the image encoder's weights expect (EfficientNet-Lite0: 0.5 / 0.5).
    image = getattr(model, "image", None)
    norm = (image.mean, image.std) if image is not None else None
    train_loader, val_loader, streamed = build_loaders(cfg, accelerator, dataset, norm)
    if cfg.compile:
        model = torch.compile(model)
    optimizer = torch.optim.AdamW(param_groups(model, cfg.weight_decay, cfg.lr, cfg.encoder_lr), lr=cfg.lr)
    # The schedule counts optimizer steps: micro-batches / accumulation, per process (each process takes
    # the same number of steps), never multiplied by the process count.
    total_steps = math.ceil(len(train_loader) / cfg.grad_accum) * cfg.epochs
    if cfg.max_steps:
        total_steps = min(total_steps, cfg.max_steps)
    scheduler = make_scheduler(
        optimizer,
        cfg.scheduler,
        int(total_steps * cfg.warmup_frac),
        total_steps,
        int(total_steps * cfg.probe_frac),
    )
    # The scheduler is not passed to prepare(): Accelerate would step it num_processes times per step.
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.register_for_checkpointing(scheduler)

    state = {**initial_state(), "run": identity}
    if resume_from is not None:
        state = {**load_checkpoint(accelerator, resume_from), "run": identity}
        check_finite_weights(model, f"the weights loaded from {resume_from}")
        train_loader.load_state_dict(state["loader"][accelerator.process_index])
        accelerator.print(f"resumed from {resume_from} (epoch {state['epoch']}, step {state['global_step']})")
        if state["global_step"] >= total_steps:  # the model directories are written again, nothing is trained
            accelerator.print(
                f"nothing left to train: the checkpoint is at step {state['global_step']} of {total_steps} "
                "(--epochs / --max-steps); raise them to train on"
            )
    if accelerator.is_main_process:
        _write_config(run_dir, identity, dataset, total_steps, resume_from, state["global_step"])
    # written once the run has started (a run that stops before leaves nothing; a refused resume changes nothing)
    tokenizer = snapshot_tokenizer(tokenizer_files, run_dir) if accelerator.is_main_process else None
    if accelerator.log_with:  # --report-to: the full configuration as the run's hyper-parameters
        start_trackers(accelerator, tracker_config(identity))
    ctx = EpochRunner(cfg, accelerator, model, optimizer, scheduler, train_loader, run_dir, total_steps, state)
    ctx.class_names = sorted(dataset.labels, key=dataset.labels.get)
    sampler = UtilizationSampler(cfg.profile_interval) if cfg.profile else contextlib.nullcontext()

    if getattr(signal.getsignal(signal.SIGINT), "pending", None) is not None:
        raise KeyboardInterrupt  # a start-up Ctrl-C that a library's catch-all swallowed (tools/train.py)
    with _StopFlag(cfg.stop_grace) as stop, sampler:
        ctx.stop, ctx.sampler = stop, (sampler if cfg.profile else None)
        last_metrics = ctx.fit(val_loader)
    if cfg.profile and accelerator.is_main_process:
        _write_profile(run_dir, ctx, train_loader, cfg, accelerator)
    summary = _summary(cfg, accelerator, state, last_metrics, ctx.interrupted, run_dir, t_start)
    summary["images"] = images_note({"train": train_loader, "val": val_loader}, streamed)
    if cfg.record_ids:  # debugging/test aid: a digest of this process's final weights
        _write_weights_digest(accelerator, model, run_dir)
    if accelerator.is_main_process:
        atomic_write_json(run_dir / "summary.json", summary)
        # RUN/model (best) and RUN/model-last: what users load, predict with and export
        best = summary["best_checkpoint"]
        write_run_models(run_dir, accelerator.unwrap_model(model), cfg, dataset, best, tokenizer)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return {**summary, "is_main_process": accelerator.is_main_process}


def _check_resumable(resume_from: Path | None, identity: dict) -> None:
    """Refuse to resume from a checkpoint whose run had other must-match settings than this one."""
    saved = read_trainer_state(resume_from) if resume_from is not None else None
    if saved is not None:
        diffs = resume_differences(saved.get("run", {}), identity)
        if diffs:
            raise CheckpointError(
                f"cannot resume from {resume_from}: these settings differ from the run that wrote it:\n  "
                + "\n  ".join(diffs)
                + "\nresume with the same settings, or start afresh with --overwrite (the old run is moved aside)"
            )


def _summary(
    cfg: TrainConfig,
    accelerator,
    state: dict,
    last_metrics: dict,
    interrupted: bool,
    run_dir: Path,
    t_start: float,
) -> dict:
    """summary.json's figures: the last and best evaluations, speed, the run's set-up and how far it got."""
    best = state.get("best_step")
    summary = {
        "val_acc": last_metrics.get("val_acc"),  # the last evaluation's
        "val_macro_f1": last_metrics.get("val_macro_f1"),
        "best_val_acc": state["best_val_acc"],
        "best_val_macro_f1": state.get("best_val_macro_f1"),
        "best_epoch": state.get("best_epoch"),
        "best_checkpoint": (
            str(checkpoint_dir(run_dir) / f"step-{best:08d}") if best is not None and cfg.checkpoints else None
        ),
        "images_per_s": last_metrics.get("images_per_s"),
        "wall_s": time.perf_counter() - t_start,
        "device": str(accelerator.device),
        "mixed_precision": accelerator.mixed_precision,
        "num_processes": accelerator.num_processes,
        "model": cfg.model,
        "preset": cfg.preset,
        "image_backbone": cfg.image_backbone,
        "text_model": cfg.text_model,
        "global_step": state["global_step"],
        "epochs_done": state["epoch"],
        "skipped_steps": state["skipped_steps"],
        "interrupted": interrupted,
        "run_dir": str(run_dir),
    }
    return summary


def tracker_config(identity: dict) -> dict:
    """The run's configuration as trackers take hyper-parameters: numbers, strings and bools (TensorBoard's
    hparams refuse None and containers, so those are written as text)."""
    return {k: v if isinstance(v, bool | int | float | str) else str(v) for k, v in identity.items()}


# The scalars TensorBoard's HParams view shows beside each run's hyper-parameters.
HPARAM_METRICS = ("epoch/val_acc", "epoch/val_macro_f1", "epoch/val_loss", "epoch/train_loss")


def start_trackers(accelerator, config: dict) -> None:
    """Start the --report-to trackers with ``config`` as hyper-parameters. TensorBoard gets them in the run
    that holds the scalars, naming the epoch figures as their metrics (Accelerate's own call writes them
    into a sub-run of their own, where the HParams view finds no metric to compare runs by)."""
    accelerator.init_trackers("mmfast")
    for tracker in accelerator.trackers:
        if tracker.name != "tensorboard":
            tracker.store_init_configuration(config)
            continue
        from torch.utils.tensorboard.summary import hparams

        writer = tracker.writer
        for summary in hparams(config, dict.fromkeys(HPARAM_METRICS, 0.0)):  # experiment, session start/end
            writer.file_writer.add_summary(summary)
        writer.flush()


def _build_model(cfg: TrainConfig, dataset: PreparedDataset) -> torch.nn.Module:
    if dataset.num_classes < 2:
        raise ValueError(
            f"{dataset.root} has one class ({next(iter(dataset.labels))!r}); a classifier needs two or more: "
            "prepare it with --label-column naming the column that holds the classes"
        )
    return build_model(
        cfg.model,
        dataset.num_classes,
        image_backbone=cfg.image_backbone,
        text_model=cfg.text_model,
        vocab_size=dataset.vocab_size,
        image_weights=cfg.image_weights,
        freeze_image=cfg.freeze_image,
        freeze_text=cfg.freeze_text,
        hidden=cfg.hidden,
        dropout=cfg.dropout,
        channels_last=cfg.channels_last,
        **({"combine": cfg.combine} if cfg.model == "late" else {}),
    )


def _write_config(
    run_dir: Path, identity: dict, dataset: PreparedDataset, total_steps: int, resumed_from: Path | None, step: int
) -> None:
    """config.json: this segment's resolved configuration on top, and every segment of the run in order."""
    segments = []
    if resumed_from is not None:
        try:
            segments = json.loads((run_dir / "config.json").read_text()).get("segments", [])
        except (OSError, ValueError, AttributeError):
            log.warning("%s unreadable: its earlier segments are not carried over", run_dir / "config.json")
    segment = {
        **identity,
        "data_dir": str(dataset.root),
        "total_steps": total_steps,
        "started_at_step": step,
        "resumed_from": str(resumed_from) if resumed_from is not None else None,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    atomic_write_json(run_dir / "config.json", {**segment, "segments": [*segments, segment]})


def _append_line(path: Path, line: str) -> None:
    """Append one line whole or not at all: a failed write (disk full) is cut back off the file."""
    with open(path, "ab") as f:
        size = f.seek(0, os.SEEK_END)
        try:
            f.write(line.encode() + b"\n")
            f.flush()
        except OSError:
            f.truncate(size)
            raise


def check_finite_weights(model: torch.nn.Module, what: str) -> None:
    """Raise NonFiniteLossError when any parameter holds NaN or inf (a CPU-GPU sync: checkpoints only)."""
    bad = [n for n, p in model.named_parameters() if not bool(torch.isfinite(p).all())]
    if bad:
        raise NonFiniteLossError(
            f"{what}: {len(bad)} parameter tensors hold NaN/inf (first: {bad[0]}); refusing to use or save "
            "them. Lower --lr, or resume from an earlier checkpoint"
        )


def _write_profile(
    run_dir: Path, ctx: EpochRunner, loader: MultimodalLoader, cfg: TrainConfig, accelerator
) -> None:
    """profile.json (phases, throughput, utilization, settings, verdict) and profile.png of this process."""
    settings = {
        "decode_device": "mixed" if loader.device.type == "cuda" else "cpu",
        "dali_threads": loader.num_threads,
        "prefetch": loader.prefetch,
        "cache_decoded": loader.cache_decoded,
        "batch_size": cfg.batch_size,
        "image_size": cfg.image_size,
        "mixed_precision": accelerator.mixed_precision,
        "channels_last": cfg.channels_last,
        "num_processes": accelerator.num_processes,
        "model": cfg.model,
        "grad_accum": cfg.grad_accum,
        "cuda_devices": torch.cuda.device_count(),  # what the advice may suggest, never a GPU there is not
        "cpu_fast_bf16": cpu_has_fast_bf16(),
    }
    report = build_report(ctx.timer, ctx.sampler, extra={"settings": settings})
    atomic_write_json(run_dir / "profile.json", {**report, "timeline": ctx.sampler.samples})
    try:
        plot_report(report, ctx.sampler.samples, str(run_dir / "profile.png"))
    except ImportError:
        log.warning("matplotlib is not installed: no profile.png")


def _write_weights_digest(accelerator, model, run_dir: Path) -> None:
    import hashlib

    h = hashlib.sha256()
    for name, t in sorted(accelerator.unwrap_model(model).state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    (run_dir / f"weights.rank{accelerator.process_index}.sha256").write_text(h.hexdigest())


@dataclass
class StepWindow:
    """What one --log-every interval has seen so far (this process)."""

    t0: float  # perf_counter at the window's start
    data0: float  # the timer's total data-wait seconds at the start
    loss_sum: float = 0.0  # sum of finite micro-batch losses x their samples
    loss_samples: int = 0
    seen: int = 0  # samples trained on (finite loss or not)


class EpochRunner:
    """Holds what one run's epochs share, so the loop below reads as a list of steps.

    ``loader`` is anything with ``__len__``, ``__iter__`` (one epoch of batch dicts), ``step``,
    ``set_epoch`` and ``state_dict`` (a MultimodalLoader in training; tools/bench_train.py replays
    batches held in memory to measure the loop alone).
    """

    def __init__(self, cfg, accelerator, model, optimizer, scheduler, loader, run_dir, total_steps, state):
        self.cfg, self.acc, self.model, self.opt, self.sched = cfg, accelerator, model, optimizer, scheduler
        self.loader, self.run_dir, self.total_steps, self.state = loader, run_dir, total_steps, state
        self.stop = None
        self.class_names = None  # names of class ids 0..C-1, for the per-class metrics
        self.interrupted = False
        self.consecutive_bad = 0
        # profiling reports the steady state: the first steps carry CUDA / cuDNN start-up and the first prefetch
        self.timer = StepTimer(enabled=True, cuda_sync=cfg.profile, warmup_steps=PROFILE_WARMUP_STEPS)
        self.sampler = None  # a running UtilizationSampler when profiling

    def fit(self, val_loader) -> dict:
        metrics = {}
        for epoch in range(self.state["epoch"], self.cfg.epochs):
            if self.done():  # resumed at or past --max-steps: nothing left to train
                break
            self.loader.set_epoch(epoch)
            train_stats = self.train_epoch(epoch)
            if self.interrupted:
                break
            with self.timer.phase("eval"):
                val_metrics = (
                    evaluate(self.acc, self.model, val_loader, self.class_names) if val_loader is not None else {}
                )
            metrics = {
                "epoch": epoch,
                "step": self.state["global_step"],
                **train_stats,
                **val_metrics,
                "lr": self.sched.get_last_lr()[0],
                "skipped_steps": self.state["skipped_steps"],
                "skipped_samples": len(self.loader.bad),
            }
            if metrics.get("val_acc", 0.0) > self.state["best_val_acc"] or self.state.get("best_step") is None:
                # This step's checkpoint (written just below) is the best one: retention never removes it.
                self.state.update(
                    best_val_acc=metrics.get("val_acc", 0.0),
                    best_val_macro_f1=metrics.get("val_macro_f1"),
                    best_epoch=epoch,
                    best_step=self.state["global_step"],
                )
            if train_stats["epoch_complete"]:
                self.state.update(epoch=epoch + 1, epoch_stats=None, loader=self.loader_states())
            # else: --max-steps stopped the epoch; train_epoch saved its position, so a resume with a
            # larger --max-steps continues this same epoch.
            self.log_metrics(metrics)
            self.checkpoint()
            if self.done():
                break
        return metrics

    def done(self) -> bool:
        return self.state["global_step"] >= self.total_steps

    def train_epoch(self, epoch: int) -> dict:
        cfg, acc, loader = self.cfg, self.acc, self.loader
        s = self.state["epoch_stats"] or {"loss_sum": 0.0, "samples": 0, "time": 0.0, "data_wait": 0.0}
        n_batches = len(loader)
        self.model.train()
        bar = self.progress_bar(epoch, n_batches, loader.step)
        start = dict(self.timer.totals)  # the run-level timer keeps counting; this epoch is the difference
        n_samples = len(self.sampler.samples) if self.sampler is not None else 0
        t0 = time.perf_counter()
        logwin = StepWindow(t0, self.timer.total("data"))  # what the next --log-every line averages
        i = loader.step  # micro-batch index in the epoch (not 0 after a mid-epoch resume)
        for batch in self.timer.iterate(loader):  # the wait for each batch is the "data" phase
            window_end = (i + 1) % cfg.grad_accum == 0 or i + 1 == n_batches
            # The last window of an epoch may be shorter: divide by its real length so the gradient is
            # the mean over the samples it saw.
            window_start = (i // cfg.grad_accum) * cfg.grad_accum
            accum = min(cfg.grad_accum, n_batches - window_start)
            loss = self.micro_step(batch, accum, sync=window_end)
            n = int(batch["label"].shape[0])
            if math.isfinite(loss):  # a non-finite step is skipped and counted, not averaged in
                s["loss_sum"] += loss * n
                s["samples"] += n
                logwin.loss_sum, logwin.loss_samples = logwin.loss_sum + loss * n, logwin.loss_samples + n
            logwin.seen += n
            self.timer.end_step(n)
            if self.cfg.record_ids:
                self.record_ids(epoch, batch["id"])
            i += 1
            if bar is not None:
                bar.update(1)
            if not window_end:
                continue
            self.optimizer_step()
            if bar is not None:
                bar.set_postfix_str(self.step_line(logwin, bar=True), refresh=False)
            if self.state["global_step"] % cfg.log_every == 0:
                self.log_step(epoch, logwin, terminal=bar is not None)
                logwin = StepWindow(time.perf_counter(), self.timer.total("data"))
            self.interrupted = self.stop_requested()
            periodic = cfg.checkpoint_every and self.state["global_step"] % cfg.checkpoint_every == 0
            stop_mid_epoch = self.done() and i < n_batches  # --max-steps reached inside the epoch
            if self.interrupted or stop_mid_epoch or (periodic and i < n_batches):
                s_now = {
                    **s,
                    "time": s["time"] + time.perf_counter() - t0,
                    "data_wait": s["data_wait"] + self.timer.total("data") - start.get("data", 0.0),
                }
                self.state.update(epoch_stats=s_now, loader=self.loader_states())
                if not stop_mid_epoch:  # fit() writes that one after the evaluation
                    self.checkpoint()
            if self.interrupted:
                step = self.state["global_step"]
                acc.print(
                    f"stop signal: checkpoint written at step {step}; resume with --resume latest"
                    if self.cfg.checkpoints
                    else f"stop signal: stopped at step {step} (--no-checkpoints: nothing to resume)"
                )
                break
            if stop_mid_epoch:
                break
        if bar is not None:
            bar.close()
        s["time"] += time.perf_counter() - t0
        s["data_wait"] += self.timer.total("data") - start.get("data", 0.0)
        totals = self.acc.reduce(
            torch.tensor([s["loss_sum"], s["samples"]], dtype=torch.float64, device=acc.device), reduction="sum"
        )
        loss_sum, samples = totals.tolist()  # note: a CPU-GPU sync point, once per epoch
        return {
            "epoch_complete": i == n_batches,
            # An epoch whose every loss was non-finite has no mean: say NaN, never a reassuring 0.
            "train_loss": loss_sum / samples if samples else float("nan"),
            "images_per_s": samples / max(1e-9, s["time"]),
            "data_wait_frac": s["data_wait"] / max(1e-9, s["time"]),
            "phase_s": {k: round(v - start.get(k, 0.0), 4) for k, v in self.timer.totals.items()},
            **self.epoch_utilization(n_samples),
        }

    def epoch_utilization(self, first_sample: int) -> dict:
        """Mean GPU and CPU utilization over this epoch's samples (profiling only)."""
        if self.sampler is None:
            return {}
        new = self.sampler.samples[first_sample:]
        gpu = [x["gpu_util"] for x in new if "gpu_util" in x]
        # this run's own CPU share (other jobs on the machine do not count); the machine's where not sampled
        cpu = [
            x["proc_cpu_util"] if "proc_cpu_util" in x else sum(x["cpu_util"]) / len(x["cpu_util"]) for x in new
        ]
        return {
            "gpu_util_mean": sum(gpu) / len(gpu) if gpu else None,
            "cpu_util_mean": sum(cpu) / len(cpu) if cpu else None,
        }

    def micro_step(self, batch: dict, window: int, sync: bool) -> float:
        """Forward + backward of one micro-batch; gradients are all-reduced only at the window's end."""
        ctx = self.acc.no_sync(self.model) if not sync and self.acc.num_processes > 1 else contextlib.nullcontext()
        with ctx:
            with self.timer.phase("forward"):
                out = self.model(batch)  # (B, num_classes); autocast applied by Accelerate
                loss = training_loss(out, batch["label"])
            with self.timer.phase("backward"):
                self.acc.backward(loss / window)
        return loss.item()  # note: a CPU-GPU sync point per micro-batch (keeps NaN detection exact)

    def optimizer_step(self) -> None:
        acc, cfg = self.acc, self.cfg
        with self.timer.phase("optimizer"):
            norm = acc.clip_grad_norm_(self.model.parameters(), cfg.grad_clip) if cfg.grad_clip else None
            finite = norm is None or bool(torch.isfinite(norm))  # note: a sync point, once per optimizer step
            if acc.scaler is not None or finite:
                self.opt.step()  # with fp16 the GradScaler skips the step itself on inf/NaN gradients
            skipped = (not finite) if acc.scaler is None else self.opt.step_was_skipped
            self.opt.zero_grad(set_to_none=True)
        if skipped:
            self.state["skipped_steps"] += 1
            self.consecutive_bad += 1
            if self.consecutive_bad >= cfg.max_nan_steps:
                raise NonFiniteLossError(
                    f"{self.consecutive_bad} consecutive optimizer steps had non-finite gradients (NaN/inf loss); "
                    "stopping instead of training garbage. Lower --lr, use --mixed-precision bf16 or no, "
                    "or check the data"
                )
        else:
            self.consecutive_bad = 0
            self.sched.step()
        self.state["global_step"] += 1

    def stop_requested(self) -> bool:
        """Whether any process got SIGTERM/SIGINT; all processes agree, so all stop at this same step.

        A collective call at every optimizer step of a multi-process run (one small all-reduce).
        """
        local = self.stop is not None and self.stop.signum is not None
        if self.acc.num_processes == 1:
            return local
        flag = torch.tensor([int(local)], device=self.acc.device)
        return bool(self.acc.reduce(flag, reduction="sum").item())  # note: a sync point per optimizer step

    def loader_states(self) -> list[dict]:
        """Every process's loader position (a collective call): the main process saves them all."""
        from accelerate.utils import gather_object

        return gather_object([self.loader.state_dict()])

    def checkpoint(self) -> None:
        if not self.cfg.checkpoints:
            return
        with self.timer.phase("checkpoint"):  # reported apart from training time when profiling
            check_finite_weights(self.model, f"step {self.state['global_step']}")
            save_checkpoint(
                self.acc,
                self.run_dir,
                self.state["global_step"],
                self.state,
                self.cfg.keep_checkpoints,
                protect=self.state.get("best_step"),
            )

    def record_ids(self, epoch: int, ids: torch.Tensor) -> None:
        path = self.run_dir / f"seen_ids.rank{self.acc.process_index}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps({"epoch": epoch, "step": self.state["global_step"], "ids": ids.tolist()}) + "\n")

    def log_metrics(self, metrics: dict) -> None:
        if not self.acc.is_main_process:
            return
        _append_line(self.run_dir / "metrics.jsonl", json.dumps(metrics))
        val = (
            f" val_loss {metrics['val_loss']:.4f} val_acc {metrics['val_acc']:.4f} "
            f"macro-F1 {metrics['val_macro_f1']:.4f}"
            if "val_acc" in metrics
            else ""
        )
        self.acc.print(
            f"epoch {metrics['epoch']}: train_loss {metrics['train_loss']:.4f}{val} "
            f"{metrics['images_per_s']:.0f} img/s data_wait {metrics['data_wait_frac']:.0%}"
        )
        if self.acc.trackers:
            numbers = {f"epoch/{k}": v for k, v in metrics.items() if isinstance(v, int | float) and k != "step"}
            self.acc.log({k: v for k, v in numbers.items() if not isinstance(v, bool)}, step=metrics["step"])

    def progress_bar(self, epoch: int, total: int, initial: int):
        """A tqdm bar over the epoch's micro-batches on the main process when stderr is a terminal, else None
        (``log_step`` then prints a line every --log-every steps)."""
        if not (self.cfg.progress and self.acc.is_main_process and sys.stderr.isatty()):
            return None
        from tqdm import tqdm

        return tqdm(total=total, initial=initial, desc=f"epoch {epoch}", leave=False, dynamic_ncols=True)

    def step_figures(self, w: StepWindow) -> dict:
        """The mean loss, the lr, images/s and the data-wait share since the window began. The loss is this
        process's (no collective per log); images/s counts every process (each takes equal batches)."""
        elapsed = max(1e-9, time.perf_counter() - w.t0)
        lrs = self.sched.get_last_lr()
        # train/lr: the heads' (the first group); a pretrained encoder's own lr (--encoder-lr, 0 during the
        # --probe-frac linear probe) as train/lr_encoder
        encoder = [lr for lr, g in zip(lrs, self.opt.param_groups, strict=True) if g.get("pretrained")]
        return {
            "train/loss": w.loss_sum / w.loss_samples if w.loss_samples else float("nan"),
            "train/lr": lrs[0],
            **({"train/lr_encoder": encoder[0]} if encoder else {}),
            "train/images_per_s": w.seen * self.acc.num_processes / elapsed,
            "train/data_wait_frac": min(1.0, (self.timer.total("data") - w.data0) / elapsed),
        }

    def step_line(self, w: StepWindow, bar: bool = False) -> str:
        f = self.step_figures(w)
        line = f"loss {f['train/loss']:.4f} lr {f['train/lr']:.2e} {f['train/images_per_s']:.0f} img/s"
        return line if bar else f"{line} data_wait {f['train/data_wait_frac']:.0%}"

    def log_step(self, epoch: int, w: StepWindow, terminal: bool) -> None:
        """Every --log-every optimizer steps: the window's figures to the trackers, and as one line when no
        progress bar shows them (stderr is not a terminal)."""
        if not self.acc.is_main_process:
            return
        step = self.state["global_step"]
        if self.acc.trackers:
            self.acc.log(self.step_figures(w), step=step)
        if self.cfg.progress and not terminal:
            self.acc.print(f"epoch {epoch} step {step}/{self.total_steps}: {self.step_line(w)}")


@torch.no_grad()
def evaluate(accelerator, model, loader, class_names: list[str] | None = None) -> dict:
    """Loss, accuracy, macro-F1 and per-class precision/recall over the whole split, all processes together
    (padding samples excluded)."""
    model.eval()
    c = loader.num_classes
    totals = torch.zeros(2, dtype=torch.float64, device=accelerator.device)  # loss_sum, count
    confusion = torch.zeros(c * c, dtype=torch.int64, device=accelerator.device)  # (true, predicted), flat
    for batch in loader:  # no set_epoch: the eval order is fixed, and the loader keeps its pipeline
        logits = model(batch)
        labels = batch["label"]
        keep = labels != IGNORE_LABEL
        totals[0] += compute_loss(logits[keep], labels[keep], reduction="sum")
        totals[1] += keep.sum()
        confusion += torch.bincount(labels[keep] * c + logits.argmax(1)[keep], minlength=c * c)
    model.train()
    loss_sum, count = accelerator.reduce(totals, reduction="sum").tolist()
    cm = accelerator.reduce(confusion, reduction="sum").cpu().numpy().reshape(c, c)  # note: a sync point
    figures = confusion_figures(cm, class_names)
    return {
        "val_loss": loss_sum / max(1, count),
        "val_acc": figures["acc"],
        "val_macro_f1": figures["macro_f1"],
        "val_samples": int(count),
        "val_per_class": figures["per_class"],
    }
