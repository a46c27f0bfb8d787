"""Preparation split across processes or machines: ``--shard I/N`` checks one part of the input, ``--merge``
joins the parts into the prepared directory.

Validating (decoding) every image is what takes the time of a big preparation, and it needs no view of the
whole input, while the label map, the split, the tokenizer and the token cache do. So part i of n reads the
input, keeps its slice (a contiguous n-th of a manifest's rows, or of a WebDataset input's shards),
checks those images (and stores their --max-side copies), and writes what it found into

    OUT.parts/IIIII-of-NNNNN/     (beside OUT; written atomically, under a lock, marked as mmfast's)
        part.json                 input fingerprint, part, counts, seconds, the size and SHA-256 of the
                                  two row files (written last: the part is complete)
        accepted.jsonl            the rows kept, with their images' sizes
        rejected.jsonl            the rows dropped, with their reasons
        images/, downscaled/      files the part wrote (image bytes of a Parquet input, --max-side copies)

The merge (the same command and settings with --merge instead of --shard) checks that the n parts are all
there and were made from the same input and settings, hard-links the files they wrote into OUT (a copy
across filesystems), and writes OUT as a one-process preparation would: the same rows, split, ids and
fingerprint. A part already complete for the same input and settings is not made again, so a failed machine's
part is re-run alone; a part whose files no longer match its part.json (rows deleted or edited, a file cut
short, an image it wrote gone) is damaged: the merge names the file and the --shard command, which makes
that part again. The parts stay until the user removes them (``rm -r OUT.parts``): they are mmfast's,
but a merge may be re-run from them.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import asdict, replace
from pathlib import Path

from mmfast.inputs import file_reads, reader_named
from mmfast.inputs.manifest import Candidate, ManifestError, Reject, finish_rows
from mmfast.prepare.checks import Checked, read_and_check
from mmfast.prepare.config import PrepareConfig, part_dir, parts_root
from mmfast.prepare.fingerprint import input_fingerprint
from mmfast.util.fsutil import (
    atomic_dir,
    atomic_write_json,
    atomic_write_jsonl,
    dir_lock_path,
    file_lock,
    file_sha256,
    is_replaceable,
    read_json_object,
    recover_dir,
    write_errors,
)

log = logging.getLogger(__name__)
PART_KIND = "mmfast preparation part"  # the "kind" in a part directory's marker
_FIELDS = ("line", "image", "text", "label", "source", "file", "original", "width", "height")
_REJECT_FIELDS = ("line", "reason", "row")
_ROW_FILES = ("accepted.jsonl", "rejected.jsonl")  # recorded in part.json's "files": {name: {size, sha256}}


class _DamagedPart(Exception):
    """A complete part's files are not what its part.json records (edited, cut short, rows deleted)."""


def parse_shard(text: str) -> tuple[int, int]:
    """``"I/N"`` -> (I, N), 0 <= I < N.

    Raises:
        ValueError: not of that form.
    """
    try:
        i, n = (int(v) for v in text.split("/"))
    except ValueError:
        raise ValueError(f"--shard takes I/N (part I of N, counted from 0), got '{text}'") from None
    if n < 1:
        raise ValueError(f"--shard {text}: N, the number of parts, must be at least 1")
    if not 0 <= i < n:
        raise ValueError(f"--shard {text}: I must be in 0..N-1 (the parts are 0/{n} .. {n - 1}/{n})")
    return i, n


