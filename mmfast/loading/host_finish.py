"""The end of the CPU image path, on the host: antialiased resize, flip and normalize of DALI's output.

Why not in the DALI graph: on the CPU, DALI's antialiased resize costs about as much as the ROI decode
itself and its crop_mirror_normalize half as much again, while torch's uint8 antialiased bilinear (or bicubic)
kernel (the one torchvision uses, close to PIL's) and a per-channel normalize pass do the same work several
times faster (figures in docs/benchmarks/). So when decoding on the CPU the train graph stops after the fused
decode + random crop (``image_pipeline(finish_on_host=True)``) and ``HostFinisher`` completes the batch:
each image is resized, flipped and normalized while it is still in the core's cache, by the consuming
thread and ``threads - 1`` helper threads (torch's kernels release the GIL), each with one intra-op thread.
The DALI threads decode the next batches meanwhile. The eval graph hands over whole decoded images,
resized here (shorter side) and centre-cropped with the graph's rounding. The GPU path keeps everything in
the graph.

The output batches come from ``BatchBuffers``: a batch's memory is reused once nothing refers to it any
more: a fresh batch's page faults would cost about as much as finishing it (docs/benchmarks/).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import torch.nn.functional as F

from mmfast.data.preprocessing import IMAGENET_MEAN, IMAGENET_STD
from mmfast.loading.options import CPU_RESIZE

OUTPUTS = ["crops", "flips", "id"]  # what image_pipeline(finish_on_host=True) returns, in order
# The out= form of F.interpolate(mode=..., antialias=True) for each interpolation: the aten op it dispatches to
# (None where a torch lacks it: then F.interpolate itself).
_RESIZE_OUT = {
    mode: getattr(getattr(torch.ops.aten, f"_upsample_{mode}2d_aa", None), "out", None)
    for mode in ("bilinear", "bicubic")
}


def ragged_iterator(pipe, **kwargs):
    """DALI's iterator for a ``finish_on_host`` graph: the crops as a list of tensors (they differ in
    size), flips and ids as dense tensors. ``kwargs`` go to ``DALIRaggedIterator``."""
    from nvidia.dali.plugin.pytorch import DALIRaggedIterator  # DALI: only when a DALI graph runs here

    types = [DALIRaggedIterator.SPARSE_LIST_TAG, DALIRaggedIterator.DENSE_TAG, DALIRaggedIterator.DENSE_TAG]
    return DALIRaggedIterator(pipe, OUTPUTS, output_types=types, **kwargs)


# The finishing's share of the CPU path's work per image at 224 px, as tools/benchmarks/bench_stages.py
# measures it on photos, the common case (docs/benchmarks/notes/2026-11-30-cpu-decode-limit.md).
FINISH_SHARE = 0.3


def default_threads(decode_threads: int) -> int:
    """Finishing threads for a loader whose DALI graph decodes on ``decode_threads`` threads (the cores):
    1 up to 4 cores, 2 at 8, 5 at 16, 19 at 64. The DALI threads block when their queue is full, so the
    two groups share the cores without either starving."""
    return max(1, round(decode_threads * FINISH_SHARE))


class _Lease(np.ndarray):
    """A view of a pooled block lent to one output tensor; it lives exactly as long as that tensor's
    storage does (the storage holds the view's buffer), and its death frees the block."""


class BatchBuffers:
    """Memory for output batches, reused once the batch handed out before is gone.

    ``take`` returns a tensor over a kept block whose previous tensor has died (every view of it, every
    numpy array made from it): the tensor holds a buffer export of a ``_Lease`` view of the block, whose
    weak reference tells when the last holder let go. No reference counting by hand: a batch that anybody
    still holds, in any form, is never written.

    Args:
        keep: blocks kept per (shape, dtype); when all are lent, a fresh one is made and not kept.
    """

    def __init__(self, keep: int = 4):
        self.keep = keep
        self._blocks: dict[tuple, list[list]] = {}  # (shape, dtype) -> [[block, weakref to its lease]]

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized tensor of ``shape`` and ``dtype`` (contiguous)."""
        blocks = self._blocks.setdefault((tuple(shape), dtype), [])
        entry = next((e for e in blocks if e[1]() is None), None)
        if entry is None:
            nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
            entry = [np.empty(nbytes, dtype=np.uint8), lambda: None]
            if len(blocks) < self.keep:
                blocks.append(entry)
        lease = entry[0].view(_Lease)
        entry[1] = weakref.ref(lease)
        return torch.frombuffer(lease, dtype=dtype).view(shape)


class HostFinisher:
    """Turns a batch of uint8 HWC images into normalized (B, 3, S, S) images.

    Args:
        size: output side S in pixels.
        mean, std: per-channel statistics in 0..255 units (as given to the DALI graph).
        fp16: float16 output (else float32); ``dtype`` may be set to any float type afterwards.
        resize_shorter: None (train: each input is a crop, resized to S x S) or R >= S (eval: resize the
            shorter side to R, keeping the aspect ratio, then take the centre S x S).
        threads: threads finishing each batch, the calling one included.
        interpolation: "bilinear" or "bicubic", antialiased (torch's uint8 kernels, close to PIL's).
    """

    def __init__(
        self,
        size: int,
        mean: Sequence[float],
        std: Sequence[float],
        fp16: bool = True,
        resize_shorter: int | None = None,
        threads: int = 1,
        interpolation: str = "bilinear",
    ):
        if resize_shorter is not None and resize_shorter < size:
            raise ValueError(f"resize_shorter ({resize_shorter}) must be >= size ({size}); is crop_ratio > 1?")
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        if interpolation not in _RESIZE_OUT:
            raise ValueError(f"interpolation must be 'bilinear' or 'bicubic', got {interpolation!r}")
        self.size, self.resize_shorter, self.threads = size, resize_shorter, threads
        self.interpolation = interpolation
        self._scale = torch.tensor([1.0 / s for s in std]).view(3, 1, 1)
        self._shift = torch.tensor([-m / s for m, s in zip(mean, std, strict=True)]).view(3, 1, 1)
        self.dtype = torch.float16 if fp16 else torch.float32
        self.buffers = BatchBuffers()
        self._pool: ThreadPoolExecutor | None = None
        self._local = threading.local()

    def __call__(self, crops: Sequence[torch.Tensor], flips: np.ndarray) -> torch.Tensor:
        """crops: B tensors (h, w, 3) uint8 (train crops or, for eval, whole images); flips: (B,) nonzero =
        mirror horizontally.

        Returns (B, 3, S, S) contiguous, ``self.dtype``."""
        n, s = len(crops), self.size
        out = self.buffers.take((n, 3, s, s), self.dtype)
        parts = min(self.threads, n)
        bounds = [n * k // parts for k in range(parts + 1)]
        if parts > 1 and self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="mmfast-finish")
        helped = [
            self._pool.submit(self._finish, crops, flips, out, bounds[k], bounds[k + 1]) for k in range(1, parts)
        ]
        if n:
            self._finish(crops, flips, out, bounds[0], bounds[1])
        for job in helped:
            job.result()
        return out

    def finish(self, out: dict) -> torch.Tensor:
        """The finished images of one ``ragged_iterator`` output dict: (B, 3, S, S)."""
        return self(out["crops"], out["flips"].view(-1).numpy())

    def _finish(self, crops, flips, out: torch.Tensor, start: int, stop: int) -> None:
        """Images start..stop-1 into ``out``, one at a time (each stays in the cache from resize to
        normalize), through this thread's scratch buffers (no allocation per image: on the VM a fresh
        150 KB buffer costs its page faults, ~100 us, as much as the normalize), with one intra-op thread;
        the caller's own setting is restored after."""
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            scratch = self._scratch()
            for i in range(start, stop):
                x = self._resized(crops[i].permute(2, 0, 1).unsqueeze(0), scratch.resized)[0]  # (3, S, S) HWC
                hwc = x.permute(1, 2, 0).numpy()
                # to planar uint8, mirrored on the way: numpy's strided copy takes half the time of torch's
                np.copyto(scratch.planar_np, (hwc[:, ::-1] if flips[i] else hwc).transpose(2, 0, 1))
                target = out[i]
                dst = target if self.dtype == torch.float32 else scratch.work  # float32, then one rounding
                dst.copy_(scratch.planar).mul_(self._scale).add_(self._shift)
                if dst is not target:
                    target.copy_(dst)
        finally:
            torch.set_num_threads(threads)

    def _scratch(self) -> threading.local:
        """This thread's buffers: the resized image ((3, S, S) uint8, HWC strides as the resize writes it),
        the same planar (and its numpy view) and the float32 work image."""
        local = self._local
        if not hasattr(local, "work"):
            s = self.size
            local.resized = torch.empty((1, s, s, 3), dtype=torch.uint8).permute(0, 3, 1, 2)
            local.planar = torch.empty((3, s, s), dtype=torch.uint8)
            local.planar_np = local.planar.numpy()
            local.work = torch.empty((3, s, s))
        return local

    def _resized(self, x: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
        """``_resize(x)``, written into ``buffer`` ((1, 3, S, S)) for a train crop."""
        s, resize_out = self.size, _RESIZE_OUT[self.interpolation]
        if self.resize_shorter is not None or resize_out is None:
            return self._resize(x)
        if tuple(x.shape[-2:]) == (s, s):
            return x
        resize_out(x, [s, s], False, None, None, out=buffer)  # = F.interpolate(..., antialias=True)
        return buffer

    def _resize(self, x: torch.Tensor) -> torch.Tensor:
        """(1, 3, h, w) uint8 -> (1, 3, S, S): the train crop resized, or the eval resize + centre crop."""
        s, r = self.size, self.resize_shorter
        h, w = x.shape[-2:]
        if r is None:
            size = (s, s)
        else:  # the same rounding as the graph's resize_shorter + crop_mirror_normalize(crop=(S, S))
            size = (r, round(w * r / h)) if h <= w else (round(h * r / w), r)
        if (h, w) != size:
            x = F.interpolate(x, size=size, mode=self.interpolation, antialias=True, align_corners=False)
        if r is None:
            return x
        top, left = int((size[0] - s) / 2 + 0.5), int((size[1] - s) / 2 + 0.5)
        return x[..., top : top + s, left : left + s]


class TorchvisionFinisher(HostFinisher):
    """The host finishing with torchvision's eval geometry: ``Resize(R)`` makes the longer side
    ``int(R * long / short)`` (truncated) and ``CenterCrop(S)`` starts at ``int(round((H - S) / 2))``. The
    graph's arithmetic (``HostFinisher``) rounds both, which moves half of all images by up to a pixel
    against torchvision's output. The train path, a
    random crop resized to S x S, is the same in both."""

    def _resize(self, x: torch.Tensor) -> torch.Tensor:
        s, r = self.size, self.resize_shorter
        if r is None:
            return super()._resize(x)
        h, w = x.shape[-2:]
        size = (int(r * h / w), r) if w <= h else (r, int(r * w / h))  # torchvision's (H, W)
        if (h, w) != size:
            x = F.interpolate(x, size=size, mode=self.interpolation, antialias=True, align_corners=False)
        top, left = int(round((size[0] - s) / 2.0)), int(round((size[1] - s) / 2.0))
        return x[..., top : top + s, left : left + s]


# the eval geometry a loader finishes with (``ImageLoader(eval_geometry=...)``)
EVAL_GEOMETRY = {"torchvision": TorchvisionFinisher, "dali": HostFinisher}


def make_finisher(
    cpu_resize: str,
    geometry: str,
    device,
    size: int,
    options: dict,
    dtype: torch.dtype,
    resize_shorter: int | None,
    threads: int,
) -> HostFinisher | None:
    """A loader's host finishing of CPU-decoded crops (``cpu_resize="torch"``) with the eval ``geometry``
    (``EVAL_GEOMETRY``), or None (DALI finishes: the GPU path, or ``cpu_resize="dali"``)."""
    if cpu_resize not in CPU_RESIZE:
        raise ValueError(f"cpu_resize must be {' or '.join(map(repr, CPU_RESIZE))}, got '{cpu_resize}'")
    if geometry not in EVAL_GEOMETRY:
        raise ValueError(f"eval_geometry must be {' or '.join(map(repr, EVAL_GEOMETRY))}, got '{geometry}'")
    if device.type == "cuda" or cpu_resize != "torch":
        return None
    mean, std = options.get("mean", IMAGENET_MEAN), options.get("std", IMAGENET_STD)
    fp16 = dtype == torch.float16
    interpolation = options.get("interpolation", "bilinear")
    finisher = EVAL_GEOMETRY[geometry](
        size, mean, std, fp16, resize_shorter=resize_shorter, threads=threads, interpolation=interpolation
    )
    finisher.streaming_threads = threads  # what it runs when no decoded cache frees the DALI threads
    finisher.dtype = dtype  # it allocates its output in this dtype (bfloat16 too)
    return finisher
