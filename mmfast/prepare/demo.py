"""The built-in demo dataset: the label needs both the image and the caption.

Each sample draws one of 5 shapes (only in the image) and one of 2 attributes (only in the caption);
label = shape x attribute, 10 classes, drawn uniformly. The image is rendered from (shape, image seed)
alone and the caption from (attribute, caption seed) alone, so an image-only model can reach at most
1/2 accuracy (it cannot tell the attribute) and a text-only model at most 1/5; together, 100%.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np

from mmfast.util.fsutil import atomic_dir, cache_home
from mmfast.util.locks import file_lock

SHAPES = ("circle", "square", "triangle", "cross", "ring")
ATTRIBUTES = ("morning", "evening")
_ATTR_WORDS = {
    "morning": ("morning", "sunrise", "breakfast time", "early day"),
    "evening": ("evening", "sunset", "dinner time", "late day"),
}
_TEMPLATES = (
    "a picture taken in the {w}",
    "snapped at {w} by a friend",
    "photo from the {w} walk",
    "this one was shot around {w}",
    "{w}, a quick sketch",
    "an old drawing made at {w}",
)
DEMO_VERSION = 1


def label_name(shape: str, attribute: str) -> str:
    return f"{shape}_{attribute}"


def single_modality_ceilings() -> dict[str, float]:
    """Best possible accuracy from one modality, from the generator's joint distribution.

    Labels are uniform over SHAPES x ATTRIBUTES; the image determines only the shape, the caption only
    the attribute, so the Bayes-optimal single-modality accuracy is max_label P(label | what it sees).
    """
    return {"image_only": 1.0 / len(ATTRIBUTES), "text_only": 1.0 / len(SHAPES), "both": 1.0}


def render_shape(shape: str, seed: int, size: int = 64) -> np.ndarray:
    """Draw ``shape`` on a random background: (size, size, 3) uint8. Depends only on (shape, seed)."""
    from PIL import Image, ImageDraw  # PIL: only when an image is opened here

    rng = np.random.default_rng(seed)
    bg = rng.integers(0, 256, 3)
    fg = (bg + rng.integers(96, 160, 3)) % 256  # far from the background in every channel
    img = Image.new("RGB", (size, size), tuple(int(c) for c in bg))
    d = ImageDraw.Draw(img)
    r = size * rng.uniform(0.2, 0.3)
    cx, cy = size / 2 + rng.uniform(-0.1, 0.1, 2) * size
    col = tuple(int(c) for c in fg)
    if shape == "circle":
        d.ellipse([cx - r, cy - r, cx + r, cy + r], fill=col)
    elif shape == "ring":
        d.ellipse([cx - r, cy - r, cx + r, cy + r], outline=col, width=max(2, int(r / 3)))
    elif shape == "square":
        d.rectangle([cx - r, cy - r, cx + r, cy + r], fill=col)
    elif shape == "triangle":
        pts = [(cx + r * math.cos(a), cy + r * math.sin(a)) for a in (-math.pi / 2, math.pi / 6, 5 * math.pi / 6)]
        d.polygon(pts, fill=col)
    elif shape == "cross":
        t = r / 3
        d.rectangle([cx - r, cy - t, cx + r, cy + t], fill=col)
        d.rectangle([cx - t, cy - r, cx + t, cy + r], fill=col)
    else:
        raise ValueError(f"unknown shape '{shape}'; choose from {SHAPES}")
    arr = np.asarray(img, dtype=np.int16) + rng.integers(-12, 13, (size, size, 3))
    return np.clip(arr, 0, 255).astype(np.uint8)


def make_caption(attribute: str, seed: int) -> str:
    """A caption that names the attribute and nothing about the shape. Depends only on (attribute, seed)."""
    rng = np.random.default_rng(seed)
    words = _ATTR_WORDS[attribute]
    return _TEMPLATES[rng.integers(len(_TEMPLATES))].format(w=words[rng.integers(len(words))])


def default_cache_dir() -> Path:
    return cache_home()


def demo_dataset(n: int = 2000, seed: int = 0, root: str | os.PathLike | None = None, size: int = 64) -> Path:
    """Generate the demo dataset once (atomically, under a lock) and return its manifest path.

    Args:
        n: number of samples.
        seed: generator seed; (n, seed, size) name the folder, so a second call reuses it.
        root: parent folder (default ``$MMFAST_CACHE`` or ``~/.cache/mmfast``).
        size: image side in pixels.

    Returns:
        path of ``manifest.jsonl`` inside the dataset folder.
    """
    from PIL import Image  # PIL: only when an image is opened here

    root = Path(root) if root is not None else default_cache_dir()
    final = root / f"demo-v{DEMO_VERSION}-n{n}-s{seed}-{size}px"
    manifest = final / "manifest.jsonl"
    with file_lock(root / f".{final.name}.lock"):
        if manifest.exists():
            return manifest
        rng = np.random.default_rng(seed)
        shapes = rng.integers(len(SHAPES), size=n)
        attrs = rng.integers(len(ATTRIBUTES), size=n)
        img_seeds, cap_seeds = rng.integers(2**31, size=(2, n))
        with atomic_dir(final) as tmp:
            (tmp / "images").mkdir()
            rows = []
            for i in range(n):
                shape, attr = SHAPES[shapes[i]], ATTRIBUTES[attrs[i]]
                rel = f"images/{i:05d}.jpg"
                Image.fromarray(render_shape(shape, int(img_seeds[i]), size)).save(tmp / rel, quality=90)
                rows.append(
                    {
                        "image": rel,
                        "text": make_caption(attr, int(cap_seeds[i])),
                        "label": label_name(shape, attr),
                        "shape": shape,
                        "attribute": attr,
                    }
                )
            (tmp / "manifest.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return manifest
