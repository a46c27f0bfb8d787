"""Prepare a manifest (JSONL/CSV/TSV), image folder, HF imagefolder, COCO captions JSON, Parquet or a
datasets.save_to_disk folder for training.

mmfast-prepare SOURCE --out DIR [--tokenizer X] [--max-length N]
    [--val-fraction F] [--seed S] [--workers N] [--confine] [--max-pixels N] [--format files|wds]
    [--max-side N [--quality Q]] [--shard I/N | --merge | --ray [ADDRESS] [--ray-parts N]]
    [--input-kind K] [--image-column C] [--text-column C] [--label-column C | --no-labels]
    [--columns A,B,..] [--coco-captions all|first] [--image-root DIR]
    [--wds-image-key jpg;png] [--wds-text-key txt] [--wds-label-key cls | --wds-label-field FIELD]

SOURCE may also be WebDataset shards (img2dataset / open_clip layout: key.jpg + key.txt + key.cls or
key.json): a folder of .tar files, a .tar, or a pattern such as 'shards/{00000..00099}.tar' (quoted). They are
read in place and never written to: their DALI index files go into --out, and the split is by sample (a
hash of its key, as for every input: see --val-fraction).

A big input can be prepared by several processes or machines: run `--shard I/N` for I = 0..N-1 (each checks
the images of its part into OUT.parts/), then the same command with --merge
instead writes OUT. A re-preparation into the same OUT decodes only the images that changed or are new.

--ray [ADDRESS] runs those parts as tasks on a Ray cluster (pip install 'mmfast[ray]'), then merges them:
no ADDRESS is ray.init()'s choice (RAY_ADDRESS, else a cluster started on this machine, else a new local one);
'auto', HOST:PORT or ray://HOST:PORT are passed to Ray. Every node must see --out's folder at the same path
(a shared filesystem; checked) and the input (a path there, or an s3:// URL), and have mmfast installed. Each
part reserves --workers CPUs (default 1) and validates with that many processes; a part whose worker or node
dies is run again, a part that fails on its input stops the run with its error. Put --ray after SOURCE (or
write --ray=ADDRESS).

SOURCE may also be given as --source SOURCE. When no row is usable, the first reasons are printed and all
of them are kept beside --out as OUT.rejected.jsonl.

(from a checkout: python tools/prepare_data.py ...)

--out is created, or replaced when it is a directory prepared by mmfast (or empty); anything else is refused.
"""

from __future__ import annotations

import argparse
import logging
import sys

from mmfast.cli import HelpFormatter, Parser
from mmfast.cli.input_flags import add_input_flags, input_options
from mmfast.data.validate import DEFAULT_MAX_PIXELS
from mmfast.inputs.manifest import ManifestError
from mmfast.prepare.config import part_dir
from mmfast.prepare.parts import parse_shard
from mmfast.util.commands import PREPARE, TRAIN
from mmfast.util.stop_watch import StopWatch
from mmfast.util.voice import command_line


