"""File health: which of a loader's image files are missing or undecodable, and what stands in for them in
the reader's list.

Two ways a bad file is found:
- ``watch``: before DALI reads a batch's files (the loader watches them a few batches ahead of DALI's
  reader; the decoded cache, each epoch's), they are stat'ed and compared with what they were when last
  known good (the size and mtime that preparation recorded, or the first stat; a file seen for the first time
  also has its header's pixel count checked against the budget). Only a file that is missing, not a regular
  file, empty, or changed is decoded again; one found bad is never handed to DALI. This is what keeps a file
  replaced after validation (bytes that are no image, a FIFO) away from DALI's parser, which can crash the
  process on such a file instead of raising (docs/reference/faults.md), and what tells the decoded cache that
  an image it holds has changed.
- the recovery: DALI aborts the whole pipeline on a file it cannot decode (a JPEG truncated in place keeps
  no trace in its stat when its mtime is put back); the loader then checks the files of the next few batches
  (the "recovery window"), marks the bad ones and reopens the stream at the same position.
"""

from __future__ import annotations

import logging
import os
import stat
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from mmfast.data.batch import PAD_ID
from mmfast.data.validate import check_images, pixel_budget_reason
from mmfast.loading.options import ON_BAD_IMAGE
from mmfast.util.commands import PREPARE
from mmfast.util.voice import said, setting

log = logging.getLogger(__name__)
_UNKNOWN = -1  # a baseline not taken yet
NAMED_BAD = 10  # bad files the log names one by one; the others are counted only
_STAT_THREADS_FROM = 4096  # files from which ``stat_files`` may stat on several threads
_STAT_PROBE = 512  # the files stat'ed in turn first, to tell a local file system from a network one
_STAT_SLOW_S = 100e-6  # a stat slower than this on average: a network's round trip, which threads overlap


