"""Name the process that went quiet when a multi-process run stops on a collective timeout.

The process group's timeout (``--dist-timeout``) turns a rank that died, stopped (SIGSTOP) or stalls into
an error on the others instead of a silent hang, but the error from gloo/NCCL does not say which rank it
waited for. Each process therefore stamps the time into the process group's key-value store (the one
``torchrun`` / ``accelerate launch`` host outside the workers) from a daemon thread; when a collective
fails, the survivors read the stamps and name the ranks whose stamps stopped.
"""

from __future__ import annotations

import threading
import time

KEY = "mmfast/heartbeat/{rank}"
FAILED_KEY = "mmfast/failed/{rank}"


class PeerFailure(RuntimeError):
    """Another process of the run died, stopped or stalls; this one stops instead of waiting forever."""


class Heartbeat:
    """Stamp this rank's time into the store every ``interval`` seconds until ``close()``.

    Does nothing in a single-process run or when the process group has no reachable store.
    """

    def __init__(self, rank: int, world_size: int, interval: float = 2.0):
        self.rank, self.world_size, self.interval = rank, world_size, interval
        self._store = _default_store() if world_size > 1 else None
        self._stop = threading.Event()
        self._thread = None
        if self._store is not None:
            self._beat()
            self._thread = threading.Thread(target=self._run, name="mmfast-heartbeat", daemon=True)
            self._thread.start()

    def _beat(self) -> None:
        self._store.set(KEY.format(rank=self.rank), repr(time.time()))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._beat()
            except Exception:  # the store went away (the launcher is shutting down): stop stamping
                return

    def quiet_ranks(self, grace: float | None = None) -> list[int] | None:
        """Ranks whose last stamp is older than ``grace`` seconds (default 3 intervals); None if unknown."""
        if self._store is None:
            return None
        grace = 3 * self.interval if grace is None else grace
        now, quiet = time.time(), []
        try:
            for r in range(self.world_size):
                key = KEY.format(rank=r)
                if not self._store.check([key]) or now - float(self._store.get(key)) > grace:
                    quiet.append(r)
        except Exception:
            return None
        return quiet

    def report_failure(self, error: BaseException) -> None:
        """Leave this rank's error in the store, so the others can name it when their collective fails."""
        if self._store is None:
            return
        try:
            self._store.set(FAILED_KEY.format(rank=self.rank), f"{type(error).__name__}: {error}"[:300])
        except Exception:  # the store is gone: the others will name this rank as quiet instead
            pass

    def failed_ranks(self) -> dict[int, str]:
        """{rank: its error} of the ranks that reported a failure; empty when none or unknown."""
        if self._store is None:
            return {}
        found = {}
        try:
            for r in range(self.world_size):
                key = FAILED_KEY.format(rank=r)
                if r != self.rank and self._store.check([key]):
                    found[r] = self._store.get(key).decode(errors="replace")
        except Exception:
            return found
        return found

    def explain(self, error: BaseException, timeout_s: float) -> PeerFailure:
        """A PeerFailure that says which rank(s) failed or went quiet, for a failed collective's ``error``."""
        failed = self.failed_ranks()
        quiet = [r for r in (self.quiet_ranks() or []) if r not in failed]
        if failed:
            who = "; ".join(f"rank {r} failed ({msg})" for r, msg in sorted(failed.items()))
        elif quiet:
            who = f"rank(s) {', '.join(map(str, quiet))} stopped responding (died, stopped or stalled)"
        else:
            who = "another process failed or stalls (see its own message)"
        return PeerFailure(
            f"rank {self.rank}: waiting for the other processes failed after at most {timeout_s:g} s: {who}. "
            f"Stopping this process too. Resume with --resume latest once the cause is fixed "
            f"(--dist-timeout sets the wait). Underlying error: {str(error).splitlines()[0][:200]}"
        )

    def close(self) -> None:
        self._stop.set()


def _default_store():
    try:
        import torch.distributed as dist  # torch: only once a run starts (the commands' --help imports none)
        from torch.distributed import distributed_c10d

        if not dist.is_initialized():
            return None
        return distributed_c10d._get_default_store()
    except Exception:  # private API moved, or no store: the run still works, without names
        return None
