"""WebDataset shards as an input (the layout img2dataset and open_clip write), and DALI index files over them.

A shard is an uncompressed tar whose members are grouped into samples by key: a member's name up to the
first dot of its base name (``00012.jpg``, ``00012.txt``, ``00012.json`` make sample ``00012``: the rule of
the ``webdataset`` library and of DALI's ``wds2idx``). A sample gives (``InputOptions``' wds_* fields):

    image    the first member whose extension is in ``wds_image_key`` (default "jpg;jpeg;png;webp")
    caption  the ``wds_text_key`` member (default "txt"): UTF-8, not empty once stripped
    label    the ``wds_label_key`` member (default "cls": an integer, else the text as a name), or, with
             ``wds_label_field``, that field of the ``json`` member; none with ``no_labels``

The shards stay where they are and are never written to (the user owns them). Preparation writes, inside
the prepared directory, DALI index files that list only the accepted samples of each split, so one user
shard can feed both splits and a rejected sample is never read:

    wds/<split>-<k>.idx   DALI's index format v1.2 (the one ``wds2idx`` writes), one line per sample with a
                          single component: ``img <offset> <size> <member>#<sample id, 10 digits>``. DALI
                          reports ``<tar>:<offset>:<name>`` as the image's source_info, from which the image
                          graph reads the sample id back (``pipelines.image``): how tokens and labels are
                          joined to the images whatever the shuffle.
    wds/<split>.rows.npy  (N, 2) int64 [sample id, class id] in id order: all the loader reads of the rows
    wds/<split>.json      {"tars": [shard paths], "index": [index file names], "stats": [[size, mtime_ns]],
                          "samples": N}; a shard whose size or mtime changed since is refused at training.
"""

from __future__ import annotations

import glob
import hashlib
import io
import json
import logging
import os
import re
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from mmfast.data.dataset import WDS_DIR, WDS_ID_DIGITS, WDS_IMAGE_EXT
from mmfast.data.validate import DEFAULT_MAX_PIXELS, check_image_bytes, dali_rejects
from mmfast.inputs import file_reads
from mmfast.inputs.base import ImagesInPlace, InPlaceRead, InputOptions, Member, Reader
from mmfast.inputs.manifest import NO_LABEL, Candidate, ManifestError, Reject, parse_label
from mmfast.remote.errors import redact
from mmfast.remote.objects import expand, fetch_to, is_remote, remote_version
from mmfast.util.fsutil import atomic_write_json, file_sha256
from mmfast.util.pool import process_map, progress_lines

# The one component of mmfast's index lines (the sample's image, whatever its extension) and the digits of
# the sample id that close its name: what the image graph reads (int32 ids fit in 10 digits).
INDEX_EXT, ID_DIGITS = WDS_IMAGE_EXT, WDS_ID_DIGITS
log = logging.getLogger(__name__)
_DALI_CHUNK = 1024  # images of a shard confirmed by DALI's decoder at a time (bounds the memory held)


def is_wds_source(source: str | os.PathLike) -> bool:
    """Whether ``source`` names WebDataset shards: a .tar file, a glob or brace pattern of them, or a folder
    holding .tar files."""
    s = str(source)
    if is_remote(s):  # a URL or a pattern of them: s3://bucket/shards/{00000..00099}.tar
        return s.split("?", 1)[0].endswith(".tar")
    if s.endswith(".tar") and (any(c in s for c in "*?[{") or Path(s).is_file()):
        return True
    p = Path(s)
    return p.is_dir() and any(p.glob("*.tar"))


class RemoteShard(str):
    """A shard's URL where preparation handles shard paths: ``stat()`` gives the store's size and version
    (ETag, else modification time: what tells the fingerprint a shard changed), and it lies in no local
    folder."""

    def stat(self) -> SimpleNamespace:
        size, version = remote_version(self)
        return SimpleNamespace(
            st_size=size, st_mtime_ns=int(hashlib.sha256(version.encode()).hexdigest()[:15], 16)
        )

    def is_relative_to(self, _other) -> bool:
        return False

    def resolve(self) -> RemoteShard:
        return self


