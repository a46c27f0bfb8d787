"""WebDataset export of a prepared dataset: tar shards (image + 4-byte sample id) with DALI index files.

wds/<split>-00000.tar    members <id>.<jpg|png|...> (the original bytes) and <id>.id (int32, little endian)
wds/<split>-00000.idx    DALI's index of the tar (made with DALI's own wds2idx)
wds/<split>.json         shard names and sample counts
"""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path

import numpy as np

from mmfast.fsutil import atomic_write_json

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
    """Write WebDataset shards for every split of a prepared directory; returns {split: info}."""
    from wds2idx import IndexCreator  # ships with DALI

    prepared_dir = Path(prepared_dir)
    out = prepared_dir / "wds"
    out.mkdir(exist_ok=True)
    info = {}
    for split in ("train", "val"):
        rows = [json.loads(ln) for ln in (prepared_dir / f"{split}.jsonl").read_text().splitlines() if ln]
        shards = []
        for k, start in enumerate(range(0, len(rows), shard_size)):
            name = f"{split}-{k:05d}"
            tmp = out / f".{name}.tar.tmp"
            with tarfile.open(tmp, "w") as tar:
                for r in rows[start : start + shard_size]:
                    ext = _EXT.get(Path(r["image"]).suffix.lower())
                    if ext is None:
                        raise ValueError(f"{r['image']}: WebDataset export supports {sorted(set(_EXT.values()))}")
                    key = f"{r['id']:09d}"
                    _add(tar, f"{key}.{ext}", Path(r["image"]).read_bytes())
                    _add(tar, f"{key}.id", np.array([r["id"]], dtype="<i4").tobytes())
            os.replace(tmp, out / f"{name}.tar")
            with IndexCreator(str(out / f"{name}.tar"), str(out / f".{name}.idx.tmp"), verbose=False) as creator:
                creator.create_index()
            os.replace(out / f".{name}.idx.tmp", out / f"{name}.idx")
            shards.append(name)
        info[split] = {"shards": shards, "samples": len(rows)}
        atomic_write_json(out / f"{split}.json", info[split])
    return info


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    ti = tarfile.TarInfo(name)
    ti.size = len(data)
    tar.addfile(ti, io.BytesIO(data))
