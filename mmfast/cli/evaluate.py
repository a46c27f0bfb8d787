"""Evaluate a trained model directory on a prepared dataset's split (or any labeled input mmfast-prepare reads).

    mmfast-evaluate --model runs/latest/model --data prepared/ --split val --out runs/latest/eval
    mmfast-evaluate --model runs/latest/model --input test.parquet --out runs/latest/eval-test
    mmfast-evaluate --model runs/clip/model --input coco/captions_val2017.json --out runs/clip/eval-coco

--input is read as mmfast-predict reads it (preparation's readers and flags: --input-kind, --label-column,
...); its rows without a label are predicted but not scored. Exit status 2 when the input cannot be read, no
row can be predicted or none has a label.

Prints accuracy, macro-F1 and a per-class precision/recall table; writes OUT/metrics.json,
OUT/confusion.png and OUT/predictions.jsonl.

A dual encoder (--model clip) is evaluated by retrieval instead: image -> text and text -> image recall@1/5/10
and median rank over the rows (the rows of one image file are its captions), and zero-shot accuracy over the
rows with a label (prompts: --templates, else the model's); labels are optional. Writes OUT/metrics.json, and
OUT/errors.jsonl when rows were left out (each with its reason).
"""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
from pathlib import Path

from mmfast.cli import Parser, summary_of, write_failure
from mmfast.cli.input_flags import add_input_flags
from mmfast.cli.predict import (
    add_max_pixels_flag,
    add_templates_flag,
    load_rows,
    model_reads_captions,
    none_usable,
    report_errors,
)
from mmfast.util.fsutil import OutputError, atomic_write_json, atomic_write_jsonl, claim_output_dir
from mmfast.util.quiet import filter_native_stderr
from mmfast.util.voice import command_line

ERRORS_FILE = "errors.jsonl"  # a retrieval evaluation's rows left out, each with its "error"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = Parser(description=summary_of(__doc__))
    p.add_argument("--model", required=True, help="a model directory written by mmfast-train (RUN/model)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", help="a prepared dataset directory")
    src.add_argument(
        "--input",
        help="labeled data as mmfast-prepare reads it: a manifest, image folder, HF imagefolder, COCO .json, "
        "Parquet/Arrow, WebDataset shards",
    )
    p.add_argument("--split", default="val", choices=["train", "val"])
    p.add_argument(
        "--out", help="output folder (default: <model>/../eval-<split>; with --input, eval-<the input's name>)"
    )
    p.add_argument("--batch-size", type=int, default=None, help="default: the run's eval batch size")
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda when there is one)")
    p.add_argument("--num-workers", type=int, default=None, help="DALI CPU threads (default: all cores)")
    add_templates_flag(p)
    add_max_pixels_flag(p)
    add_input_flags(p, "--input")
    return p.parse_args(argv)


def output_dir(args: argparse.Namespace) -> Path:
    """--out, else a folder beside the model directory named for what was scored: the prepared split
    (``eval-val``) or the input (``eval-captions`` for captions.jsonl; a manifest.jsonl or a brace pattern of
    shards by its folder)."""
    if args.out:
        return Path(args.out)
    name = args.split
    if args.input:
        where = Path(args.input.rstrip("/"))
        stem = where.name.split(".")[0]
        if (stem == "manifest" or "{" in where.name) and where.parent.name:
            stem = where.parent.name
        name = re.sub(r"[^\w-]+", "_", stem).strip("_") or "input"
    return Path(args.model).resolve().parent / f"eval-{name}"


def print_table(figures: dict) -> None:
    print(f"accuracy {figures['acc']:.4f}  macro-F1 {figures['macro_f1']:.4f}  ({figures['samples']} samples)")
    width = max(5, *(len(n) for n in figures["per_class"]))
    print(f"{'class':<{width}}  precision  recall     f1  support")
    for name, f in figures["per_class"].items():
        print(f"{name:<{width}}  {f['precision']:9.3f}  {f['recall']:6.3f}  {f['f1']:5.3f}  {f['support']:7d}")


def print_retrieval(figures: dict) -> None:
    print(f"{figures['images']} images, {figures['texts']} captions")
    for way, words in (("i2t", "image -> text"), ("t2i", "text -> image")):
        recalls = "  ".join(f"R@{k} {figures[f'{way}_r{k}']:5.1f}" for k in (1, 5, 10))
        print(f"{words}:  {recalls}  median rank {figures[f'{way}_median_rank']:g}")
    print(f"mean recall {figures['mean_recall']:.1f}")
    if "zero_shot_acc" in figures:
        print(
            f"zero-shot accuracy {figures['zero_shot_acc']:.1f}% ({figures['zero_shot_samples']} images, "
            f"{figures['zero_shot_classes']} classes)"
        )


