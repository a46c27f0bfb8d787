"""Where a training step's time goes, how busy the devices are, and what to change.

Three pieces, usable from any training loop:

- ``StepTimer``: wall time per phase (data wait, forward, backward, optimizer). With ``cuda_sync=True``
  it synchronizes the GPU at each phase boundary, so queued kernels are charged to the phase that
  launched them and "data wait" is time the GPU really sat idle waiting for input (honest, slightly
  slower). Off (``enabled=False``) it costs one branch per phase.
- ``UtilizationSampler``: a background thread sampling GPU utilization, memory, SM clock and power through
  NVML (``nvidia-ml-py``) and CPU utilization (``psutil``: this process and its children, as a share of
  all cores, plus the whole machine's per core for context) every ``interval`` seconds. Without a GPU or
  NVML it reports why instead of failing.
- ``build_report``: their figures and the verdict (``mmfast.train.verdict``): input-bound / host-bound /
  compute-bound, with the next thing to try.

A loop uses them like this (``mmfast.LoopProfiler`` does the same around a loop with one wrapper)::

    timer, sampler = StepTimer(cuda_sync=True), UtilizationSampler(0.2)
    with sampler:
        for batch in timer.iterate(loader):          # time spent in next() is "data"
            with timer.phase("forward"): loss = ...
            with timer.phase("backward"): loss.backward()
            with timer.phase("optimizer"): opt.step(); opt.zero_grad()
            timer.end_step(batch_size)
    report = build_report(timer, sampler); print(report["verdict"]["summary"])
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator

import torch

from mmfast.train.verdict import TRAIN_FLAGS, Knobs, verdict

PHASES = ("data", "forward", "backward", "optimizer")  # the order a report lists the timed phases in
OUTSIDE_TRAINING = ("eval", "checkpoint")  # timed, reported, but not training time


class StepTimer:
    """Accumulates wall time per named phase and counts steps and samples.

    Args:
        enabled: off, a phase costs one branch.
        cuda_sync: synchronize the GPU at each phase boundary (honest phase times, slightly slower).
        warmup_steps: the report describes the steady state after this many steps (CUDA and cuDNN
            initialization, autotuning and the first prefetch land in the first steps); ``steady`` holds
            the counters as they were then. Runs no longer than that are reported whole.

    The timed span ends at the last phase or step the timer saw: what follows the loop (closing the
    sampler, writing the report) is not in it.
    """

    def __init__(self, enabled: bool = True, cuda_sync: bool = False, warmup_steps: int = 0):
        self.enabled = enabled
        self.cuda_sync = cuda_sync and torch.cuda.is_available()
        self.warmup_steps = warmup_steps
        self.reset()

    def reset(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)
        self.steps = 0
        self.samples = 0
        self.started = self.last = time.perf_counter()  # ``last``: the end of the latest phase or step
        self.steady: dict | None = None  # the counters at the end of the warm-up
        self.outside: list[tuple[float, float]] = []  # (start, end) of each eval / checkpoint phase

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        if self.cuda_sync:
            torch.cuda.synchronize()  # note: a CPU-GPU sync point, only when profiling
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.cuda_sync:
                torch.cuda.synchronize()  # note: a CPU-GPU sync point, only when profiling
            self.last = t1 = time.perf_counter()
            self.totals[name] += t1 - t0
            self.counts[name] += 1
            if name in OUTSIDE_TRAINING:
                self.outside.append((t0, t1))

    def add(self, name: str, seconds: float) -> None:
        """Charge ``seconds`` that the caller timed (a training phase, ending now) to phase ``name``."""
        if self.enabled:
            self.totals[name] += seconds
            self.counts[name] += 1
            self.last = time.perf_counter()

    def iterate(self, iterable: Iterable) -> Iterator:
        """Yield from ``iterable``, charging the time spent waiting for each item to the "data" phase."""
        it = iter(iterable)
        while True:
            with self.phase("data"):
                item = next(it, _END)
            if item is _END:
                return
            yield item

    def end_step(self, samples: int) -> None:
        """One step ends now, having trained on ``samples`` samples."""
        self.steps += 1
        self.samples += samples
        self.last = time.perf_counter()
        if self.steps == self.warmup_steps:
            self.steady = {
                "started": self.last,
                "totals": dict(self.totals),
                "counts": dict(self.counts),
                "steps": self.steps,
                "samples": self.samples,
            }

    def total(self, name: str) -> float:
        return self.totals.get(name, 0.0)

    def elapsed(self) -> float:
        return time.perf_counter() - self.started


_END = object()


class UtilizationSampler:
    """Samples GPU (NVML) and CPU (psutil) utilization in a background thread.

    Args:
        interval: seconds between samples.
        device_index: the NVML index of the GPU to watch (default: the current CUDA device).
    """

    def __init__(self, interval: float = 0.2, device_index: int | None = None):
        self.interval = interval
        self.samples: list[dict] = []
        self.gpu_error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._nvml = None
        self._handle = None
        self._device_index = device_index

    def _open_nvml(self) -> None:
        try:
            import pynvml  # nvidia-ml-py: optional (mmfast[profile]), only on a GPU

            pynvml.nvmlInit()
            index = self._device_index
            if index is None:
                index = torch.cuda.current_device() if torch.cuda.is_available() else 0
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            self._nvml = pynvml
            self.gpu_name = pynvml.nvmlDeviceGetName(self._handle)
        except ImportError:
            self.gpu_error = "NVML bindings not installed (pip install nvidia-ml-py)"
        except Exception as e:  # pynvml.NVMLError and friends: no driver, no device
            self.gpu_error = f"none: NVML unavailable ({e})"  # printed as "GPU: none: ..."

    def read_gpu(self) -> dict:
        """One NVML reading: utilization %, memory MiB, SM clock MHz, power W (empty without a GPU)."""
        if self._nvml is None:
            return {}
        nv, h = self._nvml, self._handle
        util = nv.nvmlDeviceGetUtilizationRates(h)
        mem = nv.nvmlDeviceGetMemoryInfo(h)
        out = {
            "gpu_util": float(util.gpu),
            "gpu_mem_util": float(util.memory),
            "gpu_mem_used_mib": mem.used / 2**20,
            "gpu_mem_total_mib": mem.total / 2**20,
        }
        with contextlib.suppress(Exception):
            out["sm_clock_mhz"] = float(nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM))
        with contextlib.suppress(Exception):
            out["power_w"] = nv.nvmlDeviceGetPowerUsage(h) / 1000.0
        return out

    def _run(self) -> None:
        import psutil  # psutil: optional (mmfast[profile])

        psutil.cpu_percent(percpu=True)  # the first call only starts the measurement window
        own = _OwnCpu(psutil)
        self.t0 = t0 = time.perf_counter()
        while not self._stop.wait(self.interval):
            sample = {
                "t": time.perf_counter() - t0,
                "cpu_util": psutil.cpu_percent(percpu=True),  # the machine, per core (other jobs count)
                "proc_cpu_util": own.percent(),  # this run: this process + its children, % of all cores
            }
            with contextlib.suppress(Exception):
                sample.update(self.read_gpu())
            self.samples.append(sample)

    def __enter__(self) -> UtilizationSampler:
        self._open_nvml()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="mmfast-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._nvml is not None:
            with contextlib.suppress(Exception):
                self._nvml.nvmlShutdown()
            self._nvml = None

    def stats(self, since: float | None = None, outside: list[tuple[float, float]] = ()) -> dict:
        """Mean / median / p95 of every sampled quantity; ``gpu`` says why it is missing when it is.

        Args:
            since: a ``time.perf_counter()`` value: only samples taken after it count (the steady state).
            outside: (start, end) ``perf_counter`` intervals whose samples do not count (evaluation,
                checkpoint writes): a sample covers the ``interval`` before it, so one that overlaps
                such an interval is left out.
        """
        base = getattr(self, "t0", 0.0)
        lo = -float("inf") if since is None else since - base + self.interval
        spans = [(a - base, b - base + self.interval) for a, b in outside]
        samples = [s for s in self.samples if s["t"] >= lo and not any(a <= s["t"] <= b for a, b in spans)]
        out: dict = {"samples": len(samples), "interval_s": self.interval}
        if samples:
            per_core = [s["cpu_util"] for s in samples]
            cores = len(per_core[0])
            out["cpu_util_mean_per_core"] = [
                round(sum(s[i] for s in per_core) / len(per_core), 1) for i in range(cores)
            ]
            out["machine_cpu_util_mean"] = round(sum(out["cpu_util_mean_per_core"]) / cores, 1)
            own = [s["proc_cpu_util"] for s in samples if "proc_cpu_util" in s]
            # the run's own share: another job on the machine must not make the run look CPU-bound
            out["cpu_util_mean"] = round(sum(own) / len(own), 1) if own else out["machine_cpu_util_mean"]
        keys = ("gpu_util", "gpu_mem_used_mib", "sm_clock_mhz", "power_w")
        gpu = {k: _describe([s[k] for s in samples if k in s]) for k in keys}
        gpu = {k: v for k, v in gpu.items() if v}
        out["gpu"] = gpu if gpu else {"available": False, "reason": self.gpu_error or "no GPU samples"}
        return out


class _OwnCpu:
    """CPU use of this process and its children (DALI's threads are this process's; launcher-started
    workers are children), as a percentage of all the machine's cores. In a multi-process launch the ranks
    are siblings, so this is the sampling rank's share."""

    def __init__(self, psutil):
        self.psutil, self.cores = psutil, psutil.cpu_count() or 1
        self.procs: dict[int, object] = {}  # the same Process objects across samples keep their windows

    def percent(self) -> float:
        ps = self.psutil
        try:
            me = ps.Process()
            current = [me, *me.children(recursive=True)]
        except ps.Error:
            return 0.0
        total = 0.0
        self.procs = {p.pid: self.procs.get(p.pid, p) for p in current}
        for p in self.procs.values():
            with contextlib.suppress(ps.Error):  # a child that ended between listing and reading
                total += p.cpu_percent(None)  # the first reading of a new process is 0.0
        return round(min(100.0, total / self.cores), 1)


