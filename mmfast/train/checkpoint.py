"""Atomic, resumable checkpoints: accelerator state + trainer state + loader position.

A checkpoint is written by every process into ``checkpoints/.step-XXXXXXXX.tmp`` and renamed to
``checkpoints/step-XXXXXXXX`` by the main process only after all of them finished, so a directory
without the leading dot is always complete; a crash mid-write leaves a dot-directory that is never
picked up and is cleaned on the next save.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from mmfast.fsutil import fsync_dir, fsync_tree

STATE_FILE = "trainer_state.json"


def checkpoint_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints, oldest first."""
    d = checkpoint_dir(run_dir)
    if not d.is_dir():
        return []
    done = [p for p in d.iterdir() if p.is_dir() and p.name.startswith("step-") and (p / STATE_FILE).is_file()]
    return sorted(done, key=lambda p: int(p.name.split("-")[1]))


def resolve_resume(resume: str, run_dir: str | os.PathLike) -> Path | None:
    """The checkpoint named by ``--resume`` ("latest" or a path); None when "latest" finds none."""
    if resume == "latest":
        ckpts = list_checkpoints(run_dir)
        return ckpts[-1] if ckpts else None
    path = Path(resume)
    if not (path / STATE_FILE).is_file():
        raise ValueError(
            f"--resume {path}: not a complete mmfast checkpoint (no {STATE_FILE}); "
            f"use --resume latest or one of {checkpoint_dir(run_dir)}/step-*"
        )
    return path


def save_checkpoint(accelerator, run_dir: str | os.PathLike, step: int, trainer_state: dict, keep: int) -> Path:
    """Write a checkpoint atomically on all processes (a collective call); keep the newest ``keep``."""
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
        if accelerator.is_main_process:
            with open(tmp / STATE_FILE, "w") as f:
                json.dump(trainer_state, f, indent=2)
                f.flush()
                os.fsync(f.fileno())
            fsync_tree(tmp)
    except Exception as e:  # OSError, and serializers' own errors (safetensors reports EFBIG as SafetensorError)
        err = e
    ok = _all_ok(accelerator, int(err is None))
    if not ok:
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        msg = f"writing checkpoint {final} failed" + (f": {err}" if err is not None else " on another process")
        raise OSError(msg + "; the previous checkpoint is intact. Free disk space and --resume latest")
    if accelerator.is_main_process:
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(d)
        for old in list_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def _all_ok(accelerator, ok: int) -> bool:
    import torch

    flag = torch.tensor([ok], device=accelerator.device)
    return bool(accelerator.reduce(flag, reduction="sum").item() == accelerator.num_processes)


def load_checkpoint(accelerator, path: Path) -> dict:
    """Restore accelerator state (model, optimizer, scaler, scheduler, RNG) and return the trainer state."""
    accelerator.load_state(str(path))
    return json.loads((path / STATE_FILE).read_text())
