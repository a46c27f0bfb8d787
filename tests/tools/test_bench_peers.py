"""tools/benchmarks/bench_peers.py, the one command that runs every peer: each row it promises is in its table
and JSON, and each ratio is the named mmfast row's images/s over the row's own. A peer that is not installed
here (SPDL, LitData, Mosaic Streaming: benchmark-only) is listed as left out instead of its rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools.benchmarks import bench_peers

ROOT = Path(__file__).resolve().parents[2]
DROP_IN = "mmfast ImageLoader (drop-in), float32"
MULTIMODAL = "mmfast MultimodalLoader, float16"
LOOPBACK = "mmfast MultimodalLoader streaming, S3 on loopback"
LOCAL = "mmfast MultimodalLoader streaming, local disk"
IMAGE_ROWS = {  # bench_loader.py's name: the table's
    "ImageLoader(ImageFolder), defaults: tuple, fp32": DROP_IN,
    "ImageLoader(ImageFolder), dtype=float16": "mmfast ImageLoader, float16",
    "ImageLoader(ImageFolder), cache_decoded=False": "mmfast ImageLoader, streamed, float32",
    "ImageLoader(ImageFolder), image_sizes given": "mmfast ImageLoader, image_sizes given, float32",
    "mmfast MultimodalLoader": MULTIMODAL,
    "bare DALI iterator": "DALI alone (its own iterator, same graph), float16",
    "DataLoader(ImageFolder) + PIL + v2, fp32": "DataLoader(ImageFolder) + PIL + v2, float32",
}
STREAM_ROWS = {  # bench_stream.py's name: (the table's, the mmfast row it is compared with)
    "S3 on loopback": (LOOPBACK, LOOPBACK),
    "local disk": (LOCAL, LOCAL),
    "LitData, S3 on loopback": ("LitData, S3 on loopback", LOOPBACK),
    "Mosaic Streaming, S3 on loopback": ("Mosaic Streaming, S3 on loopback", LOOPBACK),
    "DataLoader (PIL), local disk": ("DataLoader + PIL, local disk (the peers' decode)", LOCAL),
}


def _importable(*modules: str) -> bool:
    try:
        for m in modules:
            __import__(m)
    except (ImportError, OSError):  # OSError: SPDL without FFmpeg's libraries
        return False
    return True


def _check_ratios(rows: list[dict]) -> None:
    """Each ratio is its named mmfast row's images/s over the row's, the names the ones this test expects."""
    for r in rows:
        rate = {x["row"]: x["images/s"] for x in rows if x["set"] == r["set"]}
        if r["set"] == "stream":
            against = {v[0]: v[1] for v in STREAM_ROWS.values()}[r["row"]]
            assert r["drop-in row"] is None and r["drop-in over it"] is None, r
        else:
            against = MULTIMODAL
            assert r["drop-in row"] == DROP_IN, r
            assert r["drop-in over it"] == pytest.approx(rate[DROP_IN] / r["images/s"], rel=1e-12), r
        assert r["MultimodalLoader row"] == against, r
        assert r["MultimodalLoader over it"] == pytest.approx(rate[against] / r["images/s"], rel=1e-12), r


def _raw(rates: dict[str, float], stream: dict[str, float]) -> tuple[dict, dict]:
    """bench_loader.py's and bench_stream.py's JSON shapes around made-up figures."""
    loader = {"results": {k: {"images_per_s_median": v} for k, v in rates.items()}}
    rows = {
        k: {"cold_images_per_s": v, "warm_images_per_s": 2 * v, "first_batch_s": 1 / v} for k, v in stream.items()
    }
    return loader, {"rows": rows}


def test_ratios_are_over_the_named_mmfast_rows_and_peers_ahead_are_named():
    rates = dict(zip(IMAGE_ROWS, (300.0, 280.0, 250.0, 320.0, 290.0, 330.0, 100.0), strict=True))
    rates["SPDL pipeline, 4 threads, float32"] = 200.0
    stream = dict(zip(STREAM_ROWS, (380.0, 290.0, 110.0, 400.0, 130.0), strict=True))
    loader, streamed = _raw(rates, stream)
    rows = bench_peers.image_rows("photos", loader) + bench_peers.stream_rows(streamed)
    assert [r["row"] for r in rows[:8]] == [*IMAGE_ROWS.values(), "SPDL, 4 threads, float32"]
    assert {r["row"]: r["images/s"] for r in rows[8:]} == {v[0]: stream[k] for k, v in STREAM_ROWS.items()}
    _check_ratios(rows)
    spdl = rows[7]
    assert (spdl["drop-in over it"], spdl["MultimodalLoader over it"]) == (1.5, 1.45)
    ahead = bench_peers.ahead_of_mmfast(rows)
    assert ahead == {
        "photos": ["DALI alone (its own iterator, same graph), float16"],
        "stream": ["Mosaic Streaming, S3 on loopback"],
    }


@pytest.mark.slow
def test_quick_mode_prints_every_promised_row_with_its_ratios(tmp_path):
    out = tmp_path / "peers.json"
    env = dict(os.environ, MMFAST_CACHE=str(tmp_path / "cache"), PYTHONPATH=str(ROOT))
    cmd = [sys.executable, str(ROOT / "tools/benchmarks/bench_peers.py"), "--quick", "--json", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=280)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    peers = {"SPDL": _importable("spdl.io", "spdl.pipeline"), "LitData": _importable("litdata")}
    peers["Mosaic Streaming"] = _importable("streaming")
    assert set(report["left_out"]) == {p for p, here in peers.items() if not here}
    promised = {(s, row) for s in ("photos", "small-png") for row in IMAGE_ROWS.values()}
    promised |= {(s, "SPDL, 2 threads, float32") for s in ("photos", "small-png") if peers["SPDL"]}
    promised |= {("stream", LOOPBACK), ("stream", LOCAL)}
    promised |= (
        {("stream", STREAM_ROWS["DataLoader (PIL), local disk"][0])}
        if peers["LitData"] or peers["Mosaic Streaming"]
        else set()
    )
    promised |= {("stream", f"{p}, S3 on loopback") for p in ("LitData", "Mosaic Streaming") if peers[p]}
    rows = report["rows"]
    assert sorted((r["set"], r["row"]) for r in rows) == sorted(promised)
    for r in rows:  # the figures are the scripts' own medians
        raw = report["raw"][r["set"]]
        if r["set"] == "stream":
            name = next(k for k, v in STREAM_ROWS.items() if v[0] == r["row"])
            assert r["images/s"] == raw["rows"][name]["cold_images_per_s"]
        else:
            name = next(
                (k for k, v in IMAGE_ROWS.items() if v == r["row"]), r["row"].replace("SPDL", "SPDL pipeline")
            )
            assert r["images/s"] == raw["results"][name]["images_per_s_median"]
    _check_ratios(rows)
    table = run.stdout
    for r in rows:  # the printed table: every row with its two ratios
        cells = [
            f"{r[k]:.2f}x" if r[k] is not None else "-" for k in ("drop-in over it", "MultimodalLoader over it")
        ]
        assert any(r["row"] in ln and ln.split()[-2:] == cells for ln in table.splitlines()), (r, table)
    for kind in ("photos", "small-png", "stream"):
        assert any(ln.startswith(f"{kind}: ") for ln in table.splitlines()), table
    host = report["host"]
    assert host["cpu"] and host["cores"] == os.cpu_count() and host["torch"] and host["dali"]
    assert set(report["load_average"]) == {"before", "after photos", "after small-png", "after stream"}
