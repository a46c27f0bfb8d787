"""What a shard's download costs the loader's core: CPU milliseconds per MB of ``remote.fetch_to`` (one GET
through a presigned URL, hashed and written) against the same object read by s3fs itself (ranged reads of
8 MiB, the baseline), hashed and written the same way, boto3's ``get_object`` streamed body and obstore's
streamed ``get`` (the Rust ``object_store`` crate); in one interleaved run, from an S3-compatible server
(moto) on loopback and through a throttled link.

    python tools/benchmarks/bench_fetch.py [--mb 12] [--repeats 5] [--rounds 3] [--bandwidth-mb 200]
        [--latency-ms 20] [--json OUT]

The store and its link run in a process of their own on the last core (``benchlib/store_process.py``), this
process on the others; the figure is this process's CPU time (``time.process_time``, all its threads) over
``--repeats`` downloads of one random ``--mb`` MB object, per MB, the median over ``--rounds`` rounds. Needs
``moto[server]``, ``boto3`` and ``s3fs`` (the ``remote`` and ``test`` extras); the obstore row runs when
``obstore`` is installed (the ``bench`` extra):

    pip install -e ".[remote,test,bench]"
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchlib.store_process import StoreProcess

from mmfast.remote import objects as remote

BUCKET = "mmfast-bench"
KEY = "one.tar"


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=float, default=12.0, help="the object's size, MB")
    p.add_argument("--repeats", type=int, default=5, help="downloads timed together")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--bandwidth-mb", type=float, default=200.0, help="the throttled link, MB/s")
    p.add_argument("--latency-ms", type=float, default=20.0, help="the throttled link's latency per request")
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


def s3fs_reads(url: str, endpoint: str, dest: Path, sha256: str) -> None:
    """The baseline: s3fs's own ranged reads of 8 MiB, each hashed and written, then checked."""
    import fsspec

    hasher = hashlib.sha256()
    fs, path = fsspec.core.url_to_fs(url, endpoint_url=endpoint)
    with fs.open(path, "rb", block_size=8 << 20, cache_type="none") as f, open(dest, "wb") as out:
        while block := f.read(8 << 20):
            hasher.update(block)
            out.write(block)
    assert hasher.hexdigest() == sha256


def boto3_body(client, dest: Path, sha256: str) -> None:
    """boto3's ``get_object`` streamed body in 1 MiB pieces, hashed and written, then checked."""
    hasher, body = hashlib.sha256(), client.get_object(Bucket=BUCKET, Key=KEY)["Body"]
    with open(dest, "wb") as out:
        for piece in body.iter_chunks(1 << 20):
            hasher.update(piece)
            out.write(piece)
    assert hasher.hexdigest() == sha256


def obstore_store(endpoint: str):
    """An obstore ``S3Store`` on the bucket at ``endpoint``: plain HTTP, path-style, the same credentials."""
    from obstore.store import S3Store

    return S3Store(
        BUCKET,
        endpoint=endpoint,
        access_key_id=os.environ["AWS_ACCESS_KEY_ID"],
        secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"],
        region=os.environ["AWS_DEFAULT_REGION"],
        virtual_hosted_style_request=False,
        client_options={"allow_http": True},
    )


def obstore_get(store, dest: Path, sha256: str) -> None:
    """obstore's streamed ``get`` in pieces of 1 MiB or more, hashed and written, then checked."""
    import obstore

    hasher = hashlib.sha256()
    with open(dest, "wb") as out:
        for piece in obstore.get(store, KEY).stream(min_chunk_size=1 << 20):
            hasher.update(piece)
            out.write(piece)
    assert hasher.hexdigest() == sha256


def cpu_ms_per_mb(download, repeats: int, nbytes: int) -> tuple[float, float]:
    """(CPU ms, wall ms) per MB of ``repeats`` calls of ``download`` after one untimed."""
    download()
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(repeats):
        download()
    mb = repeats * nbytes / 1e6
    return (time.process_time() - cpu) / mb * 1000, (time.perf_counter() - wall) / mb * 1000


def main(argv=None) -> int:
    args = parse_args(argv)
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        print("error: needs 2 cores or more (the store runs on one of its own)")
        return 2
    os.sched_setaffinity(0, set(cores[:-1]))
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench-key-id")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench-secret-key")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    import boto3

    try:
        import obstore
    except ImportError:
        obstore = None
        print("obstore is not installed: its row is left out (pip install obstore)")
    data = os.urandom(int(args.mb * 1e6))
    sha256, url = hashlib.sha256(data).hexdigest(), f"s3://{BUCKET}/{KEY}"
    runs: dict[str, list[tuple[float, float]]] = {}
    with (
        StoreProcess([args.bandwidth_mb], args.latency_ms, cpus=cores[-1:]) as store,
        tempfile.TemporaryDirectory() as tmp,
    ):
        boto3.client("s3", endpoint_url=store.direct).create_bucket(Bucket=BUCKET)
        boto3.client("s3", endpoint_url=store.direct).put_object(Bucket=BUCKET, Key=KEY, Body=data)
        links = {
            "loopback": store.direct,
            f"{args.bandwidth_mb:g} MB/s, {args.latency_ms:g} ms": store.links[args.bandwidth_mb],
        }
        dest = Path(tmp) / "one.tar"
        for _ in range(args.rounds):
            for link, endpoint in links.items():
                os.environ["AWS_ENDPOINT_URL"] = endpoint
                client = boto3.client("s3", endpoint_url=endpoint)
                ways = {
                    "remote.fetch_to (one GET, presigned)": lambda: remote.fetch_to(
                        url, dest, size=len(data), sha256=sha256
                    ),
                    "s3fs ranged reads (baseline)": lambda e=endpoint: s3fs_reads(url, e, dest, sha256),
                    "boto3 get_object body": lambda c=client: boto3_body(c, dest, sha256),
                }
                if obstore is not None:
                    bucket = obstore_store(endpoint)
                    ways["obstore get, streamed"] = lambda b=bucket: obstore_get(b, dest, sha256)
                for way, download in ways.items():
                    runs.setdefault(f"{link} | {way}", []).append(cpu_ms_per_mb(download, args.repeats, len(data)))
    return report(runs, args)


def report(runs: dict[str, list[tuple[float, float]]], args) -> int:
    print(f"\none {args.mb:g} MB object, {args.repeats} downloads a round, median of {args.rounds} rounds")
    print(f"{'link':<22}{'download':<40}{'CPU ms/MB':>11}{'x baseline':>12}{'x GET':>8}{'wall ms/MB':>12}")
    rows, out = {}, {"settings": vars(args) | {"json": str(args.json)}, "rows": {}}
    for name, rs in runs.items():
        rows[name] = statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs)
    for name, (cpu, wall) in rows.items():
        link, way = name.split(" | ")
        base = rows[f"{link} | s3fs ranged reads (baseline)"][0]
        get = rows[f"{link} | remote.fetch_to (one GET, presigned)"][0]
        print(f"{link:<22}{way:<40}{cpu:>11.2f}{cpu / base:>11.2f}x{cpu / get:>7.2f}x{wall:>12.2f}")
        out["rows"][name] = {
            "cpu_ms_per_mb": cpu,
            "x_baseline": cpu / base,
            "x_fetch_to": cpu / get,
            "wall_ms_per_mb": wall,
            "runs": runs[name],
        }
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
