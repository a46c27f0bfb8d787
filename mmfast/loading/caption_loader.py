"""``CaptionLoader``: captioned pictures as a CLIP trainer's DataLoader yields them, ``(images, texts)``, from
the user's table (CSV / TSV / JSONL) or lists, the user's tokenizer and the user's preprocess.

It holds an ``ImageLoader`` (DALI decodes and crops; ``transforms.options_from_transform`` turns the preprocess
into its arguments) and the captions tokenized once (``data.caption_tokens``), joined by row id. Three things
a contrastive loop needs of it, and the plain ``ImageLoader`` does not give:

- No placeholders. A picture that cannot be read is skipped, and the next good sample takes its place
  (``_Compactor``): a batch holds only true pairs. With ``drop_last`` every epoch still has ``len(loader)``
  batches of ``batch_size`` on every process (the end is filled with repeats of the batch before), so DDP
  processes step together.
- Ready batches. The host finishing, the join and the pinning run on a thread of their own
  (``prefetch.Prefetcher``): the training thread takes finished batches, as from DataLoader's workers.
- A decoded cache only for epochs that read the pictures again (``_cache_setting``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch

from mmfast.data.caption_tokens import CaptionTokens, tokenize_captions
from mmfast.data.captions import read_captioned
from mmfast.data.validate import DEFAULT_MAX_PIXELS
from mmfast.loading.epoch_reader import refuse_forked
from mmfast.loading.image_loader import ImageLoader
from mmfast.loading.prefetch import Prefetcher
from mmfast.loading.transforms import agree_with_transform, options_from_transform

log = logging.getLogger(__name__)
ON_BAD_IMAGE = ("skip", "error")


class _ImagesTexts(NamedTuple):
    images: torch.Tensor  # (B, 3, S, S) normalized
    texts: torch.Tensor  # (B, L) token ids, as the tokenizer gives them


class Pairs(_ImagesTexts):
    """A ``CaptionLoader`` batch: ``(images, texts)``, what open_clip's trainer unpacks; ``ids`` (B,) int64
    holds each pair's row id in the table (read it before a helper rebuilds the tuple)."""

    @classmethod
    def of(cls, images, texts, ids) -> Pairs:
        batch = cls(images, texts)
        batch.ids = ids
        return batch