def evaluate_retrieval(args: argparse.Namespace, model, rows: list[dict], device, source: str) -> int:
    """A dual encoder's evaluation: retrieval (and zero-shot) figures printed and written to OUT/metrics.json."""
    # torch: imported when the command runs, so --help stays light
    from mmfast.infer.embed import evaluate_retrieval as figures_of
    from mmfast.tasks.retrieval import read_templates

    try:
        templates = read_templates(args.templates) if args.templates else None
        figures = figures_of(
            model,
            rows,
            templates,
            batch_size=args.batch_size,
            device=device,
            num_workers=args.num_workers,
            max_pixels=args.max_pixels,
        )
    except ValueError as e:  # bad templates, or no row could be embedded
        print(f"error: {e}", file=sys.stderr)
        return 2
    results = figures.pop("rows")
    failed = [r for r in results if r.get("error")]
    out = output_dir(args)
    try:
        out = claim_output_dir(out, "evaluation")  # a folder of the user's is refused, never written into
        atomic_write_json(out / "metrics.json", figures)
        if failed:  # every row left out, with its reason (stderr names the first ten)
            atomic_write_jsonl(out / ERRORS_FILE, failed)
        else:  # an earlier evaluation's list, in this mmfast folder, would name rows this one scored
            (out / ERRORS_FILE).unlink(missing_ok=True)
    except OutputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: {write_failure(out, e)}", file=sys.stderr)
        return 2
    print_retrieval(figures)
    if failed:
        report_errors(results, "evaluated")
        print(f"wrote {out / ERRORS_FILE}: the {len(failed)} rows left out, each with its reason", file=sys.stderr)
    print(f"wrote {out}/metrics.json")
    return 0


@command_line
def main(argv: list[str] | None = None) -> int:
    with filter_native_stderr():  # libpng's harmless colour-profile warnings (mmfast.util.quiet)
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    # torch: imported when the command runs, so --help stays light
    from mmfast.infer.model_dir import load_for_inference
    from mmfast.infer.predict import plot_confusion, predict_rows, score, write_predictions
    from mmfast.inputs.manifest import ManifestError

    args = parse_args(argv)
    source = args.input or args.data
    with contextlib.ExitStack() as stack:
        try:
            rows = load_rows(args, stack, captions_needed=model_reads_captions(args.model, dual=True))
            if none_usable(rows, source):
                return 2
            model, device = load_for_inference(args.model, args.device)
        except (ManifestError, ValueError, FileNotFoundError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if model.embeds:
            return evaluate_retrieval(args, model, rows, device, source)
        if not _has_labels(rows, source):
            return 2
        labels = {str(r["label"]) for r in rows if "label" in r and not r.get("error")}
        unknown = sorted(labels - set(model.class_names))
        if unknown and len(unknown) == len(labels):  # nothing to score: say why instead of "accuracy 0"
            print(
                f"error: no label of {source} is a class of the model ({_listed(unknown)}; the model's classes: "
                f"{_listed(model.class_names)}): the input's labels must be the class names it was trained on",
                file=sys.stderr,
            )
            return 2
        if unknown:
            print(f"warning: labels the model does not know are not scored: {_listed(unknown)}", file=sys.stderr)
        results = predict_rows(
            model,
            rows,
            batch_size=args.batch_size,
            device=device,
            num_workers=args.num_workers,
            max_pixels=args.max_pixels,
        )
    if none_usable(results, source):
        return 2
    figures = score(results, model.class_names)
    out = output_dir(args)
    try:
        out = claim_output_dir(out, "evaluation")  # a folder of the user's is refused, never written into
        write_predictions(out / "predictions.jsonl", results)
        plot_confusion(figures["confusion"], model.class_names, out / "confusion.png")
        atomic_write_json(out / "metrics.json", figures)
    except OutputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # no permission, a full disk
        print(f"error: {write_failure(out, e)}", file=sys.stderr)
        return 2
    print_table(figures)
    if figures["errors"]:
        report_errors(results, "predicted")
        print(f"{figures['errors']} rows could not be predicted (see {out / 'predictions.jsonl'})")
    print(f"wrote {out}/metrics.json, confusion.png, predictions.jsonl")
    return 0


def _listed(names: list[str], most: int = 5) -> str:
    shown = ", ".join(repr(n) for n in names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def _has_labels(rows: list[dict], source: str) -> bool:
    """True when a usable row has a label to score it by; else says so on stderr."""
    if any("label" in r for r in rows if not r.get("error")):
        return True
    print(
        f"error: no row of {source} has a label to score it by; name the label column (--label-column) or "
        "use mmfast-predict for unlabeled data",
        file=sys.stderr,
    )
    return False


if __name__ == "__main__":
    sys.exit(main())
