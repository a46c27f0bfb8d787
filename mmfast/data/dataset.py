"""``PreparedDataset``: the one reader of a prepared dataset directory (written by mmfast-prepare).

Directory contract (docs/architecture.md, "Contracts"):
    prepare.json          what was done, and a ``files`` map {relative path: {"size", "sha256"}} of every
                          file below (written last, so its presence means the directory is complete)
    .mmfast-prepared      marker: mmfast wrote this directory (and may replace it)
    train.jsonl, val.jsonl  rows {"id", "image", "text", "label", "line", "size", "mtime_ns"}; labels are
                          contiguous class ids 0..C-1; an image the directory holds (images/: Parquet
                          bytes, downscaled/: --max-side copies) is named relative to it, so the
                          directory can be moved; ``iter_rows`` gives every path absolute; the split
                          is by a hash of each row's image (``mmfast.prepare.split``)
    labels.json           original label -> class id
    rejected.jsonl        dropped input rows with their reasons
    tokenizer/, tokens/   the tokenizer and the token cache (``mmfast.data.token_cache``)
    wds/                  optional WebDataset source of each split (``prepare.wds_export``, or the index of
                          the user's shards it was prepared from, ``mmfast.inputs.wds``):
                          <split>.json {"tars", "index", "stats": [[size, mtime_ns]] of each tar, ...} and
                          <split>.rows.npy (N, 2) int64 [sample id, class id]

A split's rows are read as arrays (``table``: ids, labels and, for the files source, image paths), never
as a list of Python dicts kept by a loader (``loading.sources.prepared_source`` picks the image source a
loader of it reads).

The directory is verified, not trusted: every recorded file is checked against its size and SHA-256
when a dataset is opened, so an edited, truncated or swapped file stops a run at start-up with the file's
name, instead of training silently on something else.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mmfast.data.tokenizer import load_tokenizer
from mmfast.data.validate import DEFAULT_MAX_PIXELS
from mmfast.remote.objects import is_remote
from mmfast.util.commands import PREPARE
from mmfast.util.fsutil import MARKER as PREPARED_MARKER
from mmfast.util.fsutil import file_sha256, restore_interrupted_swap

# The prepared directory's file names (the contract above): every stage that writes or reads one names them here.
SUMMARY_FILE = "prepare.json"  # written last: its presence means the directory is complete
LABELS_FILE = "labels.json"
REJECTED_FILE = "rejected.jsonl"
FILE_READS = "file_reads"  # what reading each shard gave, a file each: the next preparation reuses it
TOKENIZER_DIR = "tokenizer"
TOKENS_DIR = "tokens"
WDS_DIR = "wds"
SPLITS = ("train", "val")
COMPLETE, INCOMPLETE = "complete", "incomplete"  # what ``prepared_state`` tells

# mmfast's WebDataset index files (wds/: inputs.wds writes them, loading.sources reads through them): the
# image component's name, and the digits of the sample id that close each indexed image's name
WDS_IMAGE_EXT = "img"
WDS_ID_DIGITS = 10

__all__ = [
    "COMPLETE",
    "INCOMPLETE",
    "DatasetError",
    "PREPARED_MARKER",
    "PreparedDataset",
    "SplitTable",
    "file_sha256",
    "prepared_state",
    "read_json_file",
    "split_file",
    "wds_split",
]
MIN_VERSION = 2  # the first prepare.json format that records file fingerprints


class DatasetError(ValueError):
    """A prepared dataset directory is missing, incomplete, changed since preparation or unreadable."""


def split_file(split: str) -> str:
    """The rows file of ``split`` ("train" or "val") in a prepared directory."""
    return f"{split}.jsonl"


def prepared_state(path: str | os.PathLike) -> str | None:
    """What ``path`` is as a prepared directory: the one test every stage applies to a path it is given.

    Returns:
        ``COMPLETE`` when its prepare.json is there (written last), ``INCOMPLETE`` when only its rows or token
        cache are (a preparation that stopped before the end), None for anything else (a manifest, an image
        folder, a missing path).
    """
    root = Path(path)
    if (root / SUMMARY_FILE).is_file():
        return COMPLETE
    if (root / split_file("train")).exists() or (root / TOKENS_DIR).is_dir():
        return INCOMPLETE
    return None


def incomplete_message(path: str | os.PathLike) -> str:
    """What to tell the user of a path whose ``prepared_state`` is ``INCOMPLETE``."""
    return (
        f"{path} looks like an incomplete prepared dataset (no {SUMMARY_FILE}); re-run {PREPARE} on the "
        "original manifest"
    )


def read_json_file(path: Path, what: str) -> object:
    """Parse a JSON file; an unreadable or malformed one is a DatasetError naming the file and position."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DatasetError(f"{path}: missing ({what})") from None
    except UnicodeDecodeError as e:
        raise DatasetError(f"{path}: not UTF-8 at byte {e.start} ({what})") from None
    except json.JSONDecodeError as e:
        raise DatasetError(
            f"{path}: not valid JSON at line {e.lineno} column {e.colno}: {e.msg} ({what})"
        ) from None


