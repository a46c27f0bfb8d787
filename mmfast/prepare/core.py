"""Turn a manifest or image folder into a prepared dataset directory (docs/architecture.md, "Contracts").

Stages, in order: read rows -> validate images -> label map -> split -> tokenizer -> token cache -> write.
The directory is built in a temp folder and renamed into place, under a lock, so concurrent runs
never see half of it; a second run with the same inputs and settings reuses it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import stat
import time
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from mmfast.data.dataset import DatasetError, PreparedDataset
from mmfast.data.token_cache import TokenCache
from mmfast.data.tokenizer import load_tokenizer, train_wordpiece
from mmfast.data.validate import DEFAULT_MAX_PIXELS, ImageCheck, check_images
from mmfast.inputs import InputOptions, read_source
from mmfast.inputs.manifest import Candidate, ManifestError, Reject, finish_rows
from mmfast.inputs.wds import expand_shards, is_wds_source, read_wds, shard_stats, write_split_index
from mmfast.prepare.parts import parts_root
from mmfast.prepare.split import split_rows
from mmfast.util.fsutil import (
    MARKER,
    OutputDirError,
    atomic_dir,
    atomic_write_json,
    atomic_write_jsonl,
    dir_lock_path,
    file_lock,
    file_sha256,
    is_replaceable,
    recover_dir,
    write_errors,
)

log = logging.getLogger(__name__)
# 2: a "files" map of sizes and SHA-256s, the ownership marker, contiguous int labels;
# 3: the split by a hash of each row's image (prepare.split); images inside the directory named relative to it
PREPARE_VERSION = 3
PREPARED_KIND = "mmfast prepared dataset"  # the "kind" in the marker of a prepared directory
_SPLIT_FILES = ("train.jsonl", "val.jsonl", "labels.json", "rejected.jsonl")
IMAGES_DIR = "images"  # images an input stores as bytes (Parquet/Arrow), written out into the prepared dir
_SHOWN_REASONS = 10  # rejects printed when no row is usable (all of them go to OUT.rejected.jsonl)


@dataclass(frozen=True)
class PrepareConfig:
    """Settings of tools/prepare_data.py."""

    source: str
    out: str
    tokenizer: str | None = None  # None: train a WordPiece vocabulary on the training captions (offline)
    max_length: int = 64
    val_fraction: float = 0.2
    seed: int = 0
    workers: int = 0  # 0: all cores
    vocab_size: int = 4000
    confine: bool = False
    max_pixels: int = DEFAULT_MAX_PIXELS  # decoded-pixel budget per image (width x height)
    max_side: int = 0  # store JPEG copies no larger than this many pixels a side (0: the images as they are)
    quality: int = 90  # JPEG quality of those copies
    progress: bool = True
    inputs: InputOptions = InputOptions()  # how to read the source (kind, column mapping, COCO options)
    format: str = "files"  # "wds": also export the splits as WebDataset shards into wds/ (prepare.wds_export)
    wds_shard_size: int = 1000  # samples per exported shard
    shard: tuple[int, int] | None = None  # (i, n): check only part i of n of the input (mmfast.prepare.parts)
    merge: bool = False  # join the n parts checked by --shard into ``out``

    def __post_init__(self):
        if not 0.0 <= self.val_fraction < 1.0:
            raise ValueError(f"--val-fraction must be in [0, 1), got {self.val_fraction}")
        if self.max_length < 3:
            raise ValueError(f"--max-length must be at least 3 (room for [CLS] x [SEP]), got {self.max_length}")
        if self.workers < 0:
            raise ValueError(f"--workers must be >= 0, got {self.workers}")
        if self.max_pixels < 1:
            raise ValueError(f"--max-pixels must be at least 1, got {self.max_pixels}")
        if self.max_side and self.max_side < 16:
            raise ValueError(f"--max-side must be 0 (off) or at least 16 pixels, got {self.max_side}")
        if not 1 <= self.quality <= 100:
            raise ValueError(f"--quality must be in 1..100 (JPEG quality), got {self.quality}")
        if self.format not in ("files", "wds"):
            raise ValueError(f"--format must be 'files' or 'wds', got '{self.format}'")
        if self.wds_shard_size < 1:
            raise ValueError(f"the WebDataset shard size must be at least 1, got {self.wds_shard_size}")
        if self.shard is not None and self.merge:
            raise ValueError("--shard I/N checks one part and --merge joins them: pass one of the two")


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
        _check_out(out)  # now, not only when the parts are merged, after hours of checking
        from mmfast.prepare.parts import prepare_part

        return prepare_part(cfg)
    with file_lock(dir_lock_path(out)), write_errors(out, "the prepared dataset"):
        recover_dir(out, _replaceable)
        _check_out(out)
        fp = input_fingerprint(cfg)
        summary = _reuse(out, fp)
        if summary is not None:
            log.info("%s is up to date; reusing it", out)
        else:
            with atomic_dir(out, PREPARED_KIND, _replaceable) as tmp:
                summary = _prepare_into(cfg, tmp, fp)
        _remove_failure_report(cfg)
    return summary


def _replaceable(directory: Path) -> bool:
    """A directory prepare may replace: mmfast's prepared directory (marker, or the prepare.json of an
    older mmfast that wrote no marker), an empty directory, or a leftover of a killed run."""
    if is_replaceable(directory, PREPARED_KIND):
        return True
    legacy_place = directory.is_dir() and not directory.is_symlink() and not (directory / MARKER).is_file()
    return legacy_place and _is_legacy(directory)


def _is_legacy(directory: Path) -> bool:
    try:
        summary = json.loads((directory / "prepare.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(summary, dict) and "input_fingerprint" in summary and "counts" in summary


def _check_out(out: Path) -> None:
    """Refuse an --out that exists and is not a directory mmfast prepared."""
    if not os.path.lexists(out):
        return
    if out.is_symlink():
        raise OutputDirError(
            f"--out {out} is a symbolic link; pass a new or empty directory (nothing was changed)"
        )
    if not out.is_dir():
        raise OutputDirError(f"--out {out} is a file, not a directory; pass a new or empty directory")
    if not _replaceable(out):
        raise OutputDirError(
            f"--out {out} already exists and was not prepared by mmfast (it has no {MARKER} file); "
            f"nothing in it was changed. Pass a new or empty directory to --out, or move {out} away yourself"
        )


def _check_input_outside(cfg: PrepareConfig) -> None:
    """Refuse an --out that holds the input (replacing it would delete it) or that sits inside the image
    folder being prepared (the next run would read it as a class)."""
    out, src = Path(cfg.out).resolve(), Path(cfg.source).resolve()
    if _inside(src, out):
        raise OutputDirError(
            f"--out {cfg.out} contains the input {cfg.source}; preparing replaces --out, which would delete "
            "the input. Pass an --out outside the input's folder"
        )
    if src.is_dir() and _inside(out, src):
        raise OutputDirError(
            f"--out {cfg.out} is inside the image folder {cfg.source}, where it would be read as a class; "
            "pass an --out outside it"
        )


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


@dataclass
class Checked:
    """What reading and validating the input (or a part of it) gave: the rows kept, each with its image's
    size, and the rows dropped with their reasons."""

    good: list[Candidate]
    rejects: list[Reject]
    n_input: int  # rows read: len(good) + len(rejects)
    kind: str  # the input reader's name
    seconds: dict[str, float]  # read, validate, downscale
    reused: int = 0  # images whose earlier check was reused (unchanged since an earlier preparation)
    downscaled: int = 0


def _prepare_into(cfg: PrepareConfig, tmp: Path, fp: str) -> dict:
    if cfg.merge:
        from mmfast.prepare.parts import merge_parts

        checked = merge_parts(cfg, tmp, fp)
    else:
        checked = read_and_check(cfg, tmp, part=None, earlier=earlier_checks(Path(cfg.out), cfg))
    return _write_prepared(cfg, tmp, fp, checked)


def read_and_check(
    cfg: PrepareConfig, work: Path, part: tuple[int, int] | None, earlier: dict[str, tuple[int, ...]]
) -> Checked:
    """Read the input (``part`` (i, n): only the i-th of n slices of it), validate every image (those of
    ``earlier`` that did not change since are not decoded again) and store --max-side copies into ``work``."""
    t0 = time.perf_counter()
    workers = cfg.workers or os.cpu_count() or 1
    wds_input = _is_wds(cfg)
    if wds_input:  # images stay in the user's shards; the reader validates them from the tar
        _refuse_for_shards(cfg)
        cands, rejects = read_wds(cfg.source, cfg.inputs, workers, cfg.max_pixels, part=part)
        if part is None:  # duplicates across shards are found when the parts are merged
            cands, rejects = finish_rows(cands, rejects)
        kind = "wds"
    else:
        cands, rejects, kind = read_source(cfg.source, cfg.inputs, cfg.confine, (work / IMAGES_DIR).resolve())
        if part is not None:
            cands, rejects = _slice(cands, rejects, part, work)
    n_input = len(cands) + len(rejects)
    t_read = time.perf_counter()

    reused = 0
    if wds_input:
        checks = [ImageCheck(True)] * len(cands)
    else:
        checks, reused = _check(cands, cfg, workers, earlier, work)
    good: list[Candidate] = []
    for c, chk in zip(cands, checks, strict=True):
        if chk.ok:
            good.append(replace(c, width=chk.width, height=chk.height))
        else:
            rejects.append(Reject(c.line, chk.reason, c.source, c.file))
            if _inside(Path(c.image), work.resolve()):  # written from the input's bytes: not kept
                Path(c.image).unlink(missing_ok=True)
    t_validate = time.perf_counter()
    if wds_input:  # the samples are in the shards: whether those are inside --out
        _check_shards_outside(cfg)
    else:
        _check_images_outside(good, cfg)
    n_downscaled = 0
    if cfg.max_side:
        good, n_downscaled = _downscale(good, cfg, work, workers, rejects)
    seconds = {"read": t_read - t0, "validate": t_validate - t_read, "downscale": time.perf_counter() - t_validate}
    return Checked(good, rejects, n_input, kind, seconds, reused, n_downscaled)


def _refuse_for_shards(cfg: PrepareConfig) -> None:
    if cfg.format == "wds":
        raise ValueError(
            f"{cfg.source}: the input is WebDataset shards already; training reads them in place "
            "(drop --format wds)"
        )
    if cfg.max_side:
        raise ValueError(
            f"{cfg.source}: --max-side stores copies of image files; WebDataset shards are read in place "
            "(drop --max-side, or downscale when writing the shards)"
        )


def _write_prepared(cfg: PrepareConfig, tmp: Path, fp: str, checked: Checked) -> dict:
    """Label map, split, tokenizer, token cache, rows and (--format wds) shards into ``tmp``; returns the
    summary, written last as prepare.json."""
    t0 = time.perf_counter()
    good, rejects = checked.good, sorted(checked.rejects, key=lambda r: (r.file, r.line))
    if not good:
        raise ManifestError(_no_usable_rows(cfg, checked.n_input, rejects))
    label_map = _label_map(good)
    work = tmp.resolve()
    train, val = split_rows(good, cfg.val_fraction, cfg.seed, _split_bases(cfg), str(work))
    train_rows = [_row(c, i, label_map, work) for i, c in enumerate(train)]
    val_rows = [_row(c, len(train) + i, label_map, work) for i, c in enumerate(val)]
    tok = (
        load_tokenizer(cfg.tokenizer)
        if cfg.tokenizer
        else train_wordpiece([r["text"] for r in train_rows], cfg.vocab_size)
    )
    _save_tokenizer(tok, tmp / "tokenizer")
    t_tok = time.perf_counter()
    caches = {}
    for split, rows in (("train", train_rows), ("val", val_rows)):
        first = rows[0]["id"] if rows else len(train_rows)
        caches[split] = TokenCache.build(
            tmp / "tokens", split, [r["text"] for r in rows], tok, cfg.max_length, first_id=first
        )
    t_cache = time.perf_counter()
    atomic_write_jsonl(tmp / "train.jsonl", train_rows)
    atomic_write_jsonl(tmp / "val.jsonl", val_rows)
    atomic_write_jsonl(tmp / "rejected.jsonl", [r.to_json() for r in rejects])
    atomic_write_json(tmp / "labels.json", label_map)
    _write_shards(cfg, tmp, checked.kind, {"train": train_rows, "val": val_rows}, label_map)
    summary = {
        "version": PREPARE_VERSION,
        "source": str(Path(cfg.source).resolve()),
        "input_kind": checked.kind,
        "input_fingerprint": fp,
        "config": asdict(cfg),
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
        "largest_image": _largest_image(good, cfg.max_side),
        "reused_checks": checked.reused,
        "tokenizer": cfg.tokenizer or "wordpiece trained on the training captions",
        "vocab_size": len(tok),
        "max_length": cfg.max_length,
        "token_cache": {
            s: {"fingerprint": c.fingerprint, "dtype": c.meta["dtype"], "tokens": c.meta["n_tokens"]}
            for s, c in caches.items()
        },
        "timings_s": checked.seconds
        | {"tokenizer": t_tok - t0, "token_cache": t_cache - t_tok, "write": time.perf_counter() - t_cache},
    }
    summary["timings_s"]["total"] = sum(summary["timings_s"].values())
    assert checked.n_input == len(good) + len(rejects), "every input row is either kept or rejected"
    summary["files"] = _files_map(tmp)
    atomic_write_json(tmp / "prepare.json", summary)  # last: its presence means the directory is complete
    return summary


def _write_shards(cfg: PrepareConfig, tmp: Path, kind: str, rows: dict[str, list[dict]], label_map: dict) -> None:
    """The index files of the user's shards (a WebDataset input), or mmfast's own export (--format wds)."""
    if kind == "wds":
        (tmp / "wds").mkdir()
        for split, split_rows in rows.items():
            write_split_index(tmp / "wds", split, split_rows)
    elif cfg.format == "wds":
        from mmfast.prepare.wds_export import export_wds

        # rows name the images written into the directory relative to it: they are read in the temp directory
        with write_errors(cfg.out, "the WebDataset shards"):
            export_wds(
                rows,
                {v: k for k, v in label_map.items()},
                tmp / "wds",
                cfg.wds_shard_size,
                image_path=lambda p: p if os.path.isabs(p) else str(tmp / p),
            )


def _downscale(
    good: list[Candidate],
    cfg: PrepareConfig,
    tmp: Path,
    workers: int,
    rejects: list[Reject],
) -> tuple[list[Candidate], int]:
    """Point every accepted image over ``cfg.max_side`` at a downscaled JPEG copy inside ``tmp`` (see
    ``mmfast.prepare.downscale``); returns the candidates (one that cannot be copied is rejected, with its
    reason) and how many were copied."""
    from mmfast.prepare.downscale import downscale_images, downscaled_path

    big = [i for i, c in enumerate(good) if max(c.width, c.height) > cfg.max_side]
    jobs = [(good[i].image, str(downscaled_path(tmp.resolve(), i))) for i in big]
    reasons = downscale_images(jobs, cfg.max_side, cfg.quality, workers, cfg.progress)
    out, dropped, copied = list(good), set(), 0
    for i, (src, dst), reason in zip(big, jobs, reasons, strict=True):
        c = good[i]
        if reason.startswith("kept"):
            continue
        if reason:
            rejects.append(Reject(c.line, reason, c.source, c.file))
            dropped.add(i)
        else:
            given = "" if _inside(Path(src), tmp.resolve()) else src  # bytes written out here go away below
            out[i] = replace(c, image=dst, original=c.original or given)
            copied += 1
        if _inside(Path(src), tmp.resolve()):  # written from the input's bytes: the copy replaces it
            Path(src).unlink(missing_ok=True)
    return [c for i, c in enumerate(out) if i not in dropped], copied


def _slice(
    cands: list[Candidate], rejects: list[Reject], part: tuple[int, int], work: Path
) -> tuple[list[Candidate], list[Reject]]:
    """Part i of n of a whole input's rows: a contiguous slice of the candidates (the rows read, in input
    order); the rows rejected while reading go with part 0. Images other parts own that the reader wrote
    into ``work`` (an input storing image bytes) are removed."""
    i, n = part
    lo, hi = len(cands) * i // n, len(cands) * (i + 1) // n
    for c in cands[:lo] + cands[hi:]:
        if _inside(Path(c.image), work.resolve()):
            Path(c.image).unlink(missing_ok=True)
    return cands[lo:hi], (rejects if i == 0 else [])


def _check(
    cands: list[Candidate], cfg: PrepareConfig, workers: int, earlier: dict[str, tuple[int, ...]], work: Path
) -> tuple[list[ImageCheck], int]:
    """Validate the candidates' images; one that an earlier preparation accepted and whose size and mtime
    are unchanged keeps that check (the loader trusts the same two figures), and so does an image written
    from an input's bytes under the same name (named by their SHA-256: the same bytes). Returns the checks
    and how many were reused."""
    checks: list[ImageCheck | None] = [None] * len(cands)
    extracted = str(work.resolve() / IMAGES_DIR) + os.sep
    for k, c in enumerate(cands):
        by_content = c.image.startswith(extracted)
        known = earlier.get(_content_key(c.image) if by_content else c.image)
        if known is None:
            continue
        try:
            st = os.stat(c.image)
        except OSError:
            continue
        # an image named by its bytes is the same image at the same size, whatever its (fresh) mtime
        if st.st_size == known[0] and (by_content or st.st_mtime_ns == known[1]):
            checks[k] = ImageCheck(True, width=known[2], height=known[3])
    todo = [k for k, chk in enumerate(checks) if chk is None]
    fresh = check_images([cands[k].image for k in todo], workers, progress=cfg.progress, max_pixels=cfg.max_pixels)
    for k, chk in zip(todo, fresh, strict=True):
        checks[k] = chk
    return checks, len(cands) - len(todo)


def earlier_checks(out: Path, cfg: PrepareConfig) -> dict[str, tuple[int, int, int, int]]:
    """{image path: (size, mtime_ns, width, height)} of the images a complete earlier preparation into
    ``out`` accepted under the same pixel budget (empty when there is none, or it predates these records)."""
    try:
        if not (out / MARKER).is_file():
            return {}
        earlier_set = PreparedDataset(out, verify=False)  # a row is trusted by its own size and mtime
        if earlier_set.max_pixels != cfg.max_pixels:
            return {}
        earlier = {}
        for split in ("train", "val"):
            for r in earlier_set.iter_rows(split):
                if "width" not in r or "size" not in r:
                    continue
                size, mtime = r["original_stat"] if r.get("original") else (r["size"], r["mtime_ns"])
                key = r.get("original") or r["image"]
                rel = Path(os.path.relpath(key, out)).parts  # images/... or, merged, parts/<i>/images/...
                if rel[0] != ".." and IMAGES_DIR in rel[:-1]:
                    key = _content_key(key)  # written from an input's bytes: found again by its name
                earlier[key] = (size, mtime, r["width"], r["height"])
        return earlier
    except (OSError, DatasetError, KeyError, TypeError):
        return {}  # nothing to reuse: every image is checked


def _content_key(path: str) -> str:
    """The ``earlier_checks`` key of an image written from an input's bytes, named by their SHA-256."""
    return f"{IMAGES_DIR}:{os.path.basename(path)}"


