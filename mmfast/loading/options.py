"""The names the loaders' options take, importable without torch or DALI (``mmfast-train --help`` lists
them): who finishes CPU-decoded crops, what happens to a bad image, and the image sources by name (``SOURCES``:
a new source is its class and one line here)."""

from mmfast.util.registry import Registry

CPU_RESIZE = ("torch", "dali")  # who finishes CPU-decoded crops: the host's threads, or DALI's graph
ON_BAD_IMAGE = ("skip", "error")  # the choices of on_bad_image
CAPABILITIES = ("ordered_by_loader", "can_skip_bad", "needs_paths")  # what every source declares (sources.py)


def _check_source(name: str, cls: type) -> None:
    missing = [c for c in CAPABILITIES if not hasattr(cls, c)]
    if missing:
        raise ValueError(f"source '{name}' ({cls.__qualname__}): declare {', '.join(missing)}")


SOURCES = Registry("source", check=_check_source)
SOURCES.declare("files", "mmfast.loading.sources:FilesSource")
SOURCES.declare("wds", "mmfast.loading.sources:WdsSource")
SOURCES.declare("stream", "mmfast.loading.stream_source:StreamSource")
