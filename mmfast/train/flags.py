"""The command line of training: ``build_parser`` (argparse's mirror of ``TrainConfig``, every flag's help from
its field), ``load_config_file`` (--config YAML/JSON) and ``parse_config`` (both, flags winning)."""

from __future__ import annotations

import argparse
import json
from dataclasses import MISSING, fields
from pathlib import Path

from mmfast.models.catalog import IMAGE_BACKBONES, PRESETS
from mmfast.train.config import GROUPS, PRESET_FIELDS, TRACKERS, TrainConfig, flag, help_choices
from mmfast.util.args import Parser


def _help(f, choice: tuple[str, ...] | None) -> str:
    default = None if f.default is MISSING else f.default
    shown = "the preset's" if default is None and f.name in PRESET_FIELDS else default
    extra = f"; choices: {', '.join(choice)}" if choice else ""
    if f.name == "report_to":
        extra = f"; choices: {', '.join(TRACKERS)}, all (those installed)"
    if f.name == "preset":
        extra = "; choices: " + "; ".join(f"{k} ({v.note})" for k, v in PRESETS.items())
    if f.name == "image_backbone":
        extra = f"; choices: {', '.join(IMAGE_BACKBONES)}, timm:<name>"
    return f"{f.metadata['help']}{extra} (default: {'none' if shown is None else shown})".replace("%", "%%")


def build_parser() -> argparse.ArgumentParser:
    """argparse mirror of TrainConfig, grouped as GROUPS; every default is SUPPRESS so that only the flags the
    user gave are set. Each flag's help is its field's meaning, choices and default."""
    p = Parser(
        description="Train an image+text model (a fusion classifier, or a dual encoder: --model clip). "
        "Flags map one to one to the keys of --config (a YAML/JSON file; flags win). Without --data it trains "
        "the tiny preset on the built-in demo set.",
        argument_default=argparse.SUPPRESS,
    )
    p.add_argument("--config", help="YAML or JSON file with the same keys as the flags (flags win)")
    groups = {g: p.add_argument_group(g) for g in GROUPS}
    allowed = help_choices()
    for f in fields(TrainConfig):
        g, kind = groups[f.metadata["group"]], str(f.type)
        help_, choice = _help(f, allowed.get(f.name)), allowed.get(f.name)
        meta = {"metavar": "{" + ",".join(choice) + "}"} if choice and f.name != "preset" else {}
        if f.name == "data":  # given again: a mix of prepared datasets (mmfast/prepare/mix.py)
            g.add_argument(flag(f.name), dest=f.name, action="append", metavar="DATA", help=help_)
        elif "bool" in kind:
            g.add_argument(flag(f.name), dest=f.name, action=argparse.BooleanOptionalAction, help=help_)
        elif "float" in kind:
            g.add_argument(flag(f.name), dest=f.name, type=float, help=help_)
        elif "int" in kind:
            g.add_argument(flag(f.name), dest=f.name, type=int, help=help_)
        else:
            g.add_argument(flag(f.name), dest=f.name, help=help_, **meta)
    return p


def load_config_file(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--config {path}: no such file")
    text = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        import yaml  # PyYAML: only for a --config file

        data = yaml.safe_load(text) or {}
    else:
        data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping of keys to values")
    data = {k.replace("-", "_"): v for k, v in data.items()}
    known = {f.name for f in fields(TrainConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"--config {path}: unknown keys {unknown}; valid keys: {sorted(known)}")
    return data


def parse_config(argv: list[str] | None) -> TrainConfig:
    """Resolve the configuration from a file (optional) and flags."""
    ns = vars(build_parser().parse_args(argv))
    if "data" in ns and len(ns["data"]) == 1:  # one --data: its path, as a config file gives it
        ns["data"] = ns["data"][0]
    file_values = load_config_file(ns.pop("config")) if "config" in ns else {}
    try:
        return TrainConfig(**{**file_values, **ns})
    except TypeError as e:
        raise ValueError(f"bad configuration: {e}") from e

