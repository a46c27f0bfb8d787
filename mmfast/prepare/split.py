"""Which rows go to the validation split: by a hash of each row's image, so the split is stable and grouped.

A row goes to val when the hash of (seed, its image's key) falls under ``val_fraction``. So:

- every caption of one image lands on the same side (COCO's five captions per image, a manifest with
  several rows per picture): no image is both trained on and evaluated on;
- adding rows and preparing again moves no earlier row from one side to the other (each row's side
  depends on its own image only), so an earlier checkpoint is never scored on images it trained on;
- the key is the image's path relative to the input's folder (or image root), so moving the dataset
  keeps its split; an image preparation wrote itself (Parquet bytes, named by content) is keyed by its
  name, a ``--max-side`` copy by its original, an image read in place (a member of a WebDataset shard) by
  its file's name and its member name.

Per label, two corrections keep small classes usable (they are the only rows a change of the class can
move): a class of two or more images with none in val gives its lowest-hash image to val, and a class
with every image in val gives its highest-hash image back to train (a class of one image trains).
"""

from __future__ import annotations

import hashlib
import os
from collections import defaultdict
from collections.abc import Callable

from mmfast.inputs import Member
from mmfast.inputs.manifest import Candidate

_SCALE = float(1 << 64)


def split_rows(
    rows: list[Candidate],
    val_fraction: float,
    seed: int,
    bases: list[str],
    work: str,
    member: Callable[[Candidate], Member] | None = None,
) -> tuple[list[Candidate], list[Candidate]]:
    """(train, val), each in input order.

    Args:
        bases: folders an image key is made relative to, first match wins (the input's folder, image root).
        work: the folder preparation writes images into (their key is their file name).
        member: where an image read in place lies (``ImagesInPlace.member`` of the input's kind); None: the
            images are files.
    """
    if val_fraction <= 0 or not rows:
        return list(rows), []
    keys = [image_key(c, bases, work, member) for c in rows]
    draw = {k: _draw(seed, k) for k in set(keys)}
    in_val = {k: u < val_fraction for k, u in draw.items()}
    by_label: dict[str, set[str]] = defaultdict(set)
    for c, k in zip(rows, keys, strict=True):
        by_label[str(c.label)].add(k)
    for label in sorted(by_label):
        images = sorted(by_label[label], key=lambda k: (draw[k], k))
        chosen = [k for k in images if in_val[k]]
        if not chosen and len(images) >= 2:
            in_val[images[0]] = True
        elif len(chosen) == len(images):
            in_val[images[-1]] = False
    train = [c for c, k in zip(rows, keys, strict=True) if not in_val[k]]
    val = [c for c, k in zip(rows, keys, strict=True) if in_val[k]]
    return train, val


def image_key(
    c: Candidate, bases: list[str], work: str, member: Callable[[Candidate], Member] | None = None
) -> str:
    """The identity of a row's image for the split (see the module's docstring and ``split_rows``)."""
    if member is not None:
        m = member(c)
        return f"{os.path.basename(m.file)}:{m.name}"
    path = c.original or c.image
    if path.startswith(work + os.sep):
        return os.path.basename(path)
    for base in bases:
        if path.startswith(base + os.sep):
            return path[len(base) + 1 :]
    return path


def _draw(seed: int, key: str) -> float:
    """A number in [0, 1) fixed by (seed, key): the same on every machine and Python (no hash randomization)."""
    digest = hashlib.blake2b(f"{seed}\0{key}".encode(errors="surrogateescape"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / _SCALE
