"""Image pipelines: read -> decode (+ random crop) -> resize -> flip/jitter -> normalize to NCHW.

A source's reader (``mmfast.loading.sources``: each source builds its own DALI reader) followed by one processing
function shared by all of them (``process_images``), as DALI's own ResNet-50 example shares its processing
between readers.

One graph for CPU and GPU: ``decode_device`` is "mixed" (nvJPEG / hardware decoder, output on the GPU)
or "cpu" (libjpeg-turbo threads); the later operators follow the decoder's output. Every reader has
``name="Reader"`` so iterators can use ``reader_name``.
"""

from __future__ import annotations

from collections.abc import Callable

import nvidia.dali.math as dmath
from nvidia.dali import fn, pipeline_def, types
from nvidia.dali.pipeline import Pipeline

from mmfast.data.preprocessing import EVAL_CROP_RATIO, IMAGENET_MEAN, IMAGENET_STD
from mmfast.loading.draws import AREA, BRIGHTNESS, CONTRAST, FLIP, RATIO, SATURATION, DrawFeed, X, Y, crop_window

READER_NAME = "Reader"
# The largest batch DALI 2.4's image decoder parses on one thread. From 32 samples on it parses a batch on
# several, and a file it cannot parse there (a text file named .jpg, a header zeroed out) crashed the process
# (SIGSEGV in ImageDecoder's setup) in many runs instead of raising an error the loader can handle.
# So on the CPU, ImageLoader (files nobody decoded before) runs its graph on equal parts of its batch no larger
# until every file has been read once (``image_loader.dali_batch_size``), and ``cache_decoded`` fills in
# smaller batches.
DALI_SAFE_BATCH = 31
_INTERP = {"bilinear": types.INTERP_LINEAR, "bicubic": types.INTERP_CUBIC}  # the resizes a loader offers


def _decoder_kwargs(decode_device: str, hw_decoder_load: float, memory_padding: int, size_hint: int) -> dict:
    """GPU-only decoder knobs; the CPU decoder takes none of them."""
    if decode_device != "mixed":
        return {}
    return {
        "hw_decoder_load": hw_decoder_load,  # share of JPEGs sent to the A100/H100 hardware decoder
        "device_memory_padding": memory_padding,  # avoid re-allocations as image sizes vary
        "host_memory_padding": memory_padding,
        "preallocate_width_hint": size_hint,
        "preallocate_height_hint": size_hint,
    }


def _random_crop(encoded, draws: DrawFeed | None, scale, ratio, decode_device: str, dec: dict) -> tuple:
    """(the decoded random resized crops, the flip coins (B,) int32, three jitter uniforms in [0, 1)), decoding
    only the crop's region (ROI decoding): with ``draws``, every draw a function of (seed, epoch, sample id)
    (``mmfast.loading.draws``; the crop's window drawn on the host when ``draws`` knows the images' sizes, else
    computed here from the image's header); without, DALI's random operators."""
    if draws is None:  # a reader that orders itself (WebDataset)
        images = fn.decoders.image_random_crop(
            encoded, device=decode_device, output_type=types.RGB, random_area=list(scale),
            random_aspect_ratio=list(ratio), num_attempts=10, **dec,
        )  # fmt: skip
        coin = fn.random.coin_flip(probability=0.5, dtype=types.INT32)
        return images, coin, [fn.random.uniform(range=[0.0, 1.0]) for _ in range(3)]
    draws.batch_size = int(Pipeline.current().max_batch_size)
    if draws.shapes is not None:  # the windows drawn on the host from the images' known sizes
        draws.scale, draws.ratio = tuple(scale), tuple(ratio)
        u, anchor, extent = fn.external_source(
            source=draws, num_outputs=3, batch=True, batch_info=True, dtype=[types.FLOAT, types.INT32, types.INT32]
        )  # fmt: skip
        images = fn.decoders.image_slice(
            encoded, anchor, extent, device=decode_device, output_type=types.RGB, axis_names="WH", **dec
        )  # fmt: skip
        return images, fn.cast(u[FLIP] < 0.5, dtype=types.INT32), [u[BRIGHTNESS], u[CONTRAST], u[SATURATION]]
    u = fn.external_source(source=draws, batch=True, batch_info=True, dtype=types.FLOAT)
    shape = fn.peek_image_shape(encoded, dtype=types.FLOAT)  # (H, W, C)
    left, top, width, height = crop_window(u[AREA], u[RATIO], u[X], u[Y], shape[0], shape[1], scale, ratio, dmath)
    images = fn.decoders.image_slice(
        encoded, fn.stack(left, top), fn.stack(width, height), device=decode_device, output_type=types.RGB,
        normalized_anchor=True, normalized_shape=True, axis_names="WH", **dec,
    )  # fmt: skip
    coin = fn.cast(u[FLIP] < 0.5, dtype=types.INT32)
    return images, coin, [u[BRIGHTNESS], u[CONTRAST], u[SATURATION]]


