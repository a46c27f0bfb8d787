"""DALI-backed loaders: ``ImageLoader`` (drop-in for a DataLoader over image files) and
``MultimodalLoader`` (a prepared split: images from DALI joined with cached tokens by sample id).

Why the loader owns the sample order instead of DALI's shuffling reader: DALI's ``random_shuffle`` is a
shuffle buffer, not a permutation, and cannot be re-seeded per epoch, sharded evenly or resumed at a
given step. Here each epoch's order is a seeded permutation computed in numpy and cut into per-rank lists
of equal length (whole batches). A file reader (``random_shuffle=False``) reads the concatenation of
several epochs' lists (a "chunk"), so one DALI pipeline serves many epochs: a pipeline per epoch would
throw away its prefetched batches at every epoch end and pay a teardown (together ~25% of a short epoch).

Resume: ``state_dict()`` carries DALI's own checkpoint of the live pipeline (reader position and the
random state of every augmentation) and the chunk it belongs to, so a resumed run yields exactly the
batches, bit for bit, that the uninterrupted one would have. Without a DALI checkpoint it starts a new
chunk at the saved epoch and step: the same samples in the same order, other augmentation draws.
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

from mmfast.dataset import PreparedDataset
from mmfast.host_finish import HostFinisher, ragged_iterator
from mmfast.pipelines.image import EVAL_CROP_RATIO, IMAGENET_MEAN, IMAGENET_STD, READER_NAME, image_pipeline
from mmfast.token_cache import TokenCache
from mmfast.validate import DEFAULT_MAX_PIXELS

log = logging.getLogger(__name__)
PAD_ID = -1  # sample id of the padding entries that fill the last eval batch; their label is IGNORE_LABEL
IGNORE_LABEL = -100  # torch.nn.functional.cross_entropy's default ignore_index
MAX_CHUNK_EPOCHS = 16  # epochs one file-reader pipeline serves
MAX_CHUNK_ENTRIES = 1_000_000  # ... as long as its file list stays below this many entries


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
        shard_id, num_shards: this process's rank and the number of processes (``MultimodalLoader`` takes
            them from an Accelerator).
        fp16: float16 images (else float32).
        prefetch: DALI prefetch queue depth.
        wds_shards: read these WebDataset tars (written by ``mmfast.wds.write_wds``; each with a ``.idx``
            beside it) instead of ``files``; ``files``/``labels``/``ids`` still describe the samples. DALI
            then shards and shuffles (a shuffle buffer that runs on across epochs; ``set_epoch`` does not
            re-seed it); the last eval batch is partial instead of padded.
        on_bad_image: what to do with an image that is missing or cannot be decoded: "skip" (log it, count
            it in ``skipped``, and serve a masked sample in its place: id -1, label -100, so batch sizes and
            the other samples' order stay the same on every rank) or "error" (raise, naming the file).
        file_stats: (size, mtime_ns) of each file when it was validated; files that differ now are decoded
            again at start-up (MultimodalLoader passes what tools/prepare_data.py recorded).
        max_pixels: decoded-pixel budget per image, checked from the header of every file that is checked
            again at start-up (one over it is a bad image): what bounds the decoder's memory.
        cpu_resize: who resizes, flips and normalizes the decoded crops when decoding on the CPU: "torch"
            (the consuming thread, ``mmfast.host_finish``; about 2x faster) or "dali" (in the graph). The
            GPU path always does it in DALI.
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
        on_bad_image: str = "skip",
        file_stats: Sequence[tuple[int, int]] | None = None,
        max_pixels: int = DEFAULT_MAX_PIXELS,
        cpu_resize: str = "torch",
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
        if cpu_resize not in ("torch", "dali"):
            raise ValueError(f"cpu_resize must be 'torch' or 'dali', got '{cpu_resize}'")
        self._finisher = None
        if self.device.type != "cuda" and cpu_resize == "torch":
            mean, std = pipeline_kwargs.get("mean", IMAGENET_MEAN), pipeline_kwargs.get("std", IMAGENET_STD)
            shorter = None if self.train else round(size / pipeline_kwargs.get("crop_ratio", EVAL_CROP_RATIO))
            self._finisher = HostFinisher(size, mean, std, fp16, resize_shorter=shorter)
        if on_bad_image not in ("skip", "error"):
            raise ValueError(f"on_bad_image must be 'skip' or 'error', got '{on_bad_image}'")
        self.on_bad_image = on_bad_image
        self.bad: dict[int, str] = {}  # position in files -> why it is skipped
        self.max_pixels = max_pixels
        self._check_files(file_stats)
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
        self._stream: _Stream | None = None  # the live DALI iterator and the position of its next batch
        self._restore: tuple | None = None  # (epoch, step, chunk, DALI checkpoint) set by load_state_dict

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
            self.epoch, self.step = epoch, 0

    def state_dict(self) -> dict:
        """Position for an exact resume: the epoch, the batches of it already delivered, and DALI's
        checkpoint of the pipeline that will deliver the next one."""
        chunk, ck = None, None
        stream = self._stream
        if stream is not None and stream.at(self.epoch, self.step):
            chunk, ck = stream.chunk, stream.it.checkpoints()[0]  # its state after the last batch returned
        elif self._restore is not None and self._restore[:2] == (self.epoch, self.step):
            chunk, ck = self._restore[2:]
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
            "chunk": chunk,
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
        self._stream, self._restore = None, None
        ck = state.get("dali_checkpoint")
        if ck and state.get("chunk") is not None and state.get("shard_id", self.shard_id) == self.shard_id:
            if isinstance(ck, str) and ck.startswith("b64:"):
                ck = base64.b64decode(ck[4:])
            self._restore = (self.epoch, self.step, state["chunk"], ck)

    def _positions(self, epoch: int) -> np.ndarray:
        order = epoch_order(len(self.files), epoch, self.seed, self.shuffle)
        return shard_positions(order, self.batch_size, self.shard_id, self.num_shards, self.drop_last)

    def _chunk_epochs(self) -> int:
        """Epochs per file-reader pipeline: many for small datasets, fewer when the list gets long."""
        return max(1, min(MAX_CHUNK_EPOCHS, MAX_CHUNK_ENTRIES // max(1, len(self) * self.batch_size)))

    def _open_stream(self, epoch: int, step: int) -> _Stream:
        """A DALI iterator whose next batch is batch ``step`` of ``epoch``."""
        restore = self._restore if self._restore is not None and self._restore[:2] == (epoch, step) else None
        self._restore = None
        if self.wds_shards:
            if restore is not None:
                return _Stream(self._build_iterator(None, 0, restore[3]), {"wds": True}, epoch, step)
            stream = _Stream(self._build_iterator(None, 0), {"wds": True}, epoch, 0)
            for _ in range(step):  # no checkpoint: re-read and drop what was already delivered
                next(stream.it)
            stream.step = step
            return stream
        chunk = (
            restore[2] if restore is not None else {"start": epoch, "offset": step, "epochs": self._chunk_epochs()}
        )
        parts = [self._positions(chunk["start"] + k) for k in range(chunk["epochs"])]
        parts[0] = parts[0][chunk["offset"] * self.batch_size :]
        it = self._build_iterator(np.concatenate(parts), chunk["start"], restore[3] if restore else None)
        return _Stream(it, chunk, epoch, step)

    def _build_iterator(self, positions: np.ndarray | None, seed_epoch: int, checkpoint: bytes | None = None):
        from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

        pipe = self._pipeline(positions, seed_epoch, checkpoint)
        if self.wds_shards:
            policy = LastBatchPolicy.DROP if self.drop_last else LastBatchPolicy.PARTIAL
        else:
            policy = LastBatchPolicy.DROP  # never used: the lists are whole batches
        kwargs = {
            "reader_name": READER_NAME,
            "auto_reset": False,
            "last_batch_policy": policy,
            "prepare_first_batch": False,
        }
        if self._finisher is not None:  # ragged crops, finished on the host in _batches
            return ragged_iterator(pipe, **kwargs)
        return DALIGenericIterator(pipe, ["image", "id"], **kwargs)

    def _pipeline(self, positions: np.ndarray | None, seed_epoch: int, checkpoint: bytes | None = None):
        """The DALI graph reading ``positions`` (None: the WebDataset shards), defined but not built.

        Defining checks every operator's argument names without touching CUDA, so tests define the GPU
        ("mixed") graph on machines without a GPU.
        """
        if self.wds_shards:
            source = {
                "source": "wds",
                "wds_paths": self.wds_shards,
                "wds_index_paths": [str(Path(p).with_suffix(".idx")) for p in self.wds_shards],
                "wds_shard_id": self.shard_id,
                "wds_num_shards": self.num_shards,
                "wds_shuffle": self.shuffle,
            }
        else:
            pad_file = self._pad_file()
            source = {
                "source": "files",
                "files": [self.files[p] if p >= 0 and p not in self.bad else pad_file for p in positions],
                "ids": [int(self.ids[p]) if p >= 0 and p not in self.bad else PAD_ID for p in positions],
            }
        cuda = self.device.type == "cuda"
        return image_pipeline(
            **source,
            train=self.train,
            size=self.size,
            decode_device="mixed" if cuda else "cpu",
            fp16=self.fp16,
            finish_on_host=self._finisher is not None,
            **self.pipeline_kwargs,
            batch_size=self.batch_size,
            num_threads=self.num_threads,
            device_id=self.device.index if cuda else None,
            seed=int(np.random.default_rng([self.seed, seed_epoch, self.shard_id]).integers(2**31)),
            prefetch_queue_depth=self.prefetch,
            enable_checkpointing=True,
            checkpoint=checkpoint,
        )

    @property
    def skipped(self) -> list[dict]:
        """The samples served masked because their image is missing or undecodable."""
        return [{"id": int(self.ids[p]), "image": self.files[p], "reason": r} for p, r in sorted(self.bad.items())]

    def _mark_bad(self, positions: list[int], reasons: list[str]) -> None:
        for p, reason in zip(positions, reasons, strict=True):
            if self.on_bad_image == "error":
                raise ValueError(
                    f"{self.files[p]}: {reason}. Fix or remove it and re-run tools/prepare_data.py, "
                    "or pass on_bad_image='skip'"
                )
            log.warning("skipping %s (sample id %d): %s", self.files[p], self.ids[p], reason)
            self.bad[p] = reason
        if len(self.bad) == len(self.files):
            raise ValueError("every image is missing or undecodable; nothing to load")

    def _check_files(self, file_stats: Sequence[tuple[int, int]] | None) -> None:
        """At start-up: stat every file; decode again the ones that changed since they were validated."""
        from mmfast.validate import check_images

        suspects = []
        for p, path in enumerate(self.files):
            try:
                st = os.stat(path)
            except OSError:
                suspects.append(p)
                continue
            if file_stats is not None and (st.st_size, st.st_mtime_ns) != tuple(file_stats[p]):
                suspects.append(p)
            elif st.st_size == 0:
                suspects.append(p)
        if suspects:
            checks = check_images([self.files[p] for p in suspects], self.num_threads, max_pixels=self.max_pixels)
            bad = [(p, c.reason) for p, c in zip(suspects, checks, strict=True) if not c.ok]
            if bad:
                self._mark_bad(*map(list, zip(*bad, strict=True)))

    def _pad_file(self) -> str:
        """A decodable file to stand in for padding and skipped samples (their ids are -1)."""
        return next(f for p, f in enumerate(self.files) if p not in self.bad)

    def _recover(self, error: RuntimeError) -> _Stream:
        """DALI failed on a batch: find the file(s) it could not read among the next batches, mark them,
        and reopen the stream at the same position. Re-raises when no file is to blame."""
        from mmfast.validate import check_images

        if self.wds_shards:
            raise RuntimeError(
                f"DALI failed reading the WebDataset shards ({error}); re-export them with "
                "tools/prepare_data.py --format wds"
            ) from error
        window = self._positions(self.epoch)[self.step * self.batch_size :][
            : (self.prefetch + 2) * self.batch_size
        ]
        todo = [int(p) for p in window if p >= 0 and p not in self.bad]
        checks = check_images([self.files[p] for p in todo], self.num_threads)
        bad = [(p, c.reason) for p, c in zip(todo, checks, strict=True) if not c.ok]
        if not bad:
            raise error
        self._mark_bad(*map(list, zip(*bad, strict=True)))
        self._stream = None
        return self._open_stream(self.epoch, self.step)

    def _lookup(self, ids: np.ndarray) -> np.ndarray:
        """Positions in ``files`` of the given sample ids (-1 stays -1)."""
        found = self._id_sorter[np.searchsorted(self.ids, ids, sorter=self._id_sorter).clip(0, len(self.ids) - 1)]
        return np.where(ids >= 0, found, -1)

    def _batches(self) -> Iterator[tuple[torch.Tensor, np.ndarray]]:
        """(images on the DALI output device, sample ids as numpy) for the rest of the current epoch.

        Counts a batch as delivered (``self.step``) when it is handed out, so a consumer that stops early
        leaves the loader at the right position.
        """
        n = len(self)
        if self.step >= n:  # restored at the very end of an epoch
            self.epoch, self.step = self.epoch + 1, 0
            return
        if self._stream is None or not self._stream.at(self.epoch, self.step):
            self._stream = self._open_stream(self.epoch, self.step)
        stream = self._stream
        while self.step < n:
            try:
                out = next(stream.it)  # DALI's iterator returns one dict per pipeline; we run one pipeline
            except RuntimeError as e:  # DALI aborts the whole pipeline on one file it cannot read
                stream = self._stream = self._recover(e)
                continue
            out = out[0]
            if self._finisher is not None:
                images = self._finisher.finish(out)  # (B, 3, S, S)
            else:
                images = out["image"]  # (B, 3, S, S)
            ids = out["id"].view(-1).numpy().astype(np.int64)  # the reader's labels stay on the host
            stream.step += 1
            self.step += 1
            yield images, ids
        # The logical epoch is over; the stream moves on to the next one (or ends with its chunk).
        self.epoch, self.step = self.epoch + 1, 0
        stream.epoch, stream.step = stream.epoch + 1, 0
        if "wds" in stream.chunk:
            stream.it.reset()  # DALI's reader epoch ended with ours
        elif stream.epoch >= stream.chunk["start"] + stream.chunk["epochs"]:
            self._stream = None  # the chunk is consumed

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for images, ids in self._batches():
            pos = self._lookup(ids)
            labels = np.where(pos >= 0, self.labels[pos], IGNORE_LABEL)
            yield {
                "image": images.to(self.device, non_blocking=True),
                "label": torch.from_numpy(labels).to(self.device),
                "id": torch.from_numpy(ids).to(self.device),
            }


class _Stream:
    """A DALI iterator and the (epoch, step) of the batch it will return next."""

    def __init__(self, it, chunk: dict, epoch: int, step: int):
        self.it, self.chunk, self.epoch, self.step = it, chunk, epoch, step

    def at(self, epoch: int, step: int) -> bool:
        return (self.epoch, self.step) == (epoch, step)


class MultimodalLoader(ImageLoader):
    """One split of a prepared dataset: DALI images joined with cached tokens by sample id.

    Batches: ``{"image": (B, 3, S, S), "input_ids": (B, L), "attention_mask": (B, L), "label": (B,),
    "id": (B,)}`` on the training device, L = the longest caption in the batch. Padding samples of the
    last eval batch have id -1, label -100 and an all-zero attention mask.

    Args:
        data_dir: a directory written by tools/prepare_data.py, or a ``PreparedDataset`` of one.
        split: "train" or "val".
        batch_size: per process, as in Accelerate.
        shuffle, drop_last, train: default True for "train", False otherwise.
        accelerator: take shard_id / num_shards / device from an ``accelerate.Accelerator``.
        source: "files" (the split's image files) or "wds" (its WebDataset shards, see ``mmfast.wds``).
        **kwargs: the rest of ``ImageLoader``'s arguments.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike | PreparedDataset,
        split: str = "train",
        batch_size: int = 64,
        *,
        shuffle: bool | None = None,
        drop_last: bool | None = None,
        accelerator=None,
        source: str = "files",
        **kwargs,
    ):
        # Opening verifies every file of the directory against prepare.json (pass a PreparedDataset to
        # share one verification between the train and val loaders).
        dataset = data_dir if isinstance(data_dir, PreparedDataset) else PreparedDataset(data_dir)
        rows = dataset.rows(split)
        if not rows:
            raise ValueError(f"{dataset.root / (split + '.jsonl')}: split '{split}' is empty")
        if accelerator is not None:
            kwargs.setdefault("shard_id", accelerator.process_index)
            kwargs.setdefault("num_shards", accelerator.num_processes)
            kwargs.setdefault("device", accelerator.device)
        if source == "wds":
            index = dataset.root / "wds" / f"{split}.json"
            if not index.is_file():
                raise FileNotFoundError(f"{index}: no WebDataset shards; run tools/prepare_data.py --format wds")
            kwargs["wds_shards"] = [
                str(dataset.root / "wds" / f"{s}.tar") for s in json.loads(index.read_text())["shards"]
            ]
        elif source != "files":
            raise ValueError(f"unknown source '{source}'; choose from 'files', 'wds'")
        is_train = split == "train"
        kwargs.setdefault("max_pixels", dataset.max_pixels)
        if all("size" in r and "mtime_ns" in r for r in rows):
            kwargs.setdefault("file_stats", [(r["size"], r["mtime_ns"]) for r in rows])
        super().__init__(
            [r["image"] for r in rows],
            [r["label"] for r in rows],
            ids=[r["id"] for r in rows],
            batch_size=batch_size,
            shuffle=is_train if shuffle is None else shuffle,
            drop_last=is_train if drop_last is None else drop_last,
            **kwargs,
        )
        self.dataset = dataset
        self.tokens = TokenCache(dataset.tokens_dir, split)
        if len(self.tokens) != len(rows) or self.tokens.first_id != rows[0]["id"]:
            raise ValueError(
                f"token cache {dataset.tokens_dir}/{split} (rows {len(self.tokens)}, first id "
                f"{self.tokens.first_id}) does not match {split}.jsonl (rows {len(rows)}, first id "
                f"{rows[0]['id']}); re-run tools/prepare_data.py"
            )
        self.texts = [r["text"] for r in rows]
        self.num_classes = dataset.num_classes

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for images, ids in self._batches():
            pos = self._lookup(ids)
            labels = np.where(pos >= 0, self.labels[pos], IGNORE_LABEL)
            text = self.tokens.gather(ids)  # pinned on CUDA machines, so the copies below are asynchronous
            yield {
                "image": images.to(self.device, non_blocking=True),
                "input_ids": text["input_ids"].to(self.device, non_blocking=True),
                "attention_mask": text["attention_mask"].to(self.device, non_blocking=True),
                "label": torch.from_numpy(labels).to(self.device, non_blocking=True),
                "id": torch.from_numpy(ids).to(self.device, non_blocking=True),
            }
