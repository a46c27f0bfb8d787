"""A mix: several prepared datasets as one prepared directory (what ``mmfast-train --data A --data B`` trains
on), whose rows keep which source each came from.

The mix's rows are the sources' rows, train and val alike, with new contiguous sample ids (source 0's train
rows first), ``source`` (the index of its dataset in prepare.json's ``mix.sources``) and ``source_id`` (its id
there). Images stay where the sources hold them (absolute paths; their size and mtime as validated), class ids
map the union of the label names, captions are tokenized again with the sources' one tokenizer. How much of
each source an epoch draws is the training's choice (``--data-weights``, ``loading.sampling.MixedOrder``),
not the mix's: one mix serves any weights.

Refused, naming the source and what to do: sources tokenized by different tokenizers or to different lengths,
labelled sources mixed with unlabelled ones (``--no-labels``), sources read from WebDataset shards (a mix reads
image files), the same dataset twice.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
from pathlib import Path

from mmfast.data.dataset import (
    LABELS_FILE,
    REJECTED_FILE,
    SUMMARY_FILE,
    TOKENIZER_DIR,
    TOKENS_DIR,
    WDS_DIR,
    DatasetError,
    PreparedDataset,
    split_file,
)
from mmfast.data.token_cache import TokenCache
from mmfast.data.tokenizer import load_tokenizer, tokenizer_fingerprint
from mmfast.inputs.manifest import NO_LABEL
from mmfast.prepare.config import PREPARE_VERSION, PREPARED_KIND
from mmfast.prepare.core import check_out, replaceable
from mmfast.prepare.reuse import files_map, reuse
from mmfast.util.commands import PREPARE
from mmfast.util.fsutil import (
    atomic_dir,
    atomic_write_json,
    atomic_write_jsonl,
    dir_lock_path,
    file_lock,
    recover_dir,
    write_errors,
)

log = logging.getLogger(__name__)
MIX_FORMAT = 1  # what mix.sources records (bumped when a mix is laid out otherwise)


class MixError(DatasetError):
    """The datasets cannot be mixed as they are."""


def prepare_mix(sources: list[str | Path], out: str | Path, keep: bool = False) -> dict:
    """Mix the prepared datasets ``sources`` into ``out`` (reused when made from the same sources, unchanged).
    ``keep`` (a resumed run's): a mix already in ``out`` from other sources is refused, never replaced.

    Returns:
        the mix's prepare.json.

    Raises:
        MixError: the sources cannot be mixed (see the module doc).
        DatasetError: a source is not a prepared dataset, or changed since its preparation.
        OutputDirError: ``out`` is not mmfast's, or cannot be written.
    """
    if len(sources) < 2:
        raise MixError(f"a mix takes two or more prepared datasets, got {len(sources)}")
    roots = [Path(s).resolve() for s in sources]
    if len(set(roots)) < len(roots):
        twice = next(r for r in roots if roots.count(r) > 1)
        raise MixError(f"--data {twice} is given twice; to draw more of it, give it a larger --data-weights share")
    datasets = [PreparedDataset(r) for r in roots]  # each verified against its prepare.json
    tok = _check_mixable(datasets)
    fp = mix_fingerprint(datasets)
    out = Path(out)
    with file_lock(dir_lock_path(out)), write_errors(out, "the mixed dataset"):
        recover_dir(out, replaceable)
        check_out(out)
        summary = reuse(out, fp)
        if summary is not None:
            log.info("%s is up to date; reusing it", out)
            return summary
        if keep and (out / SUMMARY_FILE).is_file():
            raise MixError(resumed_data_changed(out))
        with atomic_dir(out, PREPARED_KIND, replaceable) as tmp:
            return _write_mix(datasets, tok, fp, tmp)


def resumed_data_changed(out: Path) -> str:
    """Why a resumed run's data in ``out`` is not prepared again: its checkpoints were trained on it."""
    return (
        f"--resume: {out} holds the data the run trained on, and the --data given now differs from it (other "
        "sources, or they changed since); pass the --data the run started with, or start a new run with another "
        "--out. Nothing was changed"
    )


def mix_fingerprint(datasets: list[PreparedDataset]) -> str:
    """One hash of the sources, in order: their places (the mix names their images by absolute path) and
    their contents (``PreparedDataset.fingerprint``)."""
    h = hashlib.sha256(f"mix v{MIX_FORMAT}\n".encode())
    for d in datasets:
        h.update(f"{d.root.resolve()}|{d.fingerprint}\n".encode())
    return h.hexdigest()


def source_names(roots: list[Path]) -> list[str]:
    """A short name of each source for metrics.jsonl: the folder's name, with its index where two share it."""
    names = [Path(r).name or str(r) for r in roots]
    return [f"{n}#{i}" if names.count(n) > 1 else n for i, n in enumerate(names)]


def _check_mixable(datasets: list[PreparedDataset]):
    """The sources' one tokenizer (loaded from the first), once every source is known to fit the mix."""
    first = datasets[0]
    tok = load_tokenizer(first.tokenizer_dir)
    want = tokenizer_fingerprint(tok)
    for d in datasets:
        if (d.root / WDS_DIR).is_dir():
            raise MixError(
                f"{d.root}: its images are read from WebDataset shards, and a mix reads image files; mix sources "
                "prepared from an image folder, manifest, COCO or Parquet input, without --format wds"
            )
        if d is not first and tokenizer_fingerprint(load_tokenizer(d.tokenizer_dir)) != want:
            raise MixError(
                f"{d.root} was tokenized with another tokenizer than {first.root}; prepare it again with "
                f"{PREPARE} ... --tokenizer {first.tokenizer_dir}"
            )
        if d.summary.get("max_length") != first.summary.get("max_length"):
            raise MixError(
                f"{d.root} was tokenized to {d.summary.get('max_length')} tokens and {first.root} to "
                f"{first.summary.get('max_length')}; prepare one again with --max-length to match"
            )
    unlabelled = [d for d in datasets if set(d.labels) == {NO_LABEL}]
    if unlabelled and len(unlabelled) < len(datasets):
        labelled = next(d for d in datasets if d not in unlabelled)
        raise MixError(
            f"{unlabelled[0].root} has no labels (prepared with --no-labels) and {labelled.root} has "
            f"{labelled.num_classes} classes: a mix's sources all have labels or none; prepare {labelled.root} "
            "with --no-labels to train them together (contrastive)"
        )
    return tok


def _write_mix(datasets: list[PreparedDataset], tok, fp: str, tmp: Path) -> dict:
    """Rows, labels, tokenizer, token cache and prepare.json of the mix into ``tmp``."""
    label_map: dict[str, int] = {}
    for d in datasets:  # the union of the label names, in the sources' order
        for name, _ in sorted(d.labels.items(), key=lambda kv: kv[1]):
            label_map.setdefault(name, len(label_map))
    rows: dict[str, list[dict]] = {"train": [], "val": []}
    next_id = 0
    for split in ("train", "val"):
        for i, d in enumerate(datasets):
            names = {v: k for k, v in d.labels.items()}
            for r in d.iter_rows(split):  # image paths come absolute
                rows[split].append(
                    {**r, "id": next_id, "label": label_map[names[r["label"]]], "source": i, "source_id": r["id"]}
                )
                next_id += 1
    shutil.copytree(datasets[0].tokenizer_dir, tmp / TOKENIZER_DIR)
    max_length = int(datasets[0].summary["max_length"])
    caches = {}
    for split, these in rows.items():
        first = these[0]["id"] if these else len(rows["train"])
        caches[split] = TokenCache.build(
            tmp / TOKENS_DIR, split, [r["text"] for r in these], tok, max_length, first_id=first
        )
    atomic_write_jsonl(tmp / split_file("train"), rows["train"])
    atomic_write_jsonl(tmp / split_file("val"), rows["val"])
    atomic_write_jsonl(tmp / REJECTED_FILE, [])
    atomic_write_json(tmp / LABELS_FILE, label_map)
    roots = [d.root.resolve() for d in datasets]
    configs = [d.summary.get("config") or {} for d in datasets]
    summary = {
        "version": PREPARE_VERSION,
        "source": " + ".join(str(r) for r in roots),
        "input_kind": "mix",
        "input_fingerprint": fp,
        "config": {  # what the loaders read of a preparation's settings: the largest of the sources'
            "max_pixels": max(int(c.get("max_pixels") or 0) for c in configs) or None,
            "max_side": 0,  # a --max-side copy counted at its original's size: an upper bound
        },
        "mix": {
            "format": MIX_FORMAT,
            "sources": [
                {
                    "root": str(r),
                    "name": name,
                    "fingerprint": d.fingerprint,
                    "train": d.split_size("train"),
                    "val": d.split_size("val"),
                }
                for r, name, d in zip(roots, source_names(roots), datasets, strict=True)
            ],
        },
        "counts": {
            "input_rows": len(rows["train"]) + len(rows["val"]),
            "accepted": len(rows["train"]) + len(rows["val"]),
            "rejected": 0,
            "train": len(rows["train"]),
            "val": len(rows["val"]),
            "classes": len(label_map),
        },
        "tokenizer": str(datasets[0].summary.get("tokenizer")),
        "vocab_size": len(tok),
        "max_length": max_length,
        "token_cache": {
            s: {"fingerprint": c.fingerprint, "dtype": c.meta["dtype"], "tokens": c.meta["n_tokens"]}
            for s, c in caches.items()
        },
    }
    summary["files"] = files_map(tmp)
    atomic_write_json(tmp / SUMMARY_FILE, summary)  # last: its presence means the directory is complete
    return summary
