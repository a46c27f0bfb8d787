"""Benchmark material made from real photos (scikit-image's sample images), nothing downloaded.

``python tools/benchmarks/benchlib/data.py N`` prepares N photos and prints the prepared directory."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

from mmfast.util.fsutil import atomic_dir
from mmfast.util.locks import file_lock

_PHOTOS = (
    "rocket.jpg",
    "hubble_deep_field.jpg",
    "retina.jpg",
    "chelsea.png",
    "astronaut.png",
    "coffee.png",
    "motorcycle_left.png",
    "immunohistochemistry.png",
    "logo.png",
)


def photo_manifest(
    root: str | os.PathLike, n: int = 512, width: int = 800, height: int = 600, seed: int = 0, fmt: str = "jpg"
) -> Path:
    """Write ``n`` images of width x height cut from real photos (random crops, scales and flips; JPEG at
    quality 90 or PNG, by ``fmt``) and a manifest with captions; returns the manifest path. Reused when it
    already exists."""
    import skimage
    from PIL import Image

    root = Path(root)
    final = root / f"{'photos' if fmt == 'jpg' else fmt}-n{n}-{width}x{height}-s{seed}"
    manifest = final / "manifest.jsonl"
    with file_lock(root / f".{final.name}.lock"):
        if manifest.exists():
            return manifest
        src = [Path(skimage.data_dir) / p for p in _PHOTOS if (Path(skimage.data_dir) / p).exists()]
        photos = [Image.open(p).convert("RGB") for p in src]
        rng = np.random.default_rng(seed)
        with atomic_dir(final) as tmp:
            rows = []
            for i in range(n):
                k = int(rng.integers(len(photos)))
                im = photos[k]
                scale = rng.uniform(0.6, 1.0)
                cw, ch = int(im.width * scale), int(im.height * scale)
                x, y = int(rng.integers(0, im.width - cw + 1)), int(rng.integers(0, im.height - ch + 1))
                out = im.crop((x, y, x + cw, y + ch)).resize((width, height), Image.BICUBIC)
                if rng.random() < 0.5:
                    out = out.transpose(Image.FLIP_LEFT_RIGHT)
                rel = f"{i:05d}.{fmt}"
                out.save(tmp / rel, **({"quality": 90} if fmt == "jpg" else {}))
                rows.append(
                    {
                        "image": rel,
                        "text": f"a photo of {src[k].stem.replace('_', ' ')} number {i}",
                        "label": src[k].stem,
                    }
                )
            (tmp / "manifest.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return manifest


SETS = {  # name: (width, height, format) of the images photo_manifest cuts
    "photos": (800, 600, "jpg"),  # camera-sized JPEGs
    "small-png": (136, 128, "png"),  # icon-sized PNGs (17k pixels, the median of the Oxygen icon set)
}


def prepared_photos(n: int = 512, max_side: int = 0, kind: str = "photos") -> Path:
    """The benchmark images of ``kind`` (a ``SETS`` name), prepared (all in the train split; with
    ``max_side``, downscaled copies) under the mmfast cache folder."""
    from mmfast.prepare.core import PrepareConfig, prepare_dataset
    from mmfast.prepare.demo import default_cache_dir

    width, height, fmt = SETS[kind]
    manifest = photo_manifest(default_cache_dir() / "bench", n, width, height, fmt=fmt)
    name = f"prepared-{kind}-n{n}" + (f"-max{max_side}" if max_side else "")
    out = default_cache_dir() / "bench" / name
    cfg = PrepareConfig(source=str(manifest), out=str(out), val_fraction=0.0, max_side=max_side, progress=False)
    prepare_dataset(cfg)
    return out


if __name__ == "__main__":
    print(prepared_photos(int(sys.argv[1]) if len(sys.argv) > 1 else 512))
