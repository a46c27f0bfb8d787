"""A Hugging Face hub name asked for where the hub cannot be reached: refused at once, not after transformers'
half a minute of retries."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path
from urllib.parse import urlparse

_PROXIES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")
_WAIT_S = 3.0  # for the host's name to resolve, then for a connection
_CACHED_FILES = ("config.json", "tokenizer_config.json")  # a model's, a tokenizer's


def refuse_unreachable_hub(name: str, what: str) -> None:
    """Raise when ``name`` is neither a local path nor in the Hugging Face cache and the hub cannot be reached:
    its host does not resolve within 3 s, or its port (``HF_ENDPOINT``'s) takes no connection within 3 s. Behind
    a proxy, with ``HF_HUB_OFFLINE`` set, or for a local path, nothing is probed: the library's own message says
    more there.

    Args:
        name: what the user passed ("org/model").
        what: how the message names it ("text model", "tokenizer").

    Raises:
        ValueError: naming ``name``, the host, and what to do instead.
    """
    if Path(name).exists() or any(os.environ.get(v) for v in _PROXIES):
        return
    from huggingface_hub import constants, try_to_load_from_cache  # a slow import, only for a hub name

    if constants.HF_HUB_OFFLINE:
        return
    try:
        if any(isinstance(try_to_load_from_cache(name, f), str) for f in _CACHED_FILES):
            return  # loaded from the cache, as transformers would
    except ValueError:  # not a valid repo id: the library's own message names it
        return
    url = urlparse(constants.ENDPOINT)
    host = url.hostname or constants.ENDPOINT
    try:
        _connect(host, url.port or (80 if url.scheme == "http" else 443))
    except OSError as e:
        raise ValueError(
            f"{what} '{name}' is not a local directory or in the Hugging Face cache, and the hub ({host}) cannot "
            f"be reached from here ({e}). Download it where there is network (huggingface-cli download "
            f"{name} --local-dir DIR) and pass DIR"
        ) from None


def _connect(host: str, port: int) -> None:
    """Resolve ``host`` and open a connection to ``port`` on it, each within ``_WAIT_S``; OSError otherwise. The
    resolver is asked on a thread of its own, as ``getaddrinfo`` takes no timeout."""
    found: list = []

    def resolve() -> None:
        try:
            found.append(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        except OSError as e:
            found.append(e)

    asking = threading.Thread(target=resolve, daemon=True)
    asking.start()
    asking.join(_WAIT_S)
    if not found:
        raise OSError(f"no answer from the resolver for {host} within {_WAIT_S:.0f} s")
    if isinstance(found[0], OSError):
        raise found[0]
    family, kind, proto, _, address = found[0][0]
    with socket.socket(family, kind, proto) as sock:
        sock.settimeout(_WAIT_S)
        sock.connect(address)
