"""Waiting, in Python, for a server to accept connections: a stop signal interrupts the wait at once, which
the native connect loops of torch's TCPStore and Ray's GCS client do not allow."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

_ATTEMPT_S = 1.0  # one connect attempt at most: the longest a stop signal waits for Python to run
_PAUSE_S = 0.2  # between two attempts


class UnknownHost(LookupError):
    """A host name that resolves to no address (a typo, or a name only another network knows)."""


def wait_for_listener(host: str, port: int, waiting: Callable[[str], None]) -> None:
    """Return once ``host:port`` accepts a TCP connection (which is closed at once).

    Args:
        waiting: called after each failed attempt with what failed ("Connection refused"); it raises to give up.

    Raises:
        UnknownHost: ``host`` does not resolve (raised at once: a wrong name does not heal by waiting).
    """
    while True:
        try:
            socket.create_connection((host, port), timeout=_ATTEMPT_S).close()
            return
        except socket.gaierror as e:
            if e.errno == socket.EAI_NONAME:
                raise UnknownHost(f"{host} resolves to no address ({e.strerror})") from None
            failure = e.strerror or str(e)
        except OSError as e:
            failure = e.strerror or str(e) or type(e).__name__
        waiting(failure)
        time.sleep(_PAUSE_S)
