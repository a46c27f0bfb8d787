"""Augmentation drawn per sample: every random number of a training image's augmentation (its crop's area,
aspect ratio and place, its flip, its colour jitter) is a function of (seed, epoch, sample id) alone. Which
process reads the sample, in which batch, after which other samples, on how many processes, resumed or not: the
same pixels. That is what makes a run on 1 process and on N train on the same global batches (#29), and a
resumed epoch deliver the samples it would have.

The numbers are a counter-based hash (SplitMix64's finalizer over the key), computed on the host for a batch at a
time: ``DrawFeed`` hands them to the DALI graph (an external source in step with the reader, batch by batch,
which DALI's checkpoints replay by iteration) and ``mmfast.loading.decoded`` uses them for the crops it cuts
from memory.

The crop (``crop_window``): the area share s uniform over the shares in ``scale`` at which a crop of a ratio in
``ratio`` fits the image, then the log aspect ratio uniform over the ratios at which that area fits, so every
draw fits at once; an image too elongated for the smallest area in range is cut to the ratio nearest its own,
whole along its shorter side. torchvision and DALI instead redraw (up to 10 times) until a crop fits, which
favours smaller areas: their mean area share is 0.48 of a square image and 0.33 of a 16:9 one at scale
(0.08, 1), this one's 0.54 and 0.41 (the same ratios on average). Written once over numpy or
``nvidia.dali.math``: the graph and the host compute the same windows (the host in float32 and rounding as DALI
does).

``resized_crop_boxes`` is the other way, where the loader knows each image's decoded size before DALI reads it
(``ImageLoader(reading=EngineReading(image_sizes=...))``): torchvision's ``RandomResizedCrop`` (the area share
uniform in ``scale``, the log aspect ratio uniform in ``ratio``, redrawn up to ``ATTEMPTS`` times until the crop
fits, then the centred crop of the ratio in range nearest the image's), every redraw a draw of (seed, epoch, id)
too. Computed on the host, the windows go to the graph's slice decode as an external source: no arithmetic in the
graph, and the smaller crops torchvision's redraws favour.
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace

import numpy as np

DRAWS = 8  # per sample: area, ratio, x, y, flip, brightness, contrast, saturation
AREA, RATIO, X, Y, FLIP, BRIGHTNESS, CONTRAST, SATURATION = range(DRAWS)
ATTEMPTS = 10  # torchvision's redraws of a crop that does not fit; (area, ratio) of attempt k > 0 after DRAWS
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
NUMPY_MATH = SimpleNamespace(log=np.log, exp=np.exp, sqrt=np.sqrt, min=np.minimum, max=np.maximum)


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer (uint64 in, uint64 out, wrapping)."""
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def sample_uniforms(seed: int, epochs: np.ndarray, ids: np.ndarray, count: int = DRAWS) -> np.ndarray:
    """(B, count) float32 in [0, 1): the draws of samples ``ids`` (B,) in ``epochs`` (B,) under ``seed``; each
    row a function of (seed, epoch, id) only."""
    epochs = np.asarray(epochs, dtype=np.int64).astype(np.uint64)
    ids = np.asarray(ids, dtype=np.int64).astype(np.uint64)  # padding (-1) wraps: a draw like any other
    with np.errstate(over="ignore"):
        key = _mix(np.uint64(seed % 2**64) * _GOLDEN + np.uint64(1))
        key = _mix((key ^ epochs) * _GOLDEN + np.uint64(2))
        key = _mix((key ^ ids) * _GOLDEN)  # (B,)
        k = np.arange(1, count + 1, dtype=np.uint64)
        bits = _mix(key[:, None] + k[None, :] * _GOLDEN)  # (B, count)
    return ((bits >> np.uint64(40)).astype(np.float64) / 2**24).astype(np.float32)  # 24 bits: exact in float32


