"""Scale of the WebDataset source: a synthetic N-row set of tiny images in img2dataset layout, prepared in
place, then opened by MultimodalLoader: preparation rows/s, the time to the first batch and the loader's
extra resident memory.

    python tools/benchmarks/bench_wds_scale.py [--rows 1000000] [--per-shard 10000] [--side 16] [--workers N]
        [--batch-size 256] [--parts P] [--dir DIR] [--json OUT]

With --parts P the preparation runs as P processes (``mmfast-prepare --shard I/P``, --workers split among
them) started together, then ``--merge``: the multi-process / multi-machine path, timed as a whole.

The images are --side x --side JPEGs cut from scikit-image's photos (a few hundred distinct crops, so the
shards stay small; each sample is still read, decoded and checked on its own), each with a unique caption
and a .cls label out of 10. The loader is timed in a fresh process (its RSS before opening the split and
after the first batch), as a training run would start.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

_PROBE = r"""
import json, sys, time
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
def peak():  # VmHWM: this program's peak (ru_maxrss would carry the parent's over exec)
    line = next(ln for ln in open("/proc/self/status") if ln.startswith("VmHWM"))
    return int(line.split()[1]) * 1024
import torch  # noqa: F401  (imports are not the loader's memory)
from mmfast.loading.multimodal import MultimodalLoader
r0, t0 = rss(), time.perf_counter()
loader = MultimodalLoader(sys.argv[1], "train", int(sys.argv[2]), size=32, num_workers=int(sys.argv[3]))
t_open = time.perf_counter() - t0
batch = next(iter(loader))
t_first = time.perf_counter() - t0
print(json.dumps({"open_s": t_open, "first_batch_s": t_first, "extra_rss_bytes": rss() - r0,
                  "peak_rss_bytes": peak(),
                  "batch": list(batch["image"].shape), "samples": len(loader.files)}))
"""


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--per-shard", type=int, default=10_000)
    p.add_argument("--side", type=int, default=16)
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--parts", type=int, default=1, help="prepare as this many --shard processes + --merge")
    p.add_argument("--dir", help="working directory (default: a temporary one, removed at the end)")
    p.add_argument("--json", default="bench_out/bench_wds_scale.json")
    return p.parse_args(argv)


def tiny_jpegs(side: int, n: int = 256) -> list[bytes]:
    import numpy as np
    import skimage
    from PIL import Image

    rng = np.random.default_rng(0)
    photos = [
        Image.open(Path(skimage.data_dir) / f).convert("RGB") for f in ("rocket.jpg", "chelsea.png", "coffee.png")
    ]
    out = []
    for k in range(n):
        im = photos[k % len(photos)]
        x, y = rng.integers(0, im.width - 64), rng.integers(0, im.height - 64)
        buf = io.BytesIO()
        im.crop((x, y, x + 64, y + 64)).resize((side, side)).save(buf, "JPEG", quality=85)
        out.append(buf.getvalue())
    return out


def write_shards(folder: Path, rows: int, per_shard: int, side: int, captions: list[str] | None = None) -> float:
    """Shards of ``rows`` tiny JPEGs; row i's caption is ``captions[i % len]`` numbered i, or a made-up one."""
    images = tiny_jpegs(side)
    t0 = time.perf_counter()
    for s in range(0, rows, per_shard):
        with tarfile.open(folder / f"{s // per_shard:05d}.tar", "w") as tar:
            for i in range(s, min(rows, s + per_shard)):
                for name, blob in (
                    (f"{i:09d}.jpg", images[i % len(images)]),
                    (f"{i:09d}.txt", _caption(i, captions).encode()),
                    (f"{i:09d}.cls", str(i % 10).encode()),
                ):
                    info = tarfile.TarInfo(name)
                    info.size = len(blob)
                    tar.addfile(info, io.BytesIO(blob))
    return time.perf_counter() - t0


def _caption(i: int, captions: list[str] | None) -> str:
    return (
        f"{captions[i % len(captions)]} (picture {i})"
        if captions
        else f"tiny picture number {i} of class {i % 10}"
    )


def _run_parts(shards: Path, out: Path, args) -> float:
    """The --shard I/P processes, started together; their wall time."""
    t0 = time.perf_counter()
    workers = max(1, args.workers // args.parts)
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "mmfast.cli.prepare", str(shards), "--out", str(out)]
            + ["--shard", f"{i}/{args.parts}", "--workers", str(workers)]
            + ["--val-fraction", "0.01", "--no-progress"],
            stdout=subprocess.DEVNULL,
        )
        for i in range(args.parts)
    ]
    if any(p.wait() for p in procs):
        raise SystemExit("a --shard process failed")
    return time.perf_counter() - t0


def _peak_rss() -> int:
    """This process's peak resident memory so far (VmHWM), bytes."""
    line = next(ln for ln in open("/proc/self/status") if ln.startswith("VmHWM"))
    return int(line.split()[1]) * 1024


def main(argv=None) -> int:
    from mmfast.prepare.core import PrepareConfig, prepare_dataset
    from mmfast.util.fsutil import atomic_write_json

    args = parse_args(argv)
    tmp = None if args.dir else tempfile.TemporaryDirectory(prefix="bench_wds_scale_")
    root = Path(args.dir or tmp.name)
    shards = root / "shards"
    if not shards.is_dir():
        shards.mkdir(parents=True)
        t_write = write_shards(shards, args.rows, args.per_shard, args.side)
        print(f"wrote {args.rows} samples in {t_write:.1f} s", file=sys.stderr)
    out = root / "prepared"
    t0 = time.perf_counter()
    t_parts = _run_parts(shards, out, args) if args.parts > 1 else 0.0
    summary = prepare_dataset(
        PrepareConfig(
            str(shards), str(out), workers=args.workers, val_fraction=0.01, progress=False, merge=args.parts > 1
        )
    )
    t_prep = time.perf_counter() - t0
    probe = subprocess.run(
        [sys.executable, "-c", _PROBE, str(out), str(args.batch_size), str(args.workers)],
        capture_output=True,
        text=True,
        check=True,
    )
    load = json.loads(probe.stdout.strip().splitlines()[-1])
    report = {
        "rows": args.rows,
        "side": args.side,
        "workers": args.workers,
        "cpu_count": os.cpu_count(),
        "prepare_s": t_prep,
        "prepare_rows_per_s": args.rows / t_prep,
        "prepare_rows_per_s_per_core": args.rows / t_prep / args.workers,
        "prepare_timings_s": summary["timings_s"],
        "prepare_peak_rss_bytes": _peak_rss(),  # the preparation runs in this process (the parts: in theirs)
        "parts": args.parts,
        "parts_s": t_parts,
        "load": load,
    }
    print(f"{'rows':<28}{args.rows:>14,}")
    print(f"{'prepare':<28}{t_prep:>12.1f} s  ({report['prepare_rows_per_s']:.0f} rows/s, {args.workers} workers)")
    print(f"{'prepare: peak RSS':<28}{report['prepare_peak_rss_bytes'] / 2**20:>12.0f} MiB (this process)")
    if args.parts > 1:
        print(f"{'  of which the parts':<28}{t_parts:>12.1f} s  ({args.parts} processes)")
    print(f"{'loader: open':<28}{load['open_s']:>12.1f} s")
    print(f"{'loader: first batch':<28}{load['first_batch_s']:>12.1f} s")
    print(f"{'loader: extra RSS':<28}{load['extra_rss_bytes'] / 2**20:>12.0f} MiB")
    atomic_write_json(args.json, report)
    print(f"wrote {args.json}")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