def expand_shards(source: str | os.PathLike) -> list[Path]:
    """The shards of ``source``: a folder's ``*.tar`` files (sorted), a .tar file, or a pattern such as
    ``shards/{00000..00099}.tar`` (brace ranges and lists, as in ``webdataset``) or ``shards/*.tar``; for a
    URL pattern (``s3://``, ``gs://``, ``hf://``, ``https://``) the URLs, as ``RemoteShard`` strings.

    Raises:
        ManifestError: no shard matches, or a named shard is missing.
    """
    s = str(source)
    if is_remote(s):
        try:
            return [RemoteShard(u) for u in expand(s)]
        except ValueError as e:
            raise ManifestError(str(e)) from None
    if Path(s).is_dir():
        shards = sorted(Path(s).glob("*.tar"))
    else:
        shards, seen = [], set()
        for pattern in _brace_expand(s):
            found = sorted(glob.glob(pattern)) if any(c in pattern for c in "*?[") else [pattern]
            for f in found:
                if not Path(f).is_file():
                    raise ManifestError(f"{f}: no such WebDataset shard (from {s})")
                if f not in seen:
                    seen.add(f)
                    shards.append(Path(f))
    if not shards:
        raise ManifestError(f"{s}: no WebDataset shards (.tar files) found")
    return [p.resolve() for p in shards]


def _brace_expand(s: str) -> list[str]:
    """``a{1..3}b`` -> a1b a2b a3b (zero padding kept: {000..002}); ``a{x,y}`` -> ax ay; nested left to right."""
    m = re.search(r"\{([^{}]*)\}", s)
    if m is None:
        return [s]
    head, tail, body = s[: m.start()], s[m.end() :], m.group(1)
    rng = re.fullmatch(r"(\d+)\.\.(\d+)", body)
    if rng:
        lo, hi = rng.groups()
        width = len(lo) if lo.startswith("0") else 0
        items = [f"{i:0{width}d}" for i in range(int(lo), int(hi) + 1)]
    else:
        items = body.split(",")
    return [x for item in items for x in _brace_expand(head + item + tail)]


def shard_stats(shards: list[Path]) -> list[list[int]]:
    """[size, mtime_ns] of each shard: what tells a shard changed since preparation."""
    return [[st.st_size, st.st_mtime_ns] for st in (p.stat() for p in shards)]


