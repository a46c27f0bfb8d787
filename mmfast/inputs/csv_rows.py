"""The rows of a CSV / TSV manifest: its delimiter and columns told from the header line (or named by --columns
for a file without one), each row a dict or a Reject with its line, as ``manifest._jsonl_rows`` reads JSONL."""

from __future__ import annotations

import csv
import io
import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from mmfast.inputs.rows import (
    MAX_LINE_BYTES,
    Columns,
    ManifestError,
    Reject,
    not_utf8,
    read_bytes,
    split_lines,
)

log = logging.getLogger(__name__)

OPEN_CLIP_COLUMNS = {"image": "filepath", "text": "title"}  # open_clip_train's --csv-img-key, --csv-caption-key


def _table_layout(path: Path, suffix: str, columns: Columns) -> tuple[str, Columns]:
    """The delimiter and columns of a CSV / TSV with a header line: a tab for a .tsv, or for a .csv whose header
    has tabs and no comma (open_clip's trainer reads tab-separated .csv files by default); open_clip's column
    names (filepath, title) where the header has them and not mmfast's defaults (image, text)."""
    with open(path, "rb") as f:
        first = f.readline(MAX_LINE_BYTES)
    tab = suffix == ".tsv" or (b"\t" in first and b"," not in first)
    if columns.names is not None:  # no header line: --columns names them
        return ("\t" if tab else ","), columns
    header = set(first.decode("utf-8", "replace").strip().split("\t" if tab else ","))
    found = {
        key: name
        for key, name in OPEN_CLIP_COLUMNS.items()
        if getattr(columns, key) == key and key not in header and name in header
    }
    for key, name in found.items():  # said as inputs.columns says the names it finds
        role = "captions" if key == "text" else "images"
        log.warning(
            "%s: no '%s' field; the %s read from '%s' (--%s-column chooses another)",
            path.name,
            key,
            role,
            name,
            key,
        )
    return ("\t" if tab else ","), replace(columns, **found)


def _csv_rows(
    path: Path, delimiter: str, columns: Columns | None = None, detect: Callable | None = None
) -> tuple[list[tuple[int, dict]], list[Reject], Columns]:
    """A CSV's rows and rejects, and the columns to read them by: ``detect`` (see ``read_input``) names those
    the user left unnamed, from the header's names (or --columns'), not from the rows under them."""
    columns = columns or Columns()
    rejects, good_lines = [], []
    for line, raw in split_lines(read_bytes(path)):
        try:
            good_lines.append(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            rejects.append(not_utf8(line, raw, e))
            good_lines.append("")  # keep line numbers aligned; an empty line is skipped by csv
    headerless = columns.names is not None
    if rejects and rejects[0].line == 1 and not headerless:
        raise ManifestError(f"{path}:1: the header is {rejects[0].reason} (as UTF-8)")
    csv.field_size_limit(MAX_LINE_BYTES)
    reader = csv.DictReader(
        io.StringIO("\n".join(good_lines), newline=""),
        fieldnames=list(columns.names) if headerless else None,
        delimiter=delimiter,
        # A headerless TSV (CC3M's caption<TAB>url) quotes nothing: a caption may hold a '"'.
        quoting=csv.QUOTE_NONE if headerless and delimiter == "\t" else csv.QUOTE_MINIMAL,
    )
    if reader.fieldnames is None:
        raise ManifestError(
            f"{path}: empty CSV; the first line must name the columns image,text,label (or pass --columns)"
        )
    rows = []
    end = reader.line_num  # the header's last line
    try:
        for row in reader:
            # A quoted field may span lines (or an unclosed quote swallow some): a row is named by its first
            # line, where the problem starts, not by reader.line_num, its last.
            start, end = end + 1, reader.line_num
            while start < end and not good_lines[start - 1].strip():
                start += 1
            extra = row.pop(None, None)
            if extra:
                rejects.append(Reject(start, f"{len(extra)} more fields than the header", row))
                continue
            rows.append((start, row))
    except csv.Error as e:
        raise ManifestError(f"{path}:{reader.line_num}: CSV cannot be parsed: {e}") from e
    if detect is not None:  # every row has every column of the header (a short row is rejected on its own)
        columns = detect([(1, dict.fromkeys(reader.fieldnames, ""))], columns)
    missing = set(columns.required()) - set(reader.fieldnames)
    if missing:  # named by --columns, or by the header line
        where = (
            "--columns " + ",".join(reader.fieldnames)
            if headerless
            else f"{path}:1: CSV header {reader.fieldnames}"
        )
        raise ManifestError(
            f"{where} lacks {sorted(missing)}; name the columns image,text,label, map yours with --image-column/"
            "--text-column/--label-column"
            + ("" if headerless else ", or pass --columns for a file without a header")
            + ("; pairs without labels (for --model clip): --no-labels" if missing == {columns.label} else "")
        )
    return rows, rejects, columns
