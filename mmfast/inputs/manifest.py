"""Read a manifest (JSONL / CSV) or an image folder into candidate rows.

Every input row ends up either in the returned candidates or in the returned rejects with a reason and
its line number, so counts always add up. Images are not opened here (see ``mmfast.data.validate``).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path

from mmfast.data.dataset import COMPLETE, INCOMPLETE, incomplete_message, prepared_state
from mmfast.inputs.csv_rows import _csv_rows, _table_layout
from mmfast.inputs.rows import (  # the row types: the readers and stages import them from here too
    IMAGE_SUFFIXES,
    MAX_LINE_BYTES,
    NO_LABEL,
    Candidate,
    Columns,
    ManifestError,
    Reject,
    not_utf8,
    read_bytes,
    split_lines,
)
from mmfast.util.commands import PREPARE, TRAIN
from mmfast.util.fsutil import RUN_MARKER, is_mmfast_output, marker_kind, read_json_object

_INT_RE = re.compile(r"^[+-]?\d+$")
_DECIMAL_RE = re.compile(r"^[+-]?(\d+\.\d*|\.\d+|\d+(?=[eE]))([eE][+-]?\d+)?$")  # 0.7, 3.0, .5, 1e3
_URL_RE = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")


def read_input(
    path: str | Path,
    confine: bool = False,
    columns: Columns | None = None,
    fmt: str | None = None,
    dedupe: bool = True,
    image_folder: Path | None = None,
    detect: Callable[..., Columns] | None = None,
) -> tuple[list[Candidate], list[Reject], str]:
    """Read a JSONL/CSV manifest or an image folder.

    Args:
        path: the manifest file or the image folder (``root/<class>/<image>``).
        confine: reject image paths that resolve outside ``image_folder`` (for untrusted manifests).
        columns: the manifest's image/text/label columns (default: named image, text, label); a folder's
            labels are its class folders whatever this says.
        fmt: "jsonl", "csv" or "folder" (default: told from the path: a folder, or the file's suffix).
        dedupe: reject exact duplicates of an earlier row (see ``finish_rows``).
        image_folder: the folder a manifest's relative image paths are read from (default: the manifest's).
        detect: (rows, columns, jsonl=...) -> the columns to read them by (``inputs.columns.detect_columns``).

    Returns:
        (candidates, rejects, kind) where kind is "jsonl", "csv" or "folder".

    Raises:
        ManifestError: the path does not exist or its format is unknown.
    """
    path = Path(path)
    columns = columns or Columns()
    if not path.exists():
        raise ManifestError(f"{path}: no such manifest or image folder; pass a .jsonl/.csv file or a folder")
    suffix = path.suffix.lower()
    fmt = fmt or ("folder" if path.is_dir() else {".csv": "csv", ".tsv": "csv"}.get(suffix, suffix.lstrip(".")))
    if fmt == "folder":
        if not path.is_dir():
            raise ManifestError(f"{path}: not a folder (an image folder is root/<class>/<image>)")
        _refuse_prepared_dir(path)
        cands, rejects = _read_folder(path.resolve())  # absolute: the rows are read from anywhere later
        kind = "folder"
    else:
        if path.is_dir():
            raise ManifestError(f"{path}: a folder, not a {fmt} manifest")
        if fmt in ("jsonl", "json", "ndjson"):
            if columns.names is not None:
                raise ManifestError(f"{path}: --columns names the columns of a CSV/TSV without a header line")
            rows, rejects = _jsonl_rows(path)
            columns = detect(rows, columns, jsonl=True) if detect is not None else columns  # those left unnamed
            kind = "jsonl"
        elif fmt == "csv":
            delimiter, columns = _table_layout(path, suffix, columns)
            rows, rejects, columns = _csv_rows(path, delimiter, columns, detect)
            kind = "csv"
        else:
            raise ManifestError(f"{path}: unknown manifest format '{suffix}'; use .jsonl, .csv or an image folder")
        root = (image_folder or path.parent).resolve()
        cands, more = check_rows(rows, root, confine, from_csv=kind == "csv", columns=columns)
        rejects.extend(more)
    cands, rejects = finish_rows(cands, rejects, dedupe)
    return cands, rejects, kind


def check_rows(
    rows: list[tuple[int, dict]], root: Path, confine: bool, from_csv: bool, columns: Columns, file: str = ""
) -> tuple[list[Candidate], list[Reject]]:
    """Check parsed table rows ``(line, row)``: each becomes a Candidate or a Reject with its reason.

    Args:
        rows: (1-based line or row number, the row as a dict of column name -> value).
        root: the folder relative image paths are resolved against.
        confine: reject image paths that resolve outside ``root``.
        from_csv: the values are CSV text (a label that reads as a number is one: see ``parse_label``).
        columns: which columns hold the image, text and label.
        file: the input file, recorded with each row when an input has several files.
    """
    cands, rejects = [], []
    for line, row in rows:
        cand, reason = _check_row(row, line, root, confine, from_csv, columns)
        if cand is None:
            rejects.append(Reject(line, reason, row, file))
        else:
            cand.file = file
            cands.append(cand)
    return cands, rejects


def parse_label(value: object, from_text: bool = False) -> tuple[str | int | None, str]:
    """A row's label as preparation keeps it: a class name (str) or an integer id; or None and why not.

    A float that is a whole number (3.0, as pandas writes an integer column with gaps) is that integer. Any
    other number (0.7, NaN, inf) is refused: labels name classes, and rounding one would merge classes
    (1.5 and 1.2) without a word.

    Args:
        value: the label as read.
        from_text: ``value`` is the text of a CSV/TSV cell or a WebDataset .cls member, where a number can
            only be written as text: "3" and "3.0" are the integer 3 and "0.7" is refused too.

    Returns:
        (label, "") or (None, the reason).
    """
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        return None, f"unknown label type {type(value).__name__}; use a string or an integer"
    if isinstance(value, str):
        value = value.strip()
        if not value:
            return None, "empty label"
        if not from_text or not (_INT_RE.match(value) or _DECIMAL_RE.match(value)):
            return value, ""
        number = float(value) if _DECIMAL_RE.match(value) else int(value)
        hint = "give the class a name that is not a number"
    else:
        number = value
        hint = f'write a class name as a string ("{value}")'
    if isinstance(number, int):
        return number, ""
    if math.isnan(number):
        return None, "label is NaN (a missing value); give the row a label or drop it"
    if not math.isfinite(number) or not number.is_integer():
        return None, f"label {value} is not a whole number: labels are class names or integer ids; {hint}"
    return int(number), ""


def finish_rows(
    cands: list[Candidate], rejects: list[Reject], dedupe: bool = True
) -> tuple[list[Candidate], list[Reject]]:
    """Drop rows whose label type differs from the first row's and (``dedupe``) exact duplicates (same image,
    text and label) into the rejects, and order the rejects by file and line. Prediction keeps duplicates:
    each input row gets its own prediction; training would count a duplicate twice."""
    cands, more = _drop_mixed_labels_and_duplicates(cands, dedupe)
    rejects = rejects + more
    rejects.sort(key=lambda r: (r.file, r.line))
    return cands, rejects


def _refuse_prepared_dir(path: Path) -> None:
    """A prepared dataset directory, or a run's, an export's or an evaluation's, is not an image folder: say what
    it is instead of reading its files as classes of images."""
    refuse_output_folder(path)
    state = prepared_state(path)
    if state == COMPLETE:
        raise ManifestError(
            f"{path} is a prepared dataset, not an image folder; pass it to {TRAIN} --data, or prepare "
            "the original manifest again"
        )
    if state == INCOMPLETE:
        raise ManifestError(incomplete_message(path))


def refuse_output_folder(path: Path) -> None:
    """A training run's, an export's or an evaluation's folder given as input: say what it is (ManifestError)."""
    if (path / RUN_MARKER).is_file():
        data = read_json_object(path / "config.json").get("data")
        raise ManifestError(
            f"{path} is a training run's folder, not an image folder; pass the data it trained on"
            + (f": {data}" if isinstance(data, str) else "")
        )
    if is_mmfast_output(path):
        raise ManifestError(f"{path} is an mmfast {marker_kind(path)} folder, not an image folder; pass the data")


