"""Other streaming libraries the stream benchmark runs beside mmfast: LitData and Mosaic Streaming.

Each writes its own format with its own tool from the same photos and captions, keeping the encoded JPEG
bytes, and reads it back from the S3 endpoint with its own dataset class. Decoding and augmentation are the
DataLoader baseline's (PIL decode, random resized crop, flip, normalize to float16) in a torch DataLoader.

    pip install litdata mosaicml-streaming

Mosaic Streaming pins older numpy and transformers than mmfast uses. Install it into a separate virtual
environment when pip would move them, and run the benchmark with that environment's python.
These are comparisons, never dependencies of mmfast: ``pip install mmfast`` installs none of them.
"""

from __future__ import annotations

import io
import json
import multiprocessing
import os
import shutil
import time
from pathlib import Path

import torch

from .baseline import pil_transform

PEERS = ("LitData", "Mosaic Streaming")
LOCAL_DECODE = "DataLoader (PIL), local disk"  # the peers' decoding without streaming


def missing(peer: str) -> str | None:
    """Why ``peer``'s rows cannot run here, or None when they can."""
    module, install = {"LitData": ("litdata", "litdata"), "Mosaic Streaming": ("streaming", "mosaicml-streaming")}[
        peer
    ]
    try:
        __import__(module)
    except ImportError as e:
        return f"{peer} is not importable ({e}); pip install {install}"
    return None


def _samples(manifest: Path):
    """(jpeg bytes, label index) for each row of the manifest, in its order."""
    rows = [json.loads(line) for line in manifest.read_text().splitlines()]
    labels = sorted({r["label"] for r in rows})
    return [((manifest.parent / r["image"]).read_bytes(), labels.index(r["label"])) for r in rows]


class _LitSample:
    """LitData's ``optimize`` function: one input index to one sample (picklable for its worker)."""

    def __init__(self, samples):
        self.samples = samples

    def __call__(self, i: int) -> dict:
        jpeg, label = self.samples[i]
        return {"image": jpeg, "label": label}


def write_litdata(manifest: Path, out: Path, per_shard: int) -> Path:
    """LitData's optimized chunks of the photos (raw JPEG bytes, ``per_shard`` samples a chunk)."""
    import litdata

    samples = _samples(manifest)
    start_method = multiprocessing.get_start_method()
    litdata.optimize(
        fn=_LitSample(samples),
        inputs=list(range(len(samples))),
        output_dir=str(out),
        chunk_size=per_shard,
        num_workers=1,
        reorder_files=False,
        verbose=False,
    )
    multiprocessing.set_start_method(start_method, force=True)  # optimize sets the process-wide method
    return out


def write_mds(manifest: Path, out: Path, per_shard: int) -> Path:
    """Mosaic's MDS shards of the photos (raw JPEG bytes), about ``per_shard`` samples a shard."""
    from streaming import MDSWriter

    samples = _samples(manifest)
    groups = [samples[s : s + per_shard] for s in range(0, len(samples), per_shard)]
    limit = max(sum(len(j) + 64 for j, _ in g) for g in groups)  # one group's bytes and its headers
    with MDSWriter(out=str(out), columns={"image": "bytes", "label": "int"}, size_limit=limit) as writer:
        for jpeg, label in samples:
            writer.write({"image": jpeg, "label": label})
    return out


def upload(client, folder: Path, bucket: str, prefix: str) -> int:
    """Every file under ``folder`` to ``s3://bucket/prefix/``; returns how many."""
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    for p in files:
        client.upload_file(str(p), bucket, f"{prefix}/{p.relative_to(folder).as_posix()}")
    return len(files)


class _Decode:
    """A sample dict (JPEG bytes, label) to (image tensor, label), as the DataLoader baseline decodes."""

    def __init__(self, size: int):
        self.transform = pil_transform(size)

    def __call__(self, sample: dict):
        from PIL import Image

        with Image.open(io.BytesIO(sample["image"])) as im:
            return self.transform(im.convert("RGB")), int(sample["label"])


