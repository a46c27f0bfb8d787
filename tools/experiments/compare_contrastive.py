"""mmfast's contrastive recipes (--model clip, --loss clip and siglip) against two baselines on frozen
pretrained towers, on real captioned sets: retrieval both ways and zero-shot accuracy, one table.

    python tools/experiments/compare_contrastive.py [--sets icons emoji] [--seeds 0 1 2]
        [--methods ridge probe clip siglip] [--preset clip-lite0-minilm] [--out bench_out/contrastive]

A set is "icons" (the Oxygen icon theme, built by ../shared/data/oxygen_icons.py), "emoji" (Noto emoji,
tools/datasets/build_emoji_set.py), "xfce" (the elementary-xfce icon theme,
tools/datasets/build_xfce_icons_set.py), a manifest / image folder, or a prepared directory; it is built and
prepared once (the captions tokenized for the preset's text model) into --cache. Every method is scored on the same
val split by the same figures (``mmfast.tasks.retrieval``, images grouped as the contrastive task groups them):

- ridge: the preset's towers frozen (the image tower's pooled features, the text model's mean-pooled features,
  L2-normalized: T); the closed-form ridge map W = argmin ||X W - T||^2 + lambda ||W||^2 from standardized
  image features X to T, fitted on the train split, lambda picked on a held-out fifth of it. Images are
  normalize(X W), texts normalize(T); no training.
- probe: the same cached features, two bias-free linear projections into --embed-dim trained with the CLIP loss
  (mmfast's, learnable temperature) by Adam; the epoch count is picked on the held-out fifth of train, then the
  projections are trained again on the whole train split.
- clip / siglip: ``mmfast.train.train`` with the preset's recipe and that loss, for every seed; the figures are
  the last epoch's evaluation (not the best one: choosing it would be tuning on val). clip-top2 / clip-top1 /
  clip-locked / siglip-top2 (``RECIPES``): the same with only the text tower's top 2 or 1 layers training, or
  none, on cached features (--feature-cache on, one cache folder per set under --out); a "-16" recipe trains 16
  epochs on 2 stored views.

Zero-shot: each class name put into the task's templates, embedded by the method's own text side. Prints the
table (mean ± std over seeds), writes compare.json and compare.png into --out. ``--quick``: a tiny subset, one
seed, one epoch (the test's mode).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BUILDERS = {  # set name -> its builder script, run as ``python SCRIPT OUT_DIR``
    "icons": ROOT.parent / "shared" / "data" / "oxygen_icons.py",
    "emoji": ROOT / "tools" / "datasets" / "build_emoji_set.py",
    "xfce": ROOT / "tools" / "datasets" / "build_xfce_icons_set.py",
}
METHODS = ("ridge", "probe", "clip", "siglip")
LONGER = {"epochs": 16, "feature_views": 2}  # what the cache's cheaper epochs may buy
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
}
FIGURES = ("i2t_r1", "i2t_r5", "i2t_r10", "t2i_r1", "t2i_r5", "t2i_r10", "zero_shot_acc")
RIDGE_LAMBDAS = (1e-3, 1e-2, 1e-1, 1.0, 10.0, 100.0)  # times the number of training samples
PROBE = {"every": 2, "lr": 1e-3, "batch_size": 64}  # the probe's Adam; its epochs checked every "every"
HELD_OUT = 0.2  # share of the train split the baselines choose lambda / epochs on
QUICK_ROWS = 120
MAX_LENGTH = 32  # tokens per caption and prompt: TrainConfig's default when a run prepares its own data


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sets", nargs="+", default=["icons", "emoji"], help="icons, emoji, or paths")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=[*METHODS, *RECIPES])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--preset", default="clip-lite0-minilm", help="the towers and the recipe of clip / siglip")
    p.add_argument("--embed-dim", type=int, default=256, help="the probe's and the dual encoder's embedding width")
    p.add_argument("--epochs", type=int, default=None, help="override the preset's epochs (clip / siglip)")
    p.add_argument("--batch-size", type=int, default=None, help="override the preset's batch (clip / siglip)")
    p.add_argument(
        "--limit", type=int, default=None, help="only this many rows of each set's manifest (spread evenly)"
    )
    p.add_argument("--quick", action="store_true", help=f"{QUICK_ROWS} rows, the first seed, 1 epoch of batch 16")
    p.add_argument("--out", default="bench_out/contrastive", help="folder for the runs, compare.json, compare.png")
    p.add_argument("--cache", default=None, help="where sets are built and prepared (default: OUT/sets)")
    p.add_argument("--probe-epochs", type=int, default=60, help="the most epochs the probe's held-out part picks")
    p.add_argument("--threads", type=int, default=None, help="DALI threads (default: all cores)")
    p.add_argument(
        "--reuse-runs", action="store_true", help="read the clip / siglip runs already finished in OUT/runs"
    )
    args = p.parse_args(argv)
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
    target.mkdir(parents=True, exist_ok=True)
    out = target / "manifest.jsonl"
    out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in picked), encoding="utf-8")
    return out


def prepared_set(name: str, cache: Path, preset: str, limit: int | None) -> Path:
    """The set prepared once (val fifth by image hash, captions tokenized for the preset's text model)."""
    from mmfast.models import get_preset
    from mmfast.prepare.core import PrepareConfig, prepare_dataset
    from mmfast.train.setup import pretrained_tokenizer

    source = source_of(name, cache)
    if (source / "prepare.json").is_file():
        return source
    label = set_label(name)
    tag = f"{label}-{limit}" if limit else label
    if limit:
        source = subset(source, limit, cache / "subsets" / tag)
    target = cache / "prepared" / f"{tag}-{get_preset(preset).text_model}"
    if not (target / "prepare.json").is_file():
        tokenizer = pretrained_tokenizer(get_preset(preset).text_model)
        prepare_dataset(
            PrepareConfig(
                source=str(source), out=str(target), tokenizer=tokenizer, max_length=MAX_LENGTH, progress=False
            )
        )
    return target


# ------------------------------------------------------------------------------------ frozen tower features


def frozen_features(data_dir: Path, preset: str, threads: int | None) -> dict:
    """The preset's pretrained towers, frozen, over both splits as the training run's evaluation sees them (the
    eval loader: resize + center crop at the preset's size, the encoder's mean / std).

    Returns:
        {"train"/"val": {"x": (N, C_img) image features, "t": (N, D_txt) normalized text features, "label",
        "group": (N,) image group (the contrastive task's)}, "prompts": (C, T, D_txt) normalized prompt
        features, "seconds": the time it took}.
    """
    import torch

    from mmfast.data.dataset import PreparedDataset
    from mmfast.data.tokenizer import load_tokenizer
    from mmfast.models import get_preset
    from mmfast.models.encoders import ImageEncoder, TextEncoder
    from mmfast.tasks.contrastive import sample_groups
    from mmfast.tasks.retrieval import DEFAULT_TEMPLATES, class_prompts

    t0 = time.perf_counter()
    spec = get_preset(preset)
    dataset = PreparedDataset(data_dir)
    image = ImageEncoder(spec.image_backbone, freeze=True).eval()
    text = TextEncoder(spec.text_model, freeze=True).eval()
    groups = sample_groups(dataset)[0]
    out = {
        split: _split_features(dataset, split, image, text, spec.image_size, threads) for split in ("train", "val")
    }
    for split in out.values():
        split["group"] = groups[split.pop("id")]
    names = sorted(dataset.labels, key=dataset.labels.get)
    flat = [p for per in class_prompts(names, DEFAULT_TEMPLATES) for p in per]
    enc = load_tokenizer(dataset.tokenizer_dir)(
        flat, padding=True, truncation=True, max_length=MAX_LENGTH, return_tensors="pt"
    )
    with torch.no_grad():
        prompts = torch.nn.functional.normalize(text(enc["input_ids"], enc["attention_mask"]), dim=-1)
    out["prompts"] = prompts.reshape(len(names), len(DEFAULT_TEMPLATES), -1)
    out["seconds"] = time.perf_counter() - t0
    return out


def _split_features(dataset, split: str, image, text, size: int, threads: int | None) -> dict:
    import torch

    from mmfast.loading.multimodal import MultimodalLoader

    norm = {"mean": tuple(255 * m for m in image.mean), "std": tuple(255 * s for s in image.std)}
    loader = MultimodalLoader(
        dataset,
        split,
        64,
        shuffle=False,
        drop_last=False,
        train=False,
        size=size,
        fp16=False,
        num_workers=threads,
        **norm,
    )
    parts: dict[str, list] = {"x": [], "t": [], "label": [], "id": []}
    with torch.no_grad():
        for batch in loader:
            keep = batch["id"] >= 0  # padding of the last batch
            parts["x"].append(image(batch["image"].float())[0][keep])
            pooled = text(batch["input_ids"], batch["attention_mask"])[keep]
            parts["t"].append(torch.nn.functional.normalize(pooled, dim=-1))
            parts["label"].append(batch["label"][keep])
            parts["id"].append(batch["id"][keep])
    got = {k: torch.cat(v) for k, v in parts.items()}
    order = got["id"].argsort()
    return {k: v[order] for k, v in got.items()}


def score(img, txt, split: dict, class_emb) -> dict:
    """Retrieval both ways (one entry per distinct image, its captions grouped) and zero-shot accuracy of the
    embeddings of ``split``'s samples (row i: sample i), in the task's own figures."""
    import torch

    from mmfast.tasks.retrieval import caption_groups, retrieval_figures, zero_shot_figures

    img, txt = torch.nn.functional.normalize(img, dim=-1), torch.nn.functional.normalize(txt, dim=-1)
    first, text_image = caption_groups(split["group"].tolist())
    figures = retrieval_figures(img[first], txt, text_image)
    figures |= zero_shot_figures(img[first], split["label"][first], class_emb)
    return {**figures, "images": len(first)}


def _held_out(split: dict, seed: int = 0) -> tuple[dict, dict]:
    """(fit, held-out): the train split cut by image group, HELD_OUT of the groups held out."""
    import torch

    groups = split["group"].unique()
    g = torch.Generator().manual_seed(seed)
    held = set(groups[torch.randperm(len(groups), generator=g)[: max(1, int(HELD_OUT * len(groups)))]].tolist())
    mask = torch.tensor([int(x) in held for x in split["group"]])
    return {k: v[~mask] for k, v in split.items()}, {k: v[mask] for k, v in split.items()}


def _standardize(train_x):
    mean, std = train_x.mean(0), train_x.std(0).clamp(min=1e-6)
    return lambda x: (x - mean) / std


# ----------------------------------------------------------------------------------------------- (a) ridge


def _ridge_fit(x, t, lam: float):
    """W (C, D) and the mean of T: ridge from centered x to centered t, closed form (the dual when N < C)."""
    import torch

    x, t = x.double(), t.double()
    t_mean = t.mean(0)
    tc = t - t_mean
    n, c = x.shape
    if n < c:
        w = x.T @ torch.linalg.solve(x @ x.T + lam * torch.eye(n, dtype=x.dtype), tc)
    else:
        w = torch.linalg.solve(x.T @ x + lam * torch.eye(c, dtype=x.dtype), x.T @ tc)
    return w.float(), t_mean.float()


def ridge(feats: dict) -> dict:
    """(a): image features mapped into the text model's space by ridge; lambda by held-out mean recall."""
    from mmfast.tasks.retrieval import class_embeddings

    t0 = time.perf_counter()
    class_emb = class_embeddings(feats["prompts"])
    fit, held = _held_out(feats["train"])
    std = _standardize(fit["x"])
    picks = {}
    for k in RIDGE_LAMBDAS:
        w, t_mean = _ridge_fit(std(fit["x"]), fit["t"], k * len(fit["x"]))
        picks[k] = score(std(held["x"]) @ w + t_mean, held["t"], held, class_emb)["mean_recall"]
    lam = max(picks, key=picks.get)
    train, val = feats["train"], feats["val"]
    std = _standardize(train["x"])
    w, t_mean = _ridge_fit(std(train["x"]), train["t"], lam * len(train["x"]))
    figures = score(std(val["x"]) @ w + t_mean, val["t"], val, class_emb)
    return {**figures, "lambda_per_sample": lam, "train_s": time.perf_counter() - t0}


# ------------------------------------------------------------------------------------ (b) the linear probe


def _probe_train(train: dict, epochs: int, dim: int, seed: int, check=None) -> tuple:
    """Two linear projections trained with mmfast's CLIP loss on cached features; ``check(project)`` is called
    every PROBE["every"] epochs. Returns (project: x, t -> (image emb, text emb), the checks' results)."""
    import math

    import torch

    from mmfast.tasks.contrastive import contrastive_loss

    torch.manual_seed(seed)
    std = _standardize(train["x"])
    x, t, group = std(train["x"]), train["t"], train["group"]
    img_proj = torch.nn.Linear(x.shape[1], dim, bias=False)
    txt_proj = torch.nn.Linear(t.shape[1], dim, bias=False)
    logit_scale = torch.nn.Parameter(torch.tensor(math.log(1 / 0.07)))
    params = [*img_proj.parameters(), *txt_proj.parameters(), logit_scale]
    opt = torch.optim.Adam(params, lr=PROBE["lr"])
    text_group = _caption_groups_of(train)

    def project(xs, ts):
        with torch.no_grad():
            return img_proj(std(xs)), txt_proj(ts)

    results = []
    for epoch in range(1, epochs + 1):
        for idx in torch.randperm(len(x)).split(PROBE["batch_size"]):
            out = {
                "image": torch.nn.functional.normalize(img_proj(x[idx]), dim=-1),
                "text": torch.nn.functional.normalize(txt_proj(t[idx]), dim=-1),
                "logit_scale": logit_scale.clamp(max=math.log(100.0)).exp(),
                "logit_bias": torch.zeros(()),
            }
            ids = torch.arange(len(idx))
            loss = contrastive_loss("clip", out, ids, torch.stack([group[idx], text_group[idx]]))
            opt.zero_grad()
            loss.backward()
            opt.step()
        if check is not None and epoch % PROBE["every"] == 0:
            results.append((epoch, check(project)))
    return project, results


def _caption_groups_of(split: dict):
    """(N,) a group per distinct text feature (identical captions embed identically): not each other's
    negatives, as in the task's loss."""
    import torch

    _, inverse = torch.unique(split["t"], dim=0, return_inverse=True)
    return inverse


def _probe_score(project, split: dict, prompts) -> dict:
    """``score`` of the projected features of ``split``, zero-shot with the projected prompts (C, T, D_txt)."""
    from mmfast.tasks.retrieval import class_embeddings

    img, txt = project(split["x"], split["t"])
    _, cls = project(split["x"][:1], prompts.flatten(0, 1))
    return score(img, txt, split, class_embeddings(cls.reshape(*prompts.shape[:2], -1)))


def probe(feats: dict, dim: int, seed: int, max_epochs: int) -> dict:
    """(b): the linear probe; its epochs by held-out mean recall, then trained again on the whole train split."""
    t0 = time.perf_counter()
    fit, held = _held_out(feats["train"])

    def check(project) -> float:
        return _probe_score(project, held, feats["prompts"])["mean_recall"]

    _, curve = _probe_train(fit, max_epochs, dim, seed, check)
    epochs = max(curve, key=lambda c: c[1])[0]
    project, _ = _probe_train(feats["train"], epochs, dim, seed)
    figures = _probe_score(project, feats["val"], feats["prompts"])
    return {**figures, "epochs": epochs, "seed": seed, "train_s": time.perf_counter() - t0}


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
        **changes,
    )
    if not (args.reuse_runs and (run_dir / "summary.json").is_file()):
        train(cfg)
    return run_figures(run_dir, seed)


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


