"""Where each input was prepared last (``remember``, ``last_prepared``): a preparation into a new folder, or a
run's raw --data, keeps the image checks of the input's last preparation elsewhere, as one into the same folder
keeps its own. A small file per input under ``cache_home()/last-prepared``, naming the folder."""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

from mmfast.data.dataset import SUMMARY_FILE
from mmfast.remote.errors import redact
from mmfast.remote.objects import is_remote
from mmfast.util.fsutil import atomic_write_json, cache_home, read_json_object

log = logging.getLogger(__name__)
LAST_PREPARED = "last-prepared"  # under cache_home(): one small file per input, naming its last folder
_REMEMBERED = 256  # inputs remembered; beyond, the entries of folders that are gone, then the oldest, go


def source_name(source: str) -> str:
    """How prepare.json names an input: its resolved path, or its URL without credentials."""
    return redact(source) if is_remote(source) else str(Path(source).resolve())


def _entry(source: str) -> Path:
    return cache_home() / LAST_PREPARED / f"{hashlib.sha256(source.encode('utf-8')).hexdigest()[:32]}.json"


def remember(source: str, out: Path) -> None:
    """Note ``out`` as the folder ``source`` (``source_name``'s) was last prepared into. Best effort: a cache
    that cannot be written costs a later preparation its reuse, not this one its result."""
    entry = _entry(source)
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(entry, {"source": source, "out": str(out.resolve())})
        entries = list(entry.parent.glob("*.json"))
        if len(entries) > _REMEMBERED:
            _forget(entries)
    except (OSError, ValueError, TypeError) as e:  # a cache that cannot be written, or a damaged entry
        log.debug("cannot note where %s was prepared (%s)", source, e)


def _forget(entries: list[Path]) -> None:
    gone = [e for e in entries if _folder(read_json_object(e)) is None]
    for e in gone:
        e.unlink(missing_ok=True)
    kept = sorted((e for e in entries if e not in gone), key=lambda e: e.stat().st_mtime_ns)
    for e in kept[: max(0, len(kept) - _REMEMBERED)]:
        e.unlink(missing_ok=True)


def last_prepared(source: str, out: Path) -> Path | None:
    """The folder ``source`` was last prepared into, when it is not ``out`` and is still a complete preparation
    of it; else None."""
    got = read_json_object(_entry(source))
    other = _folder(got)
    if other is None or got.get("source") != source or other == out.resolve():
        return None
    return other if read_json_object(other / SUMMARY_FILE).get("source") == source else None


def _folder(entry: dict) -> Path | None:
    """An entry's folder, when the entry names an absolute one that still holds a preparation."""
    out = entry.get("out")
    if not isinstance(out, str) or not os.path.isabs(out) or not (Path(out) / SUMMARY_FILE).is_file():
        return None
    return Path(out)
