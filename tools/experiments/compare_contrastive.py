"""mmfast's contrastive recipes (--model clip, --loss clip and siglip) against two baselines on frozen
pretrained towers, on real captioned sets: retrieval both ways and zero-shot accuracy, one table.

    python tools/experiments/compare_contrastive.py [--sets icons emoji] [--seeds 0 1 2]
        [--methods ridge probe clip siglip] [--preset clip-lite0-minilm] [--out bench_out/contrastive]

A set is "icons" (the Oxygen icon theme, built by ../shared/data/oxygen_icons.py), "emoji" (Noto emoji,
tools/datasets/build_emoji_set.py), "xfce" (the elementary-xfce icon theme,
tools/datasets/build_xfce_icons_set.py), a manifest / image folder, or a prepared directory; it is built and
prepared once (the captions tokenized for the preset's text model) into --cache. Every method is scored on the same
val split by the same figures (``mmfast.tasks.retrieval``, images grouped as the contrastive task groups them):

- ridge and probe: the preset's towers frozen, their features aligned by a closed-form ridge map or by two
  linear projections trained with the CLIP loss (``contrastive_baselines.py``, beside this file).
- clip / siglip: ``mmfast.train.train`` with the preset's recipe and that loss, for every seed; the figures are
  the last epoch's evaluation (not the best one: choosing it would be tuning on val). clip-top2 / clip-top1 /
  clip-locked / siglip-top2 (``RECIPES``): the same with only the text tower's top 2 or 1 layers training, or
  none, on cached features (--feature-cache on, one cache folder per set under --out); a "-16" recipe trains 16
  epochs on 2 stored views. siglip-top1 / siglip-locked: SigLIP with the top layer training, or none;
  siglip-top2-slow: siglip-top2 with the text tower's learning rate at 1e-5 (the preset's: 3e-5). clip-ms: the
  preset's recipe on --image-pool multiscale features; clip-locked-ms-E / siglip-locked-ms-E: both towers locked on
  them, E epochs on the cached centre view; siglip-locked-ms-32-slow: siglip-locked-ms-32 at --lr 3e-4 (the
  preset's: 1e-3); siglip-ms-slow: SigLIP at that rate on multiscale features, the text tower training as in the
  preset. siglip-locked-32 / siglip-locked-32-slow: the locked recipes on the head's pooled features (what an
  open_clip or transformers folder can hold). siglip-locked-ms-32-mid: at --lr 5e-4. siglip-ms-top2-slow /
  -E-slow / -32-mid: the multiscale locked recipe with the text tower's top 2 layers training (16 epochs at 3e-4,
  E = 24, 32 or 48 at 3e-4, 32 at 5e-4); clip-ms-top2-E-slow: the same with the CLIP loss, E = 16 or 32;
  siglip-top2-32-slow: siglip-ms-top2-32-slow on the head's pooled features (a model open_clip can hold); its
  ``VARIANTS`` siglip-ms-top2-32-NAME. ridge-ms / probe-ms: the baselines on multiscale features.

``--inner`` scores on an inner split instead of val: each set's train split prepared again, a fifth of its
images drawn to an inner val by another seed (``--inner-seed``). Recipes are chosen there, and val then reports the
choice. An inner val of about 100 images moves a figure by more than recipes differ, so ``--inner-seed 1 2 3 4``
runs every method on four draws and adds a table across them: each draw's mean over the seeds, averaged over the
draws, and each method's difference to ``--against`` (default: clip) on the same images, draw by draw (its mean
and its worst). Each run keeps its summary, metrics and config; ``--keep-runs`` keeps its checkpoints and models
too. ``--fuse-ridge 0.5`` also scores each run's last model beside the ridge map on the same pooled features, a
pair's cosine half the model's and half the map's (``fuse_ridge.py``): a row RECIPE+ridge0.5.
``--image-backbone efficientnet-lite2 --image-size 192``: every method on another locked image tower than the
preset's, the baselines too.

Zero-shot: each class name put into the task's templates, embedded by the method's own text side. Prints the
table (mean ± std over seeds), writes compare.json and compare.png into --out. ``--quick``: a tiny subset, one
seed, one epoch (the test's mode).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

try:  # imported as tools.experiments.compare_contrastive (the tests), or run as a script from this folder
    from tools.experiments.compare_report import (
        FIGURES,
        Report,
        across_draws,
        line,
        plot,
        print_across,
        print_table,
        table,
    )
    from tools.experiments.contrastive_baselines import MAX_LENGTH, frozen_features, probe, ridge
    from tools.experiments.fuse_ridge import RidgeMaps, fused_figures, model_embeddings
except ImportError:
    from compare_report import FIGURES, Report, across_draws, line, plot, print_across, print_table, table
    from contrastive_baselines import MAX_LENGTH, frozen_features, probe, ridge
    from fuse_ridge import RidgeMaps, fused_figures, model_embeddings

ROOT = Path(__file__).resolve().parents[2]
BUILDERS = {  # set name -> its builder script, run as ``python SCRIPT OUT_DIR``
    "icons": ROOT.parent / "shared" / "data" / "oxygen_icons.py",
    "emoji": ROOT / "tools" / "datasets" / "build_emoji_set.py",
    "xfce": ROOT / "tools" / "datasets" / "build_xfce_icons_set.py",
}
METHODS = ("ridge", "probe", "clip", "siglip")
POOLED = {"": None, "-ms": "multiscale"}  # the baselines on the preset's pooled features, or on multiscale ones
LONGER = {"epochs": 16, "feature_views": 2}  # what the cache's cheaper epochs may buy
# both towers locked on multiscale features, the centre view only (augmented views trained worse on these sets)
MS_LOCKED = {"image_pool": "multiscale", "freeze_text": True, "feature_cache": "on", "augment": False}
MS_LOCKED["feature_views"] = 1
LOCKED = {k: v for k, v in MS_LOCKED.items() if k != "image_pool"}  # both locked, the head's pooled features
# the same, the text tower's top 2 layers training (its lower 4 layers' output cached)
MS_TOP2 = {**{k: v for k, v in MS_LOCKED.items() if k != "freeze_text"}, "text_train_layers": 2}
TOP2 = {k: v for k, v in MS_TOP2.items() if k != "image_pool"}  # the same on the head's pooled features
# siglip-ms-top2-32-slow's variants: a longer warm-up, the text tower slower or faster, more of its layers training
VARIANTS = [("warm", {"warmup_frac": 0.3}), ("enc1e-5", {"encoder_lr": 1e-5}), ("enc1e-4", {"encoder_lr": 1e-4})]
VARIANTS += [("top4", {"text_train_layers": 4}), ("top6", {"text_train_layers": 6})]
TOP4 = {"-enc1e-4": {"encoder_lr": 1e-4}, **{f"-wise{a:g}": {"wise_ft": a} for a in (0.5, 0.7)}}  # --wise-ft A
TOP4["-zsmap"] = {"zero_shot_map": "kernel"}  # zero-shot beside a kernel map into the start text tower
VARIANTS += [(f"top4{k}", {"text_train_layers": 4, **v}) for k, v in TOP4.items()]
# The dual encoder's recipes (``--methods``): its loss and the training fields it sets on top of the preset's.
# clip / siglip are the preset's own; the others train fewer text layers (or none) on cached features.
RECIPES = {
    "clip": ("clip", {}),
    "siglip": ("siglip", {}),
    "clip-top2": ("clip", {"text_train_layers": 2, "feature_cache": "on"}),
    "clip-top1": ("clip", {"text_train_layers": 1, "feature_cache": "on"}),
    "clip-locked": ("clip", {"freeze_text": True, "feature_cache": "on"}),
    "siglip-top2": ("siglip", {"text_train_layers": 2, "feature_cache": "on"}),
    "clip-top2-16": ("clip", {"text_train_layers": 2, "feature_cache": "on", **LONGER}),
    "siglip-top2-16": ("siglip", {"text_train_layers": 2, "feature_cache": "on", **LONGER}),
    "siglip-top1": ("siglip", {"text_train_layers": 1, "feature_cache": "on"}),
    "siglip-locked": ("siglip", {"freeze_text": True, "feature_cache": "on"}),
    "siglip-top2-slow": ("siglip", {"text_train_layers": 2, "feature_cache": "on", "encoder_lr": 1e-5}),
    # multiscale image features (--image-pool multiscale): today's recipe on them, and both towers locked
    "clip-ms": ("clip", {"image_pool": "multiscale"}),
    **{
        f"{loss}-locked-ms-{epochs}": (loss, {**MS_LOCKED, "epochs": epochs})
        for loss in ("clip", "siglip")
        for epochs in (8, 16, 32)
    },
    "siglip-locked-ms-32-slow": ("siglip", {**MS_LOCKED, "epochs": 32, "lr": 3e-4}),
    # the same on the head's pooled features, which open_clip and transformers can hold
    "siglip-locked-32": ("siglip", {**LOCKED, "epochs": 32}),
    "siglip-locked-32-slow": ("siglip", {**LOCKED, "epochs": 32, "lr": 3e-4}),
    "siglip-ms-slow": ("siglip", {"image_pool": "multiscale", "lr": 3e-4}),
    "siglip-locked-ms-32-mid": ("siglip", {**MS_LOCKED, "epochs": 32, "lr": 5e-4}),
    "siglip-ms-top2-slow": ("siglip", {**MS_TOP2, "epochs": 16, "lr": 3e-4}),
    **{f"siglip-ms-top2-{e}-slow": ("siglip", {**MS_TOP2, "epochs": e, "lr": 3e-4}) for e in (24, 32, 48)},
    **{f"clip-ms-top2-{e}-slow": ("clip", {**MS_TOP2, "epochs": e, "lr": 3e-4}) for e in (16, 32)},
    "siglip-ms-top2-32-mid": ("siglip", {**MS_TOP2, "epochs": 32, "lr": 5e-4}),
    "siglip-top2-32-slow": ("siglip", {**TOP2, "epochs": 32, "lr": 3e-4}),
    **{f"siglip-ms-top2-32-{k}": ("siglip", {**MS_TOP2, "epochs": 32, "lr": 3e-4, **v}) for k, v in VARIANTS},
}
QUICK_ROWS = 120


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sets", nargs="+", default=["icons", "emoji"], help="icons, emoji, or paths")
    baselines = [f"{b}{suffix}" for suffix in POOLED for b in ("ridge", "probe")]
    p.add_argument(
        "--methods",
        nargs="+",
        default=list(METHODS),
        choices=list(dict.fromkeys([*METHODS, *baselines, *RECIPES])),
    )
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--preset", default="clip-lite0-minilm", help="the towers and the recipe of clip / siglip")
    p.add_argument("--image-backbone", default=None, help="the preset's image tower, another (every method)")
    p.add_argument("--image-size", type=int, default=None, help="the preset's image side, another (every method)")
    p.add_argument("--embed-dim", type=int, default=256, help="the probe's and the dual encoder's embedding width")
    p.add_argument("--epochs", type=int, default=None, help="override the preset's epochs (clip / siglip)")
    p.add_argument("--batch-size", type=int, default=None, help="override the preset's batch (clip / siglip)")
    p.add_argument("--limit", type=int, default=None, help="only this many rows of each set's manifest (spread)")
    p.add_argument("--quick", action="store_true", help=f"{QUICK_ROWS} rows, the first seed, 1 epoch of batch 16")
    p.add_argument("--out", default="bench_out/contrastive", help="folder for the runs, compare.json, compare.png")
    p.add_argument("--cache", default=None, help="where sets are built and prepared (default: OUT/sets)")
    p.add_argument("--probe-epochs", type=int, default=60, help="the most epochs the probe's held-out part picks")
    p.add_argument("--threads", type=int, default=None, help="DALI threads (default: all cores)")
    p.add_argument("--reuse-runs", action="store_true", help="read the runs already finished in OUT/runs")
    p.add_argument("--keep-runs", action="store_true", help="keep each run's checkpoints and models too")
    p.add_argument(
        "--inner-seed",
        nargs="+",
        type=int,
        default=[1],
        help="--inner: the seeds that draw the inner val, one draw each (several: a table across the draws too)",
    )
    p.add_argument(
        "--against", default="clip", help="the method the others are compared with, draw by draw (default: clip)"
    )
    p.add_argument(
        "--fuse-ridge",
        nargs="+",
        type=float,
        default=[],
        metavar="W",
        help="also score each run's model beside the ridge map on the same pooled features: cosine = W model's + "
        "(1 - W) the map's, a row RECIPE+ridgeW per weight (tools/experiments/fuse_ridge.py)",
    )
    p.add_argument(
        "--inner",
        action="store_true",
        help="score on an inner split, never on val: each set's train split split again (a fifth of its images, "
        "drawn with another seed), where a recipe is chosen",
    )
    args = p.parse_args(argv)
    _check(p, args)
    if args.quick:
        return argparse.Namespace(
            **{
                **vars(args),
                "limit": args.limit or QUICK_ROWS,
                "seeds": args.seeds[:1],
                "epochs": 1,
                "batch_size": 16,
                "probe_epochs": 4,
            }
        )
    return args


def _check(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The flags' combinations argparse cannot check: each a usage error (exit 2)."""
    if len(set(args.inner_seed)) < len(args.inner_seed):
        p.error(f"--inner-seed: a draw named twice ({args.inner_seed})")
    if min(args.inner_seed) < 1:  # 0 draws the outer split's own val fifth
        p.error(f"--inner-seed: a draw's seed is 1 or more ({args.inner_seed})")
    if len(args.inner_seed) > 1 and not args.inner:
        p.error("--inner-seed with several seeds draws several inner splits: add --inner")
    if len(args.inner_seed) > 1 and args.against not in args.methods:
        p.error(f"--against {args.against}: not among --methods, so nothing to compare the draws with")
    if any(not 0.0 <= w <= 1.0 for w in args.fuse_ridge):
        p.error(f"--fuse-ridge: a weight lies in [0, 1] ({args.fuse_ridge})")


