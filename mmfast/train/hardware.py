"""The settings that fit the hardware a run is on, each chosen by ``auto`` and overridable by its flag (#31):

- precision (``--mixed-precision auto``): bf16 autocast on a GPU that computes in bf16 (compute capability 8.0
  on: A100, H100, H200, L4, RTX 30xx on), which needs no gradient scaler; fp16 + GradScaler on older GPUs; on
  the CPU bf16 where the cores have it natively (AMX / AVX512-BF16), else float32;
- memory format (``--channels-last``, unset): NHWC for a convolutional image tower on CUDA (tensor cores
  convolve NHWC; 1.6x for the write-up's ResNet-50 on an H200, docs/benchmarks/), NCHW on the CPU;
- the optimizer's kernels (``--optimizer-impl auto``): AdamW's fused kernel on CUDA (one kernel for every
  parameter), its foreach kernels elsewhere;
- the caption width (``--text-padding auto``): each batch's longest caption, or for a compiled step the next
  power of two (a few static shapes: each is compiled, and under ``--compile-mode reduce-overhead`` recorded as a
  CUDA graph, once; the image batch is static already: train batches are whole, the last eval batch is padded).

``summary.json`` records what was chosen (``hardware_choices``). The compiled step's functions take the run's
``CompileConfig`` (``train/slices.py``), or the slice of a reader that needs one of their answers (the loop's
``LoopConfig``, the profile's ``ReportConfig``); a whole ``TrainConfig`` stands for any of them too.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from mmfast.train.config import OPTIMIZER_IMPLS

if TYPE_CHECKING:  # the slices import this module (resolve_text_padding)
    from mmfast.train.slices import CompileConfig, LoaderConfig, LoopConfig, ReportConfig

CONV_BACKBONES = ("resnet", "efficientnet")  # image towers that are CNNs (timm:<name>: only when asked)


def cpu_has_fast_bf16() -> bool:
    """The CPU computes bf16 natively (AMX or AVX512-BF16), so bf16 autocast pays."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def cuda_has_bf16() -> bool:
    """The current CUDA device computes bf16 natively (compute capability 8.0 or newer)."""
    return torch.cuda.get_device_capability() >= (8, 0)


def resolve_mixed_precision(requested: str, cuda: bool) -> str | None:
    """``auto``: fp16/bf16 if ``accelerate launch --mixed_precision`` set it, else bf16 on a CUDA device that
    has it and fp16 on one that has not, bf16 on CPUs with native bf16, else no. (``accelerate launch``
    exports "no" even when the user gave no flag, so "no" from the launcher is not taken as a choice: pass
    --mixed-precision no for fp32.)"""
    if requested == "auto":
        launcher = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
        if launcher in ("fp16", "bf16"):
            if launcher == "fp16" and not cuda:
                raise ValueError("accelerate launch --mixed_precision fp16 needs a CUDA GPU; use bf16 or no")
            return launcher
        if cuda:
            return "bf16" if cuda_has_bf16() else "fp16"
        return "bf16" if cpu_has_fast_bf16() else "no"
    if requested == "fp16" and not cuda:
        raise ValueError("--mixed-precision fp16 needs a CUDA GPU; on the CPU use bf16 or no")
    return requested


def launcher_precision_note(requested: str, used: str) -> str | None:
    """The line a run started by ``accelerate launch`` prints when the launcher named another precision than
    ``used``, the one the run trains with (``requested``: --mixed-precision); None when they agree or no
    launcher named one. Without a config file or --mixed_precision, the launcher warns that it set "no": the
    note says that this run does not train so, and why."""
    launcher = os.environ.get("ACCELERATE_MIXED_PRECISION")
    if launcher is None or launcher == used:
        return None
    if launcher == "no" and requested == "auto":
        return (
            f"mixed precision: this run trains in {used} (--mixed-precision auto on this machine). accelerate "
            "launch's --mixed_precision 'no' is its default, not taken for a choice: pass --mixed-precision no "
            "for float32"
        )
    return (
        f"mixed precision: this run trains in {used} (--mixed-precision {requested}), not in accelerate launch's "
        f"{launcher}"
    )


