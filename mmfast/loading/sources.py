"""Image sources: where a loader's DALI reader takes the encoded images from, one class per kind with its own
reader, named in ``options.SOURCES``. Adding a source is a class and its reader here and its line there: the
processing after the reader (``mmfast/loading/graphs.py``) is shared by all of them.

A source says what differs between readers, so the loader never branches on the kind:
- the reader that ``image_pipeline`` starts from (``reader``: a callable building the DALI reader's nodes);
- ``ordered_by_loader``: the loader's seeded, sharded, resumable positions decide what is read (True), or
  the reader shards and shuffles itself, one epoch per DALI reader epoch (False);
- ``can_skip_bad``: a bad sample can be found and replaced at run time;
- ``needs_paths``: the reader opens each sample's own file (so a loader needs the rows' image paths);
- ``samples_per_shard``: the per-process length when the reader shards itself;
- ``reader_name``: the DALI reader the iterator counts an epoch by (None: an external source that ends itself).

The streaming source (shards member by member, local or remote through a cache) is
``mmfast.loading.stream_source.StreamSource``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from nvidia.dali import fn, types

from mmfast.data.dataset import WDS_DIR, WDS_ID_DIGITS, WDS_IMAGE_EXT, wds_checks, wds_split
from mmfast.loading.graphs import READER_NAME
from mmfast.loading.options import SOURCES
from mmfast.loading.stream_source import StreamSource
from mmfast.remote.objects import is_remote
from mmfast.util.commands import PREPARE
from mmfast.util.voice import setting

if TYPE_CHECKING:
    from mmfast.loading.file_health import FileHealth
    from mmfast.remote.shard_cache import ShardCache


def read_files(files: list[str], ids: list[int]):
    """The file source's reader: ``files`` read in the given order, labelled with their sample ``ids``.

    Returns:
        encoded images (B,) and sample ids (B, 1) int32.
    """
    return fn.readers.file(files=files, labels=ids, random_shuffle=False, name=READER_NAME)


def read_wds(tars: list[str], index: list[str], shard_id: int = 0, num_shards: int = 1, shuffle: bool = False):
    """The WebDataset source's reader: tars read through mmfast's index files, whose image names end with the
    sample id (``mmfast.inputs.wds``); DALI shards them and, with ``shuffle``, shuffles (a buffer).

    Returns:
        encoded images (B,) and sample ids (B, 1) int32.
    """
    encoded = fn.readers.webdataset(
        paths=tars,
        index_paths=index,
        ext=[WDS_IMAGE_EXT],
        dtypes=[types.UINT8],
        missing_component_behavior="error",
        shard_id=shard_id,
        num_shards=num_shards,
        random_shuffle=shuffle,
        pad_last_batch=True,
        name=READER_NAME,
    )
    encoded = encoded[0] if isinstance(encoded, list | tuple) else encoded
    return encoded, _wds_sample_ids(encoded)


def _wds_sample_ids(encoded):
    """(1,) int32 sample id of each WebDataset image: the last ``WDS_ID_DIGITS`` characters of its source_info
    ("<tar>:<offset>:<name>"), which mmfast's index files end with the id (``mmfast.inputs.wds``). Read in
    the graph, so the ids come out as a dense tensor like the file reader's labels."""
    info = fn.get_property(encoded, key="source_info")  # (len,) uint8: the characters
    digits = fn.cast(info[-WDS_ID_DIGITS:], dtype=types.INT64) - ord("0")
    weights = types.Constant(np.array([10**k for k in range(WDS_ID_DIGITS - 1, -1, -1)], dtype=np.int64))
    return fn.cast(fn.reductions.sum(digits * weights, axes=0, keep_dims=True), dtype=types.INT32)