# ----------------------------------------------------------------------------------------------- the sets


def source_of(name: str, cache: Path) -> Path:
    """A named set built once into ``cache`` (its manifest), or the path given."""
    if name not in BUILDERS:
        if not Path(name).exists():
            raise ValueError(f"set '{name}': no such path; name one of {', '.join(BUILDERS)} or a path")
        return Path(name)
    target = cache / name
    if not (target / "manifest.jsonl").is_file():
        if not BUILDERS[name].is_file():
            raise ValueError(f"set '{name}': its builder {BUILDERS[name]} is missing; pass a manifest instead")
        subprocess.run([sys.executable, str(BUILDERS[name]), str(target)], check=True)
    return target / "manifest.jsonl"


def set_label(name: str) -> str:
    """What the table calls a set: its name, a folder's name, a file's stem (a manifest.* file: its folder's)."""
    path = Path(name)
    if name in BUILDERS or path.is_dir():
        return path.name
    return path.parent.name if path.stem == "manifest" else path.stem


def subset(manifest: Path, limit: int, target: Path) -> Path:
    """A manifest of ``limit`` rows of ``manifest`` spread evenly over it (its categories, when it is sorted by
    them), image paths made absolute."""
    rows = [json.loads(line) for line in manifest.read_text(encoding="utf-8").splitlines() if line.strip()]
    picked = [rows[int(k * len(rows) / limit)] for k in range(min(limit, len(rows)))]
    for r in picked:
        r["image"] = str((manifest.parent / r["image"]).resolve())
    return _write_manifest(picked, target)