def build_parser() -> argparse.ArgumentParser:
    """mmfast-prepare's command line: every flag with its meaning and default, as --help shows them (and as
    docs/reference/prepare-flags.md lists them)."""
    p = Parser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument(
        "source",
        nargs="?",
        help="manifest .jsonl/.csv/.tsv, image folder root/<class>/<image>, HF imagefolder (folder or its "
        "metadata.jsonl/.csv), COCO captions .json, .parquet file or folder, save_to_disk folder or .arrow, "
        "WebDataset shards (folder of .tar, .tar, or a {000..009} / * pattern)",
    )
    p.add_argument("--source", dest="source_flag", metavar="SOURCE", help="the same as the positional SOURCE")
    p.add_argument("--out", required=True, help="prepared dataset directory to write")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="Hugging Face tokenizer: 'minilm' (the --text-model's, offline), a local directory or a hub name; "
        "None: a WordPiece vocabulary trained offline on the training captions",
    )
    p.add_argument("--max-length", type=int, default=64, help="tokens per caption, special tokens included")
    p.add_argument(
        "--val-fraction",
        type=float,
        default=0.2,
        help="share of the images that go to val, by a hash of each image (its captions stay together)",
    )
    p.add_argument("--seed", type=int, default=0, help="changes which images the split puts in val")
    p.add_argument(
        "--workers",
        type=int,
        default=0,
        help="processes for image validation (0: all cores; with --ray: CPUs and processes of each part, 0: 1)",
    )
    p.add_argument("--vocab-size", type=int, default=4000, help="size of the trained WordPiece vocabulary")
    p.add_argument(
        "--confine",
        action="store_true",
        help="reject image paths outside the folder they are read from (the manifest's, or --image-root)",
    )
    p.add_argument(
        "--max-pixels",
        type=int,
        default=DEFAULT_MAX_PIXELS,
        help="reject images over this many pixels, w x h (read from the header; bounds the loader memory)",
    )
    p.add_argument(
        "--max-side",
        type=int,
        default=0,
        metavar="N",
        help="store JPEG copies of the images no larger than N pixels a side and train from them (FFCV's "
        "trick: less to decode); 0 (default): the images as they are",
    )
    p.add_argument("--quality", type=int, default=90, help="JPEG quality of the --max-side copies")
    p.add_argument(
        "--format",
        choices=["files", "wds"],
        default="files",
        help="also write WebDataset tar shards + DALI index files (wds): jpg + txt + cls + json per sample, "
        f"readable by the webdataset library; {TRAIN} --source wds trains from them alone",
    )
    p.add_argument("--shard-size", type=int, default=1000, help="samples per exported WebDataset shard")
    p.add_argument(
        "--shard",
        metavar="I/N",
        help="check only part I of N of the input (I = 0..N-1) into OUT.parts/; then run --merge",
    )
    p.add_argument("--merge", action="store_true", help="write OUT from the N parts that --shard I/N checked")
    _add_ray_flags(p)
    _add_run_flags(p)
    add_input_flags(p)
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if (args.source is None) == (args.source_flag is None):
        if args.source is None and args.ray:
            p.error(
                f"--ray took '{args.ray}' for the cluster's address: put SOURCE before --ray (or --ray=ADDRESS)"
            )
        p.error("pass the input once: SOURCE or --source SOURCE")
    if args.ray is not None and (args.shard or args.merge):
        p.error("--ray runs every part and merges them: pass it without --shard or --merge")
    if args.ray_parts is not None and (args.ray is None or args.ray_parts < 1):
        p.error("--ray-parts N (N >= 1) goes with --ray")
    return args


def _add_run_flags(p: argparse.ArgumentParser) -> None:
    """--no-progress and --stop-grace: how the command runs, not what it prepares."""
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bars on a terminal (in a log or CI, a line every 30 s says how far it got)",
    )
    p.add_argument(
        "--stop-grace",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="seconds from a stop signal (SIGTERM/SIGINT) to the process's exit; past them, or at a second "
        "signal, it exits at once, printing each thread's stack (default: 60)",
    )


def _add_ray_flags(p: argparse.ArgumentParser) -> None:
    """--ray [ADDRESS] and --ray-parts N (mmfast.prepare.ray_parts)."""
    p.add_argument(
        "--ray",
        nargs="?",
        const="",
        metavar="ADDRESS",
        help="check the parts as Ray tasks, then merge: no ADDRESS: ray.init()'s cluster; auto, HOST:PORT, "
        "ray://HOST:PORT",
    )
    p.add_argument(
        "--ray-parts",
        type=int,
        metavar="N",
        help="parts of a --ray preparation (default: the count already in OUT.parts/, so a re-run makes only "
        "the missing ones; else a small multiple of the parts the cluster runs at once)",
    )
    p.add_argument(
        "--ray-timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="how long --ray HOST:PORT may take to accept a connection before the command gives up (default: 60)",
    )


LARGE_IMAGE_PIXELS = 16_000_000  # a prepared image over this many pixels is worth a note about memory


