"""Per-source figures of a run on a mix (``mmfast.prepare.mix``): how many samples of each source an epoch
trained, and their mean train loss where the task gives each sample's (``sample_losses``). metrics.jsonl
carries them as ``"sources": {name: {"samples", "train_loss"}}``.

The sums stay on the training device (no host sync per step); they are summed over the processes once an
epoch, and into a checkpoint's epoch figures, so a resume (on any process count) goes on counting.
"""

from __future__ import annotations

import torch

_SAMPLES, _LOSS_SUM, _LOSS_SAMPLES = range(3)


class SourceTally:
    """The running sums of one epoch: for each source, samples, loss sum and the samples with a loss."""

    def __init__(self, names: list[str], device: torch.device):
        self.names, self.device = list(names), device
        dtype = torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64
        self.sums = torch.zeros(len(self.names), 3, dtype=dtype, device=device)

    def start(self, saved: list[list[float]] | None) -> None:
        """Begin an epoch from a checkpoint's sums (every process's: pass them on one process only) or 0."""
        self.sums.zero_()
        if saved:
            self.sums += torch.tensor(saved, dtype=self.sums.dtype, device=self.device)

    def add(self, source: torch.Tensor, losses: torch.Tensor | None) -> None:
        """A micro-batch: each sample's source (-1: masked, not counted) and its loss (None: the task gives
        none; a non-finite one is not averaged in)."""
        valid = source >= 0
        where = source.clamp(min=0).long()
        n = len(self.names)
        self.sums[:, _SAMPLES] += torch.bincount(where, weights=valid.to(self.sums.dtype), minlength=n)
        if losses is None:
            return
        losses = losses.detach().to(self.sums.dtype)
        finite = valid & torch.isfinite(losses)
        self.sums[:, _LOSS_SUM] += torch.bincount(where, weights=torch.where(finite, losses, 0), minlength=n)
        self.sums[:, _LOSS_SAMPLES] += torch.bincount(where, weights=finite.to(self.sums.dtype), minlength=n)

    def global_sums(self, accelerator) -> list[list[float]]:
        """The sums over every process (a collective: every process calls it)."""
        return accelerator.reduce(self.sums.clone(), reduction="sum").tolist()

    def figures(self, sums: list[list[float]]) -> dict:
        """metrics.jsonl's "sources" entry from ``global_sums``."""
        out = {}
        for name, row in zip(self.names, sums, strict=True):
            loss = row[_LOSS_SUM] / row[_LOSS_SAMPLES] if row[_LOSS_SAMPLES] else None
            out[name] = {"samples": int(round(row[_SAMPLES])), "train_loss": loss}
        return out
