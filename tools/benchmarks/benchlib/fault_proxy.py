"""A loopback HTTP proxy that injects network faults, for the tests and benchmarks of remote shard reading.

``FaultProxy(upstream)`` listens on 127.0.0.1 and forwards every request (GET, HEAD, PUT, POST, DELETE, with
their Range and other headers, so that s3fs's ListObjectsV2 / HeadObject / GetObject calls work against
moto's server behind it) to an upstream server that must itself be on loopback. Faults are programmed per
path pattern, or for the next N matching requests: a status answered instead of the upstream's (503 twice,
then the real object), a connection dropped half-way through the body, a delay before the answer. A link
can be slowed for a benchmark (``bandwidth_bytes_per_s`` per response, ``latency_s`` per request). It
counts requests per (method, path), so a test can assert how many times an object was fetched.

Standard library only. Every wait is bounded (socket timeouts, a join with a timeout at close).
"""

from __future__ import annotations

import contextlib
import fnmatch
import http.client
import ipaddress
import socket
import threading
import time
import urllib.parse
from collections import Counter
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_CHUNK = 64 * 1024
_SOCKET_TIMEOUT_S = 30.0  # a client or upstream that stalls this long is dropped, never waited on for ever
_JOIN_TIMEOUT_S = 5.0
# Headers that describe one connection, not the message, so they are not forwarded (RFC 9110, 7.6.1).
_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
}
# The S3 error code a status fault answers with, in S3's XML, so that botocore reads it as S3 would send it.
_S3_CODES = {403: "AccessDenied", 404: "NoSuchKey", 429: "SlowDown", 500: "InternalError", 503: "SlowDown"}


@dataclass
class Fault:
    """One programmed fault: which requests it hits and what it does to them.

    Attributes:
        pattern: an fnmatch pattern matched against the request's path (without the query).
        times: how many more matching requests it hits; None: every one.
        after: how many matching requests it lets through untouched first.
        methods: the methods it applies to.
        status: answer with this status (and an S3-style XML error body) instead of forwarding.
        drop_mid_body: forward, send the headers and half the body, then close the connection.
        delay_s: wait this long before answering.
    """

    pattern: str = "*"
    times: int | None = None
    after: int = 0
    methods: tuple[str, ...] = ("GET",)
    status: int | None = None
    drop_mid_body: bool = False
    delay_s: float = 0.0


