"""mmfast's rows of ``bench_loader.py``, each a variant ``(data, args, device) ->`` a function that returns one
epoch's image batches: the training engine's ``MultimodalLoader`` (float16; in float32, with more finishing
threads, decoded once, over ``--max-side`` copies, with the whole graph in DALI, and over the same pictures as
WebDataset shards or a Parquet file) and the drop-in ``ImageLoader`` over a torchvision ImageFolder (float32
tuples; in float16, streamed, given the decoded image sizes).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from benchlib.loader_peers import image_folder

from mmfast.data.dataset import PreparedDataset


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


def mmfast_dali_resize_variant(data, args, device):
    """The loader with the whole train graph in DALI on the CPU too (resize + normalize included)."""
    return mmfast_variant(data, args, device, cpu_resize="dali")


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


def imageloader_variant(data, args, device, dtype: torch.dtype | None = None, **kwargs):
    """The drop-in: ``ImageLoader(ImageFolder(root, transform), ...)`` with its defaults, (images, labels)
    tuples in float32 (or ``dtype``); ``cache_decoded="auto"`` decides whether it holds the images decoded."""
    from mmfast.loading.image_loader import ImageLoader

    folder = image_folder(data, args.folder_root, args.size)
    options = {"num_workers": args.threads, "device": device, "dtype": dtype, **kwargs}
    loader = ImageLoader(folder, args.batch_size, shuffle=True, drop_last=True, **options)
    return lambda: (images for images, _ in loader)


def imageloader_sizes_variant(data, args, device):
    """The drop-in given each file's decoded size (``image_sizes``, from preparation's ``decoded_shape``): its
    crop windows drawn on the host, as the ``MultimodalLoader``'s are, not computed in the graph."""
    rows = PreparedDataset(data, verify=False).rows("train")
    shapes = {Path(r["image"]).name: r.get("decoded_shape") for r in rows}
    folder = image_folder(data, args.folder_root, args.size)  # the drop-in's own files, in its order
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
