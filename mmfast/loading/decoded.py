"""Images decoded once and kept in memory (``cache_decoded``): on the CPU path every later epoch crops from RAM.

Why: on small images the decode is most of the CPU path's work and nothing makes it cheaper (a PNG has no
region-of-interest decode: decoding a small icon costs more than finishing its crop; docs/benchmarks/). A
set whose decoded pixels fit in memory need not pay it every epoch: FFCV stores such sets
as raw pixels for the same reason. Here the loader decodes each image the first time an epoch needs it, with
the same DALI decoder as the streaming path, and keeps the uint8 HWC array; each batch then cuts its random
resized crops and flips in numpy, takes the crops as views and hands them to the host finishing, exactly as the
ragged DALI iterator does.

The draws are the streaming graph's (``mmfast.loading.draws``: a function of (seed, epoch, sample id)), and so
are the crop windows: the same sample of the same epoch gets the same crop and flip from memory as from DALI,
on any process count, and a resumed run yields the same batches without any pipeline checkpoint. Colour
jitter is not applied on this path (asking for both is an error), and the GPU path never uses it (nvJPEG
decodes there).
"""

from __future__ import annotations

import functools
import logging
import math
import resource
from pathlib import Path

import numpy as np
import torch

from mmfast.data.batch import PAD_ID
from mmfast.data.validate import image_header
from mmfast.loading.draws import ATTEMPTS, DRAWS, FLIP, crop_boxes, resized_crop_boxes, sample_uniforms
from mmfast.loading.file_health import FileHealth
from mmfast.loading.graphs import decode_pipeline
from mmfast.loading.sources import read_files

log = logging.getLogger(__name__)
MEMORY_SHARE = 0.5  # of the memory available when decoding starts, the most the cache may take by default
DECODE_BATCH = 16  # images per DALI batch while filling: under DALI_SAFE_BATCH (mmfast/loading/graphs.py)


def available_memory(cgroup_root: str = "/sys/fs/cgroup", proc: str = "/proc/self") -> int:
    """Bytes this process may still take: Linux's MemAvailable (free memory plus the page cache it can drop),
    capped by each memory cgroup the process is in and their parents (its own, as /proc/self/cgroup names it:
    a Slurm job's or a systemd unit's, not only the root's; v2 or v1), each's limit less its use, and by its
    address-space limit (``ulimit -v``) less what it maps already; 4 GiB where none can be read.

    Args:
        cgroup_root, proc: where the cgroup file systems and this process's /proc entry are (tests point
            them at a layout of their own).
    """
    found = []
    try:
        with open("/proc/meminfo" if proc == "/proc/self" else f"{proc}/meminfo") as f:
            found += [int(ln.split()[1]) * 1024 for ln in f if ln.startswith("MemAvailable:")]
    except OSError:
        pass
    found += [max(0, cap - used) for cap, used in _cgroup_limits(Path(cgroup_root), Path(proc))]
    found += _address_space_left(Path(proc))
    return min(found) if found else 4 << 30


def _cgroup_limits(root: Path, proc: Path) -> list[tuple[int, int]]:
    """(limit, usage) of every memory cgroup over this process that has a limit: the ones /proc/self/cgroup
    names and their parents, then the root's own files (a container whose namespace shows "/")."""
    folders = []
    try:
        lines = (proc / "cgroup").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:  # "0::/path" (v2) or "4:memory:/path" (v1)
        _, controllers, path = line.split(":", 2)
        base = root if controllers == "" else root / "memory" if "memory" in controllers.split(",") else None
        if base is None:
            continue
        parts = [p for p in path.split("/") if p]
        folders += [(base.joinpath(*parts[:k]), controllers == "") for k in range(len(parts), -1, -1)]
    folders += [(root, True), (root / "memory", False)]
    limits = []
    for folder, v2 in dict.fromkeys(folders):
        names = ("memory.max", "memory.current") if v2 else ("memory.limit_in_bytes", "memory.usage_in_bytes")
        try:
            cap, used = ((folder / n).read_text().strip() for n in names)
        except OSError:
            continue
        if cap.isdigit() and used.isdigit() and int(cap) < 1 << 60:  # "max" / a huge number: no limit
            limits.append((int(cap), int(used)))
    return limits


