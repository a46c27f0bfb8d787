"""Per-image cost of each stage of the CPU image path, one thread each, against PIL's decode.

    python tools/benchmarks/bench_stages.py [--data PREPARED_DIR | --set photos|small-png] [--size 224]
        [--rounds 3] [--json OUT]

Stages, timed over the same train split in turns (best and median of ``--rounds``): DALI's fused ROI decode +
random crop (1 DALI thread, the crops handed over as they are), the host finishing of those crops
(``HostFinisher``: resize + flip + normalize to float16), the antialiased resize alone, and PIL's full decode
(``Image.open(...).convert("RGB")``, in process). ``host_finish.FINISH_SHARE`` comes from these figures.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from mmfast.data.dataset import PreparedDataset
from mmfast.loading.sources import read_files


def parse_args(argv: list[str] | None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", help="prepared dataset directory (default: the built-in --set)")
    p.add_argument("--set", default="photos", choices=["photos", "small-png"])
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default="bench_out/bench_stages.json")
    return p.parse_args(argv)


def time_stages(stages: dict, rounds: int) -> dict[str, list[float]]:
    """{stage: its ms per image in each round}; ``stages``: {name: (run, images it handles)}, taking turns."""
    times: dict[str, list[float]] = {k: [] for k in stages}
    for _ in range(rounds):
        for name, (run, n) in stages.items():
            t0 = time.perf_counter()
            run()
            times[name].append((time.perf_counter() - t0) / n * 1e3)
    return times


def main(argv: list[str] | None = None) -> int:
    from benchlib.data import prepared_photos
    from nvidia.dali.plugin.pytorch import LastBatchPolicy
    from PIL import Image

    from mmfast.data.preprocessing import IMAGENET_MEAN, IMAGENET_STD
    from mmfast.loading.graphs import image_pipeline
    from mmfast.loading.host_finish import HostFinisher, ragged_iterator
    from mmfast.util.fsutil import atomic_write_json

    args = parse_args(argv)
    data = Path(args.data) if args.data else prepared_photos(512, kind=args.set)
    rows = PreparedDataset(data, verify=False).rows("train")
    files, batch = [r["image"] for r in rows], 64
    pipe = image_pipeline(
        read=functools.partial(read_files, files, [r["id"] for r in rows]),
        train=True,
        size=args.size,
        finish_on_host=True,
        batch_size=batch,
        num_threads=1,
        device_id=None,
        seed=0,
    )
    it = ragged_iterator(pipe, reader_name="Reader", auto_reset=True, last_batch_policy=LastBatchPolicy.DROP)
    crops = [{"crops": [c.clone() for c in o[0]["crops"]], "flips": o[0]["flips"].clone()} for o in it]
    torch.set_num_threads(1)
    finisher = HostFinisher(args.size, IMAGENET_MEAN, IMAGENET_STD, fp16=True)
    size = (args.size, args.size)

    def decode():
        for _ in it:
            pass

    def finish():
        for b in crops:
            finisher.finish(b)

    def resize():
        for b in crops:
            for c in b["crops"]:
                F.interpolate(c.permute(2, 0, 1).unsqueeze(0), size=size, mode="bilinear", antialias=True)

    def pil():
        for f in files:
            np.asarray(Image.open(f).convert("RGB"))

    n_crops = len(crops) * batch
    stages = {
        "DALI ROI decode + crop": (decode, n_crops),
        "host finishing": (finish, n_crops),
        "antialiased resize alone": (resize, n_crops),
        "PIL full decode": (pil, len(files)),
    }
    times = time_stages(stages, args.rounds)
    pixels = [c.shape[0] * c.shape[1] for b in crops for c in b["crops"]]
    print(f"{data}: {len(files)} images, crop pixels median {statistics.median(pixels):.0f}")
    print(f"{'stage (1 thread)':<28}{'best ms/img':>12}{'median':>10}")
    results = {}
    for name, t in times.items():
        results[name] = {"ms_per_image_best": min(t), "ms_per_image_median": statistics.median(t)}
        print(f"{name:<28}{min(t):>12.3f}{statistics.median(t):>10.3f}")
    dec, fin = results["DALI ROI decode + crop"], results["host finishing"]
    share = fin["ms_per_image_best"] / (dec["ms_per_image_best"] + fin["ms_per_image_best"])
    print(f"finishing share of the work: {share:.2f}")
    atomic_write_json(args.json, {"data": str(data), "size": args.size, "results": results, "finish_share": share})
    return 0


if __name__ == "__main__":
    sys.exit(main())
