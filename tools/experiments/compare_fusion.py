"""Fusion against each modality alone and a bag-of-words caption baseline, on one split, same budget.

    python tools/experiments/compare_fusion.py --data DIR_OR_MANIFEST [--preset lite0-minilm] [--seeds 0 1 2]
        [--models image text early concat late] [--out bench_out/compare]

Trains every model with the preset's recipe for every seed (the split is fixed: one preparation), then
fits TF-IDF + logistic regression on the training captions (scikit-learn, optional) and scores all of them
on the same validation split. Prints a table (mean ± std over seeds of the final epoch's val accuracy and
macro-F1, the best epoch's accuracy, wall time, images/s) and writes compare.json and compare.png.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path

try:  # run as a script (python tools/experiments/...) or imported as tools.experiments.compare_fusion
    from tools.experiments.compare_report import pyplot
except ImportError:
    from compare_report import pyplot


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="a prepared directory, or a manifest / image folder to prepare")
    p.add_argument("--preset", default="lite0-minilm", help="the recipe every model trains with")
    p.add_argument("--models", nargs="+", default=["image", "text", "early", "concat", "late"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--epochs", type=int, default=None, help="override the preset's epochs")
    p.add_argument("--out", default="bench_out/compare", help="folder for the runs, compare.json and compare.png")
    p.add_argument("--threads", type=int, default=None, help="DALI threads (default: all cores)")
    return p.parse_args(argv)


def prepared_dir(data: str, preset: str, out: Path) -> Path:
    """The prepared split every model shares: ``data`` itself, or ``data`` prepared once with the tokenizer
    of the preset's text model."""
    from mmfast.models import get_preset
    from mmfast.prepare.core import PrepareConfig, prepare_dataset
    from mmfast.train.setup import pretrained_tokenizer

    if (Path(data) / "prepare.json").is_file():
        return Path(data)
    target = out / "prepared"
    tokenizer = pretrained_tokenizer(get_preset(preset).text_model)
    prepare_dataset(PrepareConfig(source=data, out=str(target), tokenizer=tokenizer, progress=False))
    return target


def tfidf_baseline(data_dir: Path) -> dict | None:
    """TF-IDF (word 1-2 grams + char 2-4 grams) + logistic regression on the train captions, scored on val."""
    try:
        from scipy.sparse import hstack
        from sklearn.feature_extraction.text import TfidfVectorizer
        from sklearn.linear_model import LogisticRegression
        from sklearn.metrics import accuracy_score, f1_score
    except ImportError:
        logging.warning("scikit-learn is not installed: no TF-IDF baseline (pip install scikit-learn)")
        return None
    from mmfast.data.dataset import PreparedDataset

    ds = PreparedDataset(data_dir)
    train, val = ds.rows("train"), ds.rows("val")
    t0 = time.perf_counter()
    words = TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True)
    chars = TfidfVectorizer(analyzer="char_wb", ngram_range=(2, 4), sublinear_tf=True)
    xt = hstack([words.fit_transform(r["text"] for r in train), chars.fit_transform(r["text"] for r in train)])
    xv = hstack([words.transform(r["text"] for r in val), chars.transform(r["text"] for r in val)])
    clf = LogisticRegression(C=10.0, max_iter=2000).fit(xt, [r["label"] for r in train])
    pred, truth = clf.predict(xv), [r["label"] for r in val]
    return {
        "val_acc": float(accuracy_score(truth, pred)),
        "val_macro_f1": float(f1_score(truth, pred, average="macro")),
        "wall_s": time.perf_counter() - t0,
    }


def run_models(args: argparse.Namespace, data_dir: Path, out: Path) -> dict[str, list[dict]]:
    from mmfast.train import train
    from mmfast.train.config import TrainConfig

    results: dict[str, list[dict]] = {}
    for model in args.models:
        for seed in args.seeds:
            run_dir = out / "runs" / f"{model}-seed{seed}"
            cfg = TrainConfig(
                data=str(data_dir),
                out=str(run_dir),
                overwrite=True,
                model=model,
                preset=args.preset,
                seed=seed,
                epochs=args.epochs,
                num_threads=args.threads,
                progress=False,
            )
            summary = train(cfg)
            print(
                f"{model:<8} seed {seed}: val_acc {summary['val_acc']:.4f} (best {summary['best_val_acc']:.4f}) "
                f"macro-F1 {summary['val_macro_f1']:.4f}  {summary['wall_s']:.0f} s",
                flush=True,
            )
            results.setdefault(model, []).append(summary)
    return results


def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def table(results: dict[str, list[dict]], baseline: dict | None) -> list[dict]:
    rows = []
    for model, runs in results.items():
        acc, acc_sd = _mean_std([r["val_acc"] for r in runs])
        f1, f1_sd = _mean_std([r["val_macro_f1"] for r in runs])
        best, _ = _mean_std([r["best_val_acc"] for r in runs])
        rows.append(
            {
                "model": model,
                "val_acc": acc,
                "val_acc_std": acc_sd,
                "val_macro_f1": f1,
                "val_macro_f1_std": f1_sd,
                "best_val_acc": best,
                "wall_s": statistics.fmean(r["wall_s"] for r in runs),
                "images_per_s": statistics.fmean(r["images_per_s"] for r in runs),
                "seeds": len(runs),
            }
        )
    if baseline is not None:
        rows.append(
            {
                "model": "tfidf+logreg (captions)",
                "val_acc": baseline["val_acc"],
                "val_acc_std": 0.0,
                "val_macro_f1": baseline["val_macro_f1"],
                "val_macro_f1_std": 0.0,
                "best_val_acc": None,
                "wall_s": baseline["wall_s"],
                "images_per_s": None,
                "seeds": 1,
            }
        )
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"\n{'model':<26}{'val_acc':>16}{'macro-F1':>16}{'best acc':>10}{'wall s':>9}{'img/s':>8}")
    for r in rows:
        best = f"{r['best_val_acc']:.3f}" if r["best_val_acc"] is not None else "-"
        ips = f"{r['images_per_s']:.0f}" if r["images_per_s"] is not None else "-"
        print(
            f"{r['model']:<26}{r['val_acc']:>9.3f} ± {r['val_acc_std']:.3f}{r['val_macro_f1']:>9.3f} ± "
            f"{r['val_macro_f1_std']:.3f}{best:>10}{r['wall_s']:>9.0f}{ips:>8}"
        )


def plot(rows: list[dict], title: str, path: Path) -> None:
    if (plt := pyplot(path)) is None:
        return
    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = [r["model"] for r in rows]
    ax.bar(
        names,
        [r["val_acc"] for r in rows],
        yerr=[r["val_acc_std"] for r in rows],
        capsize=4,
        color=["#888" if "tfidf" in n else "#4a7ebb" for n in names],
    )
    ax.set_ylabel("val accuracy (mean ± std)")
    ax.set_ylim(0, 1)
    ax.set_title(title, fontsize=9)
    ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    from mmfast.util.fsutil import atomic_write_json

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        data_dir = prepared_dir(args.data, args.preset, out)
        baseline = tfidf_baseline(data_dir)
        results = run_models(args, data_dir, out)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows = table(results, baseline)
    print_table(rows)
    atomic_write_json(
        out / "compare.json",
        {"data": str(data_dir), "preset": args.preset, "seeds": args.seeds, "rows": rows, "runs": results},
    )
    plot(rows, f"{data_dir} — preset {args.preset}, seeds {args.seeds}", out / "compare.png")
    print(f"\nwrote {out / 'compare.json'} and {out / 'compare.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
