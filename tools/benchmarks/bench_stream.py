"""Streaming shards: the same prepared WebDataset shards read by the stream source from local disk (the
baseline), from an S3-compatible server on loopback (moto's server mode, through s3fs), and from that server
through a proxy that limits bandwidth and adds latency (a remote store's link), in one interleaved run.

    python tools/benchmarks/bench_stream.py [--n 512] [--per-shard 64] [--batch-size 64] [--size 224]
        [--rounds 3] [--bandwidth-mb 50 200] [--latency-ms 20] [--threads N] [--store-cpus 1] [--json OUT]

The images are ``--n`` real 800x600 JPEGs cut from scikit-image's photos (``benchlib.data``), written as
img2dataset-layout shards (key.jpg + key.txt + key.cls), prepared in place (local) and from ``s3://``
(remote: the rows, ids and split are the same; the remote preparation records each shard's size and
SHA-256). Each round builds every variant anew with an empty shard cache (for the remote rows) and times the
first batch from construction (beside one shard's fetch through the same link, the least a first batch can
wait), the first epoch (cold: every shard fetched while it is read; also from its first batch on, once the
first shard is in) and a second
epoch (warm: the cache holds the set when ``--cache-mb`` allows); train augmentation (random resized crop +
flip) at ``--size``. The cache's hits, misses, fetches and retries are reported beside the figures. Needs
``moto[server]``, ``boto3`` and ``s3fs`` (the ``remote`` and ``test`` extras).

LitData and Mosaic Streaming read the same photos from the same store in the same rounds (``--peers``;
``benchlib.stream_peers``): each writes its own format with its own tool, keeping the JPEG bytes, and reads
it back with its own dataset class in a torch DataLoader with a worker per core (``--threads``). A peer
that is not importable is skipped with one line. LitData comes with the ``bench`` extra
(``pip install -e '.[bench]'``).

Mosaic Streaming pins numpy below 2.2 and transformers below 5, so no extra names it. To keep the versions of
an environment ``$VENV``, install it without its dependencies into a second one that sees the first, and run
this there:

    python -m venv /tmp/peersvenv
    /tmp/peersvenv/bin/pip install --no-deps mosaicml-streaming xxhash zstd python-snappy
    echo "$VENV/lib/python3.11/site-packages" > /tmp/peersvenv/lib/python3.11/site-packages/main.pth

``--store-cpus`` pins the store and its links to those cores and this process (the loader, its DALI threads
and the cache's fetch threads) to the others: on a small machine the loopback store's own work (moto and the
proxies serving every byte in Python) otherwise competes with the loader, which a remote store's does not.
Every row, local disk too, then runs on the same cores.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from benchlib import stream_peers
from benchlib.data import photo_manifest
from benchlib.store_process import StoreProcess

from mmfast.loading.multimodal import MultimodalLoader
from mmfast.prepare.core import PrepareConfig, prepare_dataset
from mmfast.prepare.demo import default_cache_dir

BUCKET = "mmfast-bench"


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=512, help="images (800x600 JPEGs)")
    p.add_argument("--per-shard", type=int, default=64, help="samples per shard")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--bandwidth-mb",
        type=float,
        nargs="*",
        default=[50.0, 200.0],
        help="throttled links, MB/s (a row each; none: the loopback store alone)",
    )
    p.add_argument("--latency-ms", type=float, default=20.0, help="the throttled link's latency per request")
    p.add_argument("--cache-mb", type=float, default=1024.0, help="the shard cache's limit")
    p.add_argument("--threads", type=int, default=None, help="DALI threads (default: the cores this process has)")
    p.add_argument("--store-cpus", type=int, nargs="+", default=None, help="cores for the store process alone")
    p.add_argument(
        "--peers", nargs="*", default=list(stream_peers.PEERS), help="other libraries read from the same store"
    )
    p.add_argument("--json", default="bench_out/bench_stream.json")
    return p.parse_args(argv)


def write_shards(manifest: Path, folder: Path, per_shard: int) -> int:
    """img2dataset-layout shards of the manifest's images; returns the number of shards."""
    rows = [json.loads(line) for line in manifest.read_text().splitlines()]
    labels = sorted({r["label"] for r in rows})
    folder.mkdir(parents=True, exist_ok=True)
    shards = 0
    for s in range(0, len(rows), per_shard):
        with tarfile.open(folder / f"{shards:05d}.tar", "w") as tar:
            for i, r in enumerate(rows[s : s + per_shard], start=s):
                for ext, data in (
                    ("jpg", (manifest.parent / r["image"]).read_bytes()),
                    ("txt", r["text"].encode()),
                    ("cls", str(labels.index(r["label"])).encode()),
                ):
                    info = tarfile.TarInfo(f"{i:09d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, _bytes(data))
        shards += 1
    return shards


def _bytes(data: bytes):
    import io

    return io.BytesIO(data)


def prepare(source: str, out: Path) -> Path:
    cfg = PrepareConfig(source=source, out=str(out), val_fraction=0.0, progress=False, workers=1)
    prepare_dataset(cfg)
    return out


def run_variant(data: Path, args, cache_root: Path | None) -> dict:
    """One fresh build: first batch, cold epoch and warm epoch, and the cache's counters."""
    from mmfast.remote.shard_cache import ShardCache

    cache = ShardCache(cache_root, int(args.cache_mb * 2**20)) if cache_root else None
    t0 = time.perf_counter()
    loader = MultimodalLoader(
        data,
        "train",
        args.batch_size,
        source="stream",
        shard_cache=cache,
        size=args.size,
        num_workers=args.threads,
    )
    epochs, first, after_first = [], None, None
    for _ in range(2):
        n, start = 0, time.perf_counter()
        for batch in loader:
            real = int((batch["id"] >= 0).sum())
            if first is None:
                first, first_at, first_n = time.perf_counter() - t0, time.perf_counter(), real
            n += real
        epochs.append(n / (time.perf_counter() - start))
        if after_first is None:  # the cold epoch once the first batch is there (the first shard fetched)
            after_first = (n - first_n) / (time.perf_counter() - first_at)
    stats = cache.stats() if cache else {}
    del loader
    return {
        "first_batch_s": first,
        "cold_images_per_s": epochs[0],
        "cold_after_first_images_per_s": after_first,
        "warm_images_per_s": epochs[1],
        "cache": stats,
    }


def one_shard_fetch_s(url: str, dest: Path) -> float:
    """Seconds to fetch one whole shard through the current endpoint (what the first batch should wait)."""
    from mmfast.remote import objects as remote

    started = time.perf_counter()
    remote.fetch_to(url, dest)
    took = time.perf_counter() - started
    dest.unlink()
    return took


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.store_cpus:
        rest = os.sched_getaffinity(0) - set(args.store_cpus)
        if not rest or not set(args.store_cpus) <= os.sched_getaffinity(0):
            print(f"error: --store-cpus {args.store_cpus} must be some of cores {sorted(os.sched_getaffinity(0))}")
            return 2
        os.sched_setaffinity(0, rest)  # before any pipeline starts: DALI's and the fetch threads inherit it
    args.threads = args.threads or len(os.sched_getaffinity(0))
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's server: one line per request otherwise
    try:
        import boto3
        import moto.server  # noqa: F401 - the store process needs it
    except ImportError as e:
        print(f"error: {e}; pip install 'moto[server]' boto3 s3fs", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="mmfast-bench-stream-"))
    manifest = photo_manifest(default_cache_dir() / "bench", args.n)
    shards = write_shards(manifest, work / "shards", args.per_shard)
    pattern = f"{{00000..{shards - 1:05d}}}.tar"
    local = prepare(str(work / "shards" / pattern), work / "local")
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    # the store in a process of its own: its threads share no GIL with the loader's
    with StoreProcess(args.bandwidth_mb, args.latency_ms, args.store_cpus) as store:
        client = boto3.client("s3", endpoint_url=store.direct)
        client.create_bucket(Bucket=BUCKET)
        for tar in sorted((work / "shards").glob("*.tar")):
            client.upload_file(str(tar), BUCKET, f"shards/{tar.name}")
        os.environ["AWS_ENDPOINT_URL"] = store.direct
        remote = prepare(f"s3://{BUCKET}/shards/{pattern}", work / "remote")
        peers = write_peers(manifest, args, client, work)
        endpoints = {"local disk": None, "S3 on loopback": store.direct}
        for mb in args.bandwidth_mb:
            endpoints[f"S3 through a {mb:g} MB/s, {args.latency_ms:g} ms link"] = store.links[float(mb)]
        runs = measure(endpoints, local, remote, args, work, peers, manifest)
    results = report(runs, args, shards)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=2))
    print(f"\nwrote {args.json}")
    return 0