def prepare_part(cfg: PrepareConfig) -> dict:
    """Check part ``cfg.shard`` of the input into its part directory (or keep it when it is complete for the
    same input and settings, and undamaged). Returns its part.json."""
    i, n = cfg.shard
    final = part_dir(cfg.out, i, n)
    fp = input_fingerprint(cfg)
    with file_lock(dir_lock_path(final)), write_errors(final, "a preparation part"):
        recover_dir(final, _is_part)
        summary = _read_part_summary(final)
        if summary is not None and summary["input_fingerprint"] == fp:
            try:
                _read_part(final, summary)
                return summary
            except _DamagedPart as e:
                log.info("part %d/%d in %s is damaged (%s); checking it again", i, n, final.parent, e)
        if os.path.lexists(final) and not _is_part(final):
            raise ValueError(f"{final} is in the way and is not a part mmfast wrote; move it away")
        with atomic_dir(final, PART_KIND, _is_part) as tmp:
            checked = read_and_check(cfg, tmp, part=(i, n))
            base = tmp.resolve()
            atomic_write_jsonl(tmp / "accepted.jsonl", [_candidate_row(c, base) for c in checked.good])
            atomic_write_jsonl(tmp / "rejected.jsonl", [r.to_json() for r in checked.rejects])
            file_reads.write(tmp, checked.file_reads)  # the merge passes them on to the next preparation
            summary = {
                "input_fingerprint": fp,
                "part": [i, n],
                "kind": checked.kind,
                "counts": {"input_rows": checked.n_input, "accepted": len(checked.good)},
                "reused_checks": checked.reused,
                "downscaled": checked.downscaled,
                "seconds": checked.seconds,
                "files": {name: _file_record(tmp / name) for name in _ROW_FILES},
            }
            atomic_write_json(tmp / "part.json", summary)  # last: the part is complete
    return summary


def merge_parts(cfg: PrepareConfig, tmp: Path, fp: str) -> Checked:
    """The checked rows of all parts of ``cfg.out``, their files linked into ``tmp`` (the prepared directory
    being built), as one ``checks.Checked``.

    Raises:
        ManifestError: no parts, a part missing or damaged (naming its file and the command that makes it
            again), or parts of another input or other settings.
    """
    root = parts_root(cfg.out)
    dirs = sorted(p for p in root.glob("*-of-*") if p.is_dir()) if root.is_dir() else []
    if not dirs:
        raise ManifestError(f"--merge: no parts in {root}; run with --shard I/N (I = 0..N-1) first")
    n = int(dirs[0].name.split("-of-")[1])
    summaries, rows = {}, {}
    for i in range(n):
        summaries[i], rows[i] = _checked_part(cfg.out, i, n, fp)
    good, rejects, n_input, reused, downscaled, records = [], [], 0, 0, 0, []
    seconds = {"read": 0.0, "validate": 0.0, "downscale": 0.0}
    for i in range(n):
        src = part_dir(cfg.out, i, n)
        accepted, rejected = rows[i]
        good += [_candidate(row, src, tmp / "parts" / f"{i:05d}") for row in accepted]
        rejects += [_reject(r) for r in rejected]
        records += file_reads.record_files(src)  # linked, not read: a damaged one is refused when used
        s = summaries[i]
        n_input += s["counts"]["input_rows"]
        reused += s["reused_checks"]
        downscaled += s["downscaled"]
        seconds = {k: v + s["seconds"][k] for k, v in seconds.items()}  # summed over the parts
    kind = summaries[0]["kind"]
    if reader_named(kind).in_place is not None:  # each part read only its files: duplicates across them now
        good, rejects = finish_rows(good, rejects)
    return Checked(good, rejects, n_input, kind, seconds, reused, downscaled, carried_reads=records)


def _checked_part(out, i: int, n: int, fp: str) -> tuple[dict, tuple[list[dict], list[dict]]]:
    """Part i of n's part.json and its (accepted, rejected) rows, for the merge.

    Raises:
        ManifestError: the part is missing, incomplete, of another input or settings, or damaged.
    """
    src = part_dir(out, i, n)
    summary = _read_part_summary(src)
    if summary is None:
        raise ManifestError(
            f"--merge: part {i}/{n} is missing or incomplete in {src.parent}; run it with --shard {i}/{n}"
        )
    if summary["input_fingerprint"] != fp:
        raise ManifestError(
            f"--merge: part {i}/{n} was made from another input or with other settings than this merge; "
            f"run --shard {i}/{n} again with the merge's input and flags"
        )
    try:
        return summary, _read_part(src, summary)
    except _DamagedPart as e:
        raise ManifestError(
            f"--merge: part {i}/{n} is damaged: {e}; make it again with the same command and --shard {i}/{n} "
            "instead of --merge (it replaces the damaged part), then --merge"
        ) from None


