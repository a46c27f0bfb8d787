"""Filesystem helpers: atomic writes and directories, ownership markers, and an inter-process lock.

Everything mmfast writes that another process (or a later run) reads goes through here, so that a
crash or a full disk leaves either the old file or the new one, never half of one.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import glob
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from mmfast.util.locks import file_lock

# Every directory mmfast builds with atomic_dir carries this file; only such a directory (or an empty one)
# is ever replaced or deleted. Its content: {"kind": what the directory is, "version": MARKER_VERSION}.
MARKER = ".mmfast-prepared"
MARKER_VERSION = 2
RUN_MARKER = ".mmfast-run"  # a training run's directory carries this one (mmfast.train.rundir)
_AT_FDCWD = -100  # <fcntl.h>: paths relative to the current directory
_RENAME_EXCHANGE = 2  # <linux/fs.h>
# What a full disk looks like to a writer (no space, over quota, over RLIMIT_FSIZE, read-only filesystem), and
# what to do about each.
_WRITE_ADVICE = {
    errno.ENOSPC: "free disk space there",
    errno.EDQUOT: "free space or raise the disk quota",
    errno.EFBIG: "raise the file-size limit (ulimit -f)",
    errno.EROFS: "use a folder on a writable file system",
    errno.EACCES: "make it writable for this user or use another folder",
}
_RESTORE_WAIT_S = 10.0  # how long opening a directory waits for a preparation that holds its lock

log = logging.getLogger(__name__)


class OutputDirError(ValueError):
    """An output directory mmfast must not touch (not its own, or holding the input), or cannot write."""


@contextlib.contextmanager
def write_errors(out: str | os.PathLike, what: str) -> Iterator[None]:
    """Turn a full disk (or quota, file-size limit, read-only filesystem) while writing ``what`` into ``out``
    into one clear ``OutputDirError``; the writers below leave no partial file, so ``out`` is as it was."""
    try:
        yield
    except OSError as e:
        if (advice := write_advice(e)) is None:
            raise
        cause = f"{e.strerror} ({e.filename})" if e.strerror and e.filename else str(e)
        raise OutputDirError(
            f"writing {what} to {out} failed: {cause}; {out} was left as it was; {advice}, and re-run"
        ) from e


def write_advice(e: OSError) -> str | None:
    """What to do about a write that failed for want of room or a writable disk ("free disk space there"); None
    for another failure."""
    return _WRITE_ADVICE.get(e.errno)


def file_sha256(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """SHA-256 of a file's bytes, read in chunks (no whole-file copy in memory)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def fsync_dir(path: Path) -> None:
    """Flush a directory entry so a rename inside it survives a power cut."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """Flush every file below ``root`` to disk (before a rename makes the tree visible)."""
    for p in Path(root).rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())


def shared_modes(root: Path) -> None:
    """Modes under ``root`` as a plain mkdir / open would give them: a temp directory is 0700 and safetensors
    writes 0600, and a model, an export or a checkpoint is meant to be shared as the user's other files are."""
    umask = current_umask()
    for path in [root, *Path(root).rglob("*")]:
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)


def current_umask() -> int:
    """The process's umask, read without changing it where Linux shows it (os.umask can only set it, and
    setting it to read it races with other threads creating files)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temp file in the same directory and a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~current_umask())  # mkstemp's 0600 would outlive the rename: open()'s mode instead
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(e, OSError) and e.filename is None:
            e.filename = str(path)  # a failed write() names no file; the caller's message should
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Atomically write UTF-8 text."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    """Atomically write ``obj`` as indented JSON."""
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def read_json_object(path: str | os.PathLike) -> dict:
    """The JSON object in ``path``; ``{}`` when the file is missing, unreadable, not JSON or not an object.
    For files mmfast wrote and can do without; a file the user must mend is read with its own error."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):  # UnicodeDecodeError is a ValueError
        return {}
    return data if isinstance(data, dict) else {}


def atomic_write_jsonl(path: str | os.PathLike, rows: list[dict]) -> None:
    """Atomically write one JSON object per line (UTF-8; a row holding text that UTF-8 cannot encode, such
    as a lone surrogate from a ``"\\ud800"`` escape, is written with ASCII escapes instead)."""
    atomic_write_bytes(path, b"".join(_jsonl_line(r) for r in rows))


