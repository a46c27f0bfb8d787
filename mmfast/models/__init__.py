"""Layer 2, models: what turns a batch into a model's output. ``catalog`` (the names users pick parts from:
image backbones, presets), ``registry`` (``MODELS``: a new model is its module and one line there, or a class
decorated with ``register_model`` from outside), ``factory`` (``build_model``), ``encoders``, ``fusion`` and
``dual`` (the built-in models).

The torch-backed names (the factory, the classes) are imported on first use (PEP 562, as ``mmfast`` itself
does): ``mmfast-train --help`` reads the catalog and the registry's names without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from mmfast.models.catalog import COMBINE, IMAGE_BACKBONES, PRESETS, Preset, get_preset
from mmfast.models.registry import BUILTIN_MODELS, MODELS, register_model

_LAZY = {
    "build_model": "mmfast.models.factory",
    "model_class": "mmfast.models.factory",
    "ConcatFusion": "mmfast.models.fusion",
    "EarlyFusion": "mmfast.models.fusion",
    "ImageOnly": "mmfast.models.fusion",
    "LateFusion": "mmfast.models.fusion",
    "TextOnly": "mmfast.models.fusion",
    "ImageEncoder": "mmfast.models.encoders",
    "TextEncoder": "mmfast.models.encoders",
}

if TYPE_CHECKING:
    from mmfast.models.encoders import ImageEncoder, TextEncoder
    from mmfast.models.factory import build_model, model_class
    from mmfast.models.fusion import ConcatFusion, EarlyFusion, ImageOnly, LateFusion, TextOnly


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mmfast.models' has no attribute '{name}'")


__all__ = [
    "BUILTIN_MODELS",
    "COMBINE",
    "IMAGE_BACKBONES",
    "MODELS",
    "PRESETS",
    "ConcatFusion",
    "EarlyFusion",
    "ImageEncoder",
    "ImageOnly",
    "LateFusion",
    "Preset",
    "TextEncoder",
    "TextOnly",
    "build_model",
    "get_preset",
    "model_class",
    "register_model",
]
