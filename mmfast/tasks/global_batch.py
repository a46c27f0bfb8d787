"""The global batch of a contrastive loss: features of every process gathered with their gradient
(``gather_features``), and a whole accumulation window trained as one batch by caching its features
(``cached_window_backward``, GradCache: Gao et al. 2021). Plain torch.distributed (gloo or NCCL); one process
without a process group gathers nothing. ``StepNormStatistics``: a step's batch-norm statistics, the same
whatever its micro-batches' layout on processes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.nn.modules.batchnorm import _NormBase

FEATURES = ("image", "text")  # the (B, D) outputs cached and split by sample
SCALARS = ("logit_scale", "logit_bias")  # the 0-dim outputs cached once per window


def world() -> tuple[int, int]:
    """(processes, this one's rank) of the default process group; (1, 0) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def gather_sizes(n: int, device: torch.device) -> list[int]:
    """Every process's row count ``n``, in rank order (a collective call; a sync point)."""
    processes, _ = world()
    if processes == 1:
        return [n]
    mine = torch.tensor([n], dtype=torch.int64, device=device)
    parts = [torch.zeros_like(mine) for _ in range(processes)]
    dist.all_gather(parts, mine)
    return [int(p) for p in parts]


def all_gather_rows(x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Every process's ``x`` (``sizes[r]`` rows on rank r) concatenated in rank order, without gradient.
    Rows are padded to the largest count for the collective (all_gather takes equal shapes) and cut after."""
    if len(sizes) == 1:
        return x
    padded = torch.cat([x, x.new_zeros((max(sizes) - x.shape[0], *x.shape[1:]))]).contiguous()
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded)
    return torch.cat([p[:n] for p, n in zip(parts, sizes, strict=True)])


def norm_statistics(model: torch.nn.Module) -> list[torch.Tensor]:
    """The running statistics of ``model``'s normalization layers that keep them (batch norm's running mean,
    running variance and batch count; instance norm's with ``track_running_stats``)."""
    found = []
    for m in model.modules():
        if isinstance(m, _NormBase) and m.track_running_stats:
            found += [b for b in (m.running_mean, m.running_var, m.num_batches_tracked) if b is not None]
    return found


class StepNormStatistics:
    """An optimizer step's normalization statistics: one update, the mean of its micro-batches' updates over
    all processes.

    Each micro-batch updates the running statistics from those the step began with (``micro_batch_done`` puts
    them back after its backward); ``finish`` moves them by the mean of the updates, over the processes too.
    Batch norm's update is linear in the batch statistics: the result is one momentum update with their mean,
    the batch count grows by one a step, and every process holds the same statistics. So a step's statistics
    do not depend on whether its micro-batches ran on one process or several.

    Args:
        model: the model whose ``norm_statistics`` are kept (none: every call does nothing).
        processes: the processes of the default process group that take part in ``finish``.
    """

    def __init__(self, model: torch.nn.Module, processes: int = 1):
        self.stats = norm_statistics(model)
        self.processes = processes
        self._start: list[torch.Tensor] = []
        self._sums: list[torch.Tensor] = []
        self._count = 0

    def start(self) -> None:
        """Take the statistics the step begins with (before its first forward)."""
        self._start = [b.detach().clone() for b in self.stats]
        self._sums = [torch.zeros_like(b, dtype=torch.float64) for b in self.stats]
        self._count = 0

    def micro_batch_done(self) -> None:
        """Keep a micro-batch's update and put the step's first statistics back (after its backward: the graph
        may hold the statistics)."""
        for b, first, total in zip(self.stats, self._start, self._sums, strict=True):
            total += b.double() - first.double()
            b.copy_(first)
        self._count += 1

    def finish(self) -> None:
        """Apply the mean update: of the micro-batches done (or what the statistics moved by since ``start``,
        without any), over the processes."""
        if not self.stats or not self._start:
            return
        if self._count:
            updates = [total / self._count for total in self._sums]
        else:
            updates = [b.double() - first.double() for b, first in zip(self.stats, self._start, strict=True)]
        if self.processes > 1:
            flat = torch.cat([u.flatten() for u in updates])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            updates = list((flat / self.processes).split([u.numel() for u in updates]))
        for b, first, u in zip(self.stats, self._start, updates, strict=True):
            new = first.double() + u.view_as(first)
            b.copy_(new if b.is_floating_point() else new.round())
        self._start, self._sums = [], []


class _GatherWithGrad(torch.autograd.Function):
    """all_gather forward; backward: the gradient of the whole gathered tensor summed over the processes
    (all_reduce: gloo has no reduce_scatter), this process's rows of it returned."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        ctx.sizes = sizes
        return all_gather_rows(x, sizes)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()  # all_reduce works in place; autograd may share the incoming tensor
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        rank = dist.get_rank()
        start = sum(ctx.sizes[:rank])
        return grad[start : start + ctx.sizes[rank]], None


def gather_features(x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Every process's features (N, D) in rank order, differentiable: each process's loss over them sends its
    gradient back to the process whose rows they are. With every loss the process's own rows against all
    columns and DDP's mean of the gradients, training equals one process on the concatenated batch."""
    return x if len(sizes) == 1 else _GatherWithGrad.apply(x, sizes)


def _rng_state(device: torch.device) -> tuple:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple, device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def cached_window_backward(
    accelerator,
    model: torch.nn.Module,
    inputs: list,
    loss_fn: Callable[[dict], torch.Tensor],
    no_sync: Callable[[], contextlib.AbstractContextManager],
) -> torch.Tensor:
    """Gradients of ``loss_fn`` over a whole window of micro-batches, as if they were one batch, in the memory of
    one micro-batch's activations.

    1. Each micro-batch is run without gradient (its RNG state saved first) for its features.
    2. The features, concatenated, become leaf tensors; ``loss_fn`` over them (every micro-batch's samples the
       others' negatives) is differentiated to the features only.
    3. Each micro-batch runs again with gradient from its saved RNG state (the same dropout), and backward takes
       its slice of the feature gradients (``sum(out * grad)``: exactly those gradients, through
       ``accelerator.backward`` so a GradScaler scales them). The 0-dim outputs' gradients go to the last
       micro-batch, the one whose backward all-reduces (the others run under ``no_sync``).

    Buffers (batch-norm statistics) are put back after step 1, so each micro-batch updates them once; the
    normalization statistics move once, by the mean of the micro-batches' updates (``StepNormStatistics``).

    Args:
        accelerator: an ``accelerate.Accelerator`` (``device``, ``backward``).
        model: returns {"image", "text": (B, D), "logit_scale", "logit_bias": 0-dim} for each of ``inputs``.
        inputs: what the model takes, one per micro-batch.
        loss_fn: the loss of the window's concatenated output dict.
        no_sync: a context manager factory that holds back the gradient all-reduce.

    Returns:
        The window's loss (0-dim, on the device: not read back).
    """
    device = accelerator.device
    saved = [b.detach().clone() for b in model.buffers()]
    states, outs = [], []
    with torch.no_grad():
        for x in inputs:
            states.append(_rng_state(device))
            outs.append(model(x))
        for b, s in zip(model.buffers(), saved, strict=True):
            b.copy_(s)
    cached = {k: torch.cat([o[k] for o in outs]).detach().requires_grad_() for k in FEATURES}
    cached |= {k: outs[0][k].detach().float().requires_grad_() for k in SCALARS}
    sizes = [o["image"].shape[0] for o in outs]  # a micro-batch may be shorter (the last of a split)
    del outs
    loss = loss_fn(cached)
    loss.backward()  # to the cached leaves only: no parameter takes part here
    grads = {k: cached[k].grad.split(sizes) if cached[k].grad is not None else None for k in FEATURES}
    last = len(inputs) - 1
    norms = StepNormStatistics(model)
    norms.start()
    for k, x in enumerate(inputs):
        with no_sync() if k < last else contextlib.nullcontext():
            _set_rng_state(states[k], device)
            out = model(x)
            accelerator.backward(_surrogate(out, grads, k, cached if k == last else None))
        norms.micro_batch_done()
    norms.finish()
    return loss.detach()


def _surrogate(out: dict, grads: dict, k: int, scalars: dict | None) -> torch.Tensor:
    """A scalar whose gradient with respect to micro-batch ``k``'s outputs is their cached gradient."""
    total = out["image"].new_zeros(())
    for name in FEATURES:
        if grads[name] is not None:
            total = total + (out[name].float() * grads[name][k]).sum()
    for name in SCALARS if scalars is not None else ():
        if scalars[name].grad is not None and out[name].requires_grad:
            total = total + out[name].float() * scalars[name].grad
    return total
