"""The streaming image source: WebDataset shards read member by member in the loader's order, from local tars
or from an object store / HTTP through a bounded local cache (``mmfast.remote.shard_cache``).

Why not DALI's WebDataset reader: it needs every tar on local disk when the pipeline is built and shuffles
with a buffer it cannot resume. Here the loader decides the order (so resume is exact, as for image files),
and a shard only has to be local while its samples are read: a Python feed (``ShardFeed``, DALI's
``external_source`` in batch mode, which DALI's checkpoints replay by iteration) reads each sample's bytes
at the offset its index line records, and asks the cache to fetch the shards the next batches need.

The order keeps reads local and starts after one shard (``window_order``): each epoch the shards are permuted
(seeded by seed and epoch) into a sequence, and each shard's samples are spread evenly over a window of up to
``window`` shard-lengths starting at its place in the sequence (the first shard's over one, the next ones'
widening to ``window``): at most ``window`` shards are being read at once, each in one stretch of the order,
and the epoch begins with its first shard alone (the first fetch is all a fresh run waits for). The order is
the same whether the tars are local or remote (what the streaming test checks, ids and pixels).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import numpy as np

from mmfast.data.batch import PAD_ID
from mmfast.data.dataset import WDS_ID_DIGITS
from mmfast.remote.errors import redact
from mmfast.remote.objects import is_remote
from mmfast.util.args import format_size
from mmfast.util.commands import PREPARE
from mmfast.util.voice import setting

if TYPE_CHECKING:
    from mmfast.loading.file_health import FileHealth
    from mmfast.remote.shard_cache import ShardCache

log = logging.getLogger(__name__)

DEFAULT_WINDOW = 4  # shards whose samples are mixed at any point of the order (the cache holds a few more)
LOOKAHEAD_BATCHES = 8  # batches ahead of the feed whose shards the cache is asked to fetch


def read_index(path: str | Path) -> np.ndarray:
    """(n, 3) int64 [offset, size, sample id] of an mmfast index file (``mmfast.inputs.wds``: DALI's v1.2
    format, one line ``img <offset> <size> <member>#<id>`` per sample)."""
    rows = []
    with open(path, encoding="utf-8") as f:
        f.readline()  # "v1.2 <lines>"
        for line in f:
            parts = line.split()
            if len(parts) >= 4:
                rows.append((int(parts[1]), int(parts[2]), int(parts[3][-WDS_ID_DIGITS:])))
    return np.array(rows, dtype=np.int64).reshape(-1, 3)


def window_order(shard_of: np.ndarray, epoch: int, seed: int, shuffle: bool, window: int) -> np.ndarray:
    """Positions 0..n-1 in the order of ``epoch``: the shards in a sequence permuted by (seed, epoch), shard
    number k of it spread over [k, k + min(k + 1, ``window``)) in shard-lengths (its m samples stratified: a
    random one of them in each m-th of the span, in random order); without ``shuffle`` shard by shard in index
    order.

    So the epoch begins with its first shard alone (a fresh run's first batch waits for one fetch, as long as
    the prefetch + 1 batches DALI reads before it hold no more than a shard), the spans widen to ``window``
    over the next shards, and from then on a new shard is needed every shard-length; at most ``window``
    shards are being read at once, and each is read in one stretch of the order, never again that epoch.

    Args:
        shard_of: (n,) the shard of each position.
    """
    by_shard = np.argsort(shard_of, kind="stable")  # positions grouped by shard, in index order within
    if not shuffle:
        return by_shard
    rng = np.random.default_rng([seed, epoch, 0x5EED])
    shards, starts, counts = np.unique(shard_of[by_shard], return_index=True, return_counts=True)
    place = np.empty(len(shards), dtype=np.int64)
    place[rng.permutation(len(shards))] = np.arange(len(shards))  # each shard's place in the sequence
    keys = np.empty(len(shard_of))
    for k, (start, m) in enumerate(zip(starts, counts, strict=True)):
        strata = (rng.permutation(m) + rng.random(m)) / m  # one in each m-th of [0, 1)
        keys[by_shard[start : start + m]] = place[k] + min(place[k] + 1, window) * strata
    return np.argsort(keys, kind="stable")


class StreamSource:
    """WebDataset shards (local paths or URLs) read by their index files in the loader's order.

    Args:
        tars: the shards, local paths or URLs (``s3://``, ``gs://``, ``hf://``, ``https://``).
        index: the index file of each (local).
        checks: (size, sha256) of each shard as preparation recorded it (None: not known; a remote shard
            then is checked by size only when the store reports one).
        cache: where remote shards are held; None when every shard is local.
        window: shards whose samples are mixed at any point of the order (``window_order``).

    Raises:
        ValueError: a remote shard and no cache.
    """

    name = "stream"
    ordered_by_loader = True
    can_skip_bad = False  # the samples were checked when they were indexed
    needs_paths = False
    reader_name = None  # an external source: the iterator runs until the feed's positions end

    def __init__(
        self,
        tars: Sequence[str],
        index: Sequence[str],
        checks: Sequence[tuple[int | None, str | None]] | None = None,
        cache: ShardCache | None = None,
        window: int = DEFAULT_WINDOW,
    ):
        self.tars, self.index = [str(t) for t in tars], [str(i) for i in index]
        self.checks = list(checks) if checks else [(None, None)] * len(self.tars)
        self.cache, self.window = cache, max(1, int(window))
        if cache is None and any(is_remote(t) for t in self.tars):
            raise ValueError(f"{redact(next(t for t in self.tars if is_remote(t)))}: remote shards need a cache")
        where: dict[int, tuple[int, int, int]] = {}
        for k, idx in enumerate(self.index):
            for offset, size, sid in read_index(idx):
                where[int(sid)] = (k, int(offset), int(size))
        self._where = where
        self.shard_of = np.zeros(0, dtype=np.int64)  # per position, once ``bind`` knows the loader's ids
        self._loc = np.zeros((0, 3), dtype=np.int64)

    def bind(self, ids: np.ndarray) -> None:
        """Where each of the loader's positions lies: its shard, offset and size (by sample id)."""
        try:
            loc = np.array([self._where[int(i)] for i in ids], dtype=np.int64).reshape(-1, 3)
        except KeyError as e:
            raise ValueError(
                f"sample id {e.args[0]} is in no index file of the shards; re-run {PREPARE}"
            ) from None
        self._loc, self.shard_of = loc, loc[:, 0]

    def grouped_note(self, labels, batch_size: int) -> str:
        """A note when the shards are grouped by class (as img2dataset and many exports write them): the order
        mixes only ``window`` shards at a time, so its batches hold far fewer classes than shuffled ones would.
        ``labels``: each bound position's class. "" when the order's batches mix the classes as well as 0.7 of
        a shuffle's, or for fewer than 3 classes."""
        labels = np.asarray(labels)
        if len(np.unique(labels)) < 3 or len(labels) < 2 * batch_size:
            return ""

        def per_batch(order: np.ndarray) -> float:  # distinct classes in a batch, on average
            whole = order[: len(order) // batch_size * batch_size].reshape(-1, batch_size)
            return float(np.mean([len(np.unique(labels[b])) for b in whole]))

        streamed = per_batch(window_order(self.shard_of, 0, 0, True, self.window))
        shuffled = per_batch(np.random.default_rng(0).permutation(len(labels)))
        if streamed >= 0.7 * shuffled:
            return ""
        return (
            f"note: the train shards are grouped by class: --source stream mixes {self.window} shards at a time, "
            f"so a batch holds {streamed:.1f} classes on average against {shuffled:.1f} shuffled; --source wds "
            "shuffles local shards across each other, and shards written with the classes mixed stream better"
        )

    def order(self, n: int, epoch: int, seed: int, shuffle: bool) -> np.ndarray:
        """The epoch's order of the loader's positions (``window_order``)."""
        if len(self.shard_of) != n:
            raise RuntimeError(f"StreamSource bound to {len(self.shard_of)} positions, the loader has {n}")
        return window_order(self.shard_of, epoch, seed, shuffle, self.window)

    def reader(
        self, positions: np.ndarray, health: FileHealth, shard_id: int, num_shards: int, shuffle: bool
    ) -> Callable[[], tuple]:
        feed = ShardFeed(self, positions, np.asarray(health.ids))
        return functools.partial(read_stream, feed)

    def samples_per_shard(self, n: int, num_shards: int) -> int | None:
        return None  # the loader's sampling decides

    def read_error(self, error: RuntimeError) -> RuntimeError:
        return RuntimeError(f"reading the streamed shards failed: {error}")

    @contextlib.contextmanager
    def open_shard(self, k: int) -> Iterator[BinaryIO]:
        """Shard ``k`` open for reading: the local tar itself, or the cache's verified copy (fetched now if
        needed), which no process evicts while it is open here."""
        tar = self.tars[k]
        if not is_remote(tar):
            with open(tar, "rb") as f:
                yield f
            return
        size, sha256 = self.checks[k]
        with self.cache.pinned(tar, size, sha256) as path, open(path, "rb") as f:
            yield f

    def prefetch(self, shards: Sequence[int]) -> None:
        """Ask the cache to fetch these shards (remote ones) in this order, in the background: as many as it
        holds beside the shard being read (more would evict shards before their first read)."""
        if self.cache is None:
            return
        items = [(self.tars[k], *self.checks[k]) for k in dict.fromkeys(shards) if is_remote(self.tars[k])]
        if items:
            self.cache.prefetch(items[: self.shards_held() - 1 or 1])

    def shards_held(self) -> int:
        """How many of the largest shards the cache holds (its limit, plus the one shard it may exceed it by);
        warns (once per cache) when that is fewer than the window's shards and two more (the next one arriving
        while the window is read): the order then fetches shards more than once per epoch."""
        biggest = max((c[0] or 0 for c in self.checks), default=0) or 1
        held = self.cache.limit_bytes // biggest + 1 if self.cache is not None else len(self.tars)
        wanted = self.window + 2
        if held < wanted and self.cache is not None:
            self.cache.warn_once(
                f"the shard cache holds {held} shard{'s' * (held != 1)} of {biggest / 2**20:.1f} MiB, fewer than "
                f"the {self.window} the order reads from at once and the 2 it fetches ahead: a shard will be "
                f"fetched again each time the order comes back to it, many times per epoch; raise "
                f"{setting('limit_bytes', '--cache-limit')} to {format_size(wanted * biggest)} or more"
                + (" (a size without a unit is bytes)" if self.cache.limit_bytes < 2**20 else "")
            )
        return held


def read_stream(feed: ShardFeed):
    """The stream source's reader: encoded images (B,) and sample ids (B, 1) int32 from ``feed``."""
    from nvidia.dali import fn  # DALI: heavy, and absent where only the prepare side runs
    from nvidia.dali.pipeline import Pipeline

    feed.batch_size = int(Pipeline.current().max_batch_size)  # defined inside the pipeline it feeds
    encoded, ids = fn.external_source(source=feed, num_outputs=2, batch=True, batch_info=True)
    return encoded, ids


class ShardFeed:
    """DALI's batch-mode source over ``positions`` (-1: padding): batch ``info.iteration`` is the encoded bytes
    and sample ids of positions [i * B, (i + 1) * B); DALI's checkpoints restore the iteration, so a resumed
    stream reads on from the right batch. Before reading, it asks the cache for the shards of the next
    ``LOOKAHEAD_BATCHES`` batches."""

    def __init__(self, source: StreamSource, positions: np.ndarray, ids: np.ndarray):
        self.source, self.positions, self.ids = source, np.asarray(positions), ids
        self.batch_size = 0  # DALI's batch: set where the pipeline is defined (``read_stream``)
        self._lock = threading.Lock()
        self._asked = -1  # the last batch whose shards were handed to the cache

    def __call__(self, info) -> tuple[list[np.ndarray], list[np.ndarray]]:
        b, i = self.batch_size, info.iteration
        mine = self.positions[i * b : (i + 1) * b]
        if len(mine) < b:
            raise StopIteration
        self._ask_ahead(i, b)
        with self._lock:
            return self._read(mine)

    def _ask_ahead(self, i: int, b: int) -> None:
        last = i + LOOKAHEAD_BATCHES
        if last <= self._asked:
            return
        ahead = self.positions[max(i, self._asked + 1) * b : (last + 1) * b]
        ahead = ahead[ahead >= 0]
        self._asked = last
        if len(ahead):
            self.source.prefetch(self.source.shard_of[ahead].tolist())

    def _read(self, mine: np.ndarray) -> tuple[list[np.ndarray], list[np.ndarray]]:
        loc = self.source._loc
        real = mine[mine >= 0]
        filler = int(real[0]) if len(real) else int(self.positions[self.positions >= 0][0])
        data: dict[int, np.ndarray] = {}
        wanted = np.append(real, filler)
        for k in np.unique(loc[wanted, 0]):
            with self.source.open_shard(int(k)) as f:
                for p in sorted({int(q) for q in wanted if loc[q, 0] == k}, key=lambda q: loc[q, 1]):
                    f.seek(int(loc[p, 1]))
                    data[p] = np.frombuffer(f.read(int(loc[p, 2])), dtype=np.uint8)
                    if len(data[p]) != loc[p, 2]:
                        raise RuntimeError(
                            f"{redact(self.source.tars[k])}: sample {int(self.ids[p])} ends past the shard's end "
                            f"(offset {loc[p, 1]}, {loc[p, 2]} bytes); the shard changed since it was "
                            f"indexed: re-run {PREPARE}"
                        )
        images = [data[int(p)] if p >= 0 else data[filler] for p in mine]
        ids = [np.array([int(self.ids[p]) if p >= 0 else PAD_ID], dtype=np.int32) for p in mine]
        return images, ids
