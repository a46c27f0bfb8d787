"""Parquet and Arrow tables as Hugging Face ``datasets`` writes them (``to_parquet``, ``save_to_disk``, the
Hub's data/*.parquet).

An image column is HF's ``Image`` feature, ``struct<bytes: binary, path: string>`` (or plain binary): its
bytes are written out to files in ``image_dir`` (inside the prepared directory being built), named by their
SHA-256, so the prepared directory holds what the loader reads. A struct with no bytes and a path refers to a
file on disk: a relative path is read from the table file's folder, or from --image-root. A ``ClassLabel``
column's integers become its class names, read from HF's features: the ``huggingface`` key of the
Parquet/Arrow schema metadata, or a save_to_disk folder's dataset_info.json. Rows are numbered 1.. within
each file.

Needs pyarrow (``pip install mmfast[formats]``).
"""

from __future__ import annotations

import hashlib
import importlib
import json
from collections.abc import Iterator
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
from mmfast.inputs.manifest import IMAGE_SUFFIXES, Candidate, Columns, ManifestError, Reject, check_rows

_BATCH_ROWS = 256  # rows per record batch read: bounds the memory held by image bytes
_MAGIC = (
    (b"\xff\xd8\xff", ".jpg"),
    (b"\x89PNG\r\n\x1a\n", ".png"),
    (b"BM", ".bmp"),
    (b"II*\x00", ".tif"),
    (b"MM\x00*", ".tif"),
    (b"\x00\x00\x00\x0cjP  ", ".jp2"),
    (b"GIF8", ".gif"),
)


def read_parquet(
    path: Path, opts: InputOptions, confine: bool, image_dir: Path | None = None
) -> tuple[list[Candidate], list[Reject]]:
    """Read a Parquet file, or every *.parquet file of a folder (and of its sub-folders one level down)."""
    pq = _pyarrow_module("pyarrow.parquet")
    files = [path] if path.is_file() else sorted(path.glob("*.parquet")) + sorted(path.glob("*/*.parquet"))
    if not files:
        raise ManifestError(f"{path}: no .parquet files")
    if path.is_dir():
        files = train_split(
            path,
            files,
            lambda f: SPLIT_NAME.match(f.name) or (f.parent != path and SPLIT_NAME.match(f.parent.name + "-")),
        )
    root = path if path.is_dir() else path.parent
    cands, rejects = [], []
    for f in files:
        try:
            pf = pq.ParquetFile(f)
            batches = pf.iter_batches(batch_size=_BATCH_ROWS)
            schema = pf.schema_arrow
        except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
            raise ManifestError(
                f"{f}: cannot read the Parquet file ({_one_line(e)}): it is corrupt or not Parquet; re-export it"
            ) from e
        more = _read_table(f, root, schema, batches, _hf_features(schema), opts, confine, image_dir)
        cands += more[0]
        rejects += more[1]
    return cands, rejects


def read_arrow(
    path: Path, opts: InputOptions, confine: bool, image_dir: Path | None = None
) -> tuple[list[Candidate], list[Reject]]:
    """Read a ``datasets.save_to_disk`` folder (a Dataset, or a DatasetDict: its train split, or every split of
    one without a train split; mmfast splits its val off what it reads) or a single .arrow file."""
    _pyarrow_module("pyarrow")
    if path.is_file():
        folders, root = [(path.parent, [path])], path.parent
    else:
        root = path
        folders = [(d, _arrow_files(d)) for d in _dataset_folders(path)]
    cands, rejects = [], []
    for folder, files in folders:
        info_features = _info_features(folder)
        for f in files:
            schema, batches = _open_arrow(f)
            features = _hf_features(schema) or info_features
            more = _read_table(f, root, schema, batches, features, opts, confine, image_dir)
            cands += more[0]
            rejects += more[1]
    return cands, rejects


def _pyarrow_module(name: str):
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise ManifestError(
            "reading Parquet/Arrow needs pyarrow: pip install 'mmfast[formats]' (or pip install pyarrow)"
        ) from e


