"""--data and --data-weights read as the run uses them: the paths in order, and each one's share of an epoch."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the slices import the configuration, which imports this module
    from mmfast.train.slices import DataConfig, LoaderConfig


def data_sources(cfg: DataConfig | LoaderConfig) -> list[str]:
    """The --data paths, in order ([] for the demo set)."""
    if cfg.data is None:
        return []
    return [cfg.data] if isinstance(cfg.data, str) else list(cfg.data)


def data_weights(cfg: LoaderConfig) -> list[float] | None:
    """--data-weights as numbers (None when not given).

    Raises:
        ValueError: a share that is not a positive finite number, or not one share per --data.
    """
    if cfg.data is not None and not (isinstance(cfg.data, str) or all(isinstance(d, str) for d in cfg.data)):
        raise ValueError(f"--data must be paths, got {cfg.data!r}")
    if cfg.data_weights is None:
        return None
    try:
        weights = [float(w) for w in str(cfg.data_weights).split(",")]
    except ValueError:
        weights = []
    if not weights or not all(math.isfinite(w) and w > 0 for w in weights):
        raise ValueError(f"--data-weights must be positive numbers separated by commas, got {cfg.data_weights!r}")
    given = data_sources(cfg)
    if len(given) > 1 and len(weights) != len(given):
        raise ValueError(f"--data-weights gives {len(weights)} shares for {len(given)} --data; give one for each")
    return weights
