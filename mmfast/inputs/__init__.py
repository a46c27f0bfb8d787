"""Source readers: the data users already have, read into candidate rows (docs/architecture.md, "Data flow").

One reader per kind of input, each a ``Reader`` record (``mmfast.inputs.base``) registered by name in
``READERS`` with ``register_reader``: the record declares what preparation and prediction may do with the kind
(its suffixes, whether it claims a source, whether its images stay in the user's files). The built-in kinds:

    jsonl, csv      a manifest with image/text/label columns (any names: ``InputOptions`` maps them; a CSV/TSV
                    without a header line takes its column names from ``columns``)
    folder          an image folder root/<class>/<image> (captions from <image>.txt sidecars)
    imagefolder     Hugging Face "imagefolder" metadata: metadata.jsonl / metadata.csv with a ``file_name``
                    column, found in the folder (or its split sub-folders) or passed directly
    coco            COCO captions JSON: ``images`` + ``annotations`` with ``image_id`` / ``caption``
    parquet, arrow  Parquet files and Hugging Face ``save_to_disk`` folders (Arrow files), with images as
                    ``struct<bytes, path>`` (HF's ``Image`` feature) and ClassLabel names from HF's metadata
    wds             WebDataset shards (img2dataset / open_clip layout: key.jpg + key.txt + key.cls or key.json),
                    read in place: see ``mmfast.inputs.wds``

``read_source`` returns ``(candidates, rejects, kind)``: each input row is either a candidate (its image still
to be validated) or a reject with its file, row and reason. Readers of images stored as bytes write them
into ``image_dir`` (inside the prepared directory being built), so the prepared directory holds what the
loader reads.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

from mmfast.inputs import arrow, coco, imagefolder, wds
from mmfast.inputs.base import (
    LABEL_NAMES,
    READERS,
    TEXT_NAMES,
    ImagesInPlace,
    InputOptions,
    Member,
    Reader,
    ReadRows,
    check_image_root,
    pick_column,
    reader_named,
    register_reader,
    unregister_reader,
)
from mmfast.inputs.columns import detect_columns
from mmfast.inputs.manifest import Candidate, ManifestError, Reject, finish_rows, read_input

__all__ = [
    "check_image_root",
    "claimed",
    "LABEL_NAMES",
    "READERS",
    "TEXT_NAMES",
    "ImagesInPlace",
    "InputOptions",
    "Member",
    "ReadRows",
    "Reader",
    "detect_kind",
    "pick_column",
    "read_source",
    "reader_for",
    "reader_named",
    "register_reader",
    "unregister_reader",
]

COCO_LISTS = ("images", "annotations")  # a JSON object holding either list is read as COCO (``coco.read_coco``)


def read_source(
    path: str | Path,
    opts: InputOptions | None = None,
    confine: bool = False,
    image_dir: Path | None = None,
    dedupe: bool = True,
) -> tuple[list[Candidate], list[Reject], str]:
    """Read any supported input into candidate rows and rejects.

    Args:
        path: a manifest, metadata or COCO JSON, Parquet/Arrow file, or a folder (image folder, HF
            imagefolder, save_to_disk folder, folder of Parquet files), or what a registered kind claims
            (WebDataset shards: a pattern of them too).
        opts: how to read it (default: told from the path, columns named image/text/label).
        confine: reject image paths that resolve outside the input's folder.
        image_dir: where readers of images stored as bytes write them (required for those inputs).
        dedupe: reject exact duplicates of an earlier row (preparation); prediction keeps them.

    Returns:
        (candidates, rejects, kind): kind is the reader's name.

    Raises:
        ManifestError: the input cannot be read as a whole (missing, unknown format, no such column).
    """
    opts = opts or InputOptions()
    reader = reader_for(path, opts)
    if (
        reader is None or reader.claims is None
    ):  # a path, which must be there (a claimed source: its reader checks)
        if not Path(path).exists():
            raise ManifestError(f"{path}: no such manifest or image folder; pass a .jsonl/.csv file or a folder")
        reader = reader or READERS[detect_kind(Path(path))]
    check_image_root(reader, opts)
    claimed_here = reader.claims is not None and reader.claims(str(path))
    # a claimed source is handed over as given: Path() would fold a URL's '//'
    cands, rejects = reader.read(path if claimed_here else Path(path), opts, confine, image_dir)
    cands, rejects = finish_rows(cands, rejects, dedupe)
    return cands, rejects, reader.name


def claimed(source: str | os.PathLike) -> bool:
    """Whether a registered kind claims ``source`` as its own (a shard pattern or URL that names no one
    path), so that a path that does not exist is not an error."""
    return any(r.claims is not None and r.claims(str(source)) for r in READERS.values())


def reader_for(source: str | os.PathLike, opts: InputOptions) -> Reader | None:
    """The kind of ``source`` as far as it is known before reading: the one ``opts`` names, else (kind "auto")
    the first registered kind that claims the source; None: told from the path when it is read
    (``detect_kind``)."""
    if opts.kind != "auto":
        return reader_named(opts.kind)
    return next((r for r in READERS.values() if r.claims is not None and r.claims(str(source))), None)


def detect_kind(path: Path) -> str:
    """The reader for ``path``, told from its name and (for a folder) what it holds; a file by the suffixes
    the registered kinds declare."""
    if path.is_dir():
        if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
            return "arrow"
        if any(path.glob("metadata.jsonl")) or any(path.glob("metadata.csv")) or _split_metadata(path):
            return "imagefolder"
        if any(path.glob("*.parquet")) or any(path.glob("*/*.parquet")):
            return "parquet"
        if any(path.glob("*.tar")):
            return "wds"
        return "folder"
    suffix = path.suffix.lower()
    if path.name in ("metadata.jsonl", "metadata.csv"):
        return "imagefolder"
    if suffix == ".json" and _is_coco(path):
        return "coco"
    kind = next((r.name for r in READERS.values() if suffix in r.suffixes), None)
    if kind is not None:
        return kind
    raise ManifestError(
        f"{path}: unknown manifest format '{suffix}'; use .jsonl/.csv/.tsv, metadata.jsonl, COCO .json, .parquet, "
        ".arrow, .tar shards or a folder, or name the format with --input-kind (a pipe or a file without a suffix)"
    )


def _split_metadata(path: Path) -> bool:
    return any(path.glob("*/metadata.jsonl")) or any(path.glob("*/metadata.csv"))


def _is_coco(path: Path) -> bool:
    """A .json file holding one JSON object with an "images" or "annotations" list: COCO-shaped (an instances
    or images-only file too, which ``coco.read_coco`` refuses saying what is missing), not a JSONL manifest,
    whose rows are objects with image and text fields, one a line."""
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 16).lstrip()
        if not head.startswith(b"{"):
            return False
        obj = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return False
    return isinstance(obj, dict) and any(isinstance(obj.get(key), list) for key in COCO_LISTS)


def _manifest_reader(fmt: str) -> ReadRows:
    """A reader of mmfast's own inputs (``manifest.read_input``) in format ``fmt``, whatever the file's suffix.
    Duplicates are left to ``read_source``, which drops them or not."""

    def read(path: Path, opts: InputOptions, confine: bool, image_dir: Path | None = None):
        folder = opts.image_folder(path.parent)
        unnamed = frozenset(role for role in ("image", "text", "label") if getattr(opts, f"{role}_column") is None)
        detect = functools.partial(detect_columns, unnamed=unnamed, path=path)
        columns = opts.table_columns()
        cands, rejects, _ = read_input(
            path, confine, columns, fmt, dedupe=False, image_folder=folder, detect=detect
        )
        return cands, rejects

    return read


# The registry: one line a kind, in the order ``--input-kind`` lists them and file suffixes are looked up.
register_reader(
    Reader("jsonl", _manifest_reader("jsonl"), suffixes=(".jsonl", ".json", ".ndjson"), image_root=True)
)
register_reader(Reader("csv", _manifest_reader("csv"), suffixes=(".csv", ".tsv"), image_root=True))
register_reader(Reader("folder", _manifest_reader("folder"), rows_are_files=True))
register_reader(imagefolder.READER)
register_reader(coco.READER)
register_reader(arrow.PARQUET)
register_reader(arrow.ARROW)
register_reader(wds.READER)
