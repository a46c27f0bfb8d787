"""The registry of models by name (what ``--model`` picks): ``register_model`` adds one. Imports nothing heavy.

``MODELS`` here holds the built-in models once ``mmfast.models.factory`` has been imported (their module,
``fusion``, registers them); read the registry as ``mmfast.models.MODELS``, which imports them first.
"""

from __future__ import annotations

from collections.abc import Callable

MODELS: dict[str, type] = {}
MODALITIES = ("image", "text")


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

    def add(cls: type) -> type:
        modalities = getattr(cls, "modalities", None)
        if not modalities or not set(modalities) <= set(MODALITIES):
            raise ValueError(f"model '{name}' ({cls.__qualname__}): declare modalities, a tuple of {MODALITIES}")
        if name in MODELS and MODELS[name] is not cls:
            raise ValueError(f"model '{name}' is already registered ({MODELS[name].__qualname__})")
        MODELS[name] = cls
        return cls

    return add
