"""A run from start to end: ``train`` claims the run directory, opens the data, builds the task, the model, the
loaders and the optimizer, resumes a checkpoint, hands them to the loop (``engine.EpochRunner``) and leaves
the run directory's files (config.json, summary.json, the model directories)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

import torch

from mmfast.data.dataset import PreparedDataset
from mmfast.infer.model_config import ModelConfig
from mmfast.infer.model_dir import write_run_models
from mmfast.loading.feature_loader import FeatureLoader
from mmfast.models import build_model, model_class
from mmfast.tasks import build_task
from mmfast.tasks.registry import Task
from mmfast.train.checkpoint import CheckpointError, load_checkpoint, read_trainer_state, resolve_resume
from mmfast.train.config import TrainConfig
from mmfast.train.data import build_loaders, image_norm, images_note, train_view_loader
from mmfast.train.elastic import loader_state, without_elastic
from mmfast.train.engine import EpochRunner, check_finite_weights, initial_state
from mmfast.train.features import feature_train_loader, feature_val_loader
from mmfast.train.hardware import (
    check_compile_fits,
    choices_made,
    compile_note,
    compile_options,
    resolve_channels_last,
)
from mmfast.train.heartbeat import Heartbeat
from mmfast.train.optim import build_optimizer, total_steps
from mmfast.train.profiler import UtilizationSampler
from mmfast.train.prompt_map_fit import fit_prompt_map
from mmfast.train.report import (
    encoder_lr_note,
    shard_figures,
    start_trackers,
    summarize,
    tracker_config,
    write_config,
    write_profile,
    write_weights_digest,
)
from mmfast.train.resolve import resolve_batches, resolve_preset
from mmfast.train.resume_rules import resume_differences
from mmfast.train.rundir import RunDirError, RunDirPlan, claim_run_dir, plan_run_dir, read_tree, snapshot_tokenizer
from mmfast.train.setup import (
    all_processes_ok,
    check_data_exists,
    check_tokenizer_matches,
    make_accelerator,
    resolve_data,
)
from mmfast.train.slices import DataConfig, ProcessConfig, ReportConfig, Slices, cut, slices
from mmfast.train.stop import StopFlag
from mmfast.train.warm_start import ridge_start
from mmfast.train.wise_ft import start_weights
from mmfast.util.fsutil import atomic_write_json

DEFAULT_OUT = "runs/latest"


def train(cfg: TrainConfig) -> dict:
    """Run training as configured; returns the summary (also written to ``<out>/summary.json``).

    Can be called several times in one process (tests, notebooks): Accelerate's process-wide state is
    reset when a run ends, so the next run may choose another mixed precision.

    Args:
        cfg: the run's configuration (``parse_config`` or ``TrainConfig(...)``).

    Returns:
        summary.json's figures, plus ``is_main_process``.
    """
    return as_run(cfg, _run)


# What a run does once its directory is claimed: (cfg, accelerator, checkpoint to resume or None, start time)
RunBody = Callable[[TrainConfig, object, Path | None, float], dict]


def as_run(cfg: TrainConfig, body: RunBody) -> dict:
    """``body`` as a run: the configuration resolved, the Accelerator made, --out claimed (an earlier run moved
    aside as the flags say; put back when ``body`` stopped before writing anything), the processes told of a
    failure, and Accelerate's process-wide state reset at the end. ``train`` runs a training so, and
    mmfast-profile (``mmfast.cli.profile_run``) a profile's steps (``short_profile.time_steps``).

    Returns:
        what ``body`` returns.
    """
    # accelerate: a slow import, only once a run starts
    from accelerate.state import AcceleratorState, GradientState

    try:
        return _train(cfg, body)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def run_identity(cfg: TrainConfig, accelerator, dataset: PreparedDataset) -> dict:
    """What a checkpoint must agree with to be resumed: the config, the process layout, the data."""
    return {
        **asdict(cfg),
        "num_processes": accelerator.num_processes,
        "mixed_precision_resolved": accelerator.mixed_precision,
        "data_fingerprint": dataset.fingerprint,
    }


def _train(cfg: TrainConfig, body: RunBody) -> dict:
    t_start = time.perf_counter()
    default_out = cfg.out is None
    given, cfg = cfg, replace(resolve_preset(cfg), out=cfg.out or DEFAULT_OUT)
    accelerator = make_accelerator(cut(ProcessConfig, cfg))
    cfg = resolve_batches(cfg, accelerator.num_processes)  # the micro-batch, the accumulation, the eval batch
    memory_format = resolve_channels_last(
        cfg.channels_last, accelerator.device.type, cfg.image_backbone, cfg.model
    )
    cfg = replace(cfg, channels_last=memory_format)  # what config.json records
    if note := encoder_lr_note(cut(ReportConfig, given), cut(ReportConfig, cfg)):
        accelerator.print(note)
    heartbeat = Heartbeat(accelerator.process_index, accelerator.num_processes)
    lock, failed = None, True
    try:
        check_data_exists(cut(DataConfig, cfg))  # the cheaper mistake first: before --out is looked at
        lock, resume_from = _claim(cfg, accelerator, default_out)
        summary = body(cfg, accelerator, resume_from, t_start)
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
    if cfg.resume == "latest" and resume_from is None:  # a job script's restart-or-start: said, not an error
        accelerator.print(f"--resume latest: no checkpoint in {run_dir}, so this is a fresh run")
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


def _run(cfg: TrainConfig, accelerator, resume_from: Path | None, t_start: float) -> dict:
    """Set the run up, train, and write what it leaves; returns the summary."""
    run_dir = Path(cfg.out)
    from accelerate.utils import set_seed  # accelerate: a slow import, only once a run starts

    set_seed(cfg.seed)
    parts = slices(cfg)  # what each builder takes of the resolved configuration
    dataset = PreparedDataset(resolve_data(parts.data, accelerator))
    tokenizer_files = read_tree(dataset.tokenizer_dir)  # the one opened, whatever becomes of the dataset
    identity = run_identity(cfg, accelerator, dataset)
    _check_resumable(resume_from, identity)
    check_tokenizer_matches(cfg.text_model, dataset.root)
    task = build_task(cfg.task, dataset, parts.model)
    if (check := getattr(task, "check_step_samples", None)) is not None:  # before a model or loader is built
        if note := check(cfg.batch_size * cfg.grad_accum * accelerator.num_processes):
            accelerator.print(note)
    model = build_run_model(parts.model, dataset, task)
    # The loaders normalize with what the image encoder's weights expect (EfficientNet-Lite0: 0.5 / 0.5).
    norm = image_norm(getattr(model, "image", None))
    train_loader, val_loader, streamed, cache = build_loaders(parts.loader, accelerator, dataset, norm)
    # its fetches end with the loop, also when a fault stops the run (the warm start reads shards too)
    with cache or contextlib.nullcontext():
        # --feature-cache: the locked image tower's features of every stored view, computed once (or read)
        train_loader, features = feature_train_loader(
            parts.features, accelerator, dataset, model, norm, cache, train_loader
        )
        val_loader = feature_val_loader(
            parts.features, accelerator, dataset, model, norm, cache, val_loader, features
        )
        starts = _starts(cfg, accelerator, (dataset, model, norm, cache, train_loader, task), resume_from is None)
        steps = total_steps(parts.optim, len(train_loader))
        model, optimizer, scheduler, start = _optimized(parts, accelerator, model, task, steps, cfg.wise_ft)
        state = _start_state(accelerator, task, identity, resume_from, model, train_loader, steps)
        if accelerator.is_main_process:
            write_config(run_dir, identity, dataset.root, steps, resume_from, state["global_step"])
        # written once the run has started (a run that stops before leaves nothing; a refused resume: nothing)
        tokenizer = snapshot_tokenizer(tokenizer_files, run_dir) if accelerator.is_main_process else None
        if accelerator.log_with:  # --report-to: the full configuration as the run's hyper-parameters
            start_trackers(accelerator, tracker_config(identity), task)
        runner = EpochRunner(
            parts.loop,
            accelerator,
            model,
            optimizer,
            scheduler,
            train_loader,
            run_dir,
            steps,
            state,
            task,
            shard_cache=cache,
            start=start,
        )
        last_metrics = _fit(cfg, runner, val_loader)
    if cfg.profile and accelerator.is_main_process:
        write_profile(
            run_dir, runner.timer, runner.sampler, train_loader, parts.report, accelerator, features=features
        )
    summary = summarize(parts.report, accelerator, task, state, last_metrics, runner.interrupted, t_start)
    summary["hardware_choices"] = choices_made(parts.compile, accelerator, optimizer)
    summary.update(starts)
    summary["images"] = images_note({"train": train_loader, "val": val_loader}, streamed)
    if features is not None:
        summary["feature_cache"] = features
    summary.update(shard_figures(accelerator, cache))  # the counters at the end, the last evaluation's included
    if cfg.record_ids:  # debugging/test aid: a digest of this process's final weights
        write_weights_digest(accelerator, model, run_dir)
    if accelerator.is_main_process:
        atomic_write_json(run_dir / "summary.json", summary)
        # RUN/model (best) and RUN/model-last: what users load, predict with and export
        best = summary["best_checkpoint"]
        write_run_models(run_dir, accelerator.unwrap_model(model), parts.model, dataset, best, tokenizer)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return {**summary, "is_main_process": accelerator.is_main_process}


def _optimized(parts: Slices, accelerator, model, task: Task, steps: int, wise_ft: float | None):
    """The model compiled as --compile says, and its optimizer and schedule for ``steps`` steps, prepared by
    Accelerate; returns (model, optimizer, scheduler, --wise-ft's copy of the start: None for none)."""
    start = start_weights(model, wise_ft)  # of the module itself, before compiling: the wrappers share its tensors
    if (compiling := compile_options(parts.compile)) is not None:
        check_compile_fits(parts.compile, task)
        if note := compile_note(parts.compile, accelerator.device.type):
            accelerator.print(f"note: {note}")
        model = torch.compile(model, **compiling)
    optimizer, scheduler = build_optimizer(parts.optim, model, steps, accelerator.device.type)
    # The scheduler is not passed to prepare(): Accelerate would step it num_processes times per step.
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.register_for_checkpointing(scheduler)
    if start is not None:  # each checkpoint carries it, and a resume loads it (after the scheduler: their order)
        accelerator.register_for_checkpointing(start)
    return model, optimizer, scheduler, start


def _start_state(
    accelerator, task: Task, identity: dict, resume_from: Path | None, model, train_loader, steps: int
) -> dict:
    """The trainer state the loop starts from: a fresh one, or the checkpoint's (its weights, optimizer and
    scheduler loaded, the train loader put back where it stood)."""
    if resume_from is None:
        return {**initial_state(task), "run": identity}
    loaded = load_checkpoint(accelerator, resume_from)
    state = {**loaded, "run": identity}
    check_finite_weights(model, f"the weights loaded from {resume_from}")
    saved = state["loader"]
    layout = train_loader.batch_size, train_loader.num_shards, train_loader.shard_id
    train_loader.load_state_dict(loader_state(saved, *layout))
    if len(saved) != train_loader.num_shards:  # an elastic resume (--global-batch-size): the same global position
        accelerator.print(
            f"the checkpoint was written by {len(saved)} processes; this run has {train_loader.num_shards}"
        )
    accelerator.print(f"resumed from {resume_from} (epoch {state['epoch']}, step {state['global_step']})")
    if state["global_step"] >= steps:  # the model directories are written again, nothing is trained
        accelerator.print(
            f"nothing left to train: the checkpoint is at step {state['global_step']} of {steps} "
            "(--epochs / --max-steps); raise them to train on"
        )
    elif note := _schedule_change(loaded.get("run", {}), identity, steps):
        accelerator.print(note)
    return state


def _schedule_change(saved: dict, now: dict, steps: int) -> str | None:
    """A line when the resumed run's --epochs / --max-steps differ from the checkpoint's run: the schedule is
    the new run's, so the learning rate may rise again (training.md, "Resume")."""
    keys = [k for k in ("epochs", "max_steps") if k in saved and saved[k] != now.get(k)]
    if not keys:
        return None

    def flag(k: str, v) -> str:
        return f"--{k.replace('_', '-')} {v}" if v is not None else f"no --{k.replace('_', '-')}"

    was = ", ".join(flag(k, saved[k]) for k in keys)
    new = ", ".join(flag(k, now.get(k)) for k in keys)
    return (
        f"the learning-rate schedule now spans {steps} steps ({new}; the checkpoint's run had {was}): "
        "the rate from here follows it, and may rise again"
    )


def _starts(cfg: TrainConfig, accelerator, parts: tuple, fresh: bool) -> dict:
    """What summary.json records of the passes before training: "init_proj" (a fresh run's ridge start of the
    projections) and "zero_shot_map" (fitted on a resumed run too, before its checkpoint loads: it depends on
    nothing training changes), each where there was one. ``parts``: (dataset, model, norm, cache, train_loader,
    task)."""
    warm = _warm_start(cfg, accelerator, *parts) if fresh else None
    starts = {"init_proj": warm, "zero_shot_map": _zero_shot_map(cfg, accelerator, *parts)}
    return {k: v for k, v in starts.items() if v is not None}


def _warm_start(
    cfg: TrainConfig, accelerator, dataset: PreparedDataset, model, norm, cache, train_loader, task
) -> dict | None:
    """--init-proj ridge on a fresh run: the dual encoder's projections from one pass over the train split
    (``warm_start``), its lambda picked on the split's held-out images (``task``'s image groups); None when the
    projections start at random. A resumed run has its checkpoint's. With a feature cache (``train_loader`` a
    ``FeatureLoader``) the pass reads its centre view instead of decoding."""
    if cfg.init_proj != "ridge":
        return None
    loader = _centre_loader(cfg, accelerator, dataset, model, norm, cache, train_loader)
    figures = ridge_start(model, loader, accelerator, image_groups=getattr(task, "image_groups", None))
    how = f"lambda {figures['lambda_per_sample']:g}"
    if pick := figures.get("lambda_pick"):
        how += f", picked on {pick['held_out_images']} held-out images"
    accelerator.print(
        f"projections started from the ridge map of {figures['samples']} samples ({how}; {figures['seconds']} s)"
    )
    return figures


def _centre_loader(cfg: TrainConfig, accelerator, dataset, model, norm, cache, train_loader):
    """The train split as evaluation sees it, in epoch 0's order, for a pass before training (the model moved
    to the device): decoded, or the centre view a feature cache holds (``train_loader`` a ``FeatureLoader``)."""
    model.to(accelerator.device)
    loader = train_view_loader(slices(cfg).loader, accelerator, dataset, norm, cache)
    if (features := getattr(train_loader, "features", None)) is not None:
        loader = FeatureLoader(loader, features, centre=True, text=train_loader.text)
    return loader


def _zero_shot_map(cfg: TrainConfig, accelerator, dataset, model, norm, cache, train_loader, task) -> dict | None:
    """--zero-shot-map kernel: the dual encoder's zero-shot map fitted in one pass over the train split
    (``prompt_map_fit``); None without one."""
    if cfg.zero_shot_map in (None, "none"):
        return None
    loader = _centre_loader(cfg, accelerator, dataset, model, norm, cache, train_loader)
    figures = fit_prompt_map(model, loader, accelerator, getattr(task, "image_groups", None))
    how = f"lambda {figures['lambda']:g}, gamma {figures['gamma']:g}"
    if pick := figures.get("pick"):
        how += f" picked on {pick['held_out_images']} held-out images"
    accelerator.print(
        f"zero-shot map: kernel ridge of {figures['samples']} samples into the text tower as it starts ({how}; "
        f"{figures['seconds']} s)"
    )
    return figures


def _fit(cfg: TrainConfig, runner: EpochRunner, val_loader) -> dict:
    """The loop under the stop signals' handler (and the utilization sampler when profiling)."""
    sampler = UtilizationSampler(cfg.profile_interval) if cfg.profile else contextlib.nullcontext()
    with StopFlag(cfg.stop_grace) as stop, sampler:
        runner.stop, runner.sampler = stop, (sampler if cfg.profile else None)
        return runner.fit(val_loader)


def _check_resumable(resume_from: Path | None, identity: dict) -> None:
    """Refuse to resume from a checkpoint whose run had other must-match settings than this one."""
    saved = read_trainer_state(resume_from) if resume_from is not None else None
    if saved is not None:
        diffs = without_elastic(resume_differences(saved.get("run", {}), identity), saved.get("run", {}), identity)
        if diffs:
            raise CheckpointError(
                f"cannot resume from {resume_from}: these settings differ from the run that wrote it:\n  "
                + "\n  ".join(diffs)
                + "\nresume with the same settings, or start afresh with --overwrite (the old run is moved aside)"
            )


def build_run_model(cfg: ModelConfig, dataset: PreparedDataset, task: Task) -> torch.nn.Module:
    """The configured model with the task's outputs; a model's own options (``config_options``) come from the
    model slice's fields of those names."""
    options = {name: getattr(cfg, name) for name in getattr(model_class(cfg.model), "config_options", ())}
    return build_model(
        cfg.model,
        task.num_outputs,
        image_backbone=cfg.image_backbone,
        text_model=cfg.text_model,
        vocab_size=dataset.vocab_size,
        image_weights=cfg.image_weights,
        freeze_image=cfg.freeze_image,
        freeze_text=cfg.freeze_text,
        text_train_layers=cfg.text_train_layers,
        image_pool=cfg.image_pool,
        hidden=cfg.hidden,
        dropout=cfg.dropout,
        channels_last=cfg.channels_last,
        **options,
    )