def _write_manifest(rows: list[dict], target: Path) -> Path:
    """``rows`` written as ``target``/manifest.jsonl, one JSON object a line."""
    target.mkdir(parents=True, exist_ok=True)
    out = target / "manifest.jsonl"
    out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return out


def inner_manifest(prepared: Path, target: Path) -> tuple[Path, Path]:
    """A manifest of a prepared set's train split (image paths absolute, label names), the rows an inner split
    divides again; with the folder that holds every image (the split keys them relative to it, so the draw does
    not depend on where --cache lies).

    Raises:
        ValueError: the prepared set reads its images in place (shard members), which a manifest cannot name.
    """
    from mmfast.data.dataset import PreparedDataset

    dataset = PreparedDataset(prepared)
    names = {v: k for k, v in dataset.labels.items()}
    rows = []
    for r in dataset.iter_rows("train"):
        image = prepared / r["image"]  # a relative path names a file inside the prepared directory
        if "tar" in r or not image.is_file():
            raise ValueError(f"--inner: {prepared}'s image {r['image']} is not a file; prepare the set from files")
        rows.append({"image": str(image.resolve()), "text": r["text"], "label": names[r["label"]]})
    out = _write_manifest(rows, target)
    return out, Path(os.path.commonpath([r["image"] for r in rows])).parent


