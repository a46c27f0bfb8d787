"""The tokenization cache: captions tokenized once, served by sample id.

Layout of ``tokens/`` (one set per split):
    <split>.ids.bin      all token ids of the split, concatenated (uint16 when the vocabulary fits, else int32)
    <split>.offsets.npy  int64 (n + 1,): row i is ids[offsets[i]:offsets[i+1]]
    <split>.meta.json    fingerprint, dtype, counts, first_id, pad id; written last, so its presence
                         means the split is complete
A split is rebuilt when its fingerprint (tokenizer, max_length, texts) differs or its files do not match
the meta (truncated, missing); each build goes to a temp name and is renamed into place. A build may be given
earlier caches of the same tokenizer and max_length with their texts: a caption found there is copied, not
tokenized again (a corpus prepared again after a shard was added tokenizes only the new shard's captions).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from mmfast.data.tokenizer import library_versions, tokenizer_fingerprint
from mmfast.util.commands import PREPARE
from mmfast.util.fsutil import atomic_write_bytes, atomic_write_json
from mmfast.util.locks import file_lock

if TYPE_CHECKING:  # the earlier rows' module imports this one
    from mmfast.data.earlier_tokens import EarlierTokens

log = logging.getLogger(__name__)
_NO_CACHE = "no cache yet"  # the reason for a first build
FORMAT_VERSION = 1
TEXT_PADDINGS = ("longest", "buckets", "max")  # how wide a batch's token rows are (``TokenCache.gather``)
_SMALLEST_BUCKET = 8


def padded_width(longest: int, padding: str, max_length: int) -> int:
    """The width of a batch whose longest row has ``longest`` tokens: that (``longest``), the next power of two
    from 8 up, at most ``max_length`` (``buckets``: a handful of shapes, so a compiled step or a CUDA graph is
    made once per bucket, at most 2x the tokens), or ``max_length`` (``max``: one shape)."""
    if padding not in TEXT_PADDINGS:
        raise ValueError(f"text padding must be one of {', '.join(TEXT_PADDINGS)}, got {padding!r}")
    longest = max(1, longest)
    if padding == "longest":
        return longest
    if padding == "max":
        return max(longest, max_length)
    return max(longest, min(max_length, max(_SMALLEST_BUCKET, 1 << (longest - 1).bit_length())))


def cache_fingerprint(tok, max_length: int, texts: list[str]) -> str:
    """Hash of (tokenizer, max_length, texts): the key of a cache split."""
    h = hashlib.sha256(f"v{FORMAT_VERSION}|{tokenizer_fingerprint(tok)}|{max_length}|{len(texts)}".encode())
    for t in texts:
        h.update(t.encode("utf-8", "surrogatepass"))
        h.update(b"\x00")
    return h.hexdigest()


class TokenCache:
    """Pre-tokenized text of one split, memory-mapped read-only, gathered into padded batches by sample id.

    Sample ids of a split are the contiguous range ``[first_id, first_id + len)``.
    """

    def __init__(self, directory: str | os.PathLike, split: str):
        self.dir = Path(directory)
        self.split = split
        meta_path = self.dir / f"{split}.meta.json"
        if not meta_path.exists():
            raise FileNotFoundError(f"{meta_path}: no token cache for split '{split}'; run {PREPARE}")
        self.meta = json.loads(meta_path.read_text())
        problem = _check_files(self.dir, split, self.meta)
        if problem:
            raise ValueError(f"token cache {self.dir}/{split} is damaged ({problem}); re-run {PREPARE}")
        self.first_id = int(self.meta["first_id"])
        self.pad_id = int(self.meta["pad_id"])
        self.offsets = np.load(self.dir / f"{split}.offsets.npy", mmap_mode="r")
        n_tokens = int(self.meta["n_tokens"])
        # np.memmap cannot map an empty file; an empty split has no tokens to gather anyway.
        self.ids = (
            np.memmap(self.dir / f"{split}.ids.bin", dtype=self.meta["dtype"], mode="r", shape=(n_tokens,))
            if n_tokens
            else np.zeros(0, dtype=self.meta["dtype"])
        )
        self.lengths = np.diff(np.asarray(self.offsets)).astype(np.int64)
        self._pin = torch.cuda.is_available()
        self.copied = 0  # rows ``build`` copied from earlier caches rather than tokenized

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def fingerprint(self) -> str:
        return self.meta["fingerprint"]

    def gather(
        self, ids: np.ndarray | torch.Tensor | list[int], padding: str = "longest"
    ) -> dict[str, torch.Tensor]:
        """Token ids and attention mask of the given sample ids, padded to the longest row in the batch (or to
        its bucket, or to max_length: ``padded_width``).

        Args:
            ids: sample ids (B,); ids < 0 mark padding samples and get [PAD] rows with mask 0.
            padding: one of ``TEXT_PADDINGS``.

        Returns:
            {"input_ids": (B, L) int64, "attention_mask": (B, L) int64}; pinned when CUDA is available so
            the caller can copy with ``non_blocking=True``.
        """
        ids = np.asarray(ids.cpu() if isinstance(ids, torch.Tensor) else ids, dtype=np.int64).reshape(-1)
        rows = ids - self.first_id
        valid = ids >= 0
        if np.any(valid & ((rows < 0) | (rows >= len(self)))):
            bad = ids[valid & ((rows < 0) | (rows >= len(self)))][:5].tolist()
            raise IndexError(
                f"sample ids {bad} are not in split '{self.split}' "
                f"(ids {self.first_id}..{self.first_id + len(self) - 1})"
            )
        rows = np.where(valid, rows, 0)
        lengths = np.where(valid, self.lengths[rows], 0)
        width = padded_width(int(lengths.max(initial=0)), padding, int(self.meta["max_length"]))
        cols = np.arange(width)
        mask = cols[None, :] < lengths[:, None]  # (B, L)
        pos = np.where(mask, self.offsets[rows][:, None] + cols[None, :], 0)
        input_ids = np.where(mask, self.ids[pos] if len(self.ids) else 0, self.pad_id).astype(np.int64)
        out = {"input_ids": torch.from_numpy(input_ids), "attention_mask": torch.from_numpy(mask.astype(np.int64))}
        if self._pin:
            out = {k: v.pin_memory() for k, v in out.items()}
        return out

    @classmethod
    def build(
        cls,
        directory: str | os.PathLike,
        split: str,
        texts: list[str],
        tokenizer,
        max_length: int,
        first_id: int = 0,
        batch_size: int = 4096,
        earlier: EarlierTokens | None = None,
    ) -> TokenCache:
        """Open the split's cache, (re)building it first if it is missing, stale or damaged.

        Safe to call from several processes at once: one builds under a lock, the others wait and read.

        Args:
            directory: the ``tokens/`` folder.
            split: split name ("train", "val").
            texts: the captions, in sample-id order.
            tokenizer: a fast Hugging Face tokenizer.
            max_length: truncation length, special tokens included.
            first_id: sample id of ``texts[0]``.
            batch_size: texts per tokenizer call.
            earlier: rows of earlier caches (``mmfast.data.earlier_tokens``) that stand in for tokenizing the
                same captions again, where they were made as this build makes them.

        Raises:
            TypeError: a text that is not a string (its index and sample id are named).
        """
        directory = Path(directory)
        bad = next((k for k, t in enumerate(texts) if not isinstance(t, str)), None)
        if bad is not None:
            raise TypeError(
                f"texts[{bad}] (sample id {first_id + bad}) is {type(texts[bad]).__name__}, not a caption string: "
                "give every sample a string (an empty one for no caption)"
            )
        fp = cache_fingerprint(tokenizer, max_length, texts)
        with file_lock(directory / f".{split}.lock"):
            reason = _stale_reason(directory, split, fp, first_id)
            copied = 0
            if reason:  # a first build (a preparation's temp directory) is no news; a rebuild is
                level = logging.DEBUG if reason == _NO_CACHE else logging.INFO
                log.log(level, "token cache %s/%s: building (%s)", directory, split, reason)
                *rows, copied = _token_rows(texts, tokenizer, max_length, batch_size, earlier, fp)
                _write_split(directory, split, rows, tokenizer, max_length, first_id, fp)
        cache = cls(directory, split)
        cache.copied = copied
        return cache


def _check_files(directory: Path, split: str, meta: dict) -> str:
    ids_path, off_path = directory / f"{split}.ids.bin", directory / f"{split}.offsets.npy"
    if not ids_path.exists() or not off_path.exists():
        return "data files missing"
    expected = int(meta["n_tokens"]) * np.dtype(meta["dtype"]).itemsize
    if ids_path.stat().st_size != expected:
        return f"{ids_path.name} has {ids_path.stat().st_size} bytes, expected {expected}"
    try:
        offsets = np.load(off_path, mmap_mode="r")
    except (ValueError, OSError, EOFError) as e:
        return f"{off_path.name} unreadable: {e}"
    if offsets.shape != (int(meta["n_rows"]) + 1,) or (len(offsets) and int(offsets[-1]) != int(meta["n_tokens"])):
        return f"{off_path.name} does not match the meta"
    return ""


def _stale_reason(directory: Path, split: str, fp: str, first_id: int) -> str:
    meta_path = directory / f"{split}.meta.json"
    if not meta_path.exists():
        return _NO_CACHE
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return "meta file unreadable"
    if meta.get("fingerprint") != fp:
        return "fingerprint changed (tokenizer, max_length or texts differ)"
    if int(meta.get("first_id", -1)) != first_id:
        return "sample ids changed"
    return _check_files(directory, split, meta)


def _token_rows(
    texts: Sequence[str], tok, max_length: int, batch_size: int, earlier: EarlierTokens | None, fp: str
) -> tuple[np.ndarray, np.ndarray, int]:
    """(all token ids concatenated, each row's length, how many rows were copied) of ``texts``: the rows
    ``earlier`` lends, the others tokenized."""
    dtype = np.uint16 if len(tok) <= np.iinfo(np.uint16).max + 1 else np.int32

    def encode(these: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        return _encode(these, tok, max_length, dtype, batch_size)

    lent = earlier.rows(texts, tok, max_length, dtype, fp, encode) if earlier is not None else None
    return lent if lent is not None else (*encode(texts), 0)


def _encode(texts: Sequence[str], tok, max_length: int, dtype, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
    chunks, lengths = [], []
    for s in range(0, len(texts), batch_size):
        enc = tok(
            list(texts[s : s + batch_size]),
            truncation=True,
            max_length=max_length,
            add_special_tokens=True,
            return_attention_mask=False,
            return_token_type_ids=False,
        )["input_ids"]
        lengths.extend(len(e) for e in enc)
        chunks.append(np.fromiter((t for e in enc for t in e), dtype=dtype))
    flat = np.concatenate(chunks) if chunks else np.zeros(0, dtype=dtype)
    return flat, np.asarray(lengths, dtype=np.int64)


def _write_split(
    directory: Path, split: str, rows: tuple[np.ndarray, np.ndarray], tok, max_length: int, first_id: int, fp: str
) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{split}.meta.json").unlink(missing_ok=True)  # the split is incomplete from here on
    flat, lengths = rows
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    atomic_write_bytes(directory / f"{split}.ids.bin", flat.tobytes())
    buf = io.BytesIO()
    np.save(buf, offsets)
    atomic_write_bytes(directory / f"{split}.offsets.npy", buf.getvalue())
    atomic_write_json(
        directory / f"{split}.meta.json",
        {
            "format": FORMAT_VERSION,
            "fingerprint": fp,
            "tokenizer": tokenizer_fingerprint(tok),  # which earlier caches a later build may copy rows from
            "libraries": library_versions(),
            "dtype": flat.dtype.name,
            "n_rows": len(lengths),
            "n_tokens": int(flat.size),
            "first_id": first_id,
            "pad_id": int(tok.pad_token_id),
            "max_length": max_length,
            "vocab_size": len(tok),
        },
    )
