"""Zero-shot prompts picked on the training split, for kept runs of a recipe: of a pool of templates, the set of
at most --most that classifies the run's own training images best (its trained embeddings, its labels), scored
then on the inner val split beside the task's default templates. Retrieval does not read the templates, so a
run's R@1 is what compare_contrastive reported; only zero-shot can move.

    python tools/experiments/pick_templates.py --runs OUT/runs [--recipe siglip-ms-top2-32-top4] [--most 3]
        [--json OUT]

OUT is a ``compare_contrastive.py --inner ... --keep-runs --out OUT`` folder (as for ``fuse_kernel.py``). Picking
on the training images uses no val image: a template set is chosen by train zero-shot accuracy, ties going to
the fewer templates, then to the pool's order (the defaults first).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

POOL = (  # the task's defaults first (mmfast.tasks.retrieval.DEFAULT_TEMPLATES), then other common ones
    "a photo of a {}.",
    "an image of {}.",
    "{}",
    "an icon of {}.",
    "a picture of a {}.",
    "a drawing of a {}.",
    "an illustration of {}.",
    "a {} icon",
    "an emoji of {}.",
    "a symbol of {}.",
    "a cartoon of {}.",
    "clip art of {}.",
)


def _baselines():
    try:
        import tools.experiments.contrastive_baselines as baselines
    except ImportError:  # run as a script from tools/experiments
        import contrastive_baselines as baselines
    return baselines


def _fuse_kernel():
    try:
        import tools.experiments.fuse_kernel as fuse_kernel
    except ImportError:  # run as a script from tools/experiments
        import fuse_kernel
    return fuse_kernel


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", required=True, help="compare_contrastive's OUT/runs, its runs kept (--keep-runs)")
    p.add_argument("--recipe", default="siglip-ms-top2-32-top4")
    p.add_argument("--most", type=int, default=3, help="templates in a picked set, at most")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default="bench_out/pick_templates.json")
    return p.parse_args(argv)


def template_embeddings(loaded, names: list[str]):
    """(T, C, D): each class name in each template of ``POOL``, through the model's text side, normalized."""
    import torch

    prompts = [t.format(n) for t in POOL for n in names]
    enc = loaded.tokenizer(
        prompts, padding=True, truncation=True, max_length=_baselines().MAX_LENGTH, return_tensors="pt"
    )
    with torch.no_grad():
        emb = loaded.model.eval().encode_text(enc["input_ids"], enc["attention_mask"])
    return torch.nn.functional.normalize(emb.float(), dim=-1).reshape(len(POOL), len(names), -1)


def accuracy(images, labels, prompts, chosen: tuple[int, ...]) -> float:
    """Zero-shot accuracy (percent) of ``images`` with the class embeddings of templates ``chosen`` ensembled."""
    import torch

    from mmfast.tasks.retrieval import zero_shot_figures

    cls = torch.nn.functional.normalize(prompts[list(chosen)].mean(0), dim=-1)
    return zero_shot_figures(images, labels, cls)["zero_shot_acc"]


def pick(images, labels, prompts, most: int) -> tuple[tuple[int, ...], float]:
    """The template set of at most ``most`` with the best accuracy on these (training) images, and it."""
    best, best_acc = (), -1.0
    for k in range(1, most + 1):
        for chosen in itertools.combinations(range(len(POOL)), k):
            acc = accuracy(images, labels, prompts, chosen)
            if acc > best_acc:  # strictly: ties keep the smaller, earlier set
                best, best_acc = chosen, acc
    return best, best_acc


def split_images(dataset, split: str, got: dict):
    """(one normalized embedding per distinct image, its label) of ``embed_split``'s output of ``split``."""
    import torch

    from mmfast.tasks.retrieval import caption_groups

    images = [r["image"] for r in dataset.rows(split)]
    first, _ = caption_groups(images)
    return torch.nn.functional.normalize(got["x"][first].float(), dim=-1), got["label"][first]


def score_run(run: Path, most: int, threads: int) -> dict:
    from mmfast.data.dataset import PreparedDataset
    from mmfast.infer.model_dir import load_model
    from mmfast.tasks.retrieval import DEFAULT_TEMPLATES

    config = json.loads((run / "config.json").read_text())
    dataset = PreparedDataset(config["data"])
    loaded = load_model(run / "model-last")
    net = loaded.model.eval()
    encoders = (net.encode_image, net.encode_text, (net.image.mean, net.image.std))
    size = loaded.config["image_size"]
    train, val = (
        split_images(dataset, split, _baselines().embed_split(dataset, split, encoders, size, threads))
        for split in ("train", "val")
    )
    prompts = template_embeddings(loaded, sorted(dataset.labels, key=dataset.labels.get))
    default = tuple(POOL.index(t) for t in DEFAULT_TEMPLATES)
    chosen, train_acc = pick(*train, prompts, most)
    return {
        "default_train": accuracy(*train, prompts, default),
        "default_val": accuracy(*val, prompts, default),
        "picked": [POOL[i] for i in chosen],
        "picked_train": train_acc,
        "picked_val": accuracy(*val, prompts, chosen),
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    rows = []
    for label, run in _fuse_kernel().kept_runs(args.runs, args.recipe):
        got = {"set": label.split("-inner")[0], "draw": label} | score_run(run, args.most, args.threads)
        rows.append(got)
        print(f"{label}: {got['picked']} train {got['picked_train']:.1f}, val {got['default_val']:.1f} -> "
              f"{got['picked_val']:.1f}", file=sys.stderr)  # fmt: skip
    print(f"{'set':<8}{'draws':>6}{'default val':>13}{'picked val':>12}{'default train':>15}{'picked train':>14}")
    for s in dict.fromkeys(r["set"] for r in rows):
        these = [r for r in rows if r["set"] == s]
        m = {
            k: statistics.mean(r[k] for r in these)
            for k in ("default_val", "picked_val", "default_train", "picked_train")
        }
        print(f"{s:<8}{len(these):>6}{m['default_val']:>13.1f}{m['picked_val']:>12.1f}{m['default_train']:>15.1f}"
              f"{m['picked_train']:>14.1f}")  # fmt: skip
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(
        json.dumps({"recipe": args.recipe, "pool": POOL, "most": args.most, "rows": rows}, indent=1)
    )
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
