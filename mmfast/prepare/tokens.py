"""A preparation's tokenizer and token cache, kept from earlier preparations of the input where they still
apply: a WordPiece vocabulary trained on the very same training captions is copied rather than trained again,
and a caption an earlier token cache of the same tokenizer holds is copied rather than tokenized again. What is
written is, byte for byte, what a preparation from nothing writes.

Only complete preparations by this version of mmfast are used, and of them only files that are still as their
prepare.json records them (size and SHA-256).
"""

from __future__ import annotations

import errno
import functools
import json
import logging
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from mmfast.data.dataset import SPLITS, TOKENIZER_DIR, TOKENS_DIR, DatasetError, PreparedDataset, split_file
from mmfast.data.token_cache import TokenCache, cache_fingerprint
from mmfast.data.tokenizer import load_tokenizer, tokenizer_fingerprint, train_wordpiece
from mmfast.prepare.config import PrepareConfig
from mmfast.prepare.reuse import changed_files

log = logging.getLogger(__name__)


@dataclass
class Tokenized:
    """The tokenizer, each split's token cache, and what was kept from earlier preparations."""

    tokenizer: object
    caches: dict[str, TokenCache]
    tokenizer_from: str = ""  # the folder whose trained vocabulary was copied
    seconds: dict[str, float] = field(default_factory=dict)  # tokenizer, token_cache


def tokenize(cfg: PrepareConfig, tmp: Path, rows: dict[str, list[dict]], earlier: list[Path]) -> Tokenized:
    """Write the tokenizer into ``tmp``/tokenizer and each split of ``rows`` into ``tmp``/tokens, using what the
    complete preparations ``earlier`` hold where it is what would be written anyway."""
    t0 = time.perf_counter()
    folders = [ds for d in reversed(earlier) if (ds := _intact(d)) is not None]  # --out's own first
    train_texts = [r["text"] for r in rows["train"]]
    kept = None if cfg.tokenizer else _same_vocabulary(folders, cfg, train_texts)
    if kept is not None:
        source, tok = kept
        shutil.copytree(source.tokenizer_dir, tmp / TOKENIZER_DIR, ignore=shutil.ignore_patterns("*.lock"))
        log.info("tokenizer: the vocabulary %s trained on the same captions is kept", source.root)
    else:
        tok = load_tokenizer(cfg.tokenizer) if cfg.tokenizer else train_wordpiece(train_texts, cfg.vocab_size)
        save_tokenizer(tok, tmp / TOKENIZER_DIR)
    t_tok = time.perf_counter()
    pairs = _earlier_caches(folders, tokenizer_fingerprint(tok), cfg.max_length)
    caches = {}
    first = 0
    for split, these in rows.items():
        caches[split] = TokenCache.build(
            tmp / TOKENS_DIR, split, [r["text"] for r in these], tok, cfg.max_length, first_id=first, earlier=pairs
        )
        first += len(these)
    seconds = {"tokenizer": t_tok - t0, "token_cache": time.perf_counter() - t_tok}
    return Tokenized(tok, caches, str(source.root) if kept is not None else "", seconds)


def save_tokenizer(tok, path: Path) -> None:
    """``tok.save_pretrained(path)``, a failed write raised as the OSError it is."""
    try:
        tok.save_pretrained(path)
    except OSError:
        raise
    except Exception as e:  # the tokenizers library reports a failed write as a bare Exception
        code = re.search(r"os error (\d+)", str(e))
        raise OSError(int(code.group(1)) if code else errno.EIO, f"saving the tokenizer: {e}", str(path)) from e


def _intact(folder: Path) -> PreparedDataset | None:
    """``folder`` when its tokenizer and token cache files are still as its prepare.json records them."""
    try:
        ds = PreparedDataset(folder, verify=False)
    except (OSError, DatasetError, KeyError, TypeError, ValueError):
        return None
    ours = {rel: want for rel, want in ds.files.items() if rel.split("/")[0] in (TOKENIZER_DIR, TOKENS_DIR)}
    return ds if ours and not changed_files(folder, ours) else None


def _same_vocabulary(folders: list[PreparedDataset], cfg: PrepareConfig, texts: list[str]) -> tuple | None:
    """(folder, its tokenizer) of the first folder whose WordPiece vocabulary of ``cfg.vocab_size`` was trained
    on exactly ``texts``: its train token cache's fingerprint is that of ``texts`` under its tokenizer (so its
    rows are not read)."""
    for ds in folders:
        config = ds.summary.get("config") or {}
        if config.get("tokenizer") is not None or config.get("vocab_size") != cfg.vocab_size:
            continue
        try:
            meta = TokenCache(ds.tokens_dir, "train").meta
            tok = load_tokenizer(ds.tokenizer_dir)
        except (OSError, ValueError):
            continue
        if cache_fingerprint(tok, meta.get("max_length"), texts) == meta.get("fingerprint"):
            return ds, tok
    return None


def _earlier_caches(folders: list[PreparedDataset], tok_fp: str, max_length: int) -> list[tuple]:
    """(token cache, a function reading its captions) of each split of the first of ``folders`` whose caches
    this tokenizer built with this max_length."""
    for ds in folders:
        pairs = []
        for split in SPLITS:
            try:
                cache = TokenCache(ds.tokens_dir, split)
            except (OSError, ValueError):
                continue
            if cache.meta.get("tokenizer") == tok_fp and cache.meta.get("max_length") == max_length:
                pairs.append((cache, functools.partial(_texts, ds, split)))
        if pairs:
            return pairs
    return []


def _texts(ds: PreparedDataset, split: str) -> list[str]:
    """The captions of ``split`` of ``ds``, in row order; [] when its rows file is not as prepare.json records
    it (a caption edited by hand must not be given the tokens of the one it replaced)."""
    rel = split_file(split)
    if rel not in ds.files or changed_files(ds.root, {rel: ds.files[rel]}):
        return []
    try:
        with open(ds.root / rel, "rb") as f:
            return [json.loads(line)["text"] for line in f if line.strip()]
    except (OSError, ValueError, KeyError, TypeError):
        return []
