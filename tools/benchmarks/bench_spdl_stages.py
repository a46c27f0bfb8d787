"""Where SPDL's pipeline spends its time: each stage of one sample, on one thread, beside PIL's.

    python tools/benchmarks/bench_spdl_stages.py [--set photos|small-png] [--n 128] [--repeats 3] [--json OUT]

It times, per image and single-threaded, what the SPDL rows of bench_loader.py do: demux (read + parse),
decode alone, decode with the RGB conversion, decode with one filter string shared by all images (resize,
RGB), and decode with the whole per-sample filter (crop, resize, flip, RGB). Then, per batch, the copy into
one buffer and torch's normalize. PIL's open + decode + RGB and torchvision's crop + resize of the decoded
image, the DataLoader rows' per-sample work, run beside them.
Each figure is the median of ``--repeats`` passes over the same ``--n`` images. Needs spdl (see
bench_loader.py).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from benchlib.data import prepared_photos
from benchlib.peers import crop_filter

from mmfast.data.dataset import PreparedDataset
from mmfast.data.preprocessing import IMAGENET_MEAN, IMAGENET_STD


def per_item_ms(fn, items, repeats: int) -> float:
    """Median over ``repeats`` passes of the mean milliseconds ``fn`` takes per item."""
    passes = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for item in items:
            fn(item)
        passes.append((time.perf_counter() - t0) / len(items) * 1e3)
    return statistics.median(passes)


def stages(files: list[str], size: int, repeats: int) -> dict[str, float]:
    import spdl.io
    from PIL import Image
    from torchvision.transforms import v2

    one = spdl.io.decode_config(decoder_options={"threads": "1"})
    fixed = spdl.io.get_video_filter_desc(filter_desc=f"scale={size}:{size}:flags=bilinear", pix_fmt="rgb24")
    crop = v2.Compose([v2.RandomResizedCrop(size, antialias=True), v2.RandomHorizontalFlip(), v2.PILToTensor()])
    mean, std = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1), torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)

    def batch_ms() -> float:
        """convert_frames + normalize of one batch of 64, per image (convert_frames takes the frames over)."""
        passes = []
        for _ in range(repeats):
            frames = [spdl.io.decode_packets(*crop_filter(f, size)) for f in files[:64]]
            t0 = time.perf_counter()
            images = spdl.io.to_torch(spdl.io.convert_frames(frames)).permute(0, 3, 1, 2)
            torch.empty(images.shape).copy_(images).sub_(mean).div_(std)  # as benchlib.peers.spdl_loader
            passes.append((time.perf_counter() - t0) / len(frames) * 1e3)
        return statistics.median(passes)

    def rgb(path):
        with Image.open(path) as im:
            return im.convert("RGB")

    decoded = [rgb(f) for f in files]
    out = {
        "spdl demux (read + parse)": per_item_ms(spdl.io.demux_image, files, repeats),
        "spdl demux + decode": per_item_ms(
            lambda f: spdl.io.decode_packets(spdl.io.demux_image(f), None), files, repeats
        ),
        "spdl demux + decode + rgb24": per_item_ms(
            lambda f: spdl.io.decode_packets(spdl.io.demux_image(f), "format=pix_fmts=rgb24"), files, repeats
        ),
        "spdl demux + decode + one filter for all (resize + rgb24)": per_item_ms(
            lambda f: spdl.io.decode_packets(spdl.io.demux_image(f), fixed), files, repeats
        ),
        "spdl demux + decode + crop/resize/flip/rgb24 (the row's)": per_item_ms(
            lambda f: spdl.io.decode_packets(*crop_filter(f, size)), files, repeats
        ),
        "the same, decoder threads=1": per_item_ms(
            lambda f: spdl.io.decode_packets(*crop_filter(f, size), decode_config=one), files, repeats
        ),
        "spdl batch: convert_frames + normalize, per image": batch_ms(),
        "PIL open + decode + RGB": per_item_ms(rgb, files, repeats),
        "torchvision crop + resize + flip of the decoded PIL image": per_item_ms(crop, decoded, repeats),
    }
    return out


def main(argv: list[str] | None = None) -> int:
    from mmfast.util.fsutil import atomic_write_json

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--set", default="photos", choices=["photos", "small-png"])
    p.add_argument("--n", type=int, default=128, help="images timed (the first of the built-in set)")
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default="bench_out/bench_spdl_stages.json")
    args = p.parse_args(argv)
    data = prepared_photos(512, kind=args.set)
    files = [r["image"] for r in PreparedDataset(data, verify=False).rows("train")][: args.n]
    per_image = stages(files, args.size, args.repeats)
    for name, ms in per_image.items():
        print(f"{name:<60}{ms:>8.2f} ms")
    atomic_write_json(args.json, {"set": args.set, "images": len(files), "ms_per_image": per_image})
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
