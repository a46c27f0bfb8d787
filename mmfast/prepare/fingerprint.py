"""The fingerprint of a preparation's input and settings: what tells that --out (or a ``--shard`` part) was
prepared from the same input with the same settings, so it is reused instead of made again."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

from mmfast.inputs.manifest import ManifestError
from mmfast.prepare.checks import in_place_kind
from mmfast.prepare.config import PREPARE_VERSION, PrepareConfig, parts_root
from mmfast.util.fsutil import is_mmfast_output


def input_fingerprint(cfg: PrepareConfig) -> str:
    """Hash of the input (manifest bytes or folder listing, with image sizes and mtimes; for an input whose
    images stay in the user's files, those files' names, sizes and mtimes) and the settings. The listing
    leaves out what mmfast's own folders there hold (``listing``).

    Raises:
        ManifestError: the input is missing or cannot be read.
    """
    h = hashlib.sha256(
        f"v{PREPARE_VERSION}|{cfg.tokenizer}|{cfg.max_length}|{cfg.val_fraction}|{cfg.seed}|"
        f"{cfg.vocab_size}|{cfg.confine}|{cfg.max_pixels}|{cfg.inputs!r}|{cfg.format}|{cfg.wds_shard_size}".encode()
    )
    if cfg.max_side:  # only then: directories prepared without it keep their fingerprint
        h.update(f"|max_side={cfg.max_side}|quality={cfg.quality}".encode())
    reader = in_place_kind(cfg)
    if reader is not None:  # the files may be terabytes: their stats, not their bytes
        for p in reader.in_place.files(cfg.source):
            st = p.stat()
            h.update(os.fsencode(p) + f"|{st.st_size}|{st.st_mtime_ns}".encode())
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
    for p in (p for base in cfg.input_folders() for p in listing(base)):
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


def listing(base: Path) -> list[Path]:
    """Every path under ``base``, as ``sorted(base.rglob("*"))`` lists them, less what mmfast's runs, exports
    and evaluations there hold (``fsutil.is_mmfast_output``; the folders themselves are listed). A run
    directory inside the manifest's folder changes as it trains, and would otherwise make each resume prepare
    the data again. A prepared or demo dataset there stays listed: a manifest may name its images. An image
    folder's reader skips the same folders."""
    found = []
    for top, dirs, files in os.walk(base):  # a link to a folder is listed, not entered, as rglob does
        found += [Path(top, name) for name in (*dirs, *files)]
        dirs[:] = [d for d in dirs if not is_mmfast_output(Path(top, d))]
    return sorted(found)