# --------------------------------------------------------------------------------------------- the report


def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def table(results: dict[str, dict[str, list[dict]]]) -> list[dict]:
    """One row per (set, method): each figure's mean and std over the method's runs, the mean and the least
    train time."""
    rows = []
    for set_name, methods in results.items():
        for method, runs in methods.items():
            row = {"set": set_name, "method": method, "runs": len(runs)}
            for k in FIGURES:
                row[k], row[f"{k}_std"] = _mean_std([r[k] for r in runs])
            row["train_s"] = statistics.fmean(r["train_s"] for r in runs)
            row["train_s_min"] = min(r["train_s"] for r in runs)  # the least disturbed run on a shared machine
            rows.append(row)
    return rows


def print_table(rows: list[dict], facts: dict[str, dict]) -> None:
    heads = ["i2t R@1", "i2t R@5", "i2t R@10", "t2i R@1", "t2i R@5", "t2i R@10", "zero-shot"]
    head = f"\n{'set':<10}{'method':<12}{'n':>2}" + "".join(f"{h:>14}" for h in heads)
    print(head + f"{'train s':>9}{'least':>7}")
    for r in rows:
        cells = "".join(f"{r[k]:>8.1f} ± {r[k + '_std']:<3.1f}" for k in FIGURES)
        print(f"{r['set']:<10}{r['method']:<12}{r['runs']:>2}{cells}{r['train_s']:>9.0f}{r['train_s_min']:>7.0f}")
    for name, f in facts.items():
        if "features_s" in f:
            print(f"{name}: the frozen towers' features (ridge and probe share them) took {f['features_s']:.0f} s")


