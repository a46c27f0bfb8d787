"""What every input reader shares: how to read the input (``InputOptions``), column picking, and the ``Reader``
record each kind registers, which declares what preparation and prediction may do with the kind.

A kind is a reader module plus one ``register_reader`` line in ``mmfast.inputs`` (docs/architecture.md,
"Where a change goes"): the code that uses inputs asks a kind's record, never its name.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from mmfast.inputs.manifest import Candidate, Columns, ManifestError, Reject

log = logging.getLogger(__name__)

# Column names tried, in order, when a reader that knows its columns is not told which holds what.
TEXT_NAMES = ("text", "caption", "captions", "sentence", "description", "prompt", "title")
LABEL_NAMES = ("label", "labels", "class", "category", "class_name")


@dataclass(frozen=True)
class InputOptions:
    """How to read the input (the input-format flags of mmfast-prepare, mmfast-predict, mmfast-evaluate).

    Args:
        kind: a registered reader's name (``READERS``), or "auto" to tell it from the path.
        image_column, text_column, label_column: the columns holding each (None: the reader's default,
            image/text/label for a manifest, detected for the others).
        no_labels: the input has no labels; every row gets the one label ``manifest.NO_LABEL``.
        columns: the column names of a CSV/TSV without a header line (e.g. ("text", "image") for CC3M).
        coco_captions: "all" (a row per caption) or "first" (a row per image, its first caption).
        image_root: the folder relative image paths are read from (default: the folder of the file naming
            them); only kinds that declare ``Reader.image_root`` take it (``check_image_root``).
        wds_image_key: WebDataset: the image member's extensions, in order of preference ("jpg;png").
        wds_text_key: WebDataset: the caption member's extension.
        wds_label_key: WebDataset: the label member's extension (an integer or a name as text).
        wds_label_field: WebDataset: take the label from this field of the ``json`` member instead.
        captions_needed: False reads a row with an empty or missing caption, its text "" (mmfast-predict's
            zero-shot and image embeddings read no caption).
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
    captions_needed: bool = True

    def __post_init__(self):
        if self.kind != "auto":
            reader_named(self.kind)
        if self.coco_captions not in ("all", "first"):
            raise ValueError(f"--coco-captions must be 'all' or 'first', got '{self.coco_captions}'")
        if self.no_labels and self.label_column:
            raise ValueError("--no-labels and --label-column exclude each other")

    def image_folder(self, beside: Path) -> Path:
        """The folder relative image paths are read from: ``image_root`` if given, else ``beside`` (the folder
        of the file naming them), resolved."""
        return Path(self.image_root).resolve() if self.image_root else beside.resolve()

    def table_columns(self, image: str = "image", text: str = "text", label: str = "label") -> Columns:
        """The Columns of a table, the given names over the reader's defaults."""
        return Columns(
            image=self.image_column or image,
            text=self.text_column or text,
            label=None if self.no_labels else (self.label_column or label),
            names=self.columns,
            text_optional=not self.captions_needed,
        )


ReadRows = Callable[[Path, InputOptions, bool, "Path | None"], tuple[list[Candidate], list[Reject]]]
"""A kind's reader: (path, options, confine, image_dir) -> (candidates, rejects). ``confine``: reject image paths
outside the input's folder; ``image_dir``: where images stored as bytes are written (None: refuse them)."""


class Member(NamedTuple):
    """Where an image read in place lies: a member of one of the user's files (a tar shard)."""

    file: str  # the file holding it (absolute)
    name: str  # its member name in that file
    offset: int  # where its bytes start in the file
    nbytes: int


@dataclass
class InPlaceRead:
    """What ``ImagesInPlace.read_checked`` gives: the rows kept and dropped, a ``file_reads`` record of each
    local file, and how many rows came from records of unchanged files instead of reading."""

    cands: list[Candidate]
    rejects: list[Reject]
    records: list[dict]
    reused: int


@dataclass(frozen=True)
class ImagesInPlace:
    """The capabilities of a kind whose images stay inside the user's files (WebDataset shards): preparation
    copies, decodes and writes none of them, and writes an index of the accepted samples instead.

    Args:
        noun: how messages name one of those files ("WebDataset shard").
        read_checked: (source, options, workers, max_pixels, part, earlier) -> ``InPlaceRead``, every
            candidate's image validated by the reader where it lies, with its width and height (0 when not
            read); ``part`` (i, n) reads only the i-th of n contiguous slices of the files (so the rows of two
            parts were never compared: the merge drops duplicates); ``earlier``: folders of earlier
            preparations, whose ``file_reads`` records of unchanged files spare reading them again.
        files: source -> the user's files holding the images: the input's fingerprint is their names, sizes and
            mtimes (not their bytes), and none may be inside --out.
        member: where a candidate's image lies in those files (what prepared rows and the index record; what
            the split keys it by; what prediction copies out into a file).
        index_dir: the prepared directory's folder the index goes into (``data.dataset``'s layout).
        write_index: (that folder, split, the split's prepared rows in id order) -> writes the split's index.
    """

    noun: str
    read_checked: Callable[..., InPlaceRead]
    files: Callable[[str], list[Path]]
    member: Callable[[Candidate], Member]
    index_dir: str
    write_index: Callable[[Path, str, list[dict]], dict]


