"""What a prepared directory's prepare.json records of its files (``files_map``), and reusing a directory that
was prepared from the same input and settings and whose files are as recorded (``reuse``)."""

from __future__ import annotations

import logging
from pathlib import Path

from mmfast.data.dataset import (
    LABELS_FILE,
    REJECTED_FILE,
    SPLITS,
    SUMMARY_FILE,
    TOKENIZER_DIR,
    TOKENS_DIR,
    WDS_DIR,
    PreparedDataset,
    split_file,
)
from mmfast.data.token_cache import TokenCache
from mmfast.data.tokenizer import load_tokenizer
from mmfast.util.fsutil import atomic_write_json, file_sha256, read_json_object

log = logging.getLogger(__name__)
SPLIT_FILES = (*map(split_file, SPLITS), LABELS_FILE, REJECTED_FILE)


def files_map(root: Path) -> dict[str, dict]:
    """{relative posix path: {"size", "sha256"}} of every file the training side verifies."""
    paths = [root / name for name in SPLIT_FILES]
    for sub in (TOKENS_DIR, TOKENIZER_DIR, WDS_DIR):
        # wds/: index files and listings (of the WebDataset export, or of an input read in place); the export's
        # shards are left out (hashing them at every start would read the whole dataset)
        paths += sorted(p for p in (root / sub).rglob("*") if p.is_file() and p.suffix not in (".lock", ".tar"))
    return {p.relative_to(root).as_posix(): {"size": p.stat().st_size, "sha256": file_sha256(p)} for p in paths}


def reuse(out: Path, fp: str) -> dict | None:
    """prepare.json of ``out`` when it was prepared from the same input and settings (fingerprint ``fp``) and
    its files are as recorded; a changed token cache is rebuilt (it follows from the verified rows and
    tokenizer). None when ``out`` must be prepared again."""
    summary = read_json_object(out / SUMMARY_FILE)
    if summary.get("input_fingerprint") != fp:
        return None
    if not isinstance(summary.get("files"), dict) or not summary["files"]:
        return None
    changed = _changed_files(out, summary["files"])
    if not changed:
        return summary
    if any(not rel.startswith("tokens/") for rel in changed):
        log.info("%s: %s changed since preparation; preparing again", out, changed[0])
        return None
    log.info("%s: token cache changed since preparation (%s); rebuilding it", out, changed[0])
    _rebuild_token_cache(out, summary, {rel.split("/")[1].split(".")[0] for rel in changed})
    summary["files"] = files_map(out)
    atomic_write_json(out / SUMMARY_FILE, summary)
    return summary


def _changed_files(root: Path, files: dict) -> list[str]:
    changed = []
    for rel, want in sorted(files.items()):
        p = root / rel
        if not p.is_file() or p.stat().st_size != want.get("size") or file_sha256(p) != want.get("sha256"):
            changed.append(rel)
    return changed


def _rebuild_token_cache(out: Path, summary: dict, splits: set[str]) -> None:
    tok = load_tokenizer(out / TOKENIZER_DIR)
    prepared = PreparedDataset(out, verify=False)
    for split in sorted(splits & set(SPLITS)):
        rows = prepared.rows(split)
        first = rows[0]["id"] if rows else summary["counts"]["train"]
        (out / TOKENS_DIR / f"{split}.meta.json").unlink(missing_ok=True)  # forces the rebuild
        TokenCache.build(
            out / TOKENS_DIR, split, [r["text"] for r in rows], tok, summary["max_length"], first_id=first
        )
