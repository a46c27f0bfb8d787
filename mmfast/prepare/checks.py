"""Read the input and check every row's image: what a preparation (or one ``--shard`` part of it) keeps,
``Checked``, before the label map, split and token cache are made from it.

Images are validated here (``data.validate``; an image an earlier preparation accepted and that did not change
keeps its check), and --max-side copies stored (``prepare.downscale``), unless the input's kind reads its images
in place (``inputs.ImagesInPlace``): then its reader validated them where they lie.
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from mmfast.data.dataset import SUMMARY_FILE, DatasetError, PreparedDataset
from mmfast.data.validate import ImageCheck, check_images
from mmfast.inputs import ImagesInPlace, Reader, check_image_root, read_source, reader_for
from mmfast.inputs.manifest import Candidate, Reject, finish_rows
from mmfast.prepare.config import IMAGES_DIR, PREPARE_VERSION, PrepareConfig
from mmfast.prepare.downscale import downscale_images, downscaled_path
from mmfast.prepare.last_prepared import last_prepared, source_name
from mmfast.util.fsutil import MARKER, OutputDirError, read_json_object


@dataclass
class Checked:
    """What reading and validating the input (or a part of it) gave: the rows kept, each with its image's
    size, and the rows dropped with their reasons."""

    good: list[Candidate]
    rejects: list[Reject]
    n_input: int  # rows read: len(good) + len(rejects)
    kind: str  # the input reader's name
    seconds: dict[str, float]  # read, validate, downscale
    reused: int = 0  # rows whose earlier check was reused (unchanged since an earlier preparation)
    downscaled: int = 0
    file_reads: list[dict] = field(default_factory=list)  # ``inputs.file_reads`` records, for the next one
    carried_reads: list[Path] = field(default_factory=list)  # a merge's: its parts' record files, unread
    reused_from: str = ""  # the input's last folder, when checks came from there and not from --out alone
    earlier: list[Path] = field(default_factory=list)  # complete preparations of the input by this version


def in_place_kind(cfg: PrepareConfig) -> Reader | None:
    """The input's kind when it reads its images in place (``Reader.in_place``); None for every other input."""
    reader = reader_for(cfg.source, cfg.inputs)
    return reader if reader is not None and reader.in_place is not None else None


def read_and_check(cfg: PrepareConfig, work: Path, part: tuple[int, int] | None) -> Checked:
    """Read the input (``part`` (i, n): only the i-th of n slices of it), validate every image (those that
    earlier preparations of the input checked and that did not change since are not decoded again: image files
    by ``earlier_checks``, files read in place by their ``inputs.file_reads`` records) and store --max-side
    copies into ``work``."""
    t0 = time.perf_counter()
    workers = cfg.workers or os.cpu_count() or 1
    earlier = {d: ds for d in earlier_dirs(cfg) if (ds := _prepared(d)) is not None}  # interrupted: not trusted
    reader = in_place_kind(cfg)
    in_place = reader.in_place if reader is not None else None
    if in_place is not None:  # images stay in the user's files; the reader validates them there
        _refuse_copies(cfg, in_place)
        check_image_root(reader, cfg.inputs)  # read_source's check, which this input does not go through
        reads = _same_version(list(earlier))  # the folders whose records of unchanged files spare reading them
        got = in_place.read_checked(cfg.source, cfg.inputs, workers, cfg.max_pixels, part, reads)
        cands, rejects, records, reused = got.cands, got.rejects, got.records, got.reused
        if part is None:  # duplicates across the parts' files are found when the parts are merged
            cands, rejects = finish_rows(cands, rejects)
        kind = reader.name
    else:
        cands, rejects, kind = read_source(cfg.source, cfg.inputs, cfg.confine, (work / IMAGES_DIR).resolve())
        records = []
        if part is not None:
            cands, rejects = _slice(cands, rejects, part, work)
    n_input = len(cands) + len(rejects)
    t_read = time.perf_counter()

    if in_place is not None:
        checks = [ImageCheck(True, width=c.width, height=c.height) for c in cands]  # as the reader found them
    else:
        checks, reused = _check(cands, cfg, workers, earlier_checks(earlier, cfg), work)
    good: list[Candidate] = []
    for c, chk in zip(cands, checks, strict=True):
        if chk.ok:
            good.append(replace(c, width=chk.width, height=chk.height, decoded=chk.decoded))
        else:
            rejects.append(Reject(c.line, chk.reason, c.source, c.file))
            if Path(c.image).is_relative_to(work.resolve()):  # written from the input's bytes: not kept
                Path(c.image).unlink(missing_ok=True)
    if in_place is not None:  # the samples are in the user's files: whether those are inside --out
        _check_files_outside(cfg, in_place)
    else:
        _check_images_outside(good, cfg)
    t_validate = time.perf_counter()
    n_downscaled = 0
    if cfg.max_side:
        good, n_downscaled = _downscale(good, cfg, work, workers, rejects)
    seconds = {"read": t_read - t0, "validate": t_validate - t_read, "downscale": time.perf_counter() - t_validate}
    done = Checked(good, rejects, n_input, kind, seconds, reused, n_downscaled, records)
    done.earlier = _same_version(list(earlier))  # their tokenizer and token cache may serve too
    return done