def _read_part(src: Path, summary: dict) -> tuple[list[dict], list[dict]]:
    """A complete part's (accepted, rejected) rows, checked against its part.json: the files' sizes and
    SHA-256 (when recorded), every line a row with its fields, the counts, the files the part wrote.

    Raises:
        _DamagedPart: what is wrong, naming the file.
    """
    for name, want in (summary.get("files") or {}).items():
        path = src / name
        if not path.is_file() or _file_record(path) != want:
            raise _DamagedPart(f"{path} is missing or changed since the part was made (size or SHA-256)")
    accepted = _rows(src / "accepted.jsonl", _FIELDS)
    rejected = _rows(src / "rejected.jsonl", _REJECT_FIELDS)
    counts = summary.get("counts") or {}
    if len(accepted) != counts.get("accepted"):
        raise _DamagedPart(
            f"{src / 'accepted.jsonl'} holds {len(accepted)} rows, part.json counts {counts.get('accepted')}"
        )
    if len(accepted) + len(rejected) != counts.get("input_rows"):
        raise _DamagedPart(
            f"{src / 'rejected.jsonl'} holds {len(rejected)} rows, part.json counts "
            f"{counts.get('input_rows', 0) - len(accepted)}"
        )
    for row in accepted:
        if row.get("in_part") and not (src / row["image"]).is_file():
            raise _DamagedPart(f"{src / row['image']} (line {row['line']} of {src / 'accepted.jsonl'}) is missing")
    return accepted, rejected


def _rows(path: Path, fields: tuple[str, ...]) -> list[dict]:
    """The rows of a part's JSONL file, each an object holding ``fields``.

    Raises:
        _DamagedPart: the file is unreadable, or a line is not such a row (cut short, edited).
    """
    try:
        lines = path.read_bytes().split(b"\n")
    except OSError as e:
        raise _DamagedPart(f"{path} cannot be read: {e.strerror or e}") from None
    rows = []
    for k, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:  # JSONDecodeError, or UnicodeDecodeError for bytes that are not UTF-8
            why = e.msg if isinstance(e, json.JSONDecodeError) else str(e)
            raise _DamagedPart(
                f"{path}, line {k}: not a JSON row ({why}); the file was cut short or edited"
            ) from None
        missing = [f for f in fields if not isinstance(row, dict) or f not in row]
        if missing:
            raise _DamagedPart(f"{path}, line {k}: no field {missing[0]!r}; the file was edited")
        rows.append(row)
    return rows


def _file_record(path: Path) -> dict:
    return {"size": path.stat().st_size, "sha256": file_sha256(path)}


def _candidate_row(c: Candidate, base: Path) -> dict:
    """A kept row for accepted.jsonl; a file the part wrote is named relative to the part directory."""
    row = {k: v for k, v in asdict(c).items() if k in _FIELDS}
    if c.decoded:
        row["decoded"] = list(c.decoded)
    if Path(c.image).is_relative_to(base):
        row["image"], row["in_part"] = Path(c.image).relative_to(base).as_posix(), True
    return row


def _candidate(row: dict, part: Path, dest: Path) -> Candidate:
    """The Candidate of an accepted.jsonl row; a file of the part is linked to the same place under ``dest``."""
    c = Candidate(**{k: row[k] for k in _FIELDS}, decoded=tuple(row["decoded"]) if row.get("decoded") else None)
    if row.get("in_part"):
        target = dest / row["image"]
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            if not target.exists():  # rows of one picture share its file (named by content)
                os.link(part / row["image"], target)
        except OSError:  # another filesystem, or links not supported: a copy (same mtime)
            shutil.copy2(part / row["image"], target)
        c = replace(c, image=str(target.resolve()))
    return c


def _reject(r: dict) -> Reject:
    return Reject(r["line"], r["reason"], r["row"], r.get("file", ""))


def _read_part_summary(directory: Path) -> dict | None:
    """A complete part's part.json (None: absent, incomplete or not a part)."""
    if not _is_part(directory):
        return None
    summary = read_json_object(directory / "part.json")
    return summary if "input_fingerprint" in summary else None


def _is_part(directory: Path) -> bool:
    """A directory a part may replace: a part (its marker; an unreadable one is a killed run's) or empty."""
    return is_replaceable(directory, PART_KIND)
