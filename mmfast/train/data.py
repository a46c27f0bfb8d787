"""A run's loaders: this process's train and val ``MultimodalLoader`` over the prepared dataset, the cache they
stream remote shards through (``shard_cache``), which splits hold their images decoded in memory
(``cache_plans``) and the summary's line on how images were served. Each builder takes the run's
``LoaderConfig`` (``train/slices.py``); a whole ``TrainConfig`` stands for it too. The loaders are made from
one typed ``LoaderOptions`` (``_loader_options``), varied per split (``_loader``)."""

from __future__ import annotations

import functools
import logging
from dataclasses import replace

import numpy as np

from mmfast.data.dataset import PreparedDataset
from mmfast.loading.arguments import LoaderOptions
from mmfast.loading.cache_plan import CachePlan, SplitImages, plan_decoded_cache
from mmfast.loading.multimodal import MultimodalLoader
from mmfast.loading.sampling import WHOLE_BATCHES, MixedOrder, WholeBatchOrder
from mmfast.loading.sources import choose_source, prepared_source
from mmfast.remote.objects import fetch_to
from mmfast.remote.shard_cache import ShardCache
from mmfast.train.data_flags import data_weights
from mmfast.train.hardware import resolve_text_padding
from mmfast.train.setup import processes_per_machine, usable_cores
from mmfast.train.slices import LoaderConfig
from mmfast.util.args import parse_size
from mmfast.util.fsutil import cache_home

log = logging.getLogger(__name__)

# --samples-per-epoch beyond the train split's rows: an epoch's order is held in memory, 8 bytes a sample
MAX_EPOCH_SAMPLES = 2**26


def build_loaders(
    cfg: LoaderConfig,
    accelerator,
    dataset: PreparedDataset,
    norm: tuple | None = None,
    val: bool = True,
) -> tuple[MultimodalLoader, MultimodalLoader | None, dict[str, str], ShardCache | None]:
    """This process's train loader (its shard, augmented), val loader (None without a val split or ``val``), why a
    split's images are streamed rather than held in memory ({split: reason}, ``images_note``), and the shard
    cache both loaders read remote shards through, whose counters the run's figures report (None when the
    shards are local).

    ``norm``: ``image_norm``'s (mean, std, geometry) that the image encoder expects (default: ImageNet's and
    mmfast's eval resize).
    """
    cache = shard_cache(cfg, dataset)
    try:
        return (*_loaders(cfg, accelerator, dataset, norm, cache, val), cache)
    except BaseException:
        if cache is not None:  # its fetch threads would outlive the failed start
            cache.close()
        raise


def _loaders(cfg: LoaderConfig, accelerator, dataset: PreparedDataset, norm, cache: ShardCache | None, val: bool):
    """build_loaders' train loader, val loader (or None) and {split: why it is streamed}."""
    common = _loader_options(cfg, accelerator, norm)
    # A dataset prepared with --val-fraction 0 has an empty val split: train without evaluation.
    has_val = val and dataset.split_size("val") > 0
    source = _source_kind(cfg, accelerator, dataset, ["train", "val"] if has_val else ["train"])
    plans = cache_plans(cfg, accelerator, dataset, has_val, cache=cache)
    streamed = {split: plan.why for split, plan in plans.items() if not plan.cache}
    train = replace(_augmented(cfg, common), cache_decoded=plans["train"], source=source)
    train_loader = _loader(dataset, "train", train, accelerator, cache, train_sampling(cfg, dataset))
    if train_loader.source.name == "stream":  # remote shards stream whatever --source says
        if note := train_loader.source.grouped_note(train_loader.images.labels, cfg.batch_size):
            accelerator.print(note)
    if len(train_loader) == 0:  # --samples-per-epoch under one global batch: an epoch would train nothing
        per_step = cfg.batch_size * accelerator.num_processes
        raise ValueError(
            f"an epoch of {cfg.samples_per_epoch} samples (--samples-per-epoch) cannot fill one batch of "
            f"{cfg.batch_size} on each of {accelerator.num_processes} processes: pass --samples-per-epoch "
            f"{per_step} or more, or a smaller --batch-size"
        )
    if not has_val:
        return train_loader, None, streamed
    evaluation = replace(common, batch_size=cfg.eval_batch_size, cache_decoded=plans["val"], source=source)
    val_loader = _loader(dataset, "val", evaluation, accelerator, cache)
    return train_loader, val_loader, streamed


def _source_kind(cfg: LoaderConfig, accelerator, dataset: PreparedDataset, splits: list[str]) -> str:
    """The source kind ``splits`` are read by (``choose_source``). One line says so where it is not the one asked
    for (the shards of a dataset prepared from them)."""
    kind, why = choose_source(dataset, cfg.source)
    if why:
        accelerator.print(f"{' and '.join(splits)} images: {why}")
    return kind


