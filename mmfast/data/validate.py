"""Decode every image once before it is accepted.

Two passes: PIL (in a process pool, gives precise reasons: missing, zero size, not an image, truncated)
then DALI's own CPU decoder over the survivors, because DALI aborts a whole pipeline on a single file it
cannot decode: a file is accepted only when the decoder that will read it at train time accepts it.
"""

from __future__ import annotations

import errno
import functools
import io
import os
import re
import stat
import warnings
from dataclasses import dataclass

import numpy as np

from mmfast.util.pool import map_files
from mmfast.util.voice import setting

# PIL format names DALI's CPU decoder reads (libjpeg-turbo, libpng, libtiff, libwebp, OpenJPEG, PNM, BMP).
DALI_FORMATS = {"JPEG", "PNG", "BMP", "TIFF", "WEBP", "PPM", "JPEG2000"}
# Decoded pixels (width x height) allowed per image: the loader decodes whole images, so this bounds its
# memory by construction (64 MP is 192 MB of RGB). A small file can declare a huge image (a 9400x9400 1-bit
# PNG is 11 KB on disk), so the bound is checked from the header, before anything is decoded.
DEFAULT_MAX_PIXELS = 64_000_000


@dataclass
class ImageCheck:
    ok: bool
    reason: str = ""
    width: int = 0
    height: int = 0
    format: str = ""
    decoded: tuple[int, int] | None = None  # (height, width) as DALI's decoder gave it (EXIF orientation applied)


def pixel_budget_reason(path: str | os.PathLike, max_pixels: int = DEFAULT_MAX_PIXELS) -> str:
    """Why an image is over the decoded-pixel budget, read from its header only (nothing is decoded).

    Returns:
        "" when the image fits (or its header cannot be read: that is for the decoders to report), else a
        reason such as "image is 9400x9400 = 88.4 MP, over the 64 MP budget (--max-pixels); downscale it"
        (the budget named as the caller set it: ``voice.setting``).
    """
    from PIL import Image  # PIL: only when an image is opened here

    size = _png_size(path)
    if size is not None:
        return _budget_reason(size[0], size[1], max_pixels)
    try:
        header = image_header(path)
    except Image.DecompressionBombError as e:
        return _bomb_reason(e, max_pixels)
    return _budget_reason(header[0], header[1], max_pixels) if header else ""