def read_shards(
    source: str | os.PathLike,
    opts: InputOptions,
    workers: int = 1,
    max_pixels: int | None = None,
    part: tuple[int, int] | None = None,
    earlier: list[Path] | None = None,
) -> InPlaceRead:
    """Read every shard of ``source`` (``part`` (i, n): the i-th of n contiguous slices of them) into
    candidate rows (images already validated) and rejects.

    Each candidate's ``image`` is ``<shard>:<member>`` and its ``source`` holds the shard, key, member, and
    the member's data offset and size in the tar (what the index files list); its width and height are the
    image's, read when it was decoded to validate it. A reject's ``file`` is the shard
    (relative to the source's folder) and its reason names the sample's key.

    Args:
        source: a folder of .tar files, a .tar file, or a pattern of them (``expand_shards``).
        opts: the wds_* fields say which members hold the image, caption and label.
        workers: processes reading shards at once.
        max_pixels: the decoded-pixel budget of an image (default: ``validate.DEFAULT_MAX_PIXELS``).
        part: (i, n), or None for every shard.
        earlier: folders of earlier preparations, the most trusted last: a local shard whose ``file_reads``
            record there still matches (size, mtime, options) is not read again.
    """
    shards = expand_shards(source)
    if part is not None:
        shards = shards[len(shards) * part[0] // part[1] : len(shards) * (part[0] + 1) // part[1]]
    src = Path(source)
    base = src if src.is_dir() else Path(os.path.dirname(str(source)) or ".")
    env = _store_env() if any(is_remote(p) for p in shards) else {}
    o, budget = _wds_opts(opts), max_pixels or DEFAULT_MAX_PIXELS
    key = {"options": o, "max_pixels": budget}
    rels = [redact(p) if is_remote(p) else _relative(p, base.resolve()) for p in shards]
    stats = [None if is_remote(p) else shard_stats([p])[0] for p in shards]
    recs = file_reads.load(earlier or [], [p for p, stat in zip(shards, stats, strict=True) if stat is not None])
    kept: list[dict | None] = [None] * len(shards)
    got: list[file_reads.Rows | None] = [None] * len(shards)
    for k, p in enumerate(shards):
        for rec in recs.get(str(p), []):  # the first that still matches
            if got[k] is None and (rows := file_reads.reusable(rec, stats[k], rels[k], key)) is not None:
                got[k], kept[k] = rows, rec
    todo = [k for k, rows in enumerate(got) if rows is None]
    reused = sum(len(rows[0]) + len(rows[1]) for rows in got if rows is not None)
    if len(todo) < len(shards):
        log.info("%d of %d shards unchanged since last read: not read again", len(shards) - len(todo), len(shards))
    jobs = [((str(shards[k]), rels[k], o, budget), env) for k in todo]
    if workers > 1 and len(jobs) > 1:
        done = process_map(_read_shard_job, jobs, min(workers, len(jobs)))
    else:
        done = (_read_shard_job(j) for j in jobs)
    done = progress_lines(done, len(jobs), "reading and checking shards", "shards")
    for k, rows in zip(todo, done, strict=True):
        got[k], kept[k] = rows, file_reads.record(shards[k], stats[k], key, rels[k], rows)
    records = [rec for rec in kept if rec is not None]  # a reused shard's as it was
    cands = [c for rows in got for c in rows[0]]
    rejects = [r for rows in got for r in rows[1]]
    return InPlaceRead(cands, rejects, records, reused)


def _read_all(
    path: Path, opts: InputOptions, confine: bool, image_dir: Path | None = None
) -> tuple[list[Candidate], list[Reject]]:
    """Every shard, in this process: ``read_shards`` as the registry calls a reader (``confine`` and
    ``image_dir`` do not apply: the images stay in the shards)."""
    got = read_shards(path, opts)
    return got.cands, got.rejects


def _member(c: Candidate) -> Member:
    """Where a candidate's image lies: its ``image`` is "<shard path>:<member>" (``read_shards``)."""
    member = c.source["member"]
    return Member(c.image[: -len(member) - 1], member, c.source["offset"], c.source["nbytes"])


def _relative(p: Path, base: Path) -> str:
    try:
        return p.relative_to(base).as_posix()
    except ValueError:
        return str(p)


def _wds_opts(opts: InputOptions) -> dict:
    image_keys = [k.strip().lower() for k in re.split(r"[;,]", opts.wds_image_key) if k.strip()]
    return {
        "image_keys": image_keys,
        "text_key": opts.wds_text_key,
        "label_key": opts.wds_label_key,
        "label_field": opts.wds_label_field,
        "no_labels": opts.no_labels,
        "text_optional": not opts.captions_needed,
    }


# The environment a store's library reads its credentials and endpoint from: handed to the pool's workers,
# which a fork server started earlier (``util.pool``) and which so may not have this process's current one.
_STORE_ENV = ("AWS_", "GOOGLE_", "GCS", "HF_", "HUGGING_FACE", "FSSPEC_", "BOTO_")


def _store_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(_STORE_ENV)}


def _read_shard_job(job) -> tuple[list[Candidate], list[Reject]]:
    job, env = job
    shard = job[0]
    if not is_remote(shard):
        return read_shard(*job)
    os.environ.update(env)  # in this worker only; never written anywhere
    # A remote shard is fetched whole into a temporary file (verified by nothing yet: its size and SHA-256
    # are what preparation records, and what training checks each fetch against), read there, then deleted.
    with tempfile.TemporaryDirectory(prefix="mmfast-shard-") as tmp:
        local = fetch_to(shard, Path(tmp) / "shard.tar")
        size, sha256 = local.stat().st_size, file_sha256(local)
        cands, rejects = read_shard(*job, local=str(local))
    for c in cands:
        c.source |= {"tar_size": size, "tar_sha256": sha256}
    return cands, rejects


def _samples(tar: tarfile.TarFile) -> Iterator[tuple[str, dict[str, tarfile.TarInfo]]]:
    """(key, {extension: member}) of each sample, members grouped by consecutive key as WebDataset does."""
    key, members = None, {}
    for ti in tar:
        if not ti.isreg():
            continue
        base = ti.name.rsplit("/", 1)[-1]
        dot = base.find(".")
        if dot <= 0:  # no extension, or a hidden file: not part of a sample
            continue
        k = ti.name[: len(ti.name) - len(base) + dot]
        ext = base[dot + 1 :].lower()
        if k != key:
            if members:
                yield key, members
            key, members = k, {}
        members.setdefault(ext, ti)
    if members:
        yield key, members