def prepared_set(
    name: str, cache: Path, preset: str, limit: int | None, inner: bool = False, inner_seed: int = 1
) -> Path:
    """The set prepared once (val fifth by image hash, captions tokenized for the preset's text model); with
    ``inner``, its train split prepared again into an inner train and val (the hash drawn with ``inner_seed``),
    in a folder named after those rows and the seed: a set prepared anew gets its own inner split.

    Raises:
        ValueError: ``limit`` with a set given already prepared (its rows are what they are); ``inner_seed`` 0
            (the outer split's own draw).
    """
    from mmfast.models import get_preset

    source = source_of(name, cache)
    label = set_label(name)
    tag = f"{label}-{limit}" if limit else label
    text_model = get_preset(preset).text_model
    outer = source
    if not (source / "prepare.json").is_file():
        if limit:
            source = subset(source, limit, cache / "subsets" / tag)
        outer = _prepare(source, cache / "prepared" / f"{tag}-{text_model}", text_model, seed=0)
    elif limit:
        raise ValueError(f"--limit: {name} is already prepared; pass its manifest to take part of it")
    if not inner:
        return outer
    if inner_seed == 0:
        raise ValueError("--inner-seed 0 draws the outer split's own val fifth: choose another seed")
    rows, root = inner_manifest(outer, cache / "inner" / tag)
    key = hashlib.sha256(rows.read_bytes()).hexdigest()[:8]
    target = cache / "prepared" / f"{tag}-inner{inner_seed}-{key}-{text_model}"
    return _prepare(rows, target, text_model, seed=inner_seed, root=root)


