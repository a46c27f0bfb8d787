"""Process pools that never fork the calling process (docs/architecture.md, "No pool forks this process")."""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import select
import signal
import sys
import threading
import time
import types
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

from tqdm import tqdm

from mmfast.util.voice import carried

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
LOG_EVERY_S = 30.0  # a progress line in a log (no terminal) at most this often
log = logging.getLogger(__name__)


def map_files(fn, items: list, workers: int, desc: str, progress: bool = False) -> list:
    """``[fn(x) for x in items]`` over ``workers`` processes (threads inside a daemonic process, which may
    not start children), in order, with a progress bar on a terminal (``progress``) and lines in a log
    (``progress_lines``). ``fn`` must be picklable (a module-level function
    or a ``functools.partial`` of one)."""

    def shown(results: Iterable) -> Iterable:
        if not sys.stderr.isatty():  # a log or CI: a line now and then, which no bar would give
            return progress_lines(results, len(items), desc, "images")
        return tqdm(results, total=len(items), desc=desc, unit="img", leave=False) if progress else results

    if workers <= 1 or len(items) <= 64:
        return [fn(x) for x in shown(items)]
    chunk = max(1, min(64, len(items) // (workers * 8)))
    if multiprocessing.current_process().daemon:  # PIL releases the GIL while decoding and encoding
        with ThreadPoolExecutor(workers) as pool:
            return list(shown(pool.map(carried(fn), items, chunksize=chunk)))
    return list(shown(process_map(fn, items, workers, chunk)))


def progress_lines(items: Iterable, total: int, desc: str, unit: str, every_s: float | None = None) -> Iterator:
    """``items`` as they come, logging how far they got at most every ``every_s`` seconds (``LOG_EVERY_S``): a
    progress bar's news where stderr is no terminal (a log, CI), which otherwise hears nothing till the end."""
    every_s = LOG_EVERY_S if every_s is None else every_s
    start = last = time.monotonic()
    for n, item in enumerate(items, 1):
        yield item
        now = time.monotonic()
        if now - last >= every_s and n < total:
            last = now
            log.info("%s: %d of %d %s (%.0f%%) in %.0f s", desc, n, total, unit, 100 * n / total, now - start)


def process_map(fn, items: list, workers: int, chunksize: int = 1) -> Iterator:
    """``fn`` over ``items`` in ``workers`` processes that never inherit this one's state, results in order.

    The workers are started by a fork server (a fresh interpreter), not forked from this process: a fork
    copies the locks of its threads but not the threads, and a child whose garbage collector finalizes a DALI
    pipeline inherited from the parent waits for ever in its destructor (or on any lock another thread held).
    They import ``fn`` from its module and never re-run the caller's script (one without an
    ``if __name__ == "__main__":`` guard would otherwise run again in each). Each worker is SIGKILLed when
    the caller dies, and runs ``fn`` in the caller's words (``voice.carried``: flags or arguments). ``fn``
    must be a module-level function of an importable module (or a partial of one).
    """
    context = multiprocessing.get_context("forkserver" if sys.platform.startswith("linux") else "spawn")
    owner = dict(initializer=_die_with_owner, initargs=(os.getpid(),))
    with ProcessPoolExecutor(workers, mp_context=context, **owner) as pool:
        main = sys.modules["__main__"]
        sys.modules["__main__"] = types.ModuleType("__main__")  # nothing for the workers to re-import
        try:
            # submits every chunk: the workers start now
            results = pool.map(carried(fn), items, chunksize=chunksize)
        finally:
            sys.modules["__main__"] = main
        yield from results


def _die_with_owner(owner: int) -> None:
    """Pool worker initializer: this worker ends the moment the pool's owner (process ``owner``) dies.

    A worker's parent is the fork server, not the owner, and the fork server exits only when every holder of
    its "alive" pipe has closed it: the owner and each worker it started (they inherit the pipe). An owner
    killed with SIGKILL cannot shut its pool down, so the workers would run on over their queued chunks, and the
    fork server with them. A daemon thread waits on a pidfd of the owner and ends the worker when it becomes
    readable (the owner exited); PDEATHSIG then covers the fork server's own death."""
    if not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    try:
        pidfd = os.pidfd_open(owner)
    except ProcessLookupError:  # it died before we looked: nobody would end us
        os._exit(1)
    except (AttributeError, OSError):  # no pidfd (a kernel before 5.3): the fork server's exit still ends us
        return
    threading.Thread(target=_exit_when_readable, args=(pidfd,), daemon=True, name="mmfast-owner-watch").start()


def _exit_when_readable(pidfd: int) -> None:
    select.select([pidfd], [], [])
    os._exit(1)
