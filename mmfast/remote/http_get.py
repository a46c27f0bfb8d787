"""One HTTP(S) GET of an object from a byte offset on: the transfer under ``remote.fetch_to`` for
``http(s)://`` URLs and for ``s3://`` through a presigned URL.

A whole shard is read with one request, straight from the socket, each piece handed to the caller as it
arrives (no event loop, no thread hop): the download's CPU is the kernel's copy, the hash and the write.
Redirects are followed (at most ``_REDIRECTS``); ``user:password@`` in the URL is sent as HTTP basic auth, to
that host only; the body is asked for unencoded (``Accept-Encoding: identity``). A read stalls for at most
``timeout_s``, and a body that trickles (under ``_MIN_BYTES`` in ``timeout_s``) fails as a timeout. An error
answer is raised as ``HTTPStatusError`` with its status and, for an S3-style error body, its code, so that
``remote_errors.classify`` sorts it as it sorts botocore's errors. Standard library only.
"""

from __future__ import annotations

import base64
import http.client
import re
import ssl
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field

_REDIRECTS = 5  # the most redirects one GET follows
_REDIRECT_STATUS = {301, 302, 303, 307, 308}
_PIECE = 1 << 20  # the most bytes one read from the socket returns
_MIN_BYTES = 64 << 10  # a body slower than this per timeout_s has stalled
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
    range and sends it whole), ``total`` the object's size (or where the range sent ends) when the server
    said it, ``content_type`` its Content-Type. ``response`` is None for a range that starts at the object's
    end: nothing is left to read."""

    offset: int
    total: int | None
    response: http.client.HTTPResponse | None
    connection: http.client.HTTPConnection | None
    timeout_s: float = field(default=30.0)
    content_type: str | None = None

    def pieces(self) -> Iterator[bytes]:
        """The body's bytes, a piece at a time, as they arrive.

        Raises:
            http.client.IncompleteRead: the connection ended before the announced length.
            TimeoutError: one read stalled past ``timeout_s``, or under ``_MIN_BYTES`` came in ``timeout_s``.
            OSError: the connection failed.
        """
        if self.response is None:
            return
        window, got = time.monotonic(), 0
        while piece := self.response.read1(_PIECE):
            yield piece
            got += len(piece)
            if (now := time.monotonic()) - window >= self.timeout_s:
                if got < _MIN_BYTES:
                    raise TimeoutError(f"the body stalled: {got} bytes in {now - window:.0f} s")
                window, got = now, 0

    def close(self) -> None:
        if self.connection is not None:
            self.connection.close()

    def __enter__(self) -> Body:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_body(url: str, offset: int = 0, *, timeout_s: float = 30.0) -> Body:
    """GET ``url`` from byte ``offset`` on (a ``Range`` request when ``offset`` > 0; asked again from 0 when
    the server answers with another range).

    Args:
        url: an ``http://`` or ``https://`` URL.
        offset: the first byte wanted.
        timeout_s: how long connecting, or any one read, may stall.

    Returns:
        The open body; close it (it is a context manager).

    Raises:
        HTTPStatusError: an answer other than 200 / 206 (after redirects), or too many redirects.
        OSError / http.client.HTTPException: the connection failed.
        ValueError: ``url`` is no http(s) URL, or its host or port cannot be read.
    """
    previous = None
    for _ in range(_REDIRECTS + 1):
        target = _Target(url, previous)
        connection, response = _request(target, offset, timeout_s)
        try:
            if response.status in _REDIRECT_STATUS and response.getheader("Location"):
                url, previous = urllib.parse.urljoin(url, response.getheader("Location")), target
                continue
            if response.status in (200, 206, 416):
                extent = _extent(response, offset)
                if extent is None:  # a range other than the one asked for: the whole object instead
                    connection.close()
                    return open_body(url, 0, timeout_s=timeout_s) if offset else _refuse(response, None)
                if response.status == 416:  # offset is the object's end: nothing is left to read
                    return Body(offset, offset, None, None, timeout_s)
                connection, keep = None, connection  # the Body closes it from here on
                return Body(*extent, response, keep, timeout_s, response.getheader("Content-Type"))
            _refuse(response, _error_code(response))
        finally:
            if connection is not None:
                connection.close()
    raise HTTPStatusError(310, f"more than {_REDIRECTS} redirects", None)


class _Target:
    """Where one request goes, and its basic-auth header: from the URL's ``user:password@``, else kept from
    the request redirected here when that went to the same host and port (and this one is not downgraded
    from https to http)."""

    def __init__(self, url: str, redirected_from: _Target | None = None):
        parts = urllib.parse.urlsplit(url)
        try:
            port = parts.port
        except ValueError:
            port = -1
        if parts.scheme not in ("http", "https") or not parts.hostname or port == -1:
            raise ValueError(  # the netloc is left out: it may hold a password
                f"not a readable http(s) URL ({parts.scheme}://...): percent-encode '#', '/', '?' and '@' in a "
                "password"
            )
        self.scheme, self.host, self.port = parts.scheme, parts.hostname, port
        self.path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self.auth = None
        if parts.username is not None:
            user = urllib.parse.unquote(parts.username) + ":" + urllib.parse.unquote(parts.password or "")
            self.auth = "Basic " + base64.b64encode(user.encode()).decode()
        elif redirected_from is not None and (redirected_from.host, redirected_from.port_or_default) == (
            self.host,
            self.port_or_default,
        ):
            if not (redirected_from.scheme == "https" and self.scheme == "http"):
                self.auth = redirected_from.auth

    @property
    def port_or_default(self) -> int:
        return self.port or (443 if self.scheme == "https" else 80)


def _request(target: _Target, offset: int, timeout_s: float):
    """Send the GET; returns (connection, response with its headers read)."""
    if target.scheme == "https":
        connection = http.client.HTTPSConnection(
            target.host, target.port, timeout=timeout_s, context=ssl.create_default_context()
        )
    else:
        connection = http.client.HTTPConnection(target.host, target.port, timeout=timeout_s)
    headers = {"Accept-Encoding": "identity", "User-Agent": "mmfast"}
    if offset:
        headers["Range"] = f"bytes={offset}-"
    if target.auth:
        headers["Authorization"] = target.auth
    try:
        connection.request("GET", target.path, headers=headers)
        return connection, connection.getresponse()
    except BaseException:
        connection.close()
        raise


def _extent(response: http.client.HTTPResponse, offset: int) -> tuple[int, int | None] | None:
    """(where the body starts in the object, where it ends: the object's size, or None when unknown) of a
    200, 206 or 416 answer; None when it is not the range asked for (a 416 for a range past the end)."""
    if response.status == 200:
        length = response.getheader("Content-Length")
        return 0, int(length) if length and length.isdigit() else None
    content_range = response.getheader("Content-Range", "").strip()
    if response.status == 416:
        match = re.fullmatch(r"bytes \*/(\d+)", content_range)
        return (offset, offset) if match and offset and int(match.group(1)) == offset else None
    match = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+|\*)", content_range)
    if match is None or int(match.group(1)) != offset:
        return None
    return offset, int(match.group(2)) + 1 if match.group(3) == "*" else int(match.group(3))


def _refuse(response: http.client.HTTPResponse, code: str | None):
    raise HTTPStatusError(response.status, response.reason, code)


def _error_code(response: http.client.HTTPResponse) -> str | None:
    """The ``<Code>`` of an S3-style error body, if the answer has one."""
    try:
        match = _S3_ERROR.search(response.read(_ERROR_BODY))
    except (OSError, http.client.HTTPException):
        return None
    return match.group(1).decode("ascii", "replace") if match else None
