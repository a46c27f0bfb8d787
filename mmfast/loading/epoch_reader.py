"""The live DALI stream of one loader, and its position: it opens the stream at an (epoch, step) (a chunk of
epochs read by one pipeline, the decoded cache, or a source that orders itself), watches each batch's files
before DALI's reader reaches them, reopens without a file that went bad, and yields the batches as DALI
delivers them. ``ImageLoader`` holds one and turns its batches into DataLoader's (``MultimodalLoader``,
into the engine's).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator

import numpy as np
import torch

from mmfast.loading import dali_stream
from mmfast.loading.arguments import LoaderSettings, dali_batch_size, first_line
from mmfast.loading.decoded import DecodedImages, DecodedIterator
from mmfast.loading.draws import DrawFeed
from mmfast.loading.file_health import FileHealth
from mmfast.loading.graphs import image_pipeline
from mmfast.loading.host_finish import HostFinisher
from mmfast.loading.sources import Source
from mmfast.loading.stream import (
    SELF_ORDERED_CHUNK,
    Restore,
    Stream,
    chunk_dali_batch,
    decode_checkpoint,
    encode_checkpoint,
    new_chunk,
)
from mmfast.util.voice import setting

log = logging.getLogger(__name__)


class DaliFailure(RuntimeError):
    """DALI failed on a batch and no file of it is to blame (memory, most often); the message says what to do."""


class EpochReader:
    """One loader's DALI stream and position (``epoch``, ``step``: batches of it already delivered).

    Args:
        settings: the loader's, whole (``arguments.LoaderSettings``).
        source, health, finisher, decoded: the loader's image source, bad-file bookkeeping, host finishing
            (None: DALI finishes) and decoded cache (None: streaming; dropped here when it outgrows its budget).
        ids: the sample id of each position in the loader's files.
        positions: ``positions(epoch)``, the positions this process reads in ``epoch`` (the sampling's).
        batches_per_epoch: the loader's ``len()``.
    """

    def __init__(
        self,
        settings: LoaderSettings,
        source: Source,
        health: FileHealth,
        finisher: HostFinisher | None,
        decoded: DecodedImages | None,
        ids: np.ndarray,
        positions: Callable[[int], np.ndarray],
        batches_per_epoch: int,
    ):
        self.s, self.source, self.health, self.finisher, self.decoded = settings, source, health, finisher, decoded
        self.ids, self._positions, self.batches_per_epoch = ids, positions, batches_per_epoch
        self._id_sorter = np.argsort(ids)
        self.files_read = np.zeros(len(ids), dtype=bool)  # positions DALI has read without failing
        self.epoch = 0
        self.step = 0
        self.stream: Stream | None = None  # the live DALI iterator and the position of its next batch
        self.restore: Restore | None = None  # set by the loader's load_state_dict
        self._held: dict[int, np.ndarray] = {}  # _epoch_positions

    def checkpoint(self) -> dict:
        """The chunk and DALI's checkpoint of the pipeline that delivers the next batch (None when none is
        live at the position)."""
        chunk, ck = None, None
        stream = self.stream
        if stream is not None and stream.at(self.epoch, self.step):
            chunk, ck = stream.chunk, stream.it.checkpoints()[0]  # its state after the last batch returned
        elif self.restore is not None and self.restore.at(self.epoch, self.step):
            chunk, ck = self.restore.chunk, self.restore.checkpoint
        return {"chunk": chunk, "dali_checkpoint": encode_checkpoint(ck)}

    def resume_keys(self) -> dict:
        """What a saved position must agree on with this reader's loader."""
        s, n = self.s, len(self.ids)
        return {"seed": s.seed, "num_samples": n, "num_shards": s.num_shards, "batch_size": s.batch_size}

    def state_dict(self) -> dict:
        """The loader's position for an exact resume: the epoch, the batches of it already delivered, what a
        resume must agree on, and DALI's checkpoint of the pipeline that delivers the next batch."""
        return {
            "epoch": self.epoch,
            "step": self.step,
            **self.resume_keys(),
            "shard_id": self.s.shard_id,
            **self.checkpoint(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from a loader's ``state_dict()``, refused when it lacks a key or disagrees on one."""
        missing = [k for k in ("epoch", "step", *self.resume_keys()) if k not in state]
        if missing:
            raise ValueError(f"not a loader state (from state_dict()): it lacks {', '.join(missing)}")
        for key, mine in self.resume_keys().items():
            if state[key] != mine:
                raise ValueError(f"cannot resume loader: {key} was {state[key]}, now {mine}")
        self.restore_position(state, same_shard=state.get("shard_id", self.s.shard_id) == self.s.shard_id)

    def restore_position(self, state: dict, same_shard: bool) -> None:
        """Continue from a loader's saved ``state`` (its DALI checkpoint only for the same shard)."""
        self.epoch, self.step = int(state["epoch"]), int(state["step"])
        self.stream, self.restore = None, None
        ck = state.get("dali_checkpoint")
        if ck and state.get("chunk") is not None and same_shard:
            self.restore = Restore(self.epoch, self.step, state["chunk"], decode_checkpoint(ck))

    def _open_stream(self, epoch: int, step: int) -> Stream:
        """A DALI iterator whose next batch is batch ``step`` of ``epoch``."""
        restore = self.restore if self.restore is not None and self.restore.at(epoch, step) else None
        self.restore = None
        if self.decoded is not None:
            self._watch(self._positions(epoch)[step * self.s.batch_size :])
            stream = self._decoded_stream(epoch, step)
            if stream is not None:
                return stream
        checkpoint = restore.checkpoint if restore is not None else None
        if not self.source.ordered_by_loader:  # one reader epoch per loader epoch, positioned by DALI
            stream = Stream(
                self._iterator(self.define_pipeline(None, 0, checkpoint)), SELF_ORDERED_CHUNK, epoch, step
            )
            if restore is None:
                stream.step = 0
                for _ in range(step):  # no checkpoint: re-read and drop what was already delivered
                    next(stream.it)
                stream.step = step
            return stream
        entries = self.batches_per_epoch * self.s.batch_size
        chunk = restore.chunk if restore is not None else new_chunk(epoch, step, entries)
        positions = self._chunk_positions(chunk)
        part = self.dali_part(positions) if restore is None else None
        if part is not None:  # a file in it not read yet: one epoch in parts DALI parses safely
            chunk = new_chunk(epoch, step, entries, part)
            positions = self._chunk_positions(chunk)
        stream = Stream(None, chunk, epoch, step)
        self._watch(self._upcoming(stream, 0, self._watch_lead()))  # the batches DALI reads first
        pipe = self.define_pipeline(
            positions, chunk["start"], checkpoint, chunk_dali_batch(chunk), self._chunk_epochs(chunk)
        )
        stream.it = self._iterator(pipe)
        return stream

    def _watch_lead(self) -> int:
        """How many batches ahead of the one it hands out next a file stream's files are watched: DALI's
        iterator runs the pipeline ``prefetch`` batches ahead, and its reader loads the files of one more."""
        return self.s.prefetch + 1

    def _watch(self, positions: np.ndarray) -> bool:
        """Before DALI reads the files at ``positions``: ``FileHealth.watch`` them (those missing or changed
        since they were last known good are decoded again; a bad one is never handed to DALI), and the decoded
        cache drops what changed. True when one of them went bad."""
        if not self.source.needs_paths:  # a shard's samples were checked when it was indexed
            return False
        changed = self.health.watch(positions)
        if changed and self.decoded is not None:
            self.decoded.forget(changed)
        return any(p in self.health.bad for p in changed)

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
        self._watch(self._upcoming(stream, 0, 2 * self.batches_per_epoch))
        return True

    def _epoch_positions(self, epoch: int) -> np.ndarray:
        """``_positions(epoch)``, kept for the epochs the stream reads (the watch asks for them each batch)."""
        held = self._held
        if epoch not in held:
            if len(held) >= 3:
                held.pop(min(held))
            held[epoch] = self._positions(epoch)
        return held[epoch]

    def _chunk_positions(self, chunk: dict) -> np.ndarray:
        """The positions a chunk's reader reads: its epochs' positions from its first batch on."""
        parts = [self._positions(chunk["start"] + k) for k in range(chunk["epochs"])]
        parts[0] = parts[0][chunk["offset"] * self.s.batch_size :]
        return np.concatenate(parts)

    def _chunk_epochs(self, chunk: dict) -> np.ndarray:
        """The epoch of each position ``_chunk_positions`` gives for ``chunk``."""
        sizes = [len(self._positions(chunk["start"] + k)) for k in range(chunk["epochs"])]
        sizes[0] -= chunk["offset"] * self.s.batch_size
        return np.repeat(np.arange(chunk["start"], chunk["start"] + chunk["epochs"]), sizes)

    def dali_part(self, positions: np.ndarray) -> int | None:
        """DALI's batch for a chunk reading ``positions``: None (the loader's) when DALI has read each of
        those files before, or preparation decoded them; on the CPU, otherwise, an equal part of the loader's
        batch that DALI parses safely (``DALI_SAFE_BATCH``: a non-image among the files is then skipped, not a
        crash, and slower (docs/benchmarks/), so only until each file has been read once)."""
        if self.s.files_checked or self.s.device.type != "cpu" or not self.source.needs_paths:
            return None
        read = self.files_read.copy()
        read[list(self.health.bad)] = True  # a bad file is never handed to DALI again
        if read[positions[positions >= 0]].all():
            return None
        part = dali_batch_size(self.s.batch_size)
        return part if part != self.s.batch_size else None

    def _decoded_stream(self, epoch: int, step: int) -> Stream | None:
        """Batch ``step`` of ``epoch`` on from the decoded images (decoded as the batches need them), or None
        when an earlier epoch found that they do not fit in the budget (the loader streams from then on)."""
        if self._drop_decoded_over_budget():
            return None
        options, b = self.s.pipeline_kwargs, self.s.batch_size
        positions = self._positions(epoch)[step * b :]
        self.decoded.plan(positions)
        it = DecodedIterator(
            self.decoded,
            positions,
            self.ids,
            b,
            key=(self.s.seed, self.s.shard_id, epoch, step),
            train=self.s.train,
            scale=options.get("scale", (0.08, 1.0)),
            ratio=options.get("ratio", (3 / 4, 4 / 3)),
            flip=options.get("flip", True),
            host_windows=self.s.image_sizes is not None,
        )
        return Stream(it, {"start": epoch, "offset": step, "epochs": 1}, epoch, step)

    def _drop_decoded_over_budget(self) -> bool:
        """After an epoch that passed the cache's budget: drop it and stream from now on (True)."""
        if self.decoded is None or not self.decoded.over:
            return False
        (log.info if self.s.cache_auto else log.warning)(
            "cache_decoded: the decoded images need more than the budget of %.1f MiB; streaming them instead",
            self.decoded.budget / 2**20,
        )
        self.decoded.close()
        self.decoded = None
        self.finisher.threads = self.finisher.streaming_threads
        return True

    def _iterator(self, pipe):
        ragged = self.finisher is not None
        source = self.source
        return dali_stream.iterator(pipe, source.ordered_by_loader, self.s.drop_last, ragged, source.reader_name)

    def _upcoming(self, stream: Stream, first: int, stop: int) -> np.ndarray:
        return dali_stream.upcoming(
            stream, first, stop, self.batches_per_epoch, self.s.batch_size, self._epoch_positions
        )

    def define_pipeline(
        self,
        positions: np.ndarray | None,
        seed_epoch: int,
        checkpoint: bytes | None = None,
        dali_batch: int | None = None,
        epochs: np.ndarray | None = None,
    ):
        """The DALI graph reading ``positions`` (None: a source that orders itself), defined but not built;
        ``dali_batch``: its batch, a divisor of the loader's (default: the loader's); ``epochs``: the epoch of
        each position (default: all ``seed_epoch``), which with the sample ids keys the augmentation's draws.

        Defining checks every operator's argument names without touching CUDA, so tests define the GPU
        ("mixed") graph on machines without a GPU.
        """
        read = self.source.reader(positions, self.health, self.s.shard_id, self.s.num_shards, self.s.shuffle)
        cuda = self.s.device.type == "cuda"
        dali_batch = dali_batch or self.s.batch_size
        draws = None
        if self.s.train and positions is not None:
            ids = np.where(positions >= 0, self.ids[np.maximum(positions, 0)], -1)
            epochs = np.full(len(positions), seed_epoch) if epochs is None else epochs
            draws = DrawFeed(self.s.seed, ids, epochs, self._read_sizes(positions))
        return image_pipeline(
            read=read,
            draws=draws,
            train=self.s.train,
            size=self.s.size,
            decode_device="mixed" if cuda else "cpu",
            fp16=self.s.fp16,  # bfloat16: the graph emits float32, converted by the loader
            finish_on_host=self.finisher is not None,
            **self.s.pipeline_kwargs,
            batch_size=dali_batch,
            num_threads=self.s.num_threads,
            device_id=self.s.device.index if cuda else None,
            seed=int(np.random.default_rng([self.s.seed, seed_epoch, self.s.shard_id]).integers(2**31)),
            prefetch_queue_depth=self.s.prefetch * (self.s.batch_size // dali_batch),  # the same samples ahead
            enable_checkpointing=True,
            checkpoint=checkpoint,
        )

    def _read_sizes(self, positions: np.ndarray) -> np.ndarray | None:
        """(height, width) of the file the reader reads at each of ``positions`` (a stand-in for padding and bad
        files: ``FileHealth.reader_list``'s), when the loader knows its files' sizes and reads them itself."""
        sizes = self.s.image_sizes
        if sizes is None or not self.source.needs_paths:
            return None
        stand_in, bad = self.health.first_good_position(), self.health.bad
        read = [p if p >= 0 and p not in bad else stand_in for p in positions.tolist()]
        return sizes[np.array(read, dtype=np.int64)]

    def _recover(self, error: RuntimeError) -> Stream:
        """DALI failed on a batch: find the file(s) it could not read among the next batches, mark them,
        and reopen the stream at the same position. Re-raises when no file is to blame."""
        if not self.source.can_skip_bad:
            raise self.source.read_error(error) from error
        window = self._positions(self.epoch)[self.step * self.s.batch_size :][
            : (self.s.prefetch + 2) * self.s.batch_size
        ]
        if not self.health.check_window(window):
            threads = setting("num_workers", "--num-threads", "--num-workers")
            raise DaliFailure(
                f"DALI failed on batch {self.step} of epoch {self.epoch}, whose files each decode on their own "
                f"({first_line(error)}); the usual cause is memory: this process's limit (ulimit -v, a cgroup's) "
                f"or the machine's. Lower the batch size or the number of threads ({setting('batch_size')} / "
                f"{threads})"
            ) from error
        self.stream = None
        return self._open_stream(self.epoch, self.step)

    def _lookup(self, ids: np.ndarray) -> np.ndarray:
        """Positions in ``files`` of the given sample ids (-1 stays -1)."""
        found = self._id_sorter[np.searchsorted(self.ids, ids, sorter=self._id_sorter).clip(0, len(self.ids) - 1)]
        return np.where(ids >= 0, found, -1)

    def batches(
        self, current: Callable[[], bool] | None = None, owner: str = "ImageLoader"
    ) -> Iterator[tuple[torch.Tensor, np.ndarray, np.ndarray, int]]:
        """(images on the DALI output device, sample ids as numpy, their positions in ``files`` (-1 for
        padding and stand-ins), the batch's index in the epoch) for the rest of the current epoch; whole
        batches (B, ...).

        Counts a batch as delivered (``self.step``) when it is handed out, so a consumer that stops early
        leaves the loader at the right position. ``current()``: False when another ``iter()`` has begun (raise).
        """
        n = self.batches_per_epoch
        if self.step >= n:  # restored at the very end of an epoch
            self.epoch, self.step = self.epoch + 1, 0
            return
        if self.stream is None or not self.stream.at(self.epoch, self.step):
            self.stream = self._open_stream(self.epoch, self.step)
        stream = self.stream
        while self.step < n:
            if current is not None and not current():
                raise RuntimeError(
                    f"this iterator of {owner} was replaced by a newer iter(loader): the loader "
                    "runs one epoch at a time (its DALI pipeline is shared), so an older iterator cannot go on; "
                    "finish or drop one before starting the next"
                )
            if self._watch_ahead(stream):  # a file DALI is about to read went bad: reopen without it
                stream = self.stream = self._open_stream(self.epoch, self.step)
            try:
                out = dali_stream.next_batch(stream, self.s.batch_size)
            except RuntimeError as e:  # DALI aborts the whole pipeline on one file it cannot read
                stream = self.stream = self._recover(e)
                continue
            ids = out["id"].view(-1).numpy().astype(np.int64)  # the reader's labels stay on the host
            pos = self._lookup(ids)
            self.files_read[pos[pos >= 0]] = True
            if self.finisher is not None:
                images = self.finisher.finish(out)  # (B, 3, S, S)
            else:
                images = out["image"]  # (B, 3, S, S)
            step = self.step
            stream.step += 1
            self.step += 1
            yield images, ids, pos, step
        self.end_epoch()

    def end_epoch(self) -> None:
        """The logical epoch is over; the stream moves on to the next one (or ends with its chunk)."""
        stream = self.stream
        if stream is not None and stream.at(self.epoch, self.batches_per_epoch):
            stream.epoch, stream.step = stream.epoch + 1, 0
            if not self.source.ordered_by_loader:
                stream.it.reset()  # DALI's reader epoch ended with ours
            elif stream.chunk_ends_at(stream.epoch):
                self.stream = None  # the chunk is consumed
        self.epoch, self.step = self.epoch + 1, 0
        self._drop_decoded_over_budget()


def refuse_forked(loader, built_in: int) -> None:
    """Raise in a process forked from the one that built ``loader`` (pid ``built_in``): a fork carries the
    loader's DALI pipelines and thread pools without their threads, so its first batch would wait for ever."""
    if os.getpid() != built_in:
        raise RuntimeError(
            f"this {type(loader).__name__} was built in process {built_in}, and this process ({os.getpid()}) was "
            "forked from it: a fork does not carry the loader's DALI pipelines and threads. Build a new loader "
            "in this process, or start worker processes with multiprocessing's 'spawn' or 'forkserver' method"
        )
