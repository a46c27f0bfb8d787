"""A feature cache built by all of a run's processes and read by each (``build_shared``): the first pass is split
across the processes, one process per filesystem writes what all of them computed, and every process then
reads the whole cache by sample id.

How it goes, for a cache directory that every process names:
    1. Every process computes the cache's fingerprint; processes that disagree stop the run.
    2. The local main process of each machine checks the directory. When it is stale it tries the directory's
       lock without waiting: holding it, it is a writer. Another holder (another run, or a writer of this run
       whose machine shares the lock folder): it waits for that build once this run's own pass is done.
    3. Writers of one filesystem (several machines on a shared folder) leave a claim file; the lowest process
       index among the claims one filesystem shows writes, the others read what it writes.
    4. When a machine writes, every process runs the tower on its share of the samples. Each step the shares
       are gathered to every process, and each writer puts them in a temp directory. It is swapped in whole,
       ``meta.json`` last (``feature_cache.build_into``).
    5. A failure on any process (its tower, a write, the swap) reaches all of them at the next step, so all
       stop; the temp directory is removed and no cache that looks whole is left.
    6. The samples whose image a process could not read (``Unreadable``: its loader skipped them) are gathered
       once every share is done, and the writers store them as absent: training masks them as decoding does.
A process waiting on another is bounded by --dist-timeout: no collective waits longer than one step.
"""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from mmfast.data.feature_cache import (
    FeatureCache,
    FeatureWriter,
    build_into,
    feature_fingerprint,
    plain_parts,
    stale_reason,
)
from mmfast.util.fsutil import OutputDirError, dir_lock_path
from mmfast.util.locks import file_lock


@dataclass
class Unreadable:
    """Given by a ``compute`` iterator between its steps: samples of its share whose image could not be read
    (``FileHealth.skipped``' entries), stored as absent (``FeatureWriter.absent``)."""

    entries: list[dict]


# One step of the first pass on one process: (stored view or None for the centre view, sample ids (B,),
# features (B, C)); ids < 0 are padding.
Step = tuple[int | None, torch.Tensor, torch.Tensor]
Compute = Callable[[int, int], Iterator[Step | Unreadable]]  # (shard, shards) -> this process's steps


def build_shared(
    accelerator,
    directory: str | os.PathLike,
    parts: dict,
    ids: np.ndarray,
    shape: tuple[int, int, int],
    dtype: str,
    compute: Compute,
    wait_s: float = -1,
    files: Callable[[], str | None] | None = None,
) -> tuple[FeatureCache, str, int]:
    """The cache of ``parts`` in ``directory`` on every process: read when whole and current, else built once
    per filesystem from the steps ``compute`` gives each process for its share.

    Args:
        shape: (views, width, rows per step): the cache's stored views and feature width, and the most rows
            one step of ``compute`` gives.
        wait_s: how long a local main process waits for another run's build of the same cache (-1: as long
            as it takes).
        files: gives the digest of the image files as they are now (``feature_cache.files_digest``); called by
            the local main process of each machine, once, and only when the cache is otherwise current or is
            written: a cache built from files that changed since is stale.

    Returns:
        (the cache, why it was built: "" when an existing one was read, how many processes wrote it: one per
        filesystem that lacked it).

    Raises:
        RuntimeError: the processes' fingerprints differ.
        FeatureBuildError: the build failed on some process (``FeatureInputError``, a ValueError too, when
            that was the data's, the flags' or the disk's doing).
    """
    directory, parts = Path(directory), plain_parts(parts)
    fingerprint = feature_fingerprint(parts)
    world, rank = _world()
    digest = functools.cache(files) if files is not None and accelerator.is_local_main_process else None
    with contextlib.ExitStack() as held:
        role, reason = _local_role(accelerator, directory, parts, held, digest)
        seen = _all_objects((fingerprint, role, reason, secrets.token_hex(8)), world)
        if len({s[0] for s in seen}) > 1:
            raise RuntimeError(
                "the processes' locked towers give different feature fingerprints; load the same weights "
                "on every process, or pass --feature-cache off"
            )
        if world > 1 and any(s[1] == "write" for s in seen):
            role = _claim(directory, seen[0][3], rank, world, held, role)
        roles = _all_objects(role, world) if world > 1 else [role]
        built = next((s[2] for s, r in zip(seen, roles, strict=True) if r == "write"), "")
        failure = ""
        if "write" in roles:
            writes = role == "write"
            failure = _build_pass(accelerator, directory, parts, ids, shape, dtype, compute, writes, digest)
    # the lock is free again: a machine that waits for it may be waiting for this run's writer
    if role == "wait" and not failure:
        failure = _wait_for(directory, parts, wait_s, digest)
    _stop_all_on(failure, world)
    features = FeatureCache(directory)
    if features.fingerprint != fingerprint:
        raise RuntimeError(f"feature cache {directory} changed while this run read it; run again")
    return features, built, roles.count("write")


