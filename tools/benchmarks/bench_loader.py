"""Loader throughput: mmfast's loaders vs a bare DALI iterator vs torch DataLoader + PIL.

The rows are in ``benchlib/loader_mmfast.py`` (mmfast's loaders) and ``benchlib/loader_peers.py`` (what
they are compared with); this script picks them, takes the turns, and prints and writes the figures.

    python tools/benchmarks/bench_loader.py [--data PREPARED_DIR] [--batch-size 64] [--size 224] [--rounds 3]
        [--epochs 3] [--json OUT]

Without --data it cuts 512 real 800x600 JPEGs from scikit-image's photos and prepares them. Every variant
reads the same images with the same batch size, the same augmentation (random resized crop + flip +
normalize) and the same output dtype: float16 for the MultimodalLoader rows (the training engine's), float32
for the drop-in rows (``ImageLoader`` with its defaults, as it replaces a ``DataLoader(ImageFolder(...))``,
against that DataLoader). The variants take turns: each round runs every variant for one
warm-up epoch (it absorbs what a variant prefetched while it waited) and ``--epochs`` timed epochs, so a
drift of the machine's speed during the run hits every variant alike; the figure is the median of all
timed epochs. ``--fresh`` times instead what the warm-up hides: each round builds every variant anew and
times its first batch and its first epoch from construction (the median of the rounds).

The SPDL rows (``--spdl-threads``, one row per concurrency and dtype) need ``pip install spdl`` and FFmpeg's
libraries; on Debian 12:

    apt-get install -y libavutil57 libavcodec59 libavformat59 libavfilter8 libswscale6 libswresample4 libavdevice59

Without them the run says so and leaves the SPDL rows out. "vs SPDL" divides by the fastest float32 SPDL row.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from benchlib.data import prepared_photos
from benchlib.loader_mmfast import (
    imageloader_fp16_variant,
    imageloader_sizes_variant,
    imageloader_streaming_variant,
    imageloader_variant,
    mmfast_cached_variant,
    mmfast_dali_resize_variant,
    mmfast_finish_threads_variant,
    mmfast_fp32_variant,
    mmfast_max_side_variant,
    mmfast_parquet_variant,
    mmfast_variant,
    mmfast_wds_variant,
)
from benchlib.loader_peers import (
    FFCVServer,
    bare_dali_graph_variant,
    bare_dali_variant,
    dali_decode_only_variant,
    dataloader_images_variant,
    dataloader_variant,
    ffcv_max_side_variant,
    ffcv_variant,
    gpu_decode_variant,
    pil_decode_only_variant,
    spdl_variant,
    torchvision_dataloader_variant,
)
from benchlib.peers import spdl_missing

from mmfast.data.dataset import PreparedDataset


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", help="prepared dataset directory (default: 512 real 800x600 photos)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--rounds", type=int, default=3, help="turns every variant takes")
    p.add_argument("--epochs", type=int, default=3, help="timed epochs per turn (after one warm-up epoch)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="DALI threads and DataLoader workers")
    p.add_argument("--only", nargs="*", help="run only the variants containing one of these (NAME$: exactly NAME)")
    p.add_argument("--spdl-threads", nargs="+", type=int, default=[8], help="SPDL decode concurrencies to run")
    p.add_argument("--set", default="photos", choices=["photos", "small-png"], help="built-in images (no --data)")
    p.add_argument("--n", type=int, default=512, help="images in the built-in set")
    p.add_argument("--max-side", type=int, default=512, help="the --max-side rows' prepare_data --max-side")
    p.add_argument("--ffcv-python", help="python of a venv with ffcv 1.0.2: adds FFCV rows (see bench_ffcv.py)")
    p.add_argument(
        "--fresh",
        action="store_true",
        help="time each variant's first batch and first epoch from construction (a fresh loader per round)",
    )
    p.add_argument("--json", default="bench_out/bench_loader.json")
    return p.parse_args(argv)


def time_epochs(make_iter, epochs: int, device: torch.device) -> tuple[list[float], list[float]]:
    """Images/s of each epoch after a warm-up epoch, and this process's CPU ms per image (its threads', not
    a DataLoader's worker processes'). ``make_iter()`` returns one epoch's batches."""
    rates, cpu = [], []
    for e in range(epochs + 1):
        n, t0, c0 = 0, time.perf_counter(), time.process_time()
        for images in make_iter():
            n += images.shape[0]
        if device.type == "cuda":
            torch.cuda.synchronize()  # note: count the GPU work of the last batch
        if e > 0:
            rates.append(n / (time.perf_counter() - t0))
            cpu.append(1000 * (time.process_time() - c0) / n)
    return rates, cpu