class FileHealth:
    """The bad files among ``files`` (by position) and why each is bad.

    Args:
        files: the loader's image paths.
        ids: their sample ids.
        on_bad_image: "skip" (log it and serve a masked stand-in) or "error" (raise, naming the file).
        max_pixels: decoded-pixel budget per image checked at start-up (one over it is a bad image).
        num_threads: threads decoding the files that are checked.
        file_stats: (size, mtime_ns) of each file when it was validated (a prepared directory's), the
            baseline ``watch`` compares with; default: the first stat ``watch`` takes.
    """

    def __init__(
        self,
        files: list[str],
        ids: np.ndarray,
        on_bad_image: str,
        max_pixels: int,
        num_threads: int,
        file_stats: Sequence[tuple[int, int]] | None = None,
    ):
        if on_bad_image not in ON_BAD_IMAGE:
            raise ValueError(f"on_bad_image must be {' or '.join(map(repr, ON_BAD_IMAGE))}, got '{on_bad_image}'")
        self.files, self.ids = files, ids
        self.dali_files = self._dali_names(files)
        self.on_bad_image = on_bad_image
        self.max_pixels = max_pixels
        self.num_threads = num_threads
        self.bad: dict[int, str] = {}  # position in files -> why it is skipped
        self.prepared = False  # the files come from a prepared directory (its tool is named in errors)
        self.instead = ""  # where else the images can be read, said when every file is missing
        # (size, mtime_ns) of each file when last known good
        if file_stats is not None:
            self._known = np.array(file_stats, dtype=np.int64).reshape(len(files), 2)
        else:
            self._known = np.full((len(files), 2), _UNKNOWN, dtype=np.int64)

    def _dali_names(self, files: list[str]) -> list[str]:
        """``files`` as DALI's reader can take them: a name UTF-8 cannot encode (a byte of another encoding, as
        Latin-1 file names have, which Python holds as a surrogate escape) is read through a symlink to it in
        a folder of this object's own (removed with it). Messages name the file itself."""
        odd = [p for p, f in enumerate(files) if not f.isascii() and not _utf8(f)]
        if not odd:
            return files
        self._links = tempfile.TemporaryDirectory(prefix="mmfast-names-")
        names = list(files)
        for p in odd:
            names[p] = os.path.join(self._links.name, str(p))
            os.symlink(os.path.abspath(files[p]), names[p])
        return names

    @property
    def skipped(self) -> list[dict]:
        """The samples served masked because their image is missing or undecodable."""
        return [{"id": int(self.ids[p]), "image": self.files[p], "reason": r} for p, r in sorted(self.bad.items())]

    def mark_bad(self, positions: list[int], reasons: list[str]) -> None:
        """Skip (or, ``on_bad_image="error"``, refuse) the files at ``positions``, each for its reason. The first
        ``NAMED_BAD`` are logged one by one, the others counted by ``skipped``.

        Raises:
            ValueError: ``on_bad_image="error"``, or every file is now bad (the count, the first and its reason).
        """
        for p, reason in zip(positions, reasons, strict=True):
            if self.on_bad_image == "error":
                again = f" and re-run {PREPARE}" if self.prepared else ""
                raise ValueError(
                    f"{self.files[p]}: {reason}. Fix or remove it{again}, or pass "
                    f"{setting('on_bad_image', value='skip')}"
                )
            if len(self.bad) < NAMED_BAD:
                log.warning("skipping %s (sample id %d): %s", self.files[p], self.ids[p], reason)
            elif len(self.bad) == NAMED_BAD:
                counted = said("a training run lists train images in skipped.jsonl", "loader.skipped lists them")
                log.warning("skipping more missing or undecodable images without naming each (%s)", counted)
            self.bad[p] = reason
        if len(self.bad) == len(self.files):
            first = min(self.bad)
            if self.instead:
                where = f"; {self.instead}"
            elif self.prepared:
                where = (
                    "; a prepared dataset's rows name its images where they were when it was prepared: if they "
                    "moved, prepare it again"
                )
            else:
                where = ""
            raise ValueError(
                f"every image is missing or undecodable ({len(self.files)} of them; the first, "
                f"{self.files[first]}: {self.bad[first]}){where}; nothing to load"
            )

    def check_all(self) -> None:
        """The start-up check (``verify_files``): ``watch`` every file now."""
        self.watch(np.arange(len(self.files)))

    def watch(self, positions: np.ndarray) -> list[int]:
        """Stat the files at ``positions`` (-1 = padding; repeats allowed) before DALI reads them; decode again
        those missing, not regular, empty, or changed (size, mtime) since they were last known good, and mark
        the bad ones (``on_bad_image``). A file with no baseline yet takes its stat as one.

        Returns:
            the positions whose file changed or went bad (a holder of their decoded images drops them).
        """
        stand_in = self.first_good_position()  # read for padding and skipped samples: watched too
        suspects = self._watch(np.append(positions, stand_in))
        while stand_in in self.bad:  # it went bad: the next one in its turn
            stand_in = self.first_good_position()
            suspects += [p for p in self._watch(np.array([stand_in])) if p not in suspects]
        return suspects

    def _watch(self, positions: np.ndarray) -> list[int]:
        todo = np.unique(positions[positions >= 0])
        if self.bad:
            todo = todo[~np.isin(todo, np.fromiter(self.bad, dtype=np.int64))]
        now = stat_files([self.files[p] for p in todo.tolist()])  # (n, 2); -1: not a regular file
        known = self._known[todo]
        fresh = known[:, 0] == _UNKNOWN
        suspect = (now[:, 0] <= 0) | (~fresh & (now != known).any(axis=1))
        self._known[todo[fresh & ~suspect]] = now[fresh & ~suspect]
        over = self._check_budget(todo[fresh & ~suspect].tolist())
        suspects = todo[suspect].tolist()
        if suspects:
            log.info("%d image file(s) missing or changed since they were checked: checking them", len(suspects))
            self._check(suspects)
            good = [p for p in suspects if p not in self.bad]
            self._known[good] = stat_files([self.files[p] for p in good])
        return suspects + over

    def _check_budget(self, positions: list[int]) -> list[int]:
        """Files seen for the first time (nobody validated them: a drop-in's) over the decoded-pixel budget, read
        from their headers, are bad: one small PNG can declare a 600 MP image. Returns their positions."""
        reasons = [pixel_budget_reason(self.files[p], self.max_pixels) for p in positions]  # threads: no faster
        over = [(p, r) for p, r in zip(positions, reasons, strict=True) if r]
        if over:
            self.mark_bad(*map(list, zip(*over, strict=True)))
        return [p for p, _ in over]

    def check_window(self, positions: np.ndarray) -> bool:
        """After DALI failed: check the not yet known-bad files at ``positions`` (-1 = padding); True when
        one of them is bad (and now marked), False when none is to blame. The stand-in file is checked too:
        without the start-up check nobody has looked at it yet."""
        todo = list(dict.fromkeys(int(p) for p in positions if p >= 0 and p not in self.bad))
        if self.first_good_position() not in todo:
            todo.append(self.first_good_position())
        return self._check(todo)

    def _check(self, positions: list[int]) -> bool:
        checks = check_images([self.files[p] for p in positions], self.num_threads, max_pixels=self.max_pixels)
        bad = [(p, c.reason) for p, c in zip(positions, checks, strict=True) if not c.ok]
        if bad:
            self.mark_bad(*map(list, zip(*bad, strict=True)))
        return bool(bad)

    def first_good_position(self) -> int:
        """The file that stands in for padding and skipped samples (their ids are -1): the first not known bad.
        Watched before each read like the others; if it still fails, the recovery marks it and picks the next."""
        return next(p for p in range(len(self.files)) if p not in self.bad)

    def reader_list(self, positions: np.ndarray) -> tuple[list[str], list[int]]:
        """(files, sample ids) the file reader reads for ``positions``: padding (-1) and bad files replaced
        by the ``first_good_position()`` file with id ``PAD_ID``."""
        pad = self.dali_files[self.first_good_position()]
        bad, names = self.bad, self.dali_files
        files = [names[p] if p >= 0 and p not in bad else pad for p in positions]
        ids = [int(self.ids[p]) if p >= 0 and p not in bad else PAD_ID for p in positions]
        return files, ids


