"""A stop signal (SIGTERM or SIGINT) ends a command within a bound, even while its main thread is in native code.

Python runs a signal's handler only once the main thread is back in the interpreter. A call blocked in C++
(torch's TCPStore connect, Ray's GCS client, a DALI call) may retry through EINTR for many minutes, so a
handler alone bounds nothing. ``StopWatch`` also hears the signals through ``signal.set_wakeup_fd``, on a
thread of its own. From the first signal the process has ``grace`` seconds to end. A second signal ends it
at once, unless it comes within ``SAME_STOP_S`` (a launcher forwards the terminal's Ctrl-C). Past the grace
the watch prints why and every thread's stack, and exits with 128 + the signal. When the watched block ends
after a signal, the rest of the grace still bounds the interpreter's shutdown (``faulthandler``'s timer), and
the exit status is the program's own (see ``_forget_caught_interrupt``).

A command run inside another program that handles these signals itself (the test suite's conftest) leaves
the bound to that program: it forwards the signal to the enclosing watch and never ends the process. When
its block ends it hands the signal on to that program's handler, so the program stops as it would have.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator

SIGNALS = (signal.SIGTERM, signal.SIGINT)
SAME_STOP_S = 2.0  # a second stop signal within this many seconds of the first is the same stop
_QUIT = 0  # the byte that ends a watch's thread (no signal has the number 0)
_PARENT_POLL_S = 1.0  # how often a watch that follows its parent process looks for it


def raise_interrupt(signum: int) -> None:
    """The reaction of a command's start-up: Ctrl-C's own, a KeyboardInterrupt in the main thread."""
    raise KeyboardInterrupt


class StopWatch:
    """Bounds a stop from the first SIGTERM / SIGINT; a context manager, entered in the main thread.

    Args:
        command: the command's name, for the messages.
        grace: seconds from the first signal to the process's end (``grace`` may be set again later).
        follow_parent: treat the parent's death as SIGTERM (a rank whose launcher was killed).
        stream: where the watch's own lines go (default: ``sys.stderr`` when they are written).

    Attributes:
        signum: the first stop signal, or None.
        react: what the main thread does with a signal (``raise_interrupt``, or a loop's flag); set by ``phase``.
        owns_process: whether this watch may end the process (no enclosing program handles the signals).
    """

    _active: list[StopWatch] = []  # the watches entered and not left, innermost last (signals are per process)

    def __init__(self, command: str, grace: float, *, follow_parent: bool = False, stream=None):
        self.command, self.grace, self.follow_parent, self.stream = command, grace, follow_parent, stream
        self.signum: int | None = None
        self.react: Callable[[int], None] = raise_interrupt
        self.overdue, self.outcome = "the command did not end", "exiting"  # the message past the grace
        self.owns_process = False
        self._first = 0.0
        self._deliveries = 0
        self._reacted = False
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    @classmethod
    def active(cls, command: str) -> StopWatch | None:
        """The innermost watch entered and not left, if it is ``command``'s (not an enclosing program's)."""
        watch = cls._active[-1] if cls._active else None
        return watch if watch is not None and watch.command == command else None

    def __enter__(self) -> StopWatch:
        if threading.current_thread() is not threading.main_thread():
            return self  # signals reach the main thread only: its own watch bounds them
        self._enclosing = {s: signal.getsignal(s) for s in SIGNALS}
        self._r, self._w = os.pipe()
        os.set_blocking(self._w, False)
        self._outer_fd = signal.set_wakeup_fd(self._w, warn_on_full_buffer=False)
        self.owns_process = self._outer_fd == -1 and not any(map(_enclosing_handler, self._enclosing.values()))
        for s in SIGNALS:
            signal.signal(s, self._handle)
        self._parent = os.getppid()
        self._thread = threading.Thread(target=self._watch, name="mmfast-stop-watch", daemon=True)
        self._thread.start()
        StopWatch._active.append(self)
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is None:
            return
        StopWatch._active.remove(self)
        for s, h in self._enclosing.items():
            signal.signal(s, signal.SIG_DFL if h is None else h)
        signal.set_wakeup_fd(self._outer_fd)  # every signal byte is now ahead of the quit byte in the pipe
        os.write(self._w, bytes([_QUIT]))
        self._thread.join(timeout=5.0)
        self._thread = None
        os.close(self._r)
        os.close(self._w)
        if self.owns_process:
            _forget_caught_interrupt()  # one still uncaught is noted again at the top level
        if self.signum is None:
            return
        if self.owns_process:
            _bound_shutdown(self._first + self.grace)
        elif _enclosing_handler(handler := self._enclosing[self.signum]):
            handler(self.signum, None)  # the enclosing program stops as the signal asked (a KeyboardInterrupt)

    @contextlib.contextmanager
    def phase(self, react: Callable[[int], None], overdue: str, outcome: str) -> Iterator[StopWatch]:
        """Within the block, a signal calls ``react(signum)`` in the main thread, and the message past the
        grace reads "<overdue> within <grace> s of the stop signal: <outcome>"."""
        saved = self.react, self.overdue, self.outcome
        self.react, self.overdue, self.outcome = react, overdue, outcome
        try:
            yield self
        finally:
            self.react, self.overdue, self.outcome = saved

    def _handle(self, signum: int, frame) -> None:
        self._note(signum)
        if not self._reacted:  # a later signal is the watch's: the same stop, or one that ends the process
            self._reacted = True
            self.react(signum)

    def _note(self, signum: int) -> bool:
        """Record the first signal; whether this one is the first."""
        with self._lock:
            if self.signum is not None:
                return False
            self.signum, self._first = signum, time.monotonic()
            return True

    def _watch(self) -> None:
        """The thread: reads the signal numbers the interpreter writes into the pipe, forwards them to an
        enclosing watch, and ends the process past the grace or at a second signal."""
        while True:
            bounded = self.signum is not None and self.owns_process  # else the enclosing watch bounds it
            timeout = max(0.0, self._first + self.grace - time.monotonic()) if bounded else None
            if self.follow_parent:
                timeout = _PARENT_POLL_S if timeout is None else min(timeout, _PARENT_POLL_S)
            if select.select([self._r], [], [], timeout)[0]:
                for b in os.read(self._r, 256):
                    if b == _QUIT:
                        return
                    if self._outer_fd != -1:
                        with contextlib.suppress(OSError):  # full: the enclosing watch has signals to read
                            os.write(self._outer_fd, bytes([b]))
                    if b in SIGNALS:
                        self._delivered(b)
            if self.follow_parent and os.getppid() != self._parent:
                self.follow_parent = False
                print(f"{self.command}: the launcher (process {self._parent}) is gone: stopping", file=self._out())
                os.kill(os.getpid(), signal.SIGTERM)
            if bounded and time.monotonic() >= self._first + self.grace:
                self._give_up(f"{self.overdue} within {self.grace:g} s")

    def _out(self):
        return self.stream if self.stream is not None else sys.stderr

    def _delivered(self, signum: int) -> None:
        self._deliveries += 1
        if self._note(signum) or self._deliveries < 2:
            return
        if time.monotonic() - self._first > SAME_STOP_S:
            self._give_up(f"a second stop signal ({signal.Signals(signum).name})")

    def _give_up(self, why: str) -> None:
        if not self.owns_process:  # the enclosing program's watch bounds its own process
            return
        out = self._out()
        print(f"{self.command}: {why} of the stop signal: {self.outcome}; where each thread was:", file=out)
        out.flush()
        faulthandler.dump_traceback(file=out, all_threads=True)
        os._exit(128 + (self.signum or signal.SIGTERM))


def _enclosing_handler(handler) -> bool:
    """Whether ``handler`` is another program's own (a function), not Python's default or none."""
    return callable(handler) and handler is not signal.default_int_handler


def _forget_caught_interrupt() -> None:
    """Let an interrupt the program caught end with the program's exit status. CPython 3.10 and 3.11 note a
    KeyboardInterrupt that leaves code run from a string (``exec`` of a dataclass's generated ``__init__``,
    during an import) even when a caller catches it, and at exit kill a ``python -m`` module's process with
    SIGINT, whatever its status: a stopped test session ended "killed by SIGINT", not with pytest's 2. One
    still uncaught at the top level is noted again there, so Ctrl-C's own exit is kept. A no-op where the note
    is not a symbol (later versions keep it in the runtime's state)."""
    with contextlib.suppress(ValueError, AttributeError, OSError):
        ctypes.c_int.in_dll(ctypes.pythonapi, "_Py_UnhandledKeyboardInterrupt").value = 0


def _bound_shutdown(deadline: float) -> None:
    """Bound the interpreter's shutdown by ``deadline`` (time.monotonic): non-daemon threads are joined and exit
    handlers run there. faulthandler's timer is native: it ends the process even where no Python thread runs."""

    def arm() -> None:
        faulthandler.dump_traceback_later(max(1.0, deadline - time.monotonic()), exit=True)

    with contextlib.suppress(RuntimeError):  # the interpreter is already shutting down
        threading._register_atexit(arm)  # runs before the non-daemon threads are joined (as concurrent.futures)
