"""The feature cache: a locked tower's features, computed once per stored view and served by sample id.

Layout of a cache directory (one per split), swapped in whole by ``fsutil.atomic_dir``:
    views.bin    (K, N, C) the tower's pooled features of K augmented views of each sample; view v of sample i
                 is the train augmentation drawn from (seed, v, i), the pixels training epoch v would see
    centre.bin   (N, C) the features of the centre view (resized and center-cropped, as evaluation sees it)
    ids.npy      (N,) int64 sample ids, ascending: row r of both arrays is sample ids[r]
    meta.json    the fingerprint, its parts, the dtype and the shapes, each array's SHA-256, and a digest of the
                 image files' sizes when it was built ("files"); written last
A cache of one feature per sample (K = 0: a locked text tower's feature of each caption) has no views.bin; its
centre.bin holds the one feature.
A sample whose image cannot be read (the loader skips it: ``FileHealth``) has zeros in every view and is listed in
the meta's ``absent``, with its file and why: the loader serves it masked, as the decoded path does. Once the file
is fixed, the files' digest (below) makes the cache stale.
The fingerprint covers the data (the prepared directory's fingerprint), the tower's weights (``weights_digest``),
the preprocessing and the views. ``open_or_build`` reads a cache whose fingerprint and files match; otherwise it
builds a new one under a temp name and swaps it in, so a stale, damaged or partial cache is never read: the
check before a run reads the arrays' content against their SHA-256 (bytes overwritten in place keep the size). An
image
file replaced in place since the build by one of another size (an image fixed, or a failed download's error page)
makes it stale too: the digest of the files' sizes. Sizes, not mtimes: copies of the data on several machines
agree on them, so every machine judges a shared cache alike.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from mmfast.util.fsutil import atomic_dir, atomic_write_json, dir_lock_path, file_sha256
from mmfast.util.locks import file_lock

log = logging.getLogger(__name__)
FORMAT_VERSION = 3  # 2: unreadable images' samples listed as absent; 3: each array's SHA-256 in the meta
KIND = "mmfast feature cache"  # the marker's kind: only a directory of this kind is replaced
DTYPES = ("float16", "float32")
_NO_CACHE = "no cache yet"


def weights_digest(module: torch.nn.Module) -> str:
    """SHA-256 of a module's state dict (parameters and buffers: names, dtypes, shapes, bytes) in name order."""
    h = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        t = tensor.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def feature_fingerprint(parts: dict) -> str:
    """Hash of what the features depend on (``parts``: JSON-serializable) and this format's version."""
    text = json.dumps({"format": FORMAT_VERSION, **parts}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


class FeatureCache:
    """A complete cache directory, memory-mapped read-only.

    Raises:
        ValueError: the directory is not a complete cache (no meta, files missing or of the wrong size).
    """

    def __init__(self, directory: str | os.PathLike):
        self.dir = Path(directory)
        meta, problem = _read_meta(self.dir)
        problem = problem or _check_files(self.dir, meta)
        if problem:
            raise ValueError(f"feature cache {self.dir} is damaged or incomplete ({problem})")
        self.meta = meta
        self.views, self.width = int(meta["views"]), int(meta["width"])
        n, dtype = int(meta["rows"]), np.dtype(meta["dtype"])
        self.ids = np.load(self.dir / "ids.npy")
        self._views = (
            np.memmap(self.dir / "views.bin", dtype=dtype, mode="r", shape=(self.views, n, self.width))
            if self.views
            else None  # one feature per sample: centre.bin only
        )
        self._centre = np.memmap(self.dir / "centre.bin", dtype=dtype, mode="r", shape=(n, self.width))
        # sample id -> {"image", "reason", ...}: the samples whose image could not be read (zeros here)
        self.absent = {int(e["id"]): e for e in meta.get("absent", [])}

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def fingerprint(self) -> str:
        return self.meta["fingerprint"]

    @property
    def nbytes(self) -> int:
        return (self._views.nbytes if self._views is not None else 0) + self._centre.nbytes

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """Row of each sample id (-1 for padding, id < 0).

        Raises:
            IndexError: an id the cache does not hold.
        """
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        rows = np.searchsorted(self.ids, ids).clip(0, max(0, len(self.ids) - 1))
        found = (ids >= 0) & (self.ids[rows] == ids) if len(self.ids) else np.zeros(len(ids), bool)
        if np.any((ids >= 0) & ~found):
            bad = ids[(ids >= 0) & ~found][:5].tolist()
            raise IndexError(f"sample ids {bad} are not in the feature cache {self.dir}")
        return np.where(ids >= 0, rows, -1)

    def gather(self, ids: np.ndarray | torch.Tensor, view: int | None) -> torch.Tensor:
        """(B, C) float32 features of sample ``ids`` in stored ``view`` (None: the centre view); zeros for
        padding (id < 0)."""
        ids = ids.cpu().numpy() if isinstance(ids, torch.Tensor) else ids
        rows = self.rows(ids)
        table = self._centre if view is None else self._views[view]
        out = np.asarray(table[np.maximum(rows, 0)], dtype=np.float32)
        out[rows < 0] = 0.0
        return torch.from_numpy(out)


class FeatureWriter:
    """Fills a cache directory under construction: ``put`` each batch of each view, then ``finish``."""

    def __init__(self, directory: Path, ids: np.ndarray, views: int, width: int, dtype: str):
        if dtype not in DTYPES:
            raise ValueError(f"feature cache dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        self.dir, self.views, self.width, self.dtype = Path(directory), views, width, dtype
        self.ids = np.asarray(ids, dtype=np.int64)
        if len(self.ids) and np.any(np.diff(self.ids) <= 0):
            raise ValueError("a feature cache's sample ids must be ascending and distinct")
        n = len(self.ids)
        self._views = (
            np.memmap(self.dir / "views.bin", dtype=dtype, mode="w+", shape=(views, max(n, 1), width))
            if views
            else None
        )
        self._centre = np.memmap(self.dir / "centre.bin", dtype=dtype, mode="w+", shape=(max(n, 1), width))
        self._filled = np.zeros((views + 1, n), dtype=bool)  # the centre view last
        self._absent: dict[int, dict] = {}  # sample id -> its ``absent`` entry

    def put(self, view: int | None, ids: np.ndarray | torch.Tensor, features: torch.Tensor) -> None:
        """Store ``features`` (B, C) of sample ``ids`` (B,) for ``view`` (None: the centre view); rows of
        padding (id < 0) are left out."""
        ids = np.asarray(ids.cpu() if isinstance(ids, torch.Tensor) else ids, dtype=np.int64).reshape(-1)
        feats = features.detach().float().cpu().numpy()
        if feats.shape != (len(ids), self.width):
            raise ValueError(f"features of shape {feats.shape} for {len(ids)} samples of width {self.width}")
        keep = ids >= 0
        rows = np.searchsorted(self.ids, ids[keep])
        if np.any(rows >= len(self.ids)) or np.any(self.ids[np.minimum(rows, len(self.ids) - 1)] != ids[keep]):
            raise IndexError(f"features of sample ids outside the cache's {len(self.ids)} ids")
        table = self._centre if view is None else self._views[view]
        table[rows] = feats[keep].astype(self.dtype)
        self._filled[self.views if view is None else view, rows] = True

    def absent(self, entries: list[dict]) -> None:
        """The samples whose image could not be read (``FileHealth.skipped``' entries: "id", "image",
        "reason"): zeros in every view, and listed in the meta."""
        for entry in entries:
            i = int(entry["id"])
            row = int(np.searchsorted(self.ids, i))
            if row >= len(self.ids) or self.ids[row] != i:
                raise IndexError(f"an unreadable image's sample id {i} is outside the cache's {len(self.ids)} ids")
            for table in (self._centre, *(self._views if self._views is not None else ())):
                table[row] = 0
            self._filled[:, row] = True
            self._absent[i] = {"id": i, "image": entry["image"], "reason": entry["reason"]}

    def finish(self, fingerprint: str, parts: dict, files: str | None = None) -> None:
        """Flush the arrays and write ``ids.npy`` and ``meta.json`` (last).

        Raises:
            ValueError: a view of some sample was never ``put`` (nor found ``absent``).
        """
        if not self._filled.all():
            view, row = np.argwhere(~self._filled)[0]
            which = "the centre view" if view == self.views else f"view {view}"
            raise ValueError(f"feature cache incomplete: {which} of sample {int(self.ids[row])} was not computed")
        if self._views is not None:
            self._views.flush()
        self._centre.flush()
        np.save(self.dir / "ids.npy", self.ids)
        arrays = ("ids.npy", "centre.bin", *(("views.bin",) if self._views is not None else ()))
        meta = {
            "format": FORMAT_VERSION, "fingerprint": fingerprint, "parts": parts, "dtype": self.dtype,
            "views": self.views, "rows": len(self.ids), "width": self.width,
            "absent": [self._absent[i] for i in sorted(self._absent)],
            "sha256": {name: file_sha256(self.dir / name) for name in arrays},
            **({"files": files} if files is not None else {}),
        }  # fmt: skip
        atomic_write_json(self.dir / "meta.json", meta)

    def close(self) -> None:
        """Drop the memory maps (no ``put`` after)."""
        self._views = self._centre = None


def stale_reason(directory: str | os.PathLike, parts: dict, files: Callable[[], str] | None = None) -> str:
    """Why the cache in ``directory`` cannot be read for ``parts`` ("" when it can): missing, incomplete,
    damaged, or built for other data, weights, preprocessing or views (the parts that differ are named), or, with
    ``files`` (gives the image files' digest now: ``files_digest``; called only when all else is current), from
    image files that have changed since."""
    directory, parts = Path(directory), plain_parts(parts)
    if not directory.exists():
        return _NO_CACHE
    meta, problem = _read_meta(directory)
    if problem:
        return problem
    if meta.get("fingerprint") != feature_fingerprint(parts):
        old = meta.get("parts") or {}
        differ = sorted(k for k in set(old) | set(parts) if old.get(k) != parts.get(k)) or ["format"]
        named = " and ".join([", ".join(differ[:-1]), differ[-1]] if len(differ) > 1 else differ)
        return f"the {named} changed since it was built"
    problem = _check_files(directory, meta, content=True)
    if not problem and files is not None and meta.get("files") != files():
        problem = "image files changed since it was built"
    return problem


def open_or_build(
    directory: str | os.PathLike,
    parts: dict,
    ids: np.ndarray,
    views: int,
    width: int,
    dtype: str,
    fill: Callable[[FeatureWriter], None],
    timeout: float = -1,
) -> tuple[FeatureCache, str]:
    """The cache of ``parts`` in ``directory``: read when whole and current, else built by ``fill`` (which
    ``put``s every view of every id) into a temp directory that replaces ``directory`` only once finished.

    One process builds under a lock; another that asks for the same cache waits (``timeout`` seconds at most,
    -1: as long as it takes) and reads it.

    Returns:
        (the cache, why it was built: "" when an existing one was read).

    Raises:
        OutputDirError: ``directory`` exists and is not a feature cache mmfast wrote.
    """
    directory, parts = Path(directory), plain_parts(parts)
    with file_lock(dir_lock_path(directory), timeout=timeout):
        reason = stale_reason(directory, parts)
        if reason:
            log.info("feature cache %s: building (%s)", directory, reason)
            with build_into(directory, ids, views, width, dtype, parts) as writer:
                fill(writer)
        return FeatureCache(directory), reason


@contextlib.contextmanager
def build_into(
    directory: Path, ids: np.ndarray, views: int, width: int, dtype: str, parts: dict, files: str | None = None
) -> Iterator[FeatureWriter]:
    """A ``FeatureWriter`` on a temp directory that replaces ``directory`` once the block ends and the writer
    ``finish``es; an exception leaves ``directory`` as it was. The caller holds ``directory``'s lock. ``files``:
    the image files' digest the meta records (``stale_reason``)."""
    parts = plain_parts(parts)
    with atomic_dir(directory, kind=KIND) as tmp:
        writer = FeatureWriter(tmp, ids, views, width, dtype)
        try:
            yield writer
            writer.finish(feature_fingerprint(parts), parts, files)
        finally:
            writer.close()  # its memory maps are closed before the directory moves or goes


def plain_parts(parts: dict) -> dict:
    """``parts`` as JSON gives it back (tuples as lists), so a stored copy compares equal."""
    return json.loads(json.dumps(parts, sort_keys=True, default=str))


def _read_meta(directory: Path) -> tuple[dict, str]:
    path = directory / "meta.json"
    if not path.is_file():
        return {}, "no meta.json: the build did not finish"
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}, "meta.json unreadable"
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION or meta.get("dtype") not in DTYPES:
        return {}, "meta.json of another format"
    return meta, ""


def _check_files(directory: Path, meta: dict, content: bool = False) -> str:
    """What is wrong with the arrays next to ``meta`` ("" when their sizes are the meta's, and with ``content``
    their SHA-256 too: the check before a run, by one process a machine, not every process's open)."""
    itemsize = np.dtype(meta["dtype"]).itemsize
    n, width, views = int(meta["rows"]), int(meta["width"]), int(meta["views"])
    expected = {"centre.bin": max(n, 1) * width * itemsize}
    if views:
        expected["views.bin"] = views * max(n, 1) * width * itemsize
    for name, size in expected.items():
        path = directory / name
        if not path.is_file():
            return f"{name} missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, expected {size}"
    try:
        ids = np.load(directory / "ids.npy")
    except (OSError, ValueError, EOFError) as e:
        return f"ids.npy unreadable: {e}"
    if ids.shape != (n,):
        return "ids.npy does not match the meta"
    for name, want in (meta.get("sha256") or {}).items() if content else ():
        if file_sha256(directory / name) != want:
            return f"{name} changed since it was built (its SHA-256 differs)"
    return ""


def files_digest(sizes: np.ndarray) -> str:
    """The digest ``stale_reason`` compares: of the image files' sizes (N,) in bytes (-1: missing), in the split's
    order."""
    return hashlib.sha256(np.ascontiguousarray(sizes, dtype=np.int64).tobytes()).hexdigest()
