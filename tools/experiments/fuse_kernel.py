"""Kept runs of a recipe beside the kernel ridge map and the linear ridge map, each on the frozen features its
image tower pools: a pair's cosine is W times the model's plus (1 - W) times the map's (``fuse_ridge.py``'s
fusion), for each W, averaged over the runs of each set.

    python tools/experiments/fuse_kernel.py --runs OUT/runs [--recipe siglip-ms-top2-32-top4]
        [--weights 0 0.3 0.5 0.7 1] [--features DIR] [--json OUT]

OUT is a ``compare_contrastive.py --inner ... --keep-runs --out OUT`` folder. A run ``SET-innerD-RECIPE-seedS``
is scored on its own prepared inner split (its config.json's data); a set's figure is the mean over its runs,
as compare_contrastive's table across draws is. The frozen features of each prepared split are computed once
into --features (``SET-innerD.pt``). W = 0 is the map alone, W = 1 the model alone, scored again in float32.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

FIGURES = ("i2t_r1", "t2i_r1", "zero_shot_acc")


def _modules():
    try:
        import tools.experiments.contrastive_baselines as baselines
        import tools.experiments.fuse_ridge as fuse
    except ImportError:  # run as a script from tools/experiments
        import contrastive_baselines as baselines
        import fuse_ridge as fuse
    return baselines, fuse


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", required=True, help="compare_contrastive's OUT/runs, its runs kept (--keep-runs)")
    p.add_argument("--recipe", default="siglip-ms-top2-32-top4")
    p.add_argument("--weights", type=float, nargs="+", default=[0.0, 0.3, 0.5, 0.7, 1.0])
    p.add_argument("--features", default="bench_out/frozen-features", help="where frozen features are kept")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default="bench_out/fuse_kernel.json")
    return p.parse_args(argv)


def _features(run: Path, label: str, cache: Path, threads: int) -> tuple[dict, Path]:
    """The frozen features of a run's prepared split (computed once into ``cache``) and that split's folder."""
    import torch

    baselines, _ = _modules()
    config = json.loads((run / "config.json").read_text())
    data, path = Path(config["data"]), cache / f"{label}.pt"
    if not path.is_file():
        image = {"image_backbone": config["image_backbone"], "image_size": config["image_size"]}
        feats = baselines.frozen_features(data, config["preset"], threads, config["image_pool"], image)
        cache.mkdir(parents=True, exist_ok=True)
        torch.save(feats, path)
    return torch.load(path, weights_only=False), data


def kept_runs(runs: str, recipe: str) -> list[tuple[str, Path]]:
    """(its set and draw, "SET-innerD", the run's folder) of each kept run of ``recipe`` in ``runs``.

    Raises:
        SystemExit: there is none.
    """
    found = sorted(Path(runs).glob(f"*-{recipe}-seed*"))
    if not found:
        raise SystemExit(f"no run of {recipe} in {runs}")
    return [(run.name[: run.name.index(f"-{recipe}-seed")], run) for run in found]


def main(argv=None) -> int:
    args = parse_args(argv)
    baselines, fuse = _modules()
    rows = []
    for label, run in kept_runs(args.runs, args.recipe):
        feats, data = _features(run, label, Path(args.features), args.threads)
        model = fuse.model_embeddings(run / "model-last", data, args.threads)
        maps = {"kernel": baselines.kernel_ridge_embeddings(feats), "ridge": baselines.ridge_embeddings(feats)}
        for name, emb in maps.items():
            for w, got in fuse.fused_figures(model, (emb, feats["val"]), args.weights).items():
                row = {"set": label.split("-inner")[0], "draw": label, "map": name, "w": w, "picked": emb[3]}
                rows.append(row | {k: got[k] for k in FIGURES})
        print(f"{label}: kernel ridge's (lambda, gamma) {maps['kernel'][3]}", file=sys.stderr)
    table = {}
    for r in rows:
        table.setdefault((r["set"], r["map"], r["w"]), []).append(r)
    print(f"{'set':<8}{'map':<8}{'W':>5}{'runs':>6}{'i2t R@1':>10}{'t2i R@1':>10}{'zero-shot':>11}")
    for (s, m, w), got in table.items():
        means = [statistics.mean(r[k] for r in got) for k in FIGURES]
        figures = "".join(f"{v:>10.1f}" for v in means[:2]) + f"{means[2]:>11.1f}"
        print(f"{s:<8}{m:<8}{w:>5g}{len(got):>6}{figures}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    report = {"recipe": args.recipe, "weights": args.weights, "rows": rows}
    Path(args.json).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
