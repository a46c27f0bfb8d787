"""The bounded local cache of whole remote shards: fetched once, verified once, kept while used, evicted
least-recently-used first; shared by the processes of one machine.

Layout of a cache root (every file in it is the cache's own; the root carries mmfast's ownership marker):

    shards/<20 hex>-<basename>     complete, verified shards; their modification time is their last use
    shards/.<name>.partial-...     a download in progress (``objects.partial_path``)
    locks/<name>.lock              one per shard: shared while a reader holds it, exclusive while one
                                   process fetches or evicts it (``fcntl.flock``, so threads conflict too)
    reserved/<size>-<name>         the bytes an in-progress download will add, counted against the limit
    space.lock                     held while one process decides what to evict and reserves room

A shard is fetched under its exclusive lock, so two processes (or threads) that ask for it at once fetch
it once: the second waits for the lock and finds the file. Room is made under ``space.lock``: complete
shards plus live reservations must be at most ``limit_bytes`` before a new reservation is added, so the
cache holds at most ``limit_bytes`` plus one shard. Shards held by ``pinned`` are never evicted; when
nothing else can go, the fetch waits (up to ``wait_s``) for a reader to finish, then fails with
``CacheFullError``. A reservation or partial file whose shard lock is free belongs to a process that died,
and is removed by the next scan.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from mmfast.remote.errors import redact
from mmfast.remote.objects import FetchStats, fetch_to, partial_of
from mmfast.util.args import format_size
from mmfast.util.fsutil import MARKER, OutputDirError, is_replaceable, write_advice, write_marker
from mmfast.util.voice import setting

log = logging.getLogger(__name__)

KIND = "shard cache"  # the kind in the root's marker
_NAME = re.compile(r"[0-9a-f]{20}-[A-Za-z0-9._-]{1,80}")  # a complete shard's file name
_POLL_S = 0.02  # how often a waiter tries a busy lock again
_ROUNDS = 5  # how many times a shard evicted between its fetch and its pin is fetched again
_AHEAD_NS = 3600 * 10**9  # how far ahead a prefetched, unread shard is dated (see _background)
REPORT_S = 15.0  # a reader that waits this long for a shard says what it waits for, and again as often
_COUNTERS = ("hits", "misses", "fetches", "bytes_fetched", "retries", "evictions", "fetch_seconds", "wait_seconds")
_COUNTERS += ("retry_seconds",)


class CacheFullError(RuntimeError):
    """The shards in use fill the cache, so the one asked for cannot be added: raise ``limit_bytes``."""


class CacheWriteError(OSError):
    """The cache's folder cannot take a write: its disk is full, read-only, or over a quota or file-size limit
    (the message names the folder, the cause and what to do)."""


class ShardCache:
    """A bounded cache of whole shards in ``root``, shared by the processes of one machine.

    Args:
        root: the cache's folder (new, empty, or an earlier shard cache).
        limit_bytes: the most the complete and in-progress shards may hold, plus one shard.
        workers: the threads that ``prefetch`` downloads with.
        fetch: downloads one object (``objects.fetch_to``'s signature); a test hands in another.
        wait_s: the longest a call waits for a lock, an in-flight fetch or room.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        limit_bytes: int,
        *,
        workers: int = 2,
        fetch: Callable[..., Path] = fetch_to,
        wait_s: float = 600.0,
    ):
        if limit_bytes <= 0:
            raise ValueError(f"limit_bytes must be positive, got {limit_bytes}")
        with _write_errors(Path(root), "cannot be created or written"):
            self.root = _claim_root(Path(root))
        self.limit_bytes = limit_bytes
        self.wait_s = wait_s
        self._fetch = fetch
        self._shards, self._locks, self._reserved = (self.root / d for d in ("shards", "locks", "reserved"))
        self._pool = ThreadPoolExecutor(max(1, workers), thread_name_prefix="mmfast-shard-fetch")
        self._inflight: dict[str, Future] = {}
        self._counts = dict.fromkeys(_COUNTERS, 0)
        self._mutex = threading.Lock()
        self._said: set[str] = set()  # the warnings given (warn_once)
        self._closing = threading.Event()  # set by close(): the downloads in flight stop at their next piece
        self._waiting: dict[object, tuple[str, int, str, float]] = {}  # readers waiting: url, size, name, since
        self._progress: dict[str, FetchStats] = {}  # this process's downloads in flight, by shard name
        self._reporter: threading.Thread | None = None
        with (
            _write_errors(self.root, "cannot be written"),
            _flocked(self.root / "space.lock", shared=False, deadline=time.monotonic() + wait_s),
        ):
            self._scan()  # leftovers of processes that died mid-download

    def path_for(self, url: str, sha256: str | None) -> Path:
        """Where the shard at ``url`` (with this hash) lives in the cache, present or not. With a hash the
        name ignores the URL's query, so a signed URL signed again is the same shard; it never holds
        credentials."""
        key = f"{_key(url, sha256)}\n{sha256 or ''}"
        base = re.sub(r"[^A-Za-z0-9._-]", "_", url.split("?", 1)[0].rstrip("/").rsplit("/", 1)[-1])[-80:]
        return self._shards / f"{hashlib.sha256(key.encode()).hexdigest()[:20]}-{base or 'shard'}"

    def get(self, url: str, size: int, sha256: str | None) -> Path:
        """The local copy of the shard at ``url``, fetched (and verified) first when it is absent or its size
        is wrong; blocks until then. Nothing stops the copy from being evicted afterwards: hold ``pinned``
        while reading it.

        Raises:
            remote_errors.RemoteError: the fetch failed (here or in a ``prefetch`` of it).
            CacheFullError: the shards in use left no room for it within ``wait_s``.
        """
        with self.pinned(url, size, sha256) as path:
            return path

    @contextlib.contextmanager
    def pinned(self, url: str, size: int, sha256: str | None) -> Iterator[Path]:
        """Like ``get``, and the shard is not evicted (by any process) until the block ends."""
        started = time.monotonic()
        with self._reporting(url, size, sha256):
            fd, hit = self._acquire(url, size, sha256, started + self.wait_s)
        self._add(hits=int(hit), misses=int(not hit), wait_seconds=time.monotonic() - started)
        try:
            yield self.path_for(url, sha256)
        finally:
            os.close(fd)  # releases the shared lock

    def prefetch(self, items: Iterable[tuple[str, int, str | None]]) -> None:
        """Start fetching these ``(url, size, sha256)`` shards in the background, in this order, skipping those
        cached or already in flight. A failure is raised by the ``get`` of that shard."""
        for url, size, sha256 in items:
            path = self.path_for(url, sha256)
            with self._mutex:
                if path.name in self._inflight or _complete(path, size):
                    continue
                future = self._pool.submit(self._background, url, size, sha256)
                self._inflight[path.name] = future
            future.add_done_callback(lambda f, name=path.name: self._forget_if_ok(name, f))

    def warn_once(self, message: str) -> None:
        """Log ``message`` as a warning the first time this cache is given it (the loaders that share the
        cache, each epoch's, say a thing about it once)."""
        with self._mutex:
            if message in self._said:
                return
            self._said.add(message)
        log.warning("%s", message)

    def stats(self) -> dict:
        """This process's counters: hits and misses (of ``get`` / ``pinned``), fetches, bytes_fetched, retries,
        evictions, fetch_seconds (in downloads, all threads), wait_seconds (callers blocked), retry_seconds (the
        back-off sleeps before retries of a store that failed transiently, within fetch_seconds)."""
        with self._mutex:
            return dict(self._counts)

    def close(self) -> None:
        """Cancel the prefetches not started, and stop those running at their next piece (or back-off)."""
        self._closing.set()
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> ShardCache:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _acquire(
        self, url: str, size: int, sha256: str | None, deadline: float, prefetch: bool = False
    ) -> tuple[int, bool]:
        """Hold the shard's lock shared, with the complete shard in place: (lock fd, whether it was there
        when the lock was granted)."""
        path = self.path_for(url, sha256)
        if not prefetch:
            self._wait_inflight(path.name, deadline)
        lock = self._locks / f"{path.name}.lock"
        for round_ in range(_ROUNDS):
            fd = _lock(lock, shared=True, deadline=deadline)
            if _complete(path, size):
                with contextlib.suppress(OSError):
                    os.utime(path)  # its last use, for LRU
                return fd, round_ == 0
            os.close(fd)
            fd = _lock(lock, shared=False, deadline=deadline)
            try:
                if not _complete(path, size):
                    self._fetch_exclusive(url, size, sha256, path, deadline)
            finally:
                os.close(fd)  # if another process evicts it before our shared lock, the next round fetches again
        raise CacheFullError(
            f"{redact(url)} was evicted {_ROUNDS} times before it could be read: the cache at "
            f"{self.root} ({self.limit_bytes} bytes) is too small for the processes sharing it; raise "
            f"{setting('limit_bytes', '--cache-limit')}"
        )

    def _fetch_exclusive(self, url: str, size: int, sha256: str | None, path: Path, deadline: float) -> None:
        """Fetch the shard into ``path``; the caller holds its lock exclusively."""
        path.unlink(missing_ok=True)  # a copy of the wrong size
        with _write_errors(self.root, f"cannot hold {redact(url)} ({size} bytes)"):
            reservation = self._make_room(path.name, size, deadline)
        stats = FetchStats()
        with self._mutex:
            self._progress[path.name] = stats
        try:
            with _write_errors(self.root, f"cannot hold {redact(url)} ({size} bytes)"):
                self._fetch(url, path, size=size, sha256=sha256, stats=stats, stop=self._closing)
        finally:
            with self._mutex:
                self._progress.pop(path.name, None)
            with _flocked(self.root / "space.lock", shared=False, deadline=time.monotonic() + self.wait_s):
                reservation.unlink(missing_ok=True)
            self._add(
                fetches=stats.fetches,
                bytes_fetched=stats.bytes,
                retries=stats.retries,
                fetch_seconds=stats.seconds,
                retry_seconds=stats.retry_seconds,
            )

    def _make_room(self, name: str, size: int, deadline: float) -> Path:
        """Evict least-recently-used shards (never a pinned or busy one) until ``size`` more bytes fit, and
        reserve them; wait for readers while the shards left over the limit are all in use.

        Returns:
            The reservation file, removed by the caller once the shard is in place (or failed).
        """
        while True:
            with _flocked(self.root / "space.lock", shared=False, deadline=deadline):
                shards, used = self._scan()
                for _last_use, nbytes, victim in sorted(shards):
                    if used + size <= self.limit_bytes:
                        break
                    if self._evict(victim):
                        used -= nbytes
                if used <= self.limit_bytes:  # so that with this shard the cache holds at most limit + one
                    reservation = self._reserved / f"{size}-{name}"
                    reservation.touch()
                    return reservation
            if time.monotonic() > deadline:
                raise CacheFullError(
                    f"the shards in use fill the cache at {self.root} ({used} of {self.limit_bytes} bytes) and "
                    f"none was released in {self.wait_s:.0f} s; raise {setting('limit_bytes', '--cache-limit')} "
                    "above what readers hold at once"
                )
            time.sleep(_POLL_S * 5)

    def _scan(self) -> tuple[list[tuple[int, int, str]], int]:
        """The complete shards as (mtime_ns, size, name), and the bytes they and the live reservations hold;
        removes the reservations and partial downloads of processes that died. Called under space.lock."""
        shards, partials = [], []
        for entry in os.scandir(self._shards):
            if _NAME.fullmatch(entry.name):
                with contextlib.suppress(FileNotFoundError):  # a copy of the wrong size, just removed
                    st = entry.stat(follow_symlinks=False)
                    shards.append((st.st_mtime_ns, st.st_size, entry.name))
            elif partial_of(entry.name) is not None:
                partials.append(entry.name)
        present = {name for _, _, name in shards}
        used = sum(nbytes for _, nbytes, _ in shards)
        for entry in os.scandir(self._reserved):
            nbytes, _, name = entry.name.partition("-")
            if not (nbytes.isdigit() and _NAME.fullmatch(name)):
                continue
            if self._is_abandoned(name):
                os.unlink(entry.path)
            elif name not in present:  # once the shard is in place, it is counted instead
                used += int(nbytes)
        for partial in partials:
            if self._is_abandoned(partial_of(partial)):
                (self._shards / partial).unlink(missing_ok=True)
        return shards, used

    def _is_abandoned(self, name: str) -> bool:
        """Whether nobody fetches shard ``name`` now (its lock is free: whoever reserved it died)."""
        lock = self._locks / f"{name}.lock"
        fd = _try_exclusive(lock)
        if fd is None:
            return False
        if not (self._shards / name).exists():
            lock.unlink(missing_ok=True)  # as _evict does: whoever waits on it opens the new one
        os.close(fd)
        return True

    def _evict(self, name: str) -> bool:
        """Remove a complete shard unless someone holds its lock; whether it was removed."""
        lock = self._locks / f"{name}.lock"
        fd = _try_exclusive(lock)
        if fd is None:
            return False
        try:
            (self._shards / name).unlink(missing_ok=True)
            lock.unlink(missing_ok=True)  # waiters on it see a replaced lock file and open the new one
        finally:
            os.close(fd)
        self._add(evictions=1)
        log.debug("evicted %s from %s", name, self.root)
        return True

    def _background(self, url: str, size: int, sha256: str | None) -> None:
        """A prefetch: the in-flight fetch itself, so it does not wait for the in-flight fetch. The shard is
        dated ahead (``_AHEAD_NS``) until a reader's ``get`` dates it now: fetched for a reader and not read
        yet, it is the last the LRU eviction takes (it took one before its read, which fetched it again)."""
        fd, _ = self._acquire(url, size, sha256, time.monotonic() + self.wait_s, prefetch=True)
        try:
            ahead = time.time_ns() + _AHEAD_NS
            with contextlib.suppress(OSError):
                os.utime(self.path_for(url, sha256), ns=(ahead, ahead))
        finally:
            os.close(fd)

    def _wait_inflight(self, name: str, deadline: float) -> None:
        """Wait for this process's prefetch of ``name``, raising its failure (once) if it failed."""
        with self._mutex:
            future = self._inflight.get(name)
        if future is None:
            return
        try:
            future.result(timeout=max(0.0, deadline - time.monotonic()))
        finally:
            if future.done():
                with self._mutex:
                    if self._inflight.get(name) is future:
                        del self._inflight[name]

    def _forget_if_ok(self, name: str, future: Future) -> None:
        """Drop a prefetch that succeeded (or was cancelled); keep a failed one until its ``get`` raises it."""
        if future.cancelled() or future.exception() is None:
            with self._mutex:
                if self._inflight.get(name) is future:
                    del self._inflight[name]

    @contextlib.contextmanager
    def _reporting(self, url: str, size: int, sha256: str | None) -> Iterator[None]:
        """Within the block a reader waits for the shard at ``url``: the reporter says so past ``REPORT_S``."""
        token = object()
        with self._mutex:
            self._waiting[token] = (url, size, self.path_for(url, sha256).name, time.monotonic())
            if self._reporter is None:
                self._reporter = threading.Thread(target=self._report, name="mmfast-shard-wait", daemon=True)
                self._reporter.start()
        try:
            yield
        finally:
            with self._mutex:
                del self._waiting[token]

    def _report(self) -> None:
        """The reporter thread: a line for each reader waiting past ``REPORT_S``, again every ``REPORT_S``."""
        said: dict[object, float] = {}
        while not self._closing.wait(1.0):
            now = time.monotonic()
            with self._mutex:
                waiting, progress = dict(self._waiting), dict(self._progress)
            said = {token: t for token, t in said.items() if token in waiting}
            for token, (url, size, name, since) in waiting.items():
                if now - said.get(token, since) < REPORT_S:
                    continue
                said[token] = now
                got = progress.get(name)
                state = (
                    f"{format_size(got.bytes)} of {format_size(size)} fetched so far, {got.retries} retries"
                    if got is not None
                    else "another process of this machine fetches it, or the cache waits for room"
                )
                log.warning("waiting %.0f s for the shard %s: %s", now - since, redact(url), state)

    def _add(self, **counts: float) -> None:
        with self._mutex:
            for key, value in counts.items():
                self._counts[key] += value


