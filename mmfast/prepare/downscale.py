"""Downscaled storage (``mmfast-prepare --max-side N``): JPEG copies of the images, no larger than N.

FFCV's ``max_resolution`` trick: decoding is the CPU path's main cost and it grows with the stored pixels,
while a 224 px random crop of an 800x600 photo rarely needs them all. Preparation writes a copy of every
image whose longer side is over N into ``<prepared>/downscaled/``, re-encoded as JPEG at ``quality``, and
the prepared rows point at it (the original path stays in the row's ``original``); images already within N
are used as they are. The loaders read the rows, so nothing else changes. The copies are mmfast's: they live
and die with the prepared directory.

The copy is what the decoder would have shown: EXIF orientation applied (DALI's decoders apply it too), the
pixels as RGB or grayscale (alpha dropped, as the RGB decoders drop it), resized with a Lanczos filter after
libjpeg's DCT-domain downscaling to no less than the target (``Image.draft``).
"""

from __future__ import annotations

import functools
from pathlib import Path

from mmfast.util.pool import map_files

DOWNSCALED_DIR = "downscaled"
_PER_FOLDER = 10_000  # files per subfolder: a flat folder of millions is slow to list
_MODES = {"RGB", "L", "RGBA", "LA", "P", "PA", "CMYK", "YCbCr", "1"}  # 8-bit modes PIL converts exactly


def downscaled_path(root: Path, index: int) -> Path:
    """Where the copy of the ``index``-th accepted image goes under the prepared directory ``root``."""
    return root / DOWNSCALED_DIR / f"{index // _PER_FOLDER:04d}" / f"{index:08d}.jpg"


def downscale_image(job: tuple[str, str], max_side: int, quality: int) -> tuple[str, tuple[int, int] | None]:
    """Write the copy of ``job = (source, destination)``; returns ("", the copy's (height, width)) or (the
    reason it failed, None). The copy carries no EXIF orientation, so its size is the one DALI decodes.

    Called only for images whose longer side is over ``max_side``; 16-bit and float images are kept as
    they are (PIL cannot convert them to 8 bits the way the decoder does), reported as "kept".
    """
    from PIL import Image, ImageOps  # PIL: only when an image is opened here

    src, dst = job
    try:
        with Image.open(src) as im:
            if im.mode not in _MODES:
                return f"kept: {im.mode} pixels", None
            im.draft("RGB", (max_side, max_side))  # JPEG: decode at 1/2, 1/4, 1/8 scale, still >= max_side
            im = ImageOps.exif_transpose(im)
            if im.mode not in ("RGB", "L"):
                im = im.convert("RGB")
            im.thumbnail((max_side, max_side), Image.LANCZOS)
            Path(dst).parent.mkdir(parents=True, exist_ok=True)
            im.save(dst, "JPEG", quality=quality)
            shape = (im.height, im.width)
    except (OSError, ValueError) as e:
        if isinstance(e, OSError) and e.errno is not None:
            raise  # a write error (disk full, permissions): the whole preparation fails and is rolled back
        return f"cannot downscale: {e}", None
    return "", shape


def downscale_images(
    jobs: list[tuple[str, str]], max_side: int, quality: int, workers: int, progress: bool = False
) -> list[tuple[str, tuple[int, int] | None]]:
    """``downscale_image`` for every (source, destination) pair over ``workers`` processes: (the reason, ""
    where the copy was written; the copy's (height, width) or None) in order."""
    work = functools.partial(downscale_image, max_side=max_side, quality=quality)
    return map_files(work, jobs, workers, f"downscaling to {max_side} px", progress)