def _jsonl_line(row: dict) -> bytes:
    try:
        return (json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8")
    except UnicodeEncodeError:
        return (json.dumps(row) + "\n").encode("ascii")


@contextlib.contextmanager
def atomic_dir(
    final: str | os.PathLike,
    kind: str = "mmfast output",
    replaceable: Callable[[Path], bool] | None = None,
) -> Iterator[Path]:
    """Yield a temp directory beside ``final``; on success it takes ``final``'s place in one atomic step.

    The caller holds a lock for ``final`` (``file_lock``). The temp directory carries the ``MARKER`` file
    from its first instant, so what a killed run leaves behind is recognisably mmfast's and is removed by
    the next run (``recover_dir``). A kill at any instant leaves ``final`` either old or new, complete:
    the swap is one ``renameat2(RENAME_EXCHANGE)``; where the kernel or filesystem lacks it, two renames,
    and the next run moves the old directory back if the kill fell between them.

    Args:
        final: the directory to create or replace.
        kind: what the directory is, recorded in its marker.
        replaceable: whether an existing ``final`` may be replaced (default: it carries the marker or is
            an empty directory).

    Raises:
        OutputDirError: ``final`` exists and is not replaceable (checked again just before the swap).
    """
    final = Path(final)
    replaceable = replaceable or is_replaceable
    with write_errors(final.parent, kind):
        final.parent.mkdir(parents=True, exist_ok=True)
        recover_dir(final, replaceable)
        if os.path.lexists(final) and not replaceable(final):  # said now, before the work that would fill it
            raise _not_ours(final)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    try:
        os.chmod(tmp, 0o777 & ~current_umask())  # mkdtemp's 0700 would become final's: mkdir's mode instead
        write_marker(tmp, kind)
        yield tmp
        fsync_tree(tmp)
        if os.path.lexists(final):
            if not replaceable(final):
                raise _not_ours(final)
            # Mark the old directory before it moves to a temp name, so that a kill before its removal
            # leaves a leftover the next run recognises (a directory of an older mmfast has no marker).
            if marker_kind(final) is None:
                write_marker(final, kind)
            if _exchange(tmp, final):
                fsync_dir(final.parent)
                remove_ours(tmp)  # the old directory, now under the temp name
                return
            old = _old_name(final)
            os.replace(final, old)  # a kill here leaves only `old`: restore_interrupted_swap moves it back
            os.replace(tmp, final)
            fsync_dir(final.parent)
            remove_ours(old)
        else:
            os.replace(tmp, final)
            fsync_dir(final.parent)
    except BaseException:
        if tmp.exists():
            remove_ours(tmp)
        raise


def _not_ours(final: Path) -> OutputDirError:
    return OutputDirError(f"{final} exists and was not written by mmfast; it is left untouched")


def recover_dir(final: str | os.PathLike, replaceable: Callable[[Path], bool] | None = None) -> None:
    """Undo what a killed ``atomic_dir`` left beside ``final``; call it under ``final``'s lock.

    Moves ``.NAME.old`` back to ``final`` when ``final`` is missing (a kill between the two renames of the
    fallback swap), and removes mmfast's leftovers: ``.NAME.old`` and ``.NAME.*.tmp`` directories that
    carry the marker or are empty. Anything else is left alone.
    """
    final = Path(final)
    replaceable = replaceable or is_replaceable
    old = _old_name(final)
    if not _put_back_old(final, replaceable) and old.is_dir() and not old.is_symlink() and replaceable(old):
        remove_ours(old)
    if not final.parent.is_dir():
        return
    for p in final.parent.glob(f".{glob.escape(final.name)}.*.tmp"):
        if p.is_dir() and not p.is_symlink() and is_replaceable(p):
            remove_ours(p)


def restore_interrupted_swap(final: str | os.PathLike, replaceable: Callable[[Path], bool] | None = None) -> bool:
    """Put back the directory a killed swap left aside: ``.NAME.old`` (mmfast's) when ``final`` is missing.

    A kill between the two renames of ``atomic_dir``'s fallback swap leaves ``final`` absent and the complete
    old directory as ``.NAME.old``; whoever opens ``final`` next (a preparation, a training run) calls this
    first. It takes ``final``'s lock (``dir_lock_path``), waiting a few seconds at most: a preparation that
    holds the lock completes the swap itself. Nothing is deleted; a move that fails (a read-only folder) is
    logged, and ``final`` stays missing.

    Args:
        final: the directory that should exist.
        replaceable: whether ``.NAME.old`` is mmfast's (default: ``is_replaceable``).

    Returns:
        True when ``.NAME.old`` was moved back to ``final``.
    """
    final = Path(final)
    if os.path.lexists(final) or not _old_name(final).is_dir():  # the usual case: no lock, no wait
        return False
    try:
        with file_lock(dir_lock_path(final), timeout=_RESTORE_WAIT_S):
            return _put_back_old(final, replaceable or is_replaceable)
    except TimeoutError:
        return False
    except OSError as e:  # a folder this process may not write: the caller's own error follows
        log.warning("cannot put %s back from %s (%s); move it back yourself", final, _old_name(final).name, e)
        return False


def _put_back_old(final: Path, replaceable: Callable[[Path], bool]) -> bool:
    """Move ``.NAME.old`` back to ``final`` when ``final`` is missing; the caller holds ``final``'s lock."""
    old = _old_name(final)
    if os.path.lexists(final) or not old.is_dir() or old.is_symlink() or not replaceable(old):
        return False
    os.replace(old, final)
    fsync_dir(final.parent)
    log.warning("put %s back from %s (a preparation was killed while replacing it)", final, old.name)
    return True


def dir_lock_path(final: str | os.PathLike) -> Path:
    """The path whose ``file_lock`` guards building and replacing the directory ``final``."""
    final = Path(final)
    return final.parent / f".{final.name}.lock"


def remove_ours(path: Path) -> None:
    """Delete a directory that carries mmfast's marker (or is empty); the marker goes last, so that a
    kill part-way leaves a directory that is still recognisably mmfast's."""
    if not is_replaceable(path):
        raise OutputDirError(f"{path}: not mmfast's (no {MARKER}); refusing to delete it")
    for child in path.iterdir():
        if child.name == MARKER:
            continue
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()
    (path / MARKER).unlink(missing_ok=True)
    path.rmdir()


def write_marker(directory: Path, kind: str) -> None:
    """Mark ``directory`` as written by mmfast (see ``MARKER``)."""
    (Path(directory) / MARKER).write_text(json.dumps({"kind": kind, "version": MARKER_VERSION}) + "\n")


def marker_kind(directory: Path) -> str | None:
    """The ``kind`` in ``directory``'s marker; None without a readable marker."""
    kind = read_json_object(Path(directory) / MARKER).get("kind")
    return kind if isinstance(kind, str) else None


def is_replaceable(directory: Path, kind: str | None = None) -> bool:
    """True for a real directory (not a symlink) that is empty or carries mmfast's marker (of ``kind``, when
    given: a directory of another kind is not replaced by this one)."""
    directory = Path(directory)
    if directory.is_symlink() or not directory.is_dir():
        return False
    if not (directory / MARKER).is_file():
        if not any(directory.iterdir()):
            return True
        # Another process claiming the folder this instant may have written its marker between the two looks
        # (the marker being what made the folder non-empty): look for it again before calling it the user's.
        if not (directory / MARKER).is_file():
            return False
    # An unreadable marker (kind None) is what a run killed (or out of disk) while writing it leaves.
    return kind is None or marker_kind(directory) in (kind, None)


def _old_name(final: Path) -> Path:
    return final.with_name(f".{final.name}.old")


@functools.cache
def _renameat2() -> Callable | None:
    """libc's renameat2 (glibc >= 2.28), or None where there is none (other libcs, other systems)."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (``renameat2(RENAME_EXCHANGE)``); False when the kernel or the filesystem
    cannot, so the caller falls back to two renames."""
    fn = _renameat2()
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def cache_home() -> Path:
    """The folder of mmfast's caches (the demo set, feature caches, streamed shards): ``$MMFAST_CACHE`` when
    set, else ``~/.cache/mmfast``."""
    return Path(os.environ.get("MMFAST_CACHE") or Path.home() / ".cache" / "mmfast").expanduser()


class OutputError(ValueError):
    """An output path that would replace what the user owns; the message says what to pass instead."""


def claim_output_dir(path: str | os.PathLike, kind: str) -> Path:
    """The folder a command writes its files into (evaluate's, export's): created and marked as mmfast's, or
    one that is empty or already carries mmfast's marker of ``kind``. A folder holding files mmfast did not
    write is refused (its same-named files would be replaced): nothing of the user's is overwritten. Another
    kind of mmfast folder (a model directory, a prepared dataset) is refused too: it is replaced whole when
    written again, and these files with it.

    Raises:
        OutputError: ``path`` is a file, or a folder with files of the user's.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise OutputError(f"--out {path}: is a file; pass a folder (new, or one mmfast wrote)")
    if path.is_dir() and is_replaceable(path) and not is_replaceable(path, kind):  # a model directory, say
        raise OutputError(
            f"--out {path}: is mmfast's {marker_kind(path)}, not a folder for this command's files (the next "
            "write of it would remove them); pass a new or empty folder"
        )
    if path.is_dir() and not is_replaceable(path):
        raise OutputError(
            f"--out {path}: holds files mmfast did not write (same-named ones would be replaced); pass a new or "
            "empty folder"
        )
    path.mkdir(parents=True, exist_ok=True)
    if not (path / MARKER).is_file():
        write_marker(path, kind)
    return path


def check_output_file(path: str | os.PathLike, inputs: list[str], written_by_us) -> None:
    """Refuse an output file that would replace what the user owns: one of ``inputs`` (the file read, the
    images it names) or an existing file that ``written_by_us(path)`` does not recognise as an earlier output
    of the same command.

    Raises:
        OutputError: naming the path and what to pass instead.
    """
    path = Path(path)
    if not os.path.lexists(path):
        return
    if path.is_dir():
        raise OutputError(f"--out {path}: is a folder; pass a file name")
    for name in inputs:
        try:
            same = os.path.samefile(path, name)
        except (OSError, ValueError):
            continue
        if same:
            raise OutputError(f"--out {path}: is one of this command's inputs ({name}); pass another file name")
    if not written_by_us(path):
        raise OutputError(
            f"--out {path}: exists and is not an earlier output of this command; pass a new file name (or move "
            "it away first)"
        )


OUTPUT_KINDS = ("export", "evaluation")  # what claim_output_dir's callers mark their folders as


def is_mmfast_output(folder: Path) -> bool:
    """A run's, a profile's, an export's or an evaluation's folder (by its marker): never an input's part."""
    folder = Path(folder)
    if folder.is_symlink():
        return False
    return (folder / RUN_MARKER).is_file() or ((folder / MARKER).is_file() and marker_kind(folder) in OUTPUT_KINDS)