def _local_role(
    accelerator, directory: Path, parts: dict, held: contextlib.ExitStack, files: Callable[[], str] | None
) -> tuple[str, str]:
    """This process's part: "write" (the local main process, the cache stale, its lock taken: kept held
    in ``held``), "wait" (stale, another run holds the lock), "read" (current, or not the local main)."""
    if not accelerator.is_local_main_process:
        return "read", ""
    reason = stale_reason(directory, parts, files)
    if not reason:
        return "read", ""
    try:
        held.enter_context(file_lock(dir_lock_path(directory), timeout=0))
    except TimeoutError:
        return "wait", reason
    reason = stale_reason(directory, parts, files)  # another run may have finished it just before
    return ("write", reason) if reason else ("read", "")


def _claim(directory: Path, run: str, rank: int, world: int, held: contextlib.ExitStack, role: str) -> str:
    """``role``, except that a writer reads ("read") what another process on its filesystem writes: each writer
    leaves a claim beside ``directory``; the lowest process index among those this filesystem shows wins.
    Every process takes part (a barrier). ``run``: a token of this run, so that a killed run's claims are
    ignored."""
    if role != "write":
        _all_objects(None, world)
        return role
    mine = directory.parent / f".{directory.name}.claim-{run}-{rank:06d}"
    mine.parent.mkdir(parents=True, exist_ok=True)
    mine.touch()
    held.callback(mine.unlink, missing_ok=True)
    _all_objects(None, world)  # every writer's claim is in place
    claims = sorted(p.name for p in directory.parent.glob(f".{directory.name}.claim-{run}-*"))
    return "write" if claims[0] == mine.name else "read"


_ELSEWHERE = "another process failed"  # what a process that did not fail reports


class FeatureBuildError(RuntimeError):
    """The first pass stopped on some process: nothing was cached."""


class FeatureInputError(FeatureBuildError, ValueError):
    """The first pass stopped on the data or the disk: a ValueError or OSError while a process read its share
    (e.g. an unreadable image under --on-bad-image error), or an OSError making the cache's folder. A user's
    error, said in one line."""


class _Failure(str):
    """What stopped a process, as "Type: message"; ``about_input``: the data's or the disk's doing."""

    about_input = False


def _failed(e: BaseException, reading: bool = False) -> _Failure:
    """``e`` as a failure; ``reading``: it came from reading the share (the loader, the tower), where a
    ValueError or OSError is the data's; else only an OSError (the disk) is the user's to fix."""
    failure = _Failure(f"{type(e).__name__}: {e}")
    failure.about_input = isinstance(e, OSError | OutputDirError) or (reading and isinstance(e, ValueError))
    return failure


class _Stopped(Exception):
    """The first pass stopped: on this process or another (its message says which and why)."""


def _build_pass(accelerator, directory, parts, ids, shape, dtype, compute, writes: bool, files) -> str:
    """Run this process's share of the first pass, gathering every step's features to every process; a
    writer puts them in a temp directory swapped in at the end. Returns what failed ("" when nothing did)."""
    views, width, _ = shape
    try:
        with contextlib.ExitStack() as stack:
            writer, failure = None, ""
            if writes:
                try:
                    digest = files() if files is not None else None
                    writer = stack.enter_context(build_into(directory, ids, views, width, dtype, parts, digest))
                except Exception as e:  # noqa: BLE001 - every process hears of it at the first step
                    failure = _failed(e)
            failure = _steps(accelerator, compute, shape, writer, failure)
            if failure:
                raise _Stopped(failure)  # build_into removes its temp directory
    except _Stopped as e:
        return e.args[0]  # the _Failure itself, which says whether it was the input's doing
    except Exception as e:  # noqa: BLE001 - the finish or the swap: every process hears of it
        return _failed(e)
    return ""