def failure_report_path(out: str | os.PathLike) -> Path:
    """Where the rejects of a preparation that found no usable row are kept: beside --out, as
    OUT.rejected.jsonl (--out itself is left as it was)."""
    out = Path(out)
    return out.parent / f"{out.name}.rejected.jsonl"


def _no_usable_rows(cfg: PrepareConfig, n_input: int, rejects: list[Reject]) -> str:
    """Write every reject to ``failure_report_path`` and return the error: the first reasons with their
    file and line, and where the rest are."""
    src = Path(cfg.source)
    base = src if src.is_dir() else src.parent  # a reject's file is relative to the input's folder
    lines = [f"{cfg.source}: no usable rows out of {n_input}; the first reasons:"]
    for r in rejects[:_SHOWN_REASONS]:
        lines.append(f"  {base / r.file if r.file else src}:{r.line}: {r.reason}")
    if len(rejects) > _SHOWN_REASONS:
        common = Counter(_reason_kind(r.reason) for r in rejects[_SHOWN_REASONS:]).most_common(3)
        more = ", ".join(f"{why} ({n})" for why, n in common)
        lines.append(f"  ... and {len(rejects) - _SHOWN_REASONS} more ({more})")
    if rejects and all(r.reason.startswith("missing file") for r in rejects):
        root = cfg.inputs.image_root or base
        where = f"relative paths are read from {root}; a COCO JSON's from --image-root DIR"
        lines.append(f"  (every image is missing: {where})")
    report = failure_report_path(cfg.out)
    if not rejects:
        lines[0] = f"{cfg.source}: no rows to prepare (the input is empty)"
    elif _ours_or_absent(report):
        atomic_write_jsonl(report, [r.to_json() for r in rejects])
        lines.append(f"every reason is in {report}; fix the input and re-run ({cfg.out} was not changed)")
    else:
        lines.append(f"(not written to {report}: a file of that name that mmfast did not write is in the way)")
    return "\n".join(lines)


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


