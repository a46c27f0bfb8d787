"""Evaluate a trained model directory on a prepared dataset's split (or a labeled manifest).

    mmfast-evaluate --model runs/latest/model --data prepared/ --split val --out runs/latest/eval

Prints accuracy, macro-F1 and a per-class precision/recall table; writes OUT/metrics.json,
OUT/confusion.png and OUT/predictions.jsonl.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mmfast.quiet import filter_native_stderr


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a model directory written by mmfast-train (RUN/model)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", help="a prepared dataset directory")
    src.add_argument("--input", help="a labeled JSONL/CSV manifest or class-folder tree")
    p.add_argument("--split", default="val", choices=["train", "val"])
    p.add_argument("--out", help="output folder (default: <model>/../eval-<split>)")
    p.add_argument("--batch-size", type=int, default=None, help="default: the run's eval batch size")
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda when there is one)")
    p.add_argument("--num-workers", type=int, default=None, help="DALI CPU threads (default: all cores)")
    return p.parse_args(argv)


def print_table(figures: dict) -> None:
    print(f"accuracy {figures['acc']:.4f}  macro-F1 {figures['macro_f1']:.4f}  ({figures['samples']} samples)")
    width = max(5, *(len(n) for n in figures["per_class"]))
    print(f"{'class':<{width}}  precision  recall     f1  support")
    for name, f in figures["per_class"].items():
        print(f"{name:<{width}}  {f['precision']:9.3f}  {f['recall']:6.3f}  {f['f1']:5.3f}  {f['support']:7d}")


def main(argv: list[str] | None = None) -> int:
    with filter_native_stderr():  # libpng's harmless colour-profile warnings (mmfast.quiet)
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    args = parse_args(argv)
    import torch

    from mmfast.model_dir import load_model
    from mmfast.predict import plot_confusion, predict_rows, prepared_rows, read_rows, score, write_predictions

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = load_model(args.model, device)
    rows = prepared_rows(args.data, args.split) if args.data else read_rows(args.input)
    unknown = sorted({str(r["label"]) for r in rows if "label" in r} - set(model.class_names))
    if unknown:
        print(f"warning: labels the model does not know are not scored: {unknown[:5]}", file=sys.stderr)
    results = predict_rows(model, rows, batch_size=args.batch_size, device=device, num_workers=args.num_workers)
    figures = score(results, model.class_names)
    out = Path(args.out) if args.out else Path(args.model).resolve().parent / f"eval-{args.split}"
    out.mkdir(parents=True, exist_ok=True)
    write_predictions(out / "predictions.jsonl", results)
    plot_confusion(figures["confusion"], model.class_names, out / "confusion.png")
    (out / "metrics.json").write_text(json.dumps(figures, indent=2))
    print_table(figures)
    if figures["errors"]:
        print(f"{figures['errors']} rows could not be predicted (see {out / 'predictions.jsonl'})")
    print(f"wrote {out}/metrics.json, confusion.png, predictions.jsonl")
    return 0


if __name__ == "__main__":
    sys.exit(main())
