"""open_clip's trainer fed by its own loader against the same trainer fed by mmfast's (issue #48), run for run.

    python tools/benchmarks/bench_open_clip_train.py --set icons=OXYGEN_DIR/manifest.jsonl --set photos
        [--rounds 3] [--batch-size 64] [--workers 2] [--size 224] [--json OUT]

Each ``--set NAME[=MANIFEST]`` is a captioned set: a JSONL manifest ({"image", "text"}, paths relative to it:
``python /work/shared/data/oxygen_icons.py DIR``, ``tools/datasets/build_emoji_set.py DIR``), or "photos"
(512 real 800x600 JPEGs cut from scikit-image's, ``benchlib.data.photo_manifest``). Its rows are written as
open_clip_train's tab-separated table (``filepath``, ``title``).

Two questions, each in fresh child processes, open_clip's and mmfast's runs taking turns ``--rounds`` times:

- **loader**: the first epoch of the loader alone, from its construction to its last batch (images/s):
  open_clip_train's ``CsvDataset`` + ``DataLoader`` (``--workers`` workers, its preprocess and tokenizer)
  against ``CaptionLoader`` (``--workers`` DALI threads, the same preprocess and tokenizer).
- **trainer**: ``open_clip_train.main`` for one epoch on a small CLIP (a ViT written here, so the data matter),
  stock against ``python -m mmfast.loading.open_clip_data``: the data share of the step time (the sum of
  open_clip's own "Data (t)" over the sum of its "Batch (t)", logged every step; the first step left out),
  images/s of the epoch, and the peaks of the memory (``run_child``: the process tree's RSS and PSS, workers
  included, and the main process's RSS), sampled.

Prints a table and writes JSON with every run, the medians and the load average before and after.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

BENCH_MODEL = {  # a small CLIP at the loader's size: a step costs about what a batch's loading does
    "embed_dim": 128,
    "vision_cfg": {"image_size": 224, "layers": 2, "width": 128, "patch_size": 32},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 128, "heads": 4, "layers": 2},
}
MODEL_NAME = "mmfast-bench-clip"
VARIANTS = ("open_clip", "mmfast")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--set", action="append", default=[], help="NAME=MANIFEST.jsonl, or 'photos'")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers and DALI threads")
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--only", choices=["loader", "trainer"], help="one of the two questions")
    p.add_argument("--json", default="bench_out/bench_open_clip_train.json")
    p.add_argument("--child", help=argparse.SUPPRESS)  # loader:VARIANT:TABLE or trainer:VARIANT
    return p.parse_args(argv)


def write_table(name: str, manifest: str | None, folder: Path) -> Path:
    """open_clip_train's table of a set: tab-separated ``filepath`` (absolute) and ``title``."""
    if manifest is None:  # "photos"
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from benchlib.data import photo_manifest

        manifest = str(photo_manifest(folder / "photos", 512))
    root = Path(manifest).resolve().parent
    rows = [json.loads(line) for line in Path(manifest).read_text().splitlines() if line.strip()]
    table = folder / f"{name}.tsv"
    with open(table, "w", newline="") as f:
        out = csv.writer(f, delimiter="\t")
        out.writerow(["filepath", "title"])
        out.writerows([str(root / r["image"]), r["text"]] for r in rows)
    return table


# -- the children ---------------------------------------------------------------------------------------------
def child_loader(variant: str, table: str, args) -> dict:
    """One first epoch of a loader, from its construction (seconds, images)."""
    import open_clip
    import torch

    preprocess = open_clip.image_transform(args.size, is_train=True)
    tokenizer = open_clip.get_tokenizer("ViT-B-32")
    t0 = time.perf_counter()
    if variant == "open_clip":
        from open_clip_train.data import CsvDataset

        dataset = CsvDataset(table, preprocess, "filepath", "title", sep="\t", tokenizer=tokenizer)
        loader = torch.utils.data.DataLoader(
            dataset, batch_size=args.batch_size, shuffle=True, num_workers=args.workers, drop_last=True
        )
    else:
        from mmfast.loading.caption_loader import CaptionLoader

        loader = CaptionLoader(
            table, tokenizer=tokenizer, transform=preprocess, sep="\t", batch_size=args.batch_size, shuffle=True,
            drop_last=True, num_workers=args.workers, epochs=1,
        )  # fmt: skip
    n = 0
    for images, _texts in loader:
        n += len(images)
    return {"seconds": time.perf_counter() - t0, "images": n}


