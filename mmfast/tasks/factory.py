"""Build a registered task by name for a prepared dataset. Importing this module registers the built-in tasks."""

from __future__ import annotations

from mmfast.data.dataset import PreparedDataset
from mmfast.tasks import classification  # noqa: F401  (the built-in task registers itself when it is imported)
from mmfast.tasks.registry import TASKS, Task


def build_task(name: str, dataset: PreparedDataset) -> Task:
    """The task registered as ``name``, for ``dataset``.

    Raises:
        ValueError: no task of that name ("unknown task 'x'; choose from ..."), or one the dataset does not fit.
    """
    if name not in TASKS:
        raise ValueError(f"unknown task '{name}'; choose from {', '.join(TASKS)}")
    return TASKS[name](dataset)
