"""Layer 4, training: one typed configuration (``config``), a run's set-up and end (``run``: ``train``), the
loop (``engine``), its loaders (``data``), optimizer (``optim``), outputs (``report``), checkpoints, run
directories, stop signals and profiling. ``train`` is imported on first use (PEP 562): reading the
configuration (``mmfast-train --help``) imports neither torch nor DALI."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mmfast.train.config import TrainConfig
from mmfast.train.flags import parse_config

if TYPE_CHECKING:
    from mmfast.train.run import train


def __getattr__(name: str):
    if name == "train":
        from mmfast.train.run import train  # torch: ``import mmfast.train`` stays light

        return train
    raise AttributeError(f"module 'mmfast.train' has no attribute '{name}'")


__all__ = ["TrainConfig", "parse_config", "train"]