def _check_images_outside(good: list[Candidate], cfg: PrepareConfig) -> None:
    out = Path(cfg.out).resolve()
    inside = [c for c in good if _inside(Path(c.image).resolve(), out)]
    if inside:
        raise OutputDirError(
            f"{cfg.source}, line {inside[0].line}: image {inside[0].image} is inside --out {cfg.out} "
            f"({len(inside)} images are); preparing replaces --out, which would delete them. Pass an --out "
            "that holds none of the input"
        )


def _check_shards_outside(cfg: PrepareConfig) -> None:
    out = Path(cfg.out).resolve()
    inside = [p for p in expand_shards(cfg.source) if _inside(p, out)]
    if inside:
        raise OutputDirError(
            f"WebDataset shard {inside[0]} is inside --out {cfg.out}; preparing replaces --out, which would "
            "delete it. Pass an --out that holds none of the input"
        )


def _save_tokenizer(tok, path: Path) -> None:
    try:
        tok.save_pretrained(path)
    except OSError:
        raise
    except Exception as e:  # the tokenizers library reports a failed write as a bare Exception
        code = re.search(r"os error (\d+)", str(e))
        raise OSError(int(code.group(1)) if code else errno.EIO, f"saving the tokenizer: {e}", str(path)) from e


def _files_map(root: Path) -> dict[str, dict]:
    """{relative posix path: {"size", "sha256"}} of every file the training side verifies."""
    paths = [root / name for name in _SPLIT_FILES]
    for sub in ("tokens", "tokenizer", "wds"):
        # WebDataset shards are left out (hashing them at every start would read the whole dataset); their
        # index files and listings are in
        paths += sorted(p for p in (root / sub).rglob("*") if p.is_file() and p.suffix not in (".lock", ".tar"))
    return {p.relative_to(root).as_posix(): {"size": p.stat().st_size, "sha256": file_sha256(p)} for p in paths}


