"""WebDataset export of a prepared dataset: tar shards (image + 4-byte sample id) with DALI index files.

wds/<split>-00000.tar    members <id>.<jpg|png|...> (the original bytes) and <id>.id (int32, little endian)
wds/<split>-00000.idx    DALI's index of the tar (made with DALI's own wds2idx)
wds/<split>.json         shard names and sample counts
"""

from __future__ import annotations

import errno
import io
import json
import os
import tarfile
from pathlib import Path

import numpy as np

from mmfast.fsutil import MARKER, OutputDirError, atomic_dir, atomic_write_json, file_lock

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
    from wds2idx import IndexCreator  # ships with DALI

    prepared_dir = Path(prepared_dir)
    if not (prepared_dir / MARKER).is_file():
        raise OutputDirError(
            f"{prepared_dir}: not a dataset prepared by mmfast (no {MARKER}); run tools/prepare_data.py first"
        )
    info = {}
    # Everything below a prepared directory is mmfast's, so an existing wds/ may be replaced.
    with (
        file_lock(prepared_dir / ".wds.lock"),
        atomic_dir(prepared_dir / "wds", "mmfast WebDataset export", replaceable=_real_dir) as out,
    ):
        for split in ("train", "val"):
            rows = [json.loads(ln) for ln in (prepared_dir / f"{split}.jsonl").read_text().splitlines() if ln]
            shards = []
            for k, start in enumerate(range(0, len(rows), shard_size)):
                name = f"{split}-{k:05d}"
                with tarfile.open(out / f"{name}.tar", "w") as tar:
                    for r in rows[start : start + shard_size]:
                        key = f"{r['id']:09d}"
                        _add(tar, f"{key}.{_extension(r['image'])}", _read_image(r["image"]))
                        _add(tar, f"{key}.id", np.array([r["id"]], dtype="<i4").tobytes())
                with IndexCreator(str(out / f"{name}.tar"), str(out / f"{name}.idx"), verbose=False) as creator:
                    creator.create_index()
                shards.append(name)
            info[split] = {"shards": shards, "samples": len(rows)}
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
                f"{image}: cannot be read for the WebDataset export ({e.strerror}); restore it or re-run "
                "tools/prepare_data.py"
            ) from e
        raise


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    ti = tarfile.TarInfo(name)
    ti.size = len(data)
    tar.addfile(ti, io.BytesIO(data))
