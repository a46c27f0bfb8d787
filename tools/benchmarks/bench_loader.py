"""Loader throughput: mmfast's loaders vs a bare DALI iterator vs torch DataLoader + PIL.

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
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from benchlib.data import prepared_photos
from benchlib.peers import spdl_missing

from mmfast.data.dataset import PreparedDataset
from mmfast.data.preprocessing import IMAGENET_MEAN, IMAGENET_STD
from mmfast.loading.sources import read_files


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


def mmfast_variant(data, args, device, cpu_resize: str = "torch", **kwargs):
    from mmfast.loading.multimodal import MultimodalLoader

    loader = MultimodalLoader(
        data,
        "train",
        args.batch_size,
        size=args.size,
        num_workers=args.threads,
        device=device,
        cpu_resize=cpu_resize,
        **({"fp16": True} | kwargs),
    )
    return lambda: (b["image"] for b in loader)


def mmfast_fp32_variant(data, args, device):
    return mmfast_variant(data, args, device, dtype=torch.float32, fp16=None)


def mmfast_finish_threads_variant(data, args, device):
    """The loader with one finishing thread per DALI thread (the default takes fewer, see host_finish)."""
    return mmfast_variant(data, args, device, finish_threads=args.threads)


def mmfast_cached_variant(data, args, device):
    """The loader with ``cache_decoded``: each image decoded once (in the first warm-up epoch, untimed), the
    timed epochs cropping from memory."""
    return mmfast_variant(data, args, device, cache_decoded=True)


def mmfast_max_side_variant(data, args, device):
    """The loader over the same photos prepared with ``--max-side`` (downscaled JPEG copies)."""
    from benchlib.data import prepared_photos

    return mmfast_variant(prepared_photos(args.n, args.max_side, args.set), args, device)


def dali_decode_only_variant(data, args, device):
    """The CPU path's ceiling: DALI's fused ROI decode + random crop alone (no resize, no normalize), the
    crops handed over as they are."""
    from nvidia.dali.plugin.pytorch import LastBatchPolicy

    from mmfast.loading.graphs import image_pipeline
    from mmfast.loading.host_finish import ragged_iterator

    rows = PreparedDataset(data, verify=False).rows("train")
    pipe = image_pipeline(
        read=functools.partial(read_files, [r["image"] for r in rows], [r["id"] for r in rows]),
        train=True,
        size=args.size,
        finish_on_host=True,
        batch_size=args.batch_size,
        num_threads=args.threads,
        device_id=None,
        seed=0,
    )
    it = ragged_iterator(pipe, reader_name="Reader", auto_reset=True, last_batch_policy=LastBatchPolicy.DROP)
    return lambda: (out[0]["flips"] for out in it)  # (B,): counts the batch


class _Decoded(torch.utils.data.Dataset):
    """PIL's full decode of each image, nothing else; returns the decoded size (not the pixels, whose
    trip back from the workers would be the baseline's cost, not the decoder's)."""

    def __init__(self, files):
        self.files = files

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        from PIL import Image

        with Image.open(self.files[i]) as im:
            return torch.tensor(im.convert("RGB").size)


def pil_decode_only_variant(data, args, device):
    """The baseline's decode alone: DataLoader workers opening and fully decoding each image with PIL."""
    rows = PreparedDataset(data, verify=False).rows("train")
    loader = torch.utils.data.DataLoader(
        _Decoded([r["image"] for r in rows]),
        args.batch_size,
        shuffle=True,
        drop_last=True,
        num_workers=args.threads,
        persistent_workers=True,
    )
    return lambda: iter(loader)  # (B, 2) sizes: counts the batch


