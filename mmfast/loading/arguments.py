"""The loaders' arguments: the training engine's as one typed object (``LoaderOptions``), one ``ImageLoader``'s
settings resolved (``LoaderSettings``: what both ways of making one end in, and what its reader is handed), and
every loader's checked before anything is built: the samples, sizes, counts, labels, the process layout, and
the DALI batch a CPU loader runs (a divisor of the loader's that DALI parses safely)."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from mmfast.data.preprocessing import EVAL_CROP_RATIO
from mmfast.data.validate import DEFAULT_MAX_PIXELS
from mmfast.loading.device import resolve_device, resolve_dtype
from mmfast.loading.graphs import DALI_SAFE_BATCH
from mmfast.loading.sampling import WHOLE_BATCHES, Layout, Sampling
from mmfast.util.voice import on_command_line, setting

if TYPE_CHECKING:
    from mmfast.loading.cache_plan import CachePlan
    from mmfast.loading.sources import Source


@dataclass(frozen=True)
class LoaderOptions:
    """How one of the training engine's loaders makes batches: their size and order, the augmentation, the
    precision, the DALI threads, the image source and the caption width. The engine builds one for a run, varies
    it per split (``dataclasses.replace``) and makes the loader with ``MultimodalLoader.from_options``, which
    hands it on whole to ``ImageLoader.from_options``; there it becomes the loader's ``LoaderSettings``
    (``settings``). The drop-in ``ImageLoader`` keeps DataLoader's keywords. A field is named as the loaders'
    keyword of the same meaning; None leaves that keyword to the loader's default (``keywords``: the same
    loader written out).

    Args:
        batch_size: samples per batch on this process.
        size: output side in pixels (None: ``ImageLoader``'s 224).
        seed: seed of the order and of the augmentations.
        train: random resized crop + flip (+ ``color_jitter``); None: as ``shuffle``.
        shuffle, drop_last: a new order every epoch, and no partial last batch; None: for the train split.
        num_workers: DALI CPU threads (None: all cores).
        fp16: float16 batches, else float32 (None: ``MultimodalLoader``'s float16).
        cpu_resize: who finishes CPU-decoded crops: "torch" (host threads) or "dali".
        cache_decoded: hold the decoded images in memory: a plan (``cache_plan.plan_decoded_cache``'s) or False.
        on_bad_image, verify_files: as ``ImageLoader`` takes them.
        scale, color_jitter: the train crop's area range and the colour jitter (None: the graph's defaults).
        mean, std: normalization in 0..255 units (None: ImageNet's).
        shard_id, num_shards: this process's shard (None: the accelerator's).
        source: where the images are read: "files", "wds" or "stream" (``sources.choose_source``).
        text_padding: the width of a batch's tokens: "longest", "buckets" or "max".
        interpolation, resize_mode, crop_ratio: a start's resize filter and eval resize (None: mmfast's own).
    """

    batch_size: int
    size: int | None = None
    seed: int = 0
    train: bool | None = None
    shuffle: bool | None = None
    drop_last: bool | None = None
    num_workers: int | None = None
    fp16: bool | None = None
    cpu_resize: str = "torch"
    cache_decoded: bool | CachePlan = False
    on_bad_image: str = "skip"
    verify_files: bool = False
    scale: tuple[float, float] | None = None
    color_jitter: float | None = None
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    shard_id: int | None = None
    num_shards: int | None = None
    source: str = "files"
    text_padding: str = "longest"
    interpolation: str | None = None
    resize_mode: str | None = None
    crop_ratio: float | None = None

    def keywords(self) -> dict:
        """``MultimodalLoader``'s keywords these set (its own, and the ``ImageLoader`` ones it passes on);
        a field left None is left out."""
        given = {f.name: getattr(self, f.name) for f in fields(self)}
        return {name: value for name, value in given.items() if value is not None}

    def settings(self, accelerator, max_pixels: int, default_dtype: torch.dtype) -> LoaderSettings:
        """The ``ImageLoader`` settings these make (as ``MultimodalLoader(**self.keywords())`` would): this
        process's shard and device from ``accelerator``, files checked by preparation and cropped as the GPU
        path crops them, the split's order already decided (``shuffle`` and ``drop_last`` set)."""
        pipeline = {
            "scale": self.scale,
            "color_jitter": self.color_jitter,
            "mean": self.mean,
            "std": self.std,
            "interpolation": self.interpolation,
            "resize_mode": self.resize_mode,
            "crop_ratio": self.crop_ratio,
        }
        return LoaderSettings.resolved(
            batch_size=self.batch_size,
            shuffle=self.shuffle,
            drop_last=bool(self.drop_last),
            train=self.train,
            size=self.size,
            dtype=None,
            fp16=self.fp16,
            default_dtype=default_dtype,
            device=None,
            num_workers=self.num_workers,
            seed=self.seed,
            shard_id=self.shard_id,
            num_shards=self.num_shards,
            accelerator=accelerator,
            prefetch=None,
            prefetch_factor=None,
            pipeline_kwargs={name: value for name, value in pipeline.items() if value is not None},
            on_bad_image=self.on_bad_image,
            verify_files=self.verify_files,
            max_pixels=max_pixels,
            cpu_resize=self.cpu_resize,
            cache_decoded=self.cache_decoded,
            eval_geometry="dali",
            files_checked=True,  # preparation decoded every image: DALI runs whole batches
        )


@dataclass(frozen=True)
class LoaderSettings:
    """One ``ImageLoader``'s settings, resolved and checked: its batch and order, the augmentation and output,
    the process layout, the DALI threads and queue, and how its files are read and finished. Both ways of making
    an ImageLoader end here (``resolved``): the drop-in's DataLoader keywords and the engine's ``LoaderOptions``
    (``LoaderOptions.settings``). The loader hands it whole to its ``epoch_reader.EpochReader`` and shows its
    fields as DataLoader's attributes (``loader.batch_size``, ...).

    ``num_workers`` is kept as given (DataLoader's attribute); ``num_threads`` is what DALI runs (None or 0:
    every core). ``image_sizes``: the decoded (height, width) of each file (``checked``), None when unknown.
    """

    batch_size: int
    shuffle: bool
    drop_last: bool
    seed: int
    train: bool
    size: int
    dtype: torch.dtype
    device: torch.device
    num_workers: int | None
    shard_id: int
    num_shards: int
    prefetch: int
    pipeline_kwargs: dict
    on_bad_image: str = "skip"
    verify_files: bool = False
    max_pixels: int = DEFAULT_MAX_PIXELS
    cpu_resize: str = "torch"
    finish_threads: int | None = None
    cache_decoded: bool | int | str | CachePlan = "auto"
    eval_geometry: str = "torchvision"
    files_checked: bool = False  # every file was decoded before: DALI runs whole batches from the start
    image_sizes: np.ndarray | None = None

    @classmethod
    def resolved(
        cls,
        *,
        batch_size: int | None,
        shuffle: bool | None,
        drop_last: bool,
        train: bool | None,
        size: int | None,
        dtype,
        fp16: bool | None,
        device,
        num_workers: int | None,
        seed: int,
        shard_id: int | None,
        num_shards: int | None,
        accelerator,
        prefetch: int | None,
        prefetch_factor: int | None,
        pipeline_kwargs: dict,
        on_bad_image: str,
        verify_files: bool,
        max_pixels: int,
        cpu_resize: str,
        cache_decoded: bool | int | str | CachePlan,
        eval_geometry: str,
        files_checked: bool,
        finish_threads: int | None = None,
        default_dtype: torch.dtype = torch.float32,
    ) -> LoaderSettings:
        """The settings of these loader arguments, their defaults filled in: the shard and device from
        ``accelerator``, a 224-pixel side, ``train`` as ``shuffle``, the dtype and a prefetch depth of 2. The
        sizes and counts are checked (``check_sizes``); the rest is kept as given."""
        shard_id, num_shards, device = process_layout(accelerator, shard_id, num_shards, device)
        size = 224 if size is None else size
        prefetch = check_sizes(batch_size, shard_id, num_shards, size, num_workers, prefetch, prefetch_factor)
        return cls(
            batch_size,
            bool(shuffle),
            drop_last,
            seed,
            bool(shuffle) if train is None else train,
            size,
            resolve_dtype(dtype, fp16, default_dtype),
            resolve_device(device),
            num_workers,
            shard_id,
            num_shards,
            prefetch,
            pipeline_kwargs,
            on_bad_image,
            verify_files,
            max_pixels,
            cpu_resize,
            finish_threads,
            cache_decoded,
            eval_geometry,
            files_checked,
        )

    def checked(self, n: int, image_sizes) -> LoaderSettings:
        """These settings for ``n`` samples (``check_batch``), with their decoded ``image_sizes`` checked."""
        check_batch(self.batch_size, n, self.num_shards, self.size, self.max_pixels, self.drop_last)
        return replace(self, image_sizes=checked_image_sizes(image_sizes, n))

    fp16 = property(lambda self: self.dtype == torch.float16)
    num_threads = property(lambda self: self.num_workers or os.cpu_count() or 1)
    cache_auto = property(lambda self: isinstance(self.cache_decoded, str) and self.cache_decoded == "auto")

    def eval_resize(self) -> int | None:
        """Eval: the shorter side before the centre crop; None for ``resize_mode="squash"`` (to S x S, no
        crop)."""
        if self.pipeline_kwargs.get("resize_mode", "shortest") == "squash":
            return None
        return round(self.size / self.pipeline_kwargs.get("crop_ratio", EVAL_CROP_RATIO))

    def layout(self, n: int) -> Layout:
        """What the sampling needs of a loader of ``n`` samples with these settings."""
        return Layout(n, self.batch_size, self.shard_id, self.num_shards, self.seed, self.shuffle, self.drop_last)


@dataclass(frozen=True)
class EngineReading:
    """What an engine's ``ImageLoader`` reads beyond the drop-in's files (``ImageLoader(reading=...)``:
    ``MultimodalLoader``, predict's rows; the drop-in's own default is ``EngineReading(sampling=DATALOADER)``).

    Args:
        source: the image source (``mmfast.loading.sources``, e.g. ``sources.prepared_source``; None: the
            files); ``files`` still describe the samples.
        sampling: the order, shards and batches of each epoch (``mmfast.loading.sampling``; default the
            engine's whole batches).
        file_stats: (size, mtime_ns) of each file when it was validated (what preparation recorded): a file that
            differs now is decoded again before it is read; None: each file's first stat.
        image_sizes: (height, width) of each file as DALI decodes it (EXIF orientation applied; what preparation
            recorded): the train crops are then drawn on the host, as torchvision draws them
            (``mmfast.loading.draws.resized_crop_boxes``); None: computed in the graph from each header.
    """

    source: Source | None = None
    sampling: Sampling = WHOLE_BATCHES
    file_stats: Sequence[tuple[int, int]] | None = None
    image_sizes: Sequence[tuple[int, int]] | None = None


def integer_labels(labels, n: int) -> np.ndarray:
    """``labels`` as (n,) int64 (zeros when None). A column (n, 1), as a DataFrame's ``df[["label"]].values``
    gives, is flattened; another shape, or a label that is not a whole number (0.7, NaN, "cat"), is an error
    naming it (numpy's cast would truncate 0.7 to class 0)."""
    if labels is None:
        return np.zeros(n, dtype=np.int64)
    if hasattr(labels, "detach"):  # a torch tensor, maybe on the GPU
        labels = labels.detach().cpu().numpy()
    given = np.asarray(labels)
    if given.ndim == 2 and given.shape[1] == 1:
        given = given[:, 0]
    if given.ndim != 1:
        one_hot = " (one-hot rows: labels.argmax(1))" if given.ndim == 2 else ""
        raise ValueError(
            f"labels must be one integer class id per file, a sequence of {n} (or a column ({n}, 1)); got shape "
            f"{given.shape}{one_hot}"
        )
    if given.dtype.kind in "iub":
        return given.astype(np.int64)
    if given.dtype.kind == "f":
        bad = np.flatnonzero(~np.isfinite(given) | (given != np.round(given)))
        if not len(bad):
            return given.astype(np.int64)
        k = int(bad[0])
        raise ValueError(f"labels must be integer class ids; label {k} is {float(given.reshape(-1)[k])}")
    raise ValueError(f"labels must be integer class ids (map class names to ids first), got {given.dtype} values")


def checked_samples(files, labels, ids) -> tuple[list[str], np.ndarray, np.ndarray]:
    """``files``, ``labels`` and ``ids`` as a loader keeps them (a list of str, two int64 arrays), checked: a
    path where a list belongs, no file, mismatched lengths, or ids that are not unique int32 values are errors."""
    if isinstance(files, str | bytes | os.PathLike):
        raise TypeError(
            f"files must be a list of image paths (or a dataset), got the path {str(files)!r}; for a folder "
            f"of class folders use ImageLoader.from_folder({str(files)!r})"
        )
    files = [os.fsdecode(f) for f in files]
    n = len(files)
    if n == 0:
        raise ValueError("no image files given")
    labels = integer_labels(labels, n)
    ids = np.asarray(ids if ids is not None else np.arange(n), dtype=np.int64)
    if len(labels) != n or len(ids) != n:
        raise ValueError(f"{n} files but {len(labels)} labels and {len(ids)} ids")
    if len(np.unique(ids)) != n or ids.min() < 0 or ids.max() > np.iinfo(np.int32).max:
        raise ValueError("ids must be unique, non-negative int32 values")
    return files, labels, ids


def checked_image_sizes(image_sizes, n: int) -> np.ndarray | None:
    """``image_sizes`` as an (n, 2) int64 array of (height, width), or None; a wrong shape or a side under a pixel
    is an error."""
    if image_sizes is None:
        return None
    sizes = np.asarray(image_sizes, dtype=np.int64)
    if sizes.shape != (n, 2) or (sizes < 1).any():
        raise ValueError(
            f"image_sizes must hold (height, width) >= 1 pixel for each of the {n} files, got an array of shape "
            f"{sizes.shape}{'' if sizes.shape != (n, 2) else ' with a side under 1'}; pass image_sizes=None"
        )
    return sizes


def process_layout(accelerator, shard_id: int | None, num_shards: int | None, device) -> tuple:
    """(shard_id, num_shards, device): as given, else the ``accelerator``'s, else (0, 1, None)."""
    if accelerator is not None:
        shard_id = accelerator.process_index if shard_id is None else shard_id
        num_shards = accelerator.num_processes if num_shards is None else num_shards
        device = accelerator.device if device is None else device
    return shard_id or 0, 1 if num_shards is None else num_shards, device


def dali_batch_size(batch_size: int) -> int:
    """The batch a CPU loader's DALI graph runs: ``batch_size`` itself up to ``DALI_SAFE_BATCH``, else its largest
    divisor that is at most that (a batch of 64 runs as 4 x 16); ``batch_size`` when that divisor would be under 8
    (37, 74, 94, ...: many tiny DALI batches would cost more than they save; such a batch is not protected)."""
    part = next(d for d in range(min(batch_size, DALI_SAFE_BATCH), 0, -1) if batch_size % d == 0)
    return part if part >= 8 or part == batch_size else batch_size


MAX_PADDED_BATCH = 4096  # a batch larger than a process's samples is padded up to its size only up to this


def check_batch(batch_size: int, n: int, num_shards: int, size: int, max_pixels: int, drop_last: bool) -> None:
    """Refuse sizes whose memory would blow up: a batch padded far past the samples (DALI runs whole batches),
    an output image over the decoded-pixel budget; and a ``drop_last`` that would leave no batch."""
    per_rank = math.ceil(n / num_shards)
    if batch_size > max(per_rank, MAX_PADDED_BATCH):
        raise ValueError(
            f"{setting('batch_size', value=batch_size)} is larger than the {per_rank} samples of each process; "
            f"pass at most {per_rank} (one batch of all of them)"
        )
    if size * size > max_pixels:
        raise ValueError(
            f"{setting('size', '--image-size', value=size)} makes {size}x{size} = {size * size / 1e6:.0f} MP "
            f"output images, over the {max_pixels / 1e6:g} MP budget ({setting('max_pixels')}); pass a smaller "
            "size"
        )
    if drop_last and n < batch_size * num_shards:
        dropped = "and training drops a partial batch" if on_command_line() else "with drop_last=True"
        fits = n // num_shards  # the largest batch each process can fill
        fix = f"pass {setting('batch_size', value=fits)} or less" if fits else f"run at most {n} processes"
        raise ValueError(
            f"{n} samples cannot fill one batch of {batch_size}"
            + (f" on each of {num_shards} processes" if num_shards > 1 else "")
            + f" {dropped}; {fix}"
        )


def check_int(name: str, value) -> None:
    """``value`` is an int (numpy's too), not a bool, float or string: numpy would slice with it later."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be an int, got {value!r}")


def check_sizes(
    batch_size: int | None,
    shard_id: int,
    num_shards: int,
    size: int,
    num_workers: int | None,
    prefetch: int | None,
    prefetch_factor: int | None,
) -> int:
    """Check the loader's sizes and counts; returns the prefetch depth (``prefetch`` or ``prefetch_factor``,
    default 2)."""
    if batch_size is None:
        raise ValueError("batch_size=None (one unbatched sample at a time) is not supported; pass a batch size")
    for name, value in (("batch_size", batch_size), ("shard_id", shard_id), ("num_shards", num_shards)):
        check_int(name, value)
    if isinstance(size, tuple | list):
        raise TypeError(f"size must be one int (square outputs, the side in pixels), got {size!r}")
    check_int("size", size)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    if not 0 <= shard_id < num_shards:
        raise ValueError(f"shard_id must be in [0, num_shards={num_shards}), got {shard_id}")
    if size < 8:
        raise ValueError(f"size must be >= 8 pixels, got {size}")
    if num_workers is not None and num_workers < 0:
        raise ValueError(f"num_workers must be >= 0, got {num_workers}")
    if prefetch is not None and prefetch_factor is not None:
        raise ValueError("pass prefetch= or prefetch_factor=, not both (both set DALI's prefetch queue depth)")
    prefetch = prefetch_factor if prefetch_factor is not None else prefetch
    if prefetch is not None and prefetch < 1:
        raise ValueError(f"prefetch must be >= 1, got {prefetch}")
    return 2 if prefetch is None else prefetch


def first_line(error: BaseException) -> str:
    """The first line of a DALI error that says something (its messages start with a banner and a C++ stack)."""
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip() and "Critical error" not in ln]
    return (lines[0] if lines else type(error).__name__)[:200]
