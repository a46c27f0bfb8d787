"""The training loop, plain and visible: epochs of micro-batches, gradient accumulation (the loop closes the
last window of an epoch), optimizer steps, stop signals, checkpoints, and evaluations at epochs' ends.
Accelerate owns processes, devices and mixed precision; the task (``mmfast.tasks``) owns what the model takes
from a batch, the loss, the evaluation and what "best" means (a task that declares ``whole_window`` is handed
each accumulation window's micro-batches at once: ``EpochRunner.window_step``); ``mmfast.train.run`` sets a run
up.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from mmfast.tasks.global_batch import StepNormStatistics
from mmfast.tasks.registry import Task
from mmfast.train.agree import AgreedLoader, BatchAgreement, agreed
from mmfast.train.checkpoint import save_checkpoint
from mmfast.train.config import PROFILE_WARMUP_STEPS
from mmfast.train.hardware import uses_cuda_graphs
from mmfast.train.optim import scaled_step_skipped, skips_on_device, step_unless_non_finite
from mmfast.train.profiler import StepTimer
from mmfast.train.report import StepLog, StepWindow, shard_figures, write_epoch_metrics, write_skipped
from mmfast.train.slices import LoopConfig
from mmfast.train.source_tally import SourceTally

if TYPE_CHECKING:
    from mmfast.remote.shard_cache import ShardCache
    from mmfast.train.wise_ft import StartWeights


class NonFiniteLossError(RuntimeError):
    pass


def initial_state(task: Task) -> dict:
    """The trainer state of a run that has not taken a step (what a checkpoint's trainer_state.json holds)."""
    return {
        "epoch": 0,
        "global_step": 0,
        **task.best_figures({}),
        "best_epoch": None,
        "best_step": None,
        "epoch_stats": None,
        "loader": None,
        "skipped_steps": 0,
    }


def check_finite_weights(model: torch.nn.Module, what: str) -> None:
    """Raise NonFiniteLossError when any parameter holds NaN or inf (a CPU-GPU sync: checkpoints only)."""
    bad = [n for n, p in model.named_parameters() if not bool(torch.isfinite(p).all())]
    if bad:
        raise NonFiniteLossError(
            f"{what}: {len(bad)} parameter tensors hold NaN/inf (first: {bad[0]}); refusing to use or save "
            "them. Lower --lr, or resume from an earlier checkpoint"
        )


class EpochRunner:
    """Holds what one run's epochs share, so the loop below reads as a list of steps.

    ``loader`` is anything with ``__len__``, ``__iter__`` (one epoch of batch dicts with an "id" entry),
    ``step``, ``set_epoch`` and ``state_dict`` (a MultimodalLoader in training, or batches held in memory to
    measure the loop alone). ``task`` is the objective (``mmfast.tasks.registry.Task``). ``shard_cache``: the
    cache the loaders stream remote shards through (None: local data), whose counters each epoch's figures carry.
    ``warmup_steps``: the optimizer steps a profile leaves out of its figures (start-up lands in them).
    ``cfg``: the run's ``LoopConfig`` (``train/slices.py``).
    """

    def __init__(
        self,
        cfg: LoopConfig,
        accelerator,
        model,
        optimizer,
        scheduler,
        loader,
        run_dir: Path,
        total_steps: int,
        state: dict,
        task: Task,
        shard_cache: ShardCache | None = None,
        warmup_steps: int = PROFILE_WARMUP_STEPS,
        start: StartWeights | None = None,
    ):
        self.cfg, self.acc, self.model, self.opt, self.sched = cfg, accelerator, model, optimizer, scheduler
        self.loader, self.run_dir, self.total_steps, self.state = loader, run_dir, total_steps, state
        self.task, self.shard_cache, self.start = task, shard_cache, start
        self.stop = None  # a StopFlag while the loop runs
        self.interrupted = False
        self.consecutive_bad = 0
        # A fused AdamW skips a step whose gradient norm is not finite on the device (its found_inf, as a
        # GradScaler hands it), and so does fp16's GradScaler: no read back per step. Their count on the
        # device: [skipped, current run, longest run] since settle_skips.
        on_device = skips_on_device(optimizer, accelerator) and cfg.grad_clip  # the norm comes with clipping
        on_device = on_device or accelerator.scaler is not None  # fp16: the scaler's own skip, seen on the device
        self._skips = torch.zeros(3, device=accelerator.device) if on_device else None
        # profiling reports the steady state: the first steps carry CUDA / cuDNN start-up and the first prefetch
        self.timer = StepTimer(enabled=True, cuda_sync=cfg.profile, warmup_steps=warmup_steps)
        self.window_samples = 0  # samples of the accumulation window so far: the timer's step counts them
        self.steps = StepLog(cfg, accelerator, optimizer, scheduler, self.timer, total_steps)
        self.sampler = None  # a running UtilizationSampler when profiling
        # streaming from a store: the processes stop together at a batch one of them cannot get (agree.py)
        ranks = accelerator.process_index, accelerator.num_processes
        # the processes' gloo group for what they decide together (a stop signal, a failed batch): on the CPU
        self.control = BatchAgreement(*ranks, cfg.dist_timeout) if ranks[1] > 1 else None
        self.agreement = self.control if shard_cache is not None else None
        self.cuda_graphs = uses_cuda_graphs(cfg, accelerator.device.type)  # each micro-step marks its start
        # batch norm's statistics move once a step, by the mean of its micro-batches' updates on every process
        spread = ranks[1] > 1 or cfg.grad_accum > 1
        self.norms = StepNormStatistics(model, ranks[1]) if spread else None
        mix = getattr(getattr(loader, "dataset", None), "mix_sources", None)  # a mix: per-source figures
        self.tally = SourceTally([m["name"] for m in mix], accelerator.device) if mix else None

    def fit(self, val_loader) -> dict:
        """Train the epochs left, checkpointing after each and evaluating (``val_loader``: None for none) after
        every --eval-every-th and the last; returns the last epoch's metrics, with the last evaluation's figures
        where that epoch was not evaluated (a stop signal ended the run before its evaluation)."""
        metrics, evaluated = {}, {}
        for epoch in range(self.state["epoch"], self.cfg.epochs):
            if self.done():  # resumed at or past --max-steps: nothing left to train
                break
            self.loader.set_epoch(epoch)
            train_stats = self.train_epoch(epoch)
            if self.interrupted:
                break
            self.mix_at_end()  # before the last evaluation and checkpoint
            # every --eval-every epochs, and after the last one (--epochs, or --max-steps reached in this one)
            due = (epoch + 1) % self.cfg.eval_every == 0 or epoch + 1 == self.cfg.epochs or self.done()
            with self.timer.phase("eval"):
                val_metrics = self.evaluate(val_loader, epoch) if val_loader is not None and due else {}
            metrics = {
                "epoch": epoch,
                "step": self.state["global_step"],
                **train_stats,
                **val_metrics,
                "lr": self.sched.get_last_lr()[0],
                "skipped_steps": self.state["skipped_steps"],
                "skipped_samples": self.skipped_samples(),
                **shard_figures(self.acc, self.shard_cache),
            }
            evaluated = val_metrics or evaluated
            # The best: an evaluation above the best so far, or the first one where an epoch that was not
            # evaluated holds the place (a run's first epoch is the best until an evaluation says otherwise).
            first = bool(val_metrics) and not self.state.get("best_evaluated", True)
            better = bool(val_metrics) and (first or self.task.improves(metrics, self.state))
            if better or self.state["best_step"] is None:
                # This step's checkpoint (written just below) is the best one: retention never removes it.
                self.state.update(
                    **self.task.best_figures(metrics), best_epoch=epoch, best_step=self.state["global_step"]
                )
                self.state["best_evaluated"] = bool(val_metrics)
            if train_stats["epoch_complete"]:
                self.state.update(epoch=epoch + 1, epoch_stats=None, loader=self.loader_states())
            # else: --max-steps stopped the epoch; train_epoch saved its position, so a resume with a
            # larger --max-steps continues this same epoch.
            write_epoch_metrics(self.acc, self.run_dir, metrics, self.task)
            if metrics["skipped_samples"]:  # the same count on every process: all of them take part
                write_skipped(self.acc, self.run_dir, self.loader.skipped)
            self.checkpoint()
            if self.done():
                break
        self.mix_at_end()  # a stop signal after the last step, or a resume from its checkpoint: not mixed yet
        return {**evaluated, **metrics}

    def mix_at_end(self) -> None:
        """--wise-ft: once the last step has trained, the weights mixed with the start's. Once per run: the trainer
        state records it, so a run resumed past its end trains on from the mixed weights."""
        if self.start is None or not self.done() or self.state.get("wise_ft_mixed"):
            return
        self.start.mix()
        self.state["wise_ft_mixed"] = True
        a = self.start.alpha
        self.acc.print(f"--wise-ft {a:g}: the weights are {a:g} x the trained + {1 - a:g} x the start's")

    def run_steps(self) -> None:
        """Train until ``total_steps`` optimizer steps, epoch after epoch, with nothing between the epochs: no
        evaluation, metrics line or checkpoint. What ``mmfast-profile`` times."""
        epoch = self.state["epoch"]
        while not self.done() and not self.interrupted:
            self.loader.set_epoch(epoch)
            self.train_epoch(epoch)
            epoch += 1

    def evaluate(self, val_loader, epoch: int) -> dict:
        """The task's evaluation of the val split; streamed on several processes, its batches agreed too. The
        model runs in the run's mixed precision (Accelerate's autocast), which ``eval_precision`` names:
        mmfast-evaluate runs the model directory in fp32, so its figures may differ slightly."""
        if self.agreement is not None:
            val_loader = AgreedLoader(val_loader, self.agreement, f"the val split after epoch {epoch}:")
        figures = self.task.evaluate(self.acc, self.model, val_loader)
        precision = self.acc.mixed_precision
        return {**figures, "eval_precision": "fp32" if precision == "no" else precision} if figures else figures

    def done(self) -> bool:
        return self.state["global_step"] >= self.total_steps

    def train_epoch(self, epoch: int) -> dict:
        """One epoch's micro-batches from where the loader stands (not 0 after a mid-epoch resume); returns the
        epoch's train figures."""
        cfg, loader = self.cfg, self.loader
        s = self.state["epoch_stats"] or {"loss_sum": 0.0, "samples": 0, "time": 0.0, "data_wait": 0.0}
        if s.get("summed") and self.acc.process_index > 0:  # the resumed sums are all processes': counted once
            s = {**s, "loss_sum": 0.0, "samples": 0, "sources": None}
        if self.tally is not None:
            self.tally.start(s.get("sources"))
        # this process's finite loss sum and samples since the epoch (or its resumed part) began: on the device,
        # read back only by the figures (a log line, a checkpoint, the epoch's end), never per micro-batch
        self._losses = torch.zeros(2, dtype=_sum_dtype(self.acc.device), device=self.acc.device)
        n_batches = len(loader)
        self.model.train()
        bar = self.steps.progress_bar(epoch, n_batches, loader.step)
        start = dict(self.timer.totals)  # the run-level timer keeps counting; this epoch is the difference
        n_samples = len(self.sampler.samples) if self.sampler is not None else 0
        t0 = time.perf_counter()
        logwin = self.steps.window()  # what the next --log-every line averages
        i = loader.step  # micro-batch index in the epoch
        whole_window = getattr(self.task, "whole_window", False)  # the task takes each window at once
        window: list[dict] = []  # a whole-window task's micro-batches of the window so far
        batches = agreed(loader, self.agreement, lambda: f"batch {i} of epoch {epoch}")
        for batch in self.timer.iterate(batches):  # the wait for each batch is the "data" phase
            window_end = (i + 1) % cfg.grad_accum == 0 or i + 1 == n_batches
            # The last window of an epoch may be shorter: divide by its real length so the gradient is
            # the mean over the samples it saw.
            window_start = (i // cfg.grad_accum) * cfg.grad_accum
            accum = min(cfg.grad_accum, n_batches - window_start)
            if self.norms is not None and i == window_start:
                self.norms.start()
            if whole_window:
                window.append(batch)
                if window_end:
                    self.window_step(epoch, window, s, logwin)
                    window = []
            else:
                loss = self.micro_step(batch, accum, sync=window_end)
                self.count(epoch, batch, loss, s, logwin)
            i += 1
            if bar is not None:
                bar.update(1)
            if not window_end:
                continue
            if self.norms is not None:
                self.norms.finish()
            self.optimizer_step()
            self.timer.end_step(self.window_samples)  # a profile's step is an optimizer step
            self.window_samples = 0
            if self.state["global_step"] % cfg.log_every == 0:  # the loss is read back here, not every step
                self.settle_skips()
                if bar is not None:
                    bar.set_postfix_str(self.steps.line(logwin, bar=True), refresh=False)
                self.steps.log(epoch, self.state["global_step"], logwin, terminal=bar is not None)
                logwin = self.steps.window()
            if self.after_step(i < n_batches, s, t0, start):
                break
        if bar is not None:
            bar.close()
        s["time"] += time.perf_counter() - t0
        s["data_wait"] += self.timer.total("data") - start.get("data", 0.0)
        self.settle_skips()
        return self.epoch_figures(s, i == n_batches, start, n_samples)

    def count(self, epoch: int, batch: dict, loss: torch.Tensor | float, s: dict, logwin: StepWindow) -> None:
        """A micro-batch's share of the epoch's and the log window's figures (added up on the device)."""
        n = int(batch["id"].shape[0])  # samples, masked ones included
        loss = torch.as_tensor(loss, device=self.acc.device).detach().to(self._losses.dtype)
        # a non-finite loss is counted as trained, not averaged in
        part = torch.where(torch.isfinite(loss), torch.stack([loss * n, torch.ones_like(loss) * n]), 0.0)
        self._losses += part
        logwin.loss_sum, logwin.loss_samples = logwin.loss_sum + part[0], logwin.loss_samples + part[1]
        logwin.seen += n
        self.window_samples += n
        if self.cfg.record_ids:
            self.record_ids(epoch, batch["id"])

    def after_step(self, mid_epoch: bool, s: dict, t0: float, start: dict) -> bool:
        """After an optimizer step: a stop signal, --max-steps or --checkpoint-every inside the epoch saves the
        epoch's position and its figures so far (``s`` since ``t0``, the timer's ``start`` totals) and maybe a
        checkpoint. Returns whether the epoch stops here."""
        cfg = self.cfg
        self.interrupted = self.stop_requested()
        periodic = cfg.checkpoint_every and self.state["global_step"] % cfg.checkpoint_every == 0
        stop_mid_epoch = self.done() and mid_epoch  # --max-steps reached inside the epoch
        if self.interrupted or stop_mid_epoch or (periodic and mid_epoch):
            self.settle_skips()
            s_now = {
                **s,
                **self._global_sums(s),
                **({"sources": self.tally.global_sums(self.acc)} if self.tally is not None else {}),
                "time": s["time"] + time.perf_counter() - t0,
                "data_wait": s["data_wait"] + self.timer.total("data") - start.get("data", 0.0),
            }
            self.state.update(epoch_stats=s_now, loader=self.loader_states())
            if not stop_mid_epoch or self.interrupted:  # fit() writes --max-steps' after its evaluation
                self.checkpoint()  # a stop signal on that step too: fit() stops before writing it
        if self.interrupted:
            step = self.state["global_step"]
            self.acc.print(
                f"stop signal: checkpoint written at step {step}; resume with --resume latest"
                if cfg.checkpoints
                else f"stop signal: stopped at step {step} (--no-checkpoints: nothing to resume)"
            )
            return True
        return stop_mid_epoch

    def _global_sums(self, s: dict) -> dict:
        """The epoch's loss sum and samples so far over every process (a collective), as a checkpoint keeps
        them: the main process's trainer state is every process's on resume, and on another process count."""
        resumed = torch.tensor([s["loss_sum"], s["samples"]], dtype=self._losses.dtype, device=self.acc.device)
        loss_sum, samples = self.acc.reduce(resumed + self._losses, reduction="sum").tolist()
        return {"loss_sum": loss_sum, "samples": samples, "summed": True}

    def epoch_figures(self, s: dict, complete: bool, start: dict, first_sample: int) -> dict:
        """The epoch's train figures; the loss is the mean over every process's finite micro-batches."""
        totals = self._global_sums(s)  # note: a CPU-GPU sync point, once per epoch
        loss_sum, samples = totals["loss_sum"], totals["samples"]
        sources = {"sources": self.tally.figures(self.tally.global_sums(self.acc))} if self.tally else {}
        task_figures = getattr(self.task, "epoch_figures", None)  # a collective too; it may stop the run
        return {
            **sources,
            **(task_figures(self.acc) if task_figures is not None else {}),
            "epoch_complete": complete,
            # An epoch whose every loss was non-finite has no mean: say NaN, never a reassuring 0.
            "train_loss": loss_sum / samples if samples else float("nan"),
            "images_per_s": samples / max(1e-9, s["time"]),
            "data_wait_frac": s["data_wait"] / max(1e-9, s["time"]),
            "phase_s": {k: round(v - start.get(k, 0.0), 4) for k, v in self.timer.totals.items()},
            **self.epoch_utilization(first_sample),
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

    def micro_step(self, batch: dict, window: int, sync: bool) -> torch.Tensor:
        """Forward + backward of one micro-batch; gradients are all-reduced only at the window's end."""
        ctx = self.acc.no_sync(self.model) if not sync and self.acc.num_processes > 1 else contextlib.nullcontext()
        with ctx:
            with self.timer.phase("forward"):
                if self.cuda_graphs:  # the last step's graph outputs are consumed: its replay may reuse them
                    torch.compiler.cudagraph_mark_step_begin()
                out = self.model(self.task.inputs(batch))  # autocast applied by Accelerate
                loss = self.task.loss(out, self.task.targets(batch))
                if self.tally is not None:  # a mix: each sample's loss by its source, where the task has them
                    per_sample = getattr(self.task, "sample_losses", None)
                    self.tally.add(batch["source"], per_sample and per_sample(out, self.task.targets(batch)))
            with self.timer.phase("backward"):
                self.acc.backward(loss / window)
        if self.norms is not None:
            self.norms.micro_batch_done()
        return loss.detach()  # on the device: ``count`` adds it up there

    def window_step(self, epoch: int, batches: list[dict], s: dict, logwin: StepWindow) -> None:
        """A whole-window task's forward and backward of a window's micro-batches together
        (``task.backward_window``); each micro-batch is counted with the window's loss."""
        acc, model = self.acc, self.model

        def no_sync():
            return acc.no_sync(model) if acc.num_processes > 1 else contextlib.nullcontext()

        with self.timer.phase("backward"):  # forwards and backwards interleave: one phase
            loss = self.task.backward_window(acc, model, batches, no_sync)
        for batch in batches:
            self.count(epoch, batch, loss, s, logwin)
            if self.tally is not None:  # a mix: the samples of each source (the window's loss is not theirs)
                self.tally.add(batch["source"], None)

    def optimizer_step(self) -> None:
        """Clip, step (skipped when the gradients are not finite) and advance the schedule; the schedule
        advances on a skipped step too (as a GradScaler recipe's does), so the learning rate follows the step."""
        acc, cfg = self.acc, self.cfg
        with self.timer.phase("optimizer"):
            norm = acc.clip_grad_norm_(self.model.parameters(), cfg.grad_clip) if cfg.grad_clip else None
            if acc.scaler is not None:  # fp16: the GradScaler skips a step of inf/NaN gradients itself
                self._count_on_device(scaled_step_skipped(self.opt, acc.scaler))
            elif self._skips is not None:  # a fused AdamW: its kernel skips one of a non-finite norm
                self._count_on_device(step_unless_non_finite(self.opt, norm))
            else:
                finite = norm is None or bool(torch.isfinite(norm))  # note: a sync point, once per optimizer step
                if finite:
                    self.opt.step()
                self.count_skips(int(not finite), int(not finite) * (self.consecutive_bad + 1))
            self.opt.zero_grad(set_to_none=True)
        with warnings.catch_warnings():  # a first step skipped on the host: torch warns of the order
            warnings.filterwarnings("ignore", re.escape(_SCHEDULER_FIRST), UserWarning)
            self.sched.step()
        self.state["global_step"] += 1

    def _count_on_device(self, bad: torch.Tensor) -> None:
        """Count a step skipped on the device (``bad``: 1.0 or 0.0 there), read by ``settle_skips``."""
        skipped, run, longest = self._skips.unbind()
        run = (run + 1) * bad
        self._skips = torch.stack([skipped + bad, run, torch.maximum(longest, run)])

    def settle_skips(self) -> None:
        """The skips counted on the device, read (a sync point: at log lines, checkpoints and the epoch's end)
        into the run's state; raises as ``count_skips`` does."""
        if self._skips is None:
            return
        skipped, run, longest = (int(x) for x in self._skips.tolist())
        self._skips = torch.tensor([0.0, run, run], device=self._skips.device)
        self.count_skips(skipped, run, longest)

    def count_skips(self, skipped: int, run: int, longest: int | None = None) -> None:
        """``skipped`` more skipped steps, the current run of them ``run`` long (``longest`` at most since the
        last count). Raises NonFiniteLossError once a run reaches --max-nan-steps."""
        self.state["skipped_steps"] += skipped
        self.consecutive_bad = run
        longest = max(run, longest or 0)
        if longest >= self.cfg.max_nan_steps:
            raise NonFiniteLossError(
                f"{longest} consecutive optimizer steps had non-finite gradients (NaN/inf loss); "
                "stopping instead of training garbage. Lower --lr, use --mixed-precision bf16 or no, "
                "or check the data"
            )

    def stop_requested(self) -> bool:
        """Whether any process got SIGTERM/SIGINT; all processes agree, so all stop at this same step.

        A collective call at every optimizer step of a multi-process run: one small all-reduce over the CPU
        (gloo) group, which never waits for the GPU to finish the step's queued work.
        """
        local = self.stop is not None and self.stop.signum is not None
        return local if self.control is None else self.control.any(local)

    def skipped_samples(self) -> int:
        """How many samples the loaders have skipped so far, on every process together (a collective call on
        several: each process's decoding loader knows only the files its own share has read)."""
        if self.control is None:
            return len(self.loader.bad)
        return len(set().union(*self.control.gathered(sorted(self.loader.bad))))

    def loader_states(self) -> list[dict]:
        """Every process's loader position (a collective call): the main process saves them all."""
        from accelerate.utils import gather_object  # accelerate: a slow import, only once a run starts

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


_SCHEDULER_FIRST = "Detected call of `lr_scheduler.step()` before `optimizer.step()`"  # torch's warning


def _sum_dtype(device: torch.device) -> torch.dtype:
    """The dtype of the loss sums on ``device`` (float64 where it has one: MPS has not)."""
    return torch.float32 if device.type == "mps" else torch.float64
