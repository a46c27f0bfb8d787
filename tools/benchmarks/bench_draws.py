"""What drawing each sample's augmentation from (seed, epoch, id) costs the DALI graph: the train graph with the
per-sample draws (``mmfast.loading.draws``: an external source of the draws and a slice decode, the crop window
computed in the graph from the image header, or drawn on the host from the sizes preparation recorded with
torchvision's redraws) against the same graph with DALI's own random operators (``random_crop`` decode,
``coin_flip``), on the same files, in one interleaved run.

    python tools/benchmarks/bench_draws.py [--n 512] [--batch-size 64] [--size 224] [--rounds 5] [--epochs 2]
        [--threads N] [--json OUT]

Images: 512 real 800x600 JPEGs cut from scikit-image's photos (``benchlib.data.prepared_photos``). Each row is
the graph alone (``pipe.run()`` per batch, the host finishing of the CPU path excluded: it is the same for
both), with the decode finished on the host (the CPU path's default: crops out) and in DALI (resize + normalize
in the graph). Rows take turns, each a warm-up epoch and ``--epochs`` timed ones per round; the figure is the
median of every timed epoch, in images/s, beside the process's CPU time per image (DALI's threads included: less
moved by other work on the machine than the wall clock) and, where the crops come out, their mean area share.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from benchlib.data import prepared_photos

from mmfast.data.dataset import PreparedDataset
from mmfast.loading.draws import DrawFeed
from mmfast.loading.graphs import image_pipeline
from mmfast.loading.sources import read_files


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=512, help="images")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--epochs", type=int, default=2, help="timed epochs per round, after one warm-up epoch")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--json", default="bench_out/bench_draws.json")
    return p.parse_args(argv)


MODES = {"dali": "DALI draws", "graph": "per-sample, window in graph", "host": "per-sample, window on host"}


def make_pipe(files: list[str], shapes, batch: int, size: int, threads: int, mode: str, host: bool, epochs: int):
    """The train graph over ``epochs`` passes of ``files`` (the file reader reads their concatenation, as a
    loader's chunk does), with DALI's draws or per-sample ones (``mode``: a key of ``MODES``; "host": the
    windows from ``shapes``, (N, 2) (height, width))."""
    ids = list(range(len(files))) * epochs
    shapes = np.tile(shapes, (epochs, 1)) if mode == "host" else None
    epoch_of = np.repeat(np.arange(epochs), len(files))
    draws = None if mode == "dali" else DrawFeed(0, np.array(ids), epoch_of, shapes)
    pipe = image_pipeline(
        read=functools.partial(read_files, files * epochs, ids), train=True, size=size, finish_on_host=host,
        draws=draws, batch_size=batch, num_threads=threads, device_id=None, seed=0, prefetch_queue_depth=2,
    )  # fmt: skip
    pipe.build()
    return pipe


def epoch_rates(pipe, batches: int, epochs: int, host: bool, pixels: int) -> tuple[list, list, list]:
    """(images/s, CPU ms per image of the whole process, DALI's threads included) of ``epochs`` epochs of
    ``batches`` batches after a warm-up epoch, and (``host``: the crops come out) each crop's area share of an
    image of ``pixels`` in the warm-up epoch."""
    shares = []
    for _ in range(batches):
        out = pipe.run()
        if host:
            shares += [s[0] * s[1] / pixels for s in out[0].shape()]
    rates, cpu = [], []
    n = batches * pipe.max_batch_size
    for _ in range(epochs):
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(batches):
            pipe.run()
        rates.append(n / (time.perf_counter() - t0))
        cpu.append(1000 * (time.process_time() - c0) / n)
    return rates, cpu, shares


def main(argv=None) -> int:
    args = parse_args(argv)
    data = PreparedDataset(prepared_photos(args.n))
    rows = list(data.iter_rows("train"))
    files = [str(data.root / r["image"]) if not os.path.isabs(r["image"]) else r["image"] for r in rows]
    # as DALI decodes them (what preparation records now; these photos carry no EXIF orientation, so their
    # header's size is the same where an older preparation recorded only that)
    shapes = np.array([r.get("decoded_shape") or (r["height"], r["width"]) for r in rows])
    batches = len(files) // args.batch_size
    files, shapes = files[: batches * args.batch_size], shapes[: batches * args.batch_size]
    variants = {
        (host, mode): f"{MODES[mode]}, {'finished on the host' if host else 'finished in DALI'}"
        for host in (True, False)
        for mode in MODES
    }
    rates: dict[tuple, list[float]] = {k: [] for k in variants}
    cpu: dict[tuple, list[float]] = {k: [] for k in variants}
    shares: dict[tuple, list[float]] = {k: [] for k in variants}
    pixels = int(shapes[0][0] * shapes[0][1])
    for r in range(args.rounds):
        for host, mode in variants:
            pipe = make_pipe(files, shapes, args.batch_size, args.size, args.threads, mode, host, args.epochs + 1)
            r_, c_, s_ = epoch_rates(pipe, batches, args.epochs, host, pixels)
            rates[host, mode] += r_
            cpu[host, mode] += c_
            shares[host, mode] += s_
            del pipe
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    rows = []
    for (host, mode), name in variants.items():
        median = statistics.median(rates[host, mode])
        base = statistics.median(rates[host, "dali"])
        cpu_ms, cpu_base = statistics.median(cpu[host, mode]), statistics.median(cpu[host, "dali"])
        share = statistics.mean(shares[host, mode]) if shares[host, mode] else None
        rows.append({"variant": name, "images_per_s": median, "min": min(rates[host, mode]),
                     "max": max(rates[host, mode]), "vs_dali_draws": median / base, "cpu_ms_per_image": cpu_ms,
                     "cpu_vs_dali_draws": cpu_ms / cpu_base, "crop_area_share": share})  # fmt: skip
    head = f"{'variant':<56}{'images/s':>10}{'min-max':>14}{'vs DALI':>9}"
    head += f"{'CPU ms/img':>12}{'vs DALI':>9}{'area':>6}"
    print("\n" + head)
    for row in rows:
        spread = f"{row['min']:.0f}-{row['max']:.0f}"
        area = "" if row["crop_area_share"] is None else f"{row['crop_area_share']:.2f}"
        print(f"{row['variant']:<56}{row['images_per_s']:>10.0f}{spread:>14}{row['vs_dali_draws']:>8.2f}x"
              f"{row['cpu_ms_per_image']:>12.2f}{row['cpu_vs_dali_draws']:>8.2f}x{area:>6}")  # fmt: skip
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"settings": vars(args), "rows": rows}, indent=2))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
