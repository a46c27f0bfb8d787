"""The registry of models by name (what ``--model`` picks). Imports nothing heavy: a built-in model is one line
here naming its class, imported on first use, so ``mmfast-train --help`` lists the names without torch. A model
from outside adds itself with ``register_model``.
"""

from __future__ import annotations

from collections.abc import Callable

from mmfast.util.registry import Registry

MODALITIES = ("image", "text")


def _check_model(name: str, cls: type) -> None:
    modalities = getattr(cls, "modalities", None)
    if not modalities or not set(modalities) <= set(MODALITIES):
        raise ValueError(f"model '{name}' ({cls.__qualname__}): declare modalities, a tuple of {MODALITIES}")


MODELS = Registry("model", check=_check_model)
MODELS.declare("early", "mmfast.models.fusion:EarlyFusion")
MODELS.declare("concat", "mmfast.models.fusion:ConcatFusion")
MODELS.declare("late", "mmfast.models.fusion:LateFusion")
MODELS.declare("image", "mmfast.models.fusion:ImageOnly")
MODELS.declare("text", "mmfast.models.fusion:TextOnly")
MODELS.declare("clip", "mmfast.models.dual:DualEncoder")
BUILTIN_MODELS = tuple(MODELS)  # the names above, before any model from outside


def register_model(name: str) -> Callable[[type], type]:
    """Class decorator: register a model under ``name``.

    The class declares ``modalities`` (a tuple of "image" and/or "text": the encoders the factory builds for
    it; the others are passed as None) and may declare ``config_options`` (names of training-config fields
    it takes as keyword arguments, e.g. late fusion's ``combine``). ``build_model`` calls
    ``cls(image, text, num_classes, hidden=..., dropout=..., **options)``; the forward takes the loader's
    batch dict and returns what the task's loss takes (logits (B, num_classes) for classification).

    Args:
        name: the name ``--model`` and ``build_model`` use.

    Returns:
        The decorator, which returns the class unchanged.

    Raises:
        ValueError: the name is taken by another class, or the class declares no valid ``modalities``.
    """
    return MODELS.register(name)