def _input_folders(cfg: PrepareConfig) -> list[Path]:
    """The folders the input's images are found in: the input's own (a folder, or a manifest's), then the
    image root (COCO's --image-root)."""
    src = Path(cfg.source)
    folders = [src if src.is_dir() else src.parent]
    if cfg.inputs.image_root:
        folders.append(Path(cfg.inputs.image_root))
    return folders


def _split_bases(cfg: PrepareConfig) -> list[str]:
    """The folders the split keys images relative to (see mmfast.prepare.split), the innermost first."""
    return sorted((str(p.resolve()) for p in _input_folders(cfg)), key=len, reverse=True)


def _row(c: Candidate, sample_id: int, label_map: dict[str, int], work: Path) -> dict:
    """The prepared row of ``c``; an image inside ``work`` (the temp directory the prepared directory is built
    in: Parquet bytes, --max-side copies) is recorded relative to it, so the directory can be moved.

    A sample of a WebDataset shard has ``image`` "<shard>:<member>" and the member's place in the tar
    ("tar", "member", "offset", "nbytes"): what its index line lists; no file stats."""
    if "offset" in c.source:
        return {
            "id": sample_id,
            "image": c.image,
            "text": c.text,
            "label": label_map[str(c.label)],
            "line": c.line,
            "tar": c.image[: -len(c.source["member"]) - 1],
            "member": c.source["member"],
            "offset": c.source["offset"],
            "nbytes": c.source["nbytes"],
        }
    st = os.stat(c.image)  # recorded so the loader can tell a file that changed after validation
    image = Path(c.image)
    return {
        "id": sample_id,
        "image": image.relative_to(work).as_posix() if _inside(image, work) else c.image,
        "text": c.text,
        "label": label_map[str(c.label)],
        "line": c.line,
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "width": c.width,  # of the image as validated (the original, for a --max-side copy)
        "height": c.height,
    } | ({"original": c.original, "original_stat": _stat_pair(c.original)} if c.original else {})


