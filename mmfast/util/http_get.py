"""One HTTP(S) GET of an object from a byte offset on, read into a reusable buffer: the transfer under
``remote.fetch_to`` for ``http(s)://`` URLs and for ``s3://`` through a presigned URL.

A whole shard is read with one request, straight from the socket into one buffer, and each piece is handed
to the caller as a view (no copy, no event loop, no thread hop): the download's CPU is the kernel's copy,
the hash and the write. Redirects are followed (at most ``_REDIRECTS``); ``user:password@`` in the URL is
sent as HTTP basic auth; the body is asked for unencoded (``Accept-Encoding: identity``). An error answer
is raised as ``HTTPStatusError`` with its status and, for an S3 error body, its code, so that
``remote_errors.classify`` sorts it as it sorts botocore's errors. Standard library only.
"""

from __future__ import annotations

import base64
import http.client
import re
import ssl
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass

_REDIRECTS = 5  # the most redirects one GET follows
_REDIRECT_STATUS = {301, 302, 303, 307, 308}
_BUFFER = 1 << 20  # bytes read from the socket per piece
_ERROR_BODY = 64 << 10  # the most of an error answer's body read (for its S3 code)
_S3_ERROR = re.compile(rb"<Code>([^<]{1,100})</Code>")


class HTTPStatusError(Exception):
    """An error answer. ``status`` is its HTTP status; ``response`` holds an S3 error code in botocore's
    shape (``{"Error": {"Code": ...}}``) when the body carried one, else None."""

    def __init__(self, status: int, reason: str, code: str | None):
        super().__init__(f"HTTP {status} {reason}" + (f" ({code})" if code else ""))
        self.status = status
        self.response = {"Error": {"Code": code}} if code else None


@dataclass
class Body:
    """An open answer: ``offset`` is where its bytes start in the object (0 when the server ignored the
    range and sends it whole), ``total`` the object's size when the server said it."""

    offset: int
    total: int | None
    _response: http.client.HTTPResponse
    _connection: http.client.HTTPConnection

    def pieces(self) -> Iterator[memoryview]:
        """The body's bytes, a buffer at a time; each view is valid until the next one is asked for.

        Raises:
            http.client.IncompleteRead: the connection ended before the announced length.
            OSError: the connection failed or stalled past its timeout (``TimeoutError``).
        """
        buffer = memoryview(bytearray(_BUFFER))
        while n := self._response.readinto(buffer):
            yield buffer[:n]

    def close(self) -> None:
        self._connection.close()

    def __enter__(self) -> Body:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_body(url: str, offset: int = 0, *, timeout_s: float = 30.0) -> Body:
    """GET ``url`` from byte ``offset`` on (a ``Range`` request when ``offset`` > 0).

    Args:
        url: an ``http://`` or ``https://`` URL.
        offset: the first byte wanted.
        timeout_s: how long connecting, or any one read, may stall.

    Returns:
        The open body; close it (it is a context manager).

    Raises:
        HTTPStatusError: an answer other than 200 / 206 (after redirects), or too many redirects.
        OSError / http.client.HTTPException: the connection failed.
    """
    for _ in range(_REDIRECTS + 1):
        connection, response = _request(url, offset, timeout_s)
        if response.status in _REDIRECT_STATUS and response.getheader("Location"):
            url = urllib.parse.urljoin(url, response.getheader("Location"))
            connection.close()
            continue
        if response.status in (200, 206):
            start, total = _extent(response, offset)
            return Body(start, total, response, connection)
        code = _error_code(response)
        connection.close()
        raise HTTPStatusError(response.status, response.reason, code)
    connection.close()
    raise HTTPStatusError(310, f"more than {_REDIRECTS} redirects", None)


def _request(url: str, offset: int, timeout_s: float):
    """Send the GET; returns (connection, response with its headers read)."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {parts.scheme}://{parts.hostname or ''}")
    if parts.scheme == "https":
        connection = http.client.HTTPSConnection(
            parts.hostname, parts.port, timeout=timeout_s, context=ssl.create_default_context()
        )
    else:
        connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s)
    headers = {"Accept-Encoding": "identity", "User-Agent": "mmfast"}
    if offset:
        headers["Range"] = f"bytes={offset}-"
    if parts.username is not None:
        user = urllib.parse.unquote(parts.username) + ":" + urllib.parse.unquote(parts.password or "")
        headers["Authorization"] = "Basic " + base64.b64encode(user.encode()).decode()
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    try:
        connection.request("GET", target, headers=headers)
        return connection, connection.getresponse()
    except BaseException:
        connection.close()
        raise


def _extent(response: http.client.HTTPResponse, offset: int) -> tuple[int, int | None]:
    """(where the body starts in the object, the object's size or None) from a 200 or 206 answer."""
    if response.status == 206:
        match = re.fullmatch(r"bytes (\d+)-\d+/(\d+|\*)", response.getheader("Content-Range", "").strip())
        if match is None or int(match.group(1)) != offset:
            raise HTTPStatusError(206, f"a range other than bytes={offset}- was sent", None)
        return offset, None if match.group(2) == "*" else int(match.group(2))
    length = response.getheader("Content-Length")
    return 0, int(length) if length and length.isdigit() else None


def _error_code(response: http.client.HTTPResponse) -> str | None:
    """The ``<Code>`` of an S3 error body, if the answer has one."""
    try:
        match = _S3_ERROR.search(response.read(_ERROR_BODY))
    except (OSError, http.client.HTTPException):
        return None
    return match.group(1).decode("ascii", "replace") if match else None