def crop_window(
    u_area, u_ratio, u_x, u_y, height, width, scale: tuple[float, float], ratio: tuple[float, float], m=NUMPY_MATH
):
    """The random resized crop of an image of ``height`` x ``width`` pixels, in shares of its sides: (left, top,
    width, height), each in [0, 1] and at least a pixel, from four uniforms (module doc). ``m``: the math
    (numpy's, or DALI's for graph nodes: ``nvidia.dali.math``); the uniforms and the sides are arrays or DALI
    nodes alike."""
    lo_r, hi_r = math.log(min(ratio)), math.log(max(ratio))
    aspect = width / height
    # the largest area share a crop of a ratio in range can have here (s * aspect <= r <= aspect / s)
    s_fit = m.min(m.min(max(ratio) / aspect, aspect / min(ratio)), scale[1])
    s = scale[0] + u_area * (m.max(s_fit, scale[0]) - scale[0])  # uniform over the areas that fit
    log_aspect, log_s = m.log(aspect), m.log(s)
    lo = m.max(log_s + log_aspect, lo_r)  # the height share sqrt(s * aspect / r) <= 1
    hi = m.min(log_aspect - log_s, hi_r)  # the width share sqrt(s * r / aspect) <= 1
    fits = lo <= hi + 1e-6  # only an image too elongated for the smallest area in range does not
    nearest = m.min(m.max(log_aspect, lo_r), hi_r)  # too elongated: the ratio in range nearest its own
    log_r = fits * (lo + u_ratio * (hi - lo)) + (1 - fits) * nearest
    r = m.exp(log_r)
    w_share = fits * m.sqrt(s * r / aspect) + (1 - fits) * m.min(r / aspect, 1.0)
    h_share = fits * m.sqrt(s * aspect / r) + (1 - fits) * m.min(aspect / r, 1.0)
    # inside the image (rounding at the edge of the feasible range), and a pixel at least (a tiny image)
    w_share, h_share = m.max(m.min(w_share, 1.0), 1.0 / width), m.max(m.min(h_share, 1.0), 1.0 / height)
    centre = 1 - fits  # the fallback is centred
    left = fits * u_x * (1 - w_share) + centre * 0.5 * (1 - w_share)
    top = fits * u_y * (1 - h_share) + centre * 0.5 * (1 - h_share)
    return left, top, w_share, h_share


def crop_boxes(shapes: np.ndarray, u: np.ndarray, scale, ratio) -> np.ndarray:
    """(B, 4) int64 pixel boxes (top, left, height, width) of ``crop_window`` for images of ``shapes`` (B, 2) =
    (height, width) and draws ``u`` (B, >= 4) from ``sample_uniforms``: what the graph's slice decodes, rounded
    as DALI rounds a normalized slice."""
    h, w = shapes[:, 0].astype(np.float32), shapes[:, 1].astype(np.float32)
    u = u.astype(np.float32)  # DALI computes the window in float32 and rounds half away from zero (llround)
    left, top, width, height = crop_window(u[:, AREA], u[:, RATIO], u[:, X], u[:, Y], h, w, scale, ratio)
    x0, y0 = np.floor(left * w + 0.5), np.floor(top * h + 0.5)
    x1, y1 = np.floor((left + width) * w + 0.5), np.floor((top + height) * h + 0.5)
    x0, y0 = np.clip(x0, 0, w - 1), np.clip(y0, 0, h - 1)
    x1, y1 = np.clip(np.maximum(x1, x0 + 1), 1, w), np.clip(np.maximum(y1, y0 + 1), 1, h)
    return np.stack([y0, x0, y1 - y0, x1 - x0], axis=1).astype(np.int64)


