"""``MultimodalLoader``: one split of a prepared dataset, its DALI images joined with its cached tokens by
sample id (the training engine's loader)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import torch

from mmfast.data.dataset import PreparedDataset
from mmfast.data.token_cache import TokenCache
from mmfast.loading.image_loader import IGNORE_LABEL, ImageLoader


class MultimodalLoader(ImageLoader):
    """One split of a prepared dataset: DALI images joined with cached tokens by sample id.

    Batches: ``{"image": (B, 3, S, S), "input_ids": (B, L), "attention_mask": (B, L), "label": (B,),
    "id": (B,)}`` on the training device, L = the longest caption in the batch. Padding samples of the
    last eval batch have id -1, label -100 and an all-zero attention mask.

    Args:
        data_dir: a directory written by tools/prepare_data.py, or a ``PreparedDataset`` of one.
        split: "train" or "val".
        batch_size: per process, as in Accelerate.
        shuffle, drop_last, train: default True for "train", False otherwise.
        accelerator: take shard_id / num_shards / device from an ``accelerate.Accelerator``.
        source: "files" (the split's image files) or "wds" (its WebDataset shards, see ``prepare.wds_export``); a
            dataset prepared from WebDataset shards is always read from them.
        verify_files: also check every image file at start-up (see ``ImageLoader``: each batch's files are
            compared with what preparation recorded just before they are read anyway); default off.
        **kwargs: the rest of ``ImageLoader``'s arguments (default dtype here: float16; ``cache_decoded``:
            False).

    Unlike ``ImageLoader``, it keeps whole batches and its own sampling (see ``mmfast.loading.image_loader``): the
    training engine relies on both.
    """

    _default_dtype = torch.float16
    _dataloader_sampling = False
    _files_checked = True  # preparation decoded every image: DALI runs whole batches (``_safe_part``)

    def __init__(
        self,
        data_dir: str | os.PathLike | PreparedDataset,
        split: str = "train",
        batch_size: int = 64,
        *,
        shuffle: bool | None = None,
        drop_last: bool | None = None,
        accelerator=None,
        source: str = "files",
        **kwargs,
    ):
        # Opening verifies every file of the directory against prepare.json (pass a PreparedDataset to
        # share one verification between the train and val loaders).
        if kwargs.get("as_dict") is False:
            raise ValueError("MultimodalLoader's batches are always dicts (as_dict=False is ImageLoader's)")
        dataset = data_dir if isinstance(data_dir, PreparedDataset) else PreparedDataset(data_dir)
        if accelerator is not None:
            kwargs.setdefault("shard_id", accelerator.process_index)
            kwargs.setdefault("num_shards", accelerator.num_processes)
            kwargs.setdefault("device", accelerator.device)
        kwargs["image_source"] = reader = dataset.source_for(split, source)
        # A source that reads the rows' own files needs each row's path; a WebDataset only ids and labels.
        table = dataset.table(split, images=reader.needs_paths)
        n = len(table.ids)
        if not n:
            raise ValueError(f"{dataset.root / (split + '.jsonl')}: split '{split}' is empty")
        # the samples of a WebDataset are named by the index: one shared string stands for every file
        images = (
            table.images if table.images is not None else [str(dataset.root / "wds" / f"{split}.rows.npy")] * n
        )
        is_train = split == "train"
        kwargs.setdefault("max_pixels", dataset.max_pixels)
        kwargs.setdefault("cache_decoded", False)  # the training engine plans it from the recorded sizes
        if table.file_stats is not None:
            kwargs.setdefault("file_stats", table.file_stats)
        super().__init__(
            images,
            table.labels,
            ids=table.ids,
            batch_size=batch_size,
            shuffle=is_train if shuffle is None else shuffle,
            drop_last=is_train if drop_last is None else drop_last,
            **kwargs,
        )
        self.dataset = dataset
        self.tokens = TokenCache(dataset.tokens_dir, split)
        if len(self.tokens) != n or self.tokens.first_id != table.ids[0]:
            raise ValueError(
                f"token cache {dataset.tokens_dir}/{split} (rows {len(self.tokens)}, first id "
                f"{self.tokens.first_id}) does not match {split}.jsonl (rows {n}, first id "
                f"{table.ids[0]}); re-run tools/prepare_data.py"
            )
        self.num_classes = dataset.num_classes

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for images, ids, pos, _ in self._batches():
            labels = np.where(pos >= 0, self.labels[pos], IGNORE_LABEL)
            text = self.tokens.gather(ids)  # pinned on CUDA machines, so the copies below are asynchronous
            if images.dtype != self.dtype:  # bfloat16 from a graph that emits float32
                images = images.to(self.dtype)
            if self._pin:
                images = images.pin_memory()
            yield {
                "image": images.to(self.device, non_blocking=True),
                "input_ids": text["input_ids"].to(self.device, non_blocking=True),
                "attention_mask": text["attention_mask"].to(self.device, non_blocking=True),
                "label": torch.from_numpy(labels).to(self.device, non_blocking=True),
                "id": torch.from_numpy(ids).to(self.device, non_blocking=True),
            }
