"""Where a loader's batches go and in what dtype: the ``device``/``dtype``/``fp16`` arguments resolved and
checked once."""

from __future__ import annotations

import torch

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The device batches go to: the given one checked, else the current CUDA device, else the CPU."""
    if device is None:
        return (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        )
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but CUDA is not available; pass device='cpu'")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device '{device}'; use 'cpu' or 'cuda[:N]'")
    return device


def resolve_dtype(dtype: torch.dtype | str | None, fp16: bool | None, default: torch.dtype) -> torch.dtype:
    """The batches' dtype from ``dtype`` (a torch dtype or its name) or the older ``fp16`` flag."""
    if dtype is not None and fp16 is not None:
        raise ValueError("pass dtype= or fp16=, not both")
    if dtype is None:
        return default if fp16 is None else (torch.float16 if fp16 else torch.float32)
    resolved = _DTYPES.get(dtype) if isinstance(dtype, str) else dtype
    if resolved not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"dtype must be torch.float32, torch.float16 or torch.bfloat16, got {dtype!r}")
    return resolved
