"""open_clip's trainer (``open_clip_train``) fed by mmfast: ``get_data`` takes the place of
``open_clip_train.data.get_data``, with its signature, and returns what the trainer reads.

Two ways to use it, neither changing how the trainer is run otherwise:

- Run the stock trainer through it: ``python -m mmfast.loading.open_clip_data --train-data train.csv ...``
  (open_clip_train's own flags; ``main`` hands ``get_data`` to the trainer, then runs it).
- Or change one line of your copy of ``open_clip_train/main.py``: ``from open_clip_train.data import
  get_data`` becomes ``from mmfast.loading.open_clip_data import get_data``.

The train and val tables (``--train-data``, ``--val-data``: CSV / TSV with ``--csv-img-key``,
``--csv-caption-key`` and ``--csv-separator``, or JSONL) are read by ``CaptionLoader``s with the trainer's
preprocess and tokenizer. ImageNet zero-shot sets stay open_clip's. WebDataset shards and the synthetic set are
left to open_clip's own loader, with a warning.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass

from mmfast.data.captions import PathsFromElsewhere
from mmfast.loading.caption_loader import CaptionLoader
from mmfast.loading.transforms import OPEN_CLIP_AUGMENTATIONS, UnsupportedTransform

log = logging.getLogger(__name__)
# open_clip_train's defaults for the table's columns: then the loader looks for its usual names itself
_DEFAULT_KEYS = {"csv_img_key": "filepath", "csv_caption_key": "title"}


@dataclass
class TrainerData:
    """What open_clip_train reads of one split (its ``DataInfo``): ``dataloader`` (``num_batches``,
    ``num_samples``) and ``set_epoch``."""

    dataloader: CaptionLoader
    sampler: None = None
    shared_epoch: None = None

    def set_epoch(self, epoch: int) -> None:
        self.dataloader.set_epoch(epoch)


def get_data(args, preprocess_fns, epoch: int = 0, tokenizer=None, **options) -> dict:
    """``open_clip_train.data.get_data`` with mmfast's loader for the captioned tables.

    Args:
        args: open_clip_train's parsed arguments.
        preprocess_fns: (train preprocess, val preprocess), as ``create_model_and_transforms`` returns them.
        epoch: the epoch training starts at (a resumed run's).
        tokenizer: the trainer's (``open_clip.get_tokenizer(args.model)``).
        **options: ``CaptionLoader`` arguments for both splits (``max_pixels``, ``token_cache``, ...).

    Returns:
        {"train": ..., "val": ..., "imagenet-val": ..., "imagenet-v2": ...}, the splits the arguments name.
    """
    from open_clip_train import data as open_clip_data  # the trainer is only here when it is being run

    kind = _kind(args)
    if kind != "table":
        log.warning("mmfast reads CSV / TSV / JSONL tables; %s data is read by open_clip's own loader", kind)
        return open_clip_data.get_data(args, preprocess_fns, epoch=epoch, tokenizer=tokenizer)
    preprocess_train, preprocess_val = preprocess_fns
    data = {}
    if args.train_data:
        train = _loader(args, args.train_data, preprocess_train, tokenizer, True, args.epochs - epoch, options)
        train.set_epoch(epoch)
        data["train"] = TrainerData(train)
    if args.val_data:
        reads = _evaluations(args, epoch, bool(args.train_data))
        data["val"] = TrainerData(_loader(args, args.val_data, preprocess_val, tokenizer, False, reads, options))
    if args.imagenet_val is not None:
        data["imagenet-val"] = open_clip_data.get_imagenet(args, preprocess_fns, "val")
    if args.imagenet_v2 is not None:
        data["imagenet-v2"] = open_clip_data.get_imagenet(args, preprocess_fns, "v2")
    return data


def _kind(args) -> str:
    """ "table" when mmfast reads the run's data, else what open_clip calls it."""
    if args.dataset_type in ("webdataset", "synthetic"):
        return args.dataset_type
    paths = [p for p in (args.train_data, args.val_data) if p]
    if args.dataset_type == "auto" and any(p.split("::")[0].endswith(".tar") or "{" in p for p in paths):
        return "webdataset"
    return "table"


def _evaluations(args, epoch: int, training: bool) -> int:
    """How many times open_clip_train evaluates on the val split: each ``--val-frequency`` epochs and after
    the last one (once, without training)."""
    if not training:
        return 1
    freq = args.val_frequency or 0
    return sum(1 for e in range(epoch + 1, args.epochs + 1) if freq and (e % freq == 0 or e == args.epochs)) or 1


def _loader(args, table: str, preprocess, tokenizer, train: bool, epochs: int, options: dict) -> CaptionLoader:
    keys = {k: (getattr(args, k) if getattr(args, k) != v else None) for k, v in _DEFAULT_KEYS.items()}
    sharded = train and args.distributed
    settings = dict(
        tokenizer=tokenizer,
        transform=preprocess,
        batch_size=args.batch_size,
        shuffle=train,
        drop_last=train,
        image_key=keys["csv_img_key"],
        caption_key=keys["csv_caption_key"],
        sep=args.csv_separator if not table.lower().endswith(".jsonl") else None,
        seed=args.seed,
        shard_id=args.rank if sharded else 0,
        num_shards=args.world_size if sharded else 1,
        num_workers=args.workers or None,
        device=args.device,
        epochs=max(1, epochs),
    )
    try:
        return CaptionLoader(table, **{**settings, **options})
    except UnsupportedTransform as e:  # the way out: the trainer's flags, or its own loader
        advice = "train this model with open_clip's own loader (its trainer without mmfast)"
        if any(name in e.step for name in OPEN_CLIP_AUGMENTATIONS):
            advice = f"drop the --aug-cfg entries that add it (color_jitter_prob, gray_scale_prob), or {advice}"
        raise UnsupportedTransform(f"{e.step} (open_clip's preprocess)", e.why, advice) from None


def main(argv: list[str] | None = None) -> int:
    """Run open_clip_train's ``main`` with ``get_data`` in the place of its own; ``argv`` are its flags."""
    from open_clip_train import main as trainer  # open_clip_train: optional (mmfast[peers]), only for its trainer

    own = trainer.get_data
    trainer.get_data = get_data  # the name the trainer's main module calls
    try:
        trainer.main(sys.argv[1:] if argv is None else argv)
    except (UnsupportedTransform, PathsFromElsewhere) as e:  # a setting, not a failure: one line, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        trainer.get_data = own
    return 0


if __name__ == "__main__":
    sys.exit(main())
