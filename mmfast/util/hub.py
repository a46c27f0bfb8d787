"""A Hugging Face hub name asked for where the hub cannot be reached: refused at once, not after transformers'
half a minute of retries."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from urllib.parse import urlparse

_PROXIES = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")
_CACHED_FILES = ("config.json", "tokenizer_config.json")  # a model's, a tokenizer's


def refuse_unreachable_hub(name: str, what: str) -> None:
    """Raise when ``name`` is neither a local path nor in the Hugging Face cache and the hub's host cannot be
    reached (its name does not resolve, or a connection to it fails within 3 s). Behind a proxy, with
    ``HF_HUB_OFFLINE`` set, or for a local path, nothing is probed: the library's own message says more there.

    Args:
        name: what the user passed ("org/model").
        what: how the message names it ("text model", "tokenizer").

    Raises:
        ValueError: naming ``name``, the host, and what to do instead.
    """
    if Path(name).exists() or any(os.environ.get(v) for v in _PROXIES):
        return
    from huggingface_hub import constants, try_to_load_from_cache

    if constants.HF_HUB_OFFLINE:
        return
    try:
        if any(isinstance(try_to_load_from_cache(name, f), str) for f in _CACHED_FILES):
            return  # loaded from the cache, as transformers would
    except ValueError:  # not a valid repo id: the library's own message names it
        return
    host = urlparse(constants.ENDPOINT).hostname or constants.ENDPOINT
    try:
        socket.create_connection((host, 443), timeout=3).close()
    except OSError as e:
        raise ValueError(
            f"{what} '{name}' is not a local directory or in the Hugging Face cache, and the hub ({host}) cannot "
            f"be reached from here ({e}). Download it where there is network (huggingface-cli download "
            f"{name} --local-dir DIR) and pass DIR"
        ) from None