def _prepare(source: Path, target: Path, text_model: str, seed: int, root: Path | None = None) -> Path:
    """``source`` prepared into ``target`` once, its val fifth drawn by ``seed`` (image keys relative to
    ``root``, else to the source's folder)."""
    from mmfast.inputs import InputOptions
    from mmfast.prepare.core import PrepareConfig, prepare_dataset
    from mmfast.train.setup import pretrained_tokenizer

    if not (target / "prepare.json").is_file():
        tokenizer = pretrained_tokenizer(text_model)
        inputs = InputOptions(image_root=str(root) if root else None)
        cfg = PrepareConfig(
            source=str(source),
            out=str(target),
            tokenizer=tokenizer,
            max_length=MAX_LENGTH,
            seed=seed,
            progress=False,
            inputs=inputs,
        )
        prepare_dataset(cfg)
    return target


# ------------------------------------------------------------------------------- (c) mmfast's dual encoder


def dual_encoder(args: argparse.Namespace, data_dir: Path, recipe: str, seed: int, run_dir: Path) -> dict:
    """(c): one training run of --model clip with the preset's recipe and ``RECIPES[recipe]``'s changes; the
    figures of its last evaluation."""
    from mmfast.train import train
    from mmfast.train.config import TrainConfig

    loss, changes = RECIPES[recipe][0], dict(RECIPES[recipe][1])
    if changes.get("feature_cache") == "on":  # one cache per set, shared by its recipes' runs
        changes = {**changes, "feature_cache_dir": str(run_dir.parent.parent / "features" / data_dir.name)}
    cfg = TrainConfig(
        data=str(data_dir),
        out=str(run_dir),
        overwrite=True,
        model="clip",
        preset=args.preset,
        loss=loss,
        embed_dim=args.embed_dim,
        seed=seed,
        epochs=changes.pop("epochs", args.epochs),
        batch_size=args.batch_size,
        num_threads=args.threads,
        progress=False,
        **image_of(args),
        **changes,
    )
    if not (args.reuse_runs and (run_dir / "summary.json").is_file()):
        train(cfg)
    return run_figures(run_dir, seed)


def image_of(args: argparse.Namespace) -> dict:
    """--image-backbone / --image-size: the image tower every method uses in place of the preset's."""
    return {"image_backbone": args.image_backbone, "image_size": args.image_size}


