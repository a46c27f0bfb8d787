"""What reading each of the user's files gave (the rows and rejects of one WebDataset shard), kept beside a
prepared dataset so that a later preparation does not decode an unchanged file again.

A record holds one file's path, its [size, mtime_ns] when it was read, the reading options (``key``: the
members, label rule, pixel budget, and the format's version), the path by which its rows name it (``rel``), and
its candidates and rejects as read. A later preparation reuses the record only when all of these still match;
a missing, damaged or older record reuses nothing. Each record is a file of its own in the folder
``FILE_READS``, named by a hash of the file's path, so a ``--shard`` part reads only its own files' records.
Remote files are not recorded: a stat of them is a request, and their fetch is what a check would save.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path

from mmfast.data.dataset import FILE_READS
from mmfast.inputs.manifest import Candidate, Reject
from mmfast.util.fsutil import read_json_object

Rows = tuple[list[Candidate], list[Reject]]
VERSION = 1  # of a record's layout; a change makes every earlier record unused


def record(path, stat: list[int] | None, key: dict, rel: str, rows: Rows) -> dict | None:
    """One file's record: ``stat`` [size, mtime_ns] as taken before reading it; ``rows``: what reading gave.
    None for a remote file (no stat), and for a read that ended early (a reject at line 0: the file could not be
    read to its end, which may pass, as a network filesystem's error does)."""
    cands, rejects = rows
    if stat is None or any(r.line == 0 for r in rejects):
        return None
    return {
        "file": str(path),
        "stat": stat,
        "key": key | {"version": VERSION},
        "rel": rel,
        "rows": [asdict(c) for c in cands],
        "rejects": [asdict(r) for r in rejects],
    }


def reusable(rec: dict | None, stat: list[int] | None, rel: str, key: dict) -> Rows | None:
    """The rows of ``rec`` when it was read with ``key`` as ``rel`` and the file still has ``stat``; else None."""
    if rec is None or stat is None or rec.get("stat") != stat or rec.get("key") != key | {"version": VERSION}:
        return None
    if rec.get("rel") != rel:  # the same file reached through another source: its rows name it otherwise
        return None
    try:
        cands = [Candidate(**c) for c in rec["rows"]]
        rejects = [Reject(**r) for r in rec["rejects"]]
        for c in cands:
            c.decoded = tuple(c.decoded) if c.decoded else None
    except (KeyError, TypeError):
        return None
    if not all(isinstance(v, kind) for c in cands for v, kind in _fields(c)):
        return None  # a record edited by hand: read the file again
    return cands, rejects


def _fields(c: Candidate) -> list[tuple]:
    """(value, type) of the fields the index and the checks rely on."""
    return [(c.source, dict), (c.image, str), (c.text, str), (c.line, int), (c.width, int), (c.height, int)]


def _name(path) -> str:
    return hashlib.sha256(os.fsencode(str(path))).hexdigest()[:32] + ".json"  # any name the filesystem holds


def write(folder: Path, records: list[dict], carried: list[Path] = ()) -> None:
    """Each record into ``folder``'s ``FILE_READS``, a file each (no folder for none), and the record files
    ``carried`` (``record_files`` of a merge's parts) linked in unread. ``folder`` is a directory being built
    (``fsutil.atomic_dir``), whose swap makes them durable: no file is synced on its own."""
    if records or carried:
        (folder / FILE_READS).mkdir(exist_ok=True)
    for rec in records:  # ASCII JSON: a path that is not UTF-8 is kept as its escapes
        (folder / FILE_READS / _name(rec["file"])).write_text(json.dumps(rec, separators=(",", ":")))
    for src in carried:  # a damaged one is refused when read, as any record is
        dest = folder / FILE_READS / src.name
        try:
            os.link(src, dest)
        except FileExistsError:  # parts read disjoint files: never the same record twice
            continue
        except OSError:  # a filesystem without hard links, or another device
            shutil.copyfile(src, dest)


def record_files(folder: Path) -> list[Path]:
    """The record files in ``folder`` (a part's): what a merge carries over without reading them (at millions
    of rows the records are about the size of the rows)."""
    return sorted((folder / FILE_READS).glob("*.json"))


def load(folders: list[Path], paths: list) -> dict[str, list[dict]]:
    """{file path: its records in ``folders``, the last folder's first} for each of ``paths`` that has one; a
    missing or damaged record is left out (that file is read)."""
    found: dict[str, list[dict]] = {}
    for folder in reversed(folders):
        for path in paths:
            rec = read_json_object(folder / FILE_READS / _name(path))
            if rec.get("file") == str(path):
                found.setdefault(str(path), []).append(rec)
    return found


def load_all(folder: Path) -> list[dict]:
    """Every record in ``folder`` (a part's, for the merge)."""
    recs = (read_json_object(p) for p in sorted((folder / FILE_READS).glob("*.json")))
    return [r for r in recs if isinstance(r.get("file"), str)]
