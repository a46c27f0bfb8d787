"""The report of compare_contrastive.py: the table over seeds, the chart, and the table across inner draws."""

from __future__ import annotations

import logging
import statistics
from pathlib import Path

FIGURES = ("i2t_r1", "i2t_r5", "i2t_r10", "t2i_r1", "t2i_r5", "t2i_r10", "zero_shot_acc")


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
    ws = max([10, *(len(r["set"]) + 1 for r in rows)])  # a column as wide as its longest name and a space
    wm = max([12, *(len(r["method"]) + 1 for r in rows)])
    head = f"\n{'set':<{ws}}{'method':<{wm}}{'n':>2}" + "".join(f"{h:>14}" for h in heads)
    print(head + f"{'train s':>9}{'least':>7}")
    for r in rows:
        cells = "".join(f"{r[k]:>8.1f} ± {r[k + '_std']:<3.1f}" for k in FIGURES)
        times = f"{r['train_s']:>9.0f}{r['train_s_min']:>7.0f}"
        print(f"{r['set']:<{ws}}{r['method']:<{wm}}{r['runs']:>2}{cells}{times}")
    for name, f in facts.items():
        for key, took in f.items():
            if key.startswith("features") and key.endswith("_s"):  # features_s, features-ms_s: one per pooling
                suffix = key[len("features") : -len("_s")]
                print(f"{name}: the frozen towers' features (ridge{suffix}, probe{suffix}) took {took:.0f} s")


def pyplot(path: Path):
    """matplotlib's pyplot on the file backend, or None (a warning naming ``path``) when it is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logging.warning("matplotlib is not installed: no %s", path.name)
        return None
    return plt


def plot(rows: list[dict], title: str, path: Path) -> None:
    if (plt := pyplot(path)) is None:
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


ACROSS = ("i2t_r1", "t2i_r1", "zero_shot_acc")  # what the table across draws holds


def across_draws(rows: list[dict], against: str) -> list[dict]:
    """One row per (set, method) over the inner draws that ran it (labels ``NAME-innerN``): each figure of
    ``ACROSS``, the mean over the draws of each draw's mean over its seeds, with the std across the draws; and,
    where ``against`` ran too, the method's difference to it on each draw both ran (``vs_draws``; ``vs_K``: the
    mean; ``vs_K_worst``: the least). A difference on the same images is what a choice rests on: the draw moves
    both."""
    by: dict[tuple[str, str], dict[str, dict]] = {}
    for r in rows:
        base, sep, draw = r["set"].rpartition("-inner")
        if sep and draw.isdigit():
            by.setdefault((base, r["method"]), {})[draw] = r
    out = []
    for (base, method), draws in by.items():
        row = {"set": base, "method": method, "draws": sorted(int(d) for d in draws)}
        for k in ACROSS:
            row[k], row[f"{k}_std"] = _mean_std([d[k] for d in draws.values()])
        ref = by.get((base, against), {})
        both = sorted(set(draws) & set(ref), key=int)
        if method != against and both:
            row["vs_draws"] = [int(d) for d in both]
            for k in ACROSS:
                diffs = [draws[d][k] - ref[d][k] for d in both]
                row[f"vs_{k}"], row[f"vs_{k}_worst"] = statistics.fmean(diffs), min(diffs)
        out.append(row)
    return out


def print_across(rows: list[dict], against: str) -> None:
    ran = any(r["method"] == against for r in rows)
    print(
        f"\nacross the inner draws: the mean of each draw's mean (± std across draws); vs {against}: the mean"
        f" difference on the same images (the worst draw's){'' if ran else f'; {against} did not run'}"
    )
    wm = max([26, *(len(r["method"]) + 1 for r in rows)])
    print(
        f"{'set':<10}{'method':<{wm}}{'draws':<10}"
        + "".join(f"{h:>14}" for h in ("i2t R@1", "t2i R@1", "zero-shot"))
        + f"   vs {against}: i2t / t2i / zero-shot"
    )
    for r in rows:
        cells = "".join(f"{r[k]:>8.1f} ± {r[k + '_std']:<3.1f}" for k in ACROSS)
        vs = (
            "  ".join(f"{r[f'vs_{k}']:+.1f} ({r[f'vs_{k}_worst']:+.1f})" for k in ACROSS)
            if "vs_i2t_r1" in r
            else ""
        )
        if "vs_draws" in r and r["vs_draws"] != r["draws"]:
            vs += f"  (on draws {','.join(map(str, r['vs_draws']))}, where both ran)"
        print(f"{r['set']:<10}{r['method']:<{wm}}{','.join(map(str, r['draws'])):<10}{cells}   {vs}")


def line(r: dict) -> str:
    return (
        f"i2t R@1 {r['i2t_r1']:.1f} R@10 {r['i2t_r10']:.1f}  t2i R@1 {r['t2i_r1']:.1f} R@10 {r['t2i_r10']:.1f}  "
        f"zero-shot {r['zero_shot_acc']:.1f}  {r['train_s']:.0f} s"
    )


class Report:
    """compare.json, written again after every result (a comparison stopped half way keeps what it found)."""

    def __init__(self, path: Path, settings: dict):
        self.path, self.settings = path, settings
        self.results: dict[str, dict[str, list[dict]]] = {}
        self.facts: dict[str, dict] = {}

    def __call__(self, message: str) -> None:
        from mmfast.util.fsutil import atomic_write_json

        print(message, flush=True)
        rows = table(self.results)
        report = {**self.settings, "sets": self.facts, "rows": rows, "runs": self.results}
        if len(self.settings.get("inner_seed") or []) > 1:
            report["across_draws"] = across_draws(rows, self.settings["against"])
        atomic_write_json(self.path, report)
