"""The end of the CPU image path, on the host: antialiased resize, flip and normalize of DALI's output.

Why not in the DALI graph: on the CPU, DALI's antialiased resize costs about as much as the ROI decode
itself and its crop_mirror_normalize half as much again, while torch's uint8 antialiased bilinear kernel
(the one torchvision uses, close to PIL's) and a per-channel normalize pass do the same work several
times faster (figures in BENCHMARKS.md). So when decoding on the CPU the train graph stops after the fused
decode + random crop (``image_pipeline(finish_on_host=True)``) and ``HostFinisher`` completes the batch in
the thread that consumes it, with one intra-op thread: the DALI threads are decoding the next batches on
the other cores. The eval graph hands over whole decoded images, resized here (shorter side) and
centre-cropped with the graph's rounding. The GPU path keeps everything in the graph.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

OUTPUTS = ["crops", "flips", "id"]  # what image_pipeline(finish_on_host=True) returns, in order


def ragged_iterator(pipe, **kwargs):
    """DALI's iterator for a ``finish_on_host`` graph: the crops as a list of tensors (they differ in
    size), flips and ids as dense tensors. ``kwargs`` go to ``DALIRaggedIterator``."""
    from nvidia.dali.plugin.pytorch import DALIRaggedIterator

    types = [DALIRaggedIterator.SPARSE_LIST_TAG, DALIRaggedIterator.DENSE_TAG, DALIRaggedIterator.DENSE_TAG]
    return DALIRaggedIterator(pipe, OUTPUTS, output_types=types, **kwargs)


class HostFinisher:
    """Turns a batch of uint8 HWC images into normalized (B, 3, S, S) images.

    Args:
        size: output side S in pixels.
        mean, std: per-channel statistics in 0..255 units (as given to the DALI graph).
        fp16: float16 output (else float32).
        resize_shorter: None (train: each input is a crop, resized to S x S) or R >= S (eval: resize the
            shorter side to R, keeping the aspect ratio, then take the centre S x S).
    """

    def __init__(
        self,
        size: int,
        mean: Sequence[float],
        std: Sequence[float],
        fp16: bool = True,
        resize_shorter: int | None = None,
    ):
        if resize_shorter is not None and resize_shorter < size:
            raise ValueError(f"resize_shorter ({resize_shorter}) must be >= size ({size}); is crop_ratio > 1?")
        self.size, self.resize_shorter = size, resize_shorter
        self.scale = [1.0 / s for s in std]
        self.shift = [-m / s for m, s in zip(mean, std, strict=True)]
        self.dtype = torch.float16 if fp16 else torch.float32

    def __call__(self, crops: Sequence[torch.Tensor], flips: np.ndarray) -> torch.Tensor:
        """crops: B tensors (h, w, 3) uint8 (train crops or, for eval, whole images); flips: (B,) nonzero =
        mirror horizontally.

        Returns (B, 3, S, S) contiguous, ``self.dtype``."""
        s = self.size
        threads = torch.get_num_threads()  # per calling thread: the caller's own setting is restored below
        torch.set_num_threads(1)
        try:
            pixels = torch.empty((len(crops), s, s, 3), dtype=torch.uint8)  # (B, S, S, 3)
            for i, crop in enumerate(crops):
                x = crop.permute(2, 0, 1).unsqueeze(0)  # (1, 3, h, w), channels-last strides: no copy
                hwc = self._resize(x)[0].permute(1, 2, 0)  # (S, S, 3)
                pixels[i] = hwc.flip(1) if flips[i] else hwc
            out = torch.empty((len(crops), 3, s, s), dtype=self.dtype)  # (B, 3, S, S)
            for c in range(3):  # one channel at a time: contiguous float work, ~7x faster than broadcasting
                out[:, c] = pixels[..., c].float().mul_(self.scale[c]).add_(self.shift[c])
        finally:
            torch.set_num_threads(threads)
        return out

    def finish(self, out: dict) -> torch.Tensor:
        """The finished images of one ``ragged_iterator`` output dict: (B, 3, S, S)."""
        return self(out["crops"], out["flips"].view(-1).numpy())

    def _resize(self, x: torch.Tensor) -> torch.Tensor:
        """(1, 3, h, w) uint8 -> (1, 3, S, S): the train crop resized, or the eval resize + centre crop."""
        s, r = self.size, self.resize_shorter
        h, w = x.shape[-2:]
        if r is None:
            size = (s, s)
        else:  # the same rounding as the graph's resize_shorter + crop_mirror_normalize(crop=(S, S))
            size = (r, round(w * r / h)) if h <= w else (round(h * r / w), r)
        if (h, w) != size:
            x = F.interpolate(x, size=size, mode="bilinear", antialias=True, align_corners=False)
        if r is None:
            return x
        top, left = int((size[0] - s) / 2 + 0.5), int((size[1] - s) / 2 + 0.5)
        return x[..., top : top + s, left : left + s]
