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

from mmfast.data.validate import DEFAULT_MAX_PIXELS
from mmfast.loading.arguments import EngineReading, LoaderOptions, LoaderSettings, checked_samples
from mmfast.loading.cache_plan import CachePlan, decoded_images_for
from mmfast.loading.decoded import DecodedImages
from mmfast.loading.dropin import (
    Batch,
    ImageFiles,
    dataloader_batches,
    from_dataset,
    loader_from_folder,
    split_options,
)
from mmfast.loading.epoch_reader import EpochReader, refuse_forked
from mmfast.loading.file_health import FileHealth
from mmfast.loading.host_finish import default_threads, make_finisher
from mmfast.loading.sampling import DATALOADER, Layout, ShardSampler
from mmfast.loading.sources import FilesSource, Source, WdsSource
from mmfast.loading.transforms import torchvision_equivalent

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
            found = from_dataset(folder, labels, batch_size, size, train, dtype, fp16, classes, pipeline_kwargs)
            files, labels, classes, batch_size, size, train, dtype = found
        settings = LoaderSettings.resolved(
            batch_size=batch_size,
            shuffle=shuffle,
            drop_last=drop_last,
            train=train,
            size=size,
            dtype=dtype,
            fp16=fp16,
            device=device,
            num_workers=num_workers,
            seed=seed,
            shard_id=shard_id,
            num_shards=num_shards,
            accelerator=accelerator,
            prefetch=prefetch,
            prefetch_factor=prefetch_factor,
            pipeline_kwargs=pipeline_kwargs,
            on_bad_image=on_bad_image,
            verify_files=verify_files,
            max_pixels=max_pixels,
            cpu_resize=cpu_resize,
            cache_decoded=cache_decoded,
            eval_geometry=eval_geometry,
            files_checked=files_checked,
            finish_threads=finish_threads,
        )
        reading = reading or EngineReading(None, DATALOADER)  # the drop-in's: DataLoader's order
        source = reading.source or (WdsSource(wds_shards, wds_index) if wds_shards else FilesSource())
        self._start(files, labels, ids, settings, reading, source, folder, classes, as_dict, pin_memory)

    @classmethod
    def from_options(
        cls,
        files: Sequence[str],
        labels,
        ids,
        options: LoaderOptions,
        reading: EngineReading,
        *,
        accelerator,
        max_pixels: int,
        default_dtype: torch.dtype,
    ) -> ImageLoader:
        """The training engine's loader: ``files`` (with their ``labels`` and ``ids``) read as ``reading`` says,
        batched and augmented as ``options`` say (one typed object, resolved to the loader's
        ``LoaderSettings`` whole: ``LoaderOptions.settings``), on this process of ``accelerator``."""
        loader = cls.__new__(cls)
        loader.dataloader_options = {}
        settings = options.settings(accelerator, max_pixels, default_dtype)
        loader._start(files, labels, ids, settings, reading, reading.source or FilesSource(), None, None)
        return loader

    def _start(
        self,
        files,
        labels,
        ids,
        settings: LoaderSettings,
        reading: EngineReading,
        source: Source,
        folder,
        classes,
        as_dict: bool = False,
        pin_memory: bool = False,
    ) -> None:
        """The body both ways of making a loader share: the samples checked, the ``settings`` checked against
        them and kept, the batches' form, the order, the source and its bad files, the reader, and
        ``.dataset``."""
        self.files, self.labels, self.ids = checked_samples(files, labels, ids)
        self.settings = settings.checked(len(self.files), reading.image_sizes)
        self.as_dict, self.pin_memory = as_dict, pin_memory
        # Pinning needs CUDA; DataLoader ignores the flag without it, and so does this loader.
        self.pins_memory = bool(pin_memory) and self.device.type == "cpu" and torch.cuda.is_available()
        self.sampling = reading.sampling
        self._set_source(source, reading.file_stats)
        self._set_reading()
        self._set_dataset(folder, classes)
        self._sampler: ShardSampler | None = None
        self._keep_position = False  # a restored position the next iter() continues from
        self._generation = 0  # bumped by each iter(): an older iterator raises if it is advanced again
        self._pid = os.getpid()  # a forked child cannot read through this process's pipelines and threads

    # -- the settings, as DataLoader code and the engine read them ----------------------------------------
    batch_size = property(lambda self: self.settings.batch_size)
    shuffle = property(lambda self: self.settings.shuffle)
    drop_last = property(lambda self: self.settings.drop_last)
    seed = property(lambda self: self.settings.seed)
    train = property(lambda self: self.settings.train)
    size = property(lambda self: self.settings.size)
    dtype = property(lambda self: self.settings.dtype)
    fp16 = property(lambda self: self.settings.fp16)
    device = property(lambda self: self.settings.device)
    num_threads = property(lambda self: self.settings.num_threads)
    num_workers = property(lambda self: self.settings.num_workers or 0)  # DataLoader's attribute, as given
    shard_id = property(lambda self: self.settings.shard_id)
    num_shards = property(lambda self: self.settings.num_shards)
    prefetch = prefetch_factor = property(lambda self: self.settings.prefetch)
    pipeline_kwargs = property(lambda self: self.settings.pipeline_kwargs)
    on_bad_image = property(lambda self: self.settings.on_bad_image)
    max_pixels = property(lambda self: self.settings.max_pixels)
    files_checked = property(lambda self: self.settings.files_checked)
    image_sizes = property(lambda self: self.settings.image_sizes)

    def _set_reading(self) -> None:
        """How the batches are made: the decoded cache (as planned), the host finishing of CPU-decoded crops and
        its threads, and the reader of the DALI stream (handed the settings whole)."""
        s = self.settings
        shorter = None if s.train else s.eval_resize()
        threads = default_threads(s.num_threads) if s.finish_threads is None else s.finish_threads
        self.finisher = make_finisher(
            s.cpu_resize, s.eval_geometry, s.device, s.size, s.pipeline_kwargs, s.dtype, shorter, threads
        )
        decoded = decoded_images_for(s.cache_decoded, self)
        if decoded is not None and s.finish_threads is None:
            self.finisher.threads = s.num_threads  # the DALI threads will not be decoding
        positions = functools.partial(self.sampling.positions, self.layout, self.source)  # no reference to self
        reader = EpochReader(s, self.source, self.health, self.finisher, decoded, self.ids, positions, len(self))
        self._reader = reader

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

    def _set_source(self, source: Source, file_stats) -> None:
        """The source the reader reads, and the bookkeeping of bad files (checked now only if asked)."""
        s = self.settings
        self.health = FileHealth(self.files, self.ids, s.on_bad_image, s.max_pixels, s.num_threads, file_stats)
        self.health.prepared = s.files_checked  # a prepared directory's: errors name its command
        self.health.instead = getattr(source, "instead", "")  # a files source's other home for the images
        self.source = source
        if hasattr(source, "bind"):  # a source that orders by shard needs each position's sample id
            source.bind(self.ids)
        self.bad = self.health.bad  # position in files -> why it is skipped (the same dict)
        # a shard's samples were checked when it was indexed; files are watched before each stream reads them
        if s.verify_files and self.source.needs_paths:
            self.health.check_all()

    @property
    def holds_decoded(self) -> bool:
        """Whether batches come from images decoded once and held in memory (False also once a set
        asked to be cached did not fit and is streamed)."""
        return self.decoded_images is not None

    @property
    def layout(self) -> Layout:
        """What the sampling needs of this loader."""
        return self.settings.layout(len(self.files))

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
        if epoch != self.epoch or not self._keep_position:
            self.epoch, self.step, self._keep_position = epoch, 0, False

    def state_dict(self) -> dict:
        """Position for an exact resume: the epoch, the batches of it already delivered, and DALI's
        checkpoint of the pipeline that will deliver the next one (``EpochReader.state_dict``)."""
        return self._reader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Restore a position from ``state_dict()`` (same data, seed, batch size and process count); the
        next ``iter()`` continues from it."""
        self._reader.load_state_dict(state)
        self._keep_position = True

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
        refuse_forked(self, self._pid)
        current = None if generation is None else (lambda: generation == self._generation)
        return self._reader.batches(current, type(self).__name__)

    def _end_epoch(self) -> None:
        self._reader.end_epoch()

    def __iter__(self) -> Iterator[Batch | dict[str, torch.Tensor]]:
        """One epoch of batches: the epoch ``set_epoch`` selected, else the one after the last; a restored
        position (``load_state_dict``) continues, and an epoch left by a ``break`` is not resumed."""
        return dataloader_batches(self, self.begin_iteration())

    def begin_iteration(self) -> int:
        """What an ``iter()`` does before its first batch (also for loaders built on this one): move to the
        epoch it reads, as ``__iter__`` says; returns its generation, for ``raw_batches``."""
        refuse_forked(self, self._pid)
        if self._keep_position:  # restored: the rest of its epoch (none, when it was saved after the last batch)
            self._keep_position = False
        elif self.step >= len(self):  # the last batch was taken, but the loop never asked for more
            self._end_epoch()
        elif self.step > 0:  # an earlier loop stopped mid-epoch
            self.epoch, self.step = self.epoch + 1, 0
        self._generation += 1
        return self._generation
