"""The training engine's loaders from one typed ``LoaderOptions`` (mmfast/loading/arguments.py): its keywords
leave the unset ones to the loaders, the loader they make equals the one written out, and the run's options
follow its configuration's slice."""

from __future__ import annotations

from dataclasses import FrozenInstanceError, replace

import pytest
import torch

from mmfast.loading.arguments import LoaderOptions
from mmfast.loading.multimodal import MultimodalLoader
from mmfast.train import data
from mmfast.train.config import TrainConfig
from mmfast.train.resolve import resolve_preset
from mmfast.train.slices import LoaderConfig, cut


class _Cpu:
    """What the run's loader options read of an Accelerator: one process on the CPU."""

    device, num_processes, process_index, local_process_index = torch.device("cpu"), 1, 0, 0


def test_unset_fields_leave_the_loaders_defaults_and_the_rest_are_their_keywords():
    options = LoaderOptions(8, size=32, train=True, scale=(0.5, 1.0))
    assert options.keywords() == {
        "batch_size": 8,
        "size": 32,
        "seed": 0,
        "train": True,
        "cpu_resize": "torch",
        "cache_decoded": False,
        "on_bad_image": "skip",
        "verify_files": False,
        "scale": (0.5, 1.0),
        "source": "files",
        "text_padding": "longest",
    }
    with pytest.raises(FrozenInstanceError):
        options.batch_size = 16  # type: ignore[misc]


def test_a_loader_from_options_equals_the_one_written_out(prepared):
    options = LoaderOptions(16, size=32, seed=3, num_workers=1, fp16=False, train=False, text_padding="max")
    typed = MultimodalLoader(prepared, "train", **options.keywords())
    keywords = MultimodalLoader(
        prepared, "train", 16, size=32, seed=3, num_workers=1, fp16=False, train=False, text_padding="max"
    )
    assert (typed.batch_size, typed.shuffle, typed.drop_last, typed.train) == (16, True, True, False)
    assert (typed.dtype, typed.text_padding, len(typed)) == (torch.float32, "max", len(keywords))
    for a, b in zip(typed, keywords, strict=True):
        assert torch.equal(a["id"], b["id"]) and torch.equal(a["image"], b["image"])
        assert a["input_ids"].shape == b["input_ids"].shape


def test_the_runs_options_follow_its_loader_slice():
    given = TrainConfig(batch_size=12, image_size=40, seed=5, num_threads=2, cpu_resize="dali")
    cfg = cut(LoaderConfig, resolve_preset(given))  # the preset's augmentation, as a run resolves it
    common = data._loader_options(cfg, _Cpu(), ((0.5, 0.5, 0.5), (0.25, 0.25, 0.25)))
    assert (common.batch_size, common.size, common.seed, common.num_workers) == (12, 40, 5, 2)
    assert (common.fp16, common.mean, common.std) == (False, (127.5,) * 3, (63.75,) * 3)
    assert (common.train, common.cpu_resize, common.scale) == (None, "torch", None)  # evaluation: the defaults
    train = data._augmented(cfg, common)
    assert (train.train, train.cpu_resize, train.scale, train.color_jitter) == (True, "dali", (0.35, 1.0), 0.0)
    assert replace(train, batch_size=4).batch_size == 4 and train.batch_size == 12


def test_the_engines_loader_is_the_keyword_one(prepared):
    """``from_options`` (the engine's: the options handed on whole) makes the loader the keywords make."""
    options = LoaderOptions(
        8, size=32, seed=3, num_workers=1, train=True, scale=(0.5, 1.0), mean=(127.5,) * 3, crop_ratio=0.9
    )
    engine = MultimodalLoader.from_options(prepared, "train", options)
    keywords = MultimodalLoader(prepared, "train", **options.keywords())
    names = ("batch_size", "shuffle", "drop_last", "seed", "train", "size", "dtype", "device", "num_threads")
    names += ("prefetch", "shard_id", "num_shards", "text_padding")
    assert [getattr(engine, n) for n in names] == [getattr(keywords, n) for n in names]
    a, b = engine.images, keywords.images
    assert a.pipeline_kwargs == b.pipeline_kwargs == {"scale": (0.5, 1.0), "mean": (127.5,) * 3, "crop_ratio": 0.9}
    assert (a.max_pixels, a.files_checked, a.on_bad_image, a.holds_decoded) == (b.max_pixels, True, "skip", False)
    assert type(a.source) is type(b.source)
    assert a.image_sizes is not None and (a.image_sizes == b.image_sizes).all()
    assert (engine.dtype, engine.batch_size, len(engine)) == (torch.float16, 8, len(keywords))
    for x, y in zip(engine, keywords, strict=True):
        assert torch.equal(x["id"], y["id"]) and torch.equal(x["image"], y["image"])