def _png_size(path: str | os.PathLike) -> tuple[int, int] | None:
    """(width, height) from a PNG's IHDR chunk, its first 24 bytes (a tenth of PIL's header parse); None for
    anything else (or a file that cannot be read as a regular one)."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return None
        with open(path, "rb") as f:
            head = f.read(24)
    except OSError:
        return None
    if len(head) < 24 or head[:8] != b"\x89PNG\r\n\x1a\n" or head[12:16] != b"IHDR":
        return None
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")


def image_header(path: str | os.PathLike) -> tuple[int, int, str] | None:
    """(width, height, PIL's format name) read from an image's header (nothing is decoded); None when the
    header cannot be read. Raises PIL's ``DecompressionBombError`` past its hard limit; its warning below that
    is silenced (the callers apply their own budget)."""
    from PIL import Image  # PIL: only when an image is opened here

    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # a FIFO would block the open until a writer came
            return None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(path) as im:
                return im.width, im.height, im.format or ""
    except (OSError, ValueError, SyntaxError):
        return None


def _budget_reason(w: int, h: int, max_pixels: int) -> str:
    if w * h <= max_pixels:
        return ""
    return (
        f"image is {w}x{h} = {w * h / 1e6:.1f} MP, over the {max_pixels / 1e6:g} MP budget "
        f"({setting('max_pixels')}); downscale it"
    )


def _bomb_reason(error: Exception, max_pixels: int) -> str:
    """Why an image past PIL's decompression-bomb limit is refused: over the budget when it is (its pixels read
    from PIL's message), else over PIL's limit."""
    found = re.search(r"\((\d+) pixels\)", str(error))
    pixels = int(found.group(1)) if found else 0
    if pixels > max_pixels:
        return (
            f"image is {pixels / 1e6:.1f} MP, over the {max_pixels / 1e6:g} MP budget ({setting('max_pixels')}); "
            "downscale it"
        )
    return f"image is over PIL's decompression-bomb limit ({error}); downscale it"


def check_image(path: str, max_pixels: int = DEFAULT_MAX_PIXELS) -> ImageCheck:
    """Open and fully decode one image with PIL; say why it is unusable if it is.

    Args:
        path: the image file.
        max_pixels: decoded-pixel budget; checked from the header, before decoding.
    """
    return _file_problem(path) or _check_decode(path, max_pixels)[0]


def open_image(path: str | os.PathLike, max_pixels: int = DEFAULT_MAX_PIXELS) -> tuple[object, ImageCheck]:
    """``check_image`` that keeps what it decoded: (the image as an RGB PIL image, its check), or (None, the
    check saying why it is unusable)."""
    problem = _file_problem(path)
    if problem:
        return None, problem
    check, rgb = _check_decode(path, max_pixels, keep=True)
    return rgb, check


def _file_problem(path: str | os.PathLike) -> ImageCheck | None:
    """Why ``path`` is not a file to decode (missing, a directory, a FIFO, empty), or None."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return ImageCheck(False, f"missing file: {path}")  # where it was looked for (relative paths resolved)
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
    return None


def check_image_bytes(data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS) -> ImageCheck:
    """``check_image`` of an image held in memory (a member of a WebDataset shard)."""
    if not data:
        return ImageCheck(False, "zero size image")
    return _check_decode(io.BytesIO(data), max_pixels)[0]


def _check_decode(src, max_pixels: int, keep: bool = False) -> tuple[ImageCheck, object]:
    """Open and fully decode ``src`` (a path or a binary file object) with PIL: (its check, the image as an RGB
    PIL image when ``keep`` and it is usable, else None)."""
    from PIL import Image  # PIL: only when an image is opened here

    rgb = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # the budget below decides
            with Image.open(src) as im:
                fmt = im.format or "?"
                w, h = im.size
                if fmt not in DALI_FORMATS:
                    return ImageCheck(False, f"unsupported image format {fmt}; convert it to JPEG or PNG"), None
                over = _budget_reason(w, h, max_pixels)
                if over:
                    return ImageCheck(False, over), None
                im.load()  # full decode: raises on truncated or corrupt data
                if keep and w >= 1 and h >= 1:
                    rgb = im.convert("RGB")
    except (Image.UnidentifiedImageError, SyntaxError):
        return ImageCheck(False, "not an image (unrecognised content)"), None
    except Image.DecompressionBombError as e:  # PIL's own limit, as it opens: a PNG's size is read directly
        size = _png_size(src) if isinstance(src, str | os.PathLike) else None
        reason = _budget_reason(*size, max_pixels) if size else ""
        return ImageCheck(False, reason or _bomb_reason(e, max_pixels)), None
    except (OSError, ValueError) as e:
        msg = str(e)
        if any(w in msg.lower() for w in ("truncated", "broken data stream", "premature end")):
            return ImageCheck(False, f"truncated image: {msg}"), None
        return ImageCheck(False, f"corrupt image: {msg}"), None
    if w < 1 or h < 1:
        return ImageCheck(False, "image has zero width or height"), None
    return ImageCheck(True, "", w, h, fmt), rgb


def check_images(
    paths: list[str], workers: int, progress: bool = False, max_pixels: int = DEFAULT_MAX_PIXELS
) -> list[ImageCheck]:
    """Check many images with PIL in ``workers`` processes, then confirm survivors with DALI's decoder.

    Args:
        paths: image file paths.
        workers: processes for the PIL pass and threads for the DALI pass.
        progress: show a progress bar.
        max_pixels: decoded-pixel budget per image.

    Returns:
        one ImageCheck per path, in order.
    """
    check = functools.partial(check_image, max_pixels=max_pixels)
    checks = map_files(check, paths, workers, "validating images", progress)
    good = [i for i, c in enumerate(checks) if c.ok]
    shapes: dict[int, tuple[int, int]] = {}
    for i, reason in dali_rejects([paths[i] for i in good], workers, shapes=shapes).items():
        checks[good[i]] = ImageCheck(False, reason)
    for i, shape in shapes.items():
        if checks[good[i]].ok:
            checks[good[i]].decoded = shape
    return checks


def dali_rejects(
    paths: list, threads: int, batch: int = 64, load=None, shapes: dict | None = None
) -> dict[int, str]:
    """Decode ``paths`` with DALI's CPU decoder; return {index: reason} for files it refuses, and put the
    (height, width) of each one decoded in ``shapes`` {index: (height, width)} when given.

    A failing batch is split in halves until the bad file is isolated. A pipeline that failed is not
    reused: the next attempt builds a fresh one. ``load`` turns an entry of ``paths`` into its encoded bytes
    (a uint8 array); the default reads the file.
    """
    load = load or _read_file
    bad: dict[int, str] = {}
    todo = [(s, min(s + batch, len(paths))) for s in range(0, len(paths), batch)][::-1]
    pipe = None
    while todo:
        lo, hi = todo.pop()
        if pipe is None:
            pipe = _decode_pipeline(batch, threads)
        blobs = [load(p) for p in paths[lo:hi]]
        try:
            pipe.feed_input("blobs", blobs)
            (decoded,) = pipe.run()
            if shapes is not None:
                shapes.update({lo + k: (int(s[0]), int(s[1])) for k, s in enumerate(decoded.shape())})
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


def _read_file(path: str) -> np.ndarray:
    return np.fromfile(path, dtype=np.uint8)


def _decode_pipeline(batch: int, threads: int):
    from nvidia.dali import fn, pipeline_def, types  # DALI: only when a DALI graph runs here

    @pipeline_def(batch_size=batch, num_threads=max(1, threads), device_id=None, prefetch_queue_depth=1)
    def _decode():
        data = fn.external_source(name="blobs", dtype=types.UINT8, ndim=1)
        return fn.decoders.image(data, device="cpu", output_type=types.RGB)

    pipe = _decode()
    pipe.build()
    return pipe
