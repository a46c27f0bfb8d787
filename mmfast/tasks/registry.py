"""What a training objective is (``Task``, the calls the training loop makes), the registry of them by name
(what ``--task`` picks) and that of the contrastive losses (``--loss``). Imports nothing heavy: a built-in task
or loss is one line here naming its class, imported on first use, so ``mmfast-train --help`` lists the names
without torch. A task from outside adds itself with ``register_task``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from mmfast.util.registry import Registry

if TYPE_CHECKING:
    import torch

TASKS = Registry("task")
TASKS.declare("classification", "mmfast.tasks.classification:ClassificationTask")
TASKS.declare("contrastive", "mmfast.tasks.contrastive:ContrastiveTask")
BUILTIN_TASKS = tuple(TASKS)  # the names above, before any task from outside

# The contrastive losses (``--loss``), each a class in ``losses``: ``losses.create_loss`` makes one by name.
LOSSES = Registry("loss")
LOSSES.declare("clip", "mmfast.tasks.losses:ClipLoss")
LOSSES.declare("siglip", "mmfast.tasks.losses:SigLipLoss")


class Task(Protocol):
    """A training objective: everything the loop leaves to it. Built from the prepared dataset
    (``cls(dataset, **options)``), raising ValueError on a dataset it cannot train on.

    Attributes:
        num_outputs: what the model's head produces per sample (classes, for classification).
        tracked: evaluation figures that trackers compare runs by (TensorBoard's HParams view).

    Optional (read with ``getattr``; a task without them is built from the dataset alone and trained one
    micro-batch at a time):
        config_options: names of training-config fields ``build_task`` passes as keyword arguments.
        whole_window: True to be handed each accumulation window's micro-batches together:
            ``backward_window(accelerator, model, batches, no_sync) -> Tensor`` then does the forward and
            backward of all of them (``no_sync()``: a context manager that holds back the gradient all-reduce)
            and returns the window's loss (0-dim, on the device); ``inputs``/``targets``/``loss`` are the
            task's own business.
        check_step_samples(samples) -> str | None: raise ValueError when an optimizer step of ``samples`` (all
            processes and micro-batches) cannot train the task, or return a note to print; called before the
            model is built.
        epoch_figures(accelerator) -> dict: the task's own figures of the epoch's training, over all processes
            (a collective call at each epoch's end); raises ValueError when the epoch shows the run cannot learn.
    """

    num_outputs: int
    tracked: tuple[str, ...]

    def inputs(self, batch: dict) -> Any:
        """What the model's forward takes from a loader batch."""

    def targets(self, batch: dict) -> torch.Tensor:
        """What the loss compares the model's output with."""

    def loss(self, output: Any, targets: torch.Tensor) -> torch.Tensor:
        """The training loss of one micro-batch: a scalar, the mean over the samples that count."""

    def evaluate(self, accelerator, model, loader) -> dict:
        """Figures over the whole split, all processes together (keys start with "val_")."""

    def improves(self, metrics: dict, state: dict) -> bool:
        """Whether this epoch's ``metrics`` beat the best evaluation recorded in the trainer ``state``."""

    def best_figures(self, metrics: dict) -> dict:
        """The trainer-state entries that record ``metrics`` as the best (``{}``: the state before any)."""

    def epoch_line(self, metrics: dict) -> str:
        """The evaluation's part of the epoch's log line ("" without an evaluation)."""

    def summary(self, last: dict, state: dict) -> dict:
        """summary.json's figures of the task: the ``last`` evaluation's and the best one's."""


def register_task(name: str) -> Callable[[type], type]:
    """Class decorator: register a task under ``name`` (what ``--task`` picks).

    Args:
        name: the name ``--task`` and ``build_task`` use.

    Returns:
        The decorator, which returns the class unchanged.

    Raises:
        ValueError: the name is taken by another class.
    """

    return TASKS.register(name)
