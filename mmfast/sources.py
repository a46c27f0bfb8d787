"""Image sources: where a loader's DALI reader takes the encoded images from, one class per kind, registered
by name in ``SOURCES``. Adding a source is a class here (and its reader in ``pipelines/image.py``).

A source says what differs between readers, so the loader never branches on the kind:
- the reader's arguments of ``image_pipeline`` (``reader_kwargs``);
- ``ordered_by_loader``: the loader's seeded, sharded, resumable positions decide what is read (True), or
  the reader shards and shuffles itself, one epoch per DALI reader epoch (False);
- ``can_skip_bad``: a bad sample can be found and replaced at run time;
- ``needs_paths``: the reader opens each sample's own file (so a loader needs the rows' image paths);
- ``samples_per_shard``: the per-process length when the reader shards itself.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from mmfast.file_health import FileHealth


class FilesSource:
    """Image files, read in the order of the loader's positions (DALI's file reader, no shuffling)."""

    name = "files"
    ordered_by_loader = True
    can_skip_bad = True
    needs_paths = True

    def reader_kwargs(
        self, positions: np.ndarray, health: FileHealth, shard_id: int, num_shards: int, shuffle: bool
    ) -> dict:
        files, ids = health.reader_list(positions)
        return {"source": "files", "files": files, "ids": ids}

    def samples_per_shard(self, n: int, num_shards: int) -> int | None:
        return None  # the loader's sampling decides

    def read_error(self, error: RuntimeError) -> RuntimeError | None:
        return None  # the loader looks for the file to blame


class WdsSource:
    """WebDataset tars read through mmfast's index files (``mmfast.inputs.wds``); DALI shards and shuffles
    them (a shuffle buffer that runs on across epochs), and the samples were checked when they were indexed.

    Args:
        tars: the shards.
        index: the index file of each (default: the ``.idx`` beside each tar).

    Raises:
        FileNotFoundError: a shard or its index is missing.
    """

    name = "wds"
    ordered_by_loader = False
    can_skip_bad = False
    needs_paths = False

    def __init__(self, tars: list[str], index: list[str] | None = None):
        self.tars = [str(t) for t in tars]
        self.index = [str(i) for i in index] if index else [str(Path(t).with_suffix(".idx")) for t in self.tars]
        for tar, idx in zip(self.tars, self.index, strict=True):
            if not Path(tar).is_file() or not Path(idx).is_file():
                raise FileNotFoundError(
                    f"{tar}: WebDataset shard or its index {idx} missing; re-run tools/prepare_data.py"
                )

    def reader_kwargs(
        self, positions: np.ndarray | None, health: FileHealth, shard_id: int, num_shards: int, shuffle: bool
    ) -> dict:
        return {
            "source": "wds",
            "wds_paths": self.tars,
            "wds_index_paths": self.index,
            "wds_shard_id": shard_id,
            "wds_num_shards": num_shards,
            "wds_shuffle": shuffle,
        }

    def samples_per_shard(self, n: int, num_shards: int) -> int:
        return math.ceil(n / num_shards)  # DALI pads every shard to the largest

    def read_error(self, error: RuntimeError) -> RuntimeError:
        return RuntimeError(
            f"DALI failed reading the WebDataset shards ({error}); re-run tools/prepare_data.py (a shard "
            "may have changed since it was indexed)"
        )


SOURCES = {"files": FilesSource, "wds": WdsSource}
Source = FilesSource | WdsSource  # what a loader reads through


def check_source_name(name: str) -> str:
    """``name`` if it is a registered source, else a ValueError listing them."""
    if name not in SOURCES:
        raise ValueError(f"unknown source '{name}'; choose from {', '.join(repr(k) for k in SOURCES)}")
    return name
