"""``ImageLoader``: one process's epochs of image batches decoded and augmented by DALI, as a drop-in for a
torch DataLoader over image files. It checks its arguments (``arguments``, ``dropin``), plans its decoded cache
(``cache_plan``), and runs DataLoader's epoch protocol (``len``, ``iter``, ``set_epoch``, ``state_dict``) over
an ``epoch_reader.EpochReader``, which reads the DALI stream of its source (``sources``) in the order of its
sampling strategy (``sampling``: DataLoader's by default; the training engine's whole batches for the
``MultimodalLoader`` that holds one), watching files (``file_health``) and finishing crops (``host_finish``).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from mmfast.data.batch import IGNORE_LABEL
from mmfast.data.preprocessing import EVAL_CROP_RATIO
from mmfast.data.validate import DEFAULT_MAX_PIXELS
from mmfast.loading.arguments import (
    EngineReading,
    check_batch,
    check_sizes,
    checked_image_sizes,
    checked_samples,
    process_layout,
)
from mmfast.loading.cache_plan import CachePlan, decoded_images_for
from mmfast.loading.decoded import DecodedImages
from mmfast.loading.device import resolve_device, resolve_dtype
from mmfast.loading.dropin import (
    Batch,
    ImageFiles,
    from_dataset,
    loader_from_folder,
    split_options,
    torchvision_equivalent,
)
from mmfast.loading.epoch_reader import EpochReader, ReadSettings
from mmfast.loading.file_health import FileHealth
from mmfast.loading.host_finish import default_threads, make_finisher
from mmfast.loading.sampling import DATALOADER, Layout, ShardSampler
from mmfast.loading.sources import FilesSource, Source, WdsSource

log = logging.getLogger(__name__)


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
        on_bad_image: what to do with an image that is missing or cannot be decoded: "skip" (log it, count
            it in ``skipped``, and serve a masked sample in its place: id -1, label -100, mask False, so batch
            sizes and the other samples' order stay the same on every rank) or "error" (raise, naming the
            file).
        verify_files: also check every file at start-up (default off: each batch's files are stat'ed anyway
            just before DALI reads them, ``file_health.FileHealth.watch``; the missing, empty, non-regular and
            changed ones are decoded again, and handled as ``on_bad_image`` says).
        max_pixels: decoded-pixel budget per image, checked from the header of a file seen for the first time
            (without recorded stats) or checked again (one over it is a bad image): what bounds the decoder's
            memory.
        cpu_resize: who resizes, flips and normalizes the decoded crops when decoding on the CPU: "torch"
            (the consuming thread, ``mmfast.loading.host_finish``: faster, docs/benchmarks/; the eval path
            reproduces torchvision's Resize + CenterCrop pixels) or "dali" (in the graph). The GPU path always
            does it in DALI.
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
        reading: an engine's source, order, recorded file stats and image sizes (``arguments.EngineReading``:
            what ``MultimodalLoader`` and predict read); default: ``files`` (or ``wds_shards``) in DataLoader +
            DistributedSampler's order, partial last batches.
        eval_geometry: the eval resize + centre crop's rounding on the host: "torchvision" (default:
            torchvision's ``Resize`` + ``CenterCrop`` pixels) or "dali" (the graph's, as the GPU path does).
        files_checked: every file was decoded before (a prepared directory's): DALI runs whole batches from
            the first epoch, and errors say to prepare the data again.
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
        on_bad_image: str = "skip",
        verify_files: bool = False,
        max_pixels: int = DEFAULT_MAX_PIXELS,
        cpu_resize: str = "torch",
        finish_threads: int | None = None,
        cache_decoded: bool | int | str | CachePlan = "auto",
        eval_geometry: str = "torchvision",
        files_checked: bool = False,
        reading: EngineReading | None = None,
        **options,
    ):
        self.dataloader_options, pipeline_kwargs = split_options(type(self).__name__, options)
        folder = files if isinstance(files, torch.utils.data.Dataset) else None
        if folder is not None:  # DataLoader(dataset, ...) -> ImageLoader(dataset, ...)
            files, labels, classes, batch_size, size, train, dtype = from_dataset(
                folder,
                labels,
                batch_size=batch_size,
                size=size,
                train=train,
                dtype=dtype,
                fp16=fp16,
                classes=classes,
                pipeline_kwargs=pipeline_kwargs,
            )
        shard_id, num_shards, device = process_layout(accelerator, shard_id, num_shards, device)
        size = 224 if size is None else size
        prefetch = check_sizes(batch_size, shard_id, num_shards, size, num_workers, prefetch, prefetch_factor)
        self.files, self.labels, self.ids = checked_samples(files, labels, ids)
        check_batch(batch_size, len(self.files), num_shards, size, max_pixels, drop_last)
        self._set_settings(batch_size, shuffle, drop_last, train, size, dtype, fp16, device, num_workers, seed)
        reading = reading or EngineReading(None, DATALOADER)  # the drop-in's: DataLoader's order
        self.image_sizes = checked_image_sizes(reading.image_sizes, len(self.files))
        self.sampling, self.files_checked, self.as_dict = reading.sampling, files_checked, as_dict
        # Pinning needs CUDA; DataLoader ignores the flag without it, and so does this loader.
        self.pin_memory = pin_memory
        self.pins_memory = bool(pin_memory) and self.device.type == "cpu" and torch.cuda.is_available()
        self.shard_id, self.num_shards = shard_id, num_shards
        self.prefetch = self.prefetch_factor = prefetch
        self.pipeline_kwargs = pipeline_kwargs
        source = reading.source or (WdsSource(wds_shards, wds_index) if wds_shards else FilesSource())
        self._set_source(source, on_bad_image, max_pixels, verify_files, reading.file_stats)
        self._set_reading(cache_decoded, cpu_resize, eval_geometry, finish_threads)
        self._set_dataset(folder, classes)
        self._sampler: ShardSampler | None = None
        self._keep_position = False  # a restored position the next iter() continues from
        self._generation = 0  # bumped by each iter(): an older iterator raises if it is advanced again

    def _set_settings(self, batch_size, shuffle, drop_last, train, size, dtype, fp16, device, num_workers, seed):
        self.batch_size, self.shuffle, self.drop_last, self.seed = batch_size, bool(shuffle), drop_last, seed
        self.train = self.shuffle if train is None else train
        self.size = size
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, fp16, torch.float32)
        self.fp16 = self.dtype == torch.float16
        self.num_threads = num_workers or os.cpu_count() or 1
        self.num_workers = num_workers or 0  # DataLoader's attribute, as given

    def _set_reading(self, cache_decoded, cpu_resize: str, eval_geometry: str, finish_threads: int | None) -> None:
        """How the batches are made: the decoded cache (as planned), the host finishing of CPU-decoded crops and
        its threads, and the reader of the DALI stream."""
        shorter = None if self.train else self._eval_resize()
        threads = default_threads(self.num_threads) if finish_threads is None else finish_threads
        self.finisher = make_finisher(
            cpu_resize, eval_geometry, self.device, self.size, self.pipeline_kwargs, self.dtype, shorter, threads
        )
        decoded = decoded_images_for(cache_decoded, self)
        if decoded is not None and finish_threads is None:
            self.finisher.threads = self.num_threads  # the DALI threads will not be decoding
        settings = ReadSettings.of(self, cache_auto=isinstance(cache_decoded, str) and cache_decoded == "auto")
        positions = functools.partial(self.sampling.positions, self.layout, self.source)  # no reference to self
        self._reader = EpochReader(
            settings, self.source, self.health, self.finisher, decoded, self.ids, positions, len(self)
        )

    def _set_dataset(self, folder, classes) -> None:
        """``.dataset`` and ``.classes`` as DataLoader code reads them: the torchvision dataset given, else a
        dataset view of the files."""
        # its transform is made when first used: importing torchvision's transforms takes seconds
        make_transform = functools.partial(
            torchvision_equivalent, self.train, self.size, self.dtype, self.pipeline_kwargs
        )
        self.dataset = ImageFiles(self.files, self.labels, classes, make_transform) if folder is None else folder
        self.classes = list(classes) if classes is not None else self.dataset.classes

    def __reduce__(self):
        raise TypeError(
            f"{type(self).__name__} cannot be pickled or copied (it holds a live DALI pipeline); build one in "
            "each process, and save its position with state_dict()"
        )

    # -- the position, the decoded images and the DALI graph: the reader's ------------------------------
    epoch = property(lambda self: self._reader.epoch, doc="The epoch the loader is at.")
    step = property(lambda self: self._reader.step, doc="Batches of the current epoch already delivered.")

    @epoch.setter
    def epoch(self, epoch: int) -> None:
        self._reader.epoch = epoch

    @step.setter
    def step(self, step: int) -> None:
        self._reader.step = step

    @property
    def decoded_images(self) -> DecodedImages | None:
        """The images held decoded (``mmfast.loading.decoded``), or None when streaming."""
        return self._reader.decoded

    @property
    def files_read(self) -> np.ndarray:
        """Per position in ``files``: DALI has read it without failing."""
        return self._reader.files_read

    def dali_part(self, positions: np.ndarray) -> int | None:
        """The DALI batch a stream reading ``positions`` would run (None: the loader's): a part of it while
        some of those files have not been read once (``EpochReader.dali_part``)."""
        return self._reader.dali_part(positions)

    def define_pipeline(self, positions: np.ndarray | None, seed_epoch: int, checkpoint=None, dali_batch=None):
        """The DALI graph the loader would read ``positions`` with, defined but not built (defining checks
        every operator's argument names without touching CUDA: tests define the GPU graph on any machine)."""
        return self._reader.define_pipeline(positions, seed_epoch, checkpoint, dali_batch)

    def _set_source(self, source: Source, on_bad_image, max_pixels, verify_files, file_stats) -> None:
        """The source the reader reads, and the bookkeeping of bad files (checked now only if asked)."""
        self.health = FileHealth(self.files, self.ids, on_bad_image, max_pixels, self.num_threads, file_stats)
        self.health.prepared = self.files_checked  # a prepared directory's: errors name its command
        self.source, self.on_bad_image, self.max_pixels = source, on_bad_image, max_pixels
        if hasattr(source, "bind"):  # a source that orders by shard needs each position's sample id
            source.bind(self.ids)
        self.bad = self.health.bad  # position in files -> why it is skipped (the same dict)
        # a shard's samples were checked when it was indexed; files are watched before each stream reads them
        if verify_files and self.source.needs_paths:
            self.health.check_all()

    @property
    def holds_decoded(self) -> bool:
        """Whether batches come from images decoded once and held in memory (False also once a set
        asked to be cached did not fit and is streamed)."""
        return self.decoded_images is not None

    @property
    def layout(self) -> Layout:
        """What the sampling needs of this loader."""
        return Layout(
            len(self.files),
            self.batch_size,
            self.shard_id,
            self.num_shards,
            self.seed,
            self.shuffle,
            self.drop_last,
        )

    @property
    def cached_bytes(self) -> int:
        """Bytes of decoded images held in memory (0 when streaming)."""
        return self.decoded_images.nbytes if self.decoded_images is not None else 0

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
        return loader_from_folder(cls, root, is_valid_file, allow_empty, kwargs)

    def torchvision_transform(self):
        """The torchvision transform that does what this loader's pipeline does to one image (PIL image in,
        normalized (3, S, S) tensor of ``dtype`` out). The CPU eval path reproduces its pixels (up to rare
        rounding of one 8-bit level); the train path draws its own random crops and flips."""
        return torchvision_equivalent(self.train, self.size, self.dtype, self.pipeline_kwargs)

    def _eval_resize(self) -> int | None:
        """Eval: the shorter side before the centre crop; None for ``resize_mode="squash"`` (to S x S, no crop)."""
        if self.pipeline_kwargs.get("resize_mode", "shortest") == "squash":
            return None
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
        return self.sampling.batches(self.layout, self.source)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order the next ``iter()`` uses (``loader.sampler.set_epoch`` does the same).

        Setting the epoch the loader is already at keeps a position restored by ``load_state_dict`` (so a
        mid-epoch resume survives the usual ``set_epoch`` call at the top of the loop); otherwise the next
        ``iter()`` starts that epoch from its first batch.
        """
        if self.sampling.set_epoch_keeps_any_position:  # the engine's: whatever position the epoch is at
            if epoch != self.epoch:
                self.epoch, self.step = epoch, 0
            return
        if epoch != self.epoch or not self._keep_position:
            self.epoch, self.step, self._keep_position = epoch, 0, False

    def state_dict(self) -> dict:
        """Position for an exact resume: the epoch, the batches of it already delivered, and DALI's
        checkpoint of the pipeline that will deliver the next one."""
        expected = self._resume_keys()
        return {
            "epoch": self.epoch,
            "step": self.step,
            **expected,
            "shard_id": self.shard_id,
            **self._reader.checkpoint(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore a position from ``state_dict()`` (same data, seed, batch size and process count); the
        next ``iter()`` continues from it."""
        missing = [k for k in ("epoch", "step", *self._resume_keys()) if k not in state]
        if missing:
            raise ValueError(f"not a loader state (from state_dict()): it lacks {', '.join(missing)}")
        for key, mine in self._resume_keys().items():
            if state[key] != mine:
                raise ValueError(f"cannot resume loader: {key} was {state[key]}, now {mine}")
        self._keep_position = True
        self._reader.restore_position(state, same_shard=state.get("shard_id", self.shard_id) == self.shard_id)

    def _resume_keys(self) -> dict:
        """What a saved position must agree on with this loader."""
        return {
            "seed": self.seed,
            "num_samples": len(self.files),
            "num_shards": self.num_shards,
            "batch_size": self.batch_size,
        }

    def positions(self, epoch: int) -> np.ndarray:
        """Positions in ``files`` that this process reads in ``epoch``, -1 filling up the last DALI batch."""
        return self.sampling.positions(self.layout, self.source, epoch)

    @property
    def skipped(self) -> list[dict]:
        """The samples served masked because their image is missing or undecodable."""
        return self.health.skipped

    def raw_batches(
        self, generation: int | None = None
    ) -> Iterator[tuple[torch.Tensor, np.ndarray, np.ndarray, int]]:
        """The rest of the current epoch as DALI delivers it, for loaders built on this one
        (``MultimodalLoader``): (images on the DALI output device (B, 3, S, S), sample ids as numpy, their
        positions in ``files`` (-1 for padding and stand-ins), the batch's index in the epoch); whole batches.
        ``generation``: raise when another ``iter()`` has begun."""
        current = None if generation is None else (lambda: generation == self._generation)
        return self._reader.batches(current, type(self).__name__)

    def _end_epoch(self) -> None:
        self._reader.end_epoch()

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
        layout, b = self.layout, self.batch_size
        n, per_rank = self.sampling.epoch_size(layout), self.sampling.samples_per_rank(layout, self.source)
        for images, ids, pos, step in self.raw_batches(generation):
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
            if self.pins_memory:
                tensors = [t.pin_memory() for t in tensors]
            images, labels, ids, mask = (t.to(self.device, non_blocking=True) for t in tensors)
            if self.as_dict:
                yield {"image": images, "label": labels, "id": ids, "mask": mask}
            else:
                yield Batch.of(images, labels, ids, mask)
