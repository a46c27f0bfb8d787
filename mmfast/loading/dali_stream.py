"""What a loader's DALI stream reads and returns, as functions of what they are given: the iterator over a
graph, the next batch joined from the DALI batches it runs in, and the positions of the batches ahead of
it (which ``FileHealth.watch`` stats before DALI's reader reaches them)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from mmfast.loading.decoded import DecodedIterator
from mmfast.loading.graphs import READER_NAME
from mmfast.loading.host_finish import ragged_iterator
from mmfast.loading.stream import Stream, chunk_dali_batch


def iterator(pipe, ordered_by_loader: bool, drop_last: bool, ragged: bool, reader_name: str | None = READER_NAME):
    """DALI's iterator over ``pipe`` (``ImageLoader.define_pipeline``): ragged crops for the host finishing
    (``ragged``), else dense batches. ``reader_name`` None: the graph reads from an external source, and the
    iterator runs until that source's positions end."""
    from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy  # DALI's torch plugin: heavy

    if ordered_by_loader:
        policy = LastBatchPolicy.DROP  # never used: the lists are whole batches
    else:
        policy = LastBatchPolicy.DROP if drop_last else LastBatchPolicy.PARTIAL
    kwargs = {
        "auto_reset": False,
        "last_batch_policy": policy,
        "prepare_first_batch": False,
    }
    if reader_name is not None:
        kwargs["reader_name"] = reader_name
    if ragged:  # crops finished on the host by the loader
        return ragged_iterator(pipe, **kwargs)
    return DALIGenericIterator(pipe, ["image", "id"], **kwargs)


def next_batch(stream: Stream, batch_size: int) -> dict:
    """The next batch's DALI output (one dict: DALI's iterator returns one per pipeline, we run one): one DALI
    batch, or the parts of it the stream's chunk runs DALI on, joined."""
    if isinstance(stream.it, DecodedIterator):  # whole batches from memory
        return next(stream.it)[0]
    parts = [next(stream.it)[0] for _ in range(batch_size // chunk_dali_batch(stream.chunk, batch_size))]
    if len(parts) == 1:
        return parts[0]
    return {
        key: [x for p in parts for x in p[key]] if isinstance(value, list) else torch.cat([p[key] for p in parts])
        for key, value in parts[0].items()
    }


def upcoming(
    stream: Stream,
    first: int,
    stop: int,
    batches: int,
    batch_size: int,
    epoch_positions: Callable[[int], np.ndarray],
) -> np.ndarray:
    """Positions of the batches ``first`` to ``stop`` - 1 after the stream's next one, within its chunk;
    ``batches`` per epoch, ``epoch_positions(e)``: the positions epoch ``e`` reads."""
    ends = stream.chunk["start"] + stream.chunk["epochs"]
    parts = []
    for k in range(stream.epoch * batches + stream.step + first, stream.epoch * batches + stream.step + stop):
        epoch, step = divmod(k, batches)
        if epoch >= ends:
            break
        if not parts or parts[-1][0] != epoch:
            parts.append((epoch, step, step + 1))
        else:
            parts[-1] = (epoch, parts[-1][1], step + 1)
    empty = np.zeros(0, dtype=np.int64)
    return np.concatenate([empty] + [epoch_positions(e)[lo * batch_size : hi * batch_size] for e, lo, hi in parts])