def _dataset_folders(path: Path) -> list[Path]:
    """A Dataset folder itself, or the split folders a DatasetDict's dataset_dict.json names."""
    dd = path / "dataset_dict.json"
    if dd.is_file():
        try:
            splits = json.loads(dd.read_text(encoding="utf-8"))["splits"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ManifestError(f"{dd}: cannot read the split names: {e}") from e
        return train_split(path, [path / s for s in splits], lambda d: SPLIT_NAME.match(d.name + "-"))
    return [path]


def _arrow_files(folder: Path) -> list[Path]:
    """The data files state.json lists (in order), else every *.arrow file in the folder."""
    state = folder / "state.json"
    if state.is_file():
        try:
            names = [d["filename"] for d in json.loads(state.read_text(encoding="utf-8"))["_data_files"]]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ManifestError(f"{state}: cannot read the data file names: {e}") from e
        return [folder / n for n in names]
    files = sorted(folder.glob("*.arrow"))
    if not files:
        raise ManifestError(f"{folder}: no state.json and no .arrow files (not a save_to_disk folder)")
    return files


def _open_arrow(f: Path):
    """(schema, iterator of record batches) of an Arrow IPC stream (what datasets writes) or file."""
    import pyarrow as pa  # pyarrow: optional (mmfast[formats]), only for Parquet / Arrow

    try:
        source = pa.memory_map(str(f))
        try:
            reader = pa.ipc.open_stream(source)
            return reader.schema, iter(reader)
        except pa.ArrowInvalid:
            reader = pa.ipc.open_file(source)
            return reader.schema, (reader.get_batch(i) for i in range(reader.num_record_batches))
    except (OSError, pa.ArrowInvalid) as e:
        raise ManifestError(
            f"{f}: cannot read the Arrow file ({_one_line(e)}): it is corrupt; re-export it"
        ) from e


def _info_features(folder: Path) -> dict:
    info = folder / "dataset_info.json"
    if not info.is_file():
        return {}
    try:
        features = json.loads(info.read_text(encoding="utf-8")).get("features")
    except (OSError, ValueError) as e:
        raise ManifestError(f"{info}: cannot read the features: {e}") from e
    return features if isinstance(features, dict) else {}


def _hf_features(schema) -> dict:
    """HF's features {column: {"_type": ...}} from the schema's ``huggingface`` metadata ({} when absent)."""
    raw = (schema.metadata or {}).get(b"huggingface")
    if not raw:
        return {}
    try:
        features = json.loads(raw).get("info", {}).get("features")
    except (ValueError, AttributeError):
        return {}
    return features if isinstance(features, dict) else {}


def _columns(f: Path, schema, features: dict, opts: InputOptions) -> Columns:
    import pyarrow as pa  # pyarrow: optional (mmfast[formats]), only for Parquet / Arrow

    present = list(schema.names)
    images = [n for n in present if _ftype(features, n) == "Image"]
    images += [n for n in present if n not in images and _is_image_struct(schema.field(n).type)]
    images += [n for n in present if n not in images and pa.types.is_binary(schema.field(n).type)]
    image = pick_column(present, opts.image_column, tuple(images) + ("image", "img"), "image", str(f))
    text = pick_text_column(present, opts, str(f))
    if opts.no_labels:
        label = None
    else:
        classlabels = tuple(n for n in present if _ftype(features, n) == "ClassLabel")
        label = pick_column(present, opts.label_column, classlabels + LABEL_NAMES, "label", str(f))
    return Columns(image=image, text=text, label=label, text_optional=not opts.captions_needed)


def _is_image_struct(kind) -> bool:
    import pyarrow as pa  # pyarrow: optional (mmfast[formats]), only for Parquet / Arrow

    return pa.types.is_struct(kind) and {"bytes", "path"} <= {kind.field(i).name for i in range(kind.num_fields)}


def _ftype(features: dict, name: str) -> str | None:
    feat = features.get(name)
    return feat.get("_type") if isinstance(feat, dict) else None


def _read_table(
    f: Path,
    root: Path,
    schema,
    batches: Iterator,
    features: dict,
    opts: InputOptions,
    confine: bool,
    image_dir: Path | None,
) -> tuple[list[Candidate], list[Reject]]:
    """Check one file's rows; image bytes are written to ``image_dir`` as they are read."""
    import pyarrow as pa  # pyarrow: optional (mmfast[formats]), only for Parquet / Arrow

    columns = _columns(f, schema, features, opts)
    try:
        rows = _read_or_refuse(f, batches)
        return _read_rows(f, root, rows, features, columns, opts.image_folder(f.parent), confine, image_dir)
    except pa.ArrowException as e:  # a damaged value, found while converting a batch that was read
        raise ManifestError(
            f"{f}: the file is corrupt ({_one_line(e)}); re-export it, or remove it from the input"
        ) from e


def _read_or_refuse(f: Path, batches: Iterator) -> Iterator:
    """``batches``, a failure to read the next one (a damaged page or record batch, a file cut short: pyarrow
    raises ArrowInvalid, or OSError for a bad compressed page) raised as a ManifestError naming ``f``. Only
    reading is wrapped: a failure to write the images of a batch (a full disk) stays an OSError."""
    import pyarrow as pa  # pyarrow: optional (mmfast[formats]), only for Parquet / Arrow

    rows = 0
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except (pa.ArrowException, OSError, ValueError) as e:
            where = f" after row {rows}" if rows else ""
            raise ManifestError(
                f"{f}: the file is corrupt: reading it failed{where} ({_one_line(e)}); re-export it, or remove "
                "it from the input"
            ) from e
        rows += batch.num_rows
        yield batch


def _read_rows(
    f: Path,
    root: Path,
    batches: Iterator,
    features: dict,
    columns: Columns,
    folder: Path,
    confine: bool,
    image_dir: Path | None,
) -> tuple[list[Candidate], list[Reject]]:
    """One file's rows; ``folder``: where a relative image path is read from."""
    names = (features.get(columns.label) or {}).get("names") if columns.label else None
    rel = f.relative_to(root).as_posix()
    out_dir = None
    cands, rejects, line = [], [], 0
    wanted = [c for c in (columns.image, columns.text, columns.label) if c is not None]  # text even if optional
    for batch in batches:
        for row in batch.select([c for c in wanted if c in batch.schema.names]).to_pylist():
            line += 1
            image = row[columns.image]
            # The row as rejected.jsonl shows it: JSON values only, no image bytes.
            source = {k: _jsonable(v) for k, v in row.items() if k != columns.image}
            if isinstance(image, dict):
                source[columns.image] = {"path": image.get("path"), "bytes": _size(image.get("bytes"))}
                data, name = image.get("bytes"), image.get("path")
            else:
                source[columns.image] = _size(image)
                data, name = image, None
            label = row[columns.label] if columns.label else None
            if names is not None and isinstance(label, int):
                if not 0 <= label < len(names):
                    why = "no label (-1)" if label == -1 else f"label {label} is not a class of the ClassLabel"
                    rejects.append(Reject(line, f"field '{columns.label}': {why}", source, rel))
                    continue
                label = names[label]
            if data is None and name:
                path = name  # a file on disk, checked like a manifest's path
            elif isinstance(data, bytes | bytearray) and data:
                if image_dir is None:
                    raise ManifestError(f"{f}: images stored as bytes need a folder to be written to")
                if out_dir is None:
                    out_dir = image_dir / _safe(rel)
                    out_dir.mkdir(parents=True, exist_ok=True)
                # Named by content: the rows of one picture share its file (and the split groups them).
                path = str(out_dir / f"{hashlib.sha256(data).hexdigest()[:32]}{_extension(data, name)}")
                written = _write_new(path, data)
            else:
                rejects.append(Reject(line, f"field '{columns.image}' has no image bytes or path", source, rel))
                continue
            checked = {columns.image: path, columns.text: row.get(columns.text)}  # None: optional, read as ""
            if columns.label:
                checked[columns.label] = label
            more = check_rows([(line, checked)], folder, confine and data is None, False, columns, rel)
            for c in more[0]:
                c.source = source
            for r in more[1]:
                r.row = source
                if data is not None and written:  # the bytes written above belong to no sample
                    Path(path).unlink(missing_ok=True)
            cands += more[0]
            rejects += more[1]
    return cands, rejects


def _write_new(path: str, data: bytes) -> bool:
    """Write ``data`` to ``path`` unless an earlier row wrote the same bytes there; True if written now."""
    try:
        with open(path, "xb") as fh:
            fh.write(data)
        return True
    except FileExistsError:
        return False
    except OSError as e:
        if e.filename is None:
            e.filename = path  # a failed write() names no file; the error (a full disk) should
        raise


def _one_line(e: Exception) -> str:
    """pyarrow's message on one line (a thrift error ends in a newline)."""
    return " ".join(str(e).split())


def _jsonable(value: object) -> object:
    if value is None or isinstance(value, str | int | float | bool):
        return value
    if isinstance(value, bytes | bytearray):
        return _size(value)
    return repr(value)[:200]


def _size(data) -> str | None:
    return None if data is None else f"<{len(data)} bytes>"


def _safe(rel: str) -> str:
    return rel.replace("/", "__")


def _extension(data: bytes, name: str | None) -> str:
    """The file suffix for image bytes: from their magic number, else from the path stored with them."""
    for magic, ext in _MAGIC:
        if data.startswith(magic):
            return ext
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return ".webp"
    suffix = Path(name).suffix.lower() if name else ""
    return suffix if suffix in IMAGE_SUFFIXES else ".bin"


PARQUET = Reader("parquet", read_parquet, suffixes=(".parquet",), image_root=True, row_noun="row")
ARROW = Reader("arrow", read_arrow, suffixes=(".arrow",), image_root=True, row_noun="row")
