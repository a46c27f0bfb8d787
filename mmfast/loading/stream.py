"""The live DALI stream and its resume state: which chunk of epochs a pipeline reads, the (epoch, step) of
the batch it returns next, and the restore point a ``load_state_dict`` leaves for it.

Why chunks: a file reader (``random_shuffle=False``) reads the concatenation of several epochs' position
lists (a "chunk"), so one DALI pipeline serves many epochs: a pipeline per epoch would throw away its
prefetched batches at every epoch end and pay a teardown (a large share of a short epoch).

Resume: a loader's state carries DALI's own checkpoint of the live pipeline (reader position and the random
state of every augmentation) and the chunk it belongs to, so a resumed run yields exactly the batches, bit
for bit, that the uninterrupted one would have. Without a DALI checkpoint it starts a new chunk at the saved
epoch and step: the same samples in the same order, other augmentation draws.

A chunk is kept as a plain dict because it travels in ``state_dict()`` (JSON): ``{"start": first epoch,
"offset": batches of it already delivered, "epochs": epochs it spans[, "dali_batch": the DALI batch when it
runs parts of the loader's]}`` for a reader of the loader's
positions, ``{"wds": True}`` for a reader that shards and orders itself (one epoch at a time).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

MAX_CHUNK_EPOCHS = 16  # epochs one file-reader pipeline serves
MAX_CHUNK_ENTRIES = 1_000_000  # ... as long as its file list stays below this many entries
SELF_ORDERED_CHUNK = {"wds": True}  # the chunk of a reader that shards and orders itself


@dataclass
class Stream:
    """A DALI iterator and the (epoch, step) of the batch it will return next."""

    it: Any  # DALIGenericIterator (or mmfast.loading.host_finish's ragged one)
    chunk: dict
    epoch: int
    step: int

    def at(self, epoch: int, step: int) -> bool:
        return (self.epoch, self.step) == (epoch, step)

    def chunk_ends_at(self, epoch: int) -> bool:
        """``epoch`` lies beyond the epochs this stream's chunk spans (a self-ordered reader's never ends)."""
        return "wds" not in self.chunk and epoch >= self.chunk["start"] + self.chunk["epochs"]


@dataclass(frozen=True)
class Restore:
    """Where ``load_state_dict`` left the loader, and the pipeline checkpoint that continues from there."""

    epoch: int
    step: int
    chunk: dict
    checkpoint: bytes | str

    def at(self, epoch: int, step: int) -> bool:
        return (self.epoch, self.step) == (epoch, step)


def chunk_epochs(entries_per_epoch: int) -> int:
    """Epochs per file-reader pipeline: many for small datasets, fewer when the list gets long."""
    return max(1, min(MAX_CHUNK_EPOCHS, MAX_CHUNK_ENTRIES // max(1, entries_per_epoch)))


def new_chunk(epoch: int, step: int, entries_per_epoch: int, dali_batch: int | None = None) -> dict:
    """A chunk starting at batch ``step`` of ``epoch``; with ``dali_batch`` (its pipeline runs DALI on parts of
    the loader's batch, until every file has been read once) it spans that one epoch only."""
    if dali_batch is None:
        return {"start": epoch, "offset": step, "epochs": chunk_epochs(entries_per_epoch)}
    return {"start": epoch, "offset": step, "epochs": 1, "dali_batch": dali_batch}


def chunk_dali_batch(chunk: dict, batch_size: int | None = None) -> int | None:
    """The batch the chunk's pipeline runs DALI on (``batch_size``, the loader's, when it runs whole ones)."""
    return chunk.get("dali_batch", batch_size)


def encode_checkpoint(checkpoint: bytes | str | None) -> str | None:
    """DALI's checkpoint as text, so the loader's state is JSON-serializable."""
    if isinstance(checkpoint, bytes | bytearray):
        return "b64:" + base64.b64encode(checkpoint).decode("ascii")
    return checkpoint


def decode_checkpoint(checkpoint: bytes | str) -> bytes | str:
    """``encode_checkpoint`` undone."""
    if isinstance(checkpoint, str) and checkpoint.startswith("b64:"):
        return base64.b64decode(checkpoint[4:])
    return checkpoint
