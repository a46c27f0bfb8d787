"""File health: which of a loader's image files are missing or undecodable, found when DALI fails on one (or,
when asked, by a start-up check), and what stands in for them in the reader's list.

Why at run time by default: stat'ing every file at start-up costs a long start on a large split (a
million rows: minutes on a network file system), while a file that breaks after preparation is rare. DALI
aborts the whole pipeline on a file it cannot read; the loader then checks the files of the next few
batches (the "recovery window"), marks the bad ones and reopens the stream at the same position.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import numpy as np

from mmfast.validate import check_images

log = logging.getLogger(__name__)
PAD_ID = -1  # sample id of the padding entries that fill the last eval batch; their label is IGNORE_LABEL
ON_BAD_IMAGE = ("skip", "error")  # the choices of on_bad_image


class FileHealth:
    """The bad files among ``files`` (by position) and why each is bad.

    Args:
        files: the loader's image paths.
        ids: their sample ids.
        on_bad_image: "skip" (log it and serve a masked stand-in) or "error" (raise, naming the file).
        max_pixels: decoded-pixel budget per image checked at start-up (one over it is a bad image).
        num_threads: threads decoding the files that are checked.
    """

    def __init__(self, files: list[str], ids: np.ndarray, on_bad_image: str, max_pixels: int, num_threads: int):
        if on_bad_image not in ON_BAD_IMAGE:
            raise ValueError(f"on_bad_image must be {' or '.join(map(repr, ON_BAD_IMAGE))}, got '{on_bad_image}'")
        self.files, self.ids = files, ids
        self.on_bad_image = on_bad_image
        self.max_pixels = max_pixels
        self.num_threads = num_threads
        self.bad: dict[int, str] = {}  # position in files -> why it is skipped
        self.prepared = False  # the files come from a prepared directory (its tool is named in errors)

    @property
    def skipped(self) -> list[dict]:
        """The samples served masked because their image is missing or undecodable."""
        return [{"id": int(self.ids[p]), "image": self.files[p], "reason": r} for p, r in sorted(self.bad.items())]

    def mark_bad(self, positions: list[int], reasons: list[str]) -> None:
        for p, reason in zip(positions, reasons, strict=True):
            if self.on_bad_image == "error":
                again = " and re-run tools/prepare_data.py" if self.prepared else ""
                raise ValueError(
                    f"{self.files[p]}: {reason}. Fix or remove it{again}, or pass on_bad_image='skip'"
                )
            log.warning("skipping %s (sample id %d): %s", self.files[p], self.ids[p], reason)
            self.bad[p] = reason
        if len(self.bad) == len(self.files):
            raise ValueError("every image is missing or undecodable; nothing to load")

    def check_all(self, file_stats: Sequence[tuple[int, int]] | None) -> None:
        """The start-up check (``verify_files``): stat every file; decode again the ones that are missing,
        empty, or changed (size, mtime) since they were validated."""
        suspects = []
        for p, path in enumerate(self.files):
            try:
                st = os.stat(path)
            except OSError:
                suspects.append(p)
                continue
            if file_stats is not None and (st.st_size, st.st_mtime_ns) != tuple(file_stats[p]):
                suspects.append(p)
            elif st.st_size == 0:
                suspects.append(p)
        if suspects:
            self._check(suspects, max_pixels=self.max_pixels)

    def check_window(self, positions: np.ndarray) -> bool:
        """After DALI failed: check the not yet known-bad files at ``positions`` (-1 = padding); True when
        one of them is bad (and now marked), False when none is to blame. The stand-in file is checked too:
        without the start-up check nobody has looked at it yet."""
        todo = list(dict.fromkeys(int(p) for p in positions if p >= 0 and p not in self.bad))
        if self.first_good_position() not in todo:
            todo.append(self.first_good_position())
        return self._check(todo)

    def _check(self, positions: list[int], **limits) -> bool:
        checks = check_images([self.files[p] for p in positions], self.num_threads, **limits)
        bad = [(p, c.reason) for p, c in zip(positions, checks, strict=True) if not c.ok]
        if bad:
            self.mark_bad(*map(list, zip(*bad, strict=True)))
        return bool(bad)

    def first_good(self) -> str:
        """A file to stand in for padding and skipped samples (their ids are -1). Without the start-up check
        it may be bad too: then DALI fails on it, and the recovery marks it and picks the next one."""
        return self.files[self.first_good_position()]

    def first_good_position(self) -> int:
        return next(p for p in range(len(self.files)) if p not in self.bad)

    def reader_list(self, positions: np.ndarray) -> tuple[list[str], list[int]]:
        """(files, sample ids) the file reader reads for ``positions``: padding (-1) and bad files replaced
        by ``first_good()`` with id ``PAD_ID``."""
        pad = self.first_good()
        bad = self.bad
        files = [self.files[p] if p >= 0 and p not in bad else pad for p in positions]
        ids = [int(self.ids[p]) if p >= 0 and p not in bad else PAD_ID for p in positions]
        return files, ids
