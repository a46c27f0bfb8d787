"""--feature-cache: whether a run trains on its locked image tower's cached features (``feature_cache_plan``), the
pass that computes them once per stored view (``build_image_features``), and the train loader that serves them
(``mmfast.loading.feature_loader``). The cache's layout and its fingerprint: ``mmfast.data.feature_cache``.

View v of a sample is the train augmentation of epoch v (its draws from (seed, v, sample id):
``mmfast.loading.draws``), so epoch e < K trains on exactly the pixels the decoded path would, and epoch e reads
view e mod K. The val split gets a cache of its own, of the centre view that evaluation decodes
(``feature_val_loader``): evaluation's figures are the same, without a decode or a tower pass. The model
directories are unchanged: they take images. Each function takes the
run's ``FeatureConfig`` (``train/slices.py``), a ``LoaderConfig`` with the cache's fields; a whole
``TrainConfig`` stands for it too.

A locked text tower's features are cached too (``build_text_features``): one per caption, computed in eval mode,
so without the dropout a locked Hugging Face encoder applies in training when it runs every step. When only its
top layers train (--text-train-layers N), the locked lower layers' per-token output is cached instead
(``build_text_features`` with ``hidden=True``): a step runs only the top N layers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import re
import time
from pathlib import Path

import numpy as np
import torch

from mmfast.data.dataset import PreparedDataset
from mmfast.data.feature_cache import FeatureCache, files_digest, weights_digest
from mmfast.data.preprocessing import EVAL_CROP_RATIO
from mmfast.loading.arguments import LoaderOptions
from mmfast.loading.feature_loader import FeatureLoader
from mmfast.loading.file_health import stat_files
from mmfast.loading.multimodal import MultimodalLoader
from mmfast.models.encoders import pools_stages
from mmfast.remote.objects import is_remote
from mmfast.train.data import cache_plans, feature_view_loader
from mmfast.train.feature_build import Unreadable, build_shared
from mmfast.train.rundir import RAW_DATA_DIR
from mmfast.train.slices import FeatureConfig
from mmfast.util.commands import PREPARE
from mmfast.util.fsutil import cache_home
from mmfast.util.voice import setting


def feature_cache_plan(cfg: FeatureConfig, model, loader: MultimodalLoader) -> tuple[bool, str]:
    """Whether this run reads cached image features, and why not when it does not.

    ``on`` needs a model that takes image features (``takes_image_features``: the dual encoder), a locked image
    tower and a train order the loader makes (not a WebDataset reader's own); ``auto`` also needs more --epochs
    than --feature-views, or the cache would cost as much as it saves. Any number of processes may share it
    (``feature_build.build_shared``).

    Raises:
        ValueError: --feature-cache on where one of those does not hold.
    """
    if cfg.feature_cache == "off":
        return False, "--feature-cache off"
    problem = ""
    if not getattr(model, "takes_image_features", False):
        problem = f"--model {cfg.model} takes no image features (the dual encoder, --model clip, does)"
    elif not getattr(model.image, "frozen", False):
        problem = "the image tower trains; lock it with --freeze-image"
    elif not loader.images.source.ordered_by_loader:
        source = loader.images.source.name
        problem = f"the {source} source shuffles inside DALI, so its augmentation cannot be stored by view"
    if problem and cfg.feature_cache == "on":
        raise ValueError(f"--feature-cache on: {problem}; or pass --feature-cache off")
    if problem:
        return False, problem
    if cfg.feature_cache == "auto" and cfg.epochs <= cfg.feature_views:
        return False, f"--epochs {cfg.epochs} does not exceed --feature-views {cfg.feature_views}"
    return True, ""


def feature_parts(
    cfg: FeatureConfig, dataset: PreparedDataset, model, norm, dtype: str, precision: str, split: str = "train"
) -> dict:
    """What the stored features depend on: the data and split, the tower's weights, the preprocessing and the
    views (the val split stores the centre view only)."""
    mean, std, *geometry = norm if norm is not None else (None, None)  # image_norm's, or (mean, std)
    geometry = geometry[0] if geometry else {}
    return {
        "data": dataset.fingerprint,
        "split": split,
        "tower": {
            "class": type(model.image).__name__, "weights": weights_digest(model.image),
            **({"pool": model.image.pool} if pools_stages(model.image) else {}),
        },  # fmt: skip
        "preprocessing": {
            "image_size": cfg.image_size, "mean": mean, "std": std, "source": cfg.source,
            "eval_crop_ratio": EVAL_CROP_RATIO,
            # the train split's augmentation and resize; the val split is read as its loader reads it
            **({"augment": cfg.augment, "crop_scale": [cfg.crop_scale_min, 1.0], "color_jitter": cfg.color_jitter,
                "cpu_resize": cfg.cpu_resize} if split == "train" else {"cpu_resize": LoaderOptions.cpu_resize}),
            **({"geometry": geometry} if geometry else {}),  # a start's resize (its key as before without one)
        },
        "views": {"count": cfg.feature_views, "seed": cfg.seed} if split == "train" else {"count": 0},
        "dtype": dtype,
        "precision": precision,  # the autocast the tower ran under
    }  # fmt: skip


def text_locked(model) -> bool:
    """Whether ``model`` takes text features and its text tower gets no gradient (--freeze-text, or a preset's)."""
    text = getattr(model, "text", None)
    return bool(getattr(model, "takes_text_features", False) and text is not None) and not any(
        p.requires_grad for p in text.parameters()
    )


def text_feature_parts(
    dataset: PreparedDataset,
    model,
    loader: MultimodalLoader,
    dtype: str,
    precision: str,
    hidden: bool = False,
    split: str = "train",
) -> dict:
    """What the cached text features depend on: the data, the text tower's weights and the tokens (the token
    cache's fingerprint, its max length, the batches' padding). ``hidden``: what the cached lower layers'
    output depends on instead (``build_text_features``' ``hidden``): the locked part's weights and its depth,
    and in place of the padding the stored length (the split's longest caption)."""
    tokens = loader.tokens
    tower = {"class": type(model.text).__name__}
    token_parts = {"fingerprint": tokens.fingerprint, "max_length": int(tokens.meta["max_length"])}
    if hidden:
        tower |= {"weights": weights_digest(model.text.locked_part()), "locked_layers": model.text.frozen_layers}
        token_parts["length"] = int(tokens.lengths.max(initial=1))
    else:
        tower["weights"] = weights_digest(model.text)
        token_parts["padding"] = loader.text_padding
    return {
        "data": dataset.fingerprint,
        "split": split,
        "tower": tower,
        "tokens": token_parts,
        "views": {"count": 0},
        "dtype": dtype,
        "precision": precision,
    }


def text_partly_locked(model) -> bool:
    """Whether ``model`` takes text features and its text tower trains only its top layers (--text-train-layers):
    the locked lower layers' output is what a cache can hold."""
    text = getattr(model, "text", None)
    return bool(getattr(model, "takes_text_features", False) and getattr(text, "frozen_layers", 0))


def cache_dir(cfg: FeatureConfig, dataset: PreparedDataset, split: str = "train") -> Path:
    """A split's cache folder: in --feature-cache-dir, else in one per dataset under ``cache_home()/features``,
    named after the prepared directory, or after the raw input for one prepared on the fly into the run's folder
    (a raw --data): every run on that input then shares one cache.

    Raises:
        ValueError: --feature-cache-dir names a file.
    """
    if cfg.feature_cache_dir:
        folder = Path(cfg.feature_cache_dir).expanduser()
        if folder.exists() and not folder.is_dir():
            raise ValueError(
                f"--feature-cache-dir {cfg.feature_cache_dir} is a file, not a directory; choose another "
                "--feature-cache-dir (a directory, made if missing)"
            )
        return folder / split
    name, where = Path(dataset.root).name, os.path.realpath(dataset.root)
    raw = cfg.out is not None and where == os.path.realpath(Path(cfg.out) / RAW_DATA_DIR)
    if raw and dataset.summary.get("source"):
        where = str(dataset.summary["source"])  # as --data gave it: a path (this run's cwd) or a URL
        where = where if is_remote(where) else os.path.realpath(where)
        source = Path(where)
        name = re.sub(r"[^\w.-]", "_", source.parent.name if source.stem == "manifest" else source.stem) or name
    key = hashlib.sha256(os.fsencode(where)).hexdigest()[:16]
    return cache_home() / "features" / f"{name}-{key}" / split


def build_image_features(
    cfg: FeatureConfig,
    accelerator,
    dataset: PreparedDataset,
    model,
    norm,
    shard_cache=None,
    split: str = "train",
    files: list[str] | None = None,
) -> tuple[FeatureCache, dict]:
    """``split``'s feature cache, read when current, else computed through ``model``'s locked image tower,
    without gradient: each stored view and the centre view of every train sample, the centre view of every val
    sample. ``files``: the split's image files (None: it is read from shards), stat'ed by each machine's main
    process: a cache built before one of them was replaced in place by a file of another size is stale.

    Returns:
        (the cache, the summary's figures: views, dtype, size, whether it was built and how long that took).
    """
    t0 = time.perf_counter()
    dtype = "float32" if accelerator.mixed_precision == "no" else "float16"
    parts = feature_parts(cfg, dataset, model, norm, dtype, accelerator.mixed_precision, split)
    ids = dataset.table(split, images=False).ids

    def compute(shard: int, shards: int):
        return _view_steps(cfg, accelerator, dataset, model.image, norm, shard_cache, (shard, shards), split)

    def digest() -> str:  # of the image files' sizes now (-1: missing)
        return files_digest(stat_files(files)[:, 0])

    model.to(accelerator.device)
    views = cfg.feature_views if split == "train" else 0
    shape = (views, model.image.width, cfg.eval_batch_size or cfg.batch_size)
    with _eval_mode(model.image):
        features, reason, writers = build_shared(
            accelerator, cache_dir(cfg, dataset, split), parts, ids, shape, dtype, compute,
            _wait_s(cfg, accelerator), digest if files is not None else None,
        )  # fmt: skip
    figures = {
        "dir": str(features.dir),
        "views": features.views,
        "dtype": dtype,
        "mib": round(features.nbytes / 2**20, 1),
        "built": reason or None,  # why it was computed; None: an earlier run's was read
        "writers": writers,  # the processes that wrote it: one per filesystem that lacked it
        "seconds": round(time.perf_counter() - t0, 2),
        "absent": len(features.absent),  # samples whose image could not be read: masked
    }
    return features, figures


@contextlib.contextmanager
def _eval_mode(tower):
    """``tower`` in eval mode for the block: a stored feature is computed once, without dropout."""
    was_training = tower.training
    tower.eval()
    try:
        yield
    finally:
        tower.train(was_training)


def _wait_s(cfg: FeatureConfig, accelerator) -> float:
    """How long a local main process waits for another run's build: as long as it takes alone, else within
    the other processes' --dist-timeout."""
    return -1 if accelerator.num_processes == 1 else 0.9 * cfg.dist_timeout


@torch.no_grad()
def _view_steps(
    cfg: FeatureConfig, accelerator, dataset, tower, norm, shard_cache, shard: tuple[int, int], split="train"
):
    """This process's share (``shard``: (index, count)) of every view of every sample of ``split``: of the train
    split view v from the train loader's epoch v, then the centre view; of the val split the centre view only;
    as (view, ids, features) steps, then the samples whose image could not be read (``Unreadable``: the loader
    skipped them, and training masks them as the decoded path does)."""
    skipped = {}
    if split == "train":
        plan = cache_plans(cfg, accelerator, dataset, has_val=False, cache=shard_cache)["train"]
        views = feature_view_loader(
            cfg, accelerator, dataset, norm, shard_cache, True, cache_decoded=plan, shard=shard
        )
        for v in range(cfg.feature_views):
            views.set_epoch(v)
            yield from _tower_steps(accelerator, tower, views, v)
        skipped |= {e["id"]: e for e in views.skipped}
    centre = feature_view_loader(cfg, accelerator, dataset, norm, shard_cache, False, shard=shard, split=split)
    yield from _tower_steps(accelerator, tower, centre, None)
    skipped |= {e["id"]: e for e in centre.skipped}
    yield Unreadable([skipped[i] for i in sorted(skipped)])


def build_text_features(
    cfg: FeatureConfig,
    accelerator,
    dataset: PreparedDataset,
    model,
    loader: MultimodalLoader,
    hidden: bool = False,
    split: str = "train",
) -> tuple[FeatureCache, dict]:
    """``split``'s cache of the locked text tower's features, one per caption (``train-text`` or ``val-text``
    beside the split's image folder; ``loader``: the split's), read when current, else computed in eval mode
    without gradient. ``hidden``: the
    locked lower layers' output of each caption instead (``train-text-hidden`` or ``val-text-hidden``), its
    tokens padded to the split's longest caption and flattened: a row is (length x D_txt).

    Returns:
        (the cache, the summary's figures: dtype, size, whether it was built and how long that took; with
        ``hidden``, the locked layers too).
    """
    t0 = time.perf_counter()
    dtype = "float32" if accelerator.mixed_precision == "no" else "float16"
    parts = text_feature_parts(dataset, model, loader, dtype, accelerator.mixed_precision, hidden, split)
    ids = dataset.table(split, images=False).ids
    length = parts["tokens"]["length"] if hidden else None

    def compute(shard: int, shards: int):
        return _text_steps(cfg, accelerator, model.text, loader, ids, (shard, shards), length)

    model.to(accelerator.device)
    directory = cache_dir(cfg, dataset, split).with_name(f"{split}-text-hidden" if hidden else f"{split}-text")
    width = model.text.width * (length or 1)
    with _eval_mode(model.text):
        features, reason, writers = build_shared(
            accelerator, directory, parts, ids, (0, width, cfg.batch_size), dtype, compute,
            _wait_s(cfg, accelerator),
        )  # fmt: skip
    figures = {
        "dir": str(features.dir),
        "dtype": dtype,
        "mib": round(features.nbytes / 2**20, 1),
        "built": reason or None,
        "writers": writers,
        "seconds": round(time.perf_counter() - t0, 2),
    }
    if hidden:
        figures["locked_layers"] = model.text.frozen_layers
    return features, figures


@torch.no_grad()
def _text_steps(
    cfg: FeatureConfig, accelerator, tower, loader: MultimodalLoader, ids, shard: tuple[int, int], length=None
):
    """This process's share of the captions' features: batch k of --batch-size ids (padded as the train batches
    are) when k mod the count of shares is ``shard``'s index; as (None, ids, features) steps. ``length``: the
    locked lower layers' output instead, padded with zeros to ``length`` tokens and flattened."""
    index, count = shard
    for s in range(index * cfg.batch_size, len(ids), count * cfg.batch_size):
        batch_ids = np.asarray(ids[s : s + cfg.batch_size])
        text = {
            k: v.to(accelerator.device) for k, v in loader.tokens.gather(batch_ids, loader.text_padding).items()
        }
        with accelerator.autocast():
            if length is None:
                out = tower(text["input_ids"], text["attention_mask"])  # (B, D_txt)
            else:
                out = tower.lower(text["input_ids"], text["attention_mask"])[:, :length]  # (B, T, D_txt)
                out = torch.nn.functional.pad(out, (0, 0, 0, length - out.shape[1])).flatten(1)
        yield None, torch.from_numpy(batch_ids), out


def _tower_steps(accelerator, tower, loader, view: int | None):
    for batch in loader:
        with accelerator.autocast():
            pooled = tower(batch["image"])[0]  # (B, C)
        yield view, batch["id"], pooled


def feature_note(figures: dict) -> str:
    """One line on a run's feature cache (``build_image_features``' figures, with ``text`` where the captions'
    are cached too, and ``val`` where the val split's are): the note of a profile's report."""
    text = figures.get("text")
    what = _views(figures["views"]) + (" and the captions" if text else "")
    if text and "locked_layers" in text:
        what += f" (the text tower's {text['locked_layers']} locked layers)"
    built, mib, seconds = _totals(figures, text)
    how = f"computed ({built})" if built else "read from an earlier run's cache"
    note = f"train read as cached features: {what}, {mib:.1f} MiB, {how} in {seconds:.1f} s"
    if "val" in figures:  # evaluation too: its split's centre view (and captions)
        note += f"; val too, {_totals(figures['val'], figures['val'].get('text'))[1]:.1f} MiB"
    return note


def _totals(image: dict, text: dict | None) -> tuple[str, float, float]:
    """A split's image and text caches' figures together: why the first built one was computed ("" when both
    were read), their MiB and their seconds."""
    parts = [f for f in (image, text) if f]
    built = next((f["built"] for f in parts if f["built"]), "")
    return built, sum(f["mib"] for f in parts), sum(f["seconds"] for f in parts)


def _image_files(loader: MultimodalLoader) -> list[str] | None:
    """The split's image files, whose changes in place make its cache stale; None when it reads shards."""
    images = loader.images
    return images.files if images.source.needs_paths else None


def _refuse_absent(cfg: FeatureConfig, features: FeatureCache) -> None:
    """Under --on-bad-image error, a cache built with an unreadable image skipped stops the run as decoding
    would, naming the file.

    Raises:
        ValueError: ``features`` lists an absent sample and --on-bad-image is error.
    """
    if cfg.on_bad_image != "error" or not features.absent:
        return
    first = features.absent[min(features.absent)]
    raise ValueError(
        f"{first['image']}: {first['reason']} (the feature cache {features.dir} was built with it skipped). Fix "
        f"or remove it and re-run {PREPARE}, or pass {setting('on_bad_image', value='skip')}"
    )


def _views(n: int) -> str:
    return f"{n} view" if n == 1 else f"{n} views"


def _absent_note(features: FeatureCache) -> str:
    """What a printed line adds about the samples whose image could not be read when ``features`` was built."""
    if not features.absent:
        return ""
    first = features.absent[min(features.absent)]
    n, image, why = len(features.absent), first["image"], first["reason"]
    return f"; {n} unreadable image(s), masked as decoding masks them (the first: {image}: {why})"


def feature_train_loader(
    cfg: FeatureConfig, accelerator, dataset: PreparedDataset, model, norm, shard_cache, loader: MultimodalLoader
) -> tuple[MultimodalLoader | FeatureLoader, dict | None]:
    """The run's train loader: ``loader`` itself, or one that serves its order from the feature cache
    (``feature_cache_plan``); with the cache's figures for the summary (None without one)."""
    if not cfg.augment and cfg.feature_views > 1:  # every view would be the centre view: store it once
        accelerator.print(
            f"--no-augment: views are all alike, so 1 is stored (not --feature-views {cfg.feature_views})"
        )
        cfg = dataclasses.replace(cfg, feature_views=1)
    use, why = feature_cache_plan(cfg, model, loader)
    if not use:
        if cfg.feature_cache == "auto":
            accelerator.print(f"--feature-cache auto: decoding every epoch ({why})")
        return loader, None
    files = _image_files(loader)
    features, figures = build_image_features(cfg, accelerator, dataset, model, norm, shard_cache, files=files)
    _refuse_absent(cfg, features)
    verb = f"computed ({figures['built']})" if figures["built"] else "read"
    accelerator.print(
        f"train image features {verb}: {_views(figures['views'])}, {figures['mib']} MiB in {features.dir} "
        f"({figures['seconds']} s){_absent_note(features)}"
    )
    text = None
    hidden = text_partly_locked(model)  # the locked lower layers' output: later epochs run the top ones only
    if text_locked(model) or hidden:  # the captions' features too: later epochs run neither tower
        text, figures["text"] = build_text_features(cfg, accelerator, dataset, model, loader, hidden=hidden)
        t = figures["text"]
        verb = f"computed ({t['built']})" if t["built"] else "read"
        what = "text features" if not hidden else f"text tower's {t['locked_layers']} locked layers' output"
        accelerator.print(f"train {what} {verb}: {t['mib']} MiB in {text.dir} ({t['seconds']} s)")
    return FeatureLoader(loader, features, text=text), figures


def feature_val_loader(
    cfg: FeatureConfig, accelerator, dataset: PreparedDataset, model, norm, shard_cache, loader, figures
) -> MultimodalLoader | FeatureLoader | None:
    """The run's val loader: ``loader`` itself (None: no val split), or, when the train split is read as cached
    features (``figures``: ``feature_train_loader``'s, None without), one that serves the val split from a
    cache of its own: the centre view ``loader`` decodes, through the locked tower, and the captions' features
    where the train split's are cached. Evaluation's figures stay the same; ``figures["val"]`` gets the cache's.
    """
    if loader is None or figures is None:
        return loader
    try:  # every process raises alike when the build stops on one (feature_build.build_shared)
        features, val = build_image_features(
            cfg, accelerator, dataset, model, norm, shard_cache, split="val", files=_image_files(loader)
        )
        text = None
        if "text" in figures:
            hidden = "locked_layers" in figures["text"]
            text, val["text"] = build_text_features(cfg, accelerator, dataset, model, loader, hidden, split="val")
    except RuntimeError as e:  # e.g. a full disk: evaluation decodes
        accelerator.print(f"val features not cached ({e}): evaluation decodes the val split")
        return loader
    _refuse_absent(cfg, features)
    figures["val"] = val
    built, mib, seconds = _totals(val, val.get("text"))
    states = [(name, f["built"]) for name, f in (("centre view", val), ("captions", val.get("text"))) if f]
    if len({bool(b) for _, b in states}) == 1:  # both computed (for the first one's reason) or both read
        line = f"val features {f'computed ({built})' if built else 'read'}: {' and '.join(n for n, _ in states)}"
    else:  # e.g. another image tower: its centre view computed again, the captions' features read
        line = "val features: " + ", ".join(f"{n} computed ({b})" if b else f"{n} read" for n, b in states)
    accelerator.print(f"{line}, {mib:.1f} MiB in {features.dir.parent} ({seconds:.2f} s){_absent_note(features)}")
    return FeatureLoader(loader, features, centre=True, text=text)
