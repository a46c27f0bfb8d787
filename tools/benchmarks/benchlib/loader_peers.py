"""The rows ``bench_loader.py`` times mmfast's loaders against, each a variant ``(data, args, device) ->``
a function that returns one epoch's image batches: DALI alone over the same graph (``bare_dali_variant``), the
decode alone (DALI's ROI decode, PIL's full decode), FFCV in its own interpreter (``FFCVServer``), torch
DataLoader over an ImageFolder or the prepared rows, SPDL and torchvision's GPU decode. Every row reads the
same images with the same batch size and augmentation.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

from mmfast.data.dataset import PreparedDataset
from mmfast.data.preprocessing import IMAGENET_MEAN, IMAGENET_STD
from mmfast.loading.sources import read_files


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


class FFCVServer:
    """FFCV 1.0.2 in its own interpreter (``--ffcv-python``; FFCV is a comparison, never a dependency):
    ``tools/benchmarks/bench_ffcv.py --serve`` writes the .beton once, builds its loader once and times epochs on
    request; ``round(epochs)`` returns their images/s."""

    def __init__(self, data, args, max_side: int):
        import subprocess

        cmd = [args.ffcv_python, str(Path(__file__).parents[1] / "bench_ffcv.py"), "--serve", "--data", str(data)]
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
    return FFCVServer(data, args, 0)


def ffcv_max_side_variant(data, args, device):
    return FFCVServer(data, args, args.max_side)


def image_folder(data, root: Path, size: int, dtype: torch.dtype = torch.float32):
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


def torchvision_dataloader_variant(data, args, device):
    """What the drop-in replaces: ``DataLoader(ImageFolder(root, transform), ...)``, float32 batches."""
    folder = image_folder(data, args.folder_root, args.size)
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
