"""Captioned pictures as a trainer names them: the image paths and captions of a CSV / TSV / JSONL table (the
columns open_clip's trainer reads, or mmfast's manifest's), or of two lists; each row's id is its index.

Paths are taken as the table writes them, relative to the current directory as open_clip's ``CsvDataset``
opens them, unless a ``root`` is given.
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

# The columns looked for when none is named: open_clip_train's defaults first, then mmfast's manifest's.
IMAGE_KEYS = ("filepath", "image")
CAPTION_KEYS = ("title", "text", "caption")
TABLE_SUFFIXES = {".csv": ",", ".tsv": "\t", ".jsonl": None}


@dataclass(frozen=True)
class Captioned:
    """The pictures and their captions, row by row (a row's id is its index)."""

    files: list[str]
    captions: list[str]
    source: str  # the table's path, or "the lists", for messages

    def __len__(self) -> int:
        return len(self.files)


def read_captioned(
    images: str | os.PathLike | Sequence[str],
    captions: Sequence[str] | None = None,
    *,
    image_key: str | None = None,
    caption_key: str | None = None,
    sep: str | None = None,
    root: str | os.PathLike | None = None,
) -> Captioned:
    """The rows of a table of captioned pictures, or of two lists.

    Args:
        images: a ``.csv`` / ``.tsv`` / ``.jsonl`` table, or a list of image paths.
        captions: with a list of paths, one caption per path; with a table, None.
        image_key, caption_key: the table's columns (default: the first of ``IMAGE_KEYS`` /
            ``CAPTION_KEYS`` that it has).
        sep: a CSV's separator (default: by the suffix, "," for .csv and a tab for .tsv; open_clip_train's
            ``--csv-separator`` is a tab for both).
        root: the folder relative paths start from (default: the current directory).

    Raises:
        ValueError naming the table and what is wrong (a missing column, an empty table, a row without a path).
    """
    if isinstance(images, str | os.PathLike):
        if captions is not None:
            raise TypeError(
                "captions come from the table's caption column; pass captions= only with a list of paths"
            )
        rows = _read_table(Path(images), image_key, caption_key, sep)
        source = str(images)
    else:
        if captions is None:
            raise TypeError("a list of image paths needs captions=, one caption per path")
        files, texts = [os.fspath(f) for f in images], list(captions)
        if len(files) != len(texts):
            raise ValueError(f"{len(files)} image paths but {len(texts)} captions")
        rows, source = list(zip(files, texts, strict=True)), "the lists"
    if not rows:
        raise ValueError(f"{source}: no rows")
    files, texts = [], []
    for k, (path, text) in enumerate(rows):
        if not path:
            raise ValueError(f"{source}: row {k + 1} has no image path")
        files.append(str(Path(root) / path) if root is not None else path)
        texts.append("" if text is None else str(text))
    if root is None and isinstance(images, str | os.PathLike):
        _check_relative_to_here(Path(images), files)
    return Captioned(files, texts, source)


class PathsFromElsewhere(ValueError):
    """A table whose relative image paths start from its own folder, not from the current directory."""


def _check_relative_to_here(table: Path, files: list[str], probe: int = 8) -> None:
    """Refuse a table whose relative paths name files beside the table but not from the current directory:
    every picture would be missing, found only once the first batches are read."""
    relative = [f for f in files[:probe] if not os.path.isabs(f)]
    if not relative or any(os.path.exists(f) for f in relative):
        return
    folder = table.resolve().parent
    if all((folder / f).exists() for f in relative):
        raise PathsFromElsewhere(
            f"{table}: its image paths are relative to the table's folder, and they start from the current "
            f"directory ({Path.cwd()}), as open_clip reads them: run from {folder} (cd there first; the "
            f"trainer's other paths then start there too), or, building the loader yourself, pass root='{folder}'"
        )


def _read_table(path: Path, image_key: str | None, caption_key: str | None, sep: str | None) -> list[tuple]:
    """(path, caption) of each row of a CSV / TSV / JSONL table (any other name is a CSV when ``sep`` is
    given, as open_clip_train's ``--dataset-type csv`` reads it)."""
    suffix = path.suffix.lower()
    if suffix not in TABLE_SUFFIXES and sep is None:
        raise ValueError(
            f"{path}: a table of captioned pictures is a {', '.join(TABLE_SUFFIXES)} file (or give sep= for a "
            "CSV of another name)"
        )
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    if suffix == ".jsonl":
        records = []
        with open(path, encoding="utf-8-sig") as f:
            for k, line in enumerate(f, 1):
                if line.strip():
                    try:
                        records.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{path}: line {k} is not JSON ({e.msg})") from None
        columns = list(records[0]) if records else []
    else:
        with open(path, encoding="utf-8-sig", newline="") as f:  # -sig: a byte-order mark is not a column's name
            reader = csv.DictReader(f, delimiter=sep or TABLE_SUFFIXES[suffix])
            records, columns = list(reader), list(reader.fieldnames or [])
    image_key = _column(path, columns, image_key, IMAGE_KEYS, "image")
    caption_key = _column(path, columns, caption_key, CAPTION_KEYS, "caption")
    rows = []
    for k, r in enumerate(records, 1):
        if not isinstance(r, dict) or image_key not in r:
            raise ValueError(f"{path}: row {k} has no '{image_key}'")
        rows.append((r[image_key], r.get(caption_key)))
    return rows


def _column(path: Path, columns: list[str], given: str | None, usual: tuple[str, ...], what: str) -> str:
    if given is not None:
        if columns and given not in columns:
            raise ValueError(f"{path}: no {what} column '{given}'; its columns are {', '.join(columns)}")
        return given
    found = next((c for c in usual if c in columns), None)
    if found is None:
        raise ValueError(
            f"{path}: no {what} column ({' or '.join(usual)}); its columns are {', '.join(columns) or 'none'}: "
            f"name yours with {what}_key="
        )
    return found
