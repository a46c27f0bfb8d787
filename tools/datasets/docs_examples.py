"""Write the files the guides' commands name, to try them as written:

    python tools/datasets/docs_examples.py examples && cd examples

Writes captions.jsonl (image, text, label) and images/, pairs.jsonl (image, text), photos/<class>/<name>.jpg,
shards/00000.tar .. 00003.tar (WebDataset: key.jpg, key.txt, key.cls) and query.jpg: 200 generated captioned
pictures and 48 photo-like ones, nothing downloaded. The docs' tests run every page's commands in a copy of
this folder.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script from a checkout


def build_examples(dest: Path) -> Path:
    """The files every guide starts with, built from the project's own generators (nothing downloaded):
    captions.jsonl + images/ (labeled captions), pairs.jsonl (captions only), photos/<class>/<name>.jpg,
    shards/00000.tar .. 00003.tar (WebDataset: key.jpg + key.txt + key.cls), query.jpg."""
    # mmfast and the benchmarks' photos: importable once this checkout is on the path (above)
    from mmfast.prepare.demo import demo_dataset
    from tools.benchmarks.benchlib.data import photo_manifest

    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="docs-examples-") as tmp:
        demo = demo_dataset(n=200, seed=7, root=Path(tmp))
        shutil.copytree(demo.parent / "images", dest / "images")
        rows = [json.loads(ln) for ln in demo.read_text().splitlines()]
        labeled = [{"image": r["image"], "text": r["text"], "label": r["label"]} for r in rows]
        _write_jsonl(dest / "captions.jsonl", labeled)
        _write_jsonl(dest / "pairs.jsonl", [{"image": r["image"], "text": r["text"]} for r in rows])
        shutil.copy(dest / rows[0]["image"], dest / "query.jpg")
        _write_shards(dest / "shards", dest, labeled, n_shards=4)
        photos = photo_manifest(Path(tmp), n=48, width=96, height=72, seed=5)
        for r in (json.loads(ln) for ln in photos.read_text().splitlines()):
            target = dest / "photos" / r["label"] / Path(r["image"]).name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(photos.parent / r["image"], target)
    return dest


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _write_shards(folder: Path, root: Path, rows: list[dict], n_shards: int) -> None:
    """img2dataset's layout: per sample key.jpg, key.txt and key.cls (the label's index among the sorted names)."""
    folder.mkdir()
    classes = sorted({r["label"] for r in rows})
    per = -(-len(rows) // n_shards)
    for s in range(n_shards):
        with tarfile.open(folder / f"{s:05d}.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
            for i, r in enumerate(rows[s * per : (s + 1) * per], start=s * per):
                members = {
                    "jpg": (root / r["image"]).read_bytes(),
                    "txt": r["text"].encode(),
                    "cls": str(classes.index(r["label"])).encode(),
                }
                for ext, data in members.items():
                    info = tarfile.TarInfo(f"{i:06d}.{ext}")
                    info.size, info.mtime, info.mode = len(data), 0, 0o644
                    tar.addfile(info, _Bytes(data))


class _Bytes:
    """A file-like reader over bytes, for tarfile.addfile."""

    def __init__(self, data: bytes):
        self.data, self.pos = data, 0

    def read(self, n: int = -1) -> bytes:
        end = len(self.data) if n < 0 else self.pos + n
        chunk, self.pos = self.data[self.pos : end], min(end, len(self.data))
        return chunk


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="a new folder")
    a = p.parse_args(argv)
    out = Path(a.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        print(f"error: {out} exists and is not an empty folder; pass a new folder", file=sys.stderr)
        return 2
    try:
        build_examples(out)
    except ImportError as e:  # the photos are cut from scikit-image's, a test dependency
        print(f"error: {e.name} is not installed: pip install scikit-image (or mmfast[test])", file=sys.stderr)
        return 2
    print(f"wrote the guides' example files into {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
