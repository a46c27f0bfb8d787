"""Decode every image once before it is accepted.

Two passes: PIL (in a process pool, gives precise reasons: missing, zero size, not an image, truncated)
then DALI's own CPU decoder over the survivors, because DALI aborts a whole pipeline on a single file it
cannot decode: a file is accepted only when the decoder that will read it at train time accepts it.
"""

from __future__ import annotations

import errno
import multiprocessing
import os
import stat
import warnings
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

# PIL format names DALI's CPU decoder reads (libjpeg-turbo, libpng, libtiff, libwebp, OpenJPEG, PNM, BMP).
DALI_FORMATS = {"JPEG", "PNG", "BMP", "TIFF", "WEBP", "PPM", "JPEG2000"}
MAX_PIXELS = 16384 * 16384


@dataclass
class ImageCheck:
    ok: bool
    reason: str = ""
    width: int = 0
    height: int = 0
    format: str = ""


def check_image(path: str) -> ImageCheck:
    """Open and fully decode one image with PIL; say why it is unusable if it is."""
    from PIL import Image

    try:
        st = os.stat(path)
    except FileNotFoundError:
        return ImageCheck(False, "missing file")
    except OSError as e:
        if e.errno == errno.ELOOP:
            return ImageCheck(False, "symlink loop")
        return ImageCheck(False, f"cannot stat file: {e.strerror}")
    if stat.S_ISDIR(st.st_mode):
        return ImageCheck(False, "path is a directory, not an image file")
    if not stat.S_ISREG(st.st_mode):
        return ImageCheck(False, "not a regular file (device, socket or pipe)")
    if st.st_size == 0:
        return ImageCheck(False, "zero size file")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as im:
                fmt = im.format or "?"
                w, h = im.size
                if fmt not in DALI_FORMATS:
                    return ImageCheck(False, f"unsupported image format {fmt}; convert it to JPEG or PNG")
                if w * h > MAX_PIXELS:
                    return ImageCheck(False, f"image too large ({w}x{h})")
                im.load()  # full decode: raises on truncated or corrupt data
    except (Image.UnidentifiedImageError, SyntaxError):
        return ImageCheck(False, "not an image (unrecognised content)")
    except (OSError, ValueError, Image.DecompressionBombWarning, Image.DecompressionBombError) as e:
        msg = str(e)
        if any(w in msg.lower() for w in ("truncated", "broken data stream", "premature end")):
            return ImageCheck(False, f"truncated image: {msg}")
        return ImageCheck(False, f"corrupt image: {msg}")
    if w < 1 or h < 1:
        return ImageCheck(False, "image has zero width or height")
    return ImageCheck(True, "", w, h, fmt)


def check_images(paths: list[str], workers: int, progress: bool = False) -> list[ImageCheck]:
    """Check many images with PIL in ``workers`` processes, then confirm survivors with DALI's decoder.

    Args:
        paths: image file paths.
        workers: processes for the PIL pass and threads for the DALI pass.
        progress: show a progress bar.

    Returns:
        one ImageCheck per path, in order.
    """
    from tqdm import tqdm

    bar = dict(
        total=len(paths), desc="validating images", unit="img", disable=None if progress else True, leave=False
    )
    if workers > 1 and len(paths) > 64:
        # A daemonic process (a multiprocessing.Pool worker) may not start children: use threads there
        # (PIL releases the GIL while decoding).
        executor = ThreadPoolExecutor if multiprocessing.current_process().daemon else ProcessPoolExecutor
        with executor(workers) as pool:
            chunk = max(1, min(64, len(paths) // (workers * 8)))
            checks = list(tqdm(pool.map(check_image, paths, chunksize=chunk), **bar))
    else:
        checks = [check_image(p) for p in tqdm(paths, **bar)]
    good = [i for i, c in enumerate(checks) if c.ok]
    for i, reason in _dali_rejects([paths[i] for i in good], workers).items():
        checks[good[i]] = ImageCheck(False, reason)
    return checks


def _dali_rejects(paths: list[str], threads: int, batch: int = 64) -> dict[int, str]:
    """Decode ``paths`` with DALI's CPU decoder; return {index: reason} for files it refuses.

    A failing batch is split in halves until the bad file is isolated. A pipeline that failed is not
    reused: the next attempt builds a fresh one.
    """
    bad: dict[int, str] = {}
    todo = [(s, min(s + batch, len(paths))) for s in range(0, len(paths), batch)][::-1]
    pipe = None
    while todo:
        lo, hi = todo.pop()
        if pipe is None:
            pipe = _decode_pipeline(batch, threads)
        blobs = [np.fromfile(p, dtype=np.uint8) for p in paths[lo:hi]]
        try:
            pipe.feed_input("blobs", blobs)
            pipe.run()
            continue
        except RuntimeError as e:  # DALI reports decoder failures as RuntimeError with the decoder's message
            err = str(e) or "decoder error"
            pipe = None
        if hi - lo == 1:
            lines = [ln.strip() for ln in err.splitlines() if ln.strip() and "Critical error" not in ln]
            bad[lo] = f"DALI cannot decode this image: {(lines[0] if lines else err)[:200]}"
        else:
            mid = (lo + hi) // 2
            todo += [(mid, hi), (lo, mid)]
    return bad


def _decode_pipeline(batch: int, threads: int):
    from nvidia.dali import fn, pipeline_def, types

    @pipeline_def(batch_size=batch, num_threads=max(1, threads), device_id=None, prefetch_queue_depth=1)
    def _decode():
        data = fn.external_source(name="blobs", dtype=types.UINT8, ndim=1)
        return fn.decoders.image(data, device="cpu", output_type=types.RGB)

    pipe = _decode()
    pipe.build()
    return pipe