def train_sampling(cfg: LoaderConfig, dataset: PreparedDataset) -> WholeBatchOrder:
    """The train split's order: ``WHOLE_BATCHES``, or for a mix (and for ``--samples-per-epoch``) its sources
    drawn by ``--data-weights`` (by their sizes without it: every row once an epoch, as one dataset).

    Raises:
        ValueError: shares that do not match the sources, a source without train rows, or --samples-per-epoch
            above both the split's rows and ``MAX_EPOCH_SAMPLES``.
    """
    sources, weights = dataset.mix_sources, data_weights(cfg)
    if not sources and weights is not None and len(weights) > 1:
        raise ValueError(
            f"--data-weights gives {len(weights)} shares, and {dataset.root} is one dataset; give --data once "
            "for each dataset of the mix"
        )
    if not sources and cfg.samples_per_epoch is None:
        return WHOLE_BATCHES
    rows = dataset.split_size("train")
    if cfg.samples_per_epoch is not None and cfg.samples_per_epoch > max(rows, MAX_EPOCH_SAMPLES):
        raise ValueError(
            f"--samples-per-epoch {cfg.samples_per_epoch}: an epoch's order is held in memory, 8 bytes a sample "
            f"({cfg.samples_per_epoch * 8 / 2**30:.1f} GiB); use at most {max(rows, MAX_EPOCH_SAMPLES)} (the "
            f"train split has {rows} rows), and more --epochs for a longer run"
        )
    if sources and weights is not None and len(weights) != len(sources):
        raise ValueError(
            f"--data-weights gives {len(weights)} shares for the {len(sources)} datasets of the mix {dataset.root}"
        )
    for s in sources:
        if not s["train"]:
            raise ValueError(f"{s['root']} has no train rows to draw from; leave it out of the mix")
    groups = dataset.table("train").sources if sources else np.zeros(dataset.split_size("train"), np.int64)
    return MixedOrder(groups, weights or [s["train"] for s in sources] or [1.0], cfg.samples_per_epoch)


def train_view_loader(
    cfg: LoaderConfig, accelerator, dataset: PreparedDataset, norm: tuple[tuple, tuple] | None, cache
) -> MultimodalLoader:
    """This process's share of the train split as evaluation sees it (resized, center-cropped, streamed), in the
    seeded order of epoch 0 (a split sorted by class gives the first batches of every class): what
    ``--init-proj ridge`` fits the projections on."""
    common = _loader_options(cfg, accelerator, norm)
    view = replace(common, batch_size=cfg.eval_batch_size, shuffle=True, drop_last=False, train=False)
    return _loader(dataset, "train", view, accelerator, cache)


def feature_view_loader(
    cfg: LoaderConfig,
    accelerator,
    dataset: PreparedDataset,
    norm,
    cache,
    train: bool,
    cache_decoded=False,
    shard: tuple[int, int] = (0, 1),
    split: str = "train",
) -> MultimodalLoader:
    """``split``'s samples of ``shard`` ((index, count): all of them by default), in id order, augmented as
    training augments it (``train``; its epoch is the view) or as evaluation sees it: what a feature cache
    stores (``mmfast.train.features``). The val split is read as the run's val loader reads it (without the
    train split's --cpu-resize), so its cached features are the ones evaluation would compute."""
    common = _loader_options(cfg, accelerator, norm)
    view = replace(
        _augmented(cfg, common) if split == "train" else common,
        batch_size=cfg.eval_batch_size or cfg.batch_size,
        shuffle=False,
        drop_last=False,
        train=train and cfg.augment,
        cache_decoded=cache_decoded,
        shard_id=shard[0],
        num_shards=shard[1],
    )
    return _loader(dataset, split, view, accelerator, cache)


def _loader(
    dataset: PreparedDataset, split: str, options: LoaderOptions, accelerator, cache, sampling=WHOLE_BATCHES
) -> MultimodalLoader:
    """``split``'s loader as ``options`` say, on this process (``accelerator``), its remote shards through
    ``cache``, in the order of ``sampling``."""
    return MultimodalLoader.from_options(
        dataset, split, options, accelerator=accelerator, shard_cache=cache, sampling=sampling
    )


def image_norm(image) -> tuple[tuple, tuple, dict] | None:
    """What the loaders take from an image encoder: (mean, std) on the 0..1 scale, and the eval geometry its
    start was trained with ({"interpolation", "resize_mode", "crop_ratio"}, any of them; {}: mmfast's own).
    None without an image encoder."""
    if image is None:
        return None
    return tuple(image.mean), tuple(image.std), dict(getattr(image, "geometry", {}))


