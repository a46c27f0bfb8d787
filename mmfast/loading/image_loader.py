"""``ImageLoader``: one process's epochs of image batches decoded and augmented by DALI, as a drop-in for a
torch DataLoader over image files. It assembles the pipeline (a source's reader + the shared processing
graph) and runs the epoch protocol (``len``, ``iter``, ``set_epoch``, ``state_dict``) on top of the modules
that do each part:

    mmfast.loading.sampling      the order and the shards of each epoch (and ``loader.sampler``)
    mmfast.loading.sources       where the encoded images come from (files, WebDataset shards)
    mmfast.loading.stream        the live DALI stream, its chunk of epochs and the resume state
    mmfast.loading.file_health   missing/undecodable files: found, skipped or reported
    mmfast.loading.dropin        what DataLoader code passes and expects (arguments, datasets, transforms, batches)
    mmfast.loading.device        the device and dtype of the batches
    mmfast.loading.multimodal    ``MultimodalLoader``: a prepared split's images joined with its cached tokens

Two samplings (``mmfast.loading.sampling``):
- ``ImageLoader`` does what ``DataLoader(dataset, sampler=DistributedSampler(dataset, num_shards, shard_id,
  shuffle, seed))`` does (one process: what ``DataLoader(shuffle=...)`` does): the order is
  ``torch.randperm`` seeded by ``seed + epoch``, a rank's list is DistributedSampler's (the first samples of
  the order repeated so that every rank gets as many), and the last batch is partial unless ``drop_last``.
  The -1 entries DALI needs are cut off the batch before it is handed out.
- ``MultimodalLoader`` (the training engine's) keeps whole batches: a numpy permutation seeded by
  (seed, epoch), each sample at most once per epoch, the last eval batch padded (id -1, label -100), and
  ``drop_last`` keeping only whole global batches.

"""

from __future__ import annotations

import functools
import logging
import math
import os
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from mmfast.data.validate import DEFAULT_MAX_PIXELS
from mmfast.loading.decoded import DecodedImages, DecodedIterator, auto_plan, default_budget
from mmfast.loading.device import resolve_device, resolve_dtype
from mmfast.loading.dropin import (
    Batch,
    ImageFiles,
    TorchvisionFinisher,
    from_dataset,
    split_options,
    torchvision_equivalent,
)
from mmfast.loading.file_health import FileHealth
from mmfast.loading.graphs import (
    DALI_SAFE_BATCH,
    EVAL_CROP_RATIO,
    IMAGENET_MEAN,
    IMAGENET_STD,
    READER_NAME,
    image_pipeline,
)
from mmfast.loading.host_finish import CPU_RESIZE, HostFinisher, default_threads, ragged_iterator
from mmfast.loading.sampling import ShardSampler, distributed_sampler_indices, epoch_order, shard_positions
from mmfast.loading.sources import FilesSource, Source, WdsSource
from mmfast.loading.stream import (
    SELF_ORDERED_CHUNK,
    Restore,
    Stream,
    chunk_dali_batch,
    decode_checkpoint,
    encode_checkpoint,
    new_chunk,
)

log = logging.getLogger(__name__)
IGNORE_LABEL = -100  # torch.nn.functional.cross_entropy's default ignore_index


class DaliFailure(RuntimeError):
    """DALI failed on a batch and no file of it is to blame (memory, most often); the message says what to do."""


def _first_line(error: BaseException) -> str:
    """The first line of a DALI error that says something (its messages start with a banner and a C++ stack)."""
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip() and "Critical error" not in ln]
    return (lines[0] if lines else type(error).__name__)[:200]


