"""The optimizer and its schedule: AdamW over parameter groups (pretrained encoders apart from new layers, no
weight decay on 1-d parameters), and a transformers schedule counted in optimizer steps. Mixed precision's
gradient scaler is Accelerate's (``accelerator.prepare``). Both builders take the run's ``OptimConfig``
(``train/slices.py``); a whole ``TrainConfig`` stands for it too."""

from __future__ import annotations

import math

import torch

from mmfast.train.hardware import optimizer_kwargs
from mmfast.train.slices import OptimConfig


def param_groups(
    model: torch.nn.Module, weight_decay: float, lr: float, encoder_lr: float | None = None
) -> list[dict]:
    """Optimizer groups: pretrained encoders at ``encoder_lr``, everything else (heads, fusion layers, encoders
    trained from scratch) at ``lr``; no weight decay on biases and norm weights (1-d parameters). Empty groups
    (a frozen encoder) are left out."""
    pretrained = {
        id(p)
        for enc in (getattr(model, "image", None), getattr(model, "text", None))
        if enc is not None and getattr(enc, "pretrained", False)
        for p in enc.parameters()
    }
    groups: dict[tuple[bool, bool], list] = {}
    for p in model.parameters():
        if p.requires_grad:
            groups.setdefault((id(p) in pretrained, p.ndim > 1), []).append(p)
    return [
        {
            "params": params,
            "lr": (encoder_lr if encoder_lr is not None else lr) if is_pre else lr,
            "weight_decay": weight_decay if decays else 0.0,
            "pretrained": is_pre,
        }
        for (is_pre, decays), params in sorted(groups.items())
    ]


def make_scheduler(optimizer, name: str, warmup: int, total: int, probe: int = 0):
    """A transformers schedule (``get_scheduler``: linear warmup, then cosine/linear/... decay) per optimizer
    step; parameter groups marked ``"pretrained"`` stay at lr 0 for the first ``probe`` steps (a linear-probe
    warm start: the new layers learn on fixed features before the encoders move)."""
    from transformers import get_scheduler  # transformers: a slow import, only when a run starts

    try:
        scheduler = get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=total)
    except ValueError as e:
        raise ValueError(f"--scheduler {name}: {e}") from None
    if probe > 0:
        for i, group in enumerate(optimizer.param_groups):
            if group.get("pretrained"):
                base = scheduler.lr_lambdas[i]
                scheduler.lr_lambdas[i] = lambda step, base=base: 0.0 if step < probe else base(step)
        # The constructor already applied step 0's factors, before the probe existed: apply them again.
        for group, factor, base in zip(
            optimizer.param_groups, scheduler.lr_lambdas, scheduler.base_lrs, strict=True
        ):
            group["lr"] = base * factor(scheduler.last_epoch)
        scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
    return scheduler


def total_steps(cfg: OptimConfig, micro_batches_per_epoch: int) -> int:
    """The optimizer steps of the run: micro-batches / accumulation, per process (each process takes the same
    number of steps, never multiplied by the process count), capped by --max-steps."""
    steps = math.ceil(micro_batches_per_epoch / cfg.grad_accum) * cfg.epochs
    return min(steps, cfg.max_steps) if cfg.max_steps else steps


def build_optimizer(cfg: OptimConfig, model: torch.nn.Module, steps: int, device_type: str = "cpu"):
    """AdamW over ``param_groups`` (its kernels by --optimizer-impl for ``device_type``: ``hardware``) and its
    schedule over ``steps`` optimizer steps (--warmup-frac, --probe-frac of them).

    Returns:
        (optimizer, scheduler).
    """
    groups = param_groups(model, cfg.weight_decay, cfg.lr, cfg.encoder_lr)
    optimizer = torch.optim.AdamW(groups, lr=cfg.lr, **optimizer_kwargs(cfg.optimizer_impl, device_type))
    scheduler = make_scheduler(
        optimizer, cfg.scheduler, int(steps * cfg.warmup_frac), steps, int(steps * cfg.probe_frac)
    )
    return optimizer, scheduler


def skips_on_device(optimizer, accelerator) -> bool:
    """Whether ``optimizer`` (or the one Accelerate's wrapper holds) can skip a step on the device: a fused
    AdamW, which takes a GradScaler's ``found_inf``, in a run without a GradScaler of its own."""
    inner = getattr(optimizer, "optimizer", optimizer)
    return accelerator.scaler is None and bool(getattr(inner, "_step_supports_amp_scaling", False))


def step_unless_non_finite(optimizer, norm: torch.Tensor) -> torch.Tensor:
    """``optimizer.step()``, which the fused kernel itself skips (the parameters, their moments, the weight
    decay and the step count all left as they were) when the gradient norm ``norm`` is not finite; nothing is
    read back to the host. Returns 1.0 (skipped) or 0.0 on the device."""
    bad = (~torch.isfinite(norm)).to(torch.float32)
    inner = getattr(optimizer, "optimizer", optimizer)
    inner.found_inf = bad  # what the fused kernel reads, as from a GradScaler (and the step count it puts back)
    try:
        optimizer.step()
    finally:
        del inner.found_inf
    return bad


def scaled_step_skipped(optimizer, scaler) -> torch.Tensor:
    """``optimizer.step()`` under Accelerate's GradScaler, and whether the scaler skipped it (1.0 or 0.0, on the
    device): it lowers its scale exactly when it found inf/NaN gradients. Accelerate's ``step_was_skipped``
    cannot tell for a fused AdamW (CUDA's default): the scaler hands that one ``found_inf`` and calls its step
    anyway, so it always says False."""
    before = scaler._scale.clone() if scaler._scale is not None else None  # set by the first scale()
    optimizer.step()
    if before is None:
        return torch.zeros((), device=scaler._scale.device if scaler._scale is not None else "cpu")
    return (scaler._scale < before).to(torch.float32)