@dataclass(frozen=True)
class SplitTable:
    """What a loader reads of a split: one entry per row, in the split's order."""

    ids: np.ndarray  # (N,) int64 sample ids
    labels: np.ndarray  # (N,) int64 class ids
    images: list[str] | None  # each row's image file; None when read from wds/<split>.rows.npy
    file_stats: list[tuple[int, int]] | None  # (size, mtime_ns) at preparation, when every row has them
    sources: np.ndarray | None = None  # (N,) int64: the source of each row in a mix (``mix_sources``)
    decoded_shapes: np.ndarray | None = None  # (N, 2) (height, width) as DALI decodes them, when every row has it


def wds_split(root: Path, split: str) -> tuple[list[str], list[str]]:
    """(tars, index files) of a split's WebDataset source in a prepared directory: mmfast's export
    (``mmfast.prepare.wds_export``) or the user's shards it was prepared from (``mmfast.inputs.wds``).

    Raises:
        FileNotFoundError: no WebDataset source for the split.
        ValueError: a user's shard changed (size or mtime) since preparation.
    """
    wds = Path(root) / WDS_DIR
    listing = wds / f"{split}.json"
    if not listing.is_file():
        raise FileNotFoundError(f"{listing}: no WebDataset shards; run {PREPARE} --format wds")
    info = json.loads(listing.read_text())
    if "tars" not in info:  # an export by an older mmfast
        info["tars"], info["index"] = [f"{s}.tar" for s in info["shards"]], [f"{s}.idx" for s in info["shards"]]
    tars = [t if is_remote(t) else str(wds / t) for t in info["tars"]]  # users' shards: absolute paths or URLs
    index = [str(wds / i) for i in info["index"]]
    for tar, want in zip(tars, info.get("stats", []), strict=False):
        if is_remote(tar):  # checked by size and SHA-256 when it is fetched (wds_checks)
            continue
        try:
            st = os.stat(tar)
        except OSError as e:
            raise FileNotFoundError(f"{tar}: WebDataset shard missing ({e.strerror}); restore it") from None
        if [st.st_size, st.st_mtime_ns] != list(want):
            raise ValueError(
                f"{tar}: changed since preparation (size or mtime); re-run {PREPARE} to index it again"
            )
    return tars, index


def wds_checks(root: Path, split: str) -> list[tuple[int | None, str | None]]:
    """(size, SHA-256) of each WebDataset shard of ``split`` as preparation recorded them ((None, None) where
    it did not: a local shard is checked by size and mtime instead)."""
    info = json.loads((Path(root) / WDS_DIR / f"{split}.json").read_text())
    checks = info.get("checks") or [[None, None]] * len(info.get("tars", info.get("shards", [])))
    return [(c[0], c[1]) for c in checks]


