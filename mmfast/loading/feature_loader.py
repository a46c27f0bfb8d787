"""``FeatureLoader``: a split served from a feature cache (``mmfast.data.feature_cache``) instead of pixels.

It has the batches of the ``MultimodalLoader`` it is built on (the same whole-batch order of each epoch, the same
sample ids on every process, the same tokens, or a locked text tower's cached ``text_features`` in their place, or
beside them its locked lower layers' cached output ``text_hidden``), with ``image_features`` (B, C) float32 in
place of ``image``: epoch e reads stored view e mod K, the pixels that loader's epoch e mod K would decode (the val
split: its centre view, every epoch). Nothing is decoded and no DALI pipeline runs. Its position (epoch, step) is
the image loader's, so a checkpoint of either resumes in the other. A sample whose image the cache's build could
not read (the cache's ``absent``) is served masked, with id -1 and no label, as the image loader serves it.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from mmfast.data.batch import IGNORE_LABEL
from mmfast.data.feature_cache import FeatureCache
from mmfast.loading.multimodal import MultimodalLoader


class FeatureLoader:
    """The epochs of ``loader`` (never iterated itself) with each sample's cached features.

    Args:
        loader: the split's loader, as the run built it (order, batch, shards, tokens, device).
        features: the split's cache; it must hold every sample id of ``loader``.
        centre: serve the centre view every epoch (what evaluation's crop sees: the ridge start's pass).
        text: the split's cache of the locked text tower's features (one per caption): batches carry
            ``text_features`` (B, D_txt) float32 in place of ``input_ids`` / ``attention_mask``. A cache of the
            locked lower layers' output (its parts name the stored token ``length``): batches carry the tokens
            and ``text_hidden`` (B, T, D_txt) float32, cut or zero-padded to the batch's T tokens.
    """

    def __init__(
        self,
        loader: MultimodalLoader,
        features: FeatureCache,
        centre: bool = False,
        text: FeatureCache | None = None,
    ):
        for cache in (features, text) if text is not None else (features,):
            missing = np.setdiff1d(np.asarray(loader.ids), cache.ids)
            if len(missing):
                raise ValueError(
                    f"the feature cache {cache.dir} lacks {len(missing)} sample ids of the split "
                    f"(first: {int(missing[0])})"
                )
        self.loader, self.features, self.centre, self.text = loader, features, centre, text
        # the positions of the samples whose image could not be read: served masked
        self._absent = np.isin(np.asarray(loader.ids), np.fromiter(features.absent, np.int64))
        self.text_length = (text.meta["parts"].get("tokens") or {}).get("length") if text is not None else None
        self.dataset = loader.dataset
        self.epoch, self.step, self._restored = 0, 0, False  # _restored: a position load_state_dict set

    # what the engine and the run read of a loader: the image loader's layout, this loader's position
    batch_size = property(lambda self: self.loader.batch_size)
    num_shards = property(lambda self: self.loader.num_shards)
    shard_id = property(lambda self: self.loader.shard_id)
    device = property(lambda self: self.loader.device)
    ids = property(lambda self: self.loader.ids)
    num_threads = property(lambda self: self.loader.num_threads)  # the image loader's, for a profile's settings
    prefetch = property(lambda self: self.loader.prefetch)
    text_padding = property(lambda self: self.loader.text_padding)

    @property
    def bad(self) -> dict[int, str]:
        """Position -> why, of the samples served masked because the cache's build could not read their image
        (the image loader's ``bad``)."""
        ids = np.asarray(self.loader.ids)
        return {int(p): self.features.absent[int(ids[p])]["reason"] for p in np.flatnonzero(self._absent)}

    @property
    def skipped(self) -> list[dict]:
        """Those samples' {"id", "image", "reason"} (the image loader's ``skipped``)."""
        ids = np.asarray(self.loader.ids)
        entries = [self.features.absent[int(ids[p])] for p in np.flatnonzero(self._absent)]
        return [{k: e[k] for k in ("id", "image", "reason")} for e in entries]

    holds_decoded = False
    cached_bytes = 0

    def __len__(self) -> int:
        return len(self.loader)

    def _hidden(self, ids: np.ndarray, tokens: int) -> torch.Tensor:
        """(B, ``tokens``, D_txt) of the cached lower layers' output: its stored length cut or zero-padded (the
        tokens past a caption's end are masked in every layer and in the pooling)."""
        stored = self.text.gather(ids, None)  # (B, length x D_txt)
        hidden = stored.reshape(len(ids), self.text_length, -1)[:, :tokens]
        return torch.nn.functional.pad(hidden, (0, 0, 0, tokens - hidden.shape[1]))

    def view(self, epoch: int) -> int | None:
        """The stored view epoch ``epoch`` reads (None: the centre view)."""
        return None if self.centre else epoch % self.features.views

    def set_epoch(self, epoch: int) -> None:
        """As the engine's whole-batch loaders do: another epoch starts at its first batch, the current one
        keeps its position (a resumed one)."""
        if epoch != self.epoch:
            self.epoch, self.step = epoch, 0

    def state_dict(self) -> dict:
        """The position for an exact resume, in the keys the image loader's state uses."""
        images = self.loader.images
        return {
            "epoch": self.epoch,
            "step": self.step,
            "seed": images.seed,
            "num_samples": len(images.files),
            "num_shards": self.num_shards,
            "batch_size": self.batch_size,
            "shard_id": self.shard_id,
        }

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "num_samples", "num_shards", "batch_size"):
            if key in state and state[key] != self.state_dict()[key]:
                raise ValueError(f"cannot resume loader: {key} was {state[key]}, now {self.state_dict()[key]}")
        self.epoch, self.step, self._restored = int(state["epoch"]), int(state["step"]), True

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        if self._restored:  # the rest of a resumed epoch (none, when it was saved after the last batch)
            self._restored = False
        elif self.step >= len(self):  # the last batch was taken, but the loop never asked for more
            self.epoch, self.step = self.epoch + 1, 0
        return self._epoch()

    def _epoch(self) -> Iterator[dict[str, torch.Tensor]]:
        mm, b = self.loader, self.batch_size
        positions = mm.images.positions(self.epoch)  # (batches x B,) whole batches, -1 for padding
        all_ids, labels_of = np.asarray(mm.ids), np.asarray(mm.labels)
        view = self.view(self.epoch)
        while self.step < len(self):
            pos = positions[self.step * b : (self.step + 1) * b]
            pos = np.where(self._absent[np.maximum(pos, 0)], -1, pos)  # an unreadable image: masked
            ids = np.where(pos >= 0, all_ids[np.maximum(pos, 0)], -1)
            labels = np.where(pos >= 0, labels_of[np.maximum(pos, 0)], IGNORE_LABEL)
            batch = {"image_features": self.features.gather(ids, view).to(self.device)}
            if self.text is not None and self.text_length is None:  # the locked text tower's output: no tokens
                batch["text_features"] = self.text.gather(ids, None).to(self.device)
            else:
                text = mm.tokens.gather(ids, mm.text_padding)
                batch["input_ids"] = text["input_ids"].to(self.device)
                batch["attention_mask"] = text["attention_mask"].to(self.device)
                if self.text is not None:
                    batch["text_hidden"] = self._hidden(ids, text["input_ids"].shape[1]).to(self.device)
            batch["label"] = torch.from_numpy(labels).to(self.device)
            batch["id"] = torch.from_numpy(ids).to(self.device)
            if mm.sources is not None:  # a mix: each sample's source (-1 for a masked one)
                source = np.where(pos >= 0, mm.sources[np.maximum(pos, 0)], -1)
                batch["source"] = torch.from_numpy(source).to(self.device)
            self.step += 1
            yield batch
        self.epoch, self.step = self.epoch + 1, 0
