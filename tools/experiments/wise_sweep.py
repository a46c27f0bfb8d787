"""--wise-ft's share swept without training again: one recipe trained, and its start, on each inner draw; then the
last model's floating-point tensors mixed with the start's at each share and scored on the inner val split.

The start is a run of the same recipe whose one epoch moves nothing (``--lr 1e-12``, the encoders at 0): the same
ridge start, the same pretrained tower. Scores are ``contrastive_baselines.score``'s, in float32, so a share of 1
may differ from the run's own (bf16) evaluation by an image or so.

    python tools/experiments/wise_sweep.py --recipe siglip-ms-top2-32-top4 --sets icons xfce emoji \\
        --inner-seed 1 2 3 4 5 6 --shares 0.5 0.7 0.9 1 --image-backbone efficientnet-lite2 --image-size 192 \\
        --cache DIR --out OUT

Writes one JSON line per (set, draw, share) into OUT/sweep.jsonl (a rerun skips those written) and prints the
mean over the draws.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import tools.experiments.compare_contrastive as cc  # noqa: E402
import tools.experiments.contrastive_baselines as baselines  # noqa: E402
from tools.experiments.fuse_ridge import loaded_embeddings  # noqa: E402

KEYS = ("i2t_r1", "t2i_r1", "zero_shot_acc")


def mixed_figures(trained: Path, start: Path, data_dir: Path, shares: list[float]) -> dict[float, dict]:
    """The figures of ``trained``'s model directory mixed with ``start``'s at each share of the trained one."""
    import torch

    from mmfast.data.dataset import PreparedDataset
    from mmfast.infer.model_dir import load_model
    from mmfast.tasks.contrastive import sample_groups

    loaded, begin = load_model(trained), load_model(start).model.state_dict()
    end = {k: v.clone() for k, v in loaded.model.state_dict().items()}
    groups = sample_groups(PreparedDataset(data_dir))[0]
    got = {}
    for a in shares:
        loaded.model.load_state_dict(
            {k: a * v + (1 - a) * begin[k] if v.is_floating_point() else v for k, v in end.items()}
        )
        with torch.no_grad():
            split, classes = loaded_embeddings(loaded, data_dir, None)
        marks = {"group": groups[split["id"]], "label": split["label"]}
        got[a] = baselines.score(split["x"], split["t"], marks, classes)
    return got


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", required=True, choices=list(cc.RECIPES))
    p.add_argument("--sets", nargs="+", required=True)
    p.add_argument("--inner-seed", nargs="+", type=int, required=True)
    p.add_argument("--shares", nargs="+", type=float, required=True, help="the trained weights' shares, in (0, 1]")
    p.add_argument("--image-backbone", default=None)
    p.add_argument("--image-size", type=int, default=None)
    p.add_argument("--cache", required=True, help="where compare_contrastive builds and prepares the sets")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    loss, changes = cc.RECIPES[args.recipe]
    cc.RECIPES["start"] = (loss, {**changes, "lr": 1e-12, "encoder_lr": 0.0, "epochs": 1})
    image = [
        f"--{k}={v}" for k, v in (("image-backbone", args.image_backbone), ("image-size", args.image_size)) if v
    ]
    run_args = cc.parse_args(
        ["--inner", "--reuse-runs", "--seeds", "0", "--cache", args.cache, "--out", args.out, *image]
    )
    out = Path(args.out) / "sweep.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = [json.loads(x) for x in out.read_text().splitlines()] if out.is_file() else []
    done = {(r["set"], r["draw"]) for r in rows}
    for name in args.sets:
        for draw in args.inner_seed:
            if (name, draw) in done:
                continue
            data = cc.prepared_set(name, Path(args.cache), run_args.preset, None, inner=True, inner_seed=draw)
            dirs = [Path(args.out) / "runs" / f"{name}-{draw}-{r}" for r in (args.recipe, "start")]
            for recipe, run_dir in zip((args.recipe, "start"), dirs, strict=True):
                cc.dual_encoder(run_args, data, recipe, 0, run_dir)
            figures = mixed_figures(dirs[0] / "model-last", dirs[1] / "model-last", data, args.shares)
            new = [
                {"set": name, "draw": draw, "share": a, **{k: round(f[k], 2) for k in KEYS}}
                for a, f in figures.items()
            ]
            with out.open("a") as fh:
                fh.writelines(json.dumps(r) + "\n" for r in new)
            rows += new
    for name in args.sets:
        for a in args.shares:
            got = [r for r in rows if r["set"] == name and r["share"] == a]
            means = " / ".join(f"{statistics.mean(r[k] for r in got):.1f}" for k in KEYS)
            print(f"{name:8s} share {a:g}: {means} (i2t / t2i R@1 / zero-shot, {len(got)} draws)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