class FaultProxy:
    """A forwarding HTTP server on 127.0.0.1 with programmable faults; a context manager.

    Args:
        upstream: the base URL of the real server (``http://127.0.0.1:PORT``); loopback only.
        bandwidth_bytes_per_s: the rate each response body is sent at (None: as fast as possible).
        latency_s: added before every answer, like a network's round trip.
    """

    def __init__(self, upstream: str, *, bandwidth_bytes_per_s: float | None = None, latency_s: float = 0.0):
        parts = urllib.parse.urlsplit(upstream)
        if parts.scheme != "http" or not parts.hostname or not _is_loopback(parts.hostname):
            raise ValueError(f"upstream {upstream!r}: must be an http:// address on loopback")
        self.upstream = (parts.hostname, parts.port or 80)
        self.bandwidth_bytes_per_s = bandwidth_bytes_per_s
        self.latency_s = latency_s
        self._faults: list[Fault] = []
        self._counts: Counter[tuple[str, str]] = Counter()
        self._lock = threading.Lock()
        self._server = _Server(("127.0.0.1", 0), _handler_for(self))
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """The proxy's base URL, ``http://127.0.0.1:PORT``."""
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> FaultProxy:
        """Start serving in a daemon thread."""
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop serving, close every open connection, and wait (bounded) for the serving thread."""
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(_JOIN_TIMEOUT_S)
            self._thread = None
        self._server.close_all()
        self._server.server_close()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def add_fault(self, pattern: str = "*", *, times: int | None = None, **what) -> Fault:
        """Program a fault (the fields of ``Fault``); the first fault that matches a request applies."""
        fault = Fault(pattern=pattern, times=times, **what)
        with self._lock:
            self._faults.append(fault)
        return fault

    def clear_faults(self) -> None:
        """Forward everything unchanged from now on."""
        with self._lock:
            self._faults.clear()

    def count(self, pattern: str = "*", method: str = "GET") -> int:
        """How many ``method`` requests (any method for ``"*"``) reached the proxy for paths matching
        ``pattern``."""
        with self._lock:
            return sum(
                n
                for (m, path), n in self._counts.items()
                if (method == "*" or m == method) and fnmatch.fnmatchcase(path, pattern)
            )

    def reset_counts(self) -> None:
        """Forget the requests counted so far."""
        with self._lock:
            self._counts.clear()

    def _take_fault(self, method: str, path: str) -> Fault | None:
        """Count the request and return the fault that applies to it (using up one of its ``times``)."""
        with self._lock:
            self._counts[(method, path)] += 1
            for fault in self._faults:
                if method in fault.methods and fnmatch.fnmatchcase(path, fault.pattern):
                    if fault.after > 0:
                        fault.after -= 1
                        continue
                    if fault.times is None:
                        return fault
                    if fault.times > 0:
                        fault.times -= 1
                        return fault
        return None


class _Server(ThreadingHTTPServer):
    """A threading server that remembers its open connections, so that closing it ends them too."""

    daemon_threads = True

    def __init__(self, address, handler):
        super().__init__(address, handler)
        self._open: set[socket.socket] = set()
        self._open_lock = threading.Lock()

    def process_request(self, request, client_address):
        with self._open_lock:
            self._open.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request):
        with self._open_lock:
            self._open.discard(request)
        super().shutdown_request(request)

    def close_all(self) -> None:
        with self._open_lock:
            open_now = list(self._open)
        for sock in open_now:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _handler_for(proxy: FaultProxy) -> type[BaseHTTPRequestHandler]:
    """The request handler class bound to ``proxy`` (http.server builds one handler per request)."""

    class Handler(_ProxyHandler):
        owner = proxy

    return Handler


class _ProxyHandler(BaseHTTPRequestHandler):
    """Forwards one request to the upstream, applying the owner's faults, link speed and latency."""

    owner: FaultProxy
    protocol_version = "HTTP/1.1"  # keep-alive, as S3 clients expect; every answer carries Content-Length
    timeout = _SOCKET_TIMEOUT_S

    def do_GET(self):
        self._serve()

    do_HEAD = do_PUT = do_POST = do_DELETE = do_GET

    def log_message(self, format, *args):  # noqa: A002 - http.server's signature
        """Quiet: tests and benchmarks print their own summaries."""

    def _serve(self) -> None:
        path = urllib.parse.urlsplit(self.path).path
        fault = self.owner._take_fault(self.command, path)
        body = self._request_body()
        if body is None:
            return
        delay = self.owner.latency_s + (fault.delay_s if fault else 0.0)
        if delay > 0:
            time.sleep(delay)
        if fault is not None and fault.status is not None:
            self._answer_status(fault.status, path)
            return
        self._forward(body, drop_mid_body=bool(fault and fault.drop_mid_body))

    def _request_body(self) -> bytes | None:
        """The request's body (Content-Length only); None after answering 411 to a chunked upload."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            self._answer_status(411, "")
            return None
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _answer_status(self, status: int, path: str) -> None:
        code = _S3_CODES.get(status, "InternalError" if status >= 500 else "InvalidRequest")
        body = (
            f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
            f"<Message>injected by FaultProxy</Message><Resource>{path}</Resource></Error>"
        ).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _forward(self, body: bytes, *, drop_mid_body: bool) -> None:
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
        conn = http.client.HTTPConnection(*self.owner.upstream, timeout=_SOCKET_TIMEOUT_S)
        try:
            conn.request(self.command, self.path, body=body or None, headers=headers)
            resp = conn.getresponse()
            payload = resp.read()  # whole: shards in tests and benchmarks are small enough to hold
            self.send_response(resp.status, resp.reason)
            for k, v in resp.getheaders():
                if k.lower() not in _HOP_BY_HOP and k.lower() != "content-length":
                    self.send_header(k, v)
            # A HEAD answer has no body but says how long the GET's would be.
            length = resp.getheader("Content-Length", "0") if self.command == "HEAD" else str(len(payload))
            self.send_header("Content-Length", length)
            self.end_headers()
            if self.command == "HEAD":
                return
            if drop_mid_body:
                self._send(payload[: len(payload) // 2])
                self._drop()
                return
            self._send(payload)
        finally:
            conn.close()

    def _send(self, payload: bytes) -> None:
        """Write ``payload``, paced to the owner's bandwidth when it has one."""
        rate = self.owner.bandwidth_bytes_per_s
        start = time.monotonic()
        for offset in range(0, len(payload), _CHUNK):
            chunk = payload[offset : offset + _CHUNK]
            self.wfile.write(chunk)
            if rate:
                ahead = (offset + len(chunk)) / rate - (time.monotonic() - start)
                if ahead > 0:
                    time.sleep(ahead)

    def _drop(self) -> None:
        """End the connection before the body the headers announced is complete, as a failing network
        does: the client sees the stream end short of its Content-Length."""
        self.wfile.flush()
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)