def _loader_options(cfg: LoaderConfig, accelerator, norm: tuple | None) -> LoaderOptions:
    """What every loader of the run is given (``LoaderOptions``): the train batch size, the image size and the
    seed, the DALI threads, the precision of this process's device, the encoder's mean / std and its start's
    resize filter and eval crop (``image_norm``'s), the bad-image policy, the source and the caption width. A
    split's loader varies it (``dataclasses.replace``)."""
    threads = cfg.num_threads or max(1, usable_cores() // processes_per_machine(accelerator))
    mean, std = (tuple(255 * m for m in norm[0]), tuple(255 * v for v in norm[1])) if norm else (None, None)
    geometry = norm[2] if norm and len(norm) > 2 else {}  # train and eval alike
    return LoaderOptions(
        cfg.batch_size,
        size=cfg.image_size,
        seed=cfg.seed,
        num_workers=threads,
        fp16=accelerator.device.type == "cuda",
        on_bad_image=cfg.on_bad_image,
        verify_files=cfg.verify_files,
        mean=mean,
        std=std,
        source=cfg.source,
        text_padding=resolve_text_padding(cfg),
        **geometry,
    )


def _augmented(cfg: LoaderConfig, options: LoaderOptions) -> LoaderOptions:
    """``options`` with the train split's augmentation (--no-augment, --crop-scale-min, --color-jitter) and
    --cpu-resize."""
    augment = {"train": cfg.augment, "scale": (cfg.crop_scale_min, 1.0), "color_jitter": cfg.color_jitter}
    return replace(options, **augment, cpu_resize=cfg.cpu_resize)


def shard_cache(cfg: LoaderConfig, dataset: PreparedDataset) -> ShardCache | None:
    """The cache remote shards are streamed through (``--shard-cache``, ``--cache-limit``), or None when the
    dataset's shards (if any) are all local. One per process; the processes of a machine share its folder."""
    if not dataset.remote_shards():
        return None
    root = cfg.shard_cache or str(cache_home() / "shards")
    fetch = functools.partial(fetch_to, retry_s=cfg.store_timeout)  # --store-timeout bounds the retries
    return ShardCache(root, parse_size(cfg.cache_limit, "--cache-limit"), fetch=fetch)


def cache_plans(
    cfg: LoaderConfig,
    accelerator,
    dataset: PreparedDataset,
    has_val: bool,
    budget: int | None = None,
    cache: ShardCache | None = None,
) -> dict[str, CachePlan]:
    """Which splits hold their images decoded (``--cache-decoded``): ``cache_plan.plan_decoded_cache`` over
    train, then val, sized by the decoded bytes preparation recorded (``budget``: the memory to share,
    default half of what is available now), its reasons in the caller's words (``util.voice``)."""
    source = prepared_source(dataset, "train", cfg.source, cache or shard_cache(cfg, dataset))
    splits = [
        SplitImages("train", True, cfg.color_jitter, cfg.epochs, lambda left: dataset.decoded_bytes("train", left))
    ]
    if has_val:
        splits.append(SplitImages("val", False, need=lambda left: dataset.decoded_bytes("val", left)))
    plans = plan_decoded_cache(
        splits, "auto" if cfg.cache_decoded else False, device_type=accelerator.device.type,
        host_finish=cfg.cpu_resize == "torch", source=source, processes=processes_per_machine(accelerator),
        budget=budget,
    )  # fmt: skip
    for split, plan in plans.items():
        if plan.cache:
            log.info("%s images: %s", split, plan.why)
        else:
            log.info("streaming the %s images: %s", split, plan.why)
    return plans


def _mib(nbytes: int) -> str:
    """A cache's size for the summary: tenths below 10 MiB (a small cache is not "0 MiB")."""
    return f"{nbytes / 2**20:.1f} MiB" if nbytes < 10 * 2**20 else f"{nbytes / 2**20:.0f} MiB"


def images_note(loaders: dict[str, MultimodalLoader | None], streamed: dict[str, str]) -> str:
    """The summary's line on how each split's images were served: held in memory (how much) or streamed
    (why)."""
    parts = []
    for split, loader in loaders.items():
        if loader is None:
            continue
        if (features := getattr(loader, "features", None)) is not None:  # --feature-cache
            views = f"{features.views} view{'s' * (features.views > 1)}" if features.views else "the centre view"
            size = f"{views}, {_mib(features.nbytes)}"  # val: the centre view only
            if (text := getattr(loader, "text", None)) is not None:
                what = "captions too" if loader.text_length is None else "captions' locked text layers"
                size += f"; {what}, {_mib(text.nbytes)}"
            parts.append(f"{split} read as cached features ({size})")
        elif loader.holds_decoded:
            parts.append(f"{split} decoded once, {loader.cached_bytes / 2**20:.0f} MiB in memory")
        else:
            parts.append(f"{split} streamed ({streamed.get(split, 'did not fit in its memory budget')})")
    return "; ".join(parts)