def run_figures(run_dir: Path, seed: int) -> dict:
    """A finished run's last evaluation (every val figure of metrics.jsonl's last evaluated epoch) and time."""
    summary = json.loads((run_dir / "summary.json").read_text())
    evals = [m for m in _read_jsonl(run_dir / "metrics.jsonl") if "val_i2t_r1" in m]
    if not evals:
        raise ValueError(f"{run_dir}: the run wrote no evaluation")
    last = evals[-1]
    keys = (*FIGURES, "mean_recall", "i2t_median_rank", "t2i_median_rank", "images")
    figures = {k: last.get(f"val_{k}") for k in keys}
    return {**figures, "seed": seed, "train_s": summary["wall_s"], "epoch": last.get("epoch"), "run": str(run_dir)}


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def baselines(args: argparse.Namespace, name: str, cache: Path, save, maps: RidgeMaps, draw: int = 1) -> tuple:
    """Prepare one set (with --inner: the inner split ``draw`` draws) and run the frozen-tower baselines on it
    (--fuse-ridge: fit its ridge maps into ``maps``); returns (the set's label, its prepared dir)."""
    data_dir = prepared_set(name, cache, args.preset, args.limit, args.inner, draw)
    label = set_label(name) + (f"-inner{draw}" if args.inner else "")  # runs of two draws never mix
    prep = json.loads((data_dir / "prepare.json").read_text())
    facts = save.facts[label] = {"prepared": str(data_dir), "counts": prep.get("counts")}
    got = save.results.setdefault(label, {})
    for suffix, pool in POOLED.items():
        names = {"ridge": f"ridge{suffix}", "probe": f"probe{suffix}"}
        if not set(names.values()) & set(args.methods):
            continue
        feats = frozen_features(data_dir, args.preset, args.threads, pool, image_of(args))
        facts[f"features{suffix}_s"] = feats["seconds"]
        if args.fuse_ridge:
            maps.add((label, pool), feats)
        if names["ridge"] in args.methods:
            got[names["ridge"]] = [ridge(feats)]
            save(f"{label}: {names['ridge']} {line(got[names['ridge']][0])}")
        if names["probe"] in args.methods:
            for seed in args.seeds:
                got.setdefault(names["probe"], []).append(probe(feats, args.embed_dim, seed, args.probe_epochs))
                save(f"{label}: {names['probe']} seed {seed} {line(got[names['probe']][-1])}")
    return label, data_dir


def dual_encoders(args: argparse.Namespace, sets: dict[str, Path], out: Path, save, maps: RidgeMaps) -> None:
    """The dual encoder's recipes on every set, seed by seed (the first seed of everything comes first)."""
    for seed in args.seeds:
        for label, data_dir in sets.items():
            for recipe in [m for m in RECIPES if m in args.methods]:
                run_dir = out / "runs" / f"{label}-{recipe}-seed{seed}"
                run = dual_encoder(args, data_dir, recipe, seed, run_dir)
                save.results[label].setdefault(recipe, []).append(run)
                save(f"{label}: {recipe} seed {seed} {line(run)}")
                if args.fuse_ridge:
                    fuse(args, (label, data_dir), recipe, run, (save, maps))
                if not args.keep_runs:  # the runs would fill a disk: the figures are in summary and metrics
                    for bulky in ("checkpoints", "model", "model-last"):
                        shutil.rmtree(run_dir / bulky, ignore_errors=True)


def fuse(args: argparse.Namespace, data: tuple[str, Path], recipe: str, run: dict, to: tuple) -> None:
    """--fuse-ridge: the run's last model beside the ridge map on the frozen features its image tower pools as
    (``fuse_ridge.py``), a row per weight; ``to``: (the report, the ridge maps)."""
    (label, data_dir), (save, maps) = data, to
    pool = RECIPES[recipe][1].get("image_pool")
    if (label, pool) not in maps:  # a pool no baseline ran on: fitted for the first recipe that needs it
        maps.add((label, pool), frozen_features(data_dir, args.preset, args.threads, pool, image_of(args)))
    model = model_embeddings(Path(run["run"]) / "model-last", data_dir, args.threads)
    for w, figures in fused_figures(model, maps[(label, pool)], args.fuse_ridge).items():
        name = f"{recipe}+ridge{w:g}"
        row = {**figures, "seed": run["seed"], "train_s": run["train_s"]}
        save.results[label].setdefault(name, []).append(row)
        save(f"{label}: {name} seed {run['seed']} {line(row)}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    out = Path(args.out)
    cache = Path(args.cache) if args.cache else out / "sets"
    out.mkdir(parents=True, exist_ok=True)
    report = {
        k: getattr(args, k)
        for k in (
            "preset",
            "seeds",
            "limit",
            "epochs",
            "batch_size",
            "embed_dim",
            "inner",
            "inner_seed",
            "against",
        )
    }
    if not args.inner:
        report["inner_seed"] = None
    save = Report(out / "compare.json", report)
    draws, maps = (args.inner_seed if args.inner else [None]), RidgeMaps()
    try:
        sets = dict(baselines(args, name, cache, save, maps, draw) for draw in draws for name in args.sets)
        dual_encoders(args, sets, out, save, maps)
    except (ValueError, OSError, subprocess.CalledProcessError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows = table(save.results)
    print_table(rows, save.facts)
    if args.inner and len(args.inner_seed) > 1:
        print_across(across_draws(rows, args.against), args.against)
    plot(rows, f"preset {args.preset}, seeds {args.seeds}", out / "compare.png")
    print(f"\nwrote {out / 'compare.json'} and {out / 'compare.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
