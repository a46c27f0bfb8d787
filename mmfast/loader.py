"""DALI-backed loaders: ``ImageLoader`` (drop-in for a DataLoader over image files) and
``MultimodalLoader`` (a prepared split: images from DALI joined with cached tokens by sample id).

Why the loader owns the sample order instead of DALI's shuffling reader: DALI's ``random_shuffle`` is a
shuffle buffer, not a permutation, and cannot be re-seeded per epoch, sharded evenly or resumed at a
given step. Here each epoch's order is a seeded permutation computed in numpy, cut into per-rank lists
of equal length, and handed to a file reader (``random_shuffle=False``) that is rebuilt each epoch
(milliseconds). Resuming at step k restores DALI's own checkpoint of that epoch's pipeline (reader
position and the random state of every augmentation), so the resumed epoch yields exactly the batches,
bit for bit, that the uninterrupted one would have; without a DALI checkpoint it falls back to a reader
over the rank's list minus its first k batches (same samples, different augmentation draws).
"""

from __future__ import annotations

import base64
import json
import logging
import math
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from mmfast.pipelines.image import READER_NAME, image_pipeline
from mmfast.token_cache import TokenCache

log = logging.getLogger(__name__)
PAD_ID = -1  # sample id of the padding entries that fill the last eval batch; their label is IGNORE_LABEL
IGNORE_LABEL = -100  # torch.nn.functional.cross_entropy's default ignore_index


def epoch_order(n: int, epoch: int, seed: int, shuffle: bool) -> np.ndarray:
    """Positions 0..n-1 in the order of this epoch: a permutation seeded by (seed, epoch), same on all ranks."""
    if not shuffle:
        return np.arange(n)
    return np.random.default_rng([seed, epoch]).permutation(n)


