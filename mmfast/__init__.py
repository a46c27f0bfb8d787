"""mmfast: fast multimodal (image + text) training.

The pieces most users touch: ``MultimodalLoader`` / ``ImageLoader`` / ``CaptionLoader`` (DALI loaders),
``TokenCache``, ``build_model`` (fusion models), ``mmfast.train.train`` (the Accelerate loop), ``LoopProfiler``
(the profiler's verdict on your own loop), ``load_model`` (a trained run's model directory). The command-line
entry points live in ``mmfast.cli``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from mmfast.util import moved

moved.install()  # the modules that moved in 0.2 keep their old names (mmfast.util.moved.MOVED)

# Imported on first use (PEP 562): `import mmfast.cli.train` must not pull in torch and DALI, so that a
# command's --help is quick and a Ctrl-C during start-up lands under the command's own handler.
_LAZY = {
    "CaptionLoader": "mmfast.loading.caption_loader",
    "ImageLoader": "mmfast.loading.image_loader",
    "LoopProfiler": "mmfast.train.loop_profiler",
    "MultimodalLoader": "mmfast.loading.multimodal",
    "MmfastModel": "mmfast.infer.model_dir",
    "ModelDirError": "mmfast.infer.model_config",
    "load_model": "mmfast.infer.model_dir",
    "build_model": "mmfast.models",
    "TokenCache": "mmfast.data.token_cache",
}

if TYPE_CHECKING:
    from mmfast.data.token_cache import TokenCache
    from mmfast.infer.model_config import ModelDirError
    from mmfast.infer.model_dir import MmfastModel, load_model
    from mmfast.loading.caption_loader import CaptionLoader
    from mmfast.loading.image_loader import ImageLoader
    from mmfast.loading.multimodal import MultimodalLoader
    from mmfast.models import build_model
    from mmfast.train.loop_profiler import LoopProfiler


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mmfast' has no attribute '{name}'")


__all__ = [
    "CaptionLoader",
    "ImageLoader",
    "LoopProfiler",
    "MmfastModel",
    "ModelDirError",
    "MultimodalLoader",
    "TokenCache",
    "build_model",
    "load_model",
]
__version__ = "0.1.0"