def _steps(accelerator, compute: Compute, shape, writer: FeatureWriter | None, failure: str) -> str:
    """Each step: this process's share computed, every share gathered, and the writer's ``put``; until every
    share is done or some process failed. Returns this process's failure, or the first process's."""
    _, width, rows = shape
    world, rank = _world()
    steps, unreadable = compute(rank, world), []
    while True:
        step, failure = _next_step(steps, failure, unreadable)
        header, got = _gather_step(step, failure, width, rows, accelerator.device, world)
        if header[:, 1].any():
            return failure or _ELSEWHERE
        if not header[:, 0].any():  # every share done: the unreadable images of all of them
            entries = [e for share in _all_objects(unreadable, world) for e in share]
            try:
                if writer is not None and entries:
                    writer.absent(entries)
            except Exception as e:  # noqa: BLE001 - every process hears of it (_stop_all_on)
                return _failed(e)
            return ""
        if writer is None:
            continue
        try:
            for h, (i, f) in zip(header, got, strict=True):
                if h[0]:
                    writer.put(None if h[2] < 0 else int(h[2]), i, f)
        except Exception as e:  # noqa: BLE001 - told to all at the next step
            failure = _failed(e)


def _next_step(steps: Iterator[Step | Unreadable], failure: str, unreadable: list) -> tuple[Step | None, str]:
    """The next step of this process (None: none left), the ``Unreadable`` entries before it added to
    ``unreadable``."""
    if failure:
        return None, failure
    try:
        step = next(steps, None)
        while isinstance(step, Unreadable):
            unreadable += step.entries
            step = next(steps, None)
        return step, ""
    except Exception as e:  # noqa: BLE001 - its process stops all of them at this step
        return None, _failed(e, reading=True)


def _gather_step(step: Step | None, failure: str, width: int, rows: int, device, world: int):
    """Every process's step: a header (P, 3) of (has a step, failed, view or -1) and each one's (ids, features),
    padded to ``rows`` (ids -1)."""
    ids = torch.full((rows,), -1, dtype=torch.int64, device=device)
    feats = torch.zeros((rows, width), dtype=torch.float32, device=device)
    view = -1
    if step is not None:
        view = -1 if step[0] is None else int(step[0])
        n = len(step[1])
        ids[:n] = step[1].to(device=device, dtype=torch.int64).reshape(-1)
        feats[:n] = step[2].detach().to(device=device, dtype=torch.float32)  # (B, C)
    header = torch.tensor([[step is not None, bool(failure), view]], dtype=torch.int64, device=device)
    if world == 1:
        return header.cpu(), [(ids.cpu(), feats.cpu())]
    parts = [torch.empty_like(t) for t in (header, ids, feats) for _ in range(world)]
    for k, t in enumerate((header, ids, feats)):
        dist.all_gather(parts[k * world : (k + 1) * world], t)
    headers = torch.cat(parts[:world]).cpu()
    return headers, [(parts[world + r].cpu(), parts[2 * world + r].cpu()) for r in range(world)]


def _wait_for(directory: Path, parts: dict, wait_s: float, files: Callable[[], str] | None) -> str:
    """Wait for another run's build of ``directory`` (its lock, ``wait_s`` at most); what went wrong or ""."""
    try:
        with file_lock(dir_lock_path(directory), timeout=wait_s):
            reason = stale_reason(directory, parts, files)
    except TimeoutError:
        return f"another run has been building the feature cache {directory} for over {wait_s:.0f} s"
    return f"another run's build of the feature cache {directory} did not finish ({reason})" if reason else ""


def _stop_all_on(failure: str, world: int) -> None:
    """Raise on every process when one of them failed, naming the process and what it hit."""
    failures = _all_objects(failure, world) if world > 1 else [failure]
    bad = sorted(((f == _ELSEWHERE, r), f) for r, f in enumerate(failures) if f)  # the failing one first
    if bad:
        (_, r), f = bad[0]
        error = FeatureInputError if getattr(f, "about_input", False) else FeatureBuildError
        raise error(f"the feature cache's build stopped on process {r}: {f}; no cache was left")


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def _all_objects(obj, world: int) -> list:
    """``obj`` of every process, in rank order (a barrier too)."""
    if world == 1:
        return [obj]
    out = [None] * world
    dist.all_gather_object(out, obj)
    return out
