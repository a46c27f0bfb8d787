"""Sample order and sharding: the two sampling strategies a loader is handed (which positions each
process reads in an epoch, how many batches that makes, what ``set_epoch`` keeps), and ``ShardSampler``,
the ``loader.sampler`` that shows them to DataLoader code.

Why the loader owns the sample order instead of DALI's shuffling reader: DALI's ``random_shuffle`` is a
shuffle buffer, not a permutation, and cannot be re-seeded per epoch, sharded evenly or resumed at a
given step. Here each epoch's order is a seeded permutation cut into per-rank lists of whole batches
(padded with -1 for DALI, whose batches have a fixed size).

The strategies:
- ``DATALOADER`` (``DataLoaderOrder``, ImageLoader's default): what ``DataLoader(dataset,
  sampler=DistributedSampler(dataset, num_shards, shard_id, shuffle, seed))`` does: ``torch.randperm``
  seeded by ``seed + epoch``, a rank's list is DistributedSampler's (``distributed_sampler_indices``), the
  last batch partial unless ``drop_last``.
- ``WHOLE_BATCHES`` (``WholeBatchOrder``, the training engine's and predict's): a numpy permutation seeded
  by (seed, epoch), each sample at most once per epoch (``epoch_order`` + ``shard_positions``), whole
  batches (the last one padded), ``drop_last`` keeping only whole global batches, dealt to the ranks a batch
  at a time.
- ``MixedOrder`` (the training engine's over a mix of datasets, ``--data-weights``): whole batches like
  ``WHOLE_BATCHES``, of an epoch drawn from the sources by weight, a function of (seed, epoch) alone.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch


def epoch_order(n: int, epoch: int, seed: int, shuffle: bool) -> np.ndarray:
    """Positions 0..n-1 in the order of this epoch: a permutation seeded by (seed, epoch), same on all ranks."""
    if not shuffle:
        return np.arange(n)
    return np.random.default_rng([seed, epoch]).permutation(n)


def shard_positions(
    order: np.ndarray, batch_size: int, shard_id: int, num_shards: int, drop_last: bool
) -> np.ndarray:
    """This rank's positions for one epoch; every rank gets the same count, a multiple of batch_size.

    drop_last: keep only whole global batches (each sample at most once; the tail differs every epoch), cut
    into batches of consecutive positions dealt to the ranks in turn: rank r's k-th batch is the order's
    (k x num_shards + r)-th. A step of N processes accumulating A batches then trains the same batches as one
    process accumulating N x A, each batch the same samples (batch norm normalizes each by its own statistics).
    Otherwise every sample appears exactly once across ranks and each rank's list is padded with -1.
    """
    n = len(order)
    if drop_last:
        per_rank = (n // (num_shards * batch_size)) * batch_size
        dealt = order[: per_rank * num_shards].reshape(-1, num_shards, batch_size)  # (batches, ranks, batch)
        return dealt[:, shard_id].reshape(-1)
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


def source_order(source, layout: Layout, epoch: int) -> np.ndarray:
    """The epoch's order of all positions: the source's own when it has one (the stream source keeps reads
    within a few shards: ``mmfast.loading.stream_source.block_order``), else ``epoch_order``."""
    own = getattr(source, "order", None)
    if own is not None:
        return own(layout.n, epoch, layout.seed, layout.shuffle)
    return epoch_order(layout.n, epoch, layout.seed, layout.shuffle)


@dataclass(frozen=True)
class Layout:
    """What a sampling needs to know of a loader: its samples, batch, shards and order."""

    n: int  # samples
    batch_size: int  # per process
    shard_id: int
    num_shards: int
    seed: int
    shuffle: bool
    drop_last: bool


class SampledSource(Protocol):
    """The two things a sampling asks of an image source (``mmfast.loading.sources``)."""

    ordered_by_loader: bool

    def samples_per_shard(self, n: int, num_shards: int) -> int | None: ...


class DataLoaderOrder:
    """DataLoader + DistributedSampler's order and shards, partial last batches (see the module doc)."""

    name = "dataloader"
    partial_last_batch = True  # the loader cuts DALI's filler off the last batch

    def epoch_size(self, layout: Layout) -> int:
        """Positions an epoch reads over all processes, before padding."""
        return layout.n

    def batches(self, layout: Layout, source: SampledSource) -> int:
        """Batches per epoch on one process (the same on every process)."""
        per_rank = source.samples_per_shard(layout.n, layout.num_shards)
        if per_rank is None:
            per_rank = math.ceil(layout.n / layout.num_shards)
        return per_rank // layout.batch_size if layout.drop_last else math.ceil(per_rank / layout.batch_size)

    def samples_per_rank(self, layout: Layout, source: SampledSource) -> int:
        """DistributedSampler's ``num_samples`` (with ``drop_last`` the loader delivers its whole batches)."""
        return math.ceil(layout.n / layout.num_shards)

    def positions(self, layout: Layout, source: SampledSource, epoch: int) -> np.ndarray:
        """Positions this process reads in ``epoch``, -1 filling up the last DALI batch."""
        mine = self.indices(layout, epoch)
        whole = self.batches(layout, source) * layout.batch_size
        return np.concatenate([mine[:whole], np.full(max(0, whole - len(mine)), -1, dtype=mine.dtype)])

    def indices(self, layout: Layout, epoch: int) -> np.ndarray:
        """What DataLoader code sees of ``epoch`` through ``loader.sampler``: DistributedSampler's list."""
        return distributed_sampler_indices(
            layout.n, epoch, layout.seed, layout.shuffle, layout.shard_id, layout.num_shards
        )


