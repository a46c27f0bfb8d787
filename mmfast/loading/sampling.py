"""Sample order and sharding: which positions each process reads in an epoch, and ``ShardSampler``, the
``loader.sampler`` that shows them to DataLoader code.

Why the loader owns the sample order instead of DALI's shuffling reader: DALI's ``random_shuffle`` is a
shuffle buffer, not a permutation, and cannot be re-seeded per epoch, sharded evenly or resumed at a
given step. Here each epoch's order is a seeded permutation cut into per-rank lists of whole batches
(padded with -1 for DALI, whose batches have a fixed size).

Two samplings:
- DataLoader's (``ImageLoader``): ``torch.randperm`` seeded by ``seed + epoch``, a rank's list is
  DistributedSampler's (``distributed_sampler_indices``).
- The training engine's (``MultimodalLoader``): a numpy permutation seeded by (seed, epoch), each sample at
  most once per epoch (``epoch_order`` + ``shard_positions``).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from mmfast.loading.image_loader import ImageLoader


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


def distributed_sampler_indices(
    n: int, epoch: int, seed: int, shuffle: bool, rank: int, num_replicas: int
) -> np.ndarray:
    """Exactly ``list(DistributedSampler(dataset_of_n, num_replicas, rank, shuffle, seed))`` after
    ``set_epoch(epoch)`` (drop_last=False): ``torch.randperm(n)`` seeded by seed + epoch (or 0..n-1), the
    first samples repeated until every rank gets ceil(n / num_replicas), rank r taking every
    num_replicas-th from r."""
    if shuffle:
        g = torch.Generator()
        g.manual_seed(seed + epoch)
        order = torch.randperm(n, generator=g).numpy()
    else:
        order = np.arange(n)
    total = math.ceil(n / num_replicas) * num_replicas
    return np.resize(order, total)[rank::num_replicas]  # np.resize repeats the order cyclically


class ShardSampler:
    """``loader.sampler``: what DataLoader code expects of a (Distributed)Sampler.

    ``len()`` = samples this process yields per epoch (DistributedSampler's ``num_samples``), iteration =
    their indices into ``loader.dataset`` for the current epoch, ``set_epoch(e)`` = ``loader.set_epoch(e)``,
    and DistributedSampler's ``num_replicas``, ``rank``, ``shuffle``, ``seed``, ``epoch``.
    """

    def __init__(self, loader: ImageLoader):
        self._ref = weakref.ref(loader)  # not a reference: a cycle would keep the loader's DALI pipeline alive

    @property
    def _loader(self) -> ImageLoader:
        loader = self._ref()
        if loader is None:
            raise ReferenceError("the loader of this sampler no longer exists")
        return loader

    num_replicas = property(lambda self: self._loader.num_shards)
    rank = property(lambda self: self._loader.shard_id)
    shuffle = property(lambda self: self._loader.shuffle)
    seed = property(lambda self: self._loader.seed)
    epoch = property(lambda self: self._loader.epoch)
    drop_last = False  # DistributedSampler's: shards are always filled up (see Batch.mask)

    @property
    def num_samples(self) -> int:
        return len(self)

    @property
    def total_size(self) -> int:
        return len(self) * self._loader.num_shards

    def __len__(self) -> int:
        return self._loader._samples_per_rank()

    def __iter__(self) -> Iterator[int]:
        loader = self._loader
        if not loader.source.ordered_by_loader:
            raise TypeError("the WebDataset reader shards and shuffles inside DALI: no index list to show")
        if not loader._dataloader_sampling:
            return iter(int(p) for p in loader._positions(loader.epoch) if p >= 0)
        n, epoch = len(loader.files), loader.epoch
        return iter(
            distributed_sampler_indices(n, epoch, self.seed, self.shuffle, self.rank, self.num_replicas).tolist()
        )

    def set_epoch(self, epoch: int) -> None:
        self._loader.set_epoch(epoch)