def resized_crop_boxes(shapes: np.ndarray, u: np.ndarray, scale, ratio) -> np.ndarray:
    """(B, 4) int64 pixel boxes (top, left, height, width) of torchvision's ``RandomResizedCrop.get_params`` for
    images of ``shapes`` (B, 2) = (height, width), its random numbers taken from ``u`` (B, DRAWS + 2 *
    (ATTEMPTS - 1)) of ``sample_uniforms``: attempt 0's area and ratio at AREA and RATIO, attempt k's at DRAWS
    + 2 (k - 1) and the next; the place at X and Y (uniform over the places that fit, as ``randint``)."""
    h, w = shapes[:, 0].astype(np.float64)[:, None], shapes[:, 1].astype(np.float64)[:, None]
    u = u.astype(np.float64)
    u_area = np.concatenate([u[:, AREA : AREA + 1], u[:, DRAWS::2]], axis=1)[:, :ATTEMPTS]  # (B, ATTEMPTS)
    u_ratio = np.concatenate([u[:, RATIO : RATIO + 1], u[:, DRAWS + 1 :: 2]], axis=1)[:, :ATTEMPTS]
    if u_area.shape[1] < ATTEMPTS or u_ratio.shape[1] < ATTEMPTS:
        raise ValueError(f"resized_crop_boxes needs {DRAWS + 2 * (ATTEMPTS - 1)} draws a sample, got {u.shape[1]}")
    lo_r, hi_r = math.log(min(ratio)), math.log(max(ratio))
    area = h * w * (scale[0] + u_area * (scale[1] - scale[0]))
    r = np.exp(lo_r + u_ratio * (hi_r - lo_r))
    cw, ch = np.rint(np.sqrt(area * r)), np.rint(np.sqrt(area / r))  # int(round(.)) as torchvision's
    fits = (cw > 0) & (cw <= w) & (ch > 0) & (ch <= h)
    first = fits.argmax(axis=1)  # the first attempt that fits
    rows = np.arange(len(shapes))
    cw, ch, found = cw[rows, first], ch[rows, first], fits[rows, first]
    h, w = h[:, 0], w[:, 0]
    top = np.minimum(np.floor(u[:, Y] * (h - ch + 1)), h - ch)
    left = np.minimum(np.floor(u[:, X] * (w - cw + 1)), w - cw)
    # none fits: torchvision's centred crop, whole along the side the ratio range allows
    aspect = w / h
    fw = np.where(aspect > max(ratio), np.rint(h * max(ratio)), w)
    fh = np.where(aspect < min(ratio), np.rint(w / min(ratio)), h)
    fw, fh = np.clip(fw, 1, w), np.clip(fh, 1, h)
    ch, cw = np.where(found, ch, fh), np.where(found, cw, fw)
    top = np.where(found, top, np.floor((h - fh) / 2))
    left = np.where(found, left, np.floor((w - fw) / 2))
    return np.stack([top, left, ch, cw], axis=1).astype(np.int64)


class DrawFeed:
    """DALI's batch-mode external source of the draws: batch ``info.iteration`` holds the (DRAWS,) float32 rows
    of entries [i * B, (i + 1) * B) of a chunk, whose sample ids and epochs are given (B: the pipeline's batch,
    set where the graph is defined). With ``shapes`` (each entry's decoded (height, width)), also the crop
    windows of ``resized_crop_boxes`` as int32 (x, y) anchors and (width, height) shapes (``scale`` and ``ratio``
    set where the graph is defined)."""

    def __init__(self, seed: int, ids: np.ndarray, epochs: np.ndarray, shapes: np.ndarray | None = None):
        self.seed, self.ids, self.epochs = seed, np.asarray(ids), np.asarray(epochs)
        self.shapes = None if shapes is None else np.asarray(shapes, dtype=np.int64).reshape(-1, 2)
        self.batch_size = 0
        self.scale, self.ratio = (0.08, 1.0), (3 / 4, 4 / 3)

    def __call__(self, info) -> list[np.ndarray] | tuple:
        b, i = self.batch_size, info.iteration
        if (i + 1) * b > len(self.ids):
            raise StopIteration
        part = slice(i * b, (i + 1) * b)
        if self.shapes is None:
            return list(sample_uniforms(self.seed, self.epochs[part], self.ids[part]))
        u = sample_uniforms(self.seed, self.epochs[part], self.ids[part], DRAWS + 2 * (ATTEMPTS - 1))
        boxes = resized_crop_boxes(self.shapes[part], u, self.scale, self.ratio)  # (top, left, height, width)
        dense = functools.partial(np.ascontiguousarray, dtype=np.int32)  # DALI takes C-ordered batches only
        return np.ascontiguousarray(u[:, :DRAWS]), dense(boxes[:, [1, 0]]), dense(boxes[:, [3, 2]])