def _stat_pair(path: str) -> list[int]:
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns]


def _largest_image(good: list, max_side: int) -> dict | None:
    """The accepted image with the most pixels as the loaders decode it ({"image", "width", "height"}; a
    --max-side copy's size): what bounds a batch's decoded memory."""
    if not good:
        return None
    c = max(good, key=lambda c: c.width * c.height)
    w, h = c.width, c.height
    if max_side and max(w, h) > max_side:
        w, h = round(w * max_side / max(w, h)), round(h * max_side / max(w, h))
    return {"image": c.original or c.image, "width": w, "height": h}


def input_fingerprint(cfg: PrepareConfig) -> str:
    """Hash of the input (manifest bytes or folder listing, with image sizes and mtimes) and the settings."""
    h = hashlib.sha256(
        f"v{PREPARE_VERSION}|{cfg.tokenizer}|{cfg.max_length}|{cfg.val_fraction}|{cfg.seed}|"
        f"{cfg.vocab_size}|{cfg.confine}|{cfg.max_pixels}|{cfg.inputs!r}|{cfg.format}|{cfg.wds_shard_size}".encode()
    )
    if cfg.max_side:  # only then: directories prepared without it keep their fingerprint
        h.update(f"|max_side={cfg.max_side}|quality={cfg.quality}".encode())
    if _is_wds(cfg):  # the shards' names, sizes and mtimes (the shards may be terabytes: not their bytes)
        shards = expand_shards(cfg.source)
        for p, (size, mtime) in zip(shards, shard_stats(shards), strict=True):
            h.update(os.fsencode(p) + f"|{size}|{mtime}".encode())
        return h.hexdigest()
    src = Path(cfg.source)
    if not src.exists():
        raise ManifestError(f"{src}: no such manifest or image folder; pass a .jsonl/.csv file or a folder")
    if src.is_file():
        try:
            with open(src, "rb") as f:  # in blocks: a Parquet source may be gigabytes
                while block := f.read(1 << 20):
                    h.update(block)
        except OSError as e:
            raise ManifestError(f"{src}: cannot read the manifest: {e.strerror or e}") from e
    out, parts = os.path.abspath(cfg.out), os.path.abspath(parts_root(cfg.out))
    for p in (p for base in _input_folders(cfg) for p in sorted(base.rglob("*"))):
        path = os.path.abspath(p)
        if any(path == d or path.startswith(d + os.sep) for d in (out, parts)):  # mmfast's outputs
            continue
        try:
            st = p.stat()
        except OSError:  # dangling link, symlink loop: part of the input as it is
            h.update(os.fsencode(p) + b"|unreadable")
            continue
        if stat.S_ISREG(st.st_mode):  # fsencode: a file name need not be UTF-8
            h.update(os.fsencode(p) + f"|{st.st_size}|{st.st_mtime_ns}".encode())
    return h.hexdigest()