def process_images(
    encoded,
    *,
    train: bool,
    size: int,
    decode_device: str = "cpu",
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
    flip: bool = True,
    color_jitter: float = 0.0,
    crop_ratio: float = EVAL_CROP_RATIO,
    resize_mode: str = "shortest",
    interpolation: str = "bilinear",
    fp16: bool = True,
    mean: tuple[float, float, float] = IMAGENET_MEAN,
    std: tuple[float, float, float] = IMAGENET_STD,
    hw_decoder_load: float = 0.65,
    memory_padding: int = 64 << 20,
    size_hint: int = 1024,
    finish_on_host: bool = False,
    draws: DrawFeed | None = None,
):
    """The processing shared by every source: decode (+ random crop) -> resize -> flip/jitter -> normalize.

    Args: as ``image_pipeline``'s.

    Returns:
        images (B, 3, size, size) normalized; with ``finish_on_host``: (images (B x (h, w, 3) uint8, ragged),
        flip draws (B,) int32).
    """
    dec = _decoder_kwargs(decode_device, hw_decoder_load, memory_padding, size_hint)
    interp = _INTERP[interpolation]
    mirror = 0
    if train:
        images, coin, jitter = _random_crop(encoded, draws, scale, ratio, decode_device, dec)
        if not finish_on_host:
            images = fn.resize(images, resize_x=size, resize_y=size, antialias=True, interp_type=interp)
        if flip:
            mirror = coin
        if color_jitter > 0:
            # per-pixel ops: on the host path they run on the crop, before the resize
            lo, width_j = 1.0 - color_jitter, 2 * color_jitter
            b, c, sat = (lo + width_j * j for j in jitter)
            images = fn.color_twist(images, brightness=b, contrast=c, saturation=sat)
        crop = None
        if finish_on_host:
            return images, mirror if flip else fn.random.coin_flip(probability=0.0, dtype=types.INT32)
    else:
        images = fn.decoders.image(encoded, device=decode_device, output_type=types.RGB, **dec)
        if finish_on_host:
            return images, fn.random.coin_flip(probability=0.0, dtype=types.INT32)
        if resize_mode == "squash":
            images = fn.resize(images, resize_x=size, resize_y=size, antialias=True, interp_type=interp)
            crop = None
        else:
            images = fn.resize(images, resize_shorter=round(size / crop_ratio), antialias=True, interp_type=interp)
            crop = (size, size)
    return fn.crop_mirror_normalize(
        images,
        dtype=types.FLOAT16 if fp16 else types.FLOAT,
        output_layout="CHW",
        crop=crop,
        mean=list(mean),
        std=list(std),
        mirror=mirror,
    )


@pipeline_def
def image_pipeline(
    *,
    read: Callable[[], tuple],
    train: bool,
    size: int,
    decode_device: str = "cpu",
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
    flip: bool = True,
    color_jitter: float = 0.0,
    crop_ratio: float = EVAL_CROP_RATIO,
    resize_mode: str = "shortest",
    interpolation: str = "bilinear",
    fp16: bool = True,
    mean: tuple[float, float, float] = IMAGENET_MEAN,
    std: tuple[float, float, float] = IMAGENET_STD,
    hw_decoder_load: float = 0.65,
    memory_padding: int = 64 << 20,
    size_hint: int = 1024,
    finish_on_host: bool = False,
    draws: DrawFeed | None = None,
):
    """The image graph: a source's reader followed by ``process_images``.

    Args:
        read: builds the reader's nodes and returns (encoded images (B,), sample ids (B, 1) int32): a source's
            ``reader(...)`` (``mmfast.loading.sources``), e.g. ``functools.partial(read_files, files, ids)``. Every
            reader is named ``READER_NAME``.
        train: random resized crop + flip (+ jitter) if True; resize shorter side + center crop otherwise.
        size: output side in pixels.
        decode_device: "mixed" on a GPU, "cpu" otherwise.
        scale, ratio: area fraction and aspect-ratio ranges of the random crop.
        color_jitter: strength of brightness/contrast/saturation jitter (0: off).
        crop_ratio: eval center crop = size, after resizing the shorter side to size / crop_ratio.
        resize_mode: eval: "shortest" (resize + centre crop, as above) or "squash" (the whole picture resized to
            size x size).
        interpolation: the resize's filter, "bilinear" or "bicubic" (antialiased either way).
        fp16: emit float16 (else float32).
        hw_decoder_load, memory_padding, size_hint: GPU decoder knobs.
        finish_on_host: stop after the decode (train: of the random crop, + jitter) and return the decoded
            images with the flip draws; ``mmfast.loading.host_finish`` resizes (eval: and centre-crops), flips and
            normalizes them (the fast way on the CPU, where DALI's resize and normalize cost more than the
            decode).
        draws: train: the per-sample draws of the reader's samples, batch by batch (``DrawFeed``: the crop,
            flip and jitter of a sample depend on (seed, epoch, id) only); None: DALI's random operators.

    Returns:
        images (B, 3, size, size) normalized, and sample ids (B, 1) int32; with ``finish_on_host``:
        images (B x (h, w, 3) uint8, ragged), flip draws (B,) int32 and sample ids (B, 1) int32.
    """
    encoded, sample_ids = read()
    processed = process_images(
        encoded,
        train=train,
        size=size,
        decode_device=decode_device,
        scale=scale,
        ratio=ratio,
        flip=flip,
        color_jitter=color_jitter,
        crop_ratio=crop_ratio,
        resize_mode=resize_mode,
        interpolation=interpolation,
        fp16=fp16,
        mean=mean,
        std=std,
        hw_decoder_load=hw_decoder_load,
        memory_padding=memory_padding,
        size_hint=size_hint,
        finish_on_host=finish_on_host,
        draws=draws,
    )
    if finish_on_host:  # (images, flips)
        return (*processed, sample_ids)
    return processed, sample_ids


@pipeline_def
def decode_pipeline(*, read: Callable[[], tuple]):
    """Whole images decoded on the CPU, as they are (``mmfast.loading.decoded`` keeps them for ``cache_decoded``).

    Args:
        read: a source's reader, as for ``image_pipeline``.

    Returns:
        images (B x (h, w, 3) uint8, ragged) and the reader's labels (B, 1) int32.
    """
    encoded, labels = read()
    return fn.decoders.image(encoded, device="cpu", output_type=types.RGB), labels
