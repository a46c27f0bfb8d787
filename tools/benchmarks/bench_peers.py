"""All the peers, one command: mmfast's loaders against the loaders users pick today, on one machine.

    python tools/benchmarks/bench_peers.py [--quick] [--n 512] [--rounds 3] [--epochs 3]
        [--spdl-threads 2 4 8] [--machine ID] [--json OUT]

Three parts run one after the other, each a run of its own script in a process of its own:

- photos and small PNGs (``bench_loader.py --set photos`` and ``--set small-png``): mmfast's drop-in
  ``ImageLoader`` and its ``MultimodalLoader`` against SPDL (one row per ``--spdl-threads``), DALI alone
  (its own iterator over the same graph) and ``DataLoader(ImageFolder)``, in interleaved rounds;
- streaming (``bench_stream.py --peers``): the ``MultimodalLoader`` streaming its shards from the loopback
  S3 store against LitData and Mosaic Streaming reading their own formats from the same store, the store on
  a core of its own and every loader on the rest.

It prints one table and writes one JSON: each row's images/s, and mmfast's figure over it ("drop-in over
it": the default drop-in's images/s divided by the row's; "MultimodalLoader over it": the
``MultimodalLoader``'s, for the streaming rows its own from the same place). Above 1.00x mmfast is ahead.
Below the table a line per set names the peers ahead of mmfast, if any. The machine is named: CPU model,
cores, torch and DALI versions, and the load average before and after each part.

The peers are benchmark-only dependencies. ``pip install -e '.[bench]'`` brings SPDL and LitData; SPDL
also needs FFmpeg's libraries (``bench_loader.py --help``); Mosaic Streaming goes in a second venv
(``bench_stream.py --help``), which is where this command runs with every peer. A peer that is not
importable is left out, with one line saying why, and the JSON lists it under ``left_out``.

``--quick`` runs every row on 32 images once (about a minute): a check that the command works.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib.metadata
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SETS = ("photos", "small-png")
STREAM = "stream"

DROP_IN = "mmfast ImageLoader (drop-in), float32"
MULTIMODAL = "mmfast MultimodalLoader, float16"
STREAMING = "mmfast MultimodalLoader streaming"
# bench_loader.py's rows, as it names them: (the name here, mmfast's own row or a peer's)
IMAGE_ROWS = {
    "ImageLoader(ImageFolder), defaults: tuple, fp32": (DROP_IN, "mmfast"),
    "ImageLoader(ImageFolder), dtype=float16": ("mmfast ImageLoader, float16", "mmfast"),
    "ImageLoader(ImageFolder), cache_decoded=False": ("mmfast ImageLoader, streamed, float32", "mmfast"),
    "ImageLoader(ImageFolder), image_sizes given": ("mmfast ImageLoader, image_sizes given, float32", "mmfast"),
    "mmfast MultimodalLoader": (MULTIMODAL, "mmfast"),
    "bare DALI iterator": ("DALI alone (its own iterator, same graph), float16", "peer"),
    "DataLoader(ImageFolder) + PIL + v2, fp32": ("DataLoader(ImageFolder) + PIL + v2, float32", "peer"),
}
SPDL_ROW = "SPDL pipeline, {} threads, float32"  # bench_loader.py's name of an SPDL row
LOOPBACK, LOCAL = f"{STREAMING}, S3 on loopback", f"{STREAMING}, local disk"
# bench_stream.py's rows: (the name here, mmfast's own row or a peer's, the mmfast row it is compared with)
STREAM_ROWS = {
    "S3 on loopback": (LOOPBACK, "mmfast", LOOPBACK),
    "local disk": (LOCAL, "mmfast", LOCAL),
    "LitData, S3 on loopback": ("LitData, S3 on loopback", "peer", LOOPBACK),
    "Mosaic Streaming, S3 on loopback": ("Mosaic Streaming, S3 on loopback", "peer", LOOPBACK),
    "DataLoader (PIL), local disk": ("DataLoader + PIL, local disk (the peers' decode)", "peer", LOCAL),
}
COLUMNS = ["set", "row", "kind", "images/s", "drop-in over it", "drop-in row", "MultimodalLoader over it"]
COLUMNS += ["MultimodalLoader row", "warm images/s", "first batch s"]  # the last two: streaming rows only


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="every row on a few images, one round (a smoke check)")
    p.add_argument("--n", type=int, default=512, help="images in each set")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every part")
    p.add_argument("--epochs", type=int, default=3, help="timed epochs per turn of the image sets")
    p.add_argument(
        "--spdl-threads", nargs="+", type=int, default=[2, 4, 8], help="SPDL concurrencies (a row each)"
    )
    p.add_argument("--machine", default=None, help="the machine's id on the benchmarks page, kept in the JSON")
    p.add_argument("--json", default="bench_out/bench_peers.json")
    args = p.parse_args(argv)
    if args.quick:
        args.n, args.rounds, args.epochs, args.spdl_threads = 32, 1, 1, args.spdl_threads[:1]
    return args


def _version(*names: str) -> str | None:
    """The installed version of the first distribution found among ``names``, or None."""
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def machine() -> dict:
    """What the figures ran on: CPU model, cores and the libraries' versions."""
    model = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    names = (d.metadata["Name"] for d in importlib.metadata.distributions())
    dali = [name for name in names if name.startswith("nvidia-dali")]
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)),
        "python": sys.version.split()[0],
        "torch": _version("torch"),
        "dali": _version(*dali) if dali else None,
        "spdl": _version("spdl"),
        "litdata": _version("litdata"),
        "mosaicml-streaming": _version("mosaicml-streaming"),
    }


