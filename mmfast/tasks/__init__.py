"""Layer 2, training objectives: what a task needs from a batch, its loss, its evaluation figures, what
"best" means and its summary (``registry.Task``). The training loop calls a task and knows none of that; a new
objective is one module here plus its line in ``registry`` (or ``register_task`` from outside).

The built-in tasks: ``classification`` and ``contrastive`` (CLIP / SigLIP on image-caption pairs; labels,
when there are any, only for zero-shot evaluation). The torch-backed names are imported on first use (PEP 562):
``mmfast-train --help`` reads the registries' names without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from mmfast.tasks.registry import BUILTIN_TASKS, LOSSES, TASKS, Task, register_task

_LAZY = {
    "build_task": "mmfast.tasks.factory",
    "ClassificationTask": "mmfast.tasks.classification",
    "ContrastiveTask": "mmfast.tasks.contrastive",
}

if TYPE_CHECKING:
    from mmfast.tasks.classification import ClassificationTask
    from mmfast.tasks.contrastive import ContrastiveTask
    from mmfast.tasks.factory import build_task


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mmfast.tasks' has no attribute '{name}'")


__all__ = [
    "BUILTIN_TASKS",
    "LOSSES",
    "TASKS",
    "ClassificationTask",
    "ContrastiveTask",
    "Task",
    "build_task",
    "register_task",
]