def _is_wds(cfg: PrepareConfig) -> bool:
    return cfg.inputs.kind == "wds" or (cfg.inputs.kind == "auto" and is_wds_source(cfg.source))


def _reuse(out: Path, fp: str) -> dict | None:
    """prepare.json of ``out`` when it was prepared from the same input and settings and its files are as
    recorded; a changed token cache is rebuilt (it follows from the verified rows and tokenizer). None when
    ``out`` must be prepared again."""
    try:
        summary = json.loads((out / "prepare.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(summary, dict) or summary.get("input_fingerprint") != fp:
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
    summary["files"] = _files_map(out)
    atomic_write_json(out / "prepare.json", summary)
    return summary


def _changed_files(root: Path, files: dict) -> list[str]:
    changed = []
    for rel, want in sorted(files.items()):
        p = root / rel
        if not p.is_file() or p.stat().st_size != want.get("size") or file_sha256(p) != want.get("sha256"):
            changed.append(rel)
    return changed


def _rebuild_token_cache(out: Path, summary: dict, splits: set[str]) -> None:
    tok = load_tokenizer(out / "tokenizer")
    prepared = PreparedDataset(out, verify=False)
    for split in sorted(splits & {"train", "val"}):
        rows = prepared.rows(split)
        first = rows[0]["id"] if rows else summary["counts"]["train"]
        (out / "tokens" / f"{split}.meta.json").unlink(missing_ok=True)  # forces the rebuild
        TokenCache.build(
            out / "tokens", split, [r["text"] for r in rows], tok, summary["max_length"], first_id=first
        )
