"""Inter-process locks named by a path, kept in a folder of their own, and pruned there.

A lock file must outlive its holders: a process waiting on one inode and a newcomer creating another would
both hold "the" lock. So ``file_lock`` takes the lock and then checks that the path still names the inode it
locked, else it tries again. That check is what lets ``prune_locks`` delete a lock file no one holds: whoever
was waiting on the deleted inode notices and locks the new one. Without pruning, every dataset, split and
model folder a user ever prepared or saved left a lock file behind (tens of thousands after a test suite).

Only mmfast's own per-user folder is pruned, and in it only names ``lock_file_for`` gives. A folder named by
``MMFAST_LOCK_DIR`` is never pruned: it may be shared between users or machines (NFS caches the names the
inode check reads) or hold other tools' lock files.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import re
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

PRUNE_AGE_S = 3600.0  # a lock file not taken for an hour is deleted (when no one holds it)
PRUNE_MAX = 2000  # the most one process deletes: the first lock of a process costs milliseconds
_POLL_S = 0.05
# A timed wait lasts at least this long: a prune holds a free lock for microseconds, and a caller asking with
# timeout=0 (is anyone building this?) must not take that blink for another holder.
_GRACE_S = 0.05
_NAME = re.compile(r"-[0-9a-f]{32}\.lock$")  # what lock_file_for names: the only files a prune deletes
_OPEN = os.O_RDWR | getattr(os, "O_NOFOLLOW", 0)  # a planted symlink is not followed
_pruned: set[Path] = set()  # the lock folders this process has pruned


@contextlib.contextmanager
def file_lock(path: str | os.PathLike, timeout: float = -1) -> Iterator[None]:
    """Hold an exclusive inter-process lock named by ``path`` for the duration of the block (waiting for it
    at most ``timeout`` seconds, at least 50 ms, then ``TimeoutError``; -1: as long as it takes).

    Used so that when several processes prepare the same dataset, one builds and the others wait. The lock
    file is not ``path``: it lives in ``lock_dir()``, named by a hash of ``path``'s real location, never
    beside the user's files. Not reentrant: a process that takes the same lock twice waits for itself.
    """
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    lock = lock_file_for(path)
    if lock.parent not in _pruned and not os.environ.get("MMFAST_LOCK_DIR"):
        _pruned.add(lock.parent)
        prune_locks(lock.parent)
    fd = None
    try:
        fd = _acquire(lock, timeout, path)
        yield
    finally:
        if fd is not None:
            with contextlib.suppress(OSError):
                os.utime(fd)  # a lock held for hours is not old the moment it is let go
            os.close(fd)  # closing the only descriptor releases the lock


def _acquire(lock: Path, timeout: float, path: str | os.PathLike) -> int:
    """An open descriptor of ``lock`` holding its exclusive lock, the path naming that very inode."""
    deadline = None if timeout < 0 else time.monotonic() + max(timeout, _GRACE_S)
    while True:
        fd = os.open(lock, _OPEN | os.O_CREAT, 0o666)  # the umask decides, as for filelock's files
        try:
            if not _flock(fd, deadline):
                raise TimeoutError(f"{path}: another process held its lock ({lock}) for over {timeout:g} s")
            if _names(lock, fd):
                with contextlib.suppress(OSError):  # another user's file in a shared folder: not ours to touch
                    os.utime(fd)  # when it was last taken: prune_locks spares a lock file in use
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # pruned while this process waited: lock the file that took its place


def _flock(fd: int, deadline: float | None) -> bool:
    """Take ``fd``'s exclusive lock, waiting until ``deadline`` (None: as long as it takes); False at it."""
    if deadline is None:
        fcntl.flock(fd, fcntl.LOCK_EX)
        return True
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(_POLL_S)


def _names(lock: Path, fd: int) -> bool:
    """Whether ``lock`` still names the inode ``fd`` has open (not deleted or replaced by a prune)."""
    try:
        st = os.stat(lock)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def prune_locks(folder: Path, age_s: float = PRUNE_AGE_S, most: int = PRUNE_MAX) -> int:
    """Delete the lock files in ``folder`` that no one holds and no one took for ``age_s`` seconds (at most
    ``most`` of them); returns how many. A lock file someone holds or waits on is left (its lock is not free,
    or it was taken since): deleting a free one is safe, as ``file_lock`` checks the inode it locked."""
    cutoff, gone = time.time() - age_s, 0
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return 0
    for entry in entries:
        if gone >= most:
            break
        try:
            st = entry.stat(follow_symlinks=False)
            if not _NAME.search(entry.name) or not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                continue  # not a lock file this user's mmfast made
            if st.st_mtime > cutoff:
                continue
            fd = os.open(entry.path, _OPEN | os.O_NONBLOCK)
        except OSError:
            continue  # gone already, or not ours to open
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if _names(Path(entry.path), fd) and os.fstat(fd).st_mtime <= cutoff:
                os.unlink(entry.path)
                gone += 1
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EWOULDBLOCK, errno.ENOENT):
                log.debug("left lock file %s: %s", entry.path, e)
        finally:
            os.close(fd)
    return gone


def lock_file_for(path: str | os.PathLike) -> Path:
    """Where ``file_lock(path)`` keeps its lock file: ``lock_dir()/<name>-<hash of the real path>.lock``."""
    real = os.path.join(os.path.realpath(os.path.dirname(os.path.abspath(path))), os.path.basename(path))
    digest = hashlib.sha256(os.fsencode(real)).hexdigest()[:32]
    return lock_dir() / f"{os.path.basename(path).lstrip('.')[:40]}-{digest}.lock"


def lock_dir() -> Path:
    """This user's folder of mmfast's lock files: ``$MMFAST_LOCK_DIR`` when set (several users or machines
    sharing one dataset folder can point it at a shared directory), else ``$XDG_RUNTIME_DIR/mmfast-locks``
    (a per-user tmpfs), else ``<tempdir>/mmfast-locks-<uid>``."""
    if os.environ.get("MMFAST_LOCK_DIR"):
        d = Path(os.environ["MMFAST_LOCK_DIR"])
    elif os.environ.get("XDG_RUNTIME_DIR") and os.path.isdir(os.environ["XDG_RUNTIME_DIR"]):
        d = Path(os.environ["XDG_RUNTIME_DIR"]) / "mmfast-locks"
    else:
        d = Path(tempfile.gettempdir()) / f"mmfast-locks-{os.getuid()}"
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    return d