def plot(rows: list[dict], title: str, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logging.warning("matplotlib is not installed: no compare.png")
        return
    sets = list(dict.fromkeys(r["set"] for r in rows))
    shown = ("i2t_r1", "t2i_r1", "i2t_r10", "t2i_r10", "zero_shot_acc")
    fig, axes = plt.subplots(1, len(sets), figsize=(5.5 * len(sets), 3.6), squeeze=False)
    for ax, set_name in zip(axes[0], sets, strict=True):
        mine = [r for r in rows if r["set"] == set_name]
        width = 0.8 / len(mine)
        for i, r in enumerate(mine):
            xs = [j + (i - (len(mine) - 1) / 2) * width for j in range(len(shown))]
            ax.bar(
                xs, [r[k] for k in shown], width, yerr=[r[k + "_std"] for k in shown], capsize=2, label=r["method"]
            )
        ax.set_xticks(range(len(shown)), ["i2t R@1", "t2i R@1", "i2t R@10", "t2i R@10", "zero-shot"], fontsize=8)
        ax.set_ylim(0, 100)
        ax.set_ylabel("val %, mean ± std over seeds")
        ax.set_title(set_name, fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def baselines(args: argparse.Namespace, name: str, cache: Path, save) -> tuple[str, Path]:
    """Prepare one set and run the frozen-tower baselines on it; returns (the set's label, its prepared dir)."""
    data_dir = prepared_set(name, cache, args.preset, args.limit)
    label = set_label(name)
    prep = json.loads((data_dir / "prepare.json").read_text())
    facts = save.facts[label] = {"prepared": str(data_dir), "counts": prep.get("counts")}
    got = save.results.setdefault(label, {})
    if {"ridge", "probe"} & set(args.methods):
        feats = frozen_features(data_dir, args.preset, args.threads)
        facts["features_s"] = feats["seconds"]
        if "ridge" in args.methods:
            got["ridge"] = [ridge(feats)]
            save(f"{label}: ridge {_line(got['ridge'][0])}")
        if "probe" in args.methods:
            for seed in args.seeds:
                got.setdefault("probe", []).append(probe(feats, args.embed_dim, seed, args.probe_epochs))
                save(f"{label}: probe seed {seed} {_line(got['probe'][-1])}")
    return label, data_dir


def dual_encoders(args: argparse.Namespace, sets: dict[str, Path], out: Path, save) -> None:
    """The dual encoder's recipes on every set, seed by seed (the first seed of everything comes first)."""
    for seed in args.seeds:
        for label, data_dir in sets.items():
            for recipe in [m for m in RECIPES if m in args.methods]:
                run = dual_encoder(args, data_dir, recipe, seed, out / "runs" / f"{label}-{recipe}-seed{seed}")
                save.results[label].setdefault(recipe, []).append(run)
                save(f"{label}: {recipe} seed {seed} {_line(run)}")


def _line(r: dict) -> str:
    return (
        f"i2t R@1 {r['i2t_r1']:.1f} R@10 {r['i2t_r10']:.1f}  t2i R@1 {r['t2i_r1']:.1f} R@10 {r['t2i_r10']:.1f}  "
        f"zero-shot {r['zero_shot_acc']:.1f}  {r['train_s']:.0f} s"
    )


class _Report:
    """compare.json, written again after every result (a comparison stopped half way keeps what it found)."""

    def __init__(self, path: Path, settings: dict):
        self.path, self.settings = path, settings
        self.results: dict[str, dict[str, list[dict]]] = {}
        self.facts: dict[str, dict] = {}

    def __call__(self, line: str) -> None:
        from mmfast.util.fsutil import atomic_write_json

        print(line, flush=True)
        rows = table(self.results)
        atomic_write_json(self.path, {**self.settings, "sets": self.facts, "rows": rows, "runs": self.results})


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    out = Path(args.out)
    cache = Path(args.cache) if args.cache else out / "sets"
    out.mkdir(parents=True, exist_ok=True)
    report = {k: getattr(args, k) for k in ("preset", "seeds", "limit", "epochs", "batch_size", "embed_dim")}
    save = _Report(out / "compare.json", report)
    try:
        sets = dict(baselines(args, name, cache, save) for name in args.sets)
        dual_encoders(args, sets, out, save)
    except (ValueError, OSError, subprocess.CalledProcessError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows = table(save.results)
    print_table(rows, save.facts)
    plot(rows, f"preset {args.preset}, seeds {args.seeds}", out / "compare.png")
    print(f"\nwrote {out / 'compare.json'} and {out / 'compare.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
