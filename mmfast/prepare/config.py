"""The settings of a preparation (``PrepareConfig``, what mmfast-prepare's flags build) and the names of what it
writes: inside the prepared directory, and beside it (OUT.parts/, OUT.rejected.jsonl)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from mmfast.data.validate import DEFAULT_MAX_PIXELS
from mmfast.inputs import InputOptions

# 2: a "files" map of sizes and SHA-256s, the ownership marker, contiguous int labels;
# 3: the split by a hash of each row's image (prepare.split); images inside the directory named relative to it;
# 4: a folder of splits read for its train split (``inputs.base.train_split``): earlier, its test split too
PREPARE_VERSION = 4
PREPARED_KIND = "mmfast prepared dataset"  # the "kind" in the marker of a prepared directory
IMAGES_DIR = "images"  # images an input stores as bytes (Parquet/Arrow), written out into the prepared dir


@dataclass(frozen=True)
class PrepareConfig:
    """Settings of mmfast-prepare."""

    source: str
    out: str
    tokenizer: str | None = None  # None: train a WordPiece vocabulary on the training captions (offline)
    max_length: int = 64
    val_fraction: float = 0.2
    seed: int = 0
    workers: int = 0  # 0: all cores
    vocab_size: int = 4000
    confine: bool = False
    max_pixels: int = DEFAULT_MAX_PIXELS  # decoded-pixel budget per image (width x height)
    max_side: int = 0  # store JPEG copies no larger than this many pixels a side (0: the images as they are)
    quality: int = 90  # JPEG quality of those copies
    progress: bool = True
    inputs: InputOptions = InputOptions()  # how to read the source (kind, column mapping, COCO options)
    format: str = "files"  # "wds": also export the splits as WebDataset shards into wds/ (prepare.wds_export)
    wds_shard_size: int = 1000  # samples per exported shard
    shard: tuple[int, int] | None = None  # (i, n): check only part i of n of the input (mmfast.prepare.parts)
    merge: bool = False  # join the n parts checked by --shard into ``out``

    def __post_init__(self):
        if not 0.0 <= self.val_fraction < 1.0:
            raise ValueError(f"--val-fraction must be in [0, 1), got {self.val_fraction}")
        if self.max_length < 3:
            raise ValueError(f"--max-length must be at least 3 (room for [CLS] x [SEP]), got {self.max_length}")
        if self.workers < 0:
            raise ValueError(f"--workers must be >= 0, got {self.workers}")
        if self.max_pixels < 1:
            raise ValueError(f"--max-pixels must be at least 1, got {self.max_pixels}")
        if self.max_side and self.max_side < 16:
            raise ValueError(f"--max-side must be 0 (off) or at least 16 pixels, got {self.max_side}")
        if not 1 <= self.quality <= 100:
            raise ValueError(f"--quality must be in 1..100 (JPEG quality), got {self.quality}")
        if self.format not in ("files", "wds"):
            raise ValueError(f"--format must be 'files' or 'wds', got '{self.format}'")
        if self.wds_shard_size < 1:
            raise ValueError(f"the WebDataset shard size must be at least 1, got {self.wds_shard_size}")
        if self.shard is not None and self.merge:
            raise ValueError("--shard I/N checks one part and --merge joins them: pass one of the two")

    def input_folders(self) -> list[Path]:
        """The folders the input's images are found in: the input's own (a folder, or a manifest's), then the
        image root (COCO's --image-root)."""
        src = Path(self.source)
        folders = [src if src.is_dir() else src.parent]
        if self.inputs.image_root:
            folders.append(Path(self.inputs.image_root))
        return folders


def parts_root(out: str | os.PathLike) -> Path:
    """Where the parts of a preparation into ``out`` (``--shard I/N``) are checked into: OUT.parts/."""
    out = Path(out)
    return out.parent / f"{out.name}.parts"


def part_dir(out: str | os.PathLike, i: int, n: int) -> Path:
    """Part i of n's directory under ``parts_root(out)``."""
    return parts_root(out) / f"{i:05d}-of-{n:05d}"


def failure_report_path(out: str | os.PathLike) -> Path:
    """Where the rejects of a preparation that found no usable row are kept: beside --out, as
    OUT.rejected.jsonl (--out itself is left as it was)."""
    out = Path(out)
    return out.parent / f"{out.name}.rejected.jsonl"
