"""Hugging Face "imagefolder" metadata: metadata.jsonl or metadata.csv beside the images.

Each metadata file names its images in a ``file_name`` column, relative to the metadata file's folder (or
to --image-root);
the other columns are features (the caption, the label). Without a label column, as in HF's imagefolder,
the label is the folder each image is in (``file_name`` = "<class>/<image>"). A dataset may keep one
metadata file per split folder (train/metadata.jsonl, test/metadata.jsonl): the train split's is read, and the
others are named and left out (mmfast splits its val off what it reads; ``train_split``).
"""

from __future__ import annotations

import csv
import io
from dataclasses import replace
from pathlib import Path

from mmfast.inputs.base import (
    LABEL_NAMES,
    SPLIT_NAME,
    InputOptions,
    Reader,
    pick_column,
    pick_text_column,
    train_split,
)
from mmfast.inputs.csv_rows import _csv_rows
from mmfast.inputs.manifest import Candidate, Columns, ManifestError, Reject, _jsonl_rows, check_rows

_FOLDER = "label (the image's folder)"  # the label column of metadata that has none: the class folders


def read_imagefolder(
    path: Path, opts: InputOptions, confine: bool, image_dir: Path | None = None
) -> tuple[list[Candidate], list[Reject]]:
    """Read every metadata.jsonl / metadata.csv of an imagefolder (or the one metadata file given).

    Rows are numbered by their line in their own metadata file; each row and reject records that file
    (relative to the folder).
    """
    root = path if path.is_dir() else path.parent
    files = _metadata_files(path)
    if path.is_dir():
        files = train_split(path, files, lambda f: f.parent != path and SPLIT_NAME.match(f.parent.name + "-"))
    if not files:
        raise ManifestError(
            f"{path}: no metadata.jsonl or metadata.csv (with a file_name column) in the folder or its split "
            "sub-folders"
        )
    cands, rejects = [], []
    for meta in files:
        rel = meta.relative_to(root).as_posix()
        if meta.suffix == ".csv":
            present = _csv_header(meta)
            rows, bad, _ = _csv_rows(meta, ",", _columns(meta, present, opts, label=None))
        else:
            rows, bad = _jsonl_rows(meta)
            present = list(dict.fromkeys(k for _, r in rows[:1000] for k in r))
        columns = _columns(meta, present, opts, label=None)  # image and text first: their errors first
        columns = replace(columns, label=_label_column(meta, present, rows, opts))
        if columns.label == _FOLDER:
            rows = [(line, {**row, _FOLDER: _folder(row.get(columns.image))}) for line, row in rows]
        for r in bad:
            r.file = rel
        more_cands, more_rejects = check_rows(
            rows,
            opts.image_folder(meta.parent),
            confine,
            from_csv=meta.suffix == ".csv",
            columns=columns,
            file=rel,
        )
        cands += more_cands
        rejects += bad + more_rejects
    return cands, rejects


def _metadata_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    found = []
    for pattern in ("metadata.jsonl", "metadata.csv", "*/metadata.jsonl", "*/metadata.csv"):
        found += sorted(path.glob(pattern))
    return found


def _csv_header(meta: Path) -> list[str]:
    try:
        first = meta.read_bytes().split(b"\n", 1)[0].decode("utf-8-sig").rstrip("\r")
    except (OSError, UnicodeDecodeError) as e:
        raise ManifestError(f"{meta}:1: cannot read the header: {e}") from e
    return next(csv.reader(io.StringIO(first)), [])


def _columns(meta: Path, present: list[str], opts: InputOptions, label: str | None) -> Columns:
    """file_name (or --image-column) and the caption column of one metadata file, and ``label``."""
    if not present:
        return opts.table_columns(image="file_name")  # an empty file: no rows to check
    image = pick_column(present, opts.image_column, ("file_name",), "image", str(meta))
    text = pick_text_column(present, opts, str(meta))
    return Columns(image=image, text=text, label=label, text_optional=not opts.captions_needed)


def _label_column(meta: Path, present: list[str], rows: list[tuple[int, dict]], opts: InputOptions) -> str | None:
    """The label column; ``_FOLDER`` when there is none and every image is in a class folder."""
    if opts.no_labels or not present:
        return None
    if opts.label_column is None and not any(n in present for n in LABEL_NAMES):
        image = opts.image_column or "file_name"
        if rows and all(_folder(row.get(image)) for _, row in rows):
            return _FOLDER
    return pick_column(present, opts.label_column, LABEL_NAMES, "label", str(meta))


def _folder(file_name: object) -> str | None:
    """The folder an image is in ("cat" of "cat/1.jpg"), None for an image beside its metadata file."""
    if not isinstance(file_name, str):
        return None
    parent = Path(file_name).parent.name
    return parent or None


READER = Reader("imagefolder", read_imagefolder, image_root=True)