def left_out() -> dict[str, str]:
    """Each peer that cannot run in this interpreter, with why."""
    sys.path.insert(0, str(HERE))  # benchlib, as the scripts import it
    from benchlib import stream_peers
    from benchlib.peers import spdl_missing

    out = {"SPDL": spdl_missing()} | {peer: stream_peers.missing(peer) for peer in stream_peers.PEERS}
    return {peer: why for peer, why in out.items() if why}


def _run(script: str, argv: list[str], out: Path) -> dict:
    """One part: ``script`` with ``argv`` in a process of its own, its JSON written to ``out``; returns it."""
    cmd = [sys.executable, str(HERE / script), *argv, "--json", str(out)]
    print(f"$ {shlex.join(cmd)}", file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, stdout=sys.stderr)  # its own table goes to the log, ours to stdout
    return json.loads(out.read_text())


def image_set(kind: str, args, spdl: bool, out: Path) -> dict:
    """bench_loader.py over one set with this command's rows only."""
    only = [f"{name}$" for name in IMAGE_ROWS]
    only += [f"{SPDL_ROW.format(t)}$" for t in args.spdl_threads] if spdl else []
    argv = ["--set", kind, "--n", str(args.n), "--rounds", str(args.rounds), "--epochs", str(args.epochs)]
    argv += ["--spdl-threads", *map(str, args.spdl_threads), "--only", *only]
    argv += ["--batch-size", "16"] if args.quick else []
    return _run("bench_loader.py", argv, out)


def stream_set(args, out: Path) -> dict:
    """bench_stream.py with its peers, from the loopback store alone (no throttled link)."""
    argv = ["--n", str(args.n), "--rounds", str(args.rounds), "--bandwidth-mb"]
    cores = sorted(os.sched_getaffinity(0))
    argv += ["--store-cpus", str(cores[-1])] if len(cores) > 1 else []  # the store on a core of its own
    argv += ["--per-shard", "16", "--batch-size", "16"] if args.quick else []
    return _run("bench_stream.py", argv, out)


def image_rows(kind: str, raw: dict) -> list[dict]:
    """The table's rows of one image set from bench_loader.py's results, each compared with the drop-in and
    the ``MultimodalLoader``."""
    rows = []
    for name, r in raw["results"].items():
        row, role = IMAGE_ROWS.get(name, (name.replace("SPDL pipeline", "SPDL"), "peer"))  # else an SPDL row
        rows.append({"set": kind, "row": row, "kind": role, "images/s": r["images_per_s_median"]})
        rows[-1] |= {"drop-in row": DROP_IN, "MultimodalLoader row": MULTIMODAL}
    order = [row for row, _ in IMAGE_ROWS.values()]
    rows.sort(key=lambda r: order.index(r["row"]) if r["row"] in order else len(order))  # mmfast's rows first
    return with_ratios(rows)


def stream_rows(raw: dict) -> list[dict]:
    """The table's rows of the streaming part (cold epochs: every shard fetched while it is read), each
    compared with mmfast's streaming from the same place."""
    rows = []
    for name, r in raw["rows"].items():
        if name in STREAM_ROWS:
            row, role, against = STREAM_ROWS[name]
            rows.append({"set": STREAM, "row": row, "kind": role, "images/s": r["cold_images_per_s"]})
            rows[-1] |= {"drop-in row": None, "MultimodalLoader row": against}
            rows[-1] |= {"warm images/s": r["warm_images_per_s"], "first batch s": r["first_batch_s"]}
    return with_ratios(rows)


