"""A short profile (``mmfast-profile``): a run's training steps timed, and nothing else a run does.

``time_steps`` sets up the run as ``mmfast-train`` would (data, task, model, train loader, optimizer,
precision, compilation) from the configuration's slices, trains ``warmup`` + ``steps`` optimizer steps (the
run's ``max_steps``) and writes profile.json and profile.png. ``mmfast.cli.profile_run`` runs it as a run's
body (``run.as_run``).
It evaluates nothing, writes no checkpoint, metrics, summary or model directory, starts no tracker and builds
no val loader. A dual encoder's projections start at random: ``--init-proj ridge`` is a pass before training,
and a step takes as long from either start. ``--zero-shot-map kernel``'s pass is skipped too: it changes no step.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from mmfast.data.dataset import PreparedDataset
from mmfast.tasks import build_task
from mmfast.train.data import build_loaders, image_norm
from mmfast.train.engine import EpochRunner, initial_state
from mmfast.train.features import feature_train_loader
from mmfast.train.hardware import check_compile_fits, compile_options
from mmfast.train.optim import build_optimizer
from mmfast.train.profiler import UtilizationSampler
from mmfast.train.report import write_profile
from mmfast.train.run import build_run_model
from mmfast.train.setup import check_tokenizer_matches, resolve_data
from mmfast.train.slices import Slices
from mmfast.train.stop import StopFlag

RIDGE_SKIPPED = "projections start at random: a profile skips --init-proj ridge's pass (a step takes as long)"
MAP_SKIPPED = "no zero-shot map: a profile skips --zero-shot-map kernel's pass (it changes no step)"


def time_steps(parts: Slices, accelerator, warmup: int) -> dict:
    """The run's set-up, its timed steps, and profile.json / profile.png on the main process.

    Args:
        parts: the resolved configuration's slices; ``parts.run.max_steps`` counts ``warmup`` and the timed
            steps.
        accelerator: the run's Accelerator.
        warmup: optimizer steps left out of the figures.

    Returns:
        the report profile.json holds (on the main process), plus ``is_main_process``.
    """
    from accelerate.utils import set_seed  # accelerate: a slow import, only once a run starts

    run = parts.run
    set_seed(run.seed)
    dataset = PreparedDataset(resolve_data(parts.data, accelerator))
    check_tokenizer_matches(parts.model.text_model, dataset.root)
    task = build_task(parts.model.task, dataset, parts.model)
    model = build_run_model(parts.model, dataset, task)
    image = getattr(model, "image", None)  # the loader normalizes as the image encoder expects
    norm = image_norm(image)
    loader, _, _, cache = build_loaders(parts.loader, accelerator, dataset, norm, val=False)
    notes = [RIDGE_SKIPPED] if run.init_proj == "ridge" else []
    notes += [MAP_SKIPPED] if run.zero_shot_map == "kernel" else []
    total = run.max_steps
    accelerator.print(  # the notes are said once, in the report at the end
        f"profiling {total - warmup} steps after {warmup} warm-up step{'s' if warmup != 1 else ''}: "
        "no evaluation, checkpoint or model directory"
    )
    with cache or contextlib.nullcontext():
        # --feature-cache: the cache is built (or read) before the steps, which then read it
        loader, features = feature_train_loader(parts.features, accelerator, dataset, model, norm, cache, loader)
        if (compiling := compile_options(parts.compile)) is not None:
            check_compile_fits(parts.compile, task)
            model = torch.compile(model, **compiling)
        optimizer, scheduler = build_optimizer(parts.optim, model, total, accelerator.device.type)
        model, optimizer = accelerator.prepare(model, optimizer)
        state = initial_state(task)  # no checkpoint is written: nothing records the run's identity
        runner = EpochRunner(
            parts.loop, accelerator, model, optimizer, scheduler, loader, Path(run.out), total, state, task,
            shard_cache=cache, warmup_steps=warmup,
        )  # fmt: skip
        with StopFlag(run.stop_grace) as stop, UtilizationSampler(run.profile_interval) as sampler:
            runner.stop, runner.sampler = stop, sampler
            runner.run_steps()
    report = None
    if accelerator.is_main_process:
        report = write_profile(
            Path(run.out), runner.timer, sampler, loader, parts.report, accelerator, notes, features
        )
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return {**(report or {}), "is_main_process": accelerator.is_main_process}
