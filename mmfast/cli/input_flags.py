"""The input-format flags of every command that reads a user's data (mmfast-prepare, mmfast-predict,
mmfast-evaluate), defined once, and the ``InputOptions`` they build: the same flags read the same inputs
everywhere."""

from __future__ import annotations

import argparse

from mmfast.inputs import READERS, InputOptions
from mmfast.inputs.manifest import NO_LABEL
from mmfast.util.commands import PREPARE


def add_input_flags(parser: argparse.ArgumentParser, source: str = "SOURCE") -> None:
    """Add the input-format flags (``--input-kind``, the column mapping, COCO and WebDataset keys) as one group.

    Args:
        parser: the command's parser.
        source: how the command's help names its input (SOURCE, --input).
    """
    g = parser.add_argument_group(f"input format (default: told from {source})")
    g.add_argument("--input-kind", default="auto", choices=["auto", *READERS], help=f"how to read {source}")
    g.add_argument("--image-column", help="column of the image path (or bytes); default image (file_name, ...)")
    g.add_argument("--text-column", help="column of the caption; default text (caption, ... when detected)")
    g.add_argument("--label-column", help="column (COCO: field) of the label; default label (or a ClassLabel)")
    g.add_argument(
        "--no-labels",
        action="store_true",
        help=f"the input has no labels ({PREPARE}: every row is class '{NO_LABEL}')",
    )
    g.add_argument(
        "--columns", help="column names of a CSV/TSV without a header line, e.g. text,image (CC3M's TSV)"
    )
    g.add_argument(
        "--coco-captions", choices=["all", "first"], default="all", help="COCO: a row per caption or per image"
    )
    takers = ", ".join(r.name for r in READERS.values() if r.image_root)
    g.add_argument(
        "--image-root",
        metavar="DIR",
        help=f"folder the relative image paths of a {takers} input are read from; other kinds refuse it "
        "(default: the folder of the file naming them)",
    )
    g.add_argument(
        "--wds-image-key",
        default="jpg;jpeg;png;webp",
        help="WebDataset: the image member's extensions, by preference (default jpg;jpeg;png;webp)",
    )
    g.add_argument("--wds-text-key", default="txt", help="WebDataset: the caption member's extension")
    g.add_argument(
        "--wds-label-key", default="cls", help="WebDataset: the label member's extension (integer or name)"
    )
    g.add_argument("--wds-label-field", help="WebDataset: take the label from this field of the .json member")


def input_options(args: argparse.Namespace) -> InputOptions:
    """The InputOptions of the parsed input-format flags.

    Raises:
        ValueError: flags that exclude each other (``InputOptions``' checks).
    """
    names = tuple(c.strip() for c in args.columns.split(",")) if args.columns else None
    return InputOptions(
        kind=args.input_kind,
        image_column=args.image_column,
        text_column=args.text_column,
        label_column=args.label_column,
        no_labels=args.no_labels,
        columns=names,
        coco_captions=args.coco_captions,
        image_root=args.image_root,
        wds_image_key=args.wds_image_key,
        wds_text_key=args.wds_text_key,
        wds_label_key=args.wds_label_key,
        wds_label_field=args.wds_label_field,
    )