def read_shard(
    shard: str, rel: str, o: dict, max_pixels: int, local: str | None = None
) -> tuple[list[Candidate], list[Reject]]:
    """Candidates and rejects of one shard (see ``read_shards``); ``o`` is ``_wds_opts``' dict; ``local``: a
    local copy of a remote ``shard`` to read instead."""
    cands: list[Candidate] = []
    rejects: list[Reject] = []
    pending: list[tuple[Candidate, bytes]] = []  # PIL-valid images awaiting DALI's decoder

    def confirm() -> None:
        bad = dali_rejects([b for _, b in pending], 1, load=lambda b: np.frombuffer(b, dtype=np.uint8))
        for i, (c, _) in enumerate(pending):
            if i in bad:
                rejects.append(Reject(c.line, f"{bad[i]} ({c.source['member']})", c.source, rel))
            else:
                cands.append(c)
        pending.clear()

    try:
        tar = tarfile.open(local or shard, "r:")  # DALI reads plain tars only: a compressed one is refused
    except (tarfile.TarError, OSError) as e:
        raise ManifestError(
            f"{redact(shard)}: not a readable uncompressed tar ({e}); DALI reads plain .tar WebDataset shards"
        ) from e
    with tar:
        try:
            for line, (key, members) in enumerate(_samples(tar), start=1):
                row = {"shard": rel, "key": key, "members": sorted(m.name for m in members.values())}

                def reject(reason: str, line=line, key=key, row=row) -> None:
                    rejects.append(Reject(line, f"{reason} (sample {key})", row, rel))

                image = next((members[k] for k in o["image_keys"] if k in members), None)
                if image is None:
                    reject(f"no image member (.{' / .'.join(o['image_keys'])}); set --wds-image-key")
                    continue
                text, why = _caption(tar, members.get(o["text_key"]), o["text_key"])
                if why and o["text_optional"]:  # a command that reads no caption
                    text, why = "", ""
                if why:
                    reject(why)
                    continue
                label, why = _label(tar, members, o)
                if why:
                    reject(why)
                    continue
                data = tar.extractfile(image).read()
                check = check_image_bytes(data, max_pixels)
                if not check.ok:
                    reject(f"{check.reason}: {image.name}")
                    continue
                # what the index lists (the member list stays with the rejects: every accepted row is held)
                source = {"shard": rel, "key": key, "member": image.name}
                source |= {"offset": image.offset_data, "nbytes": image.size}
                label = NO_LABEL if o["no_labels"] else label
                c = Candidate(
                    line, f"{shard}:{image.name}", text, label, source, rel, width=check.width, height=check.height
                )
                pending.append((c, data))
                if len(pending) >= _DALI_CHUNK:
                    confirm()
        except (tarfile.TarError, OSError) as e:  # a truncated shard: keep what came before the damage
            rejects.append(
                Reject(0, f"shard unreadable after {len(cands) + len(pending)} samples: {e}", {"shard": rel}, rel)
            )
    if pending:
        confirm()
    return cands, rejects


def _member_text(tar: tarfile.TarFile, ti: tarfile.TarInfo, what: str) -> tuple[str, str]:
    raw = tar.extractfile(ti).read()
    try:
        return raw.decode("utf-8"), ""
    except UnicodeDecodeError as e:
        return "", f"{what} is not UTF-8 (byte {e.start} of {ti.name}); re-encode it as UTF-8"


def _caption(tar: tarfile.TarFile, ti: tarfile.TarInfo | None, key: str) -> tuple[str, str]:
    if ti is None:
        return "", f"no caption member (.{key}); set --wds-text-key"
    return _stripped_member(tar, ti, "caption")


def _stripped_member(tar: tarfile.TarFile, ti: tarfile.TarInfo, what: str) -> tuple[str, str]:
    """The member's text without surrounding space, or why there is none (unreadable, not UTF-8, empty)."""
    text, why = _member_text(tar, ti, f"the {what}")
    if why:
        return "", why
    text = text.strip()
    return (text, "") if text else ("", f"empty {what} ({ti.name})")


