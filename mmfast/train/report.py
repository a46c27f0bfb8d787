"""What a run tells: metrics.jsonl lines and the epoch's log line, the per-step figures (trackers, a progress
bar or a line every --log-every steps), config.json, summary.json, the shard cache's counters of a run that
streams remote shards, the trackers' hyper-parameters, and the profile of a --profile run."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from mmfast.models.catalog import get_preset
from mmfast.tasks.registry import Task
from mmfast.train.checkpoint import checkpoint_dir
from mmfast.train.features import feature_note
from mmfast.train.hardware import compile_options, cpu_has_fast_bf16, cuda_has_bf16
from mmfast.train.profiler import StepTimer, UtilizationSampler, build_report, plot_report
from mmfast.train.slices import LoopConfig, ReportConfig
from mmfast.util.fsutil import atomic_write_json, atomic_write_jsonl

if TYPE_CHECKING:
    from mmfast.remote.shard_cache import ShardCache

log = logging.getLogger(__name__)


def append_line(path: Path, line: str) -> None:
    """Append one line whole or not at all: a failed write (disk full) is cut back off the file."""
    with open(path, "ab") as f:
        size = f.seek(0, os.SEEK_END)
        try:
            f.write(line.encode() + b"\n")
            f.flush()
        except OSError:
            f.truncate(size)
            raise


SKIPPED_FILE = "skipped.jsonl"  # every image the run's train loaders skipped: id, image, reason


def write_skipped(accelerator, run_dir: Path, skipped: list[dict]) -> None:
    """skipped.jsonl: the train images the loaders of every process have skipped so far (``skipped``: this
    process's), with those listed before a resume, a line each, by sample id; rewritten whole by the main
    process. A collective call."""
    from accelerate.utils import gather_object  # accelerate: a slow import, only once a run skips an image

    every = gather_object(list(skipped)) if accelerator.num_processes > 1 else list(skipped)
    if accelerator.is_main_process:
        path = run_dir / SKIPPED_FILE  # a resumed run's loaders start afresh: what was listed before stays
        before = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
        rows = sorted({e["id"]: e for e in [*before, *every]}.values(), key=lambda e: e["id"])
        atomic_write_jsonl(path, rows)


def write_epoch_metrics(accelerator, run_dir: Path, metrics: dict, task: Task) -> None:
    """The epoch's figures: a metrics.jsonl line, the printed line, and the trackers' epoch/ scalars (main
    process only)."""
    if not accelerator.is_main_process:
        return
    append_line(run_dir / "metrics.jsonl", json.dumps(metrics))
    accelerator.print(
        f"epoch {metrics['epoch']}: train_loss {metrics['train_loss']:.4f}{task.epoch_line(metrics)} "
        f"{metrics['images_per_s']:.0f} img/s data_wait {metrics['data_wait_frac']:.0%}"
    )
    if accelerator.trackers:
        numbers = {f"epoch/{k}": v for k, v in metrics.items() if isinstance(v, int | float) and k != "step"}
        for name, figures in (metrics.get("sources") or {}).items():  # a mix: each source's samples and loss
            numbers.update({f"epoch/{name}/{k}": v for k, v in figures.items() if v is not None})
        accelerator.log({k: v for k, v in numbers.items() if not isinstance(v, bool)}, step=metrics["step"])


@dataclass
class StepWindow:
    """What one --log-every interval has seen so far (this process)."""

    t0: float  # perf_counter at the window's start
    data0: float  # the timer's total data-wait seconds at the start
    loss_sum: float | torch.Tensor = 0.0  # sum of finite micro-batch losses x their samples (on the device)
    loss_samples: float | torch.Tensor = 0
    seen: int = 0  # samples trained on (finite loss or not)


class StepLog:
    """The figures of each --log-every interval: to the trackers, and on the main process as a tqdm bar when
    stderr is a terminal, else as a line."""

    def __init__(self, cfg: LoopConfig, accelerator, optimizer, scheduler, timer: StepTimer, total_steps: int):
        self.cfg, self.acc, self.opt, self.sched = cfg, accelerator, optimizer, scheduler
        self.timer, self.total_steps = timer, total_steps

    def window(self) -> StepWindow:
        """A window that begins now."""
        return StepWindow(time.perf_counter(), self.timer.total("data"))

    def progress_bar(self, epoch: int, total: int, initial: int):
        """A tqdm bar over the epoch's micro-batches on the main process when stderr is a terminal, else None
        (``log`` then prints a line every --log-every steps)."""
        if not (self.cfg.progress and self.acc.is_main_process and sys.stderr.isatty()):
            return None
        from tqdm import tqdm  # tqdm: only when a progress bar is drawn

        return tqdm(total=total, initial=initial, desc=f"epoch {epoch}", leave=False, dynamic_ncols=True)

    def figures(self, w: StepWindow) -> dict:
        """The mean loss, the lr, images/s and the data-wait share since the window began. The loss is this
        process's (no collective per log); images/s counts every process (each takes equal batches)."""
        elapsed = max(1e-9, time.perf_counter() - w.t0)
        loss_sum, samples = float(w.loss_sum), float(w.loss_samples)  # note: the sync point of a log line
        lrs = self.sched.get_last_lr()
        # train/lr: the heads' (the first group); a pretrained encoder's own lr (--encoder-lr, 0 during the
        # --probe-frac linear probe) as train/lr_encoder
        encoder = [lr for lr, g in zip(lrs, self.opt.param_groups, strict=True) if g.get("pretrained")]
        return {
            "train/loss": loss_sum / samples if samples else float("nan"),
            "train/lr": lrs[0],
            **({"train/lr_encoder": encoder[0]} if encoder else {}),
            "train/images_per_s": w.seen * self.acc.num_processes / elapsed,
            "train/data_wait_frac": min(1.0, (self.timer.total("data") - w.data0) / elapsed),
        }

    def line(self, w: StepWindow, bar: bool = False) -> str:
        f = self.figures(w)
        line = f"loss {f['train/loss']:.4f} lr {f['train/lr']:.2e} {f['train/images_per_s']:.0f} img/s"
        return line if bar else f"{line} data_wait {f['train/data_wait_frac']:.0%}"

    def log(self, epoch: int, step: int, w: StepWindow, terminal: bool) -> None:
        """Every --log-every optimizer steps: the window's figures to the trackers, and as one line when no
        progress bar shows them (stderr is not a terminal)."""
        if not self.acc.is_main_process:
            return
        if self.acc.trackers:
            self.acc.log(self.figures(w), step=step)
        if self.cfg.progress and not terminal:
            self.acc.print(f"epoch {epoch} step {step}/{self.total_steps}: {self.line(w)}")


def write_config(
    run_dir: Path, identity: dict, data_dir: Path, total_steps: int, resumed_from: Path | None, step: int
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
        "data_dir": str(data_dir),
        "total_steps": total_steps,
        "started_at_step": step,
        "resumed_from": str(resumed_from) if resumed_from is not None else None,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    atomic_write_json(run_dir / "config.json", {**segment, "segments": [*segments, segment]})


def summarize(
    cfg: ReportConfig, accelerator, task: Task, state: dict, last_metrics: dict, interrupted: bool, t_start: float
) -> dict:
    """summary.json's figures: the task's (the last and best evaluations), speed, the run's set-up and how far
    it got."""
    run_dir = Path(cfg.out)
    best = state.get("best_step")
    figures = task.summary(last_metrics, state)
    if best is None or state.get("best_evaluated") is False:  # stopped before any evaluation: no best figures
        figures = {k: None if k.startswith("best_") else v for k, v in figures.items()}
    return {
        **figures,
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
        # unreadable train images left out so far (metrics.jsonl's, the last epoch's count; the log names them)
        "skipped_samples": last_metrics.get("skipped_samples", 0),
        "interrupted": interrupted,
        "run_dir": str(run_dir),
    }


def shard_figures(accelerator, cache: ShardCache | None) -> dict:
    """``{"shards": counters}`` for a run that streams remote shards, ``{}`` for one whose shards are local:
    the shard cache's counters (``ShardCache.stats``: hits, misses, fetches, bytes_fetched, retries,
    evictions, fetch_seconds, wait_seconds, retry_seconds) summed over the processes, since this segment of the
    run started.
    What metrics.jsonl's epoch lines and summary.json carry, so that a transient fault retried is counted in
    the run's figures. A collective call: every process streams through a cache of its own, or none does."""
    if cache is None:
        return {}
    stats = cache.stats()
    totals = accelerator.reduce(
        torch.tensor([float(v) for v in stats.values()], dtype=torch.float64, device=accelerator.device),
        reduction="sum",
    ).tolist()  # note: a CPU-GPU sync point, once per epoch
    return {
        "shards": {
            k: round(v, 3) if k.endswith("_seconds") else int(v) for k, v in zip(stats, totals, strict=True)
        }
    }


def tracker_config(identity: dict) -> dict:
    """The run's configuration as trackers take hyper-parameters: numbers, strings and bools (TensorBoard's
    hparams refuse None and containers, so those are written as text)."""
    return {k: v if isinstance(v, bool | int | float | str) else str(v) for k, v in identity.items()}


def start_trackers(accelerator, config: dict, task: Task) -> None:
    """Start the --report-to trackers with ``config`` as hyper-parameters. TensorBoard gets them in the run
    that holds the scalars, naming the task's tracked figures and the train loss as their metrics (Accelerate's
    own call writes them into a sub-run of their own, where the HParams view finds no metric to compare runs
    by)."""
    accelerator.init_trackers("mmfast")
    metrics = [f"epoch/{name}" for name in (*task.tracked, "train_loss")]
    for tracker in accelerator.trackers:
        if tracker.name != "tensorboard":
            tracker.store_init_configuration(config)
            continue
        from torch.utils.tensorboard.summary import hparams  # tensorboard: optional (mmfast[track])

        writer = tracker.writer
        for summary in hparams(config, dict.fromkeys(metrics, 0.0)):  # experiment, session start/end
            writer.file_writer.add_summary(summary)
        writer.flush()


def write_profile(
    run_dir: Path,
    timer: StepTimer,
    sampler: UtilizationSampler,
    loader,
    cfg: ReportConfig,
    accelerator,
    notes: list[str] | None = None,
    features: dict | None = None,
) -> dict:
    """profile.json (phases, throughput, utilization, settings, verdict, ``notes`` on what the profiled run left
    out) and profile.png of this process. Returns the report, without its timeline.

    Args:
        features: the run's feature cache figures (``build_image_features``'; None: it decodes every epoch):
            the settings carry them and a note says what the steps read.
    """
    settings = {
        "decode_device": "mixed" if loader.device.type == "cuda" else "cpu",
        "dali_threads": loader.num_threads,
        "prefetch": loader.prefetch,  # the image loader's DALI queue depth
        "cache_decoded": loader.holds_decoded,
        # --feature-cache: the stored views the train batches' image features come from (None: decoded pixels)
        "feature_views": features["views"] if features is not None else None,
        "feature_cache": features,  # views, captions (text), size, whether built and how long it took
        "batch_size": cfg.batch_size,
        "image_size": cfg.image_size,
        "mixed_precision": accelerator.mixed_precision,
        "channels_last": cfg.channels_last,
        "num_processes": accelerator.num_processes,
        "model": cfg.model,
        "grad_accum": cfg.grad_accum,
        "cuda_devices": torch.cuda.device_count(),  # what the advice may suggest, never a GPU there is not
        "cpu_fast_bf16": cpu_has_fast_bf16(),
        "cuda_bf16": torch.cuda.is_available() and cuda_has_bf16(),
        "compile": compile_options(cfg) is not None,
        "compile_mode": cfg.compile_mode,  # reduce-overhead: CUDA graphs
        "text_padding": getattr(loader, "text_padding", None),
        "optimizer_impl": cfg.optimizer_impl,
    }
    notes = [*(notes or []), *([feature_note(features)] if features is not None else [])]
    report = build_report(timer, sampler, extra={"settings": settings, **({"notes": notes} if notes else {})})
    atomic_write_json(run_dir / "profile.json", {**report, "timeline": sampler.samples})
    try:
        plot_report(report, sampler.samples, str(run_dir / "profile.png"))
    except ImportError:
        log.warning("matplotlib is not installed: no profile.png")
    return report


def write_weights_digest(accelerator, model, run_dir: Path) -> None:
    """weights.rank<R>.sha256: a digest of this process's final weights (--record-ids, a debugging aid)."""
    h = hashlib.sha256()
    for name, t in sorted(accelerator.unwrap_model(model).state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    (run_dir / f"weights.rank{accelerator.process_index}.sha256").write_text(h.hexdigest())


def encoder_lr_note(given: ReportConfig, resolved: ReportConfig) -> str | None:
    """The line a run prints when a pretrained encoder named by flag took its own learning rate
    (``resolve_preset``) instead of the preset's recipe for encoders from scratch; None otherwise."""

    if given.encoder_lr is not None or get_preset(resolved.preset).encoder_lr is not None:
        return None
    if resolved.encoder_lr == resolved.lr:
        return None
    return (
        f"pretrained encoder(s) train at lr {resolved.encoder_lr:g}, their own (the {resolved.preset} preset's "
        f"--lr {resolved.lr:g} is for layers trained from scratch); --encoder-lr sets it"
    )
