"""Build a registered task (``registry.TASKS``) by name for a prepared dataset."""

from __future__ import annotations

from mmfast.data.dataset import PreparedDataset
from mmfast.tasks.registry import TASKS, Task


def build_task(name: str, dataset: PreparedDataset, settings: object | None = None) -> Task:
    """The task registered as ``name``, for ``dataset``.

    Args:
        name: a registered task ("classification", "contrastive", or one added with ``register_task``).
        dataset: the prepared dataset it trains on.
        settings: the run's model slice (``ModelConfig``), or any object with the fields a task class's
            ``config_options`` names: the task gets them as keyword arguments (as a model does); None: the
            task's defaults.

    Raises:
        ValueError: no task of that name ("unknown task 'x'; choose from ..."), or one the dataset does not fit.
    """
    cls = TASKS.pick(name)
    names = getattr(cls, "config_options", ())
    options = {n: getattr(settings, n) for n in names} if settings is not None else {}
    return cls(dataset, **options)
