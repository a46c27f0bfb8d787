"""A short profile (``mmfast-profile``): a run's training steps timed, and nothing else a run does.

``profile_steps`` sets up the run as ``mmfast-train`` would (data, task, model, train loader, optimizer,
precision, compilation), trains ``warmup`` + ``steps`` optimizer steps and writes profile.json and profile.png.
It evaluates nothing, writes no checkpoint, metrics, summary or model directory, starts no tracker and builds
no val loader. A dual encoder's projections start at random: ``--init-proj ridge`` is a pass before training,
and a step takes as long from either start.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from pathlib import Path

import torch

from mmfast.data.dataset import PreparedDataset
from mmfast.tasks import build_task
from mmfast.train.config import PROFILE_WARMUP_STEPS, TrainConfig
from mmfast.train.data import build_loaders, image_norm
from mmfast.train.engine import EpochRunner, initial_state
from mmfast.train.features import feature_train_loader
from mmfast.train.hardware import check_compile_fits, compile_options
from mmfast.train.optim import build_optimizer
from mmfast.train.profiler import UtilizationSampler
from mmfast.train.report import write_profile
from mmfast.train.run import as_run, build_run_model, run_identity
from mmfast.train.setup import check_tokenizer_matches, resolve_data
from mmfast.train.slices import slices
from mmfast.train.stop import StopFlag

RIDGE_SKIPPED = "projections start at random: a profile skips --init-proj ridge's pass (a step takes as long)"


def profile_steps(cfg: TrainConfig, steps: int, warmup: int = PROFILE_WARMUP_STEPS) -> dict:
    """Time ``steps`` optimizer steps of the configured run after ``warmup`` untimed ones.

    Args:
        cfg: the run to profile; its --out receives profile.json and profile.png (an earlier profile there is
            moved aside as a run's would be).
        steps: optimizer steps in the figures.
        warmup: optimizer steps before them (start-up, autotuning, the first prefetch), left out.

    Returns:
        the report profile.json holds (on the main process), plus ``is_main_process``.

    Raises:
        ValueError: ``steps`` < 1, ``warmup`` < 0, or a --resume (a profile times a fresh start).
    """
    if steps < 1 or warmup < 0:
        raise ValueError(f"--steps must be >= 1 and --warmup >= 0, got {steps} and {warmup}")
    if cfg.resume is not None:
        raise ValueError("a profile times a fresh start: leave out --resume")
    cfg = replace(
        cfg,
        profile=True,
        max_steps=warmup + steps,
        checkpoints=False,
        report_to=None,
        tensorboard=False,
        progress=False,
    )

    def body(cfg: TrainConfig, accelerator, resume_from: Path | None, t_start: float) -> dict:
        return _profile(cfg, accelerator, warmup)

    return as_run(cfg, body)


def _profile(cfg: TrainConfig, accelerator, warmup: int) -> dict:
    """The run's set-up, its timed steps, and profile.json / profile.png on the main process."""
    from accelerate.utils import set_seed  # accelerate: a slow import, only once a run starts

    set_seed(cfg.seed)
    parts = slices(cfg)  # what each builder takes, as in a training run
    dataset = PreparedDataset(resolve_data(parts.data, accelerator))
    check_tokenizer_matches(cfg.text_model, dataset.root)
    task = build_task(cfg.task, dataset, cfg)
    model = build_run_model(cfg, dataset, task)
    image = getattr(model, "image", None)  # the loader normalizes as the image encoder expects
    norm = image_norm(image)
    loader, _, _, cache = build_loaders(parts.loader, accelerator, dataset, norm, val=False)
    notes = [RIDGE_SKIPPED] if cfg.init_proj == "ridge" else []
    total = cfg.max_steps
    accelerator.print(
        f"profiling {total - warmup} steps after {warmup} warm-up step{'s' if warmup != 1 else ''}: "
        "no evaluation, checkpoint or model directory" + "".join(f"; {n}" for n in notes)
    )
    with cache or contextlib.nullcontext():
        # --feature-cache: the cache is built (or read) before the steps, which then read it
        loader, features = feature_train_loader(parts.features, accelerator, dataset, model, norm, cache, loader)
        if (compiling := compile_options(parts.compile)) is not None:
            check_compile_fits(parts.compile, task)
            model = torch.compile(model, **compiling)
        optimizer, scheduler = build_optimizer(parts.optim, model, total, accelerator.device.type)
        model, optimizer = accelerator.prepare(model, optimizer)
        state = {**initial_state(task), "run": run_identity(cfg, accelerator, dataset)}
        runner = EpochRunner(
            cfg, accelerator, model, optimizer, scheduler, loader, Path(cfg.out), total, state, task,
            shard_cache=cache, warmup_steps=warmup,
        )  # fmt: skip
        with StopFlag(cfg.stop_grace) as stop, UtilizationSampler(cfg.profile_interval) as sampler:
            runner.stop, runner.sampler = stop, sampler
            runner.run_steps()
    report = None
    if accelerator.is_main_process:
        report = write_profile(Path(cfg.out), runner.timer, sampler, loader, cfg, accelerator, notes, features)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return {**(report or {}), "is_main_process": accelerator.is_main_process}