def _encoding_problem(what: str, value: str) -> str:
    """Why ``value`` cannot be written as UTF-8 (a lone surrogate from a JSON ``"\\ud800"`` escape, or a file
    name that is not UTF-8); "" when it can. Such text would fail later in the tokenizer, DALI or a writer."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        return (
            f"{what} cannot be encoded as UTF-8 (lone surrogate {value[e.start]!r} at character {e.start}); "
            "fix the text"
        )
    return ""


def _jsonl_rows(path: Path) -> tuple[list[tuple[int, dict]], list[Reject]]:
    rows, rejects = [], []
    for line, raw in split_lines(read_bytes(path)):
        if not raw.strip():
            continue
        if len(raw) > MAX_LINE_BYTES:
            rejects.append(Reject(line, f"line too long ({len(raw)} bytes > {MAX_LINE_BYTES})", raw[:200].hex()))
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            rejects.append(not_utf8(line, raw, e))
            continue
        try:
            row = json.loads(text)
        except json.JSONDecodeError as e:
            rejects.append(Reject(line, f"invalid JSON: {e.msg} (column {e.colno})", text[:200]))
            continue
        if not isinstance(row, dict):
            rejects.append(Reject(line, f"row is a JSON {type(row).__name__}, expected an object", text[:200]))
            continue
        rows.append((line, row))
    return rows, rejects


def _check_row(
    row: dict, line: int, root: Path, confine: bool, from_csv: bool, columns: Columns | None = None
) -> tuple[Candidate | None, str]:
    columns = columns or Columns()
    if columns.text_optional and row.get(columns.text) is None:
        row = {**row, columns.text: ""}  # a command that reads no caption
    for key in columns.required():
        if key not in row or row[key] is None:
            return None, f"missing field '{key}'"
    image, text = row[columns.image], row[columns.text]
    label = NO_LABEL if columns.label is None else row[columns.label]
    if not isinstance(image, str) or not image.strip():
        return None, f"field '{columns.image}' must be a non-empty string path, got {type(image).__name__}"
    if not isinstance(text, str):
        return None, f"field '{columns.text}' must be a string, got {type(text).__name__}"
    if not text.strip() and not columns.text_optional:
        return None, "empty text"
    label, why = parse_label(label, from_text=from_csv)
    if why:
        return None, why
    for what, value in (("image path", image), ("text", text), ("label", label)):
        if isinstance(value, str) and (problem := _encoding_problem(what, value)):
            return None, problem
    if _URL_RE.match(image):
        return None, (
            f"image '{image[:100]}' is a URL; mmfast reads local files: download the images first (img2dataset "
            f"writes WebDataset shards that {PREPARE} reads)"
        )
    p = Path(image)
    full = p if p.is_absolute() else root / p
    if confine:
        try:
            full.resolve().relative_to(root)
        except (ValueError, RuntimeError, OSError):
            return None, f"image path '{image}' leaves the folder image paths are read from (confined mode)"
    return Candidate(line, str(full), text.strip(), label, row), ""


def _drop_mixed_labels_and_duplicates(
    cands: list[Candidate], dedupe: bool = True
) -> tuple[list[Candidate], list[Reject]]:
    rejects, kept, seen = [], [], {}
    first_type = type(cands[0].label) if cands else None
    for c in cands:
        if type(c.label) is not first_type:
            rejects.append(
                Reject(
                    c.line,
                    f"mixed label types: {type(c.label).__name__} label among "
                    f"{first_type.__name__} labels; use one type",
                    c.source,
                    c.file,
                )
            )
            continue
        key = (c.image, c.text, c.label)
        if dedupe and key in seen:
            where = f"{seen[key][0]}:{seen[key][1]}" if seen[key][0] != c.file else f"line {seen[key][1]}"
            rejects.append(Reject(c.line, f"duplicate of {where}", c.source, c.file))
            continue
        seen[key] = (c.file, c.line)
        kept.append(c)
    return kept, rejects


def caption_file(image: Path) -> Path | None:
    """The sidecar caption of an image in a folder: ``img.png.txt``, else ``img.txt`` (the common convention)."""
    return next((s for s in (image.with_name(image.name + ".txt"), image.with_suffix(".txt")) if s.exists()), None)


def _read_folder(root: Path) -> tuple[list[Candidate], list[Reject]]:
    cands, rejects = [], []
    # a run, export or evaluation written into the folder is no class (nor in preparation's fingerprint)
    classes = sorted(
        d.name for d in _listdir(root) if d.is_dir() and not d.name.startswith(".") and not is_mmfast_output(d)
    )
    if not classes:
        packed = sorted(f.name for f in _listdir(root) if f.name.lower().endswith((".tar.gz", ".tgz", ".tar.zst")))
        if packed:
            raise ManifestError(
                f"{root}: holds compressed tar files ({packed[0]}, ...), which mmfast does not read as shards; "
                "decompress them to .tar files, as img2dataset and webdataset write shards"
            )
        raise ManifestError(f"{root}: image folder has no class sub-folders; expected root/<class>/<image>")
    n = 0
    for cls in classes:
        for f in sorted(_listdir(root / cls)):
            if f.name.startswith(".") or f.suffix.lower() == ".txt":
                continue
            n += 1
            src = {"image": f"{cls}/{f.name}", "label": cls}
            # A name that is not UTF-8 comes back with surrogate escapes: DALI and the writers cannot take it.
            problem = _encoding_problem("image path", src["image"])
            if problem:
                rejects.append(Reject(n, f"{problem} (rename the file or folder)", src))
                continue
            if f.suffix.lower() not in IMAGE_SUFFIXES:
                rejects.append(Reject(n, f"not an image file name ('{f.suffix}')", src))
                continue
            text = cls
            side = caption_file(f)
            if side is not None:
                try:
                    text = side.read_bytes().decode("utf-8-sig").strip()
                except UnicodeDecodeError as e:
                    reason = f"caption {side.name} is not UTF-8 ({e.reason} at byte {e.start})"
                    rejects.append(Reject(n, reason, src))
                    continue
                except OSError as e:
                    rejects.append(Reject(n, f"caption {side.name} cannot be read: {e.strerror or e}", src))
                    continue
                if not text:
                    rejects.append(Reject(n, f"caption {side.name} is empty", src))
                    continue
            src["text"] = text
            cands.append(Candidate(n, str(f), text, cls, src))
    return cands, rejects


def _listdir(folder: Path) -> list[Path]:
    try:
        return list(folder.iterdir())
    except OSError as e:
        raise ManifestError(f"{folder}: cannot list the image folder: {e.strerror or e}") from e
