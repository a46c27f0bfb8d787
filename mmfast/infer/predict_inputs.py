"""Any input mmfast-prepare reads, read for prediction: one row per input row, either ready to predict or
carrying why it cannot be (its file, line and reason).

The rows come from the preparation readers (``mmfast.inputs.read_source``: the same kinds, the same flags),
read the way prediction needs:

- a label is optional. The input is read with labels first; a row the readers reject then is read again
  without (``no_labels``): if that takes it, its only fault was its label (none, empty, of another type)
  and it is predicted without one. An input with no label column at all is read without labels, unless
  the user named one (``--label-column``), which must then be there.
- duplicates are kept: every input row gets its own prediction.
- images stored as bytes (Parquet/Arrow) or read in place from the user's files (a kind's ``in_place``:
  WebDataset shards) are written as files into a folder mmfast made for them (``input_rows``: a temporary
  folder, removed afterwards). An image read in place is copied out of its file (by the offset the reader
  found) because the predict loader reads files: simplest, and the user's files stay untouched. Such a row's
  "image" names the image for the user (``<shard>:<member>``, ``<parquet file> row <n>``) and its "path" is
  the file predict reads.

A flat folder of images (no class folders, which preparation refuses) is read too: no labels, each text a
sidecar ``<image>.txt`` / ``<stem>.txt`` or "".
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from mmfast.data.dataset import COMPLETE, prepared_state
from mmfast.inputs import ImagesInPlace, InputOptions, Reader, detect_kind, read_source, reader_named
from mmfast.inputs.columns import cell_name
from mmfast.inputs.manifest import (
    IMAGE_SUFFIXES,
    Candidate,
    ManifestError,
    Reject,
    caption_file,
    refuse_output_folder,
)
from mmfast.remote.errors import redact
from mmfast.remote.objects import fetch_to, is_remote

_Read = dict[tuple[str, int], Candidate | Reject]  # one read of the input, by (file, line)


@contextlib.contextmanager
def input_rows(source: str | os.PathLike, opts: InputOptions | None = None) -> Iterator[list[dict]]:
    """``read_rows`` with a temporary folder for the images stored as bytes, removed (with everything in it)
    when the block ends: use the rows' files inside it.

    Raises:
        ManifestError: as ``read_rows``.
    """
    with tempfile.TemporaryDirectory(prefix="mmfast-predict-input-") as tmp:
        yield read_rows(source, Path(tmp), opts)


def read_rows(
    source: str | os.PathLike, work_dir: Path | None = None, opts: InputOptions | None = None
) -> list[dict]:
    """Rows to predict of anything ``read_source`` reads, or of a flat folder of images.

    Args:
        source: a manifest, HF imagefolder (metadata), COCO JSON, Parquet/Arrow, WebDataset shards, an image
            folder (class folders, or flat).
        work_dir: an empty folder mmfast owns, for the images of Parquet/Arrow bytes and WebDataset shards
            (None: such inputs are refused).
        opts: how to read it (default: told from the path).

    Returns:
        one dict per input row, in input order (by file, then line): "image", "text", "label" (when the row
        has one) and "path" (the file to read, when "image" only names it), or "error" ("<file>:<line>:
        <reason>", with the row's "image", "text" and "label" cells as written, None where it has none).

    Raises:
        ManifestError: the input cannot be read as a whole (missing, unknown format, a named column absent,
            a damaged file).
    """
    opts = opts or InputOptions()
    path = Path(source)
    if prepared_state(path) == COMPLETE:
        raise ManifestError(f"{source} is a prepared dataset: pass it as --data {source} (with --split)")
    if path.is_dir():
        refuse_output_folder(path)  # a run's or an evaluation's folder holds pictures too: not an input
    if _is_flat_image_folder(path, opts):
        return _flat_folder_rows(path)
    work_dir = work_dir.resolve() if work_dir is not None else None
    labeled, unlabeled, kind = _read_twice(source, opts, work_dir)
    chosen = {key: (item, True) for key, item in labeled.items()}
    for key, item in unlabeled.items():  # the read without labels decides every row the labeled read rejects
        if key not in chosen or isinstance(chosen[key][0], Reject):
            chosen[key] = (item, False)
    base = path if path.is_dir() else path.parent  # what a row's file is relative to
    reader = reader_named(kind)
    rows, fetched = [], {}
    for k, key in enumerate(sorted(chosen)):
        item, with_label = chosen[key]
        if isinstance(item, Reject):
            where = _where(item, reader, path, base)
            cells = _raw_cells(item, opts)
            cells["image"] = cells["image"] or _sample_image(item, opts, _file_of(item.file, base, path))
            rows.append({**cells, "error": f"{where}: {item.reason}"})
        elif reader.in_place is not None:
            rows.append(_copied_out_row(item, k, with_label, reader.in_place, path, base, work_dir, fetched))
        else:
            rows.append(_candidate_row(item, with_label, path, base, work_dir))
    return rows


def _read_twice(source: str | os.PathLike, opts: InputOptions, work_dir: Path | None) -> tuple[_Read, _Read, str]:
    """(the read with labels, the read without, the reader's name); a read not needed is {}. The read without
    labels is only needed when the first rejected rows or found no label column the user did not name."""
    unlabeled_opts = replace(opts, no_labels=True, label_column=None)
    if opts.no_labels:
        return {}, *_read(source, unlabeled_opts, work_dir, "unlabeled")
    try:
        labeled, kind = _read(source, opts, work_dir, "labeled")
    except ManifestError:
        if opts.label_column:
            raise
        # No label column (or a reason not about labels: then the read without labels says it again).
        return {}, *_read(source, unlabeled_opts, work_dir, "unlabeled")
    if all(isinstance(item, Candidate) for item in labeled.values()):
        return labeled, {}, kind
    return labeled, *_read(source, unlabeled_opts, work_dir, "unlabeled")


def _read(source: str | os.PathLike, opts: InputOptions, work_dir: Path | None, name: str) -> tuple[_Read, str]:
    """One read of the input by ``read_source`` (duplicates kept; bytes written under work_dir/name) and the
    reader's name."""
    image_dir = work_dir / name if work_dir is not None else None
    cands, rejects, kind = read_source(source, opts, image_dir=image_dir, dedupe=False)
    read: _Read = {(r.file, r.line): r for r in rejects}
    read.update({(c.file, c.line): c for c in cands})
    return read, kind


def _copied_out_row(
    c: Candidate,
    k: int,
    with_label: bool,
    in_place: ImagesInPlace,
    path: Path,
    base: Path,
    work_dir: Path | None,
    fetched: dict[str, Path],
) -> dict:
    """The row of an image read in place (the ``k``-th row to predict): its bytes copied out of the user's file
    into a file under ``work_dir``, which the row's "path" names; its "image" is "<file>:<member>". ``fetched``:
    the remote shards already fetched into ``work_dir`` ({URL: local copy}), added to."""
    if work_dir is None:
        raise ManifestError(f"{path}: the images of {in_place.noun}s need a folder to be copied to")
    m = in_place.member(c)
    image_dir = work_dir / ("labeled" if with_label else "unlabeled")
    image_dir.mkdir(parents=True, exist_ok=True)
    local = m.file
    if is_remote(m.file):  # a remote shard is fetched once, verified, into work_dir (removed with it)
        if m.file not in fetched:
            (work_dir / "shards").mkdir(exist_ok=True)
            fetched[m.file] = fetch_to(m.file, work_dir / "shards" / f"{len(fetched):05d}.tar")
        local = fetched[m.file]
    with open(local, "rb") as f:
        f.seek(m.offset)
        data = f.read(m.nbytes)
    out = image_dir / f"{k:08d}{Path(m.name).suffix.lower()}"
    out.write_bytes(data)
    shard = redact(m.file) if is_remote(m.file) else base / c.file if c.file else path
    row = {"image": f"{shard}:{m.name}", "text": c.text}
    if with_label:
        row["label"] = c.label
    return row | {"path": str(out)}


def _candidate_row(c: Candidate, with_label: bool, path: Path, base: Path, work_dir: Path | None) -> dict:
    row = {"image": c.image, "text": c.text}
    if with_label:
        row["label"] = c.label
    if work_dir is not None and Path(c.image).is_relative_to(work_dir):  # a file mmfast wrote out: name the image
        file = base / c.file if c.file else path
        row.update(image=f"{file} row {c.line}", path=c.image)
    return row


def _raw_cells(r: Reject, opts: InputOptions) -> dict:
    """A row that could not be read, as it was given: its image, text and label cells where the input row has
    them (else None), so that its line of the predictions keeps what the user wrote."""
    raw = r.row if isinstance(r.row, dict) else {}
    names = {"image": opts.image_column, "text": opts.text_column, "label": opts.label_column}
    cells = {key: raw.get(cell_name(key, column, raw)) for key, column in names.items()}  # as found, if found
    cells = {k: str(v) if isinstance(v, int | float | str) else None for k, v in cells.items()}  # not a list
    return {"image": cells["image"], "text": cells["text"]} | ({"label": cells["label"]} if cells["label"] else {})


def _sample_image(r: Reject, opts: InputOptions, shard: str | Path) -> str | None:
    """A WebDataset sample's image as its good rows name it, ``<shard>:<member>``, where the reject lists its
    members (else None)."""
    members = r.row.get("members") if isinstance(r.row, dict) and "shard" in r.row else None
    keys = [k.strip().lower() for k in opts.wds_image_key.replace(",", ";").split(";")]
    ext = {m: m.rsplit("/", 1)[-1].partition(".")[2].lower() for m in members or ()}  # after the first dot
    image = next((m for k in keys for m in ext if ext[m] == k), None)  # as the reader chose it
    return f"{shard}:{image}" if image else None


def _file_of(file: str, base: Path, path: Path) -> str | Path:
    """The input file a row came from: a remote shard's URL (its credentials left out), else the local file."""
    if file and is_remote(file):
        return redact(file)
    return base / file if file else path


def _where(r: Reject, reader: Reader, path: Path, base: Path) -> str:
    """The row a reject names: ``<file>:<line>`` or ``Reader.where``'s (an image folder's row: its image; a
    whole shard: the shard)."""
    if reader.rows_are_files and isinstance(r.row, dict) and isinstance(r.row.get("image"), str):
        return str(path / r.row["image"])
    file = _file_of(r.file, base, path)
    return reader.where(file, r.line) if r.line > 0 else str(file)


def _is_flat_image_folder(path: Path, opts: InputOptions) -> bool:
    """A folder of images with no class folders (and nothing else a reader takes), read as the kind whose rows
    are the files of a folder (``Reader.rows_are_files``)."""
    if not path.is_dir():
        return False
    if not reader_named(detect_kind(path) if opts.kind == "auto" else opts.kind).rows_are_files:
        return False
    entries = list(path.iterdir())
    return not any(p.is_dir() and not p.name.startswith(".") for p in entries) and any(
        p.suffix.lower() in IMAGE_SUFFIXES for p in entries
    )


def _flat_folder_rows(root: Path) -> list[dict]:
    rows = []
    for p in sorted(p for p in root.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES):
        side = caption_file(p)
        try:
            text = side.read_bytes().decode("utf-8-sig").strip() if side else ""
        except (OSError, UnicodeDecodeError) as e:
            rows.append({"image": None, "text": None, "error": f"{side}: caption cannot be read ({e})"})
            continue
        rows.append({"image": str(p), "text": text})
    return rows
