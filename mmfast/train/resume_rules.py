"""Which settings a resumed run may change: the rest must equal the checkpoint's, or the run would not continue
the same training."""

from __future__ import annotations

# Settings a resumed run may change (applied from the resume on, and recorded in config.json's segments).
# Every other field must equal the checkpoint's, or the resumed run would not continue the same training.
MAY_CHANGE_ON_RESUME = frozenset(
    {
        "data",  # the path may move; the data's fingerprint must match (checked separately)
        "out",
        "resume",
        "overwrite",
        "init_proj",  # how a fresh run's weights started: a resumed one has its checkpoint's
        "init_from",
        "channels_last",  # a memory format and kernels: the same weights and optimizer state
        "optimizer_impl",
        "epochs",
        "max_steps",
        "checkpoint_every",
        "keep_checkpoints",
        "checkpoints",
        "profile",
        "profile_interval",
        "tensorboard",
        "report_to",
        "log_every",
        "progress",
        "record_ids",
        "num_threads",
        "eval_batch_size",
        "eval_every",  # when the val split is evaluated: the same training
        "max_nan_steps",
        "on_bad_image",
        "verify_files",
        "compile",
        "compile_mode",
        "text_padding",  # padding is masked: the same figures
        "dist_timeout",
        "rendezvous_timeout",
        "stop_grace",
        "feature_cache_dir",  # where the features are kept: the same features read
        "shard_cache",  # where this machine holds the remote shards, and how much: the same bytes read
        "cache_limit",
        "store_timeout",  # how long a fetch rides out a store outage: the same bytes read
        "cache_limit_gb",  # what runs before --cache-limit recorded
        "mixed_precision",  # compared as resolved by Accelerate (auto -> bf16/fp16/no), not as written
    }
)


def resume_differences(saved: dict, now: dict) -> list[str]:
    """The must-match settings in which ``now`` differs from the checkpoint's ``saved`` run, as
    "name: saved -> now" lines (empty when the run may resume)."""
    saved = {"task": "classification", **saved}  # a run that recorded no task trained a classifier
    # a record without the feature cache's fields (an earlier run's) decoded every epoch: on either side
    # and one without --image-pool's pooled the last feature map
    # and one without --wise-ft's ended with the trained weights alone; one without --zero-shot-map had none
    old = {
        "feature_cache": "off",
        "feature_views": 4,
        "image_pool": "last",
        "wise_ft": 1.0,
        "zero_shot_map": "none",
    }
    saved, now = ({**old, **r} for r in (saved, now))
    keys = sorted((set(saved) | set(now)) - MAY_CHANGE_ON_RESUME)
    return [_difference(k, saved, now) for k in keys if saved.get(k) != now.get(k)]


def _difference(key: str, saved: dict, now: dict) -> str:
    """One line of ``resume_differences``; the data's by its --data, as the user knows it, not its hash."""
    if key == "data_fingerprint":
        moved = f"{saved.get('data')!r} -> {now.get('data')!r}" if saved.get("data") != now.get("data") else ""
        where = f"data: {moved}" if moved else f"data at {now.get('data')!r}"
        return f"{where}: other prepared data than the run trained on (its rows, captions, images or split differ)"
    line = f"{key}: {_shown(saved.get(key))} -> {_shown(now.get(key))}"
    if key == "global_batch_size" and saved.get(key) is not None:  # what lets the process count change
        line += f" (pass --global-batch-size {saved[key]}: each process's batch follows from it)"
    if key == "preset" and saved.get(key) is not None:  # a default that changed (--model clip's, 2026-12-07)
        line += f" (pass --preset {saved[key]}: the run's recipe)"
    return line


def _shown(value) -> str:
    return "not set" if value is None else repr(value)
