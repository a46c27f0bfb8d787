"""``PreparedDataset``: the one reader of a prepared dataset directory (written by tools/prepare_data.py).

Directory contract (see DESIGN.md):
    prepare.json          what was done, and a ``files`` map {relative path: {"size", "sha256"}} of every
                          file below (written last, so its presence means the directory is complete)
    .mmfast-prepared      marker: mmfast wrote this directory (and may replace it)
    train.jsonl, val.jsonl  rows {"id", "image", "text", "label", "line", "size", "mtime_ns"}; labels are
                          contiguous class ids 0..C-1
    labels.json           original label -> class id
    rejected.jsonl        dropped input rows with their reasons
    tokenizer/, tokens/   the tokenizer and the token cache (``mmfast.token_cache``)

The directory is verified, not trusted: every recorded file is checked against its size and SHA-256
when a dataset is opened, so an edited, truncated or swapped file stops a run at start-up with the file's
name, instead of training silently on something else.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from mmfast.fsutil import MARKER as PREPARED_MARKER
from mmfast.fsutil import file_sha256
from mmfast.validate import DEFAULT_MAX_PIXELS

__all__ = ["DatasetError", "PREPARED_MARKER", "PreparedDataset", "file_sha256", "read_json_file"]
MIN_VERSION = 2  # the first prepare.json format that records file fingerprints


class DatasetError(ValueError):
    """A prepared dataset directory is missing, incomplete, changed since preparation or unreadable."""


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


class PreparedDataset:
    """A prepared dataset directory, opened and verified.

    Args:
        root: the directory written by tools/prepare_data.py.
        verify: check every recorded file's size and SHA-256 (default). Only skip it when the caller
            verified the same directory already in this process.

    Raises:
        DatasetError: not a prepared directory, prepared by an older mmfast, or changed since preparation.
    """

    def __init__(self, root: str | os.PathLike, verify: bool = True):
        self.root = Path(root)
        summary_path = self.root / "prepare.json"
        if not summary_path.is_file():
            if (self.root / "train.jsonl").exists() or (self.root / "tokens").is_dir():
                raise DatasetError(
                    f"{self.root} looks like an incomplete prepared dataset (no prepare.json); re-run "
                    "tools/prepare_data.py on the original manifest"
                )
            raise DatasetError(f"{self.root}: not a prepared dataset (no prepare.json); run tools/prepare_data.py")
        summary = read_json_file(summary_path, "the preparation summary")
        if not isinstance(summary, dict):
            raise DatasetError(f"{summary_path}: expected a JSON object")
        self.summary = summary
        if int(summary.get("version", 1)) < MIN_VERSION or not isinstance(summary.get("files"), dict):
            raise DatasetError(
                f"{self.root} was prepared by an older mmfast that recorded no file fingerprints; re-run "
                f"tools/prepare_data.py {summary.get('source', 'YOUR_MANIFEST')} --out {self.root}"
            )
        self.files: dict[str, dict] = summary["files"]
        if verify:
            self.verify()
        labels = read_json_file(self.root / "labels.json", "label name -> class id")
        if not isinstance(labels, dict) or sorted(labels.values()) != list(range(len(labels))):
            raise DatasetError(
                f"{self.root / 'labels.json'}: expected a mapping of label names to class ids 0..C-1; "
                "re-run tools/prepare_data.py"
            )
        self.labels: dict[str, int] = labels

    def verify(self) -> None:
        """Compare every file recorded in prepare.json with its size and SHA-256.

        Raises:
            DatasetError: naming the first file that is missing or differs.
        """
        for rel, want in sorted(self.files.items()):
            path = self.root / rel
            redo = f"re-run tools/prepare_data.py to prepare {self.root} again"
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
    def tokenizer_dir(self) -> Path:
        return self.root / "tokenizer"

    @property
    def tokens_dir(self) -> Path:
        return self.root / "tokens"

    @property
    def max_pixels(self) -> int:
        """The decoded-pixel budget the images were validated against."""
        return int(self.summary.get("config", {}).get("max_pixels") or DEFAULT_MAX_PIXELS)

    def split_size(self, split: str) -> int:
        """Rows in a split, from prepare.json's counts (0 for an empty or absent split)."""
        return int(self.summary.get("counts", {}).get(split, 0))

    def rows(self, split: str) -> list[dict]:
        """The rows of ``split`` ("train" or "val"), checked field by field.

        Raises:
            DatasetError: naming the file and line of a row that cannot be parsed or is out of range.
        """
        path = self.root / f"{split}.jsonl"
        if split not in ("train", "val"):
            raise DatasetError(f"unknown split '{split}'; choose from 'train', 'val'")
        rows = []
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
                    raise DatasetError(f"{path}, line {line_no}: {problem}; re-run tools/prepare_data.py")
                rows.append(row)
        return rows

    def _row_problem(self, row: object) -> str:
        if not isinstance(row, dict):
            return "expected a JSON object"
        for key, kind in (("id", int), ("label", int), ("image", str), ("text", str)):
            if not isinstance(row.get(key), kind) or isinstance(row.get(key), bool):
                return f"field '{key}' missing or not {kind.__name__}"
        if not 0 <= row["label"] < self.num_classes:
            return f"label {row['label']} is not a class id 0..{self.num_classes - 1} of labels.json"
        return ""