def write_peers(manifest: Path, args, client, work: Path) -> dict[str, str]:
    """Each importable peer's own format written by its own tool and uploaded; returns peer -> its URL."""
    writers = {"LitData": stream_peers.write_litdata, "Mosaic Streaming": stream_peers.write_mds}
    urls = {}
    for peer in args.peers:
        if why := stream_peers.missing(peer):
            print(f"skipping {peer}: {why}")
            continue
        prefix = peer.split()[0].lower()
        folder = writers[peer](manifest, work / prefix, args.per_shard)
        files = stream_peers.upload(client, folder, BUCKET, prefix)
        print(f"{peer}: {files} files in s3://{BUCKET}/{prefix}", file=sys.stderr)
        urls[peer] = f"s3://{BUCKET}/{prefix}"
    return urls


def measure(
    endpoints: dict[str, str | None], local: Path, remote: Path, args, work: Path, peers: dict, manifest: Path
) -> dict:
    """``args.rounds`` rounds, each variant once a round in turn; a remote variant also times one shard's fetch.
    Each peer reads from every remote endpoint in the same rounds, right after mmfast's row for it. With any
    peer, the peers' decoding also reads the photos from local disk, right after mmfast's local row."""
    runs: dict[str, list[dict]] = {name: [] for name in endpoints}
    runs |= {stream_peers.LOCAL_DECODE: []} if peers else {}
    runs |= {f"{peer}, {name}": [] for name, ep in endpoints.items() if ep for peer in peers}
    first_shard = f"s3://{BUCKET}/shards/00000.tar"
    for r in range(args.rounds):
        for v, (name, endpoint) in enumerate(endpoints.items()):
            if endpoint:
                os.environ["AWS_ENDPOINT_URL"] = endpoint
            cache = work / f"cache-{r}-{v}" if endpoint else None
            runs[name].append(run_variant(remote if endpoint else local, args, cache))
            if endpoint:
                runs[name][-1]["one_shard_fetch_s"] = one_shard_fetch_s(first_shard, work / "one.tar")
            print(f"  round {r + 1}: {name}: {runs[name][-1]}", file=sys.stderr)
            if peers and not endpoint:
                run = stream_peers.run_peer(stream_peers.LOCAL_DECODE, manifest, None, work / "unused", args)
                runs[stream_peers.LOCAL_DECODE].append(run)
                print(f"  round {r + 1}: {stream_peers.LOCAL_DECODE}: {run}", file=sys.stderr)
            for peer, url in peers.items() if endpoint else ():
                run = stream_peers.run_peer(peer, url, endpoint, work / f"peer-cache-{r}-{v}", args)
                runs[f"{peer}, {name}"].append(run)
                print(f"  round {r + 1}: {peer}, {name}: {run}", file=sys.stderr)
    return runs