class FilesSource:
    """Image files, read in the order of the loader's positions (DALI's file reader, no shuffling).

    Args:
        instead: where else the images can be read, said when every file is missing ("": nowhere).
    """

    name = "files"
    reader_name = READER_NAME  # what DALI's iterator counts the epoch by
    ordered_by_loader = True
    can_skip_bad = True
    needs_paths = True

    def __init__(self, instead: str = ""):
        self.instead = instead

    def reader(
        self, positions: np.ndarray, health: FileHealth, shard_id: int, num_shards: int, shuffle: bool
    ) -> Callable[[], tuple]:
        files, ids = health.reader_list(positions)
        return functools.partial(read_files, files, ids)

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
    reader_name = READER_NAME
    ordered_by_loader = False
    can_skip_bad = False
    needs_paths = False

    def __init__(self, tars: list[str], index: list[str] | None = None):
        self.tars = [str(t) for t in tars]
        self.index = [str(i) for i in index] if index else [str(Path(t).with_suffix(".idx")) for t in self.tars]
        for tar, idx in zip(self.tars, self.index, strict=True):
            if not Path(tar).is_file() or not Path(idx).is_file():
                raise FileNotFoundError(f"{tar}: WebDataset shard or its index {idx} missing; re-run {PREPARE}")

    def reader(
        self, positions: np.ndarray | None, health: FileHealth, shard_id: int, num_shards: int, shuffle: bool
    ) -> Callable[[], tuple]:
        return functools.partial(read_wds, self.tars, self.index, shard_id, num_shards, shuffle)

    def samples_per_shard(self, n: int, num_shards: int) -> int:
        return math.ceil(n / num_shards)  # DALI pads every shard to the largest

    def read_error(self, error: RuntimeError) -> RuntimeError:
        return RuntimeError(
            f"DALI failed reading the WebDataset shards ({error}); re-run {PREPARE} (a shard "
            "may have changed since it was indexed)"
        )


Source = FilesSource | WdsSource | StreamSource  # what a loader reads through


def check_source_name(name: str) -> str:
    """``name`` if it is a registered source, else a ValueError listing them."""
    if name not in SOURCES:
        raise ValueError(f"unknown source '{name}'; choose from {', '.join(repr(k) for k in SOURCES)}")
    return name


def prepared_source(dataset, split: str, kind: str = "files", cache: ShardCache | None = None) -> Source:
    """The image source a loader of ``split`` of a ``PreparedDataset`` reads: ``choose_source``'s kind, streamed
    when the shards are remote (through ``cache``).

    Raises:
        ValueError: an unknown kind, or remote shards and no cache. FileNotFoundError: the split has no
        WebDataset shards.
    """
    kind = choose_source(dataset, kind)[0]
    if kind == "files":  # where every file is gone, the error says where else the images are
        shards = f"the dataset's WebDataset shards hold them: pass {setting('source', value='wds')}"
        return FilesSource(shards if _shards_hold(dataset, split) else "")
    tars, index = wds_split(dataset.root, split)
    if kind == "stream" or any(is_remote(t) for t in tars):
        return StreamSource(tars, index, wds_checks(dataset.root, split), cache)
    return WdsSource(tars, index)


def choose_source(dataset, kind: str = "files") -> tuple[str, str]:
    """The source kind a ``PreparedDataset``'s splits are read by, and why when it is not the one asked for:
    "files" on a dataset prepared from WebDataset shards reads the shards, its images' only home. The choice
    depends on the prepared directory alone, so every split and every process of a run makes the same one.

    Returns:
        (kind, why): why is "" unless the kind differs from the one asked for (one line to say).

    Raises:
        ValueError: an unknown kind.
    """
    kind = check_source_name(kind)
    if kind == "files" and dataset.summary.get("input_kind") == "wds":
        return "wds", f"read from the WebDataset shards {dataset.root} was prepared from (it has no image files)"
    return kind, ""


def _shards_hold(dataset, split: str) -> bool:
    """Whether the dataset has WebDataset shards of ``split`` (``mmfast-prepare --format wds``)."""
    return (Path(dataset.root) / WDS_DIR / f"{split}.json").is_file()
