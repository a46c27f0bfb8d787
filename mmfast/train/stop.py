"""How a stop signal ends a run: SIGTERM / SIGINT set a flag the loop reads at each optimizer step, where the
run writes a checkpoint and ends. ``util.stop_watch`` bounds the stop by ``--stop-grace`` up to the process's
exit: a run stuck in a read, a collective or native code, or a second signal, exits without a checkpoint."""

from __future__ import annotations

import contextlib

from mmfast.util.commands import TRAIN
from mmfast.util.stop_watch import StopWatch

NO_STEP = "exiting without a new checkpoint (an earlier one resumes with --resume latest)"


class StopFlag:
    """SIGTERM / SIGINT set ``signum``; the loop writes a checkpoint at the next optimizer step and exits.

    It uses the command's ``StopWatch`` (``mmfast-train`` enters one for the whole process), or enters one of
    its own when ``train`` is called as a library. Past ``grace`` seconds without a step, or at a second
    signal, the watch ends the process at once, printing every thread's stack.
    """

    def __init__(self, grace: float):
        self.signum = None
        self.grace = grace
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> StopFlag:
        watch = StopWatch.active(TRAIN)
        if watch is None:  # train() called as a library
            watch = self._stack.enter_context(StopWatch(TRAIN, self.grace))
        elif watch.signum is not None:
            raise KeyboardInterrupt  # a start-up stop that a library's catch-all swallowed
        watch.grace = self.grace
        self._stack.enter_context(watch.phase(self._set, "no step ended", NO_STEP))
        return self

    def _set(self, signum: int) -> None:
        if self.signum is None:
            self.signum = signum

    def __exit__(self, *exc) -> None:
        self._stack.__exit__(*exc)
