"""Predict with a trained model directory (RUN/model) on any input mmfast-prepare reads, a split or one image.

    mmfast-predict --model runs/latest/model --input new.jsonl --out predictions.jsonl
    mmfast-predict --model runs/latest/model --input data/train-00000.parquet --out predictions.jsonl
    mmfast-predict --model runs/latest/model --image cat.jpg --text "a cat on a mat"
    mmfast-predict --model runs/latest/model --data prepared/ --split val --out val.csv
    mmfast-predict --model runs/clip/model --input new.jsonl --embed image --out new-images

--input is read by preparation's readers, with its flags (--input-kind, --image-column, ..., --wds-*; see
mmfast/infer/predict_inputs.py): a manifest, image folder, HF imagefolder metadata, COCO captions, Parquet/Arrow,
WebDataset shards. Labels are optional. Writes JSONL (or CSV for a .csv --out): per input row the class, its
probability and the top-k, or the reason the row could not be predicted (naming its file and line; the other
rows are predicted anyway). Exit status 2 when the input cannot be read or no row of it can be predicted.
A dual encoder (--model clip) predicts zero-shot from the image alone: among --classes (names separated by
commas, or a file with one per line) in the prompts of --templates, else among the classes it was trained with.
--embed image|text (a dual encoder, --model clip) writes the rows' normalized embeddings instead: OUT.npy
(N, D) float32, OUT.ids.npy (N,) int64 (the prepared sample id with --data, else the row's position in the
input) and, when pyarrow is installed, OUT.parquet (id, image, text, embedding). An --out that is a folder (or
ends in /) holds them, named by modality: OUT/image.npy, OUT/image.ids.npy, OUT/image.parquet.
--compare-pil also times a plain PIL + torchvision + model loop on the same rows and prints both throughputs.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from mmfast.cli import Parser, summary_of, write_failure
from mmfast.cli.input_flags import add_input_flags, input_options
from mmfast.util.fsutil import check_output_file, read_json_object
from mmfast.util.quiet import filter_native_stderr
from mmfast.util.voice import command_line


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = Parser(description=summary_of(__doc__))
    p.add_argument("--model", required=True, help="a model directory written by mmfast-train (RUN/model)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--input",
        help="what mmfast-prepare reads: a manifest (.jsonl/.csv/.tsv), image folder, HF imagefolder, COCO .json, "
        "Parquet/Arrow, WebDataset shards",
    )
    src.add_argument("--data", help="a prepared dataset directory (with --split)")
    src.add_argument("--image", help="one image (with --text)")
    p.add_argument("--split", default="val", choices=["train", "val"], help="with --data (default: val)")
    p.add_argument("--text", default="", help="the caption of --image")
    p.add_argument("--out", help="predictions file: .jsonl (default) or .csv; default: print to stdout")
    p.add_argument("--top-k", type=int, default=3, help="classes listed per row, most probable first (default: 3)")
    p.add_argument(
        "--embed",
        choices=["image", "text"],
        default=None,
        help="a dual encoder (clip): write the rows' image or text embeddings (OUT.npy, OUT.ids.npy, "
        "OUT.parquet; in a folder OUT/: image.npy or text.npy, ...) instead of predictions; needs --out",
    )
    p.add_argument(
        "--classes",
        default=None,
        help="a dual encoder: predict zero-shot among these class names, separated by commas, or a file with one "
        "per line (default: the classes it was trained with)",
    )
    add_templates_flag(p)
    p.add_argument("--batch-size", type=int, default=None, help="default: the run's eval batch size")
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda when there is one)")
    p.add_argument("--num-workers", type=int, default=None, help="DALI CPU threads (default: all cores)")
    add_max_pixels_flag(p)
    p.add_argument(
        "--compare-pil",
        type=int,
        default=0,
        metavar="REPEATS",
        help="time predict and a plain PIL + model loop REPEATS times each; print images/s",
    )
    p.add_argument("--bench-json", help="with --compare-pil: write the timings here")
    add_input_flags(p, "--input")
    return p.parse_args(argv)


def add_templates_flag(p: argparse.ArgumentParser) -> None:
    """--templates, as predict and evaluate take it."""
    p.add_argument(
        "--templates",
        default=None,
        help="a dual encoder's zero-shot prompts: joined by '|' with {} for the class name, or a file with one "
        "per line (default: those the model was trained with)",
    )


def add_max_pixels_flag(p: argparse.ArgumentParser) -> None:
    """--max-pixels, as predict and evaluate take it."""
    p.add_argument(
        "--max-pixels",
        type=_positive_int,
        default=None,
        help="images over this many pixels, w x h (read from the header), are errors, not decoded "
        "(default: the model's, as its training data was prepared)",
    )


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _missing_data(data: str, model: str | None) -> str:
    """--data names nothing: say so, and name the prepared folder the model's run trained on when it is there
    (a run given a prepared --data has no prepared/ of its own)."""
    from mmfast.data.dataset import COMPLETE, prepared_state  # only for this error
    from mmfast.train.rundir import RAW_DATA_DIR

    why = f"--data {data}: no such folder"
    run = Path(model).parent if model else None
    if run is not None:
        trained = read_json_object(run / "config.json").get("data")
        for folder in (run / RAW_DATA_DIR, Path(trained) if isinstance(trained, str) else None):
            if folder is not None and prepared_state(folder) == COMPLETE:
                return f"{why}; the model's run trained on {folder}: pass --data {folder}"
    return f"{why}; pass the folder mmfast-prepare wrote (its --out), or use --input for a manifest or images"


def load_rows(args: argparse.Namespace, stack: contextlib.ExitStack, captions_needed: bool = True) -> list[dict]:
    """The rows of --data, --image or --input (its images stored as bytes in a temp folder ``stack`` removes).

    Raises:
        ManifestError, ValueError: --input cannot be read, or its flags exclude each other.
    """
    from mmfast.infer.predict import prepared_rows  # torch: imported when the command runs, so --help stays light
    from mmfast.infer.predict_inputs import input_rows

    if getattr(args, "data", None):
        if not Path(args.data).exists():
            raise ValueError(_missing_data(args.data, getattr(args, "model", None)))
        rows = prepared_rows(
            args.data, args.split, stack.enter_context(tempfile.TemporaryDirectory(prefix="mmfast-rows-"))
        )
        if not rows:
            raise ValueError(
                f"{args.data}: its {args.split} split is empty (prepared with --val-fraction 0?); pass --split "
                "train or another input"
            )
        return rows
    if getattr(args, "image", None):
        try:
            args.text.encode("utf-8")
        except UnicodeEncodeError as e:  # bytes the locale could not decode come as surrogate escapes
            byte = ord(args.text[e.start]) - 0xDC00 if 0xDC80 <= ord(args.text[e.start]) <= 0xDCFF else None
            what = f"byte 0x{byte:02x}" if byte is not None else repr(args.text[e.start])
            raise ValueError(
                f"--text is not UTF-8 ({what} at character {e.start}); pass the caption in UTF-8"
            ) from None
        return [{"image": str(Path(args.image).resolve()), "text": args.text}]
    opts = dataclasses.replace(input_options(args), captions_needed=captions_needed)
    return stack.enter_context(input_rows(args.input, opts))


def _reads_captions(args: argparse.Namespace) -> bool:
    """Whether what is asked reads the rows' captions: not for image embeddings, nor for a dual encoder's
    zero-shot (``model_reads_captions``)."""
    if args.embed or args.classes:
        return args.embed == "text"
    return model_reads_captions(args.model, dual=False)


def model_reads_captions(model_dir: str, dual: bool) -> bool:
    """Whether the model in ``model_dir`` reads captions: a classifier with a text tower does, one without does
    not, a dual encoder as ``dual`` says (evaluation's retrieval does, zero-shot does not). From its config.json;
    where that cannot be read, True (the model's own load says why later)."""
    from mmfast.models.registry import MODELS  # here: it imports the model class, and torch with it

    try:
        cls = MODELS[json.loads((Path(model_dir) / "config.json").read_text())["model"]]
    except (OSError, ValueError, KeyError, TypeError):
        return True
    if hasattr(cls, "encode_image") and hasattr(cls, "encode_text"):  # a dual encoder, as MmfastModel.embeds
        return dual
    return "text" in getattr(cls, "modalities", ("text",))


def report_errors(results: list[dict], done: str) -> None:
    """The count of rows ``done`` and with errors, and the first ten errors, on stderr."""
    errors = [r for r in results if r.get("error")]
    good = len(results) - len(errors)
    print(f"{good} row{'s' if good != 1 else ''} {done}, {len(errors)} more left out for errors", file=sys.stderr)
    for r in errors[:10]:
        print(f"  {r['image']}: {r['error']}" if r.get("image") else f"  {r['error']}", file=sys.stderr)


def none_usable(rows: list[dict], source: str, table: bool = True) -> bool:
    """True (after saying why on stderr, in one line after the reasons) when no row is left to predict.
    ``table``: the rows came from an input the reading flags apply to (not --image, whose one reason is the
    message)."""
    if any(not r.get("error") for r in rows):
        return False
    if not table and len(rows) == 1:
        print(f"error: cannot predict {source}: {rows[0]['error']}", file=sys.stderr)
    elif rows:
        report_errors(rows, "usable")
        how = ", or say how to read it (--input-kind, --image-column, --text-column)" if table else ""
        failed = f"all {len(rows)} failed, reasons above"
        print(f"error: no row of {source} can be predicted ({failed}); fix the input{how}", file=sys.stderr)
    else:
        print(f"error: {source} holds no rows to predict", file=sys.stderr)
    return True


def compare_pil(model, rows: list[dict], args: argparse.Namespace, device) -> dict:
    """Median images/s of predict_rows and of the plain PIL loop on the same rows (after one warm-up each,
    runs alternating)."""
    # torch: imported when the command runs, so --help stays light
    from mmfast.infer.predict import image_file, predict_pil, predict_rows

    good = [r for r in rows if not r.get("error") and Path(image_file(r)).is_file()]
    bs = args.batch_size or model.config.get("eval_batch_size") or 64
    timings = {"mmfast_predict": [], "pil_loop": []}
    runs = {
        "mmfast_predict": lambda: predict_rows(
            model, good, batch_size=bs, device=device, num_workers=args.num_workers
        ),
        "pil_loop": lambda: predict_pil(model, good, batch_size=bs),
    }
    for fn in runs.values():
        fn()  # warm-up: thread pools, allocator, first-call costs
    for _ in range(args.compare_pil):  # interleaved: a load change on a shared machine hits both alike
        for name, fn in runs.items():
            t0 = time.perf_counter()
            fn()
            timings[name].append(len(good) / (time.perf_counter() - t0))
    result = {
        "images": len(good),
        "batch_size": bs,
        "image_size": model.config["image_size"],
        "device": str(device),
        **{f"{k}_images_per_s": timings[k] for k in timings},
        **{f"{k}_median": statistics.median(timings[k]) for k in timings},
    }
    result["ratio"] = result["mmfast_predict_median"] / result["pil_loop_median"]
    print(f"{'loop':<16} {'images/s (median of ' + str(args.compare_pil) + ')':>28}")
    for k in timings:
        print(f"{k:<16} {result[k + '_median']:>28.1f}")
    print(f"ratio {result['ratio']:.2f}x ({len(good)} images, batch {bs}, {device})")
    if args.bench_json:
        Path(args.bench_json).write_text(json.dumps(result, indent=2))
    return result


def check_outputs(args: argparse.Namespace, inputs: list[str]) -> None:
    """Refuse an --out (each embeddings file, with --embed) that is an input or a file of the user's.

    Raises:
        OutputError: naming the file.
    """
    if not args.embed:
        # torch: imported when the command runs, so --help stays light
        from mmfast.infer.predict import is_predictions_file

        check_output_file(args.out, inputs, is_predictions_file)
        return
    # torch: imported when the command runs, so --help stays light
    from mmfast.infer.embed import embedding_paths, is_embeddings_file

    for path in embedding_paths(args.out, args.embed).values():
        check_output_file(path, inputs, is_embeddings_file)


def embed(args: argparse.Namespace, model, rows: list[dict], device, source: str) -> int:
    """--embed: the rows' embeddings written to the --out files; 2 when none can be embedded or written."""
    # torch: imported when the command runs, so --help stays light
    from mmfast.infer.embed import embed_rows, row_ids, write_embeddings

    try:
        results, emb, kept = embed_rows(
            model,
            rows,
            args.embed,
            batch_size=args.batch_size,
            device=device,
            num_workers=args.num_workers,
            max_pixels=args.max_pixels,
        )
    except ValueError as e:  # not a dual encoder
        print(f"error: {e}", file=sys.stderr)
        return 2
    if none_usable(results, source, table=args.image is None):
        return 2
    ids = row_ids(rows)
    try:
        written = write_embeddings(args.out, emb, [ids[i] for i in kept], [results[i] for i in kept], args.embed)
    except OSError as e:  # each file written whole or not at all
        print(f"error: {write_failure(args.out, e)}", file=sys.stderr)
        return 2
    print(f"wrote {len(kept)} {args.embed} embeddings ({emb.shape[1]}-d): {', '.join(map(str, written))}")
    report_errors(results, "embedded")
    return 0


def _refused(args: argparse.Namespace, model) -> str:
    """Why the model cannot predict what was asked ('' when it can)."""
    if not model.embeds:
        for flag in ("classes", "templates"):
            if getattr(args, flag):
                return (
                    f"--{flag} is for a dual encoder; {args.model} is a classifier, which predicts its own classes"
                )
        return ""
    if args.compare_pil:
        return f"{args.model} is a dual encoder and --compare-pil times a classifier: pass --embed image|text"
    if not model.knows_classes and not args.classes:
        return (
            f"{args.model} is a dual encoder and it was trained without labels: pass --classes NAMES for "
            "zero-shot among your class names, or --embed image|text for embeddings"
        )
    return ""


@command_line
def main(argv: list[str] | None = None) -> int:
    with filter_native_stderr():  # libpng's harmless colour-profile warnings (mmfast.util.quiet)
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    # torch: imported when the command runs, so --help stays light
    from mmfast.infer.embed import zero_shot_rows
    from mmfast.infer.model_dir import load_for_inference
    from mmfast.infer.predict import image_file, predict_rows, write_predictions
    from mmfast.inputs.manifest import ManifestError
    from mmfast.tasks.retrieval import read_class_names, read_templates

    args = parse_args(argv)
    source = args.input or args.data or args.image
    if args.embed and not args.out:
        print("error: --embed needs --out (its files: OUT.npy, OUT.ids.npy, OUT.parquet)", file=sys.stderr)
        return 2
    if args.embed and (args.classes or args.templates):
        print(
            "error: --classes and --templates choose zero-shot predictions, and --embed writes embeddings "
            "instead: drop one or the other",
            file=sys.stderr,
        )
        return 2
    with contextlib.ExitStack() as stack:
        try:
            classes = read_class_names(args.classes) if args.classes else None  # before any image is read
            templates = read_templates(args.templates) if args.templates else None
            rows = load_rows(args, stack, captions_needed=_reads_captions(args))
            if args.out:  # never the input, one of its images, or a file of the user's
                inputs = [str(source)] + [image_file(r) for r in rows if r.get("image")]
                check_outputs(args, inputs)
            if none_usable(rows, source, table=args.image is None):
                return 2
            model, device = load_for_inference(args.model, args.device)
        except (ManifestError, ValueError, FileNotFoundError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if args.embed:
            return embed(args, model, rows, device, source)
        refused = _refused(args, model)
        if refused:
            print(f"error: {refused}", file=sys.stderr)
            return 2
        if args.compare_pil:
            compare_pil(model, rows, args, device)
            return 0
        loader = {"batch_size": args.batch_size, "device": device, "num_workers": args.num_workers}
        if model.embeds:  # zero-shot among --classes, else the classes it was trained with
            results = zero_shot_rows(
                model, rows, templates, args.top_k, classes, max_pixels=args.max_pixels, **loader
            )
        else:
            results = predict_rows(model, rows, top_k=args.top_k, max_pixels=args.max_pixels, **loader)
    if none_usable(results, source, table=args.image is None):
        return 2
    if args.out:
        try:
            written = write_predictions(args.out, results)
        except OSError as e:  # written whole or not at all: nothing is left behind
            print(f"error: {write_failure(args.out, e)}", file=sys.stderr)
            return 2
        print(f"wrote {len(results)} predictions: {written}")
    else:
        for r in results:
            print(json.dumps({k: r.get(k) for k in ("image", "class", "prob", "top_k", "error")}))
    report_errors(results, "predicted")
    return 0


if __name__ == "__main__":
    sys.exit(main())
