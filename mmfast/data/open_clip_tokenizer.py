"""open_clip's own tokenizer (its ``SimpleTokenizer``: CLIP's byte-level BPE, with open_clip's caption cleaning),
called as mmfast calls a Hugging Face tokenizer: the token cache, predict and the zero-shot prompts use it as
they use any other.

A token row is open_clip's: the start-of-text id, the caption's BPE ids, the end-of-text id, cut to the context
length (or ``max_length``, when shorter) with the end-of-text id last. Padding is open_clip's id 0.

A tokenizer directory holds ``open_clip_tokenizer.json`` (context length, cleaning) and the BPE merges file,
so a model directory rebuilds it offline from its own files.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from pathlib import Path

SPEC_FILE = "open_clip_tokenizer.json"
VOCAB_FILE = "bpe_simple_vocab_16e6.txt.gz"
FORMAT = "mmfast-open_clip-tokenizer/1"
CLEANINGS = ("lower", "whitespace", "canonicalize")  # open_clip/tokenizer.py's get_clean_fn
PAD_ID = 0  # open_clip fills a row past its end-of-text id with zeros


def is_open_clip_tokenizer(path: str | os.PathLike) -> bool:
    """True for a directory mmfast wrote an open_clip tokenizer into."""
    return (Path(path) / SPEC_FILE).is_file()


class OpenClipTokenizer:
    """open_clip's ``SimpleTokenizer`` behind the calls mmfast makes of a fast Hugging Face tokenizer.

    Args:
        context_length: the longest row open_clip's text tower takes (its positional embeddings).
        clean: open_clip's caption cleaning ("lower", "whitespace" or "canonicalize").
        vocab: the BPE merges file; open_clip's own when None.
    """

    is_fast = True  # what load_tokenizer asks of a tokenizer: it tokenizes a batch in one call
    padding_side = "right"
    truncation_side = "right"
    pad_token_id = PAD_ID

    def __init__(self, context_length: int = 77, clean: str = "lower", vocab: str | os.PathLike | None = None):
        try:  # open_clip (and its ftfy): only for a model that tokenizes as open_clip does
            from open_clip.tokenizer import SimpleTokenizer, default_bpe
        except ImportError as e:
            raise ValueError("open_clip's tokenizer needs open_clip: pip install 'mmfast[peers]'") from e
        if clean not in CLEANINGS:
            raise ValueError(f"open_clip tokenizer: no cleaning {clean!r}; choose from {', '.join(CLEANINGS)}")
        self.vocab = str(vocab or default_bpe())
        self.context_length, self.clean = int(context_length), clean
        self._tok = SimpleTokenizer(bpe_path=self.vocab, context_length=self.context_length, clean=clean)

    @classmethod
    def from_text_cfg(cls, text_cfg: dict, where: str) -> OpenClipTokenizer:
        """The tokenizer open_clip's ``get_tokenizer`` builds for a model whose ``text_cfg`` names no Hugging
        Face tokenizer.

        Raises:
            ValueError: the config asks for what this tokenizer does not do (a reduction mask, other tokens).
        """
        _need_open_clip(where)
        kwargs = dict(text_cfg.get("tokenizer_kwargs") or {})
        other = sorted(set(kwargs) - {"clean"})
        if other:
            raise ValueError(f"{where}: tokenizer_kwargs {other} are not supported; mmfast takes 'clean' only")
        return cls(int(text_cfg.get("context_length", 77)), kwargs.get("clean", "lower"))

    @classmethod
    def load(cls, path: str | os.PathLike) -> OpenClipTokenizer:
        """The tokenizer ``save_pretrained`` wrote into ``path``."""
        path = Path(path)
        _need_open_clip(str(path))
        spec = json.loads((path / SPEC_FILE).read_text(encoding="utf-8"))
        if spec.get("format") != FORMAT:
            raise ValueError(f"{path / SPEC_FILE}: format {spec.get('format')!r}, expected {FORMAT!r}")
        return cls(spec["context_length"], spec["clean"], path / VOCAB_FILE)

    def save_pretrained(self, path: str | os.PathLike) -> None:
        """Write the spec and the BPE merges file into ``path``."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        if Path(self.vocab).resolve() != (path / VOCAB_FILE).resolve():
            shutil.copyfile(self.vocab, path / VOCAB_FILE)
        spec = {"format": FORMAT, "context_length": self.context_length, "clean": self.clean}
        (path / SPEC_FILE).write_text(json.dumps(spec, indent=2) + "\n", encoding="utf-8")

    def __len__(self) -> int:
        return self._tok.vocab_size

    def fingerprint(self) -> str:
        """A hash of everything that changes token ids: the merges, the cleaning, the context length."""
        h = hashlib.sha256(Path(self.vocab).read_bytes())
        h.update(json.dumps([FORMAT, self.clean, self.context_length]).encode())
        return h.hexdigest()

    def bpe(self) -> tuple[dict[str, int], list[tuple[str, str]]]:
        """The byte-level BPE as a Hugging Face ``CLIPTokenizer`` takes it: (token -> id, merges by rank)."""
        ranks = sorted(self._tok.bpe_ranks.items(), key=lambda item: item[1])
        return dict(self._tok.encoder), [pair for pair, _ in ranks]

    def encode_row(self, text: str, max_length: int | None = None) -> list[int]:
        """One caption's ids as open_clip's tokenizer gives them, cut to ``max_length`` (at most the context)."""
        width = min(self.context_length, max_length or self.context_length)
        ids = [self._tok.sot_token_id, *self._tok.encode(text), self._tok.eot_token_id]
        if len(ids) > width:
            ids = ids[:width]
            ids[-1] = self._tok.eot_token_id
        return ids

    def __call__(
        self,
        texts: str | list[str],
        truncation: bool = True,
        max_length: int | None = None,
        padding: bool | str = False,
        return_tensors: str | None = None,
        **_ignored,
    ) -> dict:
        """``{"input_ids", "attention_mask"}`` of the captions, as a fast tokenizer returns them: lists of rows,
        or (B, L) tensors padded to the longest row with ``return_tensors="pt"``. Rows are always cut at the
        context length, as open_clip cuts them (``truncation`` is taken for a Hugging Face caller's sake)."""
        rows = [self.encode_row(t, max_length) for t in ([texts] if isinstance(texts, str) else texts)]
        masks = [[1] * len(r) for r in rows]
        if not padding and return_tensors is None:
            return {"input_ids": rows, "attention_mask": masks}
        import torch  # torch: only when tensors are asked for; the token cache tokenizes without it

        width = max((len(r) for r in rows), default=0)
        ids = torch.full((len(rows), width), PAD_ID, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), 1
        if return_tensors == "pt":
            return {"input_ids": ids, "attention_mask": mask}
        return {"input_ids": ids.tolist(), "attention_mask": mask.tolist()}


def _need_open_clip(where: str) -> None:
    """Raise a one-line error naming ``where`` and the extra to install when open_clip cannot be imported."""
    try:
        found = importlib.util.find_spec("open_clip.tokenizer") is not None
    except (ImportError, ValueError):  # a parent package that cannot be imported
        found = False
    if not found:
        raise ValueError(f"{where}: open_clip's tokenizer needs open_clip (pip install 'mmfast[peers]')")
