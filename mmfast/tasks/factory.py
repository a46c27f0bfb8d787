"""Build a registered task (``registry.TASKS``) by name for a prepared dataset."""

from __future__ import annotations

from mmfast.data.dataset import PreparedDataset
from mmfast.tasks.registry import TASKS, Task


def build_task(name: str, dataset: PreparedDataset, cfg: object | None = None) -> Task:
    """The task registered as ``name``, for ``dataset``.

    Args:
        name: a registered task ("classification", "contrastive", or one added with ``register_task``).
        dataset: the prepared dataset it trains on.
        cfg: the run's config (``TrainConfig``): a task class that declares ``config_options`` gets those
            fields as keyword arguments (as a model does); None: the task's defaults.

    Raises:
        ValueError: no task of that name ("unknown task 'x'; choose from ..."), or one the dataset does not fit.
    """
    cls = TASKS.pick(name)
    options = {n: getattr(cfg, n) for n in getattr(cls, "config_options", ())} if cfg is not None else {}
    return cls(dataset, **options)