def time_fresh(make, data, args, device) -> tuple[float, float]:
    """(seconds to the first batch, images/s of the first epoch), both from the loader's construction."""
    t0 = time.perf_counter()
    batches = iter(make(data, args, device)())
    n = next(batches).shape[0]
    first = time.perf_counter() - t0
    for images in batches:
        n += images.shape[0]
    if device.type == "cuda":
        torch.cuda.synchronize()
    return first, n / (time.perf_counter() - t0)


def fresh_report(variants: dict, data, args, device) -> dict:
    """``--fresh``: each round builds every variant anew and times its first batch and first epoch."""
    runs = {name: [] for name in variants}
    for r in range(args.rounds):
        for name, make in variants.items():
            runs[name].append(time_fresh(make, data, args, device))
            print(f"  round {r + 1}: {name}: first batch {runs[name][-1][0]:.3f} s", file=sys.stderr)
    print(f"\n{'variant':<50}{'first batch s':>15}{'first epoch img/s':>20}")
    results = {}
    for name, pairs in runs.items():
        first, rate = statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)
        results[name] = {"first_batch_s_median": first, "first_epoch_images_per_s_median": rate, "runs": pairs}
        print(f"{name:<50}{first:>15.3f}{rate:>20.1f}")
    return results


def add_ratios(results: dict) -> None:
    """Each row's ratio to the reference rows present in this run, printed as a table and kept in ``results``."""
    references = {  # ratio key in the JSON: (column title, the variant it divides by)
        "ratio_vs_baseline": ("vs baseline", "DataLoader + PIL + v2 + tokenize (baseline)"),
        "ratio_vs_images_only_baseline": ("vs images-only", "DataLoader + PIL + v2, images only"),
        "ratio_vs_imagefolder_dataloader": ("vs DL(ImageFolder)", "DataLoader(ImageFolder) + PIL + v2, fp32"),
        "ratio_vs_bare_dali": ("vs bare DALI", "bare DALI iterator"),
        "ratio_vs_roi_decode_only": ("vs ROI decode", "decode-only: DALI ROI decode of the crops"),
        "ratio_vs_pil_decode_only": ("vs PIL decode", "decode-only: PIL full decode, DataLoader"),
    }
    spdl_rows = [k for k in results if k.startswith("SPDL") and k.endswith("float32")]
    if spdl_rows:  # the tuned SPDL: its fastest concurrency in this run
        best = max(spdl_rows, key=lambda k: results[k]["images_per_s_median"])
        references["ratio_vs_spdl"] = ("vs SPDL", best)
    print(f"\n{'variant':<50}{'img/s':>9}" + "".join(f"{title:>20}" for title, _ in references.values()))
    for name, r in results.items():
        m = r["images_per_s_median"]
        line = f"{name:<50}{m:>9.1f}"
        for key, (_, ref) in references.items():
            den = results.get(ref, {}).get("images_per_s_median")
            r[key] = m / den if den else None
            line += f"{r[key]:>19.2f}x" if den else f"{'-':>20}"
        print(line)