def _refuse_copies(cfg: PrepareConfig, in_place: ImagesInPlace) -> None:
    """Refuse what needs image files of an input whose images stay in the user's files."""
    if cfg.format == "wds":
        raise ValueError(
            f"{cfg.source}: the input is {in_place.noun}s already; training reads them in place "
            "(drop --format wds)"
        )
    if cfg.max_side:
        raise ValueError(
            f"{cfg.source}: --max-side stores copies of image files; {in_place.noun}s are read in place "
            "(drop --max-side, or downscale when writing the shards)"
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
    big = [i for i, c in enumerate(good) if max(c.width, c.height) > cfg.max_side]
    jobs = [(good[i].image, str(downscaled_path(tmp.resolve(), i))) for i in big]
    written = downscale_images(jobs, cfg.max_side, cfg.quality, workers, cfg.progress)
    out, dropped, copied = list(good), set(), 0
    for i, (src, dst), (reason, shape) in zip(big, jobs, written, strict=True):
        c = good[i]
        if reason.startswith("kept"):
            continue
        written_here = Path(src).is_relative_to(tmp.resolve())  # from the input's bytes: the copy replaces it
        if reason:
            rejects.append(Reject(c.line, reason, c.source, c.file))
            dropped.add(i)
        else:
            # the copy's own size (no EXIF orientation in it): the loader draws its crops on the host
            out[i] = replace(c, image=dst, original=c.original or ("" if written_here else src), decoded=shape)
            copied += 1
        if written_here:
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
        if Path(c.image).is_relative_to(work.resolve()):
            Path(c.image).unlink(missing_ok=True)
    return cands[lo:hi], (rejects if i == 0 else [])


def _check(
    cands: list[Candidate], cfg: PrepareConfig, workers: int, earlier: dict[str, list[tuple]], work: Path
) -> tuple[list[ImageCheck], int]:
    """Validate the candidates' images; one that an earlier preparation accepted and whose size and mtime
    are unchanged keeps that check (the loader trusts the same two figures), and so does an image written
    from an input's bytes under the same name (named by their SHA-256: the same bytes). Returns the checks
    and how many were reused."""
    checks: list[ImageCheck | None] = [None] * len(cands)
    extracted = str(work.resolve() / IMAGES_DIR) + os.sep
    for k, c in enumerate(cands):
        by_content = c.image.startswith(extracted)
        knowns = earlier.get(_content_key(c.image) if by_content else c.image)
        if not knowns:
            continue
        try:
            st = os.stat(c.image)
        except OSError:
            continue
        for known in knowns:  # the first that still holds
            # an image named by its bytes is the same image at the same size, whatever its (fresh) mtime
            if st.st_size == known[0] and (by_content or st.st_mtime_ns == known[1]):
                checks[k] = ImageCheck(True, width=known[2], height=known[3], decoded=known[4])
                break
    todo = [k for k, chk in enumerate(checks) if chk is None]
    fresh = check_images([cands[k].image for k in todo], workers, progress=cfg.progress, max_pixels=cfg.max_pixels)
    for k, chk in zip(todo, fresh, strict=True):
        checks[k] = chk
    return checks, len(cands) - len(todo)


def earlier_dirs(cfg: PrepareConfig) -> list[Path]:
    """Where earlier checks of the input may be: the folder it was last prepared into, when that is another,
    then --out, whose own records win."""
    out = Path(cfg.out)
    other = last_prepared(source_name(cfg.source), out)
    return [out] if other is None else [other, out]


def _prepared(out: Path) -> PreparedDataset | None:
    """``out`` as a complete preparation mmfast wrote (its rows unverified: a row is trusted by its own size and
    mtime), or None."""
    try:
        return PreparedDataset(out, verify=False) if (out / MARKER).is_file() else None
    except (OSError, DatasetError, KeyError, TypeError):
        return None


def earlier_preparations(cfg: PrepareConfig) -> list[Path]:
    """The complete preparations of the input by this version of mmfast (of ``earlier_dirs``): what a merge
    of parts, which reads no earlier checks, may still keep the tokenizer and token cache of."""
    return _same_version([d for d in earlier_dirs(cfg) if _prepared(d) is not None])


def earlier_checks(folders: dict[Path, PreparedDataset], cfg: PrepareConfig) -> dict[str, list[tuple]]:
    """{image path: [(size, mtime_ns, width, height, decoded (height, width) or None), ...]} of the images that
    the complete preparations ``folders`` ({folder: its ``_prepared``}) accepted under the same pixel budget,
    the last folder's first (empty when there is none, or they predate these records)."""
    earlier: dict[str, list[tuple]] = {}
    for folder, earlier_set in folders.items():
        for key, known in _checks_in(folder, earlier_set, cfg).items():
            earlier.setdefault(key, []).insert(0, known)  # --out's own first
    return earlier


def _checks_in(out: Path, earlier_set: PreparedDataset, cfg: PrepareConfig) -> dict[str, tuple]:
    """``earlier_checks`` of one folder."""
    try:
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
                shape = None if r.get("original") else r.get("decoded_shape")  # of the copy, not of the original
                earlier[key] = (size, mtime, r["width"], r["height"], tuple(shape) if shape else None)
        return earlier
    except (OSError, DatasetError, KeyError, TypeError):
        return {}  # nothing to reuse: every image is checked


def _same_version(folders: list[Path]) -> list[Path]:
    """Those of ``folders`` prepared by this version of mmfast: an ``inputs.file_reads`` record holds rows as
    the reading code then read them, and a fix to reading must reach every file."""
    return [d for d in folders if read_json_object(d / SUMMARY_FILE).get("version") == PREPARE_VERSION]


def _content_key(path: str) -> str:
    """The ``earlier_checks`` key of an image written from an input's bytes, named by their SHA-256."""
    return f"{IMAGES_DIR}:{os.path.basename(path)}"


def _check_images_outside(good: list[Candidate], cfg: PrepareConfig) -> None:
    """Refuse images that resolve to a place inside --out. Each folder is resolved once and each file looked
    at once (a symlinked file resolved whole): a resolve per image was 10 s of a 100k-row re-prepare."""
    out = str(Path(cfg.out).resolve())
    real_folder = functools.cache(os.path.realpath)

    def real(image: str) -> str:
        if os.path.islink(image):
            return os.path.realpath(image)
        return os.path.join(real_folder(os.path.dirname(image)), os.path.basename(image))

    inside = [c for c in good if (r := real(os.path.abspath(c.image))) == out or r.startswith(out + os.sep)]
    if inside:
        raise OutputDirError(
            f"{cfg.source}, line {inside[0].line}: image {inside[0].image} is inside --out {cfg.out} "
            f"({len(inside)} images are); preparing replaces --out, which would delete them. Pass an --out "
            "that holds none of the input"
        )


def _check_files_outside(cfg: PrepareConfig, in_place: ImagesInPlace) -> None:
    out = Path(cfg.out).resolve()
    inside = [p for p in in_place.files(cfg.source) if p.is_relative_to(out)]
    if inside:
        raise OutputDirError(
            f"{in_place.noun} {inside[0]} is inside --out {cfg.out}; preparing replaces --out, which would "
            "delete it. Pass an --out that holds none of the input"
        )