def report(runs: dict[str, list[dict]], args, shards: int) -> dict:
    figures = ("first_batch_s", "one_shard_fetch_s", "cold_images_per_s", "cold_after_first_images_per_s")
    figures += ("warm_images_per_s",)
    rows = {}
    for name, rs in runs.items():
        rows[name] = {k: statistics.median(r[k] for r in rs) if k in rs[0] else None for k in figures}
    base = rows["local disk"]
    cores = f", the store on cores {args.store_cpus}" if args.store_cpus else ""
    print(f"\n{args.n} images in {shards} shards, batch {args.batch_size}, {args.size} px", end="")
    print(f", {args.threads} threads{cores}")
    cols = ("first batch s", "1 shard s", "cold img/s", "x local", "after 1st", "x local", "warm img/s", "x local")
    print(f"{'source':<56}" + "".join(f"{c:>12}" for c in cols) + f"{'hits':>6}{'misses':>7}{'retries':>8}")
    out = {"settings": vars(args), "shards": shards, "rows": {}}
    for name, row in rows.items():
        for k in ("cold_images_per_s", "cold_after_first_images_per_s", "warm_images_per_s"):
            row[k.replace("images_per_s", "x_local")] = row[k] / base[k]
        row["cache"] = runs[name][-1]["cache"]
        if ", " in name and name.split(", ", 1)[1] in rows:  # a peer: mmfast's figure over its own
            own = rows[name.split(", ", 1)[1]]
            row["mmfast_x"] = {k: own[k] / row[k] for k in figures if k.endswith("images_per_s")}
            row["mmfast_x"]["first_batch_s"] = row["first_batch_s"] / own["first_batch_s"]
        out["rows"][name] = row | {"runs": runs[name]}
        shard_s = "-" if row["one_shard_fetch_s"] is None else f"{row['one_shard_fetch_s']:.2f}"
        cells = [f"{row['first_batch_s']:.2f}", shard_s]
        for k in ("cold_", "cold_after_first_", "warm_"):
            cells += [f"{row[k + 'images_per_s']:.1f}", f"{row[k + 'x_local']:.2f}"]
        c = row["cache"]
        print(
            f"{name:<56}"
            + "".join(f"{x:>12}" for x in cells)
            + "".join(f"{c.get(k, '-'):>{w}}" for k, w in (("hits", 6), ("misses", 7), ("retries", 8)))
        )
    return out


if __name__ == "__main__":
    sys.exit(main())
