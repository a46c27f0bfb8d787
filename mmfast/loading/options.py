"""The names the loaders' options take, importable without torch or DALI (``mmfast-train --help`` lists
them): who finishes CPU-decoded crops, what happens to a bad image, and the image sources by name (their
classes are registered in ``sources.SOURCES``; a test holds the two together)."""

CPU_RESIZE = ("torch", "dali")  # who finishes CPU-decoded crops: the host's threads, or DALI's graph
ON_BAD_IMAGE = ("skip", "error")  # the choices of on_bad_image
SOURCE_NAMES = ("files", "wds", "stream")
