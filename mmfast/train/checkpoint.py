"""Atomic, verified, resumable checkpoints: accelerator state + trainer state + loader position.

A checkpoint is written by every process into ``checkpoints/.step-XXXXXXXX.tmp`` and renamed to
``checkpoints/step-XXXXXXXX`` by the main process only after all of them finished, so a directory
without the leading dot is always complete; a crash mid-write leaves a dot-directory that is never
picked up and is cleaned on the next save. ``checksums.json`` records the SHA-256 of every other file;
a resume verifies them and falls back to the newest intact checkpoint when the latest one was damaged.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

from mmfast.train.setup import all_processes_ok
from mmfast.util.fsutil import atomic_write_json, file_sha256, fsync_dir, fsync_tree, shared_modes

log = logging.getLogger(__name__)
STATE_FILE = "trainer_state.json"
CHECKSUMS_FILE = "checksums.json"


class CheckpointError(ValueError):
    """No usable checkpoint: the one named is damaged, or every one of the run is."""


def checkpoint_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints, oldest first."""
    d = checkpoint_dir(run_dir)
    if not d.is_dir():
        return []
    done = [p for p in d.iterdir() if p.is_dir() and p.name.startswith("step-") and (p / STATE_FILE).is_file()]
    return sorted(done, key=lambda p: int(p.name.split("-")[1]))


def verify_checkpoint(path: Path) -> str:
    """Check every file of a checkpoint against checksums.json; "" when intact, else what is wrong."""
    try:
        sums = json.loads((path / CHECKSUMS_FILE).read_text())
    except FileNotFoundError:
        return f"no {CHECKSUMS_FILE} (incomplete, or written by an mmfast without checksums)"
    except (OSError, ValueError) as e:
        return f"{CHECKSUMS_FILE} unreadable ({e})"
    if not isinstance(sums, dict) or STATE_FILE not in sums:
        return f"{CHECKSUMS_FILE} does not list {STATE_FILE}"
    for rel, want in sorted(sums.items()):
        f = path / rel
        if not f.is_file():
            return f"{rel} is missing"
        if file_sha256(f) != want:
            return f"{rel} differs from what was written (SHA-256 mismatch)"
    return ""


def resolve_resume(resume: str, run_dir: str | os.PathLike) -> Path | None:
    """The checkpoint named by ``--resume`` ("latest" or a path), verified; None when "latest" finds none.

    "latest" skips damaged checkpoints (each is reported) and takes the newest intact one.

    Raises:
        CheckpointError: the named checkpoint is damaged, or the run has checkpoints and all are damaged.
    """
    if resume != "latest":
        path = Path(resume)
        if not path.exists():
            hint = f"use --resume latest, or one of {checkpoint_dir(run_dir)}/step-*"
            if not list_checkpoints(run_dir):
                hint = f"{run_dir} has no checkpoint yet: start the run without --resume"
            raise CheckpointError(f"--resume {path}: no such checkpoint; {hint}")
        problem = verify_checkpoint(path) if (path / STATE_FILE).is_file() else f"no {STATE_FILE}"
        if problem:
            raise CheckpointError(
                f"--resume {path}: not an intact mmfast checkpoint ({problem}); "
                f"use --resume latest or another of {checkpoint_dir(run_dir)}/step-*"
            )
        return path
    ckpts = list_checkpoints(run_dir)
    for path in reversed(ckpts):
        problem = verify_checkpoint(path)
        if not problem:
            return path
        log.warning("checkpoint %s is damaged (%s); trying the one before it", path, problem)
    if ckpts:
        raise CheckpointError(
            f"every checkpoint in {checkpoint_dir(run_dir)} is damaged (see above); cannot resume. Start "
            "afresh with --overwrite (the old run is moved aside, not deleted)"
        )
    return None


def read_trainer_state(path: Path) -> dict:
    """The trainer state saved with a checkpoint (epoch, step, loader positions, the run's config)."""
    f = path / STATE_FILE
    try:
        state = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{f}: unreadable ({e}); resume from another checkpoint") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{f}: expected a JSON object")
    return state


def save_checkpoint(
    accelerator, run_dir: str | os.PathLike, step: int, trainer_state: dict, keep: int, protect: int | None = None
) -> Path:
    """Write a checkpoint atomically on all processes (a collective call); keep the newest ``keep`` and the
    one of step ``protect`` (the best so far)."""
    d = checkpoint_dir(run_dir)
    final = d / f"step-{step:08d}"
    tmp = d / f".step-{step:08d}.tmp"
    if accelerator.is_main_process:
        d.mkdir(parents=True, exist_ok=True)
        for stale in d.glob(".step-*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    accelerator.wait_for_everyone()
    err: Exception | None = None
    try:
        accelerator.save_state(str(tmp), safe_serialization=True)
    except Exception as e:  # OSError, and serializers' own errors (safetensors reports EFBIG as SafetensorError)
        err = e
    ok = all_processes_ok(accelerator, err is None)  # every process's files are written (or one failed)
    if ok and accelerator.is_main_process:
        try:
            atomic_write_json(tmp / STATE_FILE, trainer_state)
            sums = {p.relative_to(tmp).as_posix(): file_sha256(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
            atomic_write_json(tmp / CHECKSUMS_FILE, sums)
            shared_modes(tmp)
            fsync_tree(tmp)
        except Exception as e:
            err = e
    ok = all_processes_ok(accelerator, err is None) if ok else ok
    if not ok:
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        msg = f"writing checkpoint {final} failed" + (f": {err}" if err is not None else " on another process")
        kept = [p for p in final.parent.iterdir() if p.is_dir() and p.name.startswith("step-")]
        after = "the previous checkpoint is intact" if kept else "there is no earlier checkpoint to resume from"
        raise OSError(f"{msg}; {after}. Free disk space and {'--resume latest' if kept else 'run again'}")
    if accelerator.is_main_process:
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(d)
        for old in list_checkpoints(run_dir)[:-keep]:
            if protect is None or old.name != f"step-{protect:08d}":
                shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(accelerator, path: Path) -> dict:
    """Restore accelerator state (model, optimizer, scaler, scheduler, RNG) and return the trainer state."""
    accelerator.load_state(str(path))
    return read_trainer_state(path)
