"""The configuration's slices (mmfast/train/slices.py): each is TrainConfig's fields of the same name and type,
holds every field its builders read, and is cut from the resolved record with the values it settles."""

from __future__ import annotations

import ast
import inspect
from dataclasses import fields
from pathlib import Path

import pytest

import mmfast
from mmfast.infer import model_config, model_dir
from mmfast.train import config, data, data_flags, engine, features, hardware, optim, report, run, setup
from mmfast.train.config import TrainConfig
from mmfast.train.slices import (
    SLICES,
    CompileConfig,
    DataConfig,
    FeatureConfig,
    LoaderConfig,
    LoopConfig,
    ModelConfig,
    OptimConfig,
    ProcessConfig,
    ReportConfig,
    RunConfig,
    cut,
    slices,
)

# the builders typed with a slice: {module: {function: its slice}}
BUILDERS = {
    data: {name: LoaderConfig for name in ("build_loaders", "_loaders", "train_sampling", "train_view_loader")}
    | {name: LoaderConfig for name in ("feature_view_loader", "_loader_options", "shard_cache", "cache_plans")}
    | {"_augmented": LoaderConfig},
    setup: {"make_accelerator": ProcessConfig}
    | {name: DataConfig for name in ("resolve_data", "_prepare_raw", "check_data_exists", "_mix")},
    optim: {"total_steps": OptimConfig, "build_optimizer": OptimConfig},
    features: {name: FeatureConfig for name in ("feature_cache_plan", "feature_parts", "cache_dir")}
    | {name: FeatureConfig for name in ("build_image_features", "_view_steps", "feature_train_loader", "_wait_s")}
    | {"feature_val_loader": FeatureConfig}
    | {"_text_steps": FeatureConfig},
    hardware: {name: CompileConfig for name in ("compiles", "compile_options", "resolve_text_padding")}
    | {name: CompileConfig for name in ("check_compile_fits", "uses_cuda_graphs", "choices_made")},
    # the loop, what a run reports, the model and its directory's record, the profile's run
    engine: {"EpochRunner": LoopConfig},
    report: {"StepLog": LoopConfig, "summarize": ReportConfig, "write_profile": ReportConfig},
    run: {"build_run_model": ModelConfig},
    model_config: {"model_config": ModelConfig},
    model_dir: {"write_run_models": ModelConfig},
    # the helpers the builders hand their slice to
    config: {"trackers": ProcessConfig},
    data_flags: {"data_sources": DataConfig, "data_weights": LoaderConfig},
}


@pytest.mark.parametrize("kind", SLICES, ids=lambda k: k.__name__)
def test_a_slice_is_train_configs_fields_of_the_same_name_and_type(kind):
    whole = {f.name: f.type for f in fields(TrainConfig)}
    for f in fields(kind):
        assert f.name in whole, f"{kind.__name__}.{f.name} is no TrainConfig field"
        assert f.type == whole[f.name], f"{kind.__name__}.{f.name}: {f.type} is not TrainConfig's {whole[f.name]}"


def _is_cfg(node: ast.expr) -> bool:
    """``cfg``, or a class's ``self.cfg``."""
    if isinstance(node, ast.Name):
        return node.id == "cfg"
    return isinstance(node, ast.Attribute) and node.attr == "cfg" and isinstance(node.value, ast.Name)


def _reads(function) -> set[str]:
    """The attributes ``function`` (or every method of a class) reads of its ``cfg`` (or ``self.cfg``)."""
    tree = ast.parse(inspect.getsource(function).lstrip())
    return {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and _is_cfg(n.value)}


@pytest.mark.parametrize("module", BUILDERS, ids=lambda m: m.__name__)
def test_a_builder_reads_only_its_slice(module):
    for name, kind in BUILDERS[module].items():
        function = getattr(module, name)
        takes = (function.__init__ if isinstance(function, type) else function).__annotations__["cfg"]
        assert kind.__name__ in takes, f"{module.__name__}.{name} takes {kind.__name__}"
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



# The record's own modules: resolve.py settles its values, slices.py cuts it into the slices.
RECORD = ("mmfast/train/resolve.py", "mmfast/train/slices.py")
# The run (train/run.py) and the commands (cli/) hand each builder its slice.
HANDS_OUT = ("mmfast/train/run.py", "mmfast/cli/")


def whole_config_takers(root: Path) -> list[str]:
    """``path:function(parameter)`` for every function under ``root``/mmfast, outside the run, the commands and
    the record's own modules, with a parameter that takes the whole configuration: one annotated with
    ``TrainConfig``, or a ``cfg`` left unannotated (or ``object``), which a whole record can be handed."""
    found = []
    for path in sorted((root / "mmfast").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel in RECORD or rel.startswith(HANDS_OUT):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            a = node.args
            for arg in (*a.posonlyargs, *a.args, *a.kwonlyargs):
                note = ast.unparse(arg.annotation) if arg.annotation is not None else None
                untyped = arg.arg == "cfg" and note in (None, "object", "object | None")
                if (note and "TrainConfig" in note) or untyped:
                    found.append(f"{rel}:{node.name}({arg.arg})")
    return found


def test_no_function_takes_the_whole_configuration_outside_the_run_and_the_commands():
    found = whole_config_takers(Path(mmfast.__file__).parent.parent)
    assert not found, f"these take the whole TrainConfig; type them with their slice (train/slices.py): {found}"


def test_the_check_finds_a_new_whole_configuration_taker(tmp_path):
    module = tmp_path / "mmfast" / "train" / "newcomer.py"
    module.parent.mkdir(parents=True)
    module.write_text(
        "def typed(cfg: TrainConfig, n: int): ...\n"
        "def untyped(cfg): ...\n"
        "def sliced(cfg: LoaderConfig): ...\n"
        "class Holder:\n    def __init__(self, whole: 'TrainConfig | None'): ...\n"
    )
    (tmp_path / "mmfast" / "cli").mkdir()
    (tmp_path / "mmfast" / "cli" / "main.py").write_text("def main(cfg: TrainConfig): ...\n")
    assert whole_config_takers(tmp_path) == [
        "mmfast/train/newcomer.py:typed(cfg)",
        "mmfast/train/newcomer.py:untyped(cfg)",
        "mmfast/train/newcomer.py:__init__(whole)",
    ]


def test_the_new_slices_are_cut_with_their_values():
    parts = slices(TrainConfig(model="clip", grad_clip=0.5, log_every=3, out="r", stop_grace=4.0, loss="siglip"))
    assert (parts.model.model, parts.model.loss, parts.loop.grad_clip, parts.loop.log_every) == (
        "clip",
        "siglip",
        0.5,
        3,
    )
    assert parts.run == RunConfig("r", 0, None, None, None, 4.0, False, 0.2)
    assert (parts.report.out, parts.report.model, parts.report.text_padding) == ("r", "clip", "longest")