class WholeBatchOrder:
    """Whole batches, each sample at most once per epoch (see the module doc): what the training engine's
    gradient accumulation and evaluation count on."""

    name = "whole-batches"
    partial_last_batch = False

    def __repr__(self) -> str:  # read in help(MultimodalLoader)'s signature
        return "WHOLE_BATCHES" if type(self) is WholeBatchOrder else f"{type(self).__name__}()"

    def epoch_size(self, layout: Layout) -> int:
        """Positions an epoch reads over all processes, before padding."""
        return layout.n

    def batches(self, layout: Layout, source: SampledSource) -> int:
        per_rank = source.samples_per_shard(layout.n, layout.num_shards)
        if per_rank is not None:
            return per_rank // layout.batch_size if layout.drop_last else math.ceil(per_rank / layout.batch_size)
        return len(self.positions(layout, source, 0)) // layout.batch_size

    def samples_per_rank(self, layout: Layout, source: SampledSource) -> int:
        """The samples of its whole batches (a shuffling WebDataset reader's share without ``drop_last``)."""
        if not source.ordered_by_loader and not layout.drop_last:
            return math.ceil(layout.n / layout.num_shards)
        return self.batches(layout, source) * layout.batch_size

    def positions(self, layout: Layout, source: SampledSource | None, epoch: int) -> np.ndarray:
        order = source_order(source, layout, epoch)
        return shard_positions(order, layout.batch_size, layout.shard_id, layout.num_shards, layout.drop_last)

    def indices(self, layout: Layout, epoch: int, source: SampledSource | None = None) -> np.ndarray:
        mine = self.positions(layout, source, epoch)
        return mine[mine >= 0]