class CaptionLoader:
    """A DataLoader of captioned pictures for a CLIP trainer: DALI's images joined with pre-tokenized captions.

    Batches are ``Pairs`` tuples ``(images (B, 3, S, S), texts (B, L))`` (``as_dict=True``: ``{"image",
    "input_ids", "id"}``, plus ``"attention_mask"`` when the tokenizer gives one). ``len()``, ``num_batches``,
    ``num_samples``, ``batch_size``, ``set_epoch`` and a new epoch per ``iter()`` are DataLoader's.

    Args:
        images: a ``.csv`` / ``.tsv`` / ``.jsonl`` table of image paths and captions, or a list of paths.
        captions: with a list of paths, one caption per path.
        tokenizer: open_clip's (``open_clip.get_tokenizer(model)``), a Hugging Face tokenizer (slow or fast), or
            a callable from a list of captions to equal-length rows. Each caption is tokenized once.
        transform: the trainer's preprocess (a torchvision transform or open_clip's): its crop, resize
            (bilinear or bicubic), flip and normalization become the pipeline's; a step it cannot reproduce
            is an error naming it. Without one: ``size``, ``train`` and the image options.
        batch_size, shuffle, drop_last, seed, shard_id, num_shards, num_workers, device, dtype: as
            ``ImageLoader`` takes them (``num_workers``: DALI threads).
        context_length: the token rows' length (a Hugging Face tokenizer's default: its ``model_max_length``).
        token_cache: a folder keeping the token rows on disk for later runs (``data.caption_tokens``).
        image_key, caption_key, sep, root: how to read the table (``data.captions.read_captioned``).
        on_bad_image: "skip" (log it, count it in ``skipped``, and let the next good sample take its place)
            or "error" (raise, naming the file).
        epochs: how many epochs the run reads (None: unknown). The pictures are held decoded
            (``cache_decoded="auto"``) only for a run that reads them more than once: from the first epoch
            when ``epochs`` > 1, from the second when it is unknown, never when it is 1.
        cache_decoded: "auto" (the rule above), or ``ImageLoader``'s True / False / a budget in bytes.
        prefetch_batches: finished batches kept ready ahead of the training thread.
        as_dict: dict batches instead of tuples.
        **image_options: the rest of ``ImageLoader``'s arguments (``max_pixels``, ``pin_memory``, ``size``,
            ``train``, ``scale``, ``interpolation``, ...); one the transform also sets must agree with it.

    Bad pictures: without ``drop_last`` the last batch is shorter by the number skipped (and the epoch may have
    fewer than ``len()`` batches), so processes of a DDP evaluation may differ; evaluate on one process, or
    pass ``drop_last=True``.
    """

    def __init__(
        self,
        images: str | os.PathLike | Sequence[str],
        captions: Sequence[str] | None = None,
        *,
        tokenizer,
        transform=None,
        batch_size: int = 64,
        shuffle: bool = False,
        drop_last: bool = False,
        context_length: int | None = None,
        token_cache: str | os.PathLike | None = None,
        image_key: str | None = None,
        caption_key: str | None = None,
        sep: str | None = None,
        root: str | os.PathLike | None = None,
        on_bad_image: str = "skip",
        epochs: int | None = None,
        cache_decoded: bool | int | str = "auto",
        prefetch_batches: int = 2,
        as_dict: bool = False,
        max_pixels: int = DEFAULT_MAX_PIXELS,
        **image_options,
    ):
        if on_bad_image not in ON_BAD_IMAGE:
            raise ValueError(f"on_bad_image must be 'skip' or 'error', got {on_bad_image!r}")
        if epochs is not None and epochs < 1:
            raise ValueError(f"epochs must be >= 1 (or None: unknown), got {epochs}")
        rows = read_captioned(images, captions, image_key=image_key, caption_key=caption_key, sep=sep, root=root)
        self.files, self.captions = rows.files, rows.captions
        self.tokens: CaptionTokens = tokenize_captions(
            rows.captions, tokenizer, context_length=context_length, cache_dir=token_cache
        )
        if transform is not None:
            image_options = _with_transform(transform, image_options)
        self.batch_size, self.drop_last, self.as_dict = batch_size, drop_last, as_dict
        self.epochs, self.cache_decoded, self.prefetch_batches = epochs, cache_decoded, prefetch_batches
        self._settings = dict(
            batch_size=batch_size, shuffle=shuffle, drop_last=drop_last, on_bad_image=on_bad_image,
            max_pixels=max_pixels, **image_options,
        )  # fmt: skip
        self._epochs_done = 0  # epochs this loader has read to their end
        self._renewed = False  # the image loader was made anew for a second epoch (``_next_images``)
        self._skipped: dict[int, dict] = {}  # row id -> its entry, over every image loader used
        self.images = self._image_loader(self._cache_setting())
        self._prefetcher: Prefetcher | None = None
        self._pid = os.getpid()  # refuse_forked

    # -- what DataLoader code and open_clip's trainer read -----------------------------------------------
    def __len__(self) -> int:
        """Batches per epoch on this process (exact with ``drop_last``; an upper bound without)."""
        return len(self.images)

    @property
    def num_batches(self) -> int:
        return len(self)

    @property
    def num_samples(self) -> int:
        """Rows of the table (open_clip_train's ``num_samples``: the dataset's size)."""
        return len(self.files)

    epoch = property(lambda self: self.images.epoch, doc="The image loader's epoch (``ImageLoader.epoch``).")
    shard_id = property(lambda self: self.images.shard_id)
    num_shards = property(lambda self: self.images.num_shards)
    device = property(lambda self: self.images.device)

    @property
    def skipped(self) -> list[dict]:
        """Every sample skipped so far ({"id", "image", "reason"}), once each."""
        self._remember_skipped()
        return [self._skipped[k] for k in sorted(self._skipped)]

    def _remember_skipped(self) -> None:
        for entry in self.images.skipped:
            self._skipped.setdefault(entry["id"], entry)

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next ``iter()`` reads (its order and augmentation draws)."""
        self.images.set_epoch(epoch)

    def __reduce__(self):
        raise TypeError("CaptionLoader cannot be pickled or copied (it holds a live DALI pipeline)")

    # -- the epochs ----------------------------------------------------------------------------------------
    def _cache_setting(self) -> bool | int | str:
        """What the image loader of the next epoch does with decoded pictures: "auto" only for a run that
        reads them again (``epochs`` > 1, or an epoch after the first when it is unknown)."""
        if not (isinstance(self.cache_decoded, str) and self.cache_decoded == "auto"):
            return self.cache_decoded
        if self.epochs is not None:
            return "auto" if self.epochs > 1 else False
        return "auto" if self._epochs_done else False

    def _image_loader(self, cache_decoded) -> ImageLoader:
        return ImageLoader(self.files, as_dict=True, cache_decoded=cache_decoded, **self._settings)

    def _next_images(self) -> ImageLoader:
        """The image loader for the next epoch: a new one holding decoded pictures once a run of unknown
        length reads them a second time, at the epoch the old one was at."""
        setting = self._cache_setting()
        if self._renewed or not self._epochs_done or self.epochs is not None or setting is False:
            return self.images
        self._renewed, old = True, self.images
        self._remember_skipped()
        epoch = old.epoch + (1 if 0 < old.step < len(old) else 0)
        fresh = self._image_loader(setting)
        fresh.set_epoch(epoch)
        what = "holding decoded pictures" if fresh.holds_decoded else "streaming"
        log.info("CaptionLoader: a second epoch: %s", what)
        return fresh

    def __iter__(self) -> Iterator[Pairs | dict[str, torch.Tensor]]:
        """One epoch of batches, made ready on a thread of their own."""
        refuse_forked(self, self._pid)
        if self._prefetcher is not None:
            self._prefetcher.close()
        self.images = self._next_images()
        images = self.images
        self._prefetcher = Prefetcher(lambda: self._epoch(images), self.prefetch_batches, "mmfast-captions")
        return iter(self._prefetcher)

    def _epoch(self, images: ImageLoader) -> Iterator[Pairs | dict[str, torch.Tensor]]:
        """The batches of one epoch (on the prefetch thread)."""
        compactor = _Compactor(self.batch_size, len(images), self.drop_last)
        pin = images.pins_memory
        for batch in images:
            for out_images, ids in compactor.add(batch["image"], batch["id"]):
                yield self._pairs(out_images, ids, pin)
        for out_images, ids in compactor.finish():
            yield self._pairs(out_images, ids, pin)
        if compactor.holes:
            log.info(
                "CaptionLoader: %d picture(s) skipped in this epoch, the next good samples in their places "
                "(loader.skipped lists them)", compactor.holes,
            )  # fmt: skip
        self._epochs_done += 1

    def _pairs(self, images: torch.Tensor, ids: torch.Tensor, pin: bool) -> Pairs | dict[str, torch.Tensor]:
        """A batch of the images of rows ``ids`` and their captions' tokens, on the images' device."""
        rows = ids.cpu().numpy()
        texts, mask = self.tokens.gather(rows)
        device = images.device
        if pin:
            texts, mask = texts.pin_memory(), (mask.pin_memory() if mask is not None else None)
        texts = texts.to(device, non_blocking=True)
        if self.as_dict:
            out = {"image": images, "input_ids": texts, "id": ids}
            if mask is not None:
                out["attention_mask"] = mask.to(device, non_blocking=True)
            return out
        return Pairs.of(images, texts, ids)


def _with_transform(transform, options: dict) -> dict:
    """``options`` with what the transform says (an option given both ways must agree with it)."""
    found = options_from_transform(transform)
    merged = dict(options)
    for key, value in found.items():
        if key == "dtype":  # an output format: the caller's wins
            if merged.get("dtype") is None and merged.get("fp16") is None:
                merged["dtype"] = value
            continue
        merged[key] = agree_with_transform(key, merged.get(key), value)
    return merged


class _Compactor:
    """Batches of ``batch_size`` good samples from an image loader's batches, whose skipped pictures (id -1)
    leave holes: the next good samples move up to fill them. With ``drop_last`` the epoch still yields
    ``batches`` batches: its end is filled with repeats of the batch before (the first good samples when
    there is none). Without, the last batch is what is left.

    Args:
        batch_size: B.
        batches: the batches of the epoch (the image loader's ``len()``).
        drop_last: every batch whole, ``batches`` of them.
    """

    def __init__(self, batch_size: int, batches: int, drop_last: bool):
        self.batch_size, self.batches, self.drop_last = batch_size, batches, drop_last
        self.held: list[tuple[torch.Tensor, torch.Tensor]] = []  # (images, ids) waiting for a batch
        self.count = 0  # samples held
        self.emitted = 0
        self.holes = 0  # skipped samples of this epoch
        self.last: tuple[torch.Tensor, torch.Tensor] | None = None  # the batch emitted last
        self.repeats: tuple[torch.Tensor, torch.Tensor] | None = None  # rows of it, copied once holes exist

    def add(self, images: torch.Tensor, ids: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Take one image-loader batch; yield the whole batches it completes."""
        good = ids >= 0
        if not bool(good.all()):
            self.holes += int((~good).sum())
            images, ids = images[good], ids[good]
            if self.drop_last and self.last is not None:
                self._keep_repeats(self.last)
        if len(ids):
            self.held.append((images, ids))
            self.count += len(ids)
        while self.count >= self.batch_size and self.emitted < self.batches:
            yield self._emit(self.batch_size)

    def finish(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The end of the epoch: the batches its holes left out."""
        if not self.drop_last:
            if self.count:
                yield self._emit(self.count)
            return
        while self.emitted < self.batches:
            if self.repeats is None and not self.count:
                return  # nothing good was read at all (the image loader raises before that)
            need = self.batch_size - self.count
            source = self.repeats if self.repeats is not None else self._held_rows()
            if need > 0:
                reps = torch.arange(need) % len(source[1])
                self.held.append((source[0][reps], source[1][reps]))
                self.count += need
            yield self._emit(self.batch_size)

    def _held_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        images = torch.cat([h[0] for h in self.held])
        ids = torch.cat([h[1] for h in self.held])
        self.held = [(images, ids)]
        return images, ids

    def _emit(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``n`` held samples as one batch (the image loader's own tensors when they are whole)."""
        first_images, first_ids = self.held[0]
        if len(first_ids) >= n:
            out = first_images[:n], first_ids[:n]
            rest = first_images[n:], first_ids[n:]
            self.held = ([rest] if len(rest[1]) else []) + self.held[1:]
        else:
            parts, taken = [], 0
            while taken < n:
                images, ids = self.held.pop(0)
                take = min(n - taken, len(ids))
                parts.append((images[:take], ids[:take]))
                if take < len(ids):
                    self.held.insert(0, (images[take:], ids[take:]))
                taken += take
            out = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        self.count -= n
        self.emitted += 1
        self.last = out
        if self.holes and self.drop_last:
            self._keep_repeats(out)
        return out

    def _keep_repeats(self, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        """The end of the epoch will need ``holes`` repeats: copy as many rows of ``batch`` (at most all)."""
        keep = min(self.holes, len(batch[1]))
        self.repeats = batch[0][:keep].clone(), batch[1][:keep].clone()