def _address_space_left(proc: Path) -> list[int]:
    """[bytes] the address-space limit (RLIMIT_AS, ``ulimit -v``) leaves this process, if it has one."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return []
    try:
        status = (proc / "status").read_text().splitlines()
        mapped = next(int(ln.split()[1]) * 1024 for ln in status if ln.startswith("VmSize:"))
    except (OSError, StopIteration, ValueError):
        return []
    return [max(0, soft - mapped)]


def default_budget() -> int:
    """Bytes the cache may hold: ``MEMORY_SHARE`` of the memory available now."""
    return int(available_memory() * MEMORY_SHARE)


AUTO_SAMPLE = 64  # image headers read to estimate a set's decoded size for cache_decoded="auto"
# cache_decoded="auto" streams the train split of JPEGs larger than this many times the output's pixels: a
# streamed random crop decodes only its region, while the cache's first epoch decodes each image whole and
# writes it to memory (docs/benchmarks/notes/2026-12-01-dropin-auto-cache.md)
AUTO_JPEG_PIXELS = 4


def auto_plan(files: list[str], size: int, train: bool, budget: int) -> tuple[bool, str]:
    """Whether ``cache_decoded="auto"`` holds ``files`` decoded, and why: from the headers of up to
    ``AUTO_SAMPLE`` of them (spread over the list), it does when their estimated decoded size fits in
    ``budget`` with a quarter to spare, except for the train crops of large JPEGs (``AUTO_JPEG_PIXELS``)."""
    from PIL import Image  # PIL: only when an image is opened here

    picks = np.unique(np.linspace(0, len(files) - 1, min(AUTO_SAMPLE, len(files))).round().astype(int))
    pixels, jpeg = [], 0
    for p in picks.tolist():
        try:
            header = image_header(files[p])
        except Image.DecompressionBombError:
            header = None
        if header is not None:  # a bad file is found and handled when it is read
            pixels.append(header[0] * header[1])
            jpeg += header[2] == "JPEG"
    if not pixels:
        return False, "none of the sampled files could be opened"
    mean = float(np.mean(pixels))
    need = 3 * mean * len(files)
    if need * 1.25 > budget:
        return False, f"decoded, they would take ~{need / 2**20:.0f} MiB, over the {budget / 2**20:.0f} MiB budget"
    if train and jpeg * 2 >= len(pixels) and mean > AUTO_JPEG_PIXELS * size * size:
        side = math.sqrt(mean)
        return False, f"JPEGs of ~{side:.0f}x{side:.0f} px: a streamed random crop decodes only its region"
    return True, f"~{need / 2**20:.0f} MiB decoded"


class DecodedImages:
    """The decoded images of a loader's files, by position, filled in as batches need them.

    ``plan`` starts a DALI pipeline over an epoch's images not held yet, in the order the epoch reads them;
    ``ensure`` takes its batches until a loader batch's images are at hand, so the first batch comes after
    one DALI batch, not after the whole set, and DALI decodes ahead (its prefetch) while the batches before
    are finished. Past the budget the rest of the epoch is decoded for its batch only (``over``): the loader
    then streams from the next epoch on.

    Args:
        health: the loader's file bookkeeping (a file DALI cannot decode is marked bad there and served as
            a masked stand-in, as on the streaming path).
        num_threads: DALI threads decoding.
        budget: most bytes to keep (default: ``default_budget() // share`` when first filled: what other
            loaders of the process hold by then is not available any more).
        share: processes of the machine sharing the default budget.
    """

    def __init__(self, health: FileHealth, num_threads: int, budget: int | None = None, share: int = 1):
        self.health = health
        self.num_threads = num_threads
        self.budget, self.share = budget, share
        self.images: list[np.ndarray | None] = [None] * len(health.files)
        self.nbytes = 0
        self.decoded = 0  # images decoded so far
        self.over = False  # the budget was passed: images beyond it are decoded for their batch only
        self._passing: dict[int, np.ndarray] = {}  # those images, until their batch is built
        self._fill: _Fill | None = None

    def plan(self, positions: np.ndarray) -> None:
        """Start decoding the images of ``positions`` (-1 = padding) not held yet, in that order, the
        stand-in first."""
        if self.budget is None:
            self.budget = default_budget() // self.share
        self.close()
        todo = self._missing([self.stand_in()] + positions.tolist())
        if todo:
            log.info("cache_decoded: decoding %d images once, as the batches need them", len(todo))
            self._fill = _Fill(self, todo)

    def ensure(self, positions: list[int]) -> None:
        """Decode until the image of each of ``positions`` (no padding) is at hand (``image``)."""
        while todo := self._missing([self.stand_in()] + positions):
            fill = self._fill
            if fill is not None and all(fill.ahead(p) for p in todo):
                fill.step()
                continue
            side = _Fill(self, todo)  # not next in the plan (a stand-in found bad): decode them now
            while not side.done:
                side.step()

    def image(self, p: int) -> np.ndarray | None:
        held = self.images[p]
        return held if held is not None else self._passing.get(p)

    def release(self, positions: list[int]) -> None:
        """The batch of ``positions`` is built: the images decoded for it only may go."""
        stand_in = self.stand_in()
        for p in positions:
            if p != stand_in:
                self._passing.pop(p, None)

    def forget(self, positions: list[int]) -> None:
        """Drop the images of ``positions`` (their files changed): decoded again when next needed."""
        for p in positions:
            held = self.images[p]
            if held is not None:
                self.nbytes -= held.nbytes
                self.images[p] = None
            self._passing.pop(p, None)

    def close(self) -> None:
        """Stop the fill (its DALI pipeline)."""
        if self._fill is not None:
            self._fill.close()
            self._fill = None

    def stand_in(self) -> int:
        """The position whose image stands in for padding and bad files (served with id ``PAD_ID``)."""
        return self.health.first_good_position()

    def _missing(self, positions: list[int]) -> list[int]:
        bad = self.health.bad
        wanted = dict.fromkeys(p for p in positions if p >= 0)
        return [p for p in wanted if p not in bad and self.image(p) is None]

    def _keep(self, p: int, image: np.ndarray) -> None:
        copy = np.array(image, copy=True)  # DALI reuses its output buffers
        self.decoded += 1
        if not self.over and self.nbytes + copy.nbytes <= self.budget:
            self.images[p] = copy
            self.nbytes += copy.nbytes
        else:
            self.over = True
            self._passing[p] = copy


class _Fill:
    """A DALI pipeline decoding ``todo`` (positions) in batches of ``DECODE_BATCH``, a batch per ``step``."""

    def __init__(self, cache: DecodedImages, todo: list[int]):
        self.cache = cache
        self._start(todo)
        self.pipe = None

    def _start(self, todo: list[int]) -> None:
        self.todo, self.next = todo, 0  # next: index in todo of the next batch's first image
        self.index = {p: i for i, p in enumerate(todo)}

    @property
    def done(self) -> bool:
        return self.next >= len(self.todo)

    def ahead(self, p: int) -> bool:
        """Whether ``p`` is still to come in this fill."""
        return self.index.get(p, -1) >= self.next

    def step(self) -> None:
        """Decode the next batch into the cache; a file DALI fails on is found, marked bad, and the fill goes
        on after it with a new pipeline."""
        health = self.cache.health
        if self.pipe is None:
            rest = self.todo[self.next :]
            names = [health.dali_files[p] for p in rest]
            read = functools.partial(read_files, names, rest)  # labelled by position
            self.batch = min(DECODE_BATCH, len(rest))
            threads = self.cache.num_threads
            self.pipe = decode_pipeline(
                read=read, batch_size=self.batch, num_threads=threads, device_id=None, prefetch_queue_depth=2
            )
            self.pipe.build()
        try:
            images, labels = self.pipe.run()
        except RuntimeError:  # DALI aborts the whole batch on a file it cannot read: find it, go on without it
            self.close()
            if not health.check_window(np.asarray(self.todo[self.next : self.next + 2 * DECODE_BATCH])):
                raise
            self._start(self.cache._missing([self.cache.stand_in()] + self.todo[self.next :]))
            return
        fresh = min(self.batch, len(self.todo) - self.next)  # past the end, the reader wraps around
        self.next += self.batch
        for k in range(fresh):
            p = int(np.asarray(labels[k]).reshape(-1)[0])
            if self.cache.image(p) is None:
                self.cache._keep(p, images[k])
        if self.done:
            self.close()

    def close(self) -> None:
        self.pipe = None  # DALI stops its threads when the pipeline is collected


class DecodedIterator:
    """Batches of ``positions`` from ``DecodedImages`` in the form of ``host_finish.ragged_iterator``'s:
    ``[{"crops": B x (h, w, 3) uint8, "flips": (B, 1) int32, "id": (B, 1) int32}]``.

    Args:
        cache: the decoded images (``ensure``d for ``positions``).
        positions: positions in the loader's files, whole batches (-1 = padding).
        ids: sample id of each file position.
        batch_size: B.
        key: (seed, shard, epoch, first step); the draws depend on the seed, the epoch and each sample's id.
        train: random resized crops and flips; otherwise whole images (the eval finishing resizes them).
        scale, ratio, flip: the random resized crop's ranges, and whether to mirror half the images.
        host_windows: the crops of ``draws.resized_crop_boxes`` (the streaming graph's when the loader knows the
            images' sizes), else of ``draws.crop_boxes``.
    """

    def __init__(self, cache: DecodedImages, positions, ids, batch_size, key, train, scale, ratio, flip,
                 host_windows: bool = False):  # fmt: skip
        self.cache, self.positions, self.ids, self.batch_size = cache, positions, ids, batch_size
        self.key, self.train, self.scale, self.ratio, self.flip = key, train, scale, ratio, flip
        self.host_windows = host_windows
        self.step = 0

    def __iter__(self):
        return self

    def __next__(self) -> list[dict]:
        b = self.batch_size
        pos = self.positions[self.step * b : (self.step + 1) * b]
        if len(pos) == 0:
            raise StopIteration
        seed, _, epoch, _ = self.key
        cache = self.cache
        cache.ensure([p for p in pos.tolist() if p >= 0])  # may find files bad
        bad, stand_in = cache.health.bad, cache.stand_in()
        use = [p if p >= 0 and p not in bad else stand_in for p in pos.tolist()]
        ids = np.array([self.ids[p] if p >= 0 and p not in bad else PAD_ID for p in pos.tolist()], dtype=np.int32)
        whole = [cache.image(p) for p in use]
        cache.release(use)  # the crops below hold what they need
        if self.train:  # the draws of the graph's crops (mmfast.loading.draws): (seed, epoch, id) alone
            keys = np.array([self.ids[p] if p >= 0 else PAD_ID for p in pos.tolist()], dtype=np.int64)
            shapes = np.array([i.shape[:2] for i in whole])
            if self.host_windows:
                u = sample_uniforms(seed, np.full(len(pos), epoch), keys, DRAWS + 2 * (ATTEMPTS - 1))
                boxes = resized_crop_boxes(shapes, u, self.scale, self.ratio)
            else:
                u = sample_uniforms(seed, np.full(len(pos), epoch), keys)
                boxes = crop_boxes(shapes, u, self.scale, self.ratio)
            pairs = zip(whole, boxes.tolist(), strict=True)
            crops = [torch.from_numpy(i[t : t + h, x : x + w]) for i, (t, x, h, w) in pairs]
            flips = u[:, FLIP] < 0.5 if self.flip else np.zeros(len(pos), dtype=bool)
        else:
            crops, flips = [torch.from_numpy(i) for i in whole], np.zeros(len(pos), dtype=bool)
        self.step += 1  # only now: a batch that failed (a bad file with on_bad_image="error") comes again
        return [
            {
                "crops": crops,
                "flips": torch.from_numpy(flips.astype(np.int32)).view(-1, 1),
                "id": torch.from_numpy(ids).view(-1, 1),
            }
        ]

    def checkpoints(self) -> list[None]:
        """No pipeline state: (epoch, step) alone says where a resumed run continues."""
        return [None]

    def reset(self) -> None:
        self.step = 0