def child_trainer(variant: str, argv: list[str]) -> int:
    import open_clip

    folder = Path(tempfile.mkdtemp(prefix="bench-oc-model-"))
    (folder / f"{MODEL_NAME}.json").write_text(json.dumps(BENCH_MODEL))
    open_clip.add_model_config(folder / f"{MODEL_NAME}.json")
    if variant == "open_clip":
        from open_clip_train.main import main
    else:
        from mmfast.loading.open_clip_data import main
    main(argv)
    return 0


# -- the parent -----------------------------------------------------------------------------------------------
def run_child(cmd: list[str]) -> tuple[subprocess.CompletedProcess, dict]:
    """Run ``cmd``; (its result, the peaks of its memory in bytes, sampled every 0.2 s: ``peak_rss`` the resident
    memory of its process tree (DataLoader workers included; pages they share count in each), ``peak_pss`` the
    tree's proportional set size (shared pages divided among their holders), ``peak_rss_main`` the process's
    own resident memory)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peaks, parent = {"peak_rss": 0, "peak_pss": 0, "peak_rss_main": 0}, psutil.Process(proc.pid)
    while proc.poll() is None:
        try:
            tree = [parent, *parent.children(recursive=True)]
            full = [p.memory_full_info() for p in tree]
            now = {"peak_rss": sum(m.rss for m in full), "peak_pss": sum(m.pss for m in full),
                   "peak_rss_main": full[0].rss}  # fmt: skip
            peaks = {k: max(v, now[k]) for k, v in peaks.items()}
        except psutil.Error:  # a worker came or went while it was read
            pass
        time.sleep(0.2)
    out, err = proc.communicate()
    result = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd[:6])} ... exited with {proc.returncode}:\n{err[-3000:]}")
    return result, peaks


def loader_run(variant: str, table: Path, args) -> dict:
    cmd = [sys.executable, __file__, "--child", f"loader:{variant}:{table}", "--batch-size", str(args.batch_size),
           "--workers", str(args.workers), "--size", str(args.size)]  # fmt: skip
    result, peaks = run_child(cmd)
    got = json.loads(result.stdout.strip().splitlines()[-1])
    return {"images_per_s": got["images"] / got["seconds"], "seconds": got["seconds"], **peaks}


def trainer_run(variant: str, table: Path, logs: Path, args, k: int) -> dict:
    name = f"{table.stem}-{variant}-{k}"
    argv = [
        "--model", MODEL_NAME, "--train-data", str(table), "--batch-size", str(args.batch_size), "--epochs", "1",
        "--workers", str(args.workers), "--precision", "fp32", "--logs", str(logs), "--name", name,
        "--log-every-n-steps", "1", "--save-frequency", "0", "--lr", "1e-3", "--warmup", "0",
    ]  # fmt: skip
    t0 = time.perf_counter()
    _, peaks = run_child([sys.executable, __file__, "--child", f"trainer:{variant}", "--", *argv])
    wall = time.perf_counter() - t0
    log = (logs / name / "out.log").read_text()
    steps = re.findall(r"\[\s*(\d+)/\d+ .*Data \(t\): ([\d.]+) Batch \(t\): ([\d.]+)", log)
    data = [float(d) for _, d, _ in steps]
    batch = [float(b) for _, _, b in steps]
    images = int(steps[-1][0]) if steps else 0
    return {
        "data_share": sum(data[1:]) / sum(batch[1:]),
        "data_share_all_steps": sum(data) / sum(batch),
        "first_step_s": batch[0],
        "images_per_s": images / sum(batch),
        "steps": len(steps),
        "wall_s": wall,
        **peaks,
    }


def median_of(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []  # a trainer child's flags for open_clip_train
    args = parse_args(argv[: len(argv) - len(extra) - (1 if extra else 0)])
    if args.child:
        kind, variant, *rest = args.child.split(":", 2)
        if kind == "loader":
            print(json.dumps(child_loader(variant, rest[0], args)))
            return 0
        return child_trainer(variant, extra)
    sets = [s.split("=", 1) if "=" in s else [s, None] for s in (args.set or ["photos"])]
    folder = Path(tempfile.mkdtemp(prefix="bench-open-clip-train-"))
    tables = {name: write_table(name, manifest, folder) for name, manifest in sets}
    load_before = os.getloadavg()
    runs = {name: {q: {v: [] for v in VARIANTS} for q in ("loader", "trainer")} for name in tables}
    for r in range(args.rounds):
        for name, table in tables.items():
            for v in VARIANTS:  # open_clip's run, then mmfast's: turn by turn
                if args.only in (None, "loader"):
                    runs[name]["loader"][v].append(got := loader_run(v, table, args))
                    print(f"round {r + 1} {name} loader {v}: {got['images_per_s']:.1f} img/s", file=sys.stderr)
                if args.only in (None, "trainer"):
                    runs[name]["trainer"][v].append(got := trainer_run(v, table, folder / "logs", args, r))
                    print(f"round {r + 1} {name} trainer {v}: data {100 * got['data_share']:.1f}% "
                          f"{got['images_per_s']:.1f} img/s peak RSS {got['peak_rss'] / 2**30:.2f} GiB, PSS "
                          f"{got['peak_pss'] / 2**30:.2f} GiB", file=sys.stderr)  # fmt: skip
    report = summarize(runs, args, load_before, os.getloadavg())
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


def summarize(runs: dict, args, load_before, load_after) -> dict:
    """The medians and ratios of each set, printed as a table; the whole report."""
    medians = {}
    print(f"\n{'set':<10}{'question':<36}{'open_clip':>12}{'mmfast':>12}{'ratio':>9}")
    for name, questions in runs.items():
        medians[name] = {}
        rows = [("loader", "images_per_s", "loader, first epoch img/s"),
                ("trainer", "data_share", "trainer data share of step time"),
                ("trainer", "images_per_s", "trainer img/s"),
                ("trainer", "peak_rss", "trainer peak RSS, tree (GiB)"),
                ("trainer", "peak_pss", "trainer peak PSS, tree (GiB)"),
                ("trainer", "peak_rss_main", "trainer peak RSS, main (GiB)")]  # fmt: skip
        for q, key, label in rows:
            if not questions[q]["open_clip"]:
                continue
            oc, mm = (median_of(questions[q][v], key) for v in VARIANTS)
            medians[name][f"{q}.{key}"] = {"open_clip": oc, "mmfast": mm, "ratio": mm / oc}
            scale = 2**30 if key.startswith("peak") else (0.01 if key == "data_share" else 1)
            print(f"{name:<10}{label:<36}{oc / scale:>12.2f}{mm / scale:>12.2f}{mm / oc:>8.2f}x")
    print(f"load average: {load_before[0]:.1f} before, {load_after[0]:.1f} after ({os.cpu_count()} cores)")
    import open_clip
    import torch

    return {
        "command": " ".join(sys.argv),
        "cpu_count": os.cpu_count(),
        "load_average_before": load_before,
        "load_average_after": load_after,
        "batch_size": args.batch_size,
        "workers": args.workers,
        "size": args.size,
        "rounds": args.rounds,
        "model": BENCH_MODEL,
        "torch": torch.__version__,
        "open_clip": open_clip.__version__,
        "medians": medians,
        "runs": runs,
    }


if __name__ == "__main__":
    sys.exit(main())
