"""Other loaders the benchmarks run beside mmfast's, each built as its own documentation recommends.

SPDL (Meta's thread-based pipeline, ``pip install spdl``) decodes through FFmpeg's shared libraries, which
``pip`` does not bring. On Debian 12 they come from

    apt-get install -y libavutil57 libavcodec59 libavformat59 libavfilter8 libswscale6 libswresample4 libavdevice59

These are comparisons, never dependencies of mmfast: ``pip install mmfast`` installs none of them.
"""

from __future__ import annotations

import random

import torch

from mmfast.data.dataset import PreparedDataset
from mmfast.data.preprocessing import IMAGENET_MEAN, IMAGENET_STD


def spdl_missing() -> str | None:
    """Why the SPDL rows cannot run here, or None when they can."""
    try:
        import spdl.io  # noqa: F401
        import spdl.pipeline  # noqa: F401
    except (ImportError, OSError) as e:  # OSError: the FFmpeg libraries are absent
        return f"spdl is not importable ({e}); pip install spdl and the FFmpeg libraries of bench_loader.py --help"
    return None


class _Shuffled:
    """The prepared train files in a fresh random order each time it is iterated (one epoch each)."""

    def __init__(self, files: list[str]):
        self.files = files

    def __iter__(self):
        return iter(random.sample(self.files, len(self.files)))


def crop_filter(path: str, size: int):
    """(packets, FFmpeg filter) of one sample: torchvision's random resized crop box, the crop scaled to
    ``size`` square (bilinear, as the other rows resize), flipped half the time, RGB out."""
    import spdl.io
    from torchvision.transforms import v2

    packets = spdl.io.demux_image(path)
    shape = torch.empty(1, 1, 1).expand(1, packets.height, packets.width)  # no pixels: only the size
    top, left, h, w = v2.RandomResizedCrop.get_params(shape, [0.08, 1.0], [3 / 4, 4 / 3])
    chain = f"crop={w}:{h}:{left}:{top},scale={size}:{size}:flags=bilinear"
    chain += ",hflip" if random.random() < 0.5 else ""
    return packets, spdl.io.get_video_filter_desc(filter_desc=chain, pix_fmt="rgb24")


def spdl_loader(data, batch_size: int, size: int, threads: int, dtype: torch.dtype):
    """SPDL's image classification pipeline: the file source, each image demuxed, decoded, cropped,
    resized and flipped by FFmpeg in ``threads`` concurrent tasks, the frames batched into one uint8
    buffer, then normalized to ``dtype`` NCHW with torch, ``threads`` batches at once (as
    ``spdl.dataloader.DataLoader`` runs its aggregator). Returns a callable giving one epoch's batches."""
    import spdl.io
    from spdl.pipeline import PipelineBuilder

    files = _Shuffled([r["image"] for r in PreparedDataset(data, verify=False).rows("train")])
    scale = 1 / torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    shift = -torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1) * scale

    def decode(path: str):
        packets, filter_desc = crop_filter(path, size)
        return spdl.io.decode_packets(packets, filter_desc=filter_desc)

    def to_batch(frames):
        images = spdl.io.to_torch(spdl.io.convert_frames(frames)).permute(0, 3, 1, 2)  # (B, 3, H, W) uint8 view
        out = torch.empty(images.shape, dtype=torch.float32)  # NCHW contiguous, as a DataLoader's batch
        return out.copy_(images).mul_(scale).add_(shift).to(dtype)

    def epoch():
        pipeline = (
            PipelineBuilder()
            .add_source(files)
            .pipe(decode, concurrency=threads)
            .aggregate(batch_size, drop_last=True)
            .pipe(to_batch, concurrency=threads)
            .add_sink(3)
            .build(num_threads=threads)
        )
        with pipeline.auto_stop():
            yield from pipeline.get_iterator()

    return epoch
