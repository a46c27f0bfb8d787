"""Turn a manifest or image folder into a prepared dataset directory (see DESIGN.md, Contracts).

Stages, in order: read rows -> validate images -> label map -> split -> tokenizer -> token cache -> write.
The directory is built in a temp folder and renamed into place, under a lock, so concurrent runs
never see half of it; a second run with the same inputs and settings reuses it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from mmfast.fsutil import atomic_dir, atomic_write_jsonl, file_lock
from mmfast.manifest import Candidate, ManifestError, Reject, read_input
from mmfast.token_cache import TokenCache
from mmfast.tokenizer import load_tokenizer, train_wordpiece
from mmfast.validate import check_images

log = logging.getLogger(__name__)
PREPARE_VERSION = 1


@dataclass(frozen=True)
class PrepareConfig:
    """Settings of tools/prepare_data.py."""

    source: str
    out: str
    tokenizer: str | None = None  # None: train a WordPiece vocabulary on the training captions (offline)
    max_length: int = 64
    val_fraction: float = 0.2
    seed: int = 0
    workers: int = 0  # 0: all cores
    vocab_size: int = 4000
    confine: bool = False
    progress: bool = True

    def __post_init__(self):
        if not 0.0 <= self.val_fraction < 1.0:
            raise ValueError(f"--val-fraction must be in [0, 1), got {self.val_fraction}")
        if self.max_length < 3:
            raise ValueError(f"--max-length must be at least 3 (room for [CLS] x [SEP]), got {self.max_length}")
        if self.workers < 0:
            raise ValueError(f"--workers must be >= 0, got {self.workers}")


def prepare_dataset(cfg: PrepareConfig) -> dict:
    """Prepare ``cfg.source`` into ``cfg.out`` (or reuse it when inputs and settings are unchanged).

    Returns:
        the contents of prepare.json.

    Raises:
        ManifestError: the input cannot be read or leaves no usable rows.
    """
    out = Path(cfg.out)
    with file_lock(out.parent / f".{out.name}.lock"):
        fp = _input_fingerprint(cfg)
        done = out / "prepare.json"
        if done.exists():
            summary = json.loads(done.read_text())
            if summary.get("input_fingerprint") == fp:
                _refresh_token_cache(out, summary)
                log.info("%s is up to date; reusing it", out)
                return summary
        with atomic_dir(out) as tmp:
            summary = _prepare_into(cfg, tmp, fp)
    return summary


def _prepare_into(cfg: PrepareConfig, tmp: Path, fp: str) -> dict:
    t0 = time.perf_counter()
    workers = cfg.workers or os.cpu_count() or 1
    cands, rejects, kind = read_input(cfg.source, confine=cfg.confine)
    n_input = len(cands) + len(rejects)
    t_read = time.perf_counter()

    checks = check_images([c.image for c in cands], workers, progress=cfg.progress)
    good: list[Candidate] = []
    for c, chk in zip(cands, checks, strict=True):
        if chk.ok:
            good.append(c)
        else:
            rejects.append(Reject(c.line, chk.reason, c.source))
    t_validate = time.perf_counter()

    good, label_map, more = _label_map(good)
    rejects.extend(more)
    if not good:
        reasons = Counter(r.reason.split(":")[0] for r in rejects).most_common(3)
        raise ManifestError(
            f"{cfg.source}: no usable rows out of {n_input} (most common reasons: {reasons}); "
            "see the reasons above and fix the manifest"
        )
    train, val = _split(good, label_map, cfg.val_fraction, cfg.seed)
    train_rows = [_row(c, i, label_map) for i, c in enumerate(train)]
    val_rows = [_row(c, len(train) + i, label_map) for i, c in enumerate(val)]

    tok = (
        load_tokenizer(cfg.tokenizer)
        if cfg.tokenizer
        else train_wordpiece([r["text"] for r in train_rows], cfg.vocab_size)
    )
    tok.save_pretrained(tmp / "tokenizer")
    t_tok = time.perf_counter()
    caches = {}
    for split, rows in (("train", train_rows), ("val", val_rows)):
        first = rows[0]["id"] if rows else len(train_rows)
        caches[split] = TokenCache.build(
            tmp / "tokens", split, [r["text"] for r in rows], tok, cfg.max_length, first_id=first
        )
    t_cache = time.perf_counter()

    rejects.sort(key=lambda r: r.line)
    atomic_write_jsonl(tmp / "train.jsonl", train_rows)
    atomic_write_jsonl(tmp / "val.jsonl", val_rows)
    atomic_write_jsonl(tmp / "rejected.jsonl", [r.to_json() for r in rejects])
    (tmp / "labels.json").write_text(json.dumps(label_map, indent=2, ensure_ascii=False) + "\n")
    summary = {
        "version": PREPARE_VERSION,
        "source": str(Path(cfg.source).resolve()),
        "input_kind": kind,
        "input_fingerprint": fp,
        "config": asdict(cfg),
        "counts": {
            "input_rows": n_input,
            "accepted": len(good),
            "rejected": len(rejects),
            "train": len(train),
            "val": len(val),
            "classes": len(label_map),
        },
        "rejected_by_reason": dict(Counter(_reason_kind(r.reason) for r in rejects).most_common()),
        "tokenizer": cfg.tokenizer or "wordpiece trained on the training captions",
        "vocab_size": len(tok),
        "max_length": cfg.max_length,
        "token_cache": {
            s: {"fingerprint": c.fingerprint, "dtype": c.meta["dtype"], "tokens": c.meta["n_tokens"]}
            for s, c in caches.items()
        },
        "timings_s": {
            "read": t_read - t0,
            "validate": t_validate - t_read,
            "tokenizer": t_tok - t_validate,
            "token_cache": t_cache - t_tok,
            "total": time.perf_counter() - t0,
        },
    }
    assert n_input == len(good) + len(rejects), "every input row is either kept or rejected"
    (tmp / "prepare.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _reason_kind(reason: str) -> str:
    return reason.split(":")[0].split(" (")[0]


def _label_map(rows: list[Candidate]) -> tuple[list[Candidate], dict[str, int], list[Reject]]:
    if not rows:
        return rows, {}, []
    if isinstance(rows[0].label, str):
        names = sorted({c.label for c in rows})
        return rows, {n: i for i, n in enumerate(names)}, []
    kept = [c for c in rows if c.label >= 0]
    rejects = [
        Reject(c.line, f"negative integer label {c.label}; labels are class indices >= 0", c.source)
        for c in rows
        if c.label < 0
    ]
    return kept, {str(v): v for v in sorted({c.label for c in kept})}, rejects


def _split(rows: list[Candidate], label_map: dict[str, int], val_fraction: float, seed: int):
    """Seeded split, stratified by label: each class gives round(n * fraction) rows to val."""
    rng = np.random.default_rng(seed)
    by_label: dict[str, list[int]] = defaultdict(list)
    for i, c in enumerate(rows):
        by_label[str(c.label)].append(i)
    val_idx = set()
    for name in sorted(by_label):
        idx = by_label[name]
        k = int(round(len(idx) * val_fraction))
        if val_fraction > 0 and k == 0 and len(idx) >= 2:
            k = 1
        val_idx.update(rng.permutation(idx)[:k].tolist())
    train = [c for i, c in enumerate(rows) if i not in val_idx]
    val = [c for i, c in enumerate(rows) if i in val_idx]
    return train, val


def _row(c: Candidate, sample_id: int, label_map: dict[str, int]) -> dict:
    st = os.stat(c.image)  # recorded so the loader can tell a file that changed after validation
    return {
        "id": sample_id,
        "image": c.image,
        "text": c.text,
        "label": label_map[str(c.label)],
        "line": c.line,
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
    }


def _input_fingerprint(cfg: PrepareConfig) -> str:
    """Hash of the input (manifest bytes or folder listing, with image sizes and mtimes) and the settings."""
    h = hashlib.sha256(
        f"v{PREPARE_VERSION}|{cfg.tokenizer}|{cfg.max_length}|{cfg.val_fraction}|{cfg.seed}|"
        f"{cfg.vocab_size}|{cfg.confine}".encode()
    )
    src = Path(cfg.source)
    if not src.exists():
        raise ManifestError(f"{src}: no such manifest or image folder; pass a .jsonl/.csv file or a folder")
    if src.is_file():
        h.update(src.read_bytes())
    out = os.path.abspath(cfg.out)
    base = src if src.is_dir() else src.parent
    for p in sorted(base.rglob("*")):
        path = os.path.abspath(p)
        if path == out or path.startswith(out + os.sep):
            continue
        try:
            st = p.stat()
        except OSError:  # dangling link, symlink loop: part of the input as it is
            h.update(f"{p}|unreadable".encode())
            continue
        if stat.S_ISREG(st.st_mode):
            h.update(f"{p}|{st.st_size}|{st.st_mtime_ns}".encode())
    return h.hexdigest()


def _refresh_token_cache(out: Path, summary: dict) -> None:
    """Rebuild a damaged or stale token cache of an otherwise up-to-date prepared directory."""
    tok = load_tokenizer(out / "tokenizer")
    for split in ("train", "val"):
        rows = [json.loads(ln) for ln in (out / f"{split}.jsonl").read_text().splitlines() if ln]
        first = rows[0]["id"] if rows else summary["counts"]["train"]
        TokenCache.build(
            out / "tokens", split, [r["text"] for r in rows], tok, summary["max_length"], first_id=first
        )