class _FFCV:
    """FFCV 1.0.2 in its own interpreter (``--ffcv-python``; FFCV is a comparison, never a dependency):
    ``tools/benchmarks/bench_ffcv.py --serve`` writes the .beton once, builds its loader once and times epochs on
    request; ``round(epochs)`` returns their images/s."""

    def __init__(self, data, args, max_side: int):
        import subprocess

        cmd = [args.ffcv_python, str(Path(__file__).with_name("bench_ffcv.py")), "--serve", "--data", str(data)]
        cmd += ["--max-side", str(max_side), "--batch-size", str(args.batch_size), "--size", str(args.size)]
        cmd += ["--threads", str(args.threads)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.round(0)  # the .beton written and the pipeline compiled now, not while other rows are timed

    def round(self, epochs: int) -> list[float]:
        self.proc.stdin.write(f"{epochs}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"bench_ffcv.py exited with {self.proc.wait()} (its messages are above)")
        return json.loads(line)["images_per_s"]


def ffcv_variant(data, args, device):
    return _FFCV(data, args, 0)


def ffcv_max_side_variant(data, args, device):
    return _FFCV(data, args, args.max_side)


def mmfast_wds_variant(data, args, device):
    """The loader over the same pictures as WebDataset shards in img2dataset layout (key.jpg + key.txt +
    key.cls, 128 samples a shard, written here with tarfile from the train split), prepared in place: DALI's
    webdataset reader through mmfast's index files instead of its file reader. The "within 10% of the files
    source" row: compare with "mmfast MultimodalLoader"."""
    import io
    import tarfile

    from mmfast.prepare.core import PrepareConfig, prepare_dataset

    tmp = tempfile.TemporaryDirectory(prefix="bench_wds_")
    args.wds_tmp = tmp  # lives as long as the run
    shards, rows = Path(tmp.name) / "shards", PreparedDataset(data, verify=False).rows("train")
    shards.mkdir()
    for k in range(0, len(rows), 128):
        with tarfile.open(shards / f"{k // 128:05d}.tar", "w") as tar:
            for r in rows[k : k + 128]:
                ext = Path(r["image"]).suffix.lstrip(".").lower().replace("jpeg", "jpg")
                for name, blob in (
                    (f"{r['id']:09d}.{ext}", Path(r["image"]).read_bytes()),
                    (f"{r['id']:09d}.txt", r["text"].encode()),
                    (f"{r['id']:09d}.cls", str(r["label"]).encode()),
                ):
                    info = tarfile.TarInfo(name)
                    info.size = len(blob)
                    tar.addfile(info, io.BytesIO(blob))
    out = Path(tmp.name) / "prepared"
    cfg = PrepareConfig(
        str(shards), str(out), tokenizer=str(Path(data) / "tokenizer"), val_fraction=0.0, progress=False
    )
    prepare_dataset(cfg)
    return mmfast_variant(out, args, device)


def mmfast_parquet_variant(data, args, device):
    """The loader over the same pictures as a Parquet file in Hugging Face's layout (an ``image`` column of
    ``struct<bytes, path>``, written here with pyarrow from the train split), prepared: preparation writes the
    bytes out as files into the prepared directory, so this row reads files too. The "within 10% of the files
    source" row for Parquet: compare with "mmfast MultimodalLoader"."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from mmfast.prepare.core import PrepareConfig, prepare_dataset

    tmp = tempfile.TemporaryDirectory(prefix="bench_parquet_")
    args.parquet_tmp = tmp  # lives as long as the run
    rows = PreparedDataset(data, verify=False).rows("train")
    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    table = pa.table(
        {
            "image": pa.array([{"bytes": Path(r["image"]).read_bytes(), "path": None} for r in rows], image),
            "text": [r["text"] for r in rows],
            "label": [r["label"] for r in rows],
        }
    )
    pq.write_table(table, Path(tmp.name) / "train.parquet")
    out = Path(tmp.name) / "prepared"
    cfg = PrepareConfig(
        str(Path(tmp.name) / "train.parquet"),
        str(out),
        tokenizer=str(Path(data) / "tokenizer"),
        val_fraction=0.0,
        progress=False,
    )
    prepare_dataset(cfg)
    return mmfast_variant(out, args, device)


def _image_folder(data, root: Path, size: int, dtype: torch.dtype = torch.float32):
    """torchvision's ImageFolder over the prepared train split (a tree of links under ``root``), with the
    train transform the other variants apply."""
    from torchvision import datasets
    from torchvision.transforms import v2

    for r in PreparedDataset(data, verify=False).rows("train"):
        link = root / str(r["label"]) / Path(r["image"]).name
        if not link.exists():
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(Path(r["image"]).resolve())
    tf = v2.Compose(
        [
            v2.RandomResizedCrop(size, antialias=True),
            v2.RandomHorizontalFlip(),
            v2.ToImage(),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize([m / 255 for m in IMAGENET_MEAN], [s / 255 for s in IMAGENET_STD]),
            v2.ToDtype(dtype),
        ]
    )
    return datasets.ImageFolder(root, tf)


def imageloader_variant(data, args, device, dtype: torch.dtype | None = None, **kwargs):
    """The drop-in: ``ImageLoader(ImageFolder(root, transform), ...)`` with its defaults, (images, labels)
    tuples in float32 (or ``dtype``); ``cache_decoded="auto"`` decides whether it holds the images decoded."""
    from mmfast.loading.image_loader import ImageLoader

    folder = _image_folder(data, args.folder_root, args.size)
    options = {"num_workers": args.threads, "device": device, "dtype": dtype, **kwargs}
    loader = ImageLoader(folder, args.batch_size, shuffle=True, drop_last=True, **options)
    return lambda: (images for images, _ in loader)


def imageloader_sizes_variant(data, args, device):
    """The drop-in given each file's decoded size (``image_sizes``, from preparation's ``decoded_shape``): its
    crop windows drawn on the host, as the ``MultimodalLoader``'s are, not computed in the graph."""
    rows = PreparedDataset(data, verify=False).rows("train")
    shapes = {Path(r["image"]).name: r.get("decoded_shape") for r in rows}
    folder = _image_folder(data, args.folder_root, args.size)  # the drop-in's own files, in its order
    sizes = [shapes[Path(path).name] for path, _ in folder.samples]
    if None in sizes:
        raise SystemExit(f"{data}: rows without a decoded_shape (an older preparation): delete it to redo it")
    from mmfast.loading.arguments import EngineReading  # the bench's own top imports stay light
    from mmfast.loading.sampling import DATALOADER

    return imageloader_variant(data, args, device, reading=EngineReading(sampling=DATALOADER, image_sizes=sizes))


def imageloader_streaming_variant(data, args, device):
    return imageloader_variant(data, args, device, cache_decoded=False)


def imageloader_fp16_variant(data, args, device):
    return imageloader_variant(data, args, device, dtype=torch.float16)


def torchvision_dataloader_variant(data, args, device):
    """What the drop-in replaces: ``DataLoader(ImageFolder(root, transform), ...)``, float32 batches."""
    folder = _image_folder(data, args.folder_root, args.size)
    loader = torch.utils.data.DataLoader(
        folder,
        args.batch_size,
        shuffle=True,
        drop_last=True,
        num_workers=args.threads,
        pin_memory=device.type == "cuda",
        persistent_workers=True,
    )
    return lambda: (images.to(device, non_blocking=True) for images, _ in loader)


def mmfast_dali_resize_variant(data, args, device):
    """The loader with the whole train graph in DALI on the CPU too (resize + normalize included)."""
    return mmfast_variant(data, args, device, cpu_resize="dali")


def bare_dali_variant(data, args, device, host: bool | None = None):
    """DALI's own iterator over the same graph and file list, built once, reset each epoch; on the CPU the
    same host finishing as the loader (``host``), so the difference is the loader's own overhead."""
    from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

    from mmfast.loading.graphs import image_pipeline
    from mmfast.loading.host_finish import HostFinisher, ragged_iterator

    rows = PreparedDataset(data, verify=False).rows("train")
    cuda = device.type == "cuda"
    host = not cuda if host is None else host
    pipe = image_pipeline(
        read=functools.partial(read_files, [r["image"] for r in rows], [r["id"] for r in rows]),
        train=True,
        size=args.size,
        decode_device="mixed" if cuda else "cpu",
        fp16=True,
        finish_on_host=host,
        batch_size=args.batch_size,
        num_threads=args.threads,
        device_id=device.index if cuda else None,
        seed=0,
    )
    if not host:
        it = DALIGenericIterator(
            pipe, ["image", "id"], reader_name="Reader", auto_reset=True, last_batch_policy=LastBatchPolicy.DROP
        )
        return lambda: (out[0]["image"] for out in it)
    finisher = HostFinisher(args.size, IMAGENET_MEAN, IMAGENET_STD, fp16=True)
    it = ragged_iterator(pipe, reader_name="Reader", auto_reset=True, last_batch_policy=LastBatchPolicy.DROP)
    return lambda: (finisher.finish(out[0]) for out in it)


def bare_dali_graph_variant(data, args, device):
    return bare_dali_variant(data, args, device, host=False)


def dataloader_variant(data, args, device, text: bool = True):
    """What most users run: DataLoader workers decoding with PIL and torchvision.transforms.v2 (and, for
    image+text data, tokenizing the batch's captions in the collate function)."""
    from benchlib.baseline import baseline_loader

    loader = baseline_loader(data, args.batch_size, args.size, num_workers=args.threads, text=text)
    return lambda: (b["image"].to(device, non_blocking=True) for b in loader)


def dataloader_images_variant(data, args, device):
    return dataloader_variant(data, args, device, text=False)


def spdl_variant(data, args, device, threads: int, dtype: torch.dtype):
    """SPDL's pipeline: FFmpeg decodes, crops, resizes and flips each image in ``threads`` concurrent tasks,
    torch normalizes each batch (see benchlib/peers.py)."""
    from benchlib.peers import spdl_loader

    epoch = spdl_loader(data, args.batch_size, args.size, threads, dtype)
    return lambda: (images.to(device, non_blocking=True) for images in epoch())


def gpu_decode_variant(data, args, device):
    """torchvision.io.decode_jpeg on the GPU + v2 transforms on the GPU (CUDA only)."""
    from torchvision.io import decode_jpeg, read_file
    from torchvision.transforms import v2

    rows = PreparedDataset(data, verify=False).rows("train")
    tf = v2.Compose([v2.RandomResizedCrop(args.size, antialias=True), v2.RandomHorizontalFlip()])
    mean = torch.tensor(IMAGENET_MEAN, device=device).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD, device=device).view(1, 3, 1, 1)

    def epoch():
        perm = torch.randperm(len(rows)).tolist()
        for s in range(0, len(rows) - args.batch_size + 1, args.batch_size):
            data_ = [read_file(rows[i]["image"]) for i in perm[s : s + args.batch_size]]
            imgs = decode_jpeg(data_, device=device)
            batch = torch.stack([tf(im) for im in imgs]).float()
            yield ((batch - mean) / std).half()

    return epoch


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