@contextlib.contextmanager
def _write_errors(root: Path, what: str) -> Iterator[None]:
    """A write that fails for want of room or a writable disk, raised as a ``CacheWriteError`` naming the
    cache's folder, the cause and what to do; other errors as they are."""
    try:
        yield
    except OSError as e:
        advice = write_advice(e)
        if advice is None or isinstance(e, CacheWriteError):
            raise
        try:
            free = f", {shutil.disk_usage(root).free} bytes free there"
        except OSError:
            free = ""
        raise CacheWriteError(
            f"the shard cache at {root} {what}: {e.strerror or e}{free}; {advice}, or pass --shard-cache a "
            "folder on a disk with room (--cache-limit bounds what the cache holds, plus one shard)"
        ) from e


def _key(url: str, sha256: str | None) -> str:
    """What names a shard in the cache: its URL without the query when its hash is known (the hash pins the
    content), else the whole URL; redacted either way."""
    return redact(url.split("?", 1)[0] if sha256 else url)


def _claim_root(root: Path) -> Path:
    """Create the cache's folder, or accept an earlier cache's (or an empty folder); never a folder of files
    mmfast did not put there, since eviction deletes files."""
    if root.exists() and not is_replaceable(root, KIND):
        raise OutputDirError(
            f"{root}: holds files that are not a {KIND}'s (no {MARKER} of kind {KIND!r}); pass a new or empty "
            "folder for the shard cache"
        )
    root.mkdir(parents=True, exist_ok=True)
    if not (root / MARKER).is_file():
        write_marker(root, KIND)
    for sub in ("shards", "locks", "reserved"):
        (root / sub).mkdir(exist_ok=True)
    return root


def _complete(path: Path, size: int) -> bool:
    try:
        return path.stat().st_size == size
    except FileNotFoundError:
        return False


def _lock(path: Path, *, shared: bool, deadline: float) -> int:
    """Open ``path`` (creating it) and flock it, polling until ``deadline``; the open fd holds the lock.
    A lock file removed or replaced while we waited (an eviction) is opened again."""
    mode = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            while True:
                try:
                    fcntl.flock(fd, mode | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{path}: still locked by another reader or fetcher") from None
                    time.sleep(_POLL_S)
            if _same_file(fd, path):
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


def _try_exclusive(path: Path) -> int | None:
    """``path`` locked exclusively at once, or None when someone holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    if not _same_file(fd, path):
        os.close(fd)
        return None
    return fd


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


@contextlib.contextmanager
def _flocked(path: Path, *, shared: bool, deadline: float) -> Iterator[None]:
    fd = _lock(path, shared=shared, deadline=deadline)
    try:
        yield
    finally:
        os.close(fd)
