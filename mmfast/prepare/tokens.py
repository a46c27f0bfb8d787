"""A preparation's tokenizer and token cache, kept from earlier preparations of the input where they still
apply: a WordPiece vocabulary trained on the very same training captions is copied rather than trained again,
and a caption an earlier token cache of the same tokenizer holds is copied rather than tokenized again
(``mmfast.data.earlier_tokens``). What is written is, byte for byte, what a preparation from nothing writes.

Only complete preparations by this version of mmfast are used. Every byte taken from one is read once and
checked against the size and SHA-256 its prepare.json records, so a file changed by hand, damaged, or replaced
by a preparation running beside this one lends nothing; a file that cannot be read lends nothing either.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import io
import json
import logging
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mmfast.data.dataset import SPLITS, TOKENIZER_DIR, TOKENS_DIR, DatasetError, PreparedDataset, split_file
from mmfast.data.earlier_tokens import EarlierSplit, EarlierTokens
from mmfast.data.token_cache import TokenCache, cache_fingerprint
from mmfast.data.tokenizer import library_versions, load_tokenizer, tokenizer_fingerprint, train_wordpiece
from mmfast.prepare.config import PrepareConfig

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
    folders = [ds for d in reversed(earlier) if (ds := _opened(d)) is not None]  # --out's own first
    train_texts = [r["text"] for r in rows["train"]]
    tok, source = None, None
    for ds in folders if not cfg.tokenizer else ():
        tok = _kept_vocabulary(ds, cfg, train_texts, tmp / TOKENIZER_DIR)
        if tok is not None:
            source = ds
            log.info("tokenizer: the vocabulary %s trained on the same captions is kept", ds.root)
            break
    if tok is None:
        tok = load_tokenizer(cfg.tokenizer) if cfg.tokenizer else train_wordpiece(train_texts, cfg.vocab_size)
        save_tokenizer(tok, tmp / TOKENIZER_DIR)
    t_tok = time.perf_counter()
    earlier_rows = EarlierTokens(_earlier_splits(folders, tokenizer_fingerprint(tok), cfg.max_length))
    caches = {}
    first = 0
    for split, these in rows.items():
        texts = [r["text"] for r in these]
        caches[split] = TokenCache.build(
            tmp / TOKENS_DIR, split, texts, tok, cfg.max_length, first_id=first, earlier=earlier_rows
        )
        first += len(these)
    seconds = {"tokenizer": t_tok - t0, "token_cache": time.perf_counter() - t_tok}
    return Tokenized(tok, caches, str(source.root) if source is not None else "", seconds)


def save_tokenizer(tok, path: Path) -> None:
    """``tok.save_pretrained(path)``, a failed write raised as the OSError it is."""
    try:
        tok.save_pretrained(path)
    except OSError:
        raise
    except Exception as e:  # the tokenizers library reports a failed write as a bare Exception
        code = re.search(r"os error (\d+)", str(e))
        raise OSError(int(code.group(1)) if code else errno.EIO, f"saving the tokenizer: {e}", str(path)) from e


def _opened(folder: Path) -> PreparedDataset | None:
    try:
        return PreparedDataset(folder, verify=False)
    except (OSError, DatasetError, KeyError, TypeError, ValueError):
        return None


def _checked(ds: PreparedDataset, rel: str) -> bytes | None:
    """The bytes of ``rel`` in ``ds``, read once, when they are what its prepare.json records; else None."""
    want = ds.files.get(rel)
    try:
        data = (ds.root / rel).read_bytes()
    except OSError:
        return None
    if not isinstance(want, dict) or len(data) != want.get("size"):
        return None
    return data if hashlib.sha256(data).hexdigest() == want.get("sha256") else None


def _meta(ds: PreparedDataset, split: str) -> dict | None:
    data = _checked(ds, f"{TOKENS_DIR}/{split}.meta.json")
    try:
        meta = json.loads(data) if data is not None else None
    except ValueError:
        return None
    return meta if isinstance(meta, dict) else None


def _kept_vocabulary(ds: PreparedDataset, cfg: PrepareConfig, texts: list[str], dest: Path):
    """The WordPiece vocabulary of ``cfg.vocab_size`` that ``ds`` trained on exactly ``texts`` under these
    libraries, its checked files copied into ``dest`` (its train token cache's fingerprint is that of ``texts``
    under it, so no row is read); None, ``dest`` left absent, when there is none."""
    config = ds.summary.get("config") or {}
    if config.get("tokenizer") is not None or config.get("vocab_size") != cfg.vocab_size:
        return None
    meta = _meta(ds, "train")
    if meta is None or meta.get("libraries") != library_versions():
        return None
    files = [rel for rel in ds.files if rel.split("/")[0] == TOKENIZER_DIR]
    try:
        for rel in files:
            data = _checked(ds, rel)
            if data is None:
                raise ValueError(f"{ds.root / rel} is not as prepared")
            target = dest / Path(rel).relative_to(TOKENIZER_DIR)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
        tok = load_tokenizer(dest) if files else None
        if tok is not None and cache_fingerprint(tok, meta.get("max_length"), texts) == meta.get("fingerprint"):
            return tok
    except (OSError, ValueError):
        pass
    shutil.rmtree(dest, ignore_errors=True)
    return None


def _earlier_splits(folders: list[PreparedDataset], tok_fp: str, max_length: int) -> list[EarlierSplit]:
    """The checked token cache splits of the first of ``folders`` whose caches this tokenizer built with this
    max_length under these libraries."""
    versions = library_versions()
    for ds in folders:
        found = []
        for split in SPLITS:
            meta = _meta(ds, split)
            if meta is None or (meta.get("tokenizer"), meta.get("max_length")) != (tok_fp, max_length):
                continue
            ids = _checked(ds, f"{TOKENS_DIR}/{split}.ids.bin")
            offsets = _checked(ds, f"{TOKENS_DIR}/{split}.offsets.npy")
            if ids is None or offsets is None or meta.get("libraries") != versions:
                continue
            try:
                found.append(
                    EarlierSplit(
                        meta,
                        np.frombuffer(ids, dtype=meta["dtype"]),
                        np.load(io.BytesIO(offsets)),
                        functools.partial(_texts, ds, split),
                        f"{ds.root}/{split}",
                    )
                )
            except (ValueError, TypeError, KeyError):  # a meta that names no dtype, an offsets file not .npy
                continue
        if found:
            return found
    return []


def _texts(ds: PreparedDataset, split: str) -> list[str]:
    """The captions of ``split`` of ``ds``, in row order; [] when its rows file is not as prepare.json records
    it (a caption edited by hand must not be given the tokens of the one it replaced) or cannot be read. Read
    and hashed in one pass."""
    rel = split_file(split)
    want = ds.files.get(rel)
    h, texts, size = hashlib.sha256(), [], 0
    try:
        with open(ds.root / rel, "rb") as f:
            for line in f:
                h.update(line)
                size += len(line)
                if line.strip():
                    texts.append(json.loads(line)["text"])
    except (OSError, ValueError, KeyError, TypeError):
        return []
    if not isinstance(want, dict) or (size, h.hexdigest()) != (want.get("size"), want.get("sha256")):
        return []
    return texts
