"""WebDataset export of a prepared dataset: self-contained, standard tar shards (readable by the
``webdataset`` library and open_clip) with DALI index files, so training needs none of the original images.

wds/<split>-00000.tar    per sample (key = the sample id, 9 digits): <key>.<jpg|png|...> (the original
                         bytes), <key>.txt (the caption, UTF-8), <key>.cls (the class id, decimal text),
                         <key>.json ({"id", "label": class id, "label_name": the original label,
                         "image": the original path})
wds/<split>-00000.idx    DALI's index of the tar's images (``mmfast.inputs.wds.write_index``: the sample id
                         closes each image's name, which is how the image graph reads it back)
wds/<split>.rows.npy     (N, 2) int64 [sample id, class id]: what the loader reads of the split
wds/<split>.json         {"shards": names, "tars": tar files, "index": index files, "stats": [[size,
                         mtime_ns]] of each tar (a changed tar is refused at start), "samples": N}

``mmfast-prepare --format wds`` writes it inside preparation (under its lock, in its temp directory,
recorded in its fingerprint and ``files`` map); ``write_wds`` adds it to an existing prepared directory.
"""

from __future__ import annotations

import errno
import io
import json
import os
import tarfile
from collections.abc import Callable
from pathlib import Path

from mmfast.data.dataset import WDS_DIR, PreparedDataset
from mmfast.inputs.wds import shard_stats, write_index, write_rows_table
from mmfast.util.commands import PREPARE
from mmfast.util.fsutil import MARKER, OutputDirError, atomic_dir, atomic_write_json
from mmfast.util.locks import file_lock

_EXT = {
    ".jpeg": "jpg",
    ".jpg": "jpg",
    ".png": "png",
    ".bmp": "bmp",
    ".tif": "tif",
    ".tiff": "tif",
    ".webp": "webp",
}


def write_wds(prepared_dir: str | os.PathLike, shard_size: int = 1000) -> dict:
    """Write WebDataset shards for every split of a prepared directory; returns {split: info}.

    ``wds/`` is built in a temp directory and swapped into place (``fsutil.atomic_dir``): a failure or a
    full disk leaves the previous export, if any, as it was.

    Raises:
        OutputDirError: ``prepared_dir`` was not prepared by mmfast.
        ValueError: an image cannot be exported (unsupported extension, unreadable).
    """
    prepared_dir = Path(prepared_dir)
    if not (prepared_dir / MARKER).is_file():
        raise OutputDirError(
            f"{prepared_dir}: not a dataset prepared by mmfast (no {MARKER}); run {PREPARE} first"
        )
    dataset = PreparedDataset(prepared_dir, verify=False)  # its rows and labels; training verifies the rest
    splits = {split: dataset.rows(split) for split in ("train", "val")}
    labels = dataset.labels
    # Everything below a prepared directory is mmfast's, so an existing wds/ may be replaced.
    with (
        file_lock(prepared_dir / ".wds.lock"),
        atomic_dir(prepared_dir / WDS_DIR, "mmfast WebDataset export", replaceable=_real_dir) as out,
    ):
        return export_wds(splits, {v: k for k, v in labels.items()}, out, shard_size)


def export_wds(
    splits: dict[str, list[dict]],
    label_names: dict[int, str],
    out: Path,
    shard_size: int = 1000,
    image_path: Callable[[str], str] = str,
) -> dict:
    """Write the shards of ``splits`` ({split: prepared rows}) into the directory ``out``; returns
    {split: info}. ``label_names``: class id -> original label; ``image_path``: where a row's image is read
    (a prepared directory being built holds images written from the input at their final place)."""
    info = {}
    out.mkdir(exist_ok=True)
    for split, rows in splits.items():
        shards = []
        for k, start in enumerate(range(0, len(rows), shard_size)):
            name = f"{split}-{k:05d}"
            with tarfile.open(out / f"{name}.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
                for r in rows[start : start + shard_size]:
                    key = f"{r['id']:09d}"
                    _add(tar, f"{key}.{_extension(r['image'])}", _read_image(image_path(r["image"])))
                    _add(tar, f"{key}.txt", r["text"].encode("utf-8"))
                    _add(tar, f"{key}.cls", str(r["label"]).encode())
                    meta = {
                        "id": r["id"],
                        "label": r["label"],
                        "label_name": label_names[r["label"]],
                        "image": r["image"],
                    }
                    _add(tar, f"{key}.json", json.dumps(meta, ensure_ascii=False).encode("utf-8"))
            with tarfile.open(out / f"{name}.tar", "r:") as tar:  # the images' data offsets, as written
                images = [ti for ti in tar if ti.isreg() and ti.name.rsplit(".", 1)[-1] in _EXT.values()]
            write_index(
                out / f"{name}.idx",
                [(ti.offset_data, ti.size, ti.name, int(ti.name.split(".")[0])) for ti in images],
            )
            shards.append(name)
        info[split] = {
            "shards": shards,
            "tars": [f"{s}.tar" for s in shards],
            "index": [f"{s}.idx" for s in shards],
            "stats": shard_stats([out / f"{s}.tar" for s in shards]),  # checked by the loader at start
            "samples": len(rows),
        }
        write_rows_table(out / f"{split}.rows.npy", rows)
        atomic_write_json(out / f"{split}.json", info[split])
    return info


def _real_dir(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink()


def _extension(image: str) -> str:
    ext = _EXT.get(Path(image).suffix.lower())
    if ext is None:
        raise ValueError(f"{image}: WebDataset export supports {sorted(set(_EXT.values()))}")
    return ext


def _read_image(image: str) -> bytes:
    try:
        return Path(image).read_bytes()
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.EACCES, errno.EISDIR):
            raise ValueError(
                f"{image}: cannot be read for the WebDataset export ({e.strerror}); restore it or re-run {PREPARE}"
            ) from e
        raise


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    ti = tarfile.TarInfo(name)
    ti.size = len(data)
    tar.addfile(ti, io.BytesIO(data))
