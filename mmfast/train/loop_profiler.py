"""Profile your own training loop: the verdict ``mmfast-profile`` gives a run (input-bound or not, and why), for a
loop you wrote around ``mmfast.ImageLoader`` or ``MultimodalLoader`` (or any iterable of batches)::

    profiler = mmfast.LoopProfiler()
    with profiler:                                       # samples CPU (and GPU) use meanwhile
        for images, labels in profiler.iterate(loader):  # the wait in next() is "data"
            loss = criterion(model(images), labels)      # the rest of each iteration is "compute"
            optimizer.zero_grad(); loss.backward(); optimizer.step()
    profiler.print_report()                              # or .report(), .save("runs/my-loop")

Each batch the loop takes is one step. Its data wait is the time spent in the loader's ``next()``; its compute
is the rest of the iteration, up to the request for the next batch, with the GPU synchronized there so that
queued kernels count where they were launched. Work inside the loop that is not training (an evaluation, a
checkpoint) goes under ``profiler.untimed("eval")``: timed, reported apart, and left out of the figures.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator, Sized
from pathlib import Path

import torch

from mmfast.train.config import PROFILE_WARMUP_STEPS
from mmfast.train.hardware import cpu_has_fast_bf16, cuda_has_bf16
from mmfast.train.profiler import (
    OUTSIDE_TRAINING,
    StepTimer,
    UtilizationSampler,
    build_report,
    plot_report,
    report_text,
)
from mmfast.train.verdict import OWN_LOOP, TORCH_LOADER
from mmfast.util.fsutil import atomic_write_json

_END = object()


class LoopProfiler:
    """Times a training loop's data wait and compute per step, samples utilization, and gives the verdict.

    Args:
        warmup_steps: steps left out of the figures (start-up lands in them: the loader's first batches,
            CUDA and cuDNN initialization). A loop no longer than that is reported whole.
        interval: seconds between utilization samples.
        cuda_sync: synchronize the GPU at each step's end and before each ``next()`` (honest figures, a little
            slower); no effect without CUDA.
    """

    def __init__(self, warmup_steps: int = PROFILE_WARMUP_STEPS, interval: float = 0.2, cuda_sync: bool = True):
        self.timer = StepTimer(cuda_sync=cuda_sync, warmup_steps=warmup_steps)
        self.interval = interval
        self.sampler = UtilizationSampler(interval)
        self.settings: dict = {}

    def __enter__(self) -> LoopProfiler:
        self.timer.reset()  # the figures are those of this block
        self.sampler = UtilizationSampler(self.interval)
        self.sampler.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.sampler.__exit__(*exc)

    def iterate(self, loader: Iterable, samples: Callable[[object], int] | None = None) -> Iterator:
        """Yield ``loader``'s batches, each one a step: the wait for it is "data", the loop's work on it
        "compute". Call it again for each epoch.

        Args:
            loader: the loop's loader; an mmfast loader's settings (device, DALI threads, prefetch, decoded
                cache, image size) shape the advice.
            samples: a batch's number of samples (default: the first dimension of its images, or of its first
                tensor).
        """
        self.settings = loader_settings(loader)
        timer, it = self.timer, iter(loader)
        while True:
            with timer.phase("data"):
                batch = next(it, _END)
            if batch is _END:
                return
            t0, outside0 = time.perf_counter(), _outside_seconds(timer)
            try:
                yield batch
            finally:  # the loop asks for the next batch, or leaves (break): the step ends here
                if timer.cuda_sync:
                    torch.cuda.synchronize()  # note: a CPU-GPU sync point, only when profiling
                untimed = _outside_seconds(timer) - outside0
                timer.add("compute", time.perf_counter() - t0 - untimed)
                timer.end_step(samples(batch) if samples is not None else batch_samples(batch))

    def untimed(self, name: str = "eval") -> contextlib.AbstractContextManager:
        """A context for work inside the loop that is not training: "eval" or "checkpoint"."""
        if name not in OUTSIDE_TRAINING:
            raise ValueError(f"untimed({name!r}): the name must be one of {', '.join(OUTSIDE_TRAINING)}")
        return self.timer.phase(name)

    def report(self) -> dict:
        """The figures, the settings read from the loader and the verdict, as profile.json holds them.

        Returns:
            ``steps``, ``samples``, ``train_wall_s``, ``phase_s`` ({"data", "compute", ...} seconds),
            ``data_wait_frac``, ``images_per_s``, ``utilization``, ``warmup``, ``settings`` and ``verdict``
            ({"bound": "input" | "host" | "compute", "summary", "next_steps"}).

        Raises:
            RuntimeError: no step was timed (no loop over ``iterate``, or its loader gave no batch).
        """
        if not self.timer.steps:
            raise RuntimeError(
                "no step was timed, so there is nothing to report: loop over profiler.iterate(loader) first "
                "(a loader that gives no batch times none)"
            )
        words = OWN_LOOP if self.settings.get("mmfast_loader") else TORCH_LOADER
        return build_report(self.timer, self.sampler, extra={"settings": self.settings}, words=words)

    def print_report(self) -> dict:
        """Print the report as ``mmfast-profile`` does; returns it."""
        report = self.report()
        print(report_text(report))
        return report

    def save(self, folder: str | Path) -> dict:
        """Write ``folder``/profile.json (with the utilization timeline) and profile.png, replacing the ones an
        earlier ``save`` wrote there; returns the report. ``mmfast-profile --run FOLDER`` prints it again."""
        report = self.report()  # before the folder: a report that cannot be made leaves no folder
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write_json(folder / "profile.json", {**report, "timeline": self.sampler.samples})
        with contextlib.suppress(ImportError):  # matplotlib: the profile extra
            plot_report(report, self.sampler.samples, str(folder / "profile.png"))
        return report


def loader_settings(loader) -> dict:
    """What the verdict's advice reads from a loader (an mmfast loader's attributes where it has them) and
    from this machine."""
    settings = {
        "batch_size": getattr(loader, "batch_size", None),
        "num_processes": getattr(loader, "num_shards", 1),
        "cuda_devices": torch.cuda.device_count(),
        "cpu_fast_bf16": cpu_has_fast_bf16(),
        "cuda_bf16": torch.cuda.is_available() and cuda_has_bf16(),
    }
    settings["mmfast_loader"] = type(loader).__module__.startswith("mmfast.")
    device = getattr(loader, "device", None)
    if isinstance(device, torch.device | str):
        settings["decode_device"] = "mixed" if torch.device(device).type == "cuda" else "cpu"
    threads = "num_threads" if settings["mmfast_loader"] else "num_workers"  # DALI threads, or torch's workers
    for key, attr in (("dali_threads", threads), ("prefetch", "prefetch"), ("image_size", "size")):
        if isinstance(getattr(loader, attr, None), int):
            settings[key] = getattr(loader, attr)
    if isinstance(getattr(loader, "holds_decoded", None), bool):
        settings["cache_decoded"] = loader.holds_decoded
    return settings


def batch_samples(batch) -> int:
    """The samples of a batch: the first dimension of its images (``batch["image"]``, ``batch[0]``), or of
    the first tensor it holds."""
    if isinstance(batch, dict):
        first = batch["image"] if "image" in batch else next(iter(batch.values()), None)
    elif isinstance(batch, list | tuple):
        first = batch[0] if batch else None
    else:
        first = batch
    if hasattr(first, "shape") and len(first.shape):
        return int(first.shape[0])
    if isinstance(first, Sized) and not isinstance(first, str | bytes):
        return len(first)
    raise TypeError(
        f"cannot count the samples of a batch ({type(batch).__name__}, its first item of type "
        f"{type(first).__name__}): pass iterate(loader, samples=lambda batch: ...)"
    )


def _outside_seconds(timer: StepTimer) -> float:
    return sum(timer.total(name) for name in OUTSIDE_TRAINING)
