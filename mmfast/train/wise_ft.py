"""--wise-ft ALPHA: the weights a run ends with are ALPHA of the trained ones plus 1 - ALPHA of those it started
from, tensor by tensor (WiSE-FT: Wortsman et al. 2022, "Robust fine-tuning of zero-shot models").

A dual encoder started from the ridge map (``--init-proj ridge``) with a pretrained text tower starts as a model
that keeps the text tower's zero-shot prompts; training finds the captions better. A point between the two in
weight space often keeps some of both. The mixed model is an ordinary one: the same tensors, the same export.

The start is copied once, after the warm start and before the first step: the tensors that train (a locked
tower's are the same at both ends) and the floating-point buffers. Each checkpoint carries the copy (registered
with Accelerate), so a resumed run mixes with its first start, not with the checkpoint's weights. The mix happens
once, when the last step has trained: the last evaluation, the last checkpoint and ``RUN/model-last`` see the
mixed weights. The trainer state records it, so a run resumed at its end is not mixed twice, and one resumed
past it trains on from the mix.
"""

from __future__ import annotations

import torch


class StartWeights:
    """A copy (on the CPU) of ``model``'s trainable tensors and floating-point buffers as they are now, and the
    share ``alpha`` the trained ones keep when ``mix`` is called. ``model`` is the module itself, not a compiled or
    distributed wrapper: the wrappers share its tensors, so mixing it mixes theirs."""

    def __init__(self, model: torch.nn.Module, alpha: float):
        self.model, self.alpha = model, alpha
        trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        # and the floating-point buffers (batch norm's statistics), as WiSE-FT mixes the whole state
        stats = [(n, b) for n, b in model.named_buffers() if b.is_floating_point()]
        self.tensors = {n: t.detach().to("cpu", copy=True) for n, t in (*trained, *stats)}

    def state_dict(self) -> dict:
        """What a checkpoint keeps (Accelerate's ``register_for_checkpointing``)."""
        return {"alpha": self.alpha, "tensors": self.tensors}

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint's copy of the start, in place of this run's weights as they stood before loading it.

        Raises:
            ValueError: the copy names other tensors than this model's (another model's checkpoint).
        """
        names, ours = set(state["tensors"]), set(self.tensors)
        if names != ours:
            odd = sorted(names ^ ours)[:3]
            raise ValueError(f"--wise-ft: the checkpoint's start names other tensors than this model's: {odd}")
        self.tensors = state["tensors"]

    @torch.no_grad()
    def mix(self) -> None:
        """Every tensor copied becomes ``alpha`` x itself + (1 - ``alpha``) x its start."""
        for name, t in (*self.model.named_parameters(), *self.model.named_buffers()):
            if name in self.tensors:
                t.mul_(self.alpha).add_(self.tensors[name].to(t.device, t.dtype), alpha=1 - self.alpha)


def start_weights(model: torch.nn.Module, alpha: float | None) -> StartWeights | None:
    """The start to mix with at the end, or None when ``alpha`` is 1 (the trained weights alone) or unset."""
    return None if alpha is None or alpha >= 1 else StartWeights(model, alpha)