def _litdata_loader(url: str, endpoint: str, cache: Path, batch_size: int, size: int, workers: int):
    import litdata

    _allow_http(0)
    dataset = litdata.StreamingDataset(
        url,
        cache_dir=str(cache),
        shuffle=True,
        storage_options={"endpoint_url": endpoint},
        transform=_Decode(size),
    )
    return litdata.StreamingDataLoader(
        dataset, batch_size=batch_size, num_workers=workers, worker_init_fn=_allow_http
    )


def _allow_http(_worker: int) -> None:
    """Let LitData's obstore client reach a plain-http endpoint such as the loopback store's.

    LitData fetches chunks through obstore when it is installed. Its fixed client options refuse http, and
    no setting of LitData's passes ``allow_http`` through, so each worker adds it to them."""
    from litdata.streaming import downloader

    downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = "true"


def _mosaic_loader(url: str, endpoint: str, cache: Path, batch_size: int, size: int, workers: int):
    from streaming import StreamingDataset

    class Decoded(StreamingDataset):
        def __getitem__(self, i):
            return decode(super().__getitem__(i))

    decode = _Decode(size)
    os.environ["S3_ENDPOINT_URL"] = endpoint  # Mosaic's boto3 client reads its endpoint here
    dataset = Decoded(remote=url, local=str(cache), shuffle=True, batch_size=batch_size)
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, num_workers=workers)


class _LocalPhotos(torch.utils.data.Dataset):
    """The manifest's photos read from local disk and decoded as the peers decode them."""

    def __init__(self, manifest: Path, size: int):
        rows = [json.loads(line) for line in manifest.read_text().splitlines()]
        labels = sorted({r["label"] for r in rows})
        self.rows = [(manifest.parent / r["image"], labels.index(r["label"])) for r in rows]
        self.decode = _Decode(size)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int):
        path, label = self.rows[i]
        return self.decode({"image": path.read_bytes(), "label": label})


def _local_loader(manifest: Path, _endpoint, _cache, batch_size: int, size: int, workers: int):
    dataset = _LocalPhotos(manifest, size)
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=workers)


def run_peer(peer: str, url, endpoint: str | None, cache: Path, args) -> dict:
    """One fresh build of ``peer``'s loader on an empty cache: first batch, cold epoch and warm epoch.
    ``LOCAL_DECODE`` is the same decoding from local disk (``url`` is then the manifest)."""
    build = {"LitData": _litdata_loader, "Mosaic Streaming": _mosaic_loader, LOCAL_DECODE: _local_loader}[peer]
    workers = args.threads  # both libraries' docs set the DataLoader's workers to the cores at hand
    t0 = time.perf_counter()
    loader = build(url, endpoint, cache, args.batch_size, args.size, workers)
    epochs, first, after_first = [], None, None
    for _ in range(2):
        n, start = 0, time.perf_counter()
        for images, _labels in loader:
            if first is None:
                first, first_at, first_n = time.perf_counter() - t0, time.perf_counter(), len(images)
            n += len(images)
        epochs.append(n / (time.perf_counter() - start))
        if after_first is None:
            after_first = (n - first_n) / (time.perf_counter() - first_at)
    del loader
    _clean(peer, cache)
    return {
        "first_batch_s": first,
        "cold_images_per_s": epochs[0],
        "cold_after_first_images_per_s": after_first,
        "warm_images_per_s": epochs[1],
        "images_per_epoch": n,
        "workers": workers,
        "cache": {},
    }


def _clean(peer: str, cache: Path) -> None:
    """Drop the round's cache, and Mosaic's shared memory, so the next round starts empty."""
    if peer == "Mosaic Streaming":
        from streaming.base.util import clean_stale_shared_memory

        clean_stale_shared_memory()
    shutil.rmtree(cache, ignore_errors=True)
