"""The feature cache against the decoded path, in one run: epochs after the first, and the first pass's cost.

    python tools/benchmarks/bench_feature_cache.py --data PREPARED_DIR [--preset clip-lite0-minilm]
        [--epochs 3] [--views 2] [--batch-size 64] [--json OUT]

Training runs one after another on this machine, a decoded and a cached run per recipe:
  decoded, both towers locked       cached, both towers locked      (--freeze-image --freeze-text)
  decoded, LiT (text trains)        cached, LiT                     (--freeze-image)
  decoded, LiT (today's)            cached, LiT top N               (--freeze-image --text-train-layers N)
A "LiT top N" recipe trains only the text tower's top N layers; its cache holds the locked lower layers' output,
and its named baseline is today's decoded LiT, whose run is shared with the LiT recipe when both are asked for.
"decoded" is --feature-cache off, whatever the preset sets (today's path: each epoch decodes, or crops held decoded
images, and runs the image tower); "cached" is --feature-cache on with --feature-views K, in a fresh cache folder,
so its first pass is timed too. Each figure is a run's own metrics: images/s of epoch 0 and the median of epochs 1
and later (training only: evaluation and checkpoints are not in them). Speed-up: cached later epochs over decoded
later epochs. First pass per view: the cache's build seconds / (K + 1 views, the centre one included) over one
decoded epoch's seconds. run_s: the whole run's wall seconds (first pass, every epoch, every evaluation: a cached
run evaluates from the val split's own cache); run_speedup: the decoded run's over the cached run's. The table is
printed and written as JSON (``--json``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LIT = ["--freeze-image"]
# recipe: (its flags, the flags of its decoded baseline: today's path)
RECIPES = {
    "both locked": (["--freeze-image", "--freeze-text"], ["--freeze-image", "--freeze-text"]),
    "LiT": (LIT, LIT),
    "LiT top 2": ([*LIT, "--text-train-layers", "2"], LIT),
    "LiT top 1": ([*LIT, "--text-train-layers", "1"], LIT),
}
COLUMNS = ["recipe", "path", "epoch0_img_s", "later_img_s", "speedup", "build_s", "build_per_view_vs_epoch"]
COLUMNS += ["text_build_s", "run_s", "run_speedup"]


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="a prepared directory (mmfast-prepare)")
    p.add_argument("--preset", default="clip-lite0-minilm")
    p.add_argument("--epochs", type=int, default=3, help="epochs per run (2 or more: later epochs are timed)")
    p.add_argument("--views", type=int, default=2, help="--feature-views of the cached runs")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated: " + ", ".join(RECIPES))
    p.add_argument("--extra", default="", help="more mmfast-train flags for every run, in one string")
    p.add_argument("--machine", default="", help="the machine's name on docs/benchmarks/index.md, for the JSON")
    p.add_argument("--json", default="bench_out/bench_feature_cache.json")
    return p.parse_args(argv)


def _run(args, out: Path, flags: list[str]) -> dict:
    """One training run; returns its summary and its epochs' metrics."""
    from mmfast.train import parse_config, train

    common = ["--data", args.data, "--model", "clip", "--preset", args.preset, "--epochs", str(args.epochs)]
    common += ["--batch-size", str(args.batch_size), "--no-progress", "--no-checkpoints", "--out", str(out)]
    summary = train(parse_config([*common, *args.extra.split(), *flags]))
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x]
    return {"summary": summary, "metrics": metrics}


def _row(recipe: str, path: str, run: dict, epoch_samples: int) -> dict:
    """A run's figures: images/s of epoch 0 and of the later epochs (median), one later epoch's seconds."""
    speeds = [m["images_per_s"] for m in run["metrics"]]
    later = statistics.median(speeds[1:])
    row = {"recipe": recipe, "path": path, "epoch0_img_s": round(speeds[0], 1), "later_img_s": round(later, 1)}
    row["epoch_s"] = epoch_samples / later
    row["run_s"] = round(run["summary"]["wall_s"], 1)
    return row


def _compare(decoded: dict, cached: dict, run: dict) -> None:
    """The cached row's speed-up over the decoded one, and its first pass per stored view (the centre one too)
    over one decoded epoch."""
    cache = run["summary"]["feature_cache"]
    cached["speedup"] = round(cached["later_img_s"] / decoded["later_img_s"], 2)
    cached["run_speedup"] = round(decoded["run_s"] / cached["run_s"], 2)
    cached["build_s"] = cache["seconds"]
    cached["build_per_view_vs_epoch"] = round(cache["seconds"] / (cache["views"] + 1) / decoded["epoch_s"], 2)
    if "text" in cache:  # the captions' pass, apart from the image views'
        cached["text_build_s"] = cache["text"]["seconds"]


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.epochs < 2:
        print("--epochs must be 2 or more: the figures are of the epochs after the first", file=sys.stderr)
        return 2
    from mmfast.data.dataset import PreparedDataset

    epoch_samples = PreparedDataset(args.data).split_size("train") // args.batch_size * args.batch_size
    rows, baselines, load = [], {}, [os.getloadavg()]
    with tempfile.TemporaryDirectory(prefix="bench-feature-cache-") as tmp:
        for k, recipe in enumerate(args.recipes.split(",")):
            flags, base = RECIPES[recipe]
            if tuple(base) not in baselines:  # one decoded run per baseline
                # off by flag: a preset may turn the cache on (clip-lite2-minilm's auto)
                run = _run(args, Path(tmp) / f"{k}-decoded", [*base, "--feature-cache", "off"])
                name = next(n for n, (f, _) in RECIPES.items() if f == base)
                baselines[tuple(base)] = decoded = _row(name, "decoded", run, epoch_samples)
                rows.append(decoded)
            decoded = baselines[tuple(base)]
            cached_flags = [*flags, "--feature-cache", "on", "--feature-views", str(args.views)]
            cached_flags += ["--feature-cache-dir", str(Path(tmp) / f"{k}-features")]
            run = _run(args, Path(tmp) / f"{k}-cached", cached_flags)
            cached = _row(recipe, "cached", run, epoch_samples)
            _compare(decoded, cached, run)
            rows.append(cached)
    load.append(os.getloadavg())
    _print(rows)
    print(f"load average (1, 5, 15 min): {load[0]} at the start, {load[1]} at the end")
    _write(args, rows, load)
    return 0


def _print(rows: list[dict]) -> None:
    widths = [max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in COLUMNS]
    print("  ".join(c.ljust(w) for c, w in zip(COLUMNS, widths, strict=True)))
    for r in rows:
        print("  ".join(str(r.get(c, "")).ljust(w) for c, w in zip(COLUMNS, widths, strict=True)))


def _write(args, rows: list[dict], load: list) -> None:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    run = {
        "command": "python tools/benchmarks/bench_feature_cache.py " + " ".join(sys.argv[1:]),
        "commit": commit,
        "date": time.strftime("%Y-%m-%d"),
        "machine": args.machine,
        "load_average": {"start": load[0], "end": load[1]},
        "columns": COLUMNS,
        "rows": [{k: r.get(k) for k in COLUMNS} for r in rows],
    }
    out.write_text(json.dumps(run, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