def _describe(values: list[float]) -> dict:
    if not values:
        return {}
    v = sorted(values)
    return {
        "mean": round(sum(v) / len(v), 2),
        "p50": v[len(v) // 2],
        "p95": v[min(len(v) - 1, int(0.95 * len(v)))],
        "max": v[-1],
    }


def build_report(
    timer: StepTimer,
    sampler: UtilizationSampler | None = None,
    extra: dict | None = None,
    words: Knobs = TRAIN_FLAGS,
) -> dict:
    """Phase times, throughput and utilization as one JSON-able dict, with the verdict.

    Phases named "eval" and "checkpoint" are reported but left out of the training wall time that the
    fractions and images/s refer to, and so are the utilization samples taken during them. After a
    warm-up (``StepTimer(warmup_steps=...)``) the figures are those of the steady state that followed;
    ``warmup`` says what was left out. A run with no step after its warm-up is reported whole.

    Args:
        timer: the loop's phases and steps.
        sampler: its utilization samples (None: no utilization figures).
        extra: more entries for the report (``settings``: what the verdict's advice reads).
        words: how the verdict names each knob (``mmfast.train.verdict``).
    """
    base = {"started": timer.started, "totals": {}, "counts": {}, "steps": 0, "samples": 0}
    if timer.steady is not None and timer.steps > timer.steady["steps"]:
        base = timer.steady
    phases = {k: round(v - base["totals"].get(k, 0.0), 4) for k, v in timer.totals.items()}
    outside = sum(phases.get(k, 0.0) for k in OUTSIDE_TRAINING)
    wall = max(1e-9, timer.last - base["started"] - outside)
    accounted = sum(v for k, v in phases.items() if k not in OUTSIDE_TRAINING)
    samples = timer.samples - base["samples"]
    report = {
        "steps": timer.steps - base["steps"],
        "samples": samples,
        "warmup": {"steps": base["steps"], "seconds": round(base["started"] - timer.started, 3)},
        "train_wall_s": round(wall, 3),
        "images_per_s": samples / wall,
        "phase_s": phases,
        "phase_calls": {k: v - base["counts"].get(k, 0) for k, v in timer.counts.items()},
        "phase_frac": {k: round(v / wall, 4) for k, v in phases.items() if k not in OUTSIDE_TRAINING},
        "other_s": round(max(0.0, wall - accounted), 4),
        "data_wait_frac": phases.get("data", 0.0) / wall,
        "synchronized": timer.cuda_sync,
        "utilization": sampler.stats(since=base["started"], outside=timer.outside)
        if sampler is not None
        else None,
        **(extra or {}),
    }
    report["verdict"] = verdict(report, words)
    return report


def report_text(report: dict) -> str:
    """A report as ``mmfast-profile`` prints it: the phases, throughput, utilization, notes and verdict."""
    lines = [f"\n{'phase':<12}{'seconds':>10}{'share':>8}"]
    for name, sec in report["phase_s"].items():
        frac = report["phase_frac"]
        share = f"{frac[name]:>8.1%}" if name in frac else "   (not in training time)"
        lines.append(f"{name:<12}{sec:>10.3f}{share}")
    lines.append(f"{'other':<12}{report['other_s']:>10.3f}")
    util = report.get("utilization") or {}
    gpu = util.get("gpu", {})
    reason = gpu.get("reason", "n/a")
    if "Shared Library Not Found" in reason and not torch.cuda.is_available():  # no driver: a CPU machine
        reason = "none"
    gpu_line = f"GPU {gpu['gpu_util']['mean']:.0f}% mean" if "gpu_util" in gpu else f"GPU: {reason}"
    if util and not util.get("samples"):
        gpu_line = "no utilization samples in the steady state: profile more steps"
    warm = report.get("warmup") or {}
    n = warm.get("steps")
    after = f" (steady state, after {n} warm-up step{'s' if n != 1 else ''})" if n else ""
    lines.append(
        f"\n{report['steps']} steps, {report['images_per_s']:.1f} images/s, "
        + f"data wait {report['data_wait_frac']:.0%}, "
        + (f"CPU {util['cpu_util_mean']:.0f}% mean, " if "cpu_util_mean" in util else "")
        + f"{gpu_line}{after}"
    )
    lines += [f"note: {note}" for note in report.get("notes", [])]
    lines.append(f"\nverdict: {report['verdict']['summary']}")
    lines += [f"  - {step}" for step in report["verdict"]["next_steps"]]
    return "\n".join(lines)


def plot_report(report: dict, samples: list[dict], path: str) -> None:
    """PNG: utilization timeline (GPU and CPU) and the per-phase breakdown of the step time."""
    import matplotlib  # matplotlib: optional, only for the figure

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # matplotlib: optional, only for the figure

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4), gridspec_kw={"width_ratios": [2, 1]})
    t = [s["t"] for s in samples]
    if samples:
        cpu = [sum(s["cpu_util"]) / len(s["cpu_util"]) for s in samples]
        own = [s.get("proc_cpu_util", float("nan")) for s in samples]
        ax1.plot(t, own, label="CPU, this run (% of all cores)", color="#1f77b4")
        ax1.plot(t, cpu, label="CPU, whole machine", color="#1f77b4", alpha=0.35, linestyle=":")
        if any("gpu_util" in s for s in samples):
            ax1.plot(t, [s.get("gpu_util", float("nan")) for s in samples], label="GPU", color="#76b900")
    ax1.set_ylim(0, 105)
    ax1.set_xlabel("seconds")
    ax1.set_ylabel("utilization %")
    ax1.set_title("utilization timeline")
    if samples:  # no line, no legend (a loop shorter than the sampler's first look)
        ax1.legend(loc="lower right")
    phases = report["phase_s"]
    names = [p for p in PHASES if p in phases] + [p for p in phases if p not in PHASES and p != "eval"] + ["other"]
    vals = [phases.get(n, report["other_s"]) for n in names]
    ax2.barh(names[::-1], vals[::-1], color="#888")
    ax2.set_xlabel("seconds in the profiled steps")
    ax2.set_title(report["verdict"]["bound"] + "-bound")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