def with_ratios(rows: list[dict]) -> list[dict]:
    """Each row's "drop-in over it" and "MultimodalLoader over it": the images/s of the mmfast row it names
    ("drop-in row", "MultimodalLoader row") over its own; None where the set lacks that row."""
    rate = {r["row"]: r["images/s"] for r in rows}
    for r in rows:
        for who in ("drop-in", "MultimodalLoader"):
            if r[f"{who} row"] not in rate:
                r[f"{who} row"] = None
            r[f"{who} over it"] = rate[r[f"{who} row"]] / r["images/s"] if r[f"{who} row"] else None
    return rows


def ahead_of_mmfast(rows: list[dict]) -> dict[str, list[str]]:
    """Per set, the peer rows ahead of mmfast's drop-in (of the streaming MultimodalLoader for the stream)."""
    out = {}
    for r in rows:
        key = "MultimodalLoader over it" if r["set"] == STREAM else "drop-in over it"
        out.setdefault(r["set"], [])
        if r["kind"] == "peer" and r[key] is not None and r[key] < 1:
            out[r["set"]].append(r["row"])
    return out


def print_table(report: dict) -> None:
    host = report["host"]
    print(f"\nmachine: {host['cpu']}, {host['cores']} cores; torch {host['torch']}, DALI {host['dali']}; ", end="")
    print(f"SPDL {host['spdl']}, LitData {host['litdata']}, Mosaic Streaming {host['mosaicml-streaming']}")
    for part, load in report["load_average"].items():
        print(f"load average (1, 5, 15 min) {part}: " + ", ".join(f"{x:.2f}" for x in load))
    print("seconds: " + ", ".join(f"{part} {s:.0f}" for part, s in report["seconds"].items()))
    print(f"\n{'set':<10}{'row':<58}{'img/s':>9}{'drop-in over it':>17}{'MultimodalLoader over it':>26}")
    for r in report["rows"]:
        cells = [
            f"{r[k]:.2f}x" if r[k] is not None else "-" for k in ("drop-in over it", "MultimodalLoader over it")
        ]
        print(f"{r['set']:<10}{r['row']:<58}{r['images/s']:>9.1f}{cells[0]:>17}{cells[1]:>26}")
    print()
    for kind, ahead in report["ahead_of_mmfast"].items():
        who = "the drop-in" if kind != STREAM else "mmfast's streaming"
        print(
            f"{kind}: {who} is ahead of every peer" if not ahead else f"{kind}: ahead of {who}: {', '.join(ahead)}"
        )
    for peer, why in report["left_out"].items():
        print(f"left out: {peer}: {why}")


def _git_commit() -> str | None:
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True)
    except OSError:
        return None
    return done.stdout.strip() or None


def main(argv: list[str] | None = None) -> int:
    from mmfast.util.fsutil import atomic_write_json

    args = parse_args(argv)
    missing = left_out()
    report = {
        "title": "mmfast's loaders beside SPDL, DALI alone, the DataLoader, LitData and Mosaic Streaming",
        "command": shlex.join(
            ["python", "tools/benchmarks/bench_peers.py", *(sys.argv[1:] if argv is None else argv)]
        ),
        "commit": _git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "machine": args.machine,
        "host": machine(),
        "load_average": {"before": list(os.getloadavg())},
        "left_out": missing,
        "columns": COLUMNS,
        "rows": [],
        "seconds": {},
        "raw": {},
    }
    parts = {kind: (functools.partial(image_set, kind, args, "SPDL" not in missing), image_rows) for kind in SETS}
    parts[STREAM] = (functools.partial(stream_set, args), lambda _kind, raw: stream_rows(raw))
    with tempfile.TemporaryDirectory(prefix="bench_peers_") as tmp:
        for kind, (run, rows) in parts.items():
            started = time.perf_counter()
            report["raw"][kind] = run(Path(tmp) / f"{kind}.json")
            report["rows"] += rows(kind, report["raw"][kind])
            report["seconds"][kind] = time.perf_counter() - started
            report["load_average"][f"after {kind}"] = list(os.getloadavg())
    report["ahead_of_mmfast"] = ahead_of_mmfast(report["rows"])
    print_table(report)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.json, report)
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