@dataclass(frozen=True)
class Reader:
    """One kind of input, as registered (``register_reader``): its name, its reader, and what it declares.

    Args:
        name: what ``--input-kind`` calls it.
        read: the reader (``ReadRows``).
        suffixes: file suffixes told to be this kind when the kind is "auto" (lower case, with the dot).
        claims: source -> whether it is this kind, asked before anything else when the kind is "auto"; a
            kind with ``claims`` reads sources that need not be one existing path (a pattern of shards), so
            ``read_source`` leaves checking them to its reader.
        rows_are_files: each row is an image file of a folder (root/<class>/<image>): a reject is named by
            its image, not a line number, and prediction also reads a flat folder of images as this kind.
        in_place: the kind's images stay inside the user's files (``ImagesInPlace``); None: they are image
            files (on disk, or written from bytes into ``image_dir``) that preparation validates.
        image_root: its rows name images by paths that may be relative, read from ``InputOptions.image_folder``;
            a kind without it refuses --image-root (``check_image_root``).
        row_noun: what a reject's number counts when it is not a line of the file ("annotation" of a COCO
            file, "row" of a Parquet table): a reject is named "<file>, annotation 7", not "<file>:7".
    """

    name: str
    read: ReadRows
    suffixes: tuple[str, ...] = ()
    claims: Callable[[str], bool] | None = None
    rows_are_files: bool = False
    in_place: ImagesInPlace | None = None
    image_root: bool = False
    row_noun: str = ""

    def where(self, file: Path | str, line: int) -> str:
        """The place of a reject's row: ``<file>:<line>``, or ``<file>, <row_noun> <line>``."""
        return f"{file}, {self.row_noun} {line}" if self.row_noun else f"{file}:{line}"


READERS: dict[str, Reader] = {}
"""The registered kinds by name, in registration order (``mmfast.inputs`` registers the built-in ones)."""


def register_reader(reader: Reader) -> Reader:
    """Add a kind of input: ``read_source``, ``--input-kind`` and preparation take it from then on.

    Returns:
        ``reader``.

    Raises:
        ValueError: a kind of that name is registered already, or the name is "auto".
    """
    if reader.name == "auto" or reader.name in READERS:
        raise ValueError(f"input kind '{reader.name}' is taken; choose another name")
    READERS[reader.name] = reader
    return reader


def unregister_reader(name: str) -> Reader:
    """Remove the kind ``name`` (a plugin's, or a test's); returns its record.

    Raises:
        ValueError: no such kind.
    """
    reader = reader_named(name)
    del READERS[name]
    return reader


def reader_named(name: str) -> Reader:
    """The registered kind called ``name``.

    Raises:
        ValueError: no such kind, naming those there are.
    """
    try:
        return READERS[name]
    except KeyError:
        raise ValueError(f"unknown input kind '{name}'; choose from auto, {', '.join(READERS)}") from None


def check_image_root(reader: Reader, opts: InputOptions) -> None:
    """Refuse --image-root for a kind whose rows name no image by a relative path (it would be ignored).

    Raises:
        ManifestError: naming the kind and the kinds that take it.
    """
    if opts.image_root and not reader.image_root:
        takers = ", ".join(r.name for r in READERS.values() if r.image_root)
        raise ManifestError(
            f"--image-root does not apply to a {reader.name} input: its rows name no image by a relative path "
            f"(it applies to {takers}); drop --image-root"
        )


def pick_text_column(present: list[str], opts: InputOptions, where: str) -> str:
    """The caption column, as ``pick_column`` picks it; for a command that reads no caption
    (``captions_needed=False``) a table without one is read too, every row's text "" (the default name)."""
    if not opts.captions_needed and opts.text_column is None and not any(n in present for n in TEXT_NAMES):
        return TEXT_NAMES[0]
    return pick_column(present, opts.text_column, TEXT_NAMES, "text", where)


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
    if what == "image" and {"url", "key", "status"} <= set(present):  # the table img2dataset writes per shard
        hint = "it looks like img2dataset's metadata, whose pictures are in the .tar shard of the same name: pass "
        hint += "the shards (their folder, or a pattern such as 'DIR/{00000..00009}.tar')"
    raise ManifestError(f"{where}: no {what} column among {present}; {hint}")


# a split's name as the Hub's Parquet files ("train-00000-of-00002.parquet") and folders ("train/") carry it
SPLIT_NAME = re.compile(r"^(train|training|test|testing|validation|valid|val|dev|eval)(?:[-_.]|$)", re.IGNORECASE)


def train_split(path: Path, parts: list[Path], split_of) -> list[Path]:
    """The parts (files or split folders) of the train split, when ``parts`` hold one and another split's too:
    reading a test split into training would leak it into mmfast's train rows. The others are named."""
    named = {
        p: {"training": "train"}.get(m.group(1).lower(), m.group(1).lower()) for p in parts if (m := split_of(p))
    }
    train = [p for p in parts if named.get(p, "train") == "train"]
    left = sorted({s for s in named.values() if s != "train"})
    if not left or "train" not in named.values():
        return parts
    where = "; ".join(f"{s}: {', '.join(str(p) for p in parts if named.get(p) == s)}" for s in left)
    log.warning(
        "%s: read its train split; left out its %s split%s (%s): to read one of those, give its own files or "
        "folder as the input", path, ", ".join(left), "s" if len(left) > 1 else "", where,
    )  # fmt: skip
    return train
