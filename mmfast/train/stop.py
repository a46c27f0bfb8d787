"""How a stop signal ends a run: SIGTERM/SIGINT set a flag the loop reads at each optimizer step; a run stuck
past the grace period, or a second signal, exits at once."""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import time

from mmfast.util.commands import TRAIN

_SAME_STOP_S = 2.0  # a second stop signal within this many seconds of the first is the same stop


class StopFlag:
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
            f"{TRAIN}: {why} of the stop signal: exiting without a new checkpoint (an earlier one resumes "
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