def _label(tar: tarfile.TarFile, members: dict, o: dict) -> tuple[str | int, str]:
    """The sample's label (an int when it reads as a whole number: ``manifest.parse_label``) or why it has
    none."""
    if o["no_labels"]:
        return 0, ""
    if o["label_field"]:
        ti = members.get("json")
        if ti is None:
            return "", f"no .json member to read --wds-label-field '{o['label_field']}' from"
        text, why = _member_text(tar, ti, "the JSON")
        if why:
            return "", why
        try:
            meta = json.loads(text)
        except ValueError as e:
            return "", f"not valid JSON ({ti.name}: {e})"
        value = meta.get(o["label_field"]) if isinstance(meta, dict) else None
        if value is None or isinstance(value, bool | dict | list):
            return "", f"no usable field '{o['label_field']}' (--wds-label-field) in {ti.name}"
        label, why = parse_label(value)
        return (label, "") if not why else ("", f"{why} ({ti.name})")
    ti = members.get(o["label_key"])
    if ti is None:
        return "", (
            f"no label member (.{o['label_key']}); pass --wds-label-key, --wds-label-field FIELD (of the .json) "
            "or --no-labels"
        )
    text, why = _stripped_member(tar, ti, "label")
    if why:
        return "", why
    label, why = parse_label(text, from_text=True)
    return (label, "") if not why else ("", f"{why} ({ti.name})")


def write_split_index(out: Path, split: str, rows: list[dict]) -> dict:
    """Write the index files of ``split`` (rows in id order, each with "tar", "offset", "nbytes", "member")
    into ``out`` (the prepared directory's wds/ being built) and ``<split>.json``; returns that json."""
    by_tar: dict[str, list[dict]] = {}
    for r in rows:
        by_tar.setdefault(r["tar"], []).append(r)
    info = {"tars": [], "index": [], "stats": [], "samples": len(rows)}
    for k, (tar, part) in enumerate(by_tar.items()):
        name = f"{split}-{k:05d}.idx"
        write_index(out / name, [(r["offset"], r["nbytes"], r["member"], r["id"]) for r in part])
        info["tars"].append(tar)
        info["index"].append(name)
    local = [t for t in info["tars"] if not is_remote(t)]
    stats = iter(shard_stats([Path(t) for t in local]))
    info["stats"] = [None if is_remote(t) else next(stats) for t in info["tars"]]
    if len(local) < len(info["tars"]):  # remote shards: checked by size and SHA-256 when training fetches them
        first = {r["tar"]: r for r in reversed(rows)}
        info["checks"] = [[first[t].get("tar_size"), first[t].get("tar_sha256")] for t in info["tars"]]
    write_rows_table(out / f"{split}.rows.npy", rows)
    atomic_write_json(out / f"{split}.json", info)
    return info


def write_rows_table(path: Path, rows: list[dict]) -> None:
    """(N, 2) int64 [id, class id] of the rows: what the loader reads of a WebDataset split (not the JSONL)."""
    with open(path, "wb") as f:
        np.save(f, np.array([(r["id"], r["label"]) for r in rows], dtype=np.int64).reshape(-1, 2))


def write_index(path: Path, samples: list[tuple[int, int, str, int]]) -> None:
    """A DALI index (format v1.2) of (data offset, size, member name, sample id) samples, one image
    component each named ``<member>#<id>`` (see the module docstring)."""
    buf = io.StringIO()
    buf.write(f"v1.2 {len(samples)}\n")
    for offset, size, member, sample_id in samples:
        name = re.sub(r"\s", "_", member)  # the index is space-separated
        buf.write(f"{INDEX_EXT} {offset} {size} {name}#{sample_id:0{ID_DIGITS}d}\n")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(buf.getvalue())
    os.replace(tmp, path)


READER = Reader(
    name="wds",
    read=_read_all,
    suffixes=(".tar",),
    claims=is_wds_source,
    in_place=ImagesInPlace(
        noun="WebDataset shard",
        read_checked=read_shards,
        files=expand_shards,
        member=_member,
        index_dir=WDS_DIR,
        write_index=write_split_index,
    ),
)
