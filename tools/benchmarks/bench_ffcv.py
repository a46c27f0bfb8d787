"""FFCV's loader on a prepared dataset's train split, for tools/benchmarks/bench_loader.py's comparison rows.

    FFCV_PYTHON tools/benchmarks/bench_ffcv.py --data PREPARED_DIR [--max-side N] [--epochs 3] [--batch-size 64]
        [--size 224] [--threads T] [--serve]

Runs in a venv of its own (FFCV is a benchmark comparison, never a dependency of mmfast); it imports
nothing from mmfast. Building that venv on the 2-core VM (Ubuntu, Python 3.11):

    apt-get install pkg-config libturbojpeg0-dev libopencv-dev
    python3.11 -m venv ffcv-venv
    ffcv-venv/bin/pip install torch torchvision numpy numba opencv-python-headless pillow \\
        terminaltables psutil tqdm fastargs assertpy pandas
    ffcv-venv/bin/pip install ffcv==1.0.2 --no-deps --no-build-isolation

The .beton is written once beside the prepared directory (JPEG at quality 90, FFCV's ``write_mode="jpg"``;
``--max-side``: FFCV's ``max_resolution``), then each run times one warm-up epoch (numba compiles the
pipeline) and ``--epochs`` epochs of the same augmentation as the other rows: random resized crop, flip,
normalize to float16 NCHW on the CPU. Prints one JSON line: {"images_per_s": [...]}. With ``--serve`` it
keeps its loader (numba's compilation takes a minute) and answers each line ``N`` read from stdin with one
warm-up and N timed epochs, one JSON line each: how bench_loader.py interleaves it with the other rows.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

MEAN = np.array([0.485, 0.456, 0.406]) * 255
STD = np.array([0.229, 0.224, 0.225]) * 255


class _Rows:
    """The split's rows as FFCV's writer reads an indexed dataset: (RGB PIL image, label)."""

    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        from PIL import Image

        with Image.open(self.rows[i]["image"]) as im:
            return im.convert("RGB"), int(self.rows[i]["label"])


def write_beton(data: Path, max_side: int, threads: int) -> Path:
    from ffcv.fields import IntField, RGBImageField
    from ffcv.writer import DatasetWriter

    beton = data.parent / f"{data.name}.ffcv-q90-max{max_side or 'none'}.beton"
    if beton.exists():
        return beton
    # the split read by hand, not through mmfast's PreparedDataset: this script runs in FFCV's venv, without mmfast
    rows = [json.loads(ln) for ln in (data / "train.jsonl").read_text().splitlines() if ln]
    for r in rows:  # an image the prepared directory holds is named relative to it
        r["image"] = str(data / r["image"])  # (an absolute path stays as it is)
    tmp = beton.with_suffix(f".tmp{os.getpid()}")
    fields = {
        "image": RGBImageField(write_mode="jpg", max_resolution=max_side or None, jpeg_quality=90),
        "label": IntField(),
    }
    DatasetWriter(str(tmp), fields, num_workers=threads).from_indexed_dataset(_Rows(rows))
    os.replace(tmp, beton)
    return beton


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True)
    p.add_argument("--max-side", type=int, default=0)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--serve", action="store_true", help="answer epoch counts read from stdin (see above)")
    args = p.parse_args(argv)
    from ffcv.fields.decoders import IntDecoder, RandomResizedCropRGBImageDecoder
    from ffcv.loader import Loader, OrderOption
    from ffcv.transforms import NormalizeImage, RandomHorizontalFlip, Squeeze, ToTensor, ToTorchImage

    beton = write_beton(Path(args.data), args.max_side, args.threads)
    # Normalize before ToTensor: in FFCV 1.0.2 a jitted stage after a non-jitted one (ToTensor) sends
    # Graph.group_operations into an endless loop. On the CPU this is also FFCV's fastest order; ToTorchImage
    # then gives an NCHW view of the NHWC batch (channels-last strides, no copy: the other rows write NCHW).
    image = [
        RandomResizedCropRGBImageDecoder((args.size, args.size)),
        RandomHorizontalFlip(),
        NormalizeImage(MEAN, STD, np.float16),
        ToTensor(),
        ToTorchImage(),
    ]
    loader = Loader(
        str(beton),
        batch_size=args.batch_size,
        num_workers=args.threads,
        order=OrderOption.RANDOM,
        drop_last=True,
        pipelines={"image": image, "label": [IntDecoder(), ToTensor(), Squeeze()]},
    )
    requests = (int(line) for line in sys.stdin) if args.serve else [args.epochs]
    for epochs in requests:
        rates = []
        for epoch in range(epochs + 1):
            n, t0 = 0, time.perf_counter()
            for images, _ in loader:
                n += images.shape[0]
            if epoch:
                rates.append(n / (time.perf_counter() - t0))
        assert images.dtype.itemsize == 2 and images.shape[1:] == (3, args.size, args.size), images.shape
        print(json.dumps({"images_per_s": rates}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