def print_summary(summary: dict) -> None:
    c = summary["counts"]
    print(f"\n{'input rows':<22}{c['input_rows']:>8}")
    for key in ("accepted", "downscaled", "rejected", "train", "val", "classes"):
        if key == "downscaled" and not c.get(key):
            continue
        print(f"{key:<22}{c[key]:>8}")
    for reason, n in summary["rejected_by_reason"].items():
        print(f"  rejected: {reason:<40}{n:>6}")
    print(
        f"{'tokenizer':<22}{summary['tokenizer']} (vocab {summary['vocab_size']}, max_length "
        f"{summary['max_length']})"
    )
    if summary.get("reused_checks"):
        where = summary.get("reused_checks_from")
        since = f"the preparation in {where}" if where else "the last preparation"
        print(f"{'checks reused':<22}{summary['reused_checks']:>8}  (images unchanged since {since})")
    print(f"{'prepared in':<22}{summary['timings_s']['total']:.1f} s")  # a reused directory's: when it was
    big = summary.get("largest_image")
    if big and big["width"] * big["height"] > LARGE_IMAGE_PIXELS:
        mb = big["width"] * big["height"] * 3 / 1e6
        print(
            f"note: the largest image decodes to {big['width']}x{big['height']} ({mb:.0f} MB; {big['image']}): a "
            f"batch of 64 such images holds {64 * mb / 1e3:.1f} GB decoded at once, and the loaders decode "
            "whole images; --max-side 2048 stores smaller copies (or lower --max-pixels)"
        )
    if c["classes"] < 2 and summary["config"].get("inputs", {}).get("no_labels"):
        print(f"note: no labels (--no-labels): for a contrastive model ({TRAIN} --model clip), not a classifier")
    elif c["classes"] < 2:
        flag = "--wds-label-field or --wds-label-key" if summary.get("input_kind") == "wds" else "--label-column"
        print(
            f"note: one class only (labels.json): the loader reads it, but {TRAIN}'s classifiers need at "
            f"least 2 classes (map a label with {flag}); a contrastive model (--model clip) needs none"
        )


@command_line
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.stop_grace > 0:
        print(f"error: --stop-grace must be > 0 seconds, got {args.stop_grace}", file=sys.stderr)
        return 2
    # a stop is a KeyboardInterrupt in the main thread, bounded by --stop-grace even inside native code
    with StopWatch(PREPARE, args.stop_grace) as watch:
        try:
            return _prepare(args)
        except KeyboardInterrupt:
            if watch.signum is None:
                raise
            print("interrupted", file=sys.stderr)
            return 130


def _prepare(args: argparse.Namespace) -> int:
    # imported once there is something to prepare: it loads torch (the token cache), which --help need not wait for
    from mmfast.prepare.core import PrepareConfig, prepare_dataset

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for library in ("botocore", "aiobotocore", "s3fs", "fsspec"):  # their INFO lines ("Found credentials in ...")
        logging.getLogger(library).setLevel(logging.WARNING)
    try:
        cfg = PrepareConfig(
            source=args.source or args.source_flag,
            out=args.out,
            tokenizer=args.tokenizer,
            max_length=args.max_length,
            val_fraction=args.val_fraction,
            seed=args.seed,
            workers=args.workers,
            vocab_size=args.vocab_size,
            confine=args.confine,
            max_pixels=args.max_pixels,
            max_side=args.max_side,
            quality=args.quality,
            progress=not args.no_progress,
            inputs=input_options(args),
            format=args.format,
            wds_shard_size=args.shard_size,
            shard=parse_shard(args.shard) if args.shard else None,
            merge=args.merge,
        )
        if args.ray is not None:
            from mmfast.prepare.ray_parts import RayOptions, prepare_on_ray  # loads core too: see above

            opts = RayOptions(address=args.ray or None, parts=args.ray_parts, timeout_s=args.ray_timeout)
            summary = prepare_on_ray(cfg, opts)
        else:
            summary = prepare_dataset(cfg)
    except (ManifestError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if cfg.shard is not None:
        i, n = cfg.shard
        c = summary["counts"]
        print(f"part {i}/{n}: {c['accepted']} of {c['input_rows']} rows kept, in {part_dir(cfg.out, i, n)}")
        if not c["input_rows"]:  # more parts than rows (or shards): harmless, but likely not what was meant
            print(f"note: part {i}/{n} holds no input rows; the input has fewer rows (or shards) than parts")
        print(f"when all {n} parts are done: the same command with --merge instead of --shard {args.shard}")
        return 0
    print_summary(summary)
    print(f"prepared dataset: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
