"""The configuration's slices (mmfast/train/slices.py): each is TrainConfig's fields of the same name and type,
holds every field its builders read, and is cut from the resolved record with the values it settles."""

from __future__ import annotations

import ast
import inspect
from dataclasses import fields

import pytest

from mmfast.train import config, data, features, hardware, optim, setup
from mmfast.train.config import TrainConfig
from mmfast.train.slices import (
    SLICES,
    CompileConfig,
    DataConfig,
    FeatureConfig,
    LoaderConfig,
    OptimConfig,
    ProcessConfig,
    cut,
    slices,
)

# the builders typed with a slice: {module: {function: its slice}}
BUILDERS = {
    data: {name: LoaderConfig for name in ("build_loaders", "_loaders", "train_sampling", "train_view_loader")}
    | {name: LoaderConfig for name in ("feature_view_loader", "_loader_options", "shard_cache", "cache_plans")},
    setup: {"make_accelerator": ProcessConfig}
    | {name: DataConfig for name in ("resolve_data", "_prepare_raw", "check_data_exists", "_mix")},
    optim: {"total_steps": OptimConfig, "build_optimizer": OptimConfig},
    features: {name: FeatureConfig for name in ("feature_cache_plan", "feature_parts", "cache_dir")}
    | {name: FeatureConfig for name in ("build_train_features", "_view_steps", "feature_train_loader", "_wait_s")},
    hardware: {name: CompileConfig for name in ("compiles", "compile_options", "resolve_text_padding")}
    | {name: CompileConfig for name in ("check_compile_fits", "uses_cuda_graphs", "choices_made")},
    # the helpers the builders hand their slice to
    config: {"trackers": ProcessConfig, "data_sources": DataConfig, "data_weights": LoaderConfig},
}


@pytest.mark.parametrize("kind", SLICES, ids=lambda k: k.__name__)
def test_a_slice_is_train_configs_fields_of_the_same_name_and_type(kind):
    whole = {f.name: f.type for f in fields(TrainConfig)}
    for f in fields(kind):
        assert f.name in whole, f"{kind.__name__}.{f.name} is no TrainConfig field"
        assert f.type == whole[f.name], f"{kind.__name__}.{f.name}: {f.type} is not TrainConfig's {whole[f.name]}"


def _reads(function) -> set[str]:
    """The attributes ``function`` reads of its ``cfg`` parameter."""
    tree = ast.parse(inspect.getsource(function).lstrip())
    return {
        n.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "cfg"
    }


@pytest.mark.parametrize("module", BUILDERS, ids=lambda m: m.__name__)
def test_a_builder_reads_only_its_slice(module):
    for name, kind in BUILDERS[module].items():
        function = getattr(module, name)
        assert kind.__name__ in function.__annotations__["cfg"], f"{module.__name__}.{name} takes {kind.__name__}"
        missing = _reads(function) - {f.name for f in fields(kind)}
        assert not missing, f"{module.__name__}.{name} reads {sorted(missing)}, which {kind.__name__} lacks"


def test_cut_takes_the_values_and_settles_the_caption_width():
    cfg = TrainConfig(batch_size=16, eval_batch_size=48, seed=3, image_size=96, source="wds", dist_timeout=5.0)
    parts = slices(cfg)
    assert (parts.loader.batch_size, parts.loader.eval_batch_size, parts.loader.seed) == (16, 48, 3)
    assert (parts.loader.image_size, parts.loader.source) == (96, "wds")
    assert parts.processes == ProcessConfig("auto", None, None, False, 5.0, 300.0)
    assert parts.data.data is None and parts.data.max_length == 32
    assert slices(TrainConfig(lr=0.01, grad_accum=4)).optim == OptimConfig(
        None, None, 4, 0.01, None, 0.05, None, None, "cosine", "auto"
    )
    # text_padding auto: settled from the whole record (a compiled step pads to buckets)
    assert parts.loader.text_padding == "longest"
    assert cut(LoaderConfig, TrainConfig(compile=True)).text_padding == "buckets"
    assert cut(LoaderConfig, TrainConfig(text_padding="max", compile=True)).text_padding == "max"


def test_a_slice_is_frozen():
    with pytest.raises(AttributeError):
        slices(TrainConfig()).loader.batch_size = 8  # type: ignore[misc]