def stat_files(paths: list[str]) -> np.ndarray:
    """(n, 2) int64 (size, mtime_ns) of each path; (-1, -1) for one that is missing or not a regular file.

    Many paths: ``_STAT_PROBE`` of them, spread over the list (a mix's sources may lie on several file systems),
    are stat'ed in turn and timed first. On a network file system (a stat slower than ``_STAT_SLOW_S``) all go to
    16 threads, which overlap its round trips (os.stat releases the GIL). On a local one threads only add
    switching, so they are stat'ed in turn."""

    def one(path: str) -> tuple[int, int]:
        try:
            st = os.stat(path)
        except (OSError, ValueError):  # ValueError: a NUL in the name
            return _UNKNOWN, _UNKNOWN
        return (st.st_size, st.st_mtime_ns) if stat.S_ISREG(st.st_mode) else (_UNKNOWN, _UNKNOWN)

    if len(paths) < _STAT_THREADS_FROM:
        rows = [one(p) for p in paths]
    else:
        probe = paths[:: -(-len(paths) // _STAT_PROBE)]
        t0 = time.perf_counter()
        for p in probe:
            one(p)
        if time.perf_counter() - t0 < _STAT_SLOW_S * len(probe):
            rows = [one(p) for p in paths]
        else:
            with ThreadPoolExecutor(16) as pool:
                rows = list(pool.map(one, paths))
    return np.array(rows, dtype=np.int64).reshape(len(paths), 2)


def _utf8(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