def shard_positions(
    order: np.ndarray, batch_size: int, shard_id: int, num_shards: int, drop_last: bool
) -> np.ndarray:
    """This rank's positions for one epoch; every rank gets the same count, a multiple of batch_size.

    drop_last: keep only whole global batches (each sample at most once; the tail differs every epoch).
    Otherwise every sample appears exactly once across ranks and each rank's list is padded with -1.
    """
    n = len(order)
    if drop_last:
        per_rank = (n // (num_shards * batch_size)) * batch_size
        return order[: per_rank * num_shards][shard_id::num_shards]
    mine = order[shard_id::num_shards]
    per_rank = math.ceil(math.ceil(n / num_shards) / batch_size) * batch_size
    return np.concatenate([mine, np.full(per_rank - len(mine), -1, dtype=order.dtype)])


def _resolve_device(device: str | torch.device | None) -> torch.device:
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


class ImageLoader:
    """A reusable iterable over image files decoded and augmented by DALI; one ``__iter__`` is one epoch.

    Looks like ``torch.utils.data.DataLoader`` where it can: ``batch_size``, ``shuffle``, ``drop_last``,
    ``num_workers`` (DALI CPU threads), ``len()``. Batches are dicts
    ``{"image": (B, 3, S, S), "label": (B,), "id": (B,)}`` already on ``device``.

    Args:
        files: image paths.
        labels: one integer label per file (default: zeros).
        ids: one unique integer sample id per file (default: 0..n-1).
        batch_size: samples per batch on this process.
        shuffle: a fresh seeded order each epoch (the same on every rank).
        drop_last: drop the incomplete last global batch; if False, pad it (id -1, label -100).
        num_workers: DALI CPU threads (default: all cores).
        train: random resized crop + flip (train) or resize + center crop (eval); default: ``shuffle``.
        size: output side in pixels.
        device: where batches go: "cpu" or "cuda[:N]" (default: the current CUDA device, else CPU).
        seed: seed of the order and of the augmentations.
        shard_id, num_shards: this process's rank and the number of processes (see ``for_accelerator``).
        fp16: float16 images (else float32).
        prefetch: DALI prefetch queue depth.
        wds_shards: read these WebDataset tars (written by ``mmfast.wds.write_wds``; each with a ``.idx``
            beside it) instead of ``files``; ``files``/``labels``/``ids`` still describe the samples. DALI
            then shuffles (a buffer, re-seeded per epoch) and shards; the last eval batch is partial
            instead of padded.
        pipeline_kwargs: more keyword arguments of ``mmfast.pipelines.image_pipeline`` (scale, ratio,
            flip, color_jitter, crop_ratio, mean, std, hw_decoder_load, ...).
    """

    def __init__(
        self,
        files: Sequence[str],
        labels: Sequence[int] | None = None,
        *,
        ids: Sequence[int] | None = None,
        batch_size: int = 64,
        shuffle: bool = False,
        drop_last: bool = False,
        num_workers: int | None = None,
        train: bool | None = None,
        size: int = 224,
        device: str | torch.device | None = None,
        seed: int = 0,
        shard_id: int = 0,
        num_shards: int = 1,
        fp16: bool = True,
        prefetch: int = 2,
        wds_shards: Sequence[str] | None = None,
        **pipeline_kwargs,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if num_shards < 1 or not 0 <= shard_id < num_shards:
            raise ValueError(f"shard_id must be in [0, num_shards={num_shards}), got {shard_id}")
        if size < 8:
            raise ValueError(f"size must be >= 8 pixels, got {size}")
        if num_workers is not None and num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        self.files = [str(f) for f in files]
        n = len(self.files)
        if n == 0:
            raise ValueError("no image files given")
        self.labels = np.asarray(labels if labels is not None else np.zeros(n), dtype=np.int64)
        self.ids = np.asarray(ids if ids is not None else np.arange(n), dtype=np.int64)
        if len(self.labels) != n or len(self.ids) != n:
            raise ValueError(f"{n} files but {len(self.labels)} labels and {len(self.ids)} ids")
        if len(np.unique(self.ids)) != n or self.ids.min() < 0 or self.ids.max() > np.iinfo(np.int32).max:
            raise ValueError("ids must be unique, non-negative int32 values")
        self._id_sorter = np.argsort(self.ids)
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.train = shuffle if train is None else train
        self.size = size
        self.device = _resolve_device(device)
        self.num_threads = num_workers or os.cpu_count() or 1
        self.seed = seed
        self.shard_id, self.num_shards = shard_id, num_shards
        self.fp16 = fp16
        self.prefetch = prefetch
        self.pipeline_kwargs = pipeline_kwargs
        self.wds_shards = [str(p) for p in wds_shards] if wds_shards else None
        for tar in self.wds_shards or []:
            if not Path(tar).is_file() or not Path(tar).with_suffix(".idx").is_file():
                raise FileNotFoundError(
                    f"{tar}: WebDataset shard or its .idx index missing; run tools/prepare_data.py --format wds"
                )
        if drop_last and n < batch_size * num_shards:
            raise ValueError(
                f"{n} samples cannot fill one batch of {batch_size} on each of {num_shards} processes "
                "with drop_last=True; lower the batch size"
            )
        self.epoch = 0
        self.step = 0  # batches of the current epoch already delivered
        self._live = None  # the DALI iterator of the epoch in progress
        self._dali_checkpoint: str | None = None  # restored by load_state_dict, used by the next __iter__

    @classmethod
    def from_folder(cls, root: str | os.PathLike, **kwargs) -> ImageLoader:
        """Loader over ``root/<class>/<image>``, labels from the sorted class names (like ImageFolder)."""
        root = Path(root)
        classes = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
        if not classes:
            raise ValueError(f"{root}: no class sub-folders; expected root/<class>/<image>")
        from mmfast.manifest import IMAGE_SUFFIXES

        files, labels = [], []
        for i, c in enumerate(classes):
            for f in sorted((root / c).iterdir()):
                if f.suffix.lower() in IMAGE_SUFFIXES and not f.name.startswith("."):
                    files.append(str(f))
                    labels.append(i)
        loader = cls(files, labels, **kwargs)
        loader.classes = classes
        return loader

    # -- the epoch protocol ------------------------------------------------------------------------------
    def __len__(self) -> int:
        """Batches per epoch on this process (the same on every process)."""
        if self.wds_shards:
            per_shard = math.ceil(len(self.files) / self.num_shards)  # DALI pads every shard to the largest
            return per_shard // self.batch_size if self.drop_last else math.ceil(per_shard / self.batch_size)
        return len(self._positions(0)) // self.batch_size

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order the next ``__iter__`` uses.

        Setting the epoch the loader is already at keeps its position (so a restored mid-epoch state
        survives the usual ``set_epoch`` call at the top of the loop); another epoch starts at step 0.
        """
        if epoch != self.epoch:
            self.epoch, self.step, self._dali_checkpoint = epoch, 0, None

    def state_dict(self) -> dict:
        """Position for an exact resume: the epoch and the batches of it already delivered."""
        ck = None
        if self.step > 0:
            # DALI's checkpoint of the live pipeline: its state after the last batch it returned.
            ck = self._live.checkpoints()[0] if self._live is not None else self._dali_checkpoint
            if isinstance(ck, bytes | bytearray):  # kept as text so the state is JSON-serializable
                ck = "b64:" + base64.b64encode(ck).decode("ascii")
        return {
            "epoch": self.epoch,
            "step": self.step,
            "seed": self.seed,
            "num_samples": len(self.files),
            "num_shards": self.num_shards,
            "shard_id": self.shard_id,
            "batch_size": self.batch_size,
            "dali_checkpoint": ck,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore a position from ``state_dict()`` (same data, seed, batch size and process count)."""
        for key, mine in (
            ("seed", self.seed),
            ("num_samples", len(self.files)),
            ("num_shards", self.num_shards),
            ("batch_size", self.batch_size),
        ):
            if state[key] != mine:
                raise ValueError(f"cannot resume loader: {key} was {state[key]}, now {mine}")
        self.epoch, self.step = int(state["epoch"]), int(state["step"])
        same_shard = state.get("shard_id", self.shard_id) == self.shard_id
        ck = state.get("dali_checkpoint") if self.step > 0 and same_shard else None
        if isinstance(ck, str) and ck.startswith("b64:"):
            ck = base64.b64decode(ck[4:])
        self._dali_checkpoint = ck

    def _positions(self, epoch: int) -> np.ndarray:
        order = epoch_order(len(self.files), epoch, self.seed, self.shuffle)
        return shard_positions(order, self.batch_size, self.shard_id, self.num_shards, self.drop_last)

    def _build_iterator(self, positions: np.ndarray | None, checkpoint: str | None = None):
        from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

        if self.wds_shards:
            source = {
                "source": "wds",
                "wds_paths": self.wds_shards,
                "wds_index_paths": [str(Path(p).with_suffix(".idx")) for p in self.wds_shards],
                "wds_shard_id": self.shard_id,
                "wds_num_shards": self.num_shards,
                "wds_shuffle": self.shuffle,
            }
            policy = LastBatchPolicy.DROP if self.drop_last else LastBatchPolicy.PARTIAL
        else:
            pad_file = self.files[0]
            source = {
                "source": "files",
                "files": [self.files[p] if p >= 0 else pad_file for p in positions],
                "ids": [int(self.ids[p]) if p >= 0 else PAD_ID for p in positions],
            }
            policy = LastBatchPolicy.FILL  # never used: the lists are whole batches
        cuda = self.device.type == "cuda"
        pipe = image_pipeline(
            **source,
            train=self.train,
            size=self.size,
            decode_device="mixed" if cuda else "cpu",
            fp16=self.fp16,
            **self.pipeline_kwargs,
            batch_size=self.batch_size,
            num_threads=self.num_threads,
            device_id=self.device.index if cuda else None,
            seed=int(np.random.default_rng([self.seed, self.epoch, self.shard_id]).integers(2**31)),
            prefetch_queue_depth=self.prefetch,
            enable_checkpointing=True,
            checkpoint=checkpoint,
        )
        return DALIGenericIterator(
            pipe,
            ["image", "id"],
            reader_name=READER_NAME,
            auto_reset=False,
            last_batch_policy=policy,
            prepare_first_batch=True,
        )

    def _lookup(self, ids: np.ndarray) -> np.ndarray:
        """Positions in ``files`` of the given sample ids (-1 stays -1)."""
        found = self._id_sorter[np.searchsorted(self.ids, ids, sorter=self._id_sorter).clip(0, len(self.ids) - 1)]
        return np.where(ids >= 0, found, -1)

    def _batches(self) -> Iterator[tuple[torch.Tensor, np.ndarray]]:
        """(images on self.device, sample ids as numpy) for the rest of the current epoch."""
        if self.step >= len(self):  # restored at the very end of an epoch
            return
        skip = 0
        positions = None if self.wds_shards else self._positions(self.epoch)
        if self.step and self._dali_checkpoint:
            it = self._build_iterator(positions, self._dali_checkpoint)
        elif self.wds_shards:
            it, skip = self._build_iterator(None), self.step  # no checkpoint: re-read and drop what was seen
        else:
            it = self._build_iterator(positions[self.step * self.batch_size :])
        self._live, self._dali_checkpoint = it, None
        try:
            for out in it:
                if skip:
                    skip -= 1
                    continue
                # DALI's iterator returns a list with one dict per pipeline; we run one pipeline.
                images = out[0]["image"]  # (B, 3, S, S), on the DALI output device
                ids = out[0]["id"].view(-1).numpy()  # CPU int32; the reader's labels never leave the host
                yield images, ids.astype(np.int64)
        finally:
            self._live = None

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for images, ids in self._batches():
            pos = self._lookup(ids)
            labels = np.where(pos >= 0, self.labels[pos], IGNORE_LABEL)
            self.step += 1
            yield {
                "image": images.to(self.device, non_blocking=True),
                "label": torch.from_numpy(labels).to(self.device),
                "id": torch.from_numpy(ids).to(self.device),
            }
        self._end_epoch()

    def _end_epoch(self) -> None:
        self.epoch, self.step = self.epoch + 1, 0


class MultimodalLoader(ImageLoader):
    """One split of a prepared dataset: DALI images joined with cached tokens by sample id.

    Batches: ``{"image": (B, 3, S, S), "input_ids": (B, L), "attention_mask": (B, L), "label": (B,),
    "id": (B,)}`` on the training device, L = the longest caption in the batch. Padding samples of the
    last eval batch have id -1, label -100 and an all-zero attention mask.

    Args:
        data_dir: a directory written by tools/prepare_data.py.
        split: "train" or "val".
        batch_size: per process, as in Accelerate.
        shuffle, drop_last, train: default True for "train", False otherwise.
        accelerator: take shard_id / num_shards / device from an ``accelerate.Accelerator``.
        source: "files" (the split's image files) or "wds" (its WebDataset shards, see ``mmfast.wds``).
        **kwargs: the rest of ``ImageLoader``'s arguments.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike,
        split: str = "train",
        batch_size: int = 64,
        *,
        shuffle: bool | None = None,
        drop_last: bool | None = None,
        accelerator=None,
        source: str = "files",
        **kwargs,
    ):
        data_dir = Path(data_dir)
        rows_path = data_dir / f"{split}.jsonl"
        if not rows_path.exists():
            raise FileNotFoundError(f"{rows_path}: not a prepared dataset split; run tools/prepare_data.py first")
        rows = [json.loads(ln) for ln in rows_path.read_text().splitlines() if ln.strip()]
        if not rows:
            raise ValueError(f"{rows_path}: split '{split}' is empty")
        if accelerator is not None:
            kwargs.setdefault("shard_id", accelerator.process_index)
            kwargs.setdefault("num_shards", accelerator.num_processes)
            kwargs.setdefault("device", accelerator.device)
        if source == "wds":
            index = data_dir / "wds" / f"{split}.json"
            if not index.is_file():
                raise FileNotFoundError(f"{index}: no WebDataset shards; run tools/prepare_data.py --format wds")
            kwargs["wds_shards"] = [
                str(data_dir / "wds" / f"{s}.tar") for s in json.loads(index.read_text())["shards"]
            ]
        elif source != "files":
            raise ValueError(f"unknown source '{source}'; choose from 'files', 'wds'")
        is_train = split == "train"
        super().__init__(
            [r["image"] for r in rows],
            [r["label"] for r in rows],
            ids=[r["id"] for r in rows],
            batch_size=batch_size,
            shuffle=is_train if shuffle is None else shuffle,
            drop_last=is_train if drop_last is None else drop_last,
            **kwargs,
        )
        self.tokens = TokenCache(data_dir / "tokens", split)
        self.texts = [r["text"] for r in rows]
        self.num_classes = len(json.loads((data_dir / "labels.json").read_text()))

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for images, ids in self._batches():
            pos = self._lookup(ids)
            labels = np.where(pos >= 0, self.labels[pos], IGNORE_LABEL)
            text = self.tokens.gather(ids)  # pinned on CUDA machines, so the copies below are asynchronous
            self.step += 1
            yield {
                "image": images.to(self.device, non_blocking=True),
                "input_ids": text["input_ids"].to(self.device, non_blocking=True),
                "attention_mask": text["attention_mask"].to(self.device, non_blocking=True),
                "label": torch.from_numpy(labels).to(self.device, non_blocking=True),
                "id": torch.from_numpy(ids).to(self.device, non_blocking=True),
            }
        self._end_epoch()
