"""Who may write a run directory: one run at a time, and never over what the user owns.

A run directory carries a marker (``.mmfast-run``) from its first moment. A new run goes into an absent
or empty directory; an earlier run there is continued (``--resume``), moved aside whole (``--overwrite``,
or the default ``runs/latest``), or refused. A directory without the marker that holds anything is never
written, moved or deleted. While a run lives, its main process holds an exclusive lock on
``<run>/.mmfast-run.lock`` (with its pid inside), so a second process on the same directory stops at once.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from mmfast.data.dataset import PREPARED_MARKER
from mmfast.prepare.config import PREPARED_KIND
from mmfast.util.fsutil import RUN_MARKER, marker_kind, read_json_object

LOCK_FILE = ".mmfast-run.lock"
RUN_TOKENIZER_DIR = "tokenizer"  # <run>/tokenizer: the tokenizer the run trains with (snapshot_tokenizer)
RAW_DATA_DIR = "prepared"  # a raw --data is prepared into <run>/prepared (mmfast.train.setup.resolve_data)
# What a start writes before its first step: the marker, the lock, a raw --data's preparation (or the
# rejects of one that found no usable row), and config.json and the tokenizer's copy (written before the
# first batch is read: a run whose first batch failed, every image missing, left them and nothing else).
_START_FILES = {
    RUN_MARKER,
    LOCK_FILE,
    RAW_DATA_DIR,
    f"{RAW_DATA_DIR}.rejected.jsonl",
    "config.json",
    RUN_TOKENIZER_DIR,
}


class RunDirError(ValueError):
    """The run directory cannot be used as asked (holds other files, another run, or is in use)."""


def is_run_dir(path: Path) -> bool:
    """True when mmfast wrote ``path`` as a run directory (marker, or an older run's config.json)."""
    if (path / RUN_MARKER).is_file():
        return True
    # runs written before the marker existed: config.json with mmfast's own keys
    return {"model", "preset", "grad_accum"} <= set(read_json_object(path / "config.json"))


def never_started(path: Path) -> bool:
    """True when ``path`` holds only what a run writes before its first step (marker, lock, a raw --data's
    preparation) and so stopped before training (a wrong flag, a missing or unusable dataset): the
    corrected command may use it as if it were empty (and reuse that preparation)."""
    names = {p.name for p in path.iterdir()}
    return bool(names) and names <= _START_FILES


@dataclass(frozen=True)
class RunDirPlan:
    """What to do with the run directory: "new" (absent or empty), "resume" or "move-aside"."""

    action: str
    run_dir: Path


def plan_run_dir(run_dir: Path, resume: bool, overwrite: bool, default_out: bool) -> RunDirPlan:
    """Decide, without touching anything, how this run may use ``run_dir``.

    Args:
        run_dir: the --out directory.
        resume: --resume was given.
        overwrite: --overwrite was given (move an earlier run aside).
        default_out: --out was not given (the default location rotates earlier runs aside).

    Raises:
        RunDirError: the directory holds files mmfast did not write, or an earlier run and neither
            --resume nor --overwrite says what to do with it.
    """
    for parent in [run_dir.resolve(), *run_dir.resolve().parents]:
        if (parent / PREPARED_MARKER).exists():
            raise RunDirError(
                f"--out {run_dir} is inside the prepared dataset {parent}, which preparing it again replaces "
                "whole; choose an --out outside it"
            )
    if not run_dir.exists():
        return RunDirPlan("new", run_dir)
    if not run_dir.is_dir():
        raise RunDirError(f"--out {run_dir} is a file, not a directory; choose another --out")
    if not any(run_dir.iterdir()) or never_started(run_dir):
        return RunDirPlan("new", run_dir)
    if not is_run_dir(run_dir):
        raise RunDirError(
            f"--out {run_dir} holds files that mmfast did not write (no {RUN_MARKER} marker); mmfast never "
            "writes into, moves or deletes such a directory: choose an empty or new --out"
        )
    if resume:
        return RunDirPlan("resume", run_dir)
    if overwrite or default_out:
        return RunDirPlan("move-aside", run_dir)
    raise RunDirError(
        f"--out {run_dir} holds an earlier run; pass --resume latest to continue it, --overwrite to move it "
        "aside (nothing is deleted) and start afresh, or choose another --out"
    )


class RunDirLock:
    """An exclusive, non-blocking lock on a run directory, held for the life of the run (main process)."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / LOCK_FILE
        self._fd: int | None = None
        self.created_dir = False  # the run made the directory (claim_run_dir): it may remove it unused
        self.moved_aside: Path | None = None  # where claim_run_dir moved an earlier run (put back if unused)

    def release_unused(self) -> Path | None:
        """Release the lock of a run that failed; if it wrote nothing, take its marker and lock file away too
        (and the directory, when the run made it), and put back the earlier run it moved aside: nothing of
        the failed start is left behind. Returns where an earlier run was put back, if one was."""
        run_dir = self.path.parent
        if self._fd is None or not never_started(run_dir):
            self.release()
            return None
        if self.created_dir:  # this run made the directory, so what the start prepared in it is its own
            _remove_raw_preparation(run_dir)
        (run_dir / RUN_MARKER).unlink(missing_ok=True)
        self.path.unlink(missing_ok=True)  # still held: no other run can take it in between
        self.release()
        if not self.created_dir:
            return None
        try:
            run_dir.rmdir()
            if self.moved_aside is not None:
                os.rename(self.moved_aside, run_dir)
                return run_dir
        except OSError:  # something appeared in it meanwhile: leave it
            pass
        return None

    def acquire(self) -> None:
        """Take the lock and write this pid into the lock file.

        Raises:
            RunDirError: another live process holds it (its pid is named).
        """
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunDirError(
                f"--out {self.path.parent} is in use by another mmfast run (pid {holder}); wait for it to "
                "finish or choose another --out"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def _remove_raw_preparation(run_dir: Path) -> None:
    """Remove the preparation of a raw --data that a failed start wrote into the run directory it made (only a
    directory carrying mmfast's prepared-dataset marker; anything else stays, and the run directory with it)."""
    (run_dir / f"{RAW_DATA_DIR}.rejected.jsonl").unlink(missing_ok=True)
    prepared = run_dir / RAW_DATA_DIR
    if prepared.is_dir() and not prepared.is_symlink() and marker_kind(prepared) == PREPARED_KIND:
        shutil.rmtree(prepared)


def claim_run_dir(plan: RunDirPlan) -> tuple[RunDirLock, Path | None]:
    """Carry out ``plan`` on the main process: lock, move an earlier run aside if planned, mark the directory.

    Returns:
        (the held lock, where an earlier run was moved to or None).
    """
    run_dir = plan.run_dir
    moved_to = None
    if plan.action == "move-aside":
        # Lock the old run first: a run that is still going must not be moved from under it.
        old_lock = RunDirLock(run_dir)
        old_lock.acquire()
        moved_to = _aside_name(run_dir)
        os.rename(run_dir, moved_to)
        old_lock.release()
    created = not run_dir.exists()
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = RunDirLock(run_dir)
    lock.acquire()
    lock.created_dir, lock.moved_aside = created, moved_to
    marker = run_dir / RUN_MARKER
    if not marker.exists():
        marker.write_text(json.dumps({"kind": "mmfast run", "created": time.strftime("%Y-%m-%dT%H:%M:%S")}) + "\n")
    return lock, moved_to


def _aside_name(run_dir: Path) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in range(1000):
        cand = run_dir.with_name(f"{run_dir.name}.old-{stamp}" + (f"-{n}" if n else ""))
        if not cand.exists():
            return cand
    raise RunDirError(f"cannot find a free name to move {run_dir} aside; choose another --out")


def read_tree(root: Path) -> dict[str, bytes]:
    """{relative path: bytes} of every file under ``root``: a small folder held as it is now."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def snapshot_tokenizer(files: dict[str, bytes], run_dir: Path) -> Path:
    """Write the tokenizer the run opened (``read_tree`` of the prepared dataset's, taken when it opened the
    data) into ``run_dir``, so that the model directory written at the end carries the tokenizer the run
    trained with, even if the dataset is prepared again meanwhile (its token cache stays mapped; its
    tokenizer/ would be the new one). Returns the folder."""
    dest = run_dir / RUN_TOKENIZER_DIR
    tmp = run_dir / f".{RUN_TOKENIZER_DIR}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)  # a killed run's leftover: inside the run directory we hold
    for rel, data in files.items():
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp / rel).write_bytes(data)
    if dest.exists():
        shutil.rmtree(dest)  # a resumed run's earlier copy (the data's fingerprint matched)
    os.replace(tmp, dest)
    return dest