def variants(args, data_given: bool, device: torch.device) -> dict:
    """{row name: variant} of this run: every row that the machine and the flags allow, in table order,
    narrowed to ``--only``'s."""
    rows = {
        "mmfast MultimodalLoader": mmfast_variant,
        "mmfast MultimodalLoader, fp32": mmfast_fp32_variant,
        "mmfast MultimodalLoader, cache_decoded": mmfast_cached_variant,
        "mmfast, finish_threads = DALI threads": mmfast_finish_threads_variant,
        "mmfast MultimodalLoader, WebDataset source": mmfast_wds_variant,
        "mmfast MultimodalLoader, Parquet source": mmfast_parquet_variant,
        "bare DALI iterator": bare_dali_variant,
        "DataLoader + PIL + v2 + tokenize (baseline)": dataloader_variant,
        "DataLoader + PIL + v2, images only": dataloader_images_variant,
        "ImageLoader(ImageFolder), defaults: tuple, fp32": imageloader_variant,
        "ImageLoader(ImageFolder), dtype=float16": imageloader_fp16_variant,
        "ImageLoader(ImageFolder), cache_decoded=False": imageloader_streaming_variant,
        "ImageLoader(ImageFolder), image_sizes given": imageloader_sizes_variant,
        "DataLoader(ImageFolder) + PIL + v2, fp32": torchvision_dataloader_variant,
    }
    if not data_given:
        rows[f"mmfast MultimodalLoader, --max-side {args.max_side}"] = mmfast_max_side_variant
    if args.ffcv_python:
        rows["FFCV 1.0.2, stored as given"] = ffcv_variant
        rows[f"FFCV 1.0.2, stored at max side {args.max_side}"] = ffcv_max_side_variant
    if missing := spdl_missing():
        print(f"SPDL rows left out: {missing}", file=sys.stderr)
    for t in [] if missing else args.spdl_threads:
        for dtype in (torch.float32, torch.float16):
            name = f"SPDL pipeline, {t} threads, {str(dtype).removeprefix('torch.')}"
            rows[name] = functools.partial(spdl_variant, threads=t, dtype=dtype)
    rows["decode-only: DALI ROI decode of the crops"] = dali_decode_only_variant
    rows["decode-only: PIL full decode, DataLoader"] = pil_decode_only_variant
    if device.type == "cuda":
        rows["decode_jpeg(cuda) + v2 on GPU"] = gpu_decode_variant
    else:  # the CPU alternatives: resize + normalize inside the DALI graph
        rows["mmfast, cpu_resize='dali'"] = mmfast_dali_resize_variant
        rows["bare DALIGenericIterator, all in graph"] = bare_dali_graph_variant

    def picked(name: str) -> bool:
        return not args.only or any(name == o[:-1] if o.endswith("$") else o in name for o in args.only)

    return {k: v for k, v in rows.items() if picked(k)}


def turns_report(variants: dict, data, args, device) -> dict:
    """Every variant built once, then ``--rounds`` turns of a warm-up and ``--epochs`` timed epochs each:
    {row name: its median images/s, every epoch's, and this process's CPU per image}, with the ratios."""
    iters = {name: make(data, args, device) for name, make in variants.items()}
    rates: dict[str, list[float]] = {name: [] for name in variants}
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(args.rounds):
        for name, make_iter in iters.items():
            if isinstance(make_iter, FFCVServer):
                rates[name] += make_iter.round(args.epochs)
            else:
                r_, c_ = time_epochs(make_iter, args.epochs, device)
                rates[name], cpu[name] = rates[name] + r_, cpu[name] + c_
            last = statistics.median(rates[name][-args.epochs :])
            print(f"  round {r + 1}: {name}: {last:.1f} img/s", file=sys.stderr)
    results = {name: {"images_per_s_median": statistics.median(v), "epochs": v} for name, v in rates.items()}
    for name, c in cpu.items():  # this process's CPU: a DataLoader row's workers are other processes
        results[name]["cpu_ms_per_image_in_process"] = statistics.median(c) if c else None
    add_ratios(results)
    return results


def main(argv: list[str] | None = None) -> int:
    from mmfast.util.fsutil import atomic_write_json

    args = parse_args(argv)
    data = Path(args.data) if args.data else prepared_photos(args.n, kind=args.set)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    rows = variants(args, bool(args.data), device)
    folder_tmp = tempfile.TemporaryDirectory(prefix="bench_imagefolder_")
    args.folder_root = Path(folder_tmp.name)  # the ImageFolder tree of links the drop-in rows read
    report = {  # what every report says of the run
        "device": str(device),
        "cpu_count": os.cpu_count(),
        "batch_size": args.batch_size,
        "size": args.size,
        "rounds": args.rounds,
        "threads": args.threads,
        "data": str(data),
        "set": None if args.data else args.set,
        "images": PreparedDataset(data, verify=False).split_size("train"),
        "torch": torch.__version__,
        "spdl": None if spdl_missing() else importlib.metadata.version("spdl"),
    }
    if args.fresh:
        rows = {k: v for k, v in rows.items() if "FFCV" not in k}
        report |= {"mode": "fresh", "results": fresh_report(rows, data, args, device)}
    else:
        report |= {"epochs_per_round": args.epochs, "results": turns_report(rows, data, args, device)}
    folder_tmp.cleanup()
    atomic_write_json(args.json, report)
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