class ImageLoader:
    """A drop-in for ``torch.utils.data.DataLoader`` over image files, decoded and augmented by DALI.

    Loops written for a DataLoader over a torchvision ``ImageFolder`` run unchanged: batches are
    ``(images, labels)`` tuples (``Batch``: ``images`` (B, 3, S, S) float32, ``labels`` (B,) int64), the last
    batch is partial unless ``drop_last``, ``len()``, ``.dataset`` (``classes``, ``class_to_idx``,
    ``samples``, ``targets``, ``len()``), ``.batch_size``, ``.sampler`` (``set_epoch``, ``len()``) and
    ``.drop_last`` mean what they mean there, and each ``iter()`` starts a new epoch (also after a
    ``break``; one epoch runs at a time: an older iterator advanced after a newer one began raises). With
    ``shard_id``/``num_shards`` each process gets exactly the samples that
    ``DistributedSampler(dataset, num_shards, shard_id, shuffle, seed)`` gives it, in its order.

    Args:
        files: image paths, or a torchvision ``ImageFolder`` / ``DatasetFolder`` (or a ``Subset`` of one), so
            ``DataLoader(dataset, ...)`` becomes ``ImageLoader(dataset, ...)``: its files, labels and classes,
            and its transform turned into size/train/crop/normalization arguments (``options_from_transform``;
            a step the pipeline cannot reproduce is an error naming it). ``from_folder`` reads a folder tree.
        labels: one integer label per file (default: zeros); with a dataset, DataLoader's positional
            ``batch_size`` may stand here.
        ids: one unique integer sample id per file (default: 0..n-1).
        batch_size: samples per batch on this process.
        shuffle: a new order every epoch: ``torch.randperm`` seeded by ``seed + epoch``.
        drop_last: drop this process's last batch if it is incomplete (DataLoader's ``drop_last``).
        num_workers: DALI CPU threads (default and 0: all cores); no processes are started.
        pin_memory: CPU batches in pinned (page-locked) memory, so ``.cuda(non_blocking=True)`` copies
            asynchronously; no effect on batches that are on the GPU already or without CUDA.
        train: random resized crop + flip (train) or resize + center crop (eval); default: ``shuffle``.
        size: output side in pixels. Eval resizes the shorter side to ``round(size / crop_ratio)`` first
            (``crop_ratio`` 0.875: 224 -> 256, like ``Resize(256)`` + ``CenterCrop(224)``).
        dtype: torch.float32 (default), torch.float16 or torch.bfloat16 (or their names).
        device: where batches go: "cpu" or "cuda[:N]" (default: the current CUDA device, decoding there;
            else the CPU).
        seed: seed of the order and of the augmentations.
        shard_id, num_shards: this process's rank and the number of processes (DDP:
            ``torch.distributed.get_rank()`` and ``get_world_size()``); default 0 and 1.
        accelerator: take shard_id, num_shards and device from an ``accelerate.Accelerator``.
        as_dict: batches as dicts ``{"image", "label", "id", "mask"}`` instead of ``Batch`` tuples.
        classes: class names, ``classes[label]`` (default: 0..max label); ``from_folder`` sets the folders'.
        fp16: the older way to say dtype=torch.float16 (True) or torch.float32 (False).
        prefetch: DALI prefetch queue depth (default 2); ``prefetch_factor`` sets the same.
        wds_shards: read these WebDataset tars instead of ``files``, through mmfast's index files (by default
            the ``.idx`` beside each tar, as ``write_wds`` writes them); ``files``/``labels``/``ids``
            still describe the samples, and no file of ``files`` is opened. DALI then shards and shuffles (a
            shuffle buffer that runs on across epochs; ``set_epoch`` does not re-seed it), unlike
            DistributedSampler.
        wds_index: the index file of each of ``wds_shards`` (``mmfast.inputs.wds``: a prepared directory
            holds those of the user's shards).
        image_source: the source object to read (``mmfast.loading.sources``, e.g. ``PreparedDataset.source_for``)
            instead of ``wds_shards``/``files``; ``files`` still describe the samples.
        on_bad_image: what to do with an image that is missing or cannot be decoded: "skip" (log it, count
            it in ``skipped``, and serve a masked sample in its place: id -1, label -100, mask False, so batch
            sizes and the other samples' order stay the same on every rank) or "error" (raise, naming the
            file).
        verify_files: also check every file at start-up (default off: each batch's files are stat'ed anyway
            just before DALI reads them, ``file_health.FileHealth.watch``; the missing, empty, non-regular and
            changed ones are decoded again, and handled as ``on_bad_image`` says).
        file_stats: (size, mtime_ns) of each file when it was validated (MultimodalLoader passes what
            preparation recorded): a file that differs now is decoded again before it is read; default: each
            file's first stat.
        max_pixels: decoded-pixel budget per image, checked from the header of a file seen for the first time
            (without ``file_stats``) or checked again (one over it is a bad image): what bounds the decoder's
            memory.
        cpu_resize: who resizes, flips and normalizes the decoded crops when decoding on the CPU: "torch"
            (the consuming thread, ``mmfast.loading.host_finish``; about 2x faster, and the eval path reproduces
            torchvision's Resize + CenterCrop pixels) or "dali" (in the graph). The GPU path always does it
            in DALI.
        finish_threads: threads finishing each batch on the host (``cpu_resize="torch"``), the consuming
            one included (default: ``host_finish.default_threads(num_threads)``; with ``cache_decoded``,
            ``num_threads``: no DALI thread decodes then).
        cache_decoded: decode each image once and keep it in memory; later epochs crop from there
            (``mmfast.loading.decoded``: the CPU path's answer to small images, whose decode is most of the work).
            "auto" (default): where it pays and fits, as ``decoded.auto_plan`` finds from a sample of the
            files' headers (not the train crops of large JPEGs, whose streamed decode reads only the crop),
            in half the memory available now shared by the machine's processes; otherwise streaming, the
            reason in the log. True (up to half the memory available when it fills) or a budget in bytes:
            always, streaming with a warning a set that does not fit; False: never. CPU decoding with
            ``cpu_resize="torch"`` and the file source only, and no ``color_jitter`` (True or a budget with
            those is an error).
        **options: ``image_pipeline`` options (scale, ratio, flip, color_jitter, crop_ratio, mean, std in
            0..255 units, hw_decoder_load, memory_padding, size_hint) and DataLoader's arguments that have
            nothing to do here, accepted without effect: persistent_workers (the pipeline lives across
            epochs anyway), timeout (no workers to wait for), multiprocessing_context, pin_memory_device,
            in_order. ``sampler``, ``batch_sampler``, ``collate_fn``, ``worker_init_fn``, ``generator`` are
            refused (unless None) with what to pass instead, and any other name is a TypeError.

    Padding under sharding: when ``num_shards`` does not divide the dataset, the first samples of the epoch's
    order are repeated to fill up the shards (at most one per process, at its end), exactly as
    DistributedSampler does (so an accuracy over all ranks equals the DataLoader version's, repeats
    included); ``batch.mask`` is False for the repeats, so
    ``(correct & mask).sum()`` and ``mask.sum()`` summed over ranks count each sample once (their total is
    ``len(loader.dataset)``).
    """

    _default_dtype = torch.float32
    _dataloader_sampling = True  # DistributedSampler's order and shards, partial last batches (see module doc)
    _files_checked = False  # nobody decoded the files before: DALI runs safe parts until each was read once

    def __init__(
        self,
        files: Sequence[str] | torch.utils.data.Dataset,
        labels: Sequence[int] | None = None,
        *,
        ids: Sequence[int] | None = None,
        batch_size: int | None = 64,
        shuffle: bool | None = False,
        drop_last: bool = False,
        num_workers: int | None = None,
        pin_memory: bool = False,
        train: bool | None = None,
        size: int | None = None,
        dtype: torch.dtype | str | None = None,
        device: str | torch.device | None = None,
        seed: int = 0,
        shard_id: int | None = None,
        num_shards: int | None = None,
        accelerator=None,
        as_dict: bool = False,
        classes: Sequence | None = None,
        fp16: bool | None = None,
        prefetch: int | None = None,
        prefetch_factor: int | None = None,
        wds_shards: Sequence[str] | None = None,
        wds_index: Sequence[str] | None = None,
        image_source: Source | None = None,
        on_bad_image: str = "skip",
        verify_files: bool = False,
        file_stats: Sequence[tuple[int, int]] | None = None,
        max_pixels: int = DEFAULT_MAX_PIXELS,
        cpu_resize: str = "torch",
        finish_threads: int | None = None,
        cache_decoded: bool | int | str = "auto",
        **options,
    ):
        self.dataloader_options, pipeline_kwargs = split_options(type(self).__name__, options)
        folder = files if isinstance(files, torch.utils.data.Dataset) else None
        if folder is not None:  # DataLoader(dataset, ...) -> ImageLoader(dataset, ...)
            files, labels, classes, batch_size, size, train, dtype = from_dataset(
                folder, labels, batch_size=batch_size, size=size, train=train, dtype=dtype, fp16=fp16,
                classes=classes, pipeline_kwargs=pipeline_kwargs,
            )  # fmt: skip
        shard_id, num_shards, device = _process_layout(accelerator, shard_id, num_shards, device)
        size = 224 if size is None else size
        prefetch = _check_sizes(batch_size, shard_id, num_shards, size, num_workers, prefetch, prefetch_factor)
        self._set_samples(files, labels, ids)
        _check_batch(batch_size, len(self.files), num_shards, size, max_pixels)
        self.batch_size = batch_size
        self.shuffle = bool(shuffle)
        self.drop_last = drop_last
        self.train = self.shuffle if train is None else train
        self.size = size
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, fp16, self._default_dtype)
        self.fp16 = self.dtype == torch.float16
        self.num_threads = num_workers or os.cpu_count() or 1
        self.num_workers = num_workers or 0  # DataLoader's attribute, as given
        self.pin_memory = pin_memory
        # Pinning needs CUDA; DataLoader ignores the flag without it, and so does this loader.
        self._pin = bool(pin_memory) and self.device.type == "cpu" and torch.cuda.is_available()
        self.as_dict = as_dict
        self.seed = seed
        self.shard_id, self.num_shards = shard_id, num_shards
        self.prefetch = prefetch
        self.prefetch_factor = self.prefetch
        self.pipeline_kwargs = pipeline_kwargs
        self._finisher = self._make_finisher(cpu_resize, finish_threads)
        source = image_source or (WdsSource(wds_shards, wds_index) if wds_shards else FilesSource())
        self._set_source(source, on_bad_image, max_pixels, verify_files, file_stats)
        self._cache_auto = cache_decoded == "auto"
        self._decoded = self._decoded_cache(cache_decoded)
        if self._decoded is not None and finish_threads is None:
            self._finisher.threads = self.num_threads  # the DALI threads will not be decoding
        self._read_ok = np.zeros(len(self.files), dtype=bool)  # positions DALI has read without failing
        n = len(self.files)
        if drop_last and n < batch_size * num_shards:
            raise ValueError(
                f"{n} samples cannot fill one batch of {batch_size} on each of {num_shards} processes "
                "with drop_last=True; lower the batch size"
            )
        # its transform is made when first used: importing torchvision's transforms takes seconds
        make_transform = functools.partial(torchvision_equivalent, self.train, size, self.dtype, pipeline_kwargs)
        self.dataset = ImageFiles(self.files, self.labels, classes, make_transform) if folder is None else folder
        self.classes = list(classes) if classes is not None else self.dataset.classes
        self._sampler: ShardSampler | None = None
        self._start_position()

    def __reduce__(self):
        raise TypeError(
            f"{type(self).__name__} cannot be pickled or copied (it holds a live DALI pipeline); build one in "
            "each process, and save its position with state_dict()"
        )

    def _start_position(self) -> None:
        """Before the first batch: epoch 0, no stream yet."""
        self.epoch = 0
        self.step = 0  # batches of the current epoch already delivered
        self._stream: Stream | None = None  # the live DALI iterator and the position of its next batch
        self._restore: Restore | None = None  # set by load_state_dict
        self._keep_position = False  # a restored position the next iter() continues from
        self._generation = 0  # bumped by each iter(): an older iterator raises if it is advanced again
        self._held_positions: dict[int, np.ndarray] = {}  # _epoch_positions

    def _set_samples(self, files, labels, ids) -> None:
        """``files``, ``labels`` and ``ids`` as the loader keeps them (lists of str, int64 arrays), checked."""
        if isinstance(files, str | bytes | os.PathLike):
            raise TypeError(
                f"files must be a list of image paths (or a dataset), got the path {str(files)!r}; for a folder "
                f"of class folders use ImageLoader.from_folder({str(files)!r})"
            )
        self.files = [os.fsdecode(f) for f in files]
        n = len(self.files)
        if n == 0:
            raise ValueError("no image files given")
        self.labels = _integer_labels(labels, n)
        self.ids = np.asarray(ids if ids is not None else np.arange(n), dtype=np.int64)
        if len(self.labels) != n or len(self.ids) != n:
            raise ValueError(f"{n} files but {len(self.labels)} labels and {len(self.ids)} ids")
        if len(np.unique(self.ids)) != n or self.ids.min() < 0 or self.ids.max() > np.iinfo(np.int32).max:
            raise ValueError("ids must be unique, non-negative int32 values")
        self._id_sorter = np.argsort(self.ids)

    def _make_finisher(self, cpu_resize: str, finish_threads: int | None) -> HostFinisher | None:
        """The host finishing of CPU-decoded crops (``cpu_resize="torch"``), or None (DALI finishes)."""
        if cpu_resize not in CPU_RESIZE:
            raise ValueError(f"cpu_resize must be {' or '.join(map(repr, CPU_RESIZE))}, got '{cpu_resize}'")
        if self.device.type == "cuda" or cpu_resize != "torch":
            return None
        options = self.pipeline_kwargs
        mean, std = options.get("mean", IMAGENET_MEAN), options.get("std", IMAGENET_STD)
        shorter = None if self.train else self._eval_resize()
        finisher = TorchvisionFinisher if self._dataloader_sampling else HostFinisher
        threads = default_threads(self.num_threads) if finish_threads is None else finish_threads
        self._finisher_threads_streaming = threads
        finisher = finisher(self.size, mean, std, self.fp16, resize_shorter=shorter, threads=threads)
        finisher.dtype = self.dtype  # it allocates its output in this dtype (bfloat16 too)
        return finisher

    def _set_source(self, source: Source, on_bad_image, max_pixels, verify_files, file_stats) -> None:
        """The source the reader reads, and the bookkeeping of bad files (checked now only if asked)."""
        self._health = FileHealth(self.files, self.ids, on_bad_image, max_pixels, self.num_threads, file_stats)
        self._health.prepared = self._files_checked  # a prepared directory's: errors name its tool
        self.source = source
        self.on_bad_image = on_bad_image
        self.max_pixels = max_pixels
        self.bad = self._health.bad  # position in files -> why it is skipped (the same dict)
        # a shard's samples were checked when it was indexed; files are watched before each stream reads them
        if verify_files and self.source.needs_paths:
            self._health.check_all()

    def _decoded_cache(self, cache_decoded: bool | int | str) -> DecodedImages | None:
        """The in-memory decoded images (``cache_decoded``), or None; a combination it cannot serve is an
        error that says why ("auto": streaming, with the reason in the log)."""
        if cache_decoded is False or cache_decoded is None:
            return None
        why = None
        if self.device.type == "cuda":
            why = "the GPU path decodes with nvJPEG; it is for CPU decoding"
        elif self._finisher is None:
            why = "it needs the host finishing (cpu_resize='torch')"
        elif not self.source.ordered_by_loader:
            why = f"the {self.source.name} source reads and shuffles itself; it works with the file source"
        elif self.train and self.pipeline_kwargs.get("color_jitter", 0.0) > 0:
            why = (
                "colour jitter (color_jitter=, or a ColorJitter in the dataset's transform) is applied by DALI "
                "while streaming; drop it or leave cache_decoded off"
            )
        if why and self._cache_auto:
            log.debug("cache_decoded='auto': streaming (%s)", why)
            return None
        if why:
            raise ValueError(f"cache_decoded: {why}")
        if self._cache_auto:
            return self._auto_cache()
        if cache_decoded is True:
            return DecodedImages(self._health, self.num_threads)
        if isinstance(cache_decoded, bool) or not isinstance(cache_decoded, int) or cache_decoded < 1 << 20:
            raise ValueError(
                f"cache_decoded must be 'auto', True, False or a budget in bytes of at least 1 MiB, got "
                f"{cache_decoded!r}"
            )
        return DecodedImages(self._health, self.num_threads, cache_decoded)

    def _auto_cache(self) -> DecodedImages | None:
        """``cache_decoded="auto"``: the decoded images when ``decoded.auto_plan`` finds that they pay, with
        half the memory available now shared by this machine's processes (each holds its own copy: a shuffled
        shard reads every image over the epochs)."""
        local = os.environ.get("LOCAL_WORLD_SIZE", "")
        processes = int(local) if local.isdigit() and int(local) > 0 else self.num_shards
        cache, why = auto_plan(self.files, self.size, self.train, default_budget() // processes)
        log.info("cache_decoded='auto': %s (%s)", "decoding each image once" if cache else "streaming", why)
        # the budget itself is taken when the fill starts, from what is available then
        return DecodedImages(self._health, self.num_threads, share=processes) if cache else None

    @property
    def cache_decoded(self) -> bool:
        """Whether batches come from images decoded once and held in memory (False also once a set
        asked to be cached did not fit and is streamed)."""
        return self._decoded is not None

    @property
    def cached_bytes(self) -> int:
        """Bytes of decoded images held in memory (0 when streaming)."""
        return self._decoded.nbytes if self._decoded is not None else 0

    @property
    def wds_shards(self) -> list[str] | None:
        return self.source.tars if isinstance(self.source, WdsSource) else None

    @property
    def wds_index(self) -> list[str]:
        return self.source.index if isinstance(self.source, WdsSource) else []

    @classmethod
    def from_folder(
        cls, root: str | os.PathLike, *, is_valid_file=None, allow_empty: bool = False, **kwargs
    ) -> ImageLoader:
        """Loader over an ImageFolder tree ``root/<class>/**/<image>``, found by torchvision's own
        ``ImageFolder`` (its class discovery, extensions, order and errors), which becomes ``loader.dataset``.

        Args:
            root: the folder.
            is_valid_file, allow_empty: as ImageFolder takes them.
            **kwargs: ``ImageLoader``'s arguments.
        """
        from torchvision.datasets import ImageFolder

        folder = ImageFolder(str(root), is_valid_file=is_valid_file, allow_empty=allow_empty)
        if not folder.samples:
            raise ValueError(f"{root}: no image files in its class folders")
        files, labels = zip(*folder.samples, strict=True)
        loader = cls(list(files), list(labels), classes=folder.classes, **kwargs)
        folder.transform = loader.torchvision_transform()
        loader.dataset = folder
        return loader

    def torchvision_transform(self):
        """The torchvision transform that does what this loader's pipeline does to one image (PIL image in,
        normalized (3, S, S) tensor of ``dtype`` out). The CPU eval path reproduces its pixels (up to rare
        rounding of one 8-bit level); the train path draws its own random crops and flips."""
        return torchvision_equivalent(self.train, self.size, self.dtype, self.pipeline_kwargs)

    def _eval_resize(self) -> int:
        """Eval: the shorter side before the centre crop."""
        return round(self.size / self.pipeline_kwargs.get("crop_ratio", EVAL_CROP_RATIO))

    @property
    def sampler(self) -> ShardSampler:
        """This process's share of each epoch, as DataLoader code reads it (``len``, ``set_epoch``)."""
        if self._sampler is None:
            self._sampler = ShardSampler(self)
        return self._sampler

    @property
    def batch_sampler(self) -> torch.utils.data.BatchSampler:
        """DataLoader's ``batch_sampler``: ``sampler`` cut into this loader's batches (code that inspects a
        loader, like Lightning's, reads it)."""
        return torch.utils.data.BatchSampler(self.sampler, self.batch_size, self.drop_last)

    # -- the epoch protocol ------------------------------------------------------------------------------
    def __len__(self) -> int:
        """Batches per epoch on this process (the same on every process)."""
        per_rank = self.source.samples_per_shard(len(self.files), self.num_shards)
        if per_rank is None and self._dataloader_sampling:
            per_rank = math.ceil(len(self.files) / self.num_shards)
        if per_rank is not None:
            return per_rank // self.batch_size if self.drop_last else math.ceil(per_rank / self.batch_size)
        return len(self._positions(0)) // self.batch_size

    def _samples_per_rank(self) -> int:
        """This process's share of an epoch: DistributedSampler's ``num_samples`` (with ``drop_last`` the
        loader delivers the whole batches of it); MultimodalLoader: its whole batches."""
        if self._dataloader_sampling or (not self.source.ordered_by_loader and not self.drop_last):
            return math.ceil(len(self.files) / self.num_shards)
        return len(self) * self.batch_size

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order the next ``iter()`` uses (``loader.sampler.set_epoch`` does the same).

        Setting the epoch the loader is already at keeps a position restored by ``load_state_dict`` (so a
        mid-epoch resume survives the usual ``set_epoch`` call at the top of the loop); otherwise the next
        ``iter()`` starts that epoch from its first batch.
        """
        if not self._dataloader_sampling:  # MultimodalLoader: keep whatever position the epoch is at
            if epoch != self.epoch:
                self.epoch, self.step = epoch, 0
            return
        if epoch != self.epoch or not self._keep_position:
            self.epoch, self.step, self._keep_position = epoch, 0, False

    def state_dict(self) -> dict:
        """Position for an exact resume: the epoch, the batches of it already delivered, and DALI's
        checkpoint of the pipeline that will deliver the next one."""
        chunk, ck = None, None
        stream = self._stream
        if stream is not None and stream.at(self.epoch, self.step):
            chunk, ck = stream.chunk, stream.it.checkpoints()[0]  # its state after the last batch returned
        elif self._restore is not None and self._restore.at(self.epoch, self.step):
            chunk, ck = self._restore.chunk, self._restore.checkpoint
        return {
            "epoch": self.epoch,
            "step": self.step,
            "seed": self.seed,
            "num_samples": len(self.files),
            "num_shards": self.num_shards,
            "shard_id": self.shard_id,
            "batch_size": self.batch_size,
            "chunk": chunk,
            "dali_checkpoint": encode_checkpoint(ck),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore a position from ``state_dict()`` (same data, seed, batch size and process count); the
        next ``iter()`` continues from it."""
        keys = ("epoch", "step", "seed", "num_samples", "num_shards", "batch_size")
        missing = [k for k in keys if k not in state]
        if missing:
            raise ValueError(f"not a loader state (from state_dict()): it lacks {', '.join(missing)}")
        for key, mine in (
            ("seed", self.seed),
            ("num_samples", len(self.files)),
            ("num_shards", self.num_shards),
            ("batch_size", self.batch_size),
        ):
            if state[key] != mine:
                raise ValueError(f"cannot resume loader: {key} was {state[key]}, now {mine}")
        self.epoch, self.step = int(state["epoch"]), int(state["step"])
        self._stream, self._restore, self._keep_position = None, None, True
        ck = state.get("dali_checkpoint")
        if ck and state.get("chunk") is not None and state.get("shard_id", self.shard_id) == self.shard_id:
            self._restore = Restore(self.epoch, self.step, state["chunk"], decode_checkpoint(ck))

    def _positions(self, epoch: int) -> np.ndarray:
        """Positions in ``files`` that this process reads in ``epoch``, -1 filling up the last DALI batch."""
        n = len(self.files)
        if not self._dataloader_sampling:
            order = epoch_order(n, epoch, self.seed, self.shuffle)
            return shard_positions(order, self.batch_size, self.shard_id, self.num_shards, self.drop_last)
        mine = distributed_sampler_indices(n, epoch, self.seed, self.shuffle, self.shard_id, self.num_shards)
        whole = len(self) * self.batch_size
        return np.concatenate([mine[:whole], np.full(max(0, whole - len(mine)), -1, dtype=mine.dtype)])

    # -- the DALI stream ---------------------------------------------------------------------------------
    def _open_stream(self, epoch: int, step: int) -> Stream:
        """A DALI iterator whose next batch is batch ``step`` of ``epoch``."""
        restore = self._restore if self._restore is not None and self._restore.at(epoch, step) else None
        self._restore = None
        if self._decoded is not None:
            self._watch(self._positions(epoch)[step * self.batch_size :])
            stream = self._decoded_stream(epoch, step)
            if stream is not None:
                return stream
        checkpoint = restore.checkpoint if restore is not None else None
        if not self.source.ordered_by_loader:  # one reader epoch per loader epoch, positioned by DALI
            stream = Stream(self._iterator(self._pipeline(None, 0, checkpoint)), SELF_ORDERED_CHUNK, epoch, step)
            if restore is None:
                stream.step = 0
                for _ in range(step):  # no checkpoint: re-read and drop what was already delivered
                    next(stream.it)
                stream.step = step
            return stream
        entries = len(self) * self.batch_size
        chunk = restore.chunk if restore is not None else new_chunk(epoch, step, entries)
        positions = self._chunk_positions(chunk)
        part = self._safe_part(positions) if restore is None else None
        if part is not None:  # a file in it not read yet: one epoch in parts DALI parses safely
            chunk = new_chunk(epoch, step, entries, part)
            positions = self._chunk_positions(chunk)
        stream = Stream(None, chunk, epoch, step)
        self._watch(self._upcoming(stream, 0, self._watch_lead()))  # the batches DALI reads first
        stream.it = self._iterator(self._pipeline(positions, chunk["start"], checkpoint, chunk_dali_batch(chunk)))
        return stream

    def _watch_lead(self) -> int:
        """How many batches ahead of the one it hands out next a file stream's files are watched: DALI's
        iterator runs the pipeline ``prefetch`` batches ahead, and its reader loads the files of one more."""
        return self.prefetch + 1

    def _watch(self, positions: np.ndarray) -> bool:
        """Before DALI reads the files at ``positions``: ``FileHealth.watch`` them (those missing or changed
        since they were last known good are decoded again; a bad one is never handed to DALI), and the decoded
        cache drops what changed. True when one of them went bad."""
        if not self.source.needs_paths:  # a shard's samples were checked when it was indexed
            return False
        changed = self._health.watch(positions)
        if changed and self._decoded is not None:
            self._decoded.forget(changed)
        return any(p in self.bad for p in changed)

    def _watch_ahead(self, stream: Stream) -> bool:
        """Watch the files of the batch a file stream will read ``_watch_lead()`` batches after the one it
        hands out next, before DALI reaches it. True when one of them went bad: the rest of this epoch and the
        next are watched at once (so many bad files cost one reopening), and the stream must be reopened
        without them."""
        if not self.source.ordered_by_loader or isinstance(stream.it, DecodedIterator):
            return False  # the decoded cache reads in safe batches; its files are watched each epoch
        lead = self._watch_lead()
        if not self._watch(self._upcoming(stream, lead, lead + 1)):
            return False
        self._watch(self._upcoming(stream, 0, 2 * len(self)))
        return True

    def _upcoming(self, stream: Stream, first: int, stop: int) -> np.ndarray:
        """Positions of the batches ``first`` to ``stop`` - 1 after the stream's next one, within its chunk."""
        n, b = len(self), self.batch_size
        ends = stream.chunk["start"] + stream.chunk["epochs"]
        parts = []
        for k in range(stream.epoch * n + stream.step + first, stream.epoch * n + stream.step + stop):
            epoch, step = divmod(k, n)
            if epoch >= ends:
                break
            if not parts or parts[-1][0] != epoch:
                parts.append((epoch, step, step + 1))
            else:
                parts[-1] = (epoch, parts[-1][1], step + 1)
        empty = np.zeros(0, dtype=np.int64)
        return np.concatenate([empty] + [self._epoch_positions(e)[lo * b : hi * b] for e, lo, hi in parts])

    def _epoch_positions(self, epoch: int) -> np.ndarray:
        """``_positions(epoch)``, kept for the epochs the stream reads (the watch asks for them each batch)."""
        held = self._held_positions
        if epoch not in held:
            if len(held) >= 3:
                held.pop(min(held))
            held[epoch] = self._positions(epoch)
        return held[epoch]

    def _chunk_positions(self, chunk: dict) -> np.ndarray:
        """The positions a chunk's reader reads: its epochs' positions from its first batch on."""
        parts = [self._positions(chunk["start"] + k) for k in range(chunk["epochs"])]
        parts[0] = parts[0][chunk["offset"] * self.batch_size :]
        return np.concatenate(parts)

    def _safe_part(self, positions: np.ndarray) -> int | None:
        """DALI's batch for a chunk reading ``positions``: None (the loader's) when DALI has read each of
        those files before, or preparation decoded them; on the CPU, otherwise, an equal part of the loader's
        batch that DALI parses safely (``DALI_SAFE_BATCH``: a non-image among the files is then skipped, not a
        crash; ~12% slower on 2 cores, so only until each file has been read once)."""
        if self._files_checked or self.device.type != "cpu":
            return None
        read = self._read_ok.copy()
        read[list(self._health.bad)] = True  # a bad file is never handed to DALI again
        if read[positions[positions >= 0]].all():
            return None
        part = dali_batch_size(self.batch_size)
        return part if part != self.batch_size else None

    def _decoded_stream(self, epoch: int, step: int) -> Stream | None:
        """Batch ``step`` of ``epoch`` on from the decoded images (decoded as the batches need them), or None
        when an earlier epoch found that they do not fit in the budget (the loader streams from then on)."""
        if self._drop_decoded_over_budget():
            return None
        options, b = self.pipeline_kwargs, self.batch_size
        positions = self._positions(epoch)[step * b :]
        self._decoded.plan(positions)
        it = DecodedIterator(
            self._decoded,
            positions,
            self.ids,
            b,
            key=(self.seed, self.shard_id, epoch, step),
            train=self.train,
            scale=options.get("scale", (0.08, 1.0)),
            ratio=options.get("ratio", (3 / 4, 4 / 3)),
            flip=options.get("flip", True),
        )
        return Stream(it, {"start": epoch, "offset": step, "epochs": 1}, epoch, step)

    def _drop_decoded_over_budget(self) -> bool:
        """After an epoch that passed the cache's budget: drop it and stream from now on (True)."""
        if self._decoded is None or not self._decoded.over:
            return False
        (log.info if self._cache_auto else log.warning)(
            "cache_decoded: the decoded images need more than the budget of %.1f MiB; streaming them instead",
            self._decoded.budget / 2**20,
        )
        self._decoded.close()
        self._decoded = None
        self._finisher.threads = self._finisher_threads_streaming
        return True

    def _iterator(self, pipe):
        """DALI's iterator over ``pipe`` (a ``_pipeline``): ragged crops for the host finishing, else dense."""
        from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

        if self.source.ordered_by_loader:
            policy = LastBatchPolicy.DROP  # never used: the lists are whole batches
        else:
            policy = LastBatchPolicy.DROP if self.drop_last else LastBatchPolicy.PARTIAL
        kwargs = {
            "reader_name": READER_NAME,
            "auto_reset": False,
            "last_batch_policy": policy,
            "prepare_first_batch": False,
        }
        if self._finisher is not None:  # ragged crops, finished on the host in _batches
            return ragged_iterator(pipe, **kwargs)
        return DALIGenericIterator(pipe, ["image", "id"], **kwargs)

    def _pipeline(
        self,
        positions: np.ndarray | None,
        seed_epoch: int,
        checkpoint: bytes | None = None,
        dali_batch: int | None = None,
    ):
        """The DALI graph reading ``positions`` (None: a source that orders itself), defined but not built;
        ``dali_batch``: its batch, a divisor of the loader's (default: the loader's).

        Defining checks every operator's argument names without touching CUDA, so tests define the GPU
        ("mixed") graph on machines without a GPU.
        """
        read = self.source.reader(positions, self._health, self.shard_id, self.num_shards, self.shuffle)
        cuda = self.device.type == "cuda"
        dali_batch = dali_batch or self.batch_size
        return image_pipeline(
            read=read,
            train=self.train,
            size=self.size,
            decode_device="mixed" if cuda else "cpu",
            fp16=self.fp16,  # bfloat16: the graph emits float32, converted in __iter__
            finish_on_host=self._finisher is not None,
            **self.pipeline_kwargs,
            batch_size=dali_batch,
            num_threads=self.num_threads,
            device_id=self.device.index if cuda else None,
            seed=int(np.random.default_rng([self.seed, seed_epoch, self.shard_id]).integers(2**31)),
            prefetch_queue_depth=self.prefetch * (self.batch_size // dali_batch),  # the same samples ahead
            enable_checkpointing=True,
            checkpoint=checkpoint,
        )

    @property
    def skipped(self) -> list[dict]:
        """The samples served masked because their image is missing or undecodable."""
        return self._health.skipped

    def _recover(self, error: RuntimeError) -> Stream:
        """DALI failed on a batch: find the file(s) it could not read among the next batches, mark them,
        and reopen the stream at the same position. Re-raises when no file is to blame."""
        if not self.source.can_skip_bad:
            raise self.source.read_error(error) from error
        window = self._positions(self.epoch)[self.step * self.batch_size :][
            : (self.prefetch + 2) * self.batch_size
        ]
        if not self._health.check_window(window):
            raise DaliFailure(
                f"DALI failed on batch {self.step} of epoch {self.epoch}, whose files each decode on their own "
                f"({_first_line(error)}); the usual cause is memory: this process's limit (ulimit -v, a cgroup's) "
                "or the machine's. Lower the batch size or the number of threads (--batch-size / --num-threads, "
                "batch_size= / num_workers=)"
            ) from error
        self._stream = None
        return self._open_stream(self.epoch, self.step)

    def _lookup(self, ids: np.ndarray) -> np.ndarray:
        """Positions in ``files`` of the given sample ids (-1 stays -1)."""
        found = self._id_sorter[np.searchsorted(self.ids, ids, sorter=self._id_sorter).clip(0, len(self.ids) - 1)]
        return np.where(ids >= 0, found, -1)

    def _batches(
        self, generation: int | None = None
    ) -> Iterator[tuple[torch.Tensor, np.ndarray, np.ndarray, int]]:
        """(images on the DALI output device, sample ids as numpy, their positions in ``files`` (-1 for
        padding and stand-ins), the batch's index in the epoch) for the rest of the current epoch; whole
        batches (B, ...).

        Counts a batch as delivered (``self.step``) when it is handed out, so a consumer that stops early
        leaves the loader at the right position. ``generation``: raise when another ``iter()`` has begun.
        """
        n = len(self)
        if self.step >= n:  # restored at the very end of an epoch
            self.epoch, self.step = self.epoch + 1, 0
            return
        if self._stream is None or not self._stream.at(self.epoch, self.step):
            self._stream = self._open_stream(self.epoch, self.step)
        stream = self._stream
        while self.step < n:
            if generation is not None and generation != self._generation:
                raise RuntimeError(
                    f"this iterator of {type(self).__name__} was replaced by a newer iter(loader): the loader "
                    "runs one epoch at a time (its DALI pipeline is shared), so an older iterator cannot go on; "
                    "finish or drop one before starting the next"
                )
            if self._watch_ahead(stream):  # a file DALI is about to read went bad: reopen without it
                stream = self._stream = self._open_stream(self.epoch, self.step)
            try:
                out = self._next_dali_batch(stream)
            except RuntimeError as e:  # DALI aborts the whole pipeline on one file it cannot read
                stream = self._stream = self._recover(e)
                continue
            ids = out["id"].view(-1).numpy().astype(np.int64)  # the reader's labels stay on the host
            pos = self._lookup(ids)
            self._read_ok[pos[pos >= 0]] = True
            if self._finisher is not None:
                images = self._finisher.finish(out)  # (B, 3, S, S)
            else:
                images = out["image"]  # (B, 3, S, S)
            step = self.step
            stream.step += 1
            self.step += 1
            yield images, ids, pos, step
        self._end_epoch()

    def _next_dali_batch(self, stream: Stream) -> dict:
        """The next batch's DALI output (one dict: DALI's iterator returns one per pipeline, we run one): one DALI
        batch, or the parts of it the stream's chunk runs DALI on, joined."""
        if isinstance(stream.it, DecodedIterator):  # whole batches from memory
            return next(stream.it)[0]
        parts = [
            next(stream.it)[0] for _ in range(self.batch_size // chunk_dali_batch(stream.chunk, self.batch_size))
        ]
        if len(parts) == 1:
            return parts[0]
        return {
            key: [x for p in parts for x in p[key]]
            if isinstance(value, list)
            else torch.cat([p[key] for p in parts])
            for key, value in parts[0].items()
        }

    def _end_epoch(self) -> None:
        """The logical epoch is over; the stream moves on to the next one (or ends with its chunk)."""
        stream = self._stream
        if stream is not None and stream.at(self.epoch, len(self)):
            stream.epoch, stream.step = stream.epoch + 1, 0
            if not self.source.ordered_by_loader:
                stream.it.reset()  # DALI's reader epoch ended with ours
            elif stream.chunk_ends_at(stream.epoch):
                self._stream = None  # the chunk is consumed
        self.epoch, self.step = self.epoch + 1, 0
        self._drop_decoded_over_budget()

    def __iter__(self) -> Iterator[Batch | dict[str, torch.Tensor]]:
        """One epoch of batches: the epoch ``set_epoch`` selected, else the one after the last; a restored
        position (``load_state_dict``) continues, and an epoch left by a ``break`` is not resumed."""
        if self.step >= len(self):  # the last batch was taken, but the loop never asked for more
            self._end_epoch()
        elif self.step > 0 and not self._keep_position:  # an earlier loop stopped mid-epoch
            self.epoch, self.step = self.epoch + 1, 0
        self._keep_position = False
        self._generation += 1
        return self._epoch(self._generation)

    def _epoch(self, generation: int) -> Iterator[Batch | dict[str, torch.Tensor]]:
        n, per_rank, b = len(self.files), self._samples_per_rank(), self.batch_size
        for images, ids, pos, step in self._batches(generation):
            if per_rank - step * b < len(ids):  # DataLoader's partial last batch: cut DALI's filler off
                keep = per_rank - step * b
                images, ids, pos = images[:keep], ids[:keep], pos[:keep]
            labels = np.where(pos >= 0, self.labels[pos], IGNORE_LABEL)
            mask = ids >= 0  # not a skipped image ...
            if self.source.ordered_by_loader:  # ... nor a repeat that fills up a shard
                mask &= self.shard_id + (step * b + np.arange(len(ids))) * self.num_shards < n
            if images.dtype != self.dtype:  # bfloat16 from a graph that emits float32
                images = images.to(self.dtype)
            tensors = [images, torch.from_numpy(labels), torch.from_numpy(ids), torch.from_numpy(mask)]
            if self._pin:
                tensors = [t.pin_memory() for t in tensors]
            images, labels, ids, mask = (t.to(self.device, non_blocking=True) for t in tensors)
            if self.as_dict:
                yield {"image": images, "label": labels, "id": ids, "mask": mask}
            else:
                yield Batch.of(images, labels, ids, mask)


def _integer_labels(labels, n: int) -> np.ndarray:
    """``labels`` as int64 (zeros when None); a label that is not a whole number (0.7, NaN, "cat") is an error
    naming it (numpy's cast would truncate 0.7 to class 0)."""
    if labels is None:
        return np.zeros(n, dtype=np.int64)
    given = np.asarray(labels)
    if given.dtype.kind in "iub":
        return given.astype(np.int64)
    if given.dtype.kind == "f":
        bad = np.flatnonzero(~np.isfinite(given) | (given != np.round(given)))
        if not len(bad):
            return given.astype(np.int64)
        k = int(bad[0])
        raise ValueError(f"labels must be integer class ids; label {k} is {float(given.reshape(-1)[k])}")
    raise ValueError(f"labels must be integer class ids (map class names to ids first), got {given.dtype} values")


def _process_layout(accelerator, shard_id: int | None, num_shards: int | None, device) -> tuple:
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


def _check_batch(batch_size: int, n: int, num_shards: int, size: int, max_pixels: int) -> None:
    """Refuse sizes whose memory would blow up: a batch padded far past the samples (DALI runs whole batches),
    an output image over the decoded-pixel budget."""
    per_rank = math.ceil(n / num_shards)
    if batch_size > max(per_rank, MAX_PADDED_BATCH):
        raise ValueError(
            f"batch_size {batch_size} is larger than the {per_rank} samples of each process; pass at most "
            f"{per_rank} (one batch of all of them)"
        )
    if size * size > max_pixels:
        raise ValueError(
            f"size {size} makes {size}x{size} = {size * size / 1e6:.0f} MP output images, over the "
            f"{max_pixels / 1e6:g} MP budget (max_pixels); pass a smaller size"
        )


def _check_int(name: str, value) -> None:
    """``value`` is an int (numpy's too), not a bool, float or string: numpy would slice with it later."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be an int, got {value!r}")


def _check_sizes(
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
        _check_int(name, value)
    if isinstance(size, tuple | list):
        raise TypeError(f"size must be one int (square outputs, the side in pixels), got {size!r}")
    _check_int("size", size)
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
