"""Step timing: where each training step's time goes (data wait, forward, backward, optimizer).

``StepTimer.phase(name)`` times a block. With ``cuda_sync=True`` it synchronizes the GPU at each phase
boundary so that asynchronous kernels are charged to the phase that launched them (honest but slower);
without it, GPU work shows up in whichever phase next waits for it (usually the loss's ``.item()``).
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Iterator

import torch


class StepTimer:
    """Accumulates wall time per named phase."""

    def __init__(self, enabled: bool = True, cuda_sync: bool = False):
        self.enabled = enabled
        self.cuda_sync = cuda_sync and torch.cuda.is_available()
        self.reset()

    def reset(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)

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
                torch.cuda.synchronize()
            self.totals[name] += time.perf_counter() - t0
            self.counts[name] += 1

    def total(self, name: str) -> float:
        return self.totals.get(name, 0.0)

    def summary(self) -> dict[str, float]:
        return {k: round(v, 4) for k, v in self.totals.items()}
