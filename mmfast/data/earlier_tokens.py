"""Token rows of earlier caches, by caption: what a token cache build copies rather than tokenizes, so that a
corpus prepared again tokenizes only its new captions.

The caller reads the earlier arrays and checks them (``mmfast.prepare.tokens`` against prepare.json's SHA-256s);
here captions are matched and rows assembled, in memory bounded by the chunk of rows gathered at a time. Only
splits built by the same tokenizer, max_length, cache format and tokenizer libraries lend rows.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from mmfast.data.token_cache import FORMAT_VERSION, TokenCache
from mmfast.data.tokenizer import library_versions, tokenizer_fingerprint

log = logging.getLogger(__name__)
_CHUNK_ROWS = 1 << 18  # rows gathered at a time: a few int64 arrays of their tokens


@dataclass
class EarlierSplit:
    """One split of an earlier token cache: its meta, ids and offsets (read and checked by the caller), and a
    function that reads its captions in row order (called only when captions must be matched)."""

    meta: dict
    ids: np.ndarray
    offsets: np.ndarray
    texts: Callable[[], Sequence[str]]
    where: str = ""  # for the log: the folder and split

    @classmethod
    def of_cache(cls, cache: TokenCache, texts: Sequence[str]) -> EarlierSplit:
        """An opened cache and its captions (the caller vouches for both)."""
        return cls(cache.meta, np.asarray(cache.ids), np.asarray(cache.offsets), lambda: texts, str(cache.dir))


class EarlierTokens:
    """The rows of ``splits`` a build may copy: a split of the very same fingerprint whole (its captions never
    read), else each caption found among the splits made as this build would make them. The caption lookup is
    made once and shared by the splits of a preparation."""

    def __init__(self, splits: Sequence[EarlierSplit]):
        self.splits = list(splits)
        self._lookups: dict[tuple, tuple | None] = {}

    def rows(self, texts: Sequence[str], tok, max_length: int, dtype, fp: str, encode: Callable):
        """(all token ids, each row's length, rows copied) of ``texts``, or None when no split lends a row.
        ``encode(texts)`` tokenizes the captions not found: (ids, lengths)."""
        versions = library_versions()
        made_so = [s for s in self.splits if _made_as(s.meta, max_length, dtype, versions)]
        whole = next((s for s in made_so if s.meta.get("fingerprint") == fp), None)
        if whole is not None:
            log.info("token cache: the captions are those of %s; its rows are copied", whole.where)
            return whole.ids, np.diff(whole.offsets).astype(np.int64), len(whole.offsets) - 1
        tok_fp = tokenizer_fingerprint(tok)
        key = (tok_fp, max_length, np.dtype(dtype).name)
        if key not in self._lookups:
            self._lookups[key] = _lookup([s for s in made_so if s.meta.get("tokenizer") == tok_fp])
        if self._lookups[key] is None:
            return None
        known, starts, lengths, pool = self._lookups[key]
        where = np.fromiter((known.get(t, -1) for t in texts), dtype=np.int64, count=len(texts))
        new = where < 0
        missing = np.flatnonzero(new)
        new_ids, new_lengths = encode([texts[k] for k in missing])
        row_start, row_len = np.empty(len(texts), np.int64), np.empty(len(texts), np.int64)
        row_start[~new], row_len[~new] = starts[where[~new]], lengths[where[~new]]
        row_start[new], row_len[new] = np.cumsum(new_lengths) - new_lengths, new_lengths
        flat = _gather(pool, new_ids, row_start, row_len, new, dtype)
        log.info("token cache: %d of %d captions tokenized, the rest copied", len(missing), len(texts))
        return flat, row_len, len(texts) - len(missing)


def _made_as(meta: dict, max_length: int, dtype, versions: dict) -> bool:
    """Whether a split's meta says it was made with this max_length, dtype, format and libraries."""
    return (
        meta.get("max_length") == max_length
        and meta.get("dtype") == np.dtype(dtype).name
        and meta.get("format") == FORMAT_VERSION
        and meta.get("libraries") == versions
    )


def _lookup(splits: list[EarlierSplit]) -> tuple | None:
    """({caption: row}, each row's start in the pool, each row's length, the pool of ids) over ``splits``
    whose captions can be read; None when there is no row."""
    known: dict[str, int] = {}
    starts, lengths, pools, n_rows, n_ids = [], [], [], 0, 0
    for s in splits:
        texts = s.texts()
        if len(texts) != len(s.offsets) - 1:  # captions unreadable, or not those of these rows
            continue
        known.update(zip(texts, range(n_rows, n_rows + len(texts)), strict=True))
        starts.append(np.asarray(s.offsets[:-1], dtype=np.int64) + n_ids)
        lengths.append(np.diff(s.offsets).astype(np.int64))
        pools.append(s.ids)
        n_rows, n_ids = n_rows + len(texts), n_ids + len(s.ids)
    if not known:
        return None
    pool = pools[0] if len(pools) == 1 else np.concatenate(pools)
    return known, np.concatenate(starts), np.concatenate(lengths), pool


def _gather(pool, new_ids, starts, lengths, new, dtype) -> np.ndarray:
    """The rows (``starts``, ``lengths``) concatenated: from ``new_ids`` where ``new``, else from ``pool``."""
    out = np.empty(int(lengths.sum()), dtype=dtype)
    firsts = np.cumsum(lengths) - lengths  # where each row begins in ``out``
    for a in range(0, len(lengths), _CHUNK_ROWS):
        part = slice(a, a + _CHUNK_ROWS)
        for source, pick in ((pool, ~new[part]), (new_ids, new[part])):
            s, n, f = starts[part][pick], lengths[part][pick], firsts[part][pick]
            if not n.sum():
                continue
            within = np.arange(int(n.sum()), dtype=np.int64) - np.repeat(np.cumsum(n) - n, n)
            out[np.repeat(f, n) + within] = source[np.repeat(s, n) + within]
    return out
