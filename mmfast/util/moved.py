"""The modules mmfast has moved, still importable by their old names: ``import mmfast.loader`` gives
``mmfast.loading.image_loader`` itself (the same module object, so patches and ``isinstance`` agree) and
warns once, naming the new place and the release that drops the old name (``REMOVED_IN``; tests/test_layout.py
fails once pyproject.toml's version reaches it). Installed on ``sys.meta_path`` by ``mmfast/__init__.py``; it
only answers names the package no longer has."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings

REMOVED_IN = "0.2.0"  # the release without these names (and without this module)
MOVED = {  # old name -> where it lives now (docs/architecture.md, "Layers")
    "mmfast.dataset": "mmfast.data.dataset",
    "mmfast.decoded": "mmfast.loading.decoded",
    "mmfast.demo": "mmfast.prepare.demo",
    "mmfast.device": "mmfast.loading.device",
    "mmfast.downscale": "mmfast.prepare.downscale",
    "mmfast.dropin": "mmfast.loading.dropin",
    "mmfast.export": "mmfast.infer.export",
    "mmfast.file_health": "mmfast.loading.file_health",
    "mmfast.fsutil": "mmfast.util.fsutil",
    "mmfast.host_finish": "mmfast.loading.host_finish",
    "mmfast.loader": "mmfast.loading.image_loader",
    "mmfast.manifest": "mmfast.inputs.manifest",
    "mmfast.metrics": "mmfast.tasks.classification",
    "mmfast.model_dir": "mmfast.infer.model_dir",
    "mmfast.multimodal": "mmfast.loading.multimodal",
    "mmfast.predict": "mmfast.infer.predict",
    "mmfast.predict_inputs": "mmfast.infer.predict_inputs",
    "mmfast.prepare_parts": "mmfast.prepare.parts",
    "mmfast.profiler": "mmfast.train.profiler",
    "mmfast.quiet": "mmfast.util.quiet",
    "mmfast.sampling": "mmfast.loading.sampling",
    "mmfast.sources": "mmfast.loading.sources",
    "mmfast.split": "mmfast.prepare.split",
    "mmfast.stream": "mmfast.loading.stream",
    "mmfast.token_cache": "mmfast.data.token_cache",
    "mmfast.tokenizer": "mmfast.data.tokenizer",
    "mmfast.validate": "mmfast.data.validate",
    "mmfast.wds": "mmfast.prepare.wds_export",
}


class MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old module name and loads it as the module that replaced it."""

    def find_spec(self, name, path=None, target=None):
        if name not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(name, self)

    def create_module(self, spec):
        new = MOVED[spec.name]
        warnings.warn(
            f"{spec.name} has moved to {new}: import it from there (mmfast {REMOVED_IN} removes the old name)",
            DeprecationWarning,
            stacklevel=2,
        )
        return importlib.import_module(new)

    def exec_module(self, module) -> None:
        """Nothing to run: the module is the new one, already imported."""


def install() -> None:
    if not any(isinstance(f, MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(MovedFinder())
