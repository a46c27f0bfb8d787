"""Batches made ready on a thread of their own: the consuming thread (the training loop) only takes them.

A DataLoader's workers hand the loop finished batches; a loader whose last steps (the host finishing of DALI's
crops, the join with the captions) ran on the loop's own thread would add them to every step's wait. Here one
producer thread runs the whole batch iterator and keeps up to ``depth`` batches ready in a queue. torch's
kernels and DALI release the GIL, so the producer works while the loop computes.

Nothing waits for ever: the consumer checks the producer's life while it waits, an error in the producer is
raised in the consumer, and a consumer that stops early (a ``break``) stops the producer and joins it.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

T = TypeVar("T")
_POLL_S = 0.5  # how often a waiting side looks at the other's state
_JOIN_S = 60.0  # how long a stopping consumer waits for the producer's batch in progress


class _End:
    """The producer's last message: the iterator's end, or its error."""

    def __init__(self, error: BaseException | None = None):
        self.error = error


class Prefetcher:
    """Runs ``make()``'s iterator on a producer thread; iterating this yields its items in order.

    Args:
        make: builds the iterator (called on the producer thread).
        depth: items kept ready ahead of the consumer.
        name: the thread's name.
    """

    def __init__(self, make: Callable[[], Iterator[T]], depth: int = 2, name: str = "mmfast-prefetch"):
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, args=(make,), name=name, daemon=True)
        self._thread.start()

    def _produce(self, make: Callable[[], Iterator[T]]) -> None:
        end = _End()
        try:
            for item in make():
                if not self._put(item):
                    return
        except BaseException as e:  # raised again on the consumer's thread
            end = _End(e)
        self._put(end)

    def _put(self, item, _full: type[Exception] = queue.Full) -> bool:
        """Queue ``item``; False once the consumer has stopped. ``_full``: bound now, as ``close``'s ``_empty``."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=_POLL_S)
                return True
            except _full:
                continue
        return False

    def __iter__(self) -> Iterator[T]:
        try:
            while True:
                item = self._get()
                if isinstance(item, _End):
                    if item.error is not None:
                        raise item.error
                    return
                yield item
        finally:
            self.close()

    def _get(self):
        while True:
            if self._stop.is_set():
                raise RuntimeError(
                    "this iterator was stopped: a newer iter(loader) replaced it (the loader reads one epoch at a "
                    "time); finish or drop one before starting the next"
                )
            try:
                return self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise RuntimeError("the prefetch thread ended without a word") from None

    def close(
        self, _empty: type[Exception] = queue.Empty, _join_s: float = _JOIN_S, _current=threading.current_thread
    ) -> None:
        """Stop the producer and wait for it to leave (its batch in progress, at most ``_JOIN_S``). The
        defaults are bound now: a generator closed as the interpreter exits finds module globals None."""
        self._stop.set()
        while True:  # unblock a producer waiting on a full queue
            try:
                self._queue.get_nowait()
            except _empty:
                break
        if self._thread is not _current():
            self._thread.join(_join_s)
            if self._thread.is_alive():
                raise RuntimeError(f"the prefetch thread did not stop within {_join_s:.0f} s")