class MixedOrder(WholeBatchOrder):
    """The epochs of a mix of datasets (``mmfast.prepare.mix``), drawn from its sources by weight.

    An epoch is ``samples`` positions (default: all of them once): source i's share is ``weights[i]`` of it
    (largest remainders, so the shares sum to ``samples``). A share up to the source's size is the first rows
    of a permutation of them drawn for the epoch (another subset each epoch); a larger one is every row k times
    and such a subset for the rest (upsampling). The draws of every source are shuffled together and cut into
    whole batches per process as ``WHOLE_BATCHES`` does. Every draw is seeded by (seed, epoch, source), so the
    order is the same on 1 or N processes, and a resume continues it exactly.

    Args:
        groups: (n,) the source of each position (0..S-1).
        weights: S positive shares (normalized here).
        samples: positions per epoch over all processes; None: n.
    """

    name = "mixed"

    def __init__(self, groups: Sequence[int] | np.ndarray, weights: Sequence[float], samples: int | None = None):
        groups = np.asarray(groups, dtype=np.int64)
        w = np.asarray(weights, dtype=np.float64)
        if w.ndim != 1 or len(w) < 1 or not np.all(np.isfinite(w)) or np.any(w <= 0):
            raise ValueError(f"the weights of a mix must be positive numbers, got {list(weights)}")
        self.members = [np.flatnonzero(groups == i) for i in range(len(w))]
        empty = [i for i, m in enumerate(self.members) if not len(m)]
        if empty:
            raise ValueError(f"source {empty[0]} of the mix has no rows to draw from")
        self.n, self.weights = len(groups), w / w.sum()
        self.samples = self.n if samples is None else int(samples)
        if self.samples < 1:
            raise ValueError(f"samples per epoch must be >= 1, got {samples}")

    def __repr__(self) -> str:
        sizes = [len(m) for m in self.members]
        weights = [round(float(w), 4) for w in self.weights]
        return f"MixedOrder(sources of {sizes} rows, weights {weights}, {self.samples} samples per epoch)"

    def shares(self) -> list[int]:
        """Positions each source gets per epoch: ``weights`` of ``samples``, by largest remainders."""
        exact = self.weights * self.samples
        shares = np.floor(exact).astype(np.int64)
        rest = self.samples - int(shares.sum())
        shares[np.argsort(-(exact - shares), kind="stable")[:rest]] += 1
        return shares.tolist()

    def order(self, layout: Layout, epoch: int) -> np.ndarray:
        """The epoch's positions over all processes (see the class doc)."""
        if layout.n != self.n:
            raise ValueError(f"the mix's order is of {self.n} positions, the loader has {layout.n}")
        parts = []
        for i, (members, share) in enumerate(zip(self.members, self.shares(), strict=True)):
            full, rest = divmod(share, len(members))
            drawn = np.random.default_rng([layout.seed, epoch, 1 + i]).permutation(members)
            parts += [members] * full + [drawn[:rest]]
        order = np.concatenate(parts)
        return np.random.default_rng([layout.seed, epoch, 0]).permutation(order)

    def epoch_size(self, layout: Layout) -> int:
        return self.samples

    def batches(self, layout: Layout, source: SampledSource) -> int:
        per_global = layout.num_shards * layout.batch_size
        if layout.drop_last:
            return self.samples // per_global
        return math.ceil(math.ceil(self.samples / layout.num_shards) / layout.batch_size)

    def positions(self, layout: Layout, source: SampledSource | None, epoch: int) -> np.ndarray:
        order = self.order(layout, epoch)
        return shard_positions(order, layout.batch_size, layout.shard_id, layout.num_shards, layout.drop_last)


Sampling = DataLoaderOrder | WholeBatchOrder
DATALOADER = DataLoaderOrder()
WHOLE_BATCHES = WholeBatchOrder()


class ShardSampler:
    """``loader.sampler``: what DataLoader code expects of a (Distributed)Sampler.

    ``len()`` = samples this process yields per epoch (DistributedSampler's ``num_samples``), iteration =
    their indices into ``loader.dataset`` for the current epoch, ``set_epoch(e)`` = ``loader.set_epoch(e)``,
    and DistributedSampler's ``num_replicas``, ``rank``, ``shuffle``, ``seed``, ``epoch``.
    """

    def __init__(self, loader):
        self._ref = weakref.ref(loader)  # not a reference: a cycle would keep the loader's DALI pipeline alive

    @property
    def _loader(self):
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
        loader = self._loader
        return loader.sampling.samples_per_rank(loader.layout, loader.source)

    def __iter__(self) -> Iterator[int]:
        loader = self._loader
        if not loader.source.ordered_by_loader:
            raise TypeError("the WebDataset reader shards and shuffles inside DALI: no index list to show")
        if loader.sampling is WHOLE_BATCHES:
            return iter(loader.sampling.indices(loader.layout, loader.epoch, loader.source).tolist())
        return iter(loader.sampling.indices(loader.layout, loader.epoch).tolist())

    def set_epoch(self, epoch: int) -> None:
        self._loader.set_epoch(epoch)