class PreparedDataset:
    """A prepared dataset directory, opened and verified.

    Args:
        root: the directory written by mmfast-prepare.
        verify: check every recorded file's size and SHA-256 (default). Only skip it when the caller
            verified the same directory already in this process.

    A directory a killed preparation left aside while replacing it (``fsutil.restore_interrupted_swap``) is
    put back first.

    Raises:
        DatasetError: not a prepared directory, prepared by an older mmfast, or changed since preparation.
    """

    def __init__(self, root: str | os.PathLike, verify: bool = True):
        self.root = Path(root)
        restore_interrupted_swap(self.root)
        state = prepared_state(self.root)
        if state == INCOMPLETE:
            raise DatasetError(incomplete_message(self.root))
        if state != COMPLETE:
            raise DatasetError(f"{self.root}: not a prepared dataset (no {SUMMARY_FILE}); run {PREPARE}")
        summary_path = self.root / SUMMARY_FILE
        summary = read_json_file(summary_path, "the preparation summary")
        if not isinstance(summary, dict):
            raise DatasetError(f"{summary_path}: expected a JSON object")
        self.summary = summary
        if int(summary.get("version", 1)) < MIN_VERSION or not isinstance(summary.get("files"), dict):
            raise DatasetError(
                f"{self.root} was prepared by an older mmfast that recorded no file fingerprints; re-run "
                f"{PREPARE} {summary.get('source', 'YOUR_MANIFEST')} --out {self.root}"
            )
        self.files: dict[str, dict] = summary["files"]
        if verify:
            self.verify()
        labels = read_json_file(self.root / LABELS_FILE, "label name -> class id")
        if not isinstance(labels, dict) or sorted(labels.values()) != list(range(len(labels))):
            raise DatasetError(
                f"{self.root / LABELS_FILE}: expected a mapping of label names to class ids 0..C-1; "
                f"re-run {PREPARE}"
            )
        self.labels: dict[str, int] = labels

    def verify(self) -> None:
        """Compare every file recorded in prepare.json with its size and SHA-256.

        Raises:
            DatasetError: naming the first file that is missing or differs.
        """
        for rel, want in sorted(self.files.items()):
            path = self.root / rel
            redo = f"re-run {PREPARE} to prepare {self.root} again"
            try:
                size = path.stat().st_size
            except OSError:
                raise DatasetError(f"{path}: missing since preparation; {redo}") from None
            if size != want["size"]:
                raise DatasetError(
                    f"{path}: changed since preparation ({size} bytes, prepared with {want['size']}); {redo}"
                )
            if file_sha256(path) != want["sha256"]:
                raise DatasetError(f"{path}: content changed since preparation (SHA-256 differs); {redo}")

    @property
    def fingerprint(self) -> str:
        """One hash of every recorded file's content: equal fingerprints mean the same prepared data."""
        h = hashlib.sha256()
        for rel, want in sorted(self.files.items()):
            h.update(f"{rel}|{want['sha256']}\n".encode())
        return h.hexdigest()

    @property
    def num_classes(self) -> int:
        return len(self.labels)

    @property
    def version(self) -> int:
        """The format version of prepare.json (``MIN_VERSION`` or later: older ones are refused on opening)."""
        return int(self.summary.get("version", 1))

    @property
    def vocab_size(self) -> int:
        """Token ids the tokenizer in tokenizer/ produces: the size of a text model's embedding table. Read
        from the tokenizer itself (what the token cache was built with), not from prepare.json's figure."""
        return len(load_tokenizer(self.tokenizer_dir))

    @property
    def tokenizer_dir(self) -> Path:
        return self.root / TOKENIZER_DIR

    @property
    def tokens_dir(self) -> Path:
        return self.root / TOKENS_DIR

    @property
    def max_pixels(self) -> int:
        """The decoded-pixel budget the images were validated against."""
        return int(self.summary.get("config", {}).get("max_pixels") or DEFAULT_MAX_PIXELS)

    @property
    def mix_sources(self) -> list[dict]:
        """A mix's datasets (``mmfast.prepare.mix``), in the order rows' ``source`` counts them: {"root",
        "name", "fingerprint", "train", "val"} each; [] for a dataset prepared from one input."""
        return list((self.summary.get("mix") or {}).get("sources") or [])

    def remote_shards(self) -> bool:
        """Whether some WebDataset shard of either split lies in a store (is streamed through a cache)."""
        for split in SPLITS:
            listing = self.root / WDS_DIR / f"{split}.json"
            if listing.is_file() and any(is_remote(t) for t in json.loads(listing.read_text()).get("tars", [])):
                return True
        return False

    def split_size(self, split: str) -> int:
        """Rows in a split, from prepare.json's counts (0 for an empty or absent split)."""
        return int(self.summary.get("counts", {}).get(split, 0))

    def rows(self, split: str) -> list[dict]:
        """The rows of ``split`` ("train" or "val"), checked field by field.

        Raises:
            DatasetError: naming the file and line of a row that cannot be parsed or is out of range.
        """
        return list(self.iter_rows(split))

    def iter_rows(self, split: str) -> Iterator[dict]:
        """``rows(split)`` one at a time, without holding them all."""
        path = self.root / split_file(split)
        if split not in SPLITS:
            raise DatasetError(f"unknown split '{split}'; choose from 'train', 'val'")
        with open(path, "rb") as f:
            for line_no, raw in enumerate(f, start=1):
                if not raw.strip():
                    continue
                try:
                    row = json.loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    raise DatasetError(
                        f"{path}, line {line_no}: not a JSON row ({e}); re-run preparation"
                    ) from None
                problem = self._row_problem(row)
                if problem:
                    raise DatasetError(f"{path}, line {line_no}: {problem}; re-run {PREPARE}")
                if not os.path.isabs(row["image"]) and "tar" not in row:  # an image the directory holds
                    row["image"] = os.path.join(self.root, row["image"])
                yield row

    def table(self, split: str, images: bool = True) -> SplitTable:
        """The ids and labels of ``split`` as arrays, and (``images``) each row's image file and the
        (size, mtime_ns) it had when validated. Without ``images`` a WebDataset split is read from
        wds/<split>.rows.npy (bytes a row, not a dict of Python objects: what keeps a 10M-row split's loader
        small)."""
        npy = self.root / WDS_DIR / f"{split}.rows.npy"
        if not images and npy.is_file():
            ids_labels = np.load(npy).reshape(-1, 2)  # (N, 2) int64: id, class id
            return SplitTable(ids_labels[:, 0], ids_labels[:, 1], None, None)
        ids, labels, paths, stats, sources, shapes = [], [], [], [], [], []
        for r in self.iter_rows(split):
            shapes.append(r.get("decoded_shape"))
            ids.append(r["id"])
            labels.append(r["label"])
            paths.append(r["image"])
            stats.append((r["size"], r["mtime_ns"]) if "size" in r and "mtime_ns" in r else None)
            sources.append(r.get("source", 0))
        return SplitTable(
            np.array(ids, dtype=np.int64),
            np.array(labels, dtype=np.int64),
            paths,
            None if None in stats else stats,
            np.array(sources, dtype=np.int64) if self.mix_sources else None,
            None if None in shapes else np.array(shapes, dtype=np.int64).reshape(-1, 2),
        )

    def decoded_bytes(self, split: str, limit: int) -> int | None:
        """Bytes ``split``'s images take decoded (uint8 RGB), from the sizes preparation recorded; None when a
        row lacks them or the total passes ``limit`` (the rows after are not read)."""
        max_side = (self.summary.get("config") or {}).get("max_side") or 0
        total = 0
        for r in self.iter_rows(split):
            if "width" not in r or "height" not in r:
                return None
            w, h = r["width"], r["height"]  # of the original, for a --max-side copy: the copy is scaled down
            scale = min(1.0, max_side / max(w, h)) if r.get("original") and max_side else 1.0
            total += 3 * math.ceil(w * scale) * math.ceil(h * scale)
            if total > limit:
                return None
        return total

    def _row_problem(self, row: object) -> str:
        if not isinstance(row, dict):
            return "expected a JSON object"
        for key, kind in (("id", int), ("label", int), ("image", str), ("text", str)):
            if not isinstance(row.get(key), kind) or isinstance(row.get(key), bool):
                return f"field '{key}' missing or not {kind.__name__}"
        if not 0 <= row["label"] < self.num_classes:
            return f"label {row['label']} is not a class id 0..{self.num_classes - 1} of labels.json"
        return ""
