"""Source readers: the data users already have, read into candidate rows (docs/architecture.md, "Data flow").

One reader per kind of input, registered by name in ``READERS``:

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

Every reader returns ``(candidates, rejects, kind)``: each input row is either a candidate (its image still
to be validated) or a reject with its file, row and reason. Readers of images stored as bytes write them
into ``image_dir`` (inside the prepared directory being built), so the prepared directory holds what the
loader reads.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mmfast.inputs.manifest import Candidate, Columns, ManifestError, Reject, finish_rows, read_input
from mmfast.inputs.wds import is_wds_source

# Column names tried, in order, when a reader that knows its columns is not told which holds what.
TEXT_NAMES = ("text", "caption", "captions", "sentence", "description", "prompt", "title")
LABEL_NAMES = ("label", "labels", "class", "category", "class_name")
COCO_LISTS = ("images", "annotations")  # a JSON object holding either list is read as COCO (``coco.read_coco``)


@dataclass(frozen=True)
class InputOptions:
    """How to read the input (tools/prepare_data.py's input flags).

    Args:
        kind: a reader name from ``READERS``, or "auto" to tell it from the path.
        image_column, text_column, label_column: the columns holding each (None: the reader's default,
            image/text/label for a manifest, detected for the others).
        no_labels: the input has no labels; every row gets the one label ``manifest.NO_LABEL``.
        columns: the column names of a CSV/TSV without a header line (e.g. ("text", "image") for CC3M).
        coco_captions: "all" (a row per caption) or "first" (a row per image, its first caption).
        image_root: the folder image paths are relative to (COCO's ``file_name``; default: the JSON's folder).
        wds_image_key: WebDataset: the image member's extensions, in order of preference ("jpg;png").
        wds_text_key: WebDataset: the caption member's extension.
        wds_label_key: WebDataset: the label member's extension (an integer or a name as text).
        wds_label_field: WebDataset: take the label from this field of the ``json`` member instead.
    """

    kind: str = "auto"
    image_column: str | None = None
    text_column: str | None = None
    label_column: str | None = None
    no_labels: bool = False
    columns: tuple[str, ...] | None = None
    coco_captions: str = "all"
    image_root: str | None = None
    wds_image_key: str = "jpg;jpeg;png;webp"
    wds_text_key: str = "txt"
    wds_label_key: str = "cls"
    wds_label_field: str | None = None

    def __post_init__(self):
        if self.kind != "auto" and self.kind not in READERS:
            raise ValueError(f"unknown input kind '{self.kind}'; choose from auto, {', '.join(READERS)}")
        if self.coco_captions not in ("all", "first"):
            raise ValueError(f"--coco-captions must be 'all' or 'first', got '{self.coco_captions}'")
        if self.no_labels and self.label_column:
            raise ValueError("--no-labels and --label-column exclude each other")

    def table_columns(self, image: str = "image", text: str = "text", label: str = "label") -> Columns:
        """The Columns of a table, the given names over the reader's defaults."""
        return Columns(
            image=self.image_column or image,
            text=self.text_column or text,
            label=None if self.no_labels else (self.label_column or label),
            names=self.columns,
        )


Reader = Callable[[Path, InputOptions, bool, "Path | None"], tuple[list[Candidate], list[Reject]]]


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
            imagefolder, save_to_disk folder, folder of Parquet files).
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
    if opts.kind == "wds" or (opts.kind == "auto" and is_wds_source(path)):
        from mmfast.inputs.wds import read_wds

        cands, rejects = read_wds(path, opts)
        cands, rejects = finish_rows(cands, rejects, dedupe)
        return cands, rejects, "wds"
    path = Path(path)
    if not path.exists():
        raise ManifestError(f"{path}: no such manifest or image folder; pass a .jsonl/.csv file or a folder")
    kind = opts.kind if opts.kind != "auto" else detect_kind(path)
    cands, rejects = READERS[kind](path, opts, confine, image_dir)
    cands, rejects = finish_rows(cands, rejects, dedupe)
    return cands, rejects, kind


def detect_kind(path: Path) -> str:
    """The reader for ``path``, told from its name and (for a folder) what it holds."""
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
    if suffix == ".tar":
        return "wds"
    if suffix == ".parquet":
        return "parquet"
    if suffix == ".arrow":
        return "arrow"
    if suffix == ".json" and _is_coco(path):
        return "coco"
    if suffix in (".jsonl", ".json", ".ndjson"):
        return "jsonl"
    if suffix in (".csv", ".tsv"):
        return "csv"
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


def pick_column(present: list[str], given: str | None, names: tuple[str, ...], what: str, where: str) -> str:
    """The column holding ``what``: the given one (which must exist), else the first of ``names`` present.

    Raises:
        ManifestError: naming the columns there are and the flag to pass.
    """
    flag = f"--{what}-column"
    if given is not None:
        if given not in present:
            raise ManifestError(f"{where}: no column '{given}' ({flag}); the columns are {present}")
        return given
    for name in names:
        if name in present:
            return name
    hint = f"pass {flag} NAME" + (" or --no-labels" if what == "label" else "")
    raise ManifestError(f"{where}: no {what} column among {present}; {hint}")


def _manifest_reader(fmt: str) -> Reader:
    """A reader of mmfast's own inputs (``manifest.read_input``) in format ``fmt``, whatever the file's suffix.
    Duplicates are left to ``read_source``, which drops them or not."""

    def read(path: Path, opts: InputOptions, confine: bool, image_dir: Path | None = None):
        cands, rejects, _ = read_input(path, confine=confine, columns=opts.table_columns(), fmt=fmt, dedupe=False)
        return cands, rejects

    return read


def _readers() -> dict[str, Reader]:
    from mmfast.inputs.arrow import read_arrow, read_parquet
    from mmfast.inputs.coco import read_coco
    from mmfast.inputs.imagefolder import read_imagefolder

    return {
        "jsonl": _manifest_reader("jsonl"),
        "csv": _manifest_reader("csv"),
        "folder": _manifest_reader("folder"),
        "imagefolder": read_imagefolder,
        "coco": read_coco,
        "parquet": read_parquet,
        "arrow": read_arrow,
        "wds": _read_wds,
    }


def _read_wds(path: Path, opts: InputOptions, confine: bool, image_dir: Path | None = None):
    from mmfast.inputs.wds import read_wds

    return read_wds(path, opts)


READERS: dict[str, Reader] = _readers()
