"""Elastic resume: a checkpoint written by N processes resumed on M, at the same global sample position.

Why it works: every process draws the same epoch order (``loading.sampling.epoch_order``) and takes every
N-th batch of it (``shard_positions``), so after t optimizer steps of a global batch G the run has trained the
first t x G positions of the epoch's order whatever N is. A run whose global batch is fixed
(``--global-batch-size``) may therefore change its process count between a stop and a restart: the per-process
batch and accumulation are derived again (``resolve.apply_global_batch``), and each process's loader starts at
micro-batch t x G / (its batch x M). Optimizer, scheduler, scaler and step counters are the checkpoint's (the
model replicas are identical). What cannot carry over: a process's DALI checkpoint (its augmentation stream is
seeded per process), so the pixels of the rest of the epoch are other draws of the same augmentation.
"""

from __future__ import annotations

from mmfast.train.checkpoint import CheckpointError

# What a run with a fixed global batch may change on resume: the layout the global batch is split into.
ELASTIC_KEYS = frozenset({"num_processes", "batch_size", "grad_accum", "eval_batch_size"})


def elastic(saved_run: dict, now: dict) -> bool:
    """Whether the checkpoint's run and this one fix the same global batch (then ``ELASTIC_KEYS`` may differ)."""
    g = now.get("global_batch_size")
    return g is not None and saved_run.get("global_batch_size") == g


def without_elastic(diffs: list[str], saved_run: dict, now: dict) -> list[str]:
    """``resume_rules.resume_differences``' lines, less those of ``ELASTIC_KEYS`` when the resume is elastic, or
    when the checkpoint's run fixed a global batch that this one changes or leaves out: the layout follows from
    the global batch, so that line alone says what to pass."""
    if elastic(saved_run, now) or saved_run.get("global_batch_size") is not None:
        return [d for d in diffs if d.split(":", 1)[0] not in ELASTIC_KEYS]
    return diffs


def loader_state(states: list[dict], batch_size: int, num_shards: int, shard_id: int) -> dict:
    """This process's loader position from the checkpoint's per-process ``states``: its own when the layout
    is unchanged, else the same global position in this layout (no DALI checkpoint).

    Raises:
        CheckpointError: the position is not a whole number of this layout's global micro-batches (it always
            is at an optimizer step of the same global batch).
    """
    first = states[0]
    if len(states) == num_shards and first.get("batch_size") == batch_size:
        return states[shard_id]
    if len({(s["epoch"], s["step"]) for s in states}) != 1:
        raise CheckpointError("the checkpoint's processes stood at different positions: it cannot be resumed")
    done = int(first["step"]) * int(first["batch_size"]) * len(states)  # samples of the epoch trained
    per = batch_size * num_shards
    if done % per:
        raise CheckpointError(
            f"the checkpoint stands {done} samples into epoch {first['epoch']}, not a whole number of this "
            f"run's global micro-batches ({num_shards} processes x {batch_size}); resume with "
            f"{len(states)} processes, or with a --global-batch-size whose share divides it"
        )
    return {
        "epoch": first["epoch"],
        "step": done // per,
        "seed": first["seed"],
        "num_samples": first["num_samples"],
        "num_shards": num_shards,
        "batch_size": batch_size,
        "shard_id": -1,  # no process of this layout wrote it: its DALI checkpoint does not apply
    }