def main(argv: list[str] | None = None) -> int:
    from mmfast.util.fsutil import atomic_write_json

    args = parse_args(argv)
    data = Path(args.data) if args.data else prepared_photos(args.n, kind=args.set)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    variants = {
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
    if not args.data:
        variants[f"mmfast MultimodalLoader, --max-side {args.max_side}"] = mmfast_max_side_variant
    if args.ffcv_python:
        variants["FFCV 1.0.2, stored as given"] = ffcv_variant
        variants[f"FFCV 1.0.2, stored at max side {args.max_side}"] = ffcv_max_side_variant
    if missing := spdl_missing():
        print(f"SPDL rows left out: {missing}", file=sys.stderr)
    for t in [] if missing else args.spdl_threads:
        for dtype in (torch.float32, torch.float16):
            name = f"SPDL pipeline, {t} threads, {str(dtype).removeprefix('torch.')}"
            variants[name] = functools.partial(spdl_variant, threads=t, dtype=dtype)
    variants["decode-only: DALI ROI decode of the crops"] = dali_decode_only_variant
    variants["decode-only: PIL full decode, DataLoader"] = pil_decode_only_variant
    if device.type == "cuda":
        variants["decode_jpeg(cuda) + v2 on GPU"] = gpu_decode_variant
    else:  # the CPU alternatives: resize + normalize inside the DALI graph
        variants["mmfast, cpu_resize='dali'"] = mmfast_dali_resize_variant
        variants["bare DALIGenericIterator, all in graph"] = bare_dali_graph_variant
    def picked(name: str) -> bool:
        return not args.only or any(name == o[:-1] if o.endswith("$") else o in name for o in args.only)

    variants = {k: v for k, v in variants.items() if picked(k)}
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
        variants = {k: v for k, v in variants.items() if "FFCV" not in k}
        report |= {"mode": "fresh", "results": fresh_report(variants, data, args, device)}
        folder_tmp.cleanup()
        atomic_write_json(args.json, report)
        print(f"\nwrote {args.json}")
        return 0
    iters = {name: make(data, args, device) for name, make in variants.items()}
    rates: dict[str, list[float]] = {name: [] for name in variants}
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(args.rounds):
        for name, make_iter in iters.items():
            if isinstance(make_iter, _FFCV):
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
    folder_tmp.cleanup()
    report |= {"epochs_per_round": args.epochs, "results": results}
    atomic_write_json(args.json, report)
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
