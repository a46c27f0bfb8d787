"""Turn the data users have into a prepared dataset directory (docs/architecture.md, "Contracts").

Stages, in order: read rows and validate images (``prepare.checks``) -> label map -> split -> tokenizer -> token
cache -> write. The directory is built in a temp folder and renamed into place, under a lock, so concurrent runs
never see half of it; a second run with the same inputs and settings reuses it (``prepare.reuse``).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path

from mmfast.data.dataset import (
    LABELS_FILE,
    REJECTED_FILE,
    SUMMARY_FILE,
    WDS_DIR,
    split_file,
)
from mmfast.inputs import ImagesInPlace, Reader, detect_kind, file_reads, reader_named
from mmfast.inputs.manifest import Candidate, ManifestError, Reject
from mmfast.prepare.checks import Checked, earlier_preparations, read_and_check
from mmfast.prepare.config import PREPARE_VERSION, PREPARED_KIND, PrepareConfig, failure_report_path
from mmfast.prepare.fingerprint import input_fingerprint
from mmfast.prepare.last_prepared import last_prepared, remember, source_name
from mmfast.prepare.parts import merge_parts, prepare_part
from mmfast.prepare.reuse import files_map, reuse
from mmfast.prepare.split import split_rows
from mmfast.prepare.tokens import tokenize
from mmfast.prepare.wds_export import export_wds
from mmfast.remote.errors import redact
from mmfast.remote.objects import is_remote
from mmfast.util.commands import PREPARE
from mmfast.util.fsutil import (
    MARKER,
    OutputDirError,
    atomic_dir,
    atomic_write_json,
    atomic_write_jsonl,
    dir_lock_path,
    file_lock,
    is_replaceable,
    read_json_object,
    recover_dir,
    write_errors,
)

__all__ = ["PREPARED_KIND", "PREPARE_VERSION", "PrepareConfig", "failure_report_path", "prepare_dataset"]

log = logging.getLogger(__name__)
_SHOWN_REASONS = 10  # rejects printed when no row is usable (all of them go to OUT.rejected.jsonl)


def prepare_dataset(cfg: PrepareConfig) -> dict:
    """Prepare ``cfg.source`` into ``cfg.out`` (or reuse it when inputs, settings and files are unchanged).

    ``cfg.out`` is replaced only when mmfast prepared it (its marker file, or a prepare.json of an older
    mmfast) or it is an empty directory; the replacement is atomic (see ``fsutil.atomic_dir``).

    Returns:
        the contents of prepare.json.

    Raises:
        ManifestError: the input cannot be read or leaves no usable rows.
        OutputDirError: ``cfg.out`` is not mmfast's, holds the input, or cannot be written (disk full).
    """
    out = Path(cfg.out)
    _check_input_outside(cfg)
    if cfg.shard is not None:
        check_out(out)  # now, not only when the parts are merged, after hours of checking
        check_out_writable(out)
        return prepare_part(cfg)
    with file_lock(dir_lock_path(out)), write_errors(out, "the prepared dataset"):
        recover_dir(out, replaceable)
        check_out(out)
        fp = input_fingerprint(cfg)
        summary = reuse(out, fp)
        if summary is not None:
            log.info("%s is up to date; reusing it", out)
        else:
            check_out_writable(out)
            with atomic_dir(out, PREPARED_KIND, replaceable) as tmp:
                summary = _prepare_into(cfg, tmp, fp)
        remember(source_name(cfg.source), out)  # the next preparation of this input elsewhere keeps its checks
        _remove_failure_report(cfg)
    return summary


def replaceable(directory: Path) -> bool:
    """A directory prepare may replace: mmfast's prepared directory (marker, or the prepare.json of an
    older mmfast that wrote no marker), an empty directory, or a leftover of a killed run."""
    if is_replaceable(directory, PREPARED_KIND):
        return True
    legacy_place = directory.is_dir() and not directory.is_symlink() and not (directory / MARKER).is_file()
    return legacy_place and _is_legacy(directory)


def _is_legacy(directory: Path) -> bool:
    summary = read_json_object(directory / SUMMARY_FILE)
    return "input_fingerprint" in summary and "counts" in summary


def check_out_writable(out: Path) -> None:
    """Refuse, before any work, an --out that cannot be (re)written: the prepared directory is written beside
    it and renamed into its place, which neither a mount point nor a read-only or unwritable folder allows."""
    if os.path.ismount(out):
        raise OutputDirError(
            f"--out {out} is a mount point, which {PREPARE} cannot rename a prepared directory onto; pass a "
            f"folder inside it (--out {out / 'prepared'}); nothing was changed"
        )
    beside = next(p for p in (out.absolute().parent, *out.absolute().parents) if p.exists())
    if not os.access(beside, os.W_OK):
        why = "is on a read-only file system" if _read_only(beside) else "is not writable by this user"
        raise OutputDirError(
            f"--out {out}: {beside} {why}, and {PREPARE} writes the prepared directory there before it renames "
            "it into place; pass an --out on a writable disk; nothing was changed"
        )


def check_out(out: Path) -> None:
    """Refuse an --out that exists and is not a directory mmfast prepared."""
    if not os.path.lexists(out):
        return
    if out.is_symlink():
        raise OutputDirError(
            f"--out {out} is a symbolic link; pass a new or empty directory (nothing was changed)"
        )
    if not out.is_dir():
        raise OutputDirError(f"--out {out} is a file, not a directory; pass a new or empty directory")
    if not replaceable(out):
        raise OutputDirError(
            f"--out {out} already exists and was not prepared by mmfast (it has no {MARKER} file); "
            f"nothing in it was changed. Pass a new or empty directory to --out, or move {out} away yourself"
        )


def _read_only(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _check_input_outside(cfg: PrepareConfig) -> None:
    """Refuse an --out that holds the input (replacing it would delete it) or that sits inside the image
    folder being prepared (the next run would read it as a class)."""
    if is_remote(cfg.source):  # shards in a store: nothing of it lies under a local --out
        return
    out, src = Path(cfg.out).resolve(), Path(cfg.source).resolve()
    if src.is_relative_to(out):
        raise OutputDirError(
            f"--out {cfg.out} contains the input {cfg.source}; preparing replaces --out, which would delete "
            "the input. Pass an --out outside the input's folder"
        )
    if src.is_dir() and out.is_relative_to(src):
        classes = detect_kind(src) == "folder"  # an image folder's sub-folders are its classes
        where = (
            "image folder {}, where the next preparation would read it as a class"
            if classes
            else "input folder {}"
        )
        raise OutputDirError(f"--out {cfg.out} is inside the {where.format(cfg.source)}; pass an --out outside it")


def _prepare_into(cfg: PrepareConfig, tmp: Path, fp: str) -> dict:
    elsewhere = last_prepared(source_name(cfg.source), Path(cfg.out))  # before this preparation is noted
    if cfg.merge:
        checked = merge_parts(cfg, tmp, fp)
        checked.earlier = earlier_preparations(cfg)
    else:
        checked = read_and_check(cfg, tmp, part=None)
    if elsewhere is not None and checked.reused:
        checked.reused_from = str(elsewhere)
    return _write_prepared(cfg, tmp, fp, checked)


def _write_prepared(cfg: PrepareConfig, tmp: Path, fp: str, checked: Checked) -> dict:
    """Label map, split, tokenizer, token cache, rows and (--format wds) shards into ``tmp``; returns the
    summary, written last as prepare.json."""
    t0 = time.perf_counter()
    good, rejects = checked.good, sorted(checked.rejects, key=lambda r: (r.file, r.line))
    if not good:
        raise ManifestError(_no_usable_rows(cfg, checked.n_input, rejects, reader_named(checked.kind)))
    label_map = _label_map(good)
    work = tmp.resolve()
    in_place = reader_named(checked.kind).in_place
    member = in_place.member if in_place is not None else None
    train, val = split_rows(good, cfg.val_fraction, cfg.seed, _split_bases(cfg), str(work), member)
    train_rows = [_row(c, i, label_map, work, in_place) for i, c in enumerate(train)]
    val_rows = [_row(c, len(train) + i, label_map, work, in_place) for i, c in enumerate(val)]
    t_split = time.perf_counter()
    tokenized = tokenize(cfg, tmp, {"train": train_rows, "val": val_rows}, checked.earlier)
    tok, caches = tokenized.tokenizer, tokenized.caches
    t_cache = time.perf_counter()
    atomic_write_jsonl(tmp / split_file("train"), train_rows)
    atomic_write_jsonl(tmp / split_file("val"), val_rows)
    atomic_write_jsonl(tmp / REJECTED_FILE, [r.to_json() for r in rejects])
    file_reads.write(tmp, checked.file_reads, checked.carried_reads)  # what the next one need not read again
    atomic_write_json(tmp / LABELS_FILE, label_map)
    _write_index(cfg, tmp, in_place, {"train": train_rows, "val": val_rows}, label_map)
    largest = _largest_image(good, cfg.max_side, work, Path(cfg.out).resolve(), in_place)
    summary = {
        "version": PREPARE_VERSION,
        "source": source_name(cfg.source),
        "input_kind": checked.kind,
        "input_fingerprint": fp,
        "config": asdict(cfg) | {"source": redact(cfg.source)},  # never a URL's credentials
        "counts": {
            "input_rows": checked.n_input,
            "accepted": len(good),
            "rejected": len(rejects),
            "train": len(train),
            "val": len(val),
            "classes": len(label_map),
        }
        | ({"downscaled": checked.downscaled} if cfg.max_side else {}),  # copies stored under --max-side
        "rejected_by_reason": dict(Counter(_reason_kind(r.reason) for r in rejects).most_common()),
        **({"largest_image": largest} if largest else {}),  # none when the reader learnt no image's size
        "reused_checks": checked.reused,
        **({"reused_checks_from": checked.reused_from} if checked.reused_from else {}),
        "tokenizer": cfg.tokenizer or "wordpiece trained on the training captions",
        **({"tokenizer_kept_from": tokenized.tokenizer_from} if tokenized.tokenizer_from else {}),
        "vocab_size": len(tok),
        "max_length": cfg.max_length,
        "token_cache": {
            s: {"fingerprint": c.fingerprint, "dtype": c.meta["dtype"], "tokens": c.meta["n_tokens"]}
            | ({"rows_copied": c.copied} if c.copied else {})  # from an earlier preparation's cache
            for s, c in caches.items()
        },
        "timings_s": checked.seconds
        | {"split": t_split - t0}
        | tokenized.seconds
        | {"write": time.perf_counter() - t_cache},
    }
    summary["timings_s"]["total"] = sum(summary["timings_s"].values())
    assert checked.n_input == len(good) + len(rejects), "every input row is either kept or rejected"
    summary["files"] = files_map(tmp)
    atomic_write_json(tmp / SUMMARY_FILE, summary)  # last: its presence means the directory is complete
    return summary


def _write_index(
    cfg: PrepareConfig, tmp: Path, in_place: ImagesInPlace | None, rows: dict[str, list[dict]], label_map: dict
) -> None:
    """The index of the user's files (an input whose images stay in them), or mmfast's own WebDataset export
    (--format wds)."""
    if in_place is not None:
        (tmp / in_place.index_dir).mkdir()
        for split, these in rows.items():
            in_place.write_index(tmp / in_place.index_dir, split, these)
    elif cfg.format == "wds":
        # rows name the images written into the directory relative to it: they are read in the temp directory
        with write_errors(cfg.out, "the WebDataset shards"):
            export_wds(
                rows,
                {v: k for k, v in label_map.items()},
                tmp / WDS_DIR,
                cfg.wds_shard_size,
                image_path=lambda p: p if os.path.isabs(p) else str(tmp / p),
            )


def _no_usable_rows(cfg: PrepareConfig, n_input: int, rejects: list[Reject], reader: Reader) -> str:
    """Write every reject to ``failure_report_path`` and return the error: the first reasons with their
    file and line, and where the rest are."""
    src = Path(cfg.source)
    base = src if src.is_dir() else src.parent  # a reject's file is relative to the input's folder
    lines = [f"{cfg.source}: no usable rows out of {n_input}; the first reasons:"]
    shown = 3 if len({_reason_kind(r.reason) for r in rejects}) == 1 else _SHOWN_REASONS  # one reason: 3 say it
    for r in rejects[:shown]:
        lines.append(f"  {reader.where(base / r.file if r.file else src, r.line)}: {r.reason}")
    if len(rejects) > shown:
        common = Counter(_reason_kind(r.reason) for r in rejects[shown:]).most_common(3)
        more = ", ".join(f"{why} ({n})" for why, n in common)
        lines.append(f"  ... and {len(rejects) - shown} more ({more})")
    if rejects and all(r.reason.startswith("missing file") for r in rejects):
        lines.append(f"  (every image is missing: {_where_images_are_read(cfg, base, rejects, reader)})")
    if rejects and all(r.reason.startswith("missing field 'label'") for r in rejects):
        lines.append("  (no row has a label: pass --no-labels for image-text pairs, as --model clip trains on)")
    report = failure_report_path(cfg.out)
    if not rejects:
        lines[0] = f"{cfg.source}: no rows to prepare (the input is empty)"
    elif _ours_or_absent(report):
        atomic_write_jsonl(report, [r.to_json() for r in rejects])
        lines.append(f"every reason is in {report}; fix the input and re-run ({cfg.out} was not changed)")
    else:
        lines.append(f"(not written to {report}: a file of that name that mmfast did not write is in the way)")
    return "\n".join(lines)


def _where_images_are_read(cfg: PrepareConfig, base: Path, rejects: list[Reject], reader: Reader) -> str:
    """The folders the rejects' relative image paths were read from, as the readers chose them
    (``InputOptions.image_folder``), and the flag that names another."""
    if cfg.inputs.image_root:
        return f"relative paths are read from --image-root {cfg.inputs.image_folder(base)}"
    folders = sorted({str(cfg.inputs.image_folder((base / r.file).parent if r.file else base)) for r in rejects})
    named = ", ".join(folders[:3]) + (f" and {len(folders) - 3} more" if len(folders) > 3 else "")
    each = "the file" if len(folders) == 1 else "each file"
    where = f"relative paths are read from {named} (the folder of {each} naming them)"
    return where + ("; --image-root DIR reads them from DIR" if reader.image_root else "")


def _remove_failure_report(cfg: PrepareConfig) -> None:
    """A successful run removes the failure report an earlier run left beside --out (only if it is one)."""
    report = failure_report_path(cfg.out)
    if report.is_file() and not report.is_symlink() and _ours_or_absent(report):
        report.unlink()


def _ours_or_absent(report: Path) -> bool:
    """Whether ``report`` is absent or a rejects file mmfast wrote (every line a {line, reason, row} object)."""
    if not os.path.lexists(report):
        return True
    if report.is_symlink() or not report.is_file():
        return False
    try:
        rows = [json.loads(ln) for ln in report.read_text(encoding="utf-8").splitlines() if ln]
    except (OSError, ValueError):
        return False
    return bool(rows) and all(isinstance(r, dict) and {"line", "reason", "row"} <= set(r) for r in rows)


def _reason_kind(reason: str) -> str:
    return reason.split(":")[0].split(" (")[0]


def _label_map(rows: list[Candidate]) -> dict[str, int]:
    """Class ids 0..C-1 for the sorted distinct labels: {str(original label): class id}.

    Integer labels are names like any other, so 1-based (1..4), sparse ({0, 5, 17, 42}) and negative
    labels all get contiguous ids in numeric order; labels.json keeps the originals as keys.
    """
    distinct = sorted({c.label for c in rows})  # one type per manifest (read_input rejects a mix)
    return {str(v): i for i, v in enumerate(distinct)}


def _split_bases(cfg: PrepareConfig) -> list[str]:
    """The folders the split keys images relative to (see mmfast.prepare.split), the innermost first."""
    return sorted((str(p.resolve()) for p in cfg.input_folders()), key=len, reverse=True)


def _row(
    c: Candidate, sample_id: int, label_map: dict[str, int], work: Path, in_place: ImagesInPlace | None
) -> dict:
    """The prepared row of ``c``; an image inside ``work`` (the temp directory the prepared directory is built
    in: Parquet bytes, --max-side copies) is recorded relative to it, so the directory can be moved.

    An image read in place (``in_place``) is named by ``image`` and its place in the user's file ("tar",
    "member", "offset", "nbytes"): what its index line lists; no file stats."""
    if in_place is not None:
        m = in_place.member(c)
        return {
            "id": sample_id,
            "image": c.image,
            "text": c.text,
            "label": label_map[str(c.label)],
            "line": c.line,
            "tar": m.file,
            "member": m.name,
            "offset": m.offset,
            "nbytes": m.nbytes,
            **{k: c.source[k] for k in ("tar_size", "tar_sha256") if k in c.source},  # a remote shard's
        }
    st = os.stat(c.image)  # recorded so the loader can tell a file that changed after validation
    image = Path(c.image)
    row = {
        "id": sample_id,
        "image": image.relative_to(work).as_posix() if image.is_relative_to(work) else c.image,
        "text": c.text,
        "label": label_map[str(c.label)],
        "line": c.line,
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "width": c.width,  # of the image as validated (the original, for a --max-side copy)
        "height": c.height,
    }
    # the size as DALI decodes it (EXIF orientation applied): the loader draws its crops there
    decoded = {"decoded_shape": list(c.decoded)} if c.decoded else {}
    original = {"original": c.original, "original_stat": _stat_pair(c.original)} if c.original else {}
    return row | decoded | original


def _stat_pair(path: str) -> list[int]:
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns]


def _largest_image(
    good: list[Candidate], max_side: int, work: Path, out: Path, in_place: ImagesInPlace | None
) -> dict | None:
    """The accepted image with the most pixels as the loaders decode it ({"image", "width", "height"}; a
    --max-side copy's size): what bounds a batch's decoded memory. None when the reader learnt no size.

    Args:
        work: the temp directory the prepared directory is built in, renamed to ``out`` when complete.
    """
    sized = [c for c in good if c.width and c.height]
    if not sized:
        return None
    c = max(sized, key=lambda c: c.width * c.height)
    w, h = c.width, c.height
    if max_side and max(w, h) > max_side:
        w, h = round(w * max_side / max(w, h)), round(h * max_side / max(w, h))
    return {"image": _image_name(c, work, out, in_place), "width": w, "height": h}


def _image_name(c: Candidate, work: Path, out: Path, in_place: ImagesInPlace | None) -> str:
    """Where the user finds ``c``'s image: "<shard>:<member>" for an image read in place, the file's final path
    in ``out`` for one preparation wrote (image bytes, a --max-side copy), else the user's own file."""
    if in_place is not None:
        m = in_place.member(c)
        return redact(f"{m.file}:{m.name}")  # a remote shard's URL without its credentials
    image = Path(c.original or c.image)
    return str(out / image.relative_to(work)) if image.is_relative_to(work) else str(image)
