"""Captions tokenized once by the trainer's own tokenizer, kept as fixed-width rows and served by row id.

Any tokenizer: open_clip's (``open_clip.get_tokenizer``: a (N, 77) tensor per call), a Hugging Face one
(slow or fast: padded to ``context_length``, with its attention mask), or a plain callable that maps a list
of captions to equal-length rows (a tensor, an array, lists, or a dict with ``input_ids``). The rows keep the
tokenizer's own padding, length and dtype, so the text tower sees what the tokenizer would have given it.

With a cache folder the rows are also written to disk once and memory-mapped by later runs, keyed by a
fingerprint of the tokenizer (its type, and what it makes of a few fixed probe captions), the length and the
captions: a stale cache is never read.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from mmfast.util.fsutil import fsync_dir
from mmfast.util.locks import file_lock

log = logging.getLogger(__name__)
FORMAT_VERSION = 1
CHUNK = 4096  # captions per tokenizer call
# Captions every fingerprint tokenizes: two tokenizers that agree on them all agree on the vocabulary with
# near certainty.
_PROBES = (
    "a photo of a cat",
    "Zebra crossing at 3 AM, 42 km/h!",
    "naïve café déjà vu",
    "日本語のテキスト",
    "x" * 300,
)
_MAX_CONTEXT = 100_000  # a Hugging Face model_max_length above this is its "no limit" placeholder


@dataclass(frozen=True)
class CaptionTokens:
    """Token rows of every caption, by row id.

    ``input_ids``: (N, L) in the tokenizer's dtype; ``attention_mask``: (N, L) or None when the tokenizer
    gives none (open_clip's towers find the end of each caption themselves).
    """

    input_ids: np.ndarray
    attention_mask: np.ndarray | None
    fingerprint: str

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def context_length(self) -> int:
        return int(self.input_ids.shape[1])

    def gather(self, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(input_ids (B, L), attention_mask (B, L) or None) of the given row ids."""
        ids = torch.from_numpy(np.ascontiguousarray(self.input_ids[rows]))
        if self.attention_mask is None:
            return ids, None
        return ids, torch.from_numpy(np.ascontiguousarray(self.attention_mask[rows]))


def is_hf_tokenizer(tokenizer) -> bool:
    """A Hugging Face tokenizer (slow or fast), told apart by what its call takes and its padding needs."""
    return hasattr(tokenizer, "pad_token_id") and hasattr(tokenizer, "model_max_length")


def tokenize_captions(
    captions: Sequence[str],
    tokenizer,
    *,
    context_length: int | None = None,
    cache_dir: str | os.PathLike | None = None,
) -> CaptionTokens:
    """Every caption's token row, tokenized once (and cached in ``cache_dir`` when given).

    Args:
        captions: the captions, by row id.
        tokenizer: open_clip's, a Hugging Face one, or a callable (list of captions -> equal-length rows).
        context_length: the row length. A Hugging Face tokenizer pads and truncates to it (default: its
            ``model_max_length``); another tokenizer is called with ``context_length=`` when given.
        cache_dir: a folder to keep the rows in, read back by later runs with the same tokenizer and captions.

    Raises:
        ValueError naming what the tokenizer returned that cannot be used (rows of different lengths, another
        count of rows, no pad token).
    """
    captions = [str(c) for c in captions]
    length = _hf_length(tokenizer, context_length) if is_hf_tokenizer(tokenizer) else context_length
    fp = _fingerprint(tokenizer, length, captions)
    if cache_dir is None:
        return _tokenize(captions, tokenizer, length, fp)
    folder = Path(cache_dir)
    names = folder / f"captions-{fp[:32]}.ids.npy", folder / f"captions-{fp[:32]}.mask.npy"
    with file_lock(folder / f".captions-{fp[:32]}.lock"):
        if names[0].exists():
            log.info("caption tokens: reading %s", names[0])
            mask = np.load(names[1], mmap_mode="r") if names[1].exists() else None
            cached = CaptionTokens(np.load(names[0], mmap_mode="r"), mask, fp)
            if len(cached) == len(captions):
                return cached
        tokens = _tokenize(captions, tokenizer, length, fp)
        if tokens.attention_mask is not None:  # written first: the ids' file says the rows are complete
            _save(names[1], tokens.attention_mask)
        _save(names[0], tokens.input_ids)
    return tokens


def _hf_length(tokenizer, context_length: int | None) -> int:
    if tokenizer.pad_token_id is None:
        raise ValueError(
            f"{type(tokenizer).__name__} has no pad token, and the rows must be padded to one length: set one "
            "(tokenizer.pad_token = tokenizer.eos_token) before passing it"
        )
    length = context_length or tokenizer.model_max_length
    if not length or length > _MAX_CONTEXT:
        raise ValueError(
            f"{type(tokenizer).__name__} names no maximum length (model_max_length={tokenizer.model_max_length}): "
            "pass context_length=, the length your text tower takes"
        )
    return int(length)


def _call(tokenizer, texts: list[str], length: int | None) -> tuple[np.ndarray, np.ndarray | None]:
    """One tokenizer call: (ids (n, L), mask (n, L) or None), checked."""
    if is_hf_tokenizer(tokenizer):
        out = tokenizer(texts, padding="max_length", truncation=True, max_length=length)
    elif length is not None:
        out = tokenizer(texts, context_length=length)
    else:
        out = tokenizer(texts)
    mask = None
    if isinstance(out, Mapping):  # a BatchEncoding, or a dict of its own
        if "input_ids" not in out:
            raise ValueError(f"the tokenizer returned a dict without 'input_ids' (keys: {', '.join(out)})")
        mask = out.get("attention_mask")
        out = out["input_ids"]
    ids = _rows(out, len(texts), "rows")
    if mask is not None:
        mask = _rows(mask, len(texts), "attention mask rows")
        if mask.shape != ids.shape:
            raise ValueError(f"the tokenizer's attention mask is {mask.shape[1]} wide, its rows {ids.shape[1]}")
    return ids, mask


def _rows(out, n: int, what: str) -> np.ndarray:
    if isinstance(out, torch.Tensor):
        out = out.detach().cpu().numpy()
    elif not isinstance(out, np.ndarray):
        lengths = {len(r) for r in out}
        if len(lengths) > 1:
            raise ValueError(
                f"the tokenizer returned {what} of {len(lengths)} different lengths ({min(lengths)} to "
                f"{max(lengths)}); have it pad to one length (open_clip's tokenizers do; a Hugging Face one is "
                "padded to context_length)"
            )
        out = np.asarray(out, dtype=np.int64)
    if out.ndim != 2 or len(out) != n:
        raise ValueError(
            f"the tokenizer returned {what} of shape {tuple(out.shape)} for {n} captions; expected ({n}, L)"
        )
    return out


def _tokenize(captions: list[str], tokenizer, length: int | None, fp: str) -> CaptionTokens:
    parts = [_call(tokenizer, captions[s : s + CHUNK], length) for s in range(0, len(captions), CHUNK)]
    ids = np.concatenate([p[0] for p in parts])
    masks = [p[1] for p in parts]
    mask = None if any(m is None for m in masks) else np.concatenate(masks)
    return CaptionTokens(ids, mask, fp)


def _fingerprint(tokenizer, length: int | None, captions: list[str]) -> str:
    """What the rows depend on: the tokenizer's type and its rows for ``_PROBES``, the length, the captions."""
    kind = type(tokenizer)
    name = f"{kind.__module__}.{kind.__qualname__}"
    h = hashlib.sha256(f"v{FORMAT_VERSION}|{name}|{length}|{len(captions)}".encode())
    try:
        ids, mask = _call(tokenizer, list(_PROBES), length)
        h.update(ids.astype(np.int64).tobytes())
        h.update(b"mask" if mask is None else mask.astype(np.int64).tobytes())
    except ValueError:  # rows it cannot use: the captions' own call says so, in their numbers
        h.update(b"unusable")
    for c in captions:
        h.update(c.encode("utf-8", "surrogatepass"))
        h.update(b"\x00")
    return h.hexdigest()


def _save(path: Path, array: np.ndarray) -> None:
    """``np.save`` through a temp file in the same folder and a rename: a reader sees all of it or nothing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, array)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