def resolve_channels_last(
    requested: bool | None, device_type: str, image_backbone: str | None, model: str
) -> bool:
    """``requested`` when given; otherwise NHWC exactly when the run is on CUDA and its image tower is a CNN."""
    if requested is not None:
        return requested
    conv = image_backbone is not None and image_backbone.startswith(CONV_BACKBONES)
    return device_type == "cuda" and conv and model != "text"


def optimizer_kwargs(requested: str, device_type: str) -> dict:
    """AdamW's keyword arguments for ``--optimizer-impl``: fused on CUDA under ``auto``, else foreach."""
    if requested not in OPTIMIZER_IMPLS:
        raise ValueError(f"--optimizer-impl must be one of {', '.join(OPTIMIZER_IMPLS)}, got '{requested}'")
    impl = ("fused" if device_type == "cuda" else "foreach") if requested == "auto" else requested
    return {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}[impl]


def compiles(cfg: CompileConfig | ReportConfig) -> bool:
    """Whether the run's model is compiled: ``--compile``, or a ``--compile-mode`` other than default."""
    return cfg.compile or cfg.compile_mode != "default"


def compile_options(cfg: CompileConfig | ReportConfig) -> dict | None:
    """``torch.compile``'s keyword arguments for this run, None when it is not compiled (``compiles``).
    Static shapes (``dynamic=False``) when the captions are padded to a few widths: one specialized graph
    per width, which CUDA graphs need."""
    if not compiles(cfg):
        return None
    return {"mode": cfg.compile_mode, "dynamic": False if resolve_text_padding(cfg) != "longest" else None}


def resolve_text_padding(cfg: CompileConfig | LoaderConfig | ReportConfig) -> str:
    """``--text-padding``; ``auto``: buckets for a compiled step, else each batch's longest caption. A
    ``LoaderConfig`` holds it settled (``slices.cut``)."""
    if cfg.text_padding != "auto":
        return cfg.text_padding
    return "buckets" if compiles(cfg) else "longest"


def check_compile_fits(cfg: CompileConfig, task) -> None:
    """Refuse CUDA graphs where a step holds a graph's outputs across its next calls: a task that takes each
    window at once (the contrastive feature cache embeds every micro-batch before the first backward), whose
    features a replay would overwrite."""
    if cfg.compile_mode == "reduce-overhead" and cfg.grad_accum > 1 and getattr(task, "whole_window", False):
        raise ValueError(
            f"--compile-mode reduce-overhead (CUDA graphs) with --grad-accum {cfg.grad_accum}: the {cfg.task} "
            "objective embeds a window's micro-batches before their backward, and a graph's replay overwrites "
            "the outputs it holds; use --compile-mode default or max-autotune-no-cudagraphs, or --grad-accum 1"
        )


def compile_note(cfg: CompileConfig, device_type: str) -> str | None:
    """What the run says when --compile-mode asks for CUDA graphs on a device without them, else None."""
    if cfg.compile_mode != "reduce-overhead" or uses_cuda_graphs(cfg, device_type):
        return None
    return (
        f"--compile-mode reduce-overhead records CUDA graphs on a CUDA GPU only; on the {device_type} it compiles"
    )


def uses_cuda_graphs(cfg: CompileConfig | LoopConfig, device_type: str) -> bool:
    """Whether the compiled step replays CUDA graphs (``reduce-overhead`` on a CUDA device)."""
    return cfg.compile_mode == "reduce-overhead" and device_type == "cuda"  # the mode implies compiling


def choices_made(cfg: CompileConfig, accelerator, optimizer) -> dict:
    """What summary.json records of the hardware choices: precision, memory format, optimizer kernels, the
    compiled step and the caption width."""
    defaults = getattr(optimizer, "optimizer", optimizer).defaults  # Accelerate's wrapper holds the AdamW
    impl = "fused" if defaults.get("fused") else ("foreach" if defaults.get("foreach") else "for-loop")
    return {
        "mixed_precision": accelerator.mixed_precision,
        "grad_scaler": accelerator.scaler is not None,
        "channels_last": cfg.channels_last,
        "optimizer_impl": impl,
        "compile_mode": (compile_options(cfg) or {}).get("mode"),
        "cuda_graphs": uses_cuda_graphs(cfg, accelerator.device.type),
        "text_padding": resolve_text_padding(cfg),
        "cuda_bf16": torch.cuda.is_available() and cuda_has_bf16(),
        "cpu_fast_bf16": cpu_has_fast_bf16(),
    }
