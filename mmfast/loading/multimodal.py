"""``MultimodalLoader``: one split of a prepared dataset, its images (an ``ImageLoader`` with the engine's
whole-batch sampling) joined with its cached tokens (a ``TokenCache``) by sample id: the training
engine's loader (its keywords one typed ``arguments.LoaderOptions`` there), and predict's over rows never
prepared (``MultimodalLoader.join``)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from mmfast.data.batch import IGNORE_LABEL
from mmfast.data.dataset import WDS_DIR, PreparedDataset
from mmfast.data.token_cache import TokenCache, padded_width
from mmfast.loading.arguments import EngineReading, LoaderOptions
from mmfast.loading.image_loader import ImageLoader
from mmfast.loading.sampling import WHOLE_BATCHES, WholeBatchOrder
from mmfast.loading.sources import prepared_source
from mmfast.util.commands import PREPARE

if TYPE_CHECKING:
    from mmfast.data.dataset import SplitTable
    from mmfast.loading.sources import Source
    from mmfast.remote.shard_cache import ShardCache


class MultimodalLoader:
    """One split of a prepared dataset: DALI images joined with cached tokens by sample id.

    Batches: ``{"image": (B, 3, S, S), "input_ids": (B, L), "attention_mask": (B, L), "label": (B,),
    "id": (B,)}`` on the training device, L = the longest caption in the batch (see ``text_padding``). Padding
    samples of the last eval batch have id -1, label -100 and an all-zero attention mask.

    Args:
        data_dir: a directory written by mmfast-prepare, or a ``PreparedDataset`` of one.
        split: "train" or "val".
        batch_size: per process, as in Accelerate.
        shuffle, drop_last, train: default True for "train", False otherwise.
        accelerator: take shard_id / num_shards / device from an ``accelerate.Accelerator``.
        source: "files" (the split's image files), "wds" (its WebDataset shards through DALI's reader, see
            ``prepare.wds_export``) or "stream" (the shards member by member in the loader's order:
            ``loading.stream_source``); a dataset prepared from WebDataset shards is always read from them,
            and streamed when they are remote (``sources.choose_source``).
        shard_cache: the ``remote.shard_cache.ShardCache`` remote shards are held in while streamed.
        sampling: ``WHOLE_BATCHES``, or another whole-batch order (``sampling.MixedOrder``: a mix's
            sources by weight; a mix's batches then carry "source", each sample's source, -1 when masked).
        text_padding: the width L of a batch's tokens: "longest" (its longest caption), "buckets" (the next
            power of two from 8, at most max_length: a few shapes, for a compiled step) or "max" (max_length).
        verify_files: also check every image file at start-up (see ``ImageLoader``: each batch's files are
            compared with what preparation recorded just before they are read anyway); default off.
        image_sizes: (height, width) of each image as decoded (default: what preparation recorded, when it did;
            None: the train crops' windows are computed in the graph).
        **kwargs: the rest of ``ImageLoader``'s arguments (default dtype here: float16; ``cache_decoded``:
            False).

    The training engine makes it from one ``arguments.LoaderOptions`` instead (``from_options``).

    ``images`` is the ImageLoader it reads (whole batches, each sample at most once per epoch unless a mix
    draws a source more than once: the training engine relies on both); its epoch protocol (``len``,
    ``set_epoch``, ``state_dict``, ...) is this loader's.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike | PreparedDataset,
        split: str = "train",
        batch_size: int = 64,
        *,
        accelerator=None,
        shard_cache: ShardCache | None = None,
        sampling: WholeBatchOrder = WHOLE_BATCHES,
        **kwargs,
    ):
        if kwargs.get("as_dict") is False:
            raise ValueError("MultimodalLoader's batches are always dicts (as_dict=False is ImageLoader's)")
        source, text_padding = kwargs.pop("source", "files"), kwargs.pop("text_padding", "longest")
        dataset, table, reader = self._open(data_dir, split, source, shard_cache)
        shuffle, drop_last = kwargs.pop("shuffle", None), kwargs.pop("drop_last", None)
        if accelerator is not None:
            kwargs.setdefault("shard_id", accelerator.process_index)
            kwargs.setdefault("num_shards", accelerator.num_processes)
            kwargs.setdefault("device", accelerator.device)
        kwargs.setdefault("max_pixels", dataset.max_pixels)
        kwargs.setdefault("cache_decoded", False)  # the training engine plans it from the recorded sizes
        if kwargs.get("dtype") is None and kwargs.get("fp16") is None:
            kwargs["dtype"] = torch.float16
        sizes = kwargs.pop("image_sizes", table.decoded_shapes)  # the train crops' windows drawn on the host
        shuffle, drop_last = _split_order(split, shuffle, drop_last)
        loader = ImageLoader(
            _image_files(dataset, split, table),
            table.labels,
            ids=table.ids,
            batch_size=batch_size,
            shuffle=shuffle,
            drop_last=drop_last,
            reading=EngineReading(reader, sampling, table.file_stats, sizes),
            eval_geometry="dali",
            files_checked=True,  # preparation decoded every image: DALI runs whole batches
            **kwargs,
        )
        self._finish(dataset, split, table, loader, text_padding)

    @classmethod
    def from_options(
        cls,
        data_dir: str | os.PathLike | PreparedDataset,
        split: str,
        options: LoaderOptions,
        *,
        accelerator=None,
        shard_cache: ShardCache | None = None,
        sampling: WholeBatchOrder = WHOLE_BATCHES,
    ) -> MultimodalLoader:
        """The training engine's loader: ``split`` of ``data_dir`` as ``options`` say, handed on whole to
        ``ImageLoader.from_options``; the other arguments as the class takes them."""
        loader = cls.__new__(cls)
        dataset, table, reader = loader._open(data_dir, split, options.source, shard_cache)
        shuffle, drop_last = _split_order(split, options.shuffle, options.drop_last)
        images = ImageLoader.from_options(
            _image_files(dataset, split, table),
            table.labels,
            table.ids,
            replace(options, shuffle=shuffle, drop_last=drop_last),
            EngineReading(reader, sampling, table.file_stats, table.decoded_shapes),
            accelerator=accelerator,
            max_pixels=dataset.max_pixels,
            default_dtype=torch.float16,
        )
        loader._finish(dataset, split, table, images, options.text_padding)
        return loader

    def _open(self, data_dir, split: str, source: str, shard_cache) -> tuple[PreparedDataset, SplitTable, Source]:
        """``split`` of ``data_dir``: the dataset, the split's table (each row's path where ``source`` reads
        files) and the image source it is read from (``choose_source``'s)."""
        # Opening verifies every file of the directory against prepare.json (pass a PreparedDataset to
        # share one verification between the train and val loaders).
        dataset = data_dir if isinstance(data_dir, PreparedDataset) else PreparedDataset(data_dir)
        reader = prepared_source(dataset, split, source, shard_cache)
        # A source that reads the rows' own files needs each row's path; a WebDataset only ids and labels.
        table = dataset.table(split, images=reader.needs_paths)
        if not len(table.ids):
            raise ValueError(f"{dataset.root / (split + '.jsonl')}: split '{split}' is empty")
        return dataset, table, reader

    def _finish(self, dataset: PreparedDataset, split: str, table, loader: ImageLoader, text_padding: str) -> None:
        """Join ``loader``'s images with the split's cached tokens, which must hold the same rows."""
        tokens, n = TokenCache(dataset.tokens_dir, split), len(table.ids)
        if len(tokens) != n or tokens.first_id != table.ids[0]:
            raise ValueError(
                f"token cache {dataset.tokens_dir}/{split} (rows {len(tokens)}, first id "
                f"{tokens.first_id}) does not match {split}.jsonl (rows {n}, first id "
                f"{table.ids[0]}); run {PREPARE} again"
            )
        self._join(loader, tokens, dataset.num_classes, text_padding)
        self.dataset, self.sources = dataset, table.sources

    @classmethod
    def join(cls, images: ImageLoader, tokens: TokenCache, num_classes: int) -> MultimodalLoader:
        """A loader of ``images`` (an ImageLoader reading the engine's ``WHOLE_BATCHES``) and the ``tokens`` of the
        same sample ids, for rows that were never prepared (predict)."""
        if images.sampling is not WHOLE_BATCHES:
            raise ValueError(
                "MultimodalLoader.join needs an ImageLoader that reads whole batches: reading=EngineReading()"
            )
        loader = cls.__new__(cls)
        loader._join(images, tokens, num_classes)
        loader.dataset, loader.sources = None, None
        return loader

    def _join(self, images: ImageLoader, tokens: TokenCache, num_classes: int, padding: str = "longest") -> None:
        padded_width(1, padding, 1)  # refuses an unknown one now, not at the first batch
        self.images, self.tokens, self.num_classes, self.text_padding = images, tokens, num_classes, padding

    def __reduce__(self):
        return self.images.__reduce__()  # refuses: it holds a live DALI pipeline

    # The epoch protocol and what the engine reads are the image loader's.

    def __len__(self) -> int:
        """Batches in one epoch of this process's shard."""
        return len(self.images)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order and augmentation draws the next ``iter()`` uses (as
        ``DistributedSampler.set_epoch``); the epoch a restored position is in keeps that position."""
        self.images.set_epoch(epoch)

    def state_dict(self) -> dict:
        """Position for an exact resume, JSON-safe: the epoch, the batches of it already delivered, and DALI's
        checkpoint of the pipeline that will deliver the next one."""
        return self.images.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Restore a position from ``state_dict()`` (same data, seed, batch size and process count); the next
        ``iter()`` yields exactly the rest of that epoch."""
        self.images.load_state_dict(state)

    epoch = property(lambda self: self.images.epoch)
    step = property(lambda self: self.images.step)
    batch_size = property(lambda self: self.images.batch_size)
    shard_id = property(lambda self: self.images.shard_id)
    num_shards = property(lambda self: self.images.num_shards)
    files = property(lambda self: self.images.files)
    labels = property(lambda self: self.images.labels)
    ids = property(lambda self: self.images.ids)
    source = property(lambda self: self.images.source)
    device = property(lambda self: self.images.device)
    dtype = property(lambda self: self.images.dtype)
    size = property(lambda self: self.images.size)
    train = property(lambda self: self.images.train)
    shuffle = property(lambda self: self.images.shuffle)
    drop_last = property(lambda self: self.images.drop_last)
    seed = property(lambda self: self.images.seed)
    num_threads = property(lambda self: self.images.num_threads)
    prefetch = property(lambda self: self.images.prefetch)
    bad = property(lambda self: self.images.bad)
    skipped = property(lambda self: self.images.skipped)
    holds_decoded = property(lambda self: self.images.holds_decoded)
    cached_bytes = property(lambda self: self.images.cached_bytes)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        """One epoch of batch dicts, by ``ImageLoader``'s rules: each ``iter()`` starts the epoch ``set_epoch``
        selected, else the next one, also after a ``break``; a restored position (``load_state_dict``)
        continues; an older iterator advanced after a newer one began raises."""
        return self._batches(self.images.begin_iteration())

    def _batches(self, generation: int) -> Iterator[dict[str, torch.Tensor]]:
        loader = self.images
        for images, ids, pos, _ in loader.raw_batches(generation):
            labels = np.where(pos >= 0, loader.labels[pos], IGNORE_LABEL)
            # pinned on CUDA machines, so the copies below are asynchronous
            text = self.tokens.gather(ids, self.text_padding)
            if images.dtype != loader.dtype:  # bfloat16 from a graph that emits float32
                images = images.to(loader.dtype)
            if loader.pins_memory:
                images = images.pin_memory()
            batch = {
                "image": images.to(self.device, non_blocking=True),
                "input_ids": text["input_ids"].to(self.device, non_blocking=True),
                "attention_mask": text["attention_mask"].to(self.device, non_blocking=True),
                "label": torch.from_numpy(labels).to(self.device, non_blocking=True),
                "id": torch.from_numpy(ids).to(self.device, non_blocking=True),
            }
            if self.sources is not None:  # a mix: each sample's source (-1 for a masked one)
                source = np.where((pos >= 0) & (ids >= 0), self.sources[np.maximum(pos, 0)], -1)
                batch["source"] = torch.from_numpy(source).to(self.device, non_blocking=True)
            yield batch


def _split_order(split: str, shuffle: bool | None, drop_last: bool | None) -> tuple[bool, bool]:
    """``shuffle`` and ``drop_last`` as given, else the split's: both for "train", neither otherwise."""
    is_train = split == "train"
    return is_train if shuffle is None else shuffle, is_train if drop_last is None else drop_last


def _image_files(dataset: PreparedDataset, split: str, table) -> list[str]:
    """The image file of each row; a WebDataset's samples are named by its index, one string for all."""
    if table.images is not None:
        return table.images
    return [str(dataset.root / WDS_DIR / f"{split}.rows.npy")] * len(table.ids)
