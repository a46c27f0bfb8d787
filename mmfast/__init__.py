"""mmfast: fast multimodal (image + text) training.

The pieces most users touch: ``MultimodalLoader`` / ``ImageLoader`` (DALI loaders), ``TokenCache``,
``build_model`` (fusion models), ``mmfast.train.train`` (the Accelerate loop), ``mmfast.train.profiler``,
``load_model`` (a trained run's model directory). The command-line entry points live in ``mmfast.cli``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from mmfast.util import moved

moved.install()  # the modules that moved in 0.2 keep their old names (mmfast.util.moved.MOVED)

# Imported on first use (PEP 562): `import mmfast.cli.train` must not pull in torch and DALI, so that a
# command's --help is quick and a Ctrl-C during start-up lands under the command's own handler.
_LAZY = {
    "ImageLoader": "mmfast.loading.image_loader",
    "MultimodalLoader": "mmfast.loading.multimodal",
    "MmfastModel": "mmfast.infer.model_dir",
    "load_model": "mmfast.infer.model_dir",
    "build_model": "mmfast.models",
    "TokenCache": "mmfast.data.token_cache",
}

if TYPE_CHECKING:
    from mmfast.data.token_cache import TokenCache
    from mmfast.infer.model_dir import MmfastModel, load_model
    from mmfast.loading.image_loader import ImageLoader
    from mmfast.loading.multimodal import MultimodalLoader
    from mmfast.models import build_model


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mmfast' has no attribute '{name}'")


__all__ = ["ImageLoader", "MmfastModel", "MultimodalLoader", "TokenCache", "build_model", "load_model"]
__version__ = "0.1.0"
