"""mmfast.remote.objects and mmfast.remote.shard_cache against real servers on loopback: Python's http.server over
a temp folder and moto's S3 server, each behind the FaultProxy of tools/benchmarks/benchlib, which drops
connections, answers 503 / 403 / 404 and counts the requests that reach the store."""

from __future__ import annotations

import base64
import contextlib
import errno
import functools
import hashlib
import http.client
import logging
import multiprocessing
import os
import resource
import subprocess
import sys
import threading
import time
import traceback
from http.server import BaseHTTPRequestHandler, SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from mmfast.remote import errors as remote_errors
from mmfast.remote import objects as remote
from mmfast.remote.errors import PermanentRemoteError, TransientRemoteError
from mmfast.remote.http_get import HTTPStatusError
from mmfast.remote.shard_cache import CacheFullError, ShardCache
from mmfast.util.fsutil import MARKER, OutputDirError, write_marker
from tools.benchmarks.benchlib.fault_proxy import FaultProxy

ROOT = Path(__file__).resolve().parents[2]
SHARD = 100_000  # bytes per cache-test shard
SECRET_KEY = "fakeSecretKey0123456789SHOULDNEVERPRINT"
SIGNATURE = "deadbeefSIGNATUREnotforprinting"
BUCKET = "mmfast-test"
FAST = {"backoff_s": 0.01, "timeout_s": 10.0}  # retries that do not slow the tests down


def _blob(n: int, seed: int) -> bytes:
    """``n`` deterministic bytes that differ per seed."""
    out, block = bytearray(), hashlib.sha256(str(seed).encode()).digest()
    while len(out) < n:
        block = hashlib.sha256(block).digest()
        out += block * 64
    return bytes(out[:n])


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _files(root: Path) -> dict[str, int]:
    """{path under root: size} of the files there now (one a background eviction removes meanwhile is left out)."""
    found = {}
    for p in root.rglob("*"):
        with contextlib.suppress(FileNotFoundError):
            if p.is_file():
                found[str(p.relative_to(root))] = p.stat().st_size
    return found


class _Handler(SimpleHTTPRequestHandler):
    """http.server's file handler, quiet; ``/moved/NAME`` answers 302 to ``/NAME`` and ``/loop`` redirects to
    itself; the Authorization header of every GET is kept in ``server.auth``."""

    def do_GET(self):
        self.server.auth.append(self.headers.get("Authorization"))
        if self.path.startswith("/moved/") or self.path == "/loop":
            self.send_response(302)
            self.send_header("Location", self.path.removeprefix("/moved"))
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        super().do_GET()

    def log_message(self, format, *args):  # noqa: A002
        pass


@pytest.fixture(scope="module")
def http_server(tmp_path_factory):
    """An http.server over a folder of shards, with ``url``, ``root``, ``blobs`` ({name: bytes}) and ``auth``."""
    root = tmp_path_factory.mktemp("store")
    blobs = {"big.bin": _blob(3_000_000, 0)} | {f"shard-{i:05d}.tar": _blob(SHARD, i + 1) for i in range(8)}
    for name, data in blobs.items():
        (root / name).write_bytes(data)
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Handler, directory=str(root)))
    server.url, server.root = f"http://127.0.0.1:{server.server_address[1]}", root
    server.blobs, server.auth = blobs, []
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join(5)


@pytest.fixture(scope="module")
def http_store(http_server):
    """(base URL, folder, {name: bytes}) of the http.server."""
    return http_server.url, http_server.root, http_server.blobs


@pytest.fixture
def proxy(http_store):
    with FaultProxy(http_store[0]) as p:
        yield p


@pytest.fixture(scope="module")
def s3_store():
    """moto's S3 server with a bucket of objects, and fake credentials in the environment: (URL, {key: bytes})."""
    moto_server = pytest.importorskip("moto.server")
    boto3 = pytest.importorskip("boto3")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AWS_ACCESS_KEY_ID", "AKIAFAKEFAKEFAKEFAKE")
        mp.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
        mp.setenv("AWS_DEFAULT_REGION", "us-east-1")
        mp.delenv("AWS_PROFILE", raising=False)
        server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        url = f"http://{host}:{port}"
        client = boto3.client("s3", endpoint_url=url)
        client.create_bucket(Bucket=BUCKET)
        blobs = {"data/shard-00000.tar": _blob(9 << 20, 10), "data/shard-00001.tar": _blob(1000, 11)}
        blobs["data/other.txt"] = b"not a shard"
        for key, data in blobs.items():
            client.put_object(Bucket=BUCKET, Key=key, Body=data)
        yield url, blobs
        server.stop()


@pytest.fixture
def s3_proxy(s3_store, monkeypatch):
    """A FaultProxy in front of moto, and AWS_ENDPOINT_URL pointing at it (as a user's S3-compatible server)."""
    with FaultProxy(s3_store[0]) as p:
        monkeypatch.setenv("AWS_ENDPOINT_URL", p.url)
        yield p


def test_is_remote_tells_stores_from_local_paths():
    for path in ("s3://b/k", "gs://b/k", "gcs://b/k", "hf://datasets/o/n/x.tar", "http://h/x", "https://h/x"):
        assert remote.is_remote(path), path
    for path in ("/data/x.tar", "rel/x.tar", "file:///data/x.tar", Path("/data/x.tar"), "C:x"):
        assert not remote.is_remote(path), path


def test_redact_removes_credentials_and_signatures_but_keeps_the_rest():
    url = (
        "https://alice:pa55word@store.example/bucket/shard-00001.tar?X-Amz-Algorithm=AWS4-HMAC-SHA256"
        f"&X-Amz-Credential=AKIA%2F2026&X-Amz-Signature={SIGNATURE}&X-Amz-Security-Token=tok&part=3&sig=s&token=t"
    )
    assert remote_errors.redact(url) == (
        "https://store.example/bucket/shard-00001.tar?X-Amz-Algorithm=AWS4-HMAC-SHA256"
        "&X-Amz-Credential=***&X-Amz-Signature=***&X-Amz-Security-Token=***&part=3&sig=***&token=***"
    )
    assert remote_errors.redact("s3://bucket/key@v1/x.tar") == "s3://bucket/key@v1/x.tar"
    assert remote_errors.redact(f"error at {url} (retry)").startswith("error at https://store.example/bucket/")


def test_redact_masks_a_secret_from_the_environment(monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    assert remote_errors.redact(f"signing with {SECRET_KEY} failed") == "signing with *** failed"


def test_classify_sorts_library_errors_into_transient_and_permanent():
    aiohttp = pytest.importorskip("aiohttp")
    botocore_exceptions = pytest.importorskip("botocore.exceptions")

    def http_error(status):
        return aiohttp.ClientResponseError(None, (), status=status)

    def s3_error(code, status):
        body = {"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}
        return botocore_exceptions.ClientError(body, "GetObject")

    def wrapped(outer, inner):
        try:
            raise outer from inner
        except BaseException as e:
            return e

    transient = [
        ConnectionResetError(),
        ConnectionRefusedError(),
        TimeoutError(),
        http.client.IncompleteRead(b"x", 10),
        aiohttp.ClientPayloadError("cut short"),
        aiohttp.ServerDisconnectedError(),
        http_error(503),
        http_error(500),
        http_error(429),
        s3_error("SlowDown", 503),
        s3_error("InternalError", 500),
        s3_error("RequestTimeout", 400),
        wrapped(OSError(errno.EBUSY, "SlowDown"), s3_error("SlowDown", 503)),  # as s3fs translates it
        wrapped(FileNotFoundError("http://h/x"), ConnectionRefusedError()),  # as fsspec's http info wraps it
        botocore_exceptions.EndpointConnectionError(endpoint_url="http://h"),
        HTTPStatusError(503, "Service Unavailable", "SlowDown"),  # what remote's own GET raises
        HTTPStatusError(502, "Bad Gateway", None),
        HTTPStatusError(400, "Bad Request", "RequestTimeout"),
        HTTPStatusError(503, "Service Unavailable", "ServerBusy"),  # a code not S3's: its status decides
    ]
    permanent = [
        http_error(403),
        http_error(401),
        http_error(404),
        http_error(501),
        FileNotFoundError("bucket/key"),
        PermissionError("denied"),
        s3_error("NoSuchKey", 404),
        s3_error("AccessDenied", 403),
        s3_error("NoSuchBucket", 404),
        wrapped(PermissionError("x"), s3_error("AccessDenied", 403)),
        ValueError("a bug"),
        HTTPStatusError(403, "Forbidden", "SignatureDoesNotMatch"),
        HTTPStatusError(404, "Not Found", None),
        HTTPStatusError(416, "Range Not Satisfiable", "InvalidRange"),
    ]
    assert [remote_errors.classify(e) for e in transient] == ["transient"] * len(transient)
    assert [remote_errors.classify(e) for e in permanent] == ["permanent"] * len(permanent)


def test_fetch_over_http_gives_the_exact_bytes_atomically(proxy, http_store, tmp_path):
    data = http_store[2]["big.bin"]
    stats = remote.FetchStats()
    out = remote.fetch_to(
        f"{proxy.url}/big.bin", tmp_path / "big.bin", size=len(data), sha256=_sha(data), stats=stats
    )
    assert out == tmp_path / "big.bin" and out.read_bytes() == data
    assert (stats.fetches, stats.retries, stats.bytes) == (1, 0, len(data))
    assert sorted(os.listdir(tmp_path)) == ["big.bin"]  # no partial file left beside it
    assert proxy.count("/big.bin") == 1


def test_fetch_from_s3_on_moto_gives_the_exact_bytes(s3_proxy, s3_store, tmp_path):
    for key, data in s3_store[1].items():
        dest = tmp_path / key.replace("/", "_")
        remote.fetch_to(f"s3://{BUCKET}/{key}", dest, size=len(data), sha256=_sha(data), **FAST)
        assert dest.read_bytes() == data, key
    assert s3_proxy.count(f"/{BUCKET}/data/shard-00000.tar") == 1  # 9 MiB in one GET
    assert s3_proxy.count(f"/{BUCKET}/*", method="*") == 3  # no HEAD or listing before the GET


def test_a_dropped_s3_read_resumes_where_it_stopped(s3_proxy, s3_store, tmp_path):
    key = "data/shard-00000.tar"
    data = s3_store[1][key]
    s3_proxy.add_fault(f"/{BUCKET}/{key}", times=1, drop_mid_body=True)  # half the body, then the connection ends
    stats = remote.FetchStats()
    dest = remote.fetch_to(
        f"s3://{BUCKET}/{key}", tmp_path / "s", size=len(data), sha256=_sha(data), stats=stats, **FAST
    )
    assert dest.read_bytes() == data
    assert stats.retries == 1 and s3_proxy.count(f"/{BUCKET}/{key}") == 2
    assert stats.bytes == len(data)  # the second GET asked for the second half only: nothing read twice


@pytest.fixture
def s3_forward_proxy(s3_store, monkeypatch):
    """HTTP_PROXY naming a FaultProxy (forwarding to moto) and an endpoint nothing listens on: what reaches the
    store went through the proxy, read by s3fs (a plain GET to the endpoint would be refused)."""
    with FaultProxy(s3_store[0]) as p:
        monkeypatch.setenv("HTTP_PROXY", p.url)
        monkeypatch.delenv("NO_PROXY", raising=False)
        monkeypatch.delenv("no_proxy", raising=False)
        monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.3:9")
        yield p


def test_with_a_proxy_in_the_environment_s3_is_read_through_it(s3_forward_proxy, s3_store, tmp_path):
    key = "data/shard-00001.tar"
    data = s3_store[1][key]
    remote.fetch_to(f"s3://{BUCKET}/{key}", tmp_path / "p", size=len(data), sha256=_sha(data), retries=0)
    assert s3_forward_proxy.count(f"/{BUCKET}/{key}") == 1
    assert (tmp_path / "p").read_bytes() == data


def test_read_by_s3fs_a_dropped_block_resumes_at_that_block(s3_forward_proxy, s3_store, tmp_path):
    key = "data/shard-00000.tar"
    data = s3_store[1][key]
    s3_forward_proxy.add_fault(f"/{BUCKET}/{key}", after=1, times=1, drop_mid_body=True)  # the 2nd block's GET
    stats = remote.FetchStats()
    dest = remote.fetch_to(
        f"s3://{BUCKET}/{key}", tmp_path / "s", size=len(data), sha256=_sha(data), stats=stats, **FAST
    )
    assert dest.read_bytes() == data and stats.retries == 1
    assert s3_forward_proxy.count(f"/{BUCKET}/{key}") == 3  # block 1, block 2 dropped, block 2 again: not block 1


def test_a_dropped_http_read_resumes_where_the_server_serves_ranges(s3_store, tmp_path):
    """An https-style URL to a store that serves ranges (moto's, presigned): the retry asks for the rest."""
    boto3 = pytest.importorskip("boto3")
    key = "data/shard-00000.tar"
    data = s3_store[1][key]
    with FaultProxy(s3_store[0]) as p:
        client = boto3.client("s3", endpoint_url=p.url)
        url = client.generate_presigned_url("get_object", Params={"Bucket": BUCKET, "Key": key}, ExpiresIn=600)
        p.add_fault(f"/{BUCKET}/{key}", times=1, drop_mid_body=True)
        stats = remote.FetchStats()
        remote.fetch_to(url, tmp_path / "h", size=len(data), sha256=_sha(data), stats=stats, **FAST)
    assert (tmp_path / "h").read_bytes() == data
    assert (stats.retries, stats.bytes) == (1, len(data))


def test_a_connection_dropped_mid_body_is_retried_and_counted(proxy, http_store, tmp_path):
    data = http_store[2]["big.bin"]
    proxy.add_fault("/big.bin", times=1, drop_mid_body=True)
    stats = remote.FetchStats()
    dest = remote.fetch_to(
        f"{proxy.url}/big.bin", tmp_path / "b", size=len(data), sha256=_sha(data), stats=stats, **FAST
    )
    assert dest.read_bytes() == data
    assert (stats.fetches, stats.retries) == (1, 1)
    assert proxy.count("/big.bin") == 2
    assert stats.bytes == len(data) + len(data) // 2  # http.server ignores Range: the retry reads it all again


@pytest.mark.parametrize("store", ["http", "s3"])
def test_503_twice_then_success_is_retried(store, request, tmp_path):
    if store == "http":
        p, (_, _, blobs) = request.getfixturevalue("proxy"), request.getfixturevalue("http_store")
        url, path, data = f"{p.url}/shard-00000.tar", "/shard-00000.tar", blobs["shard-00000.tar"]
    else:
        p, (_, blobs) = request.getfixturevalue("s3_proxy"), request.getfixturevalue("s3_store")
        key = "data/shard-00001.tar"
        url, path, data = f"s3://{BUCKET}/{key}", f"/{BUCKET}/{key}", blobs[key]
    p.add_fault(path, times=2, status=503, methods=("GET", "HEAD"))
    stats = remote.FetchStats()
    assert remote.fetch_to(url, tmp_path / "x", size=len(data), stats=stats, **FAST).read_bytes() == data
    assert stats.retries == 2


def test_a_redirect_is_followed_and_a_redirect_loop_is_permanent(http_server, tmp_path):
    data = http_server.blobs["shard-00003.tar"]
    url = f"{http_server.url}/moved/shard-00003.tar"
    assert remote.fetch_to(url, tmp_path / "r", size=len(data), sha256=_sha(data), **FAST).read_bytes() == data
    with pytest.raises(PermanentRemoteError, match=r"/loop: cannot be read .*more than 5 redirects"):
        remote.fetch_to(f"{http_server.url}/loop", tmp_path / "l", **FAST)
    assert os.listdir(tmp_path) == ["r"]


def test_user_and_password_in_the_url_are_sent_as_basic_auth_and_never_shown(http_server, tmp_path):
    data = http_server.blobs["shard-00004.tar"]
    host = http_server.url.removeprefix("http://")
    remote.fetch_to(f"http://reader:p%40ss{SIGNATURE}@{host}/shard-00004.tar", tmp_path / "a", size=len(data))
    assert http_server.auth[-1] == "Basic " + base64.b64encode(f"reader:p@ss{SIGNATURE}".encode()).decode()
    with pytest.raises(PermanentRemoteError) as info:
        remote.fetch_to(f"http://reader:{SIGNATURE}@{host}/no-such.tar", tmp_path / "b", **FAST)
    assert str(info.value).startswith(f"http://{host}/no-such.tar: not found")
    assert SIGNATURE not in "".join(traceback.format_exception(info.value))


class _OddServer(BaseHTTPRequestHandler):
    """Answers real servers give that a plain GET must survive, one per path, for ``ODD`` bytes:
    ``/auth/go`` redirects to an absolute URL on the same host, and ``/auth/ok`` wants the basic auth;
    ``/end`` sends the whole body chunked but drops the connection before its last chunk, and answers a
    range from the end with 416; ``/star`` answers a range with ``bytes N-END/*`` and sends less than that;
    ``/trickle`` sends a byte every 0.1 s."""

    protocol_version = "HTTP/1.1"
    timeout = 10

    def do_GET(self):
        data, start = ODD, int((self.headers.get("Range") or "bytes=0-")[6:].rstrip("-"))
        if self.path == "/auth/go":
            return self._answer(302, b"", Location=f"http://{self.headers['Host']}/auth/ok")
        if self.path == "/auth/ok":
            ok = self.headers.get("Authorization") == "Basic " + base64.b64encode(b"reader:pw").decode()
            return self._answer(200, data) if ok else self._answer(401, b"")
        if self.path == "/end" and start == len(data):
            return self._answer(416, b"", **{"Content-Range": f"bytes */{len(data)}"})
        if self.path == "/end":
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))  # no closing 0-chunk
            self.close_connection = True
            return None
        if self.path == "/star" and start:
            return self._answer(
                206, data[start : start + 100], **{"Content-Range": f"bytes {start}-{len(data) - 1}/*"}
            )
        if self.path == "/star":
            return self._answer(200, data[: len(data) // 2], drop=True, length=len(data))
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        with contextlib.suppress(OSError):
            for i in range(50):  # bounded: 5 s at most
                self.wfile.write(data[i : i + 1])
                self.wfile.flush()
                time.sleep(0.1)
        self.close_connection = True
        return None

    def _answer(self, status, body, drop=False, length=None, **headers):
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(length or len(body)))
        self.end_headers()
        self.wfile.write(body)
        self.close_connection = drop

    def log_message(self, format, *args):  # noqa: A002
        pass


ODD = _blob(200_000, 7)


@pytest.fixture(scope="module")
def odd_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _OddServer)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(5)


def test_odd_but_valid_answers_are_read_whole_and_short_ones_refused(odd_server, tmp_path):
    got = remote.fetch_to(f"http://reader:pw@{odd_server}/auth/go", tmp_path / "a", size=len(ODD), **FAST)
    assert got.read_bytes() == ODD  # the auth kept across a redirect to the same host
    stats = remote.FetchStats()
    got = remote.fetch_to(f"http://{odd_server}/end", tmp_path / "e", size=len(ODD), stats=stats, **FAST)
    assert got.read_bytes() == ODD and stats.retries == 1  # every byte in: the range from the end is 416
    with pytest.raises(TransientRemoteError, match="the body ended at"):
        remote.fetch_to(f"http://{odd_server}/star", tmp_path / "s", retries=1, backoff_s=0.01, timeout_s=10)
    started = time.monotonic()
    with pytest.raises(TransientRemoteError, match="stalled"):
        remote.fetch_to(f"http://{odd_server}/trickle", tmp_path / "t", retries=0, timeout_s=1.0)
    assert time.monotonic() - started < 4
    with pytest.raises(PermanentRemoteError) as info:
        remote.fetch_to(f"http://u:Pa#{SIGNATURE}@{odd_server}/x", tmp_path / "x", **FAST)
    assert "percent-encode" in str(info.value)
    assert SIGNATURE not in "".join(traceback.format_exception(info.value))
    assert sorted(os.listdir(tmp_path)) == ["a", "e"]


def test_transient_failures_stop_after_the_retries_allowed(proxy, tmp_path):
    proxy.add_fault("/big.bin", status=503)
    started = time.monotonic()
    with pytest.raises(TransientRemoteError, match="still failing after 3 attempts") as info:
        remote.fetch_to(f"{proxy.url}/big.bin", tmp_path / "b", size=3_000_000, retries=2, **FAST)
    assert proxy.count("/big.bin") == 3
    assert time.monotonic() - started < 5
    assert info.value.url == f"{proxy.url}/big.bin"
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("status,words", [(403, "access denied"), (404, "not found")])
def test_403_and_404_over_http_are_permanent_at_once(proxy, tmp_path, status, words):
    proxy.add_fault("/big.bin", status=status)
    url = f"{proxy.url}/big.bin?X-Amz-Credential=AKIA&X-Amz-Signature={SIGNATURE}"
    stats = remote.FetchStats()
    with pytest.raises(PermanentRemoteError) as info:
        remote.fetch_to(url, tmp_path / "b", size=3_000_000, stats=stats, **FAST)
    message = str(info.value)
    assert message.startswith(f"{proxy.url}/big.bin?X-Amz-Credential=***&X-Amz-Signature=***: {words}")
    assert SIGNATURE not in message and SIGNATURE not in "".join(traceback.format_exception(info.value))
    assert ("signature" if status == 403 else "the prefix") in message
    assert stats.retries == 0 and proxy.count("/big.bin") == 1
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("status,words", [(403, "AWS_ACCESS_KEY_ID"), (404, "the prefix")])
def test_403_and_404_on_s3_say_what_to_check(s3_proxy, tmp_path, status, words):
    key = "data/shard-00001.tar"
    s3_proxy.add_fault(f"/{BUCKET}/{key}", status=status, methods=("GET", "HEAD"))
    with pytest.raises(PermanentRemoteError, match=words) as info:
        remote.fetch_to(f"s3://{BUCKET}/{key}", tmp_path / "x", size=1000, **FAST)
    assert str(info.value).startswith(f"s3://{BUCKET}/{key}: ")
    assert s3_proxy.count(f"/{BUCKET}/{key}", method="*") == 1  # the GET, refused: no retry
    assert SECRET_KEY not in "".join(traceback.format_exception(info.value))


def test_a_presigned_get_refused_as_for_another_region_is_read_through_s3fs(s3_proxy, s3_store, tmp_path):
    """S3 answers a URL signed for another region than the bucket's with 301 (or 400) and no Location: the
    object is then read by s3fs, whose client follows the region."""
    key = "data/shard-00001.tar"
    data = s3_store[1][key]
    s3_proxy.add_fault(f"/{BUCKET}/{key}", times=1, status=301, methods=("GET",))
    stats = remote.FetchStats()
    dest = remote.fetch_to(f"s3://{BUCKET}/{key}", tmp_path / "r", size=len(data), sha256=_sha(data), stats=stats)
    assert dest.read_bytes() == data and stats.retries == 0
    assert s3_proxy.count(f"/{BUCKET}/{key}") == 2  # the presigned GET refused, then s3fs's


def test_preparations_stat_of_a_shard_rides_out_a_store_blip(s3_proxy, s3_store):
    """A shard's size and version (what preparation reads of it) are asked again while the store answers 503,
    as a download is; past the bound the error says what to check."""
    key = f"/{BUCKET}/data/shard-00001.tar"
    s3_proxy.add_fault(key, times=2, status=503, methods=("HEAD",))
    size, version = remote.remote_version(f"s3://{BUCKET}/data/shard-00001.tar")
    assert size == len(s3_store[1]["data/shard-00001.tar"]) and version
    assert s3_proxy.count(key, method="HEAD") == 3
    s3_proxy.add_fault(key, status=503, methods=("HEAD",))
    with pytest.raises(TransientRemoteError, match="still failing after .* check that the store answers"):
        remote._retrying(
            f"s3://{BUCKET}/data/shard-00001.tar",
            lambda: remote._filesystem(f"s3://{BUCKET}/data/shard-00001.tar", 30.0)[0].info(
                f"{BUCKET}/data/shard-00001.tar"
            ),
            retry_s=1.0,
        )


def test_a_host_that_does_not_resolve_is_permanent_and_names_the_endpoint_to_check(monkeypatch):
    """s3fs against an endpoint whose name does not resolve (its real chain: botocore's EndpointConnectionError,
    aiohttp's ClientConnectorDNSError, gaierror): refused at once, naming AWS_ENDPOINT_URL, not retried for a
    minute as a blip."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://no-such-host.invalid:9000")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAFAKEFAKEFAKEFAKE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    started = time.monotonic()
    with pytest.raises(PermanentRemoteError) as info:
        remote.remote_version(f"s3://{BUCKET}/data/shard-00001.tar", timeout_s=5.0)
    assert time.monotonic() - started < 20
    assert "host name does not resolve; check the URL's host (an S3-compatible server: AWS_ENDPOINT_URL)" in str(
        info.value
    )
    import socket

    again = OSError("resolver busy")
    again.__cause__ = socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
    assert remote_errors.classify(again) == "transient"


def test_a_missing_key_on_s3_is_permanent(s3_proxy, tmp_path):
    with pytest.raises(PermanentRemoteError, match="not found"):
        remote.fetch_to(f"s3://{BUCKET}/data/no-such.tar", tmp_path / "x", **FAST)
    assert os.listdir(tmp_path) == []


def test_a_wrong_sha256_is_fetched_once_more_then_refused_leaving_nothing(proxy, http_store, tmp_path):
    data = http_store[2]["shard-00002.tar"]
    url = f"{proxy.url}/shard-00002.tar"
    with pytest.raises(PermanentRemoteError) as info:
        remote.fetch_to(url, tmp_path / "s.tar", size=len(data), sha256="0" * 64, **FAST)
    message = str(info.value)
    assert message.startswith(url) and "0" * 64 in message and _sha(data) in message
    assert "the object changed since preparation: re-run mmfast-prepare" in message
    assert proxy.count("/shard-00002.tar") == 2
    assert os.listdir(tmp_path) == []


def test_a_wrong_size_names_both_sizes(proxy, http_store, tmp_path):
    data = http_store[2]["shard-00002.tar"]
    with pytest.raises(PermanentRemoteError, match=f"expected {len(data) + 1} bytes .* got {len(data)} "):
        remote.fetch_to(f"{proxy.url}/shard-00002.tar", tmp_path / "s.tar", size=len(data) + 1, **FAST)
    assert os.listdir(tmp_path) == []


def test_size_and_sha256_are_read_in_one_pass(proxy, http_store):
    data = http_store[2]["big.bin"]
    assert remote.remote_size_and_sha256(f"{proxy.url}/big.bin", **FAST) == (len(data), _sha(data))
    assert proxy.count("/big.bin") == 1


def test_a_killed_download_leaves_no_file_and_the_cache_removes_its_leftovers(proxy, http_store, tmp_path):
    data = http_store[2]["big.bin"]
    url, root = f"{proxy.url}/big.bin", tmp_path / "cache"
    with ShardCache(root, 10**9) as cache:
        dest = cache.path_for(url, _sha(data))
    proxy.bandwidth_bytes_per_s = 300_000  # ten seconds for the whole object: time to kill it part-way
    code = (
        "import sys; from mmfast.remote.shard_cache import ShardCache; "
        "ShardCache(sys.argv[1], 10**9).get(sys.argv[2], int(sys.argv[3]), sys.argv[4])"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen([sys.executable, "-c", code, str(root), url, str(len(data)), _sha(data)], env=env)
    try:
        deadline = time.monotonic() + 30
        while not any(size > 0 for size in _partials(root).values()):
            assert time.monotonic() < deadline and child.poll() is None, "the download never started"
            time.sleep(0.05)
    finally:
        child.kill()
        child.wait(10)
    assert not dest.exists()
    assert _partials(root) and os.listdir(root / "reserved")  # what the killed process left behind
    proxy.bandwidth_bytes_per_s = None
    with ShardCache(root, 10**9) as cache:  # the next cache on this root removes what the dead one left
        assert not _partials(root) and os.listdir(root / "reserved") == []
        assert cache.get(url, len(data), _sha(data)).read_bytes() == data


def _partials(root: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in (root / "shards").iterdir() if remote.partial_of(p.name)}


def _items(proxy: FaultProxy, blobs: dict[str, bytes], indices) -> list[tuple[str, int, str]]:
    """(url, size, sha256) of the cache-test shards with these indices."""
    names = [f"shard-{i:05d}.tar" for i in indices]
    return [(f"{proxy.url}/{n}", len(blobs[n]), _sha(blobs[n])) for n in names]


def test_the_cache_never_holds_more_than_its_limit_plus_one_shard(proxy, http_store, tmp_path):
    blobs = http_store[2]
    limit = 3 * SHARD
    with ShardCache(tmp_path / "c", limit) as cache:
        order = [0, 1, 2, 3, 1, 4, 5, 6, 7, 0, 7]
        for item in _items(proxy, blobs, order):
            assert cache.get(*item).read_bytes() == blobs[item[0].rsplit("/", 1)[1]]
            on_disk = sum(_files(tmp_path / "c").values())
            assert on_disk <= limit + SHARD, _files(tmp_path / "c")
        stats = cache.stats()
    shards = sorted(n.rsplit("-", 1)[-1] for n in _files(tmp_path / "c") if n.startswith("shards/"))
    assert shards == ["00000.tar", "00006.tar", "00007.tar"]
    assert (stats["hits"], stats["misses"], stats["fetches"]) == (2, 9, 9)
    assert stats["evictions"] == 6 and stats["bytes_fetched"] == 9 * SHARD


def test_prefetching_stays_within_the_limit(proxy, http_store, tmp_path):
    # Room for the shard being read, the two fetched ahead, and the one before (older than all of them).
    blobs, limit, seen = http_store[2], 4 * SHARD, []
    with ShardCache(tmp_path / "c", limit, workers=2) as cache:
        items = _items(proxy, blobs, range(8))
        for i, item in enumerate(items):
            cache.prefetch(items[i + 1 : i + 3])
            with cache.pinned(*item) as path:
                assert path.read_bytes() == blobs[item[0].rsplit("/", 1)[1]]
                seen.append(sum(_files(tmp_path / "c").values()))
    assert max(seen) <= limit + SHARD
    assert [proxy.count(f"/shard-{i:05d}.tar") for i in range(8)] == [1] * 8  # each fetched once


def test_lru_evicts_the_least_recently_used_and_never_a_pinned_one(proxy, http_store, tmp_path):
    a, b, c, d, e, f = _items(proxy, http_store[2], range(6))
    with ShardCache(tmp_path / "c", 3 * SHARD) as cache:
        for item in (a, b, c, a):  # a used again: b is now the least recently used
            cache.get(*item)
        cache.get(*d)
        assert [cache.path_for(u, s).exists() for u, _, s in (a, b, c, d)] == [True, False, True, True]
        with cache.pinned(*c) as pinned:  # c is the least recently used now, but in use
            cache.get(*e)
            cache.get(*f)
            assert pinned.exists() and pinned.read_bytes() == http_store[2]["shard-00002.tar"]
        assert [cache.path_for(u, s).exists() for u, _, s in (a, c, d, e, f)] == [False, True, False, True, True]


def test_when_everything_is_pinned_a_fetch_waits_then_says_the_cache_is_full(proxy, http_store, tmp_path):
    a, b, c = _items(proxy, http_store[2], range(3))
    with ShardCache(tmp_path / "c", SHARD, wait_s=0.5) as cache:
        with cache.pinned(*a), cache.pinned(*b):  # a fills the limit; b is the one shard allowed over it
            started = time.monotonic()
            with pytest.raises(CacheFullError, match="raise limit_bytes"):
                cache.get(*c)
            assert time.monotonic() - started >= 0.5
        assert cache.get(*c).exists()  # once they are released, c fits (a and b make room)
        assert sum(_files(tmp_path / "c").values()) <= 2 * SHARD


def test_a_cached_copy_of_the_wrong_size_is_fetched_again(proxy, http_store, tmp_path):
    (item,) = _items(proxy, http_store[2], [3])
    with ShardCache(tmp_path / "c", 10 * SHARD) as cache:
        path = cache.get(*item)
        path.write_bytes(b"truncated")
        assert cache.get(*item).read_bytes() == http_store[2]["shard-00003.tar"]
        assert cache.stats()["fetches"] == 2 and proxy.count("/shard-00003.tar") == 2


def test_a_failed_prefetch_is_raised_by_get_of_that_shard(proxy, http_store, tmp_path):
    good = _items(proxy, http_store[2], [4])[0]
    missing = (f"{proxy.url}/no-such.tar", 10, "0" * 64)
    with ShardCache(tmp_path / "c", 10 * SHARD) as cache:
        cache.prefetch([missing, good])  # nothing raised here, nor in a worker thread
        assert cache.get(*good).read_bytes() == http_store[2]["shard-00004.tar"]
        with pytest.raises(PermanentRemoteError, match="no-such.tar: not found"):
            cache.get(*missing)
    assert proxy.count("/no-such.tar") == 1 and proxy.count("/shard-00004.tar") == 1


def test_cache_names_hold_no_credentials_and_survive_a_new_signature(tmp_path):
    with ShardCache(tmp_path / "c", SHARD) as cache:
        one = cache.path_for(f"https://u:pw@h/b/shard-7.tar?X-Amz-Date=1&X-Amz-Signature={SIGNATURE}", "ab" * 32)
        two = cache.path_for("https://u:pw@h/b/shard-7.tar?X-Amz-Date=2&X-Amz-Signature=other", "ab" * 32)
    assert one == two and one.name.endswith("-shard-7.tar") and one.parent == tmp_path / "c" / "shards"
    assert "pw" not in one.name and SIGNATURE not in one.name


def test_the_cache_refuses_a_folder_of_the_users_files(tmp_path):
    (tmp_path / "mine.txt").write_text("keep me")
    with pytest.raises(OutputDirError, match="not a shard cache's"):
        ShardCache(tmp_path, SHARD)
    assert os.listdir(tmp_path) == ["mine.txt"]


def test_a_cache_another_process_is_claiming_this_instant_is_not_refused(tmp_path, monkeypatch):
    """The race two processes opening one new cache met: one looked for the marker, the other wrote it, and the
    first then found the folder non-empty and refused it as the user's. The marker is looked for again."""
    root = tmp_path / "c"
    root.mkdir()
    listed = Path.iterdir

    def other_claimer_marks_first(self):
        if self == root and not (root / MARKER).exists():
            write_marker(root, "shard cache")  # lands between the marker's look and the listing
        return listed(self)

    monkeypatch.setattr(Path, "iterdir", other_claimer_marks_first)
    with ShardCache(root, SHARD) as cache:
        assert cache.root == root
    # A folder of the user's files is still refused: nothing marks it between the looks.
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "photo.jpg").write_bytes(b"x")
    with pytest.raises(OutputDirError, match="not a shard cache"):
        ShardCache(tmp_path / "mine", SHARD)


def _spawned_get(root: str, item: tuple, ready, go, results) -> None:
    """One process of the two-process test: open the cache, say so, wait for the start, get the shard."""
    try:
        with ShardCache(root, 10 * SHARD) as cache:
            ready.put(os.getpid())
            if go.wait(60):
                path = cache.get(*item)
                results.put((cache.stats()["fetches"], hashlib.sha256(path.read_bytes()).hexdigest()))
    except BaseException as e:
        results.put(("failed", repr(e)))
        raise


def test_two_processes_asking_for_one_shard_fetch_it_once(proxy, http_store, tmp_path):
    (item,) = _items(proxy, http_store[2], [5])
    proxy.add_fault("/shard-00005.tar", delay_s=1.0)  # the first fetch is still running when the second asks
    ctx = multiprocessing.get_context("spawn")
    ready, results, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_spawned_get, args=(str(tmp_path / "c"), item, ready, go, results)) for _ in "ab"]
    for p in procs:
        p.start()
    try:
        for _ in procs:
            ready.get(timeout=60)
        go.set()
        got = sorted(results.get(timeout=60) for _ in procs)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert got == [(0, item[2]), (1, item[2])]
    assert proxy.count("/shard-00005.tar") == 1


def test_no_secret_reaches_a_message_a_traceback_or_a_log(
    proxy, http_store, tmp_path, caplog, capsys, monkeypatch
):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    caplog.set_level(logging.DEBUG, logger="mmfast")
    data = http_store[2]["shard-00006.tar"]
    url = f"http://user:{SECRET_KEY}@127.0.0.1:{proxy.url.rsplit(':', 1)[1]}/shard-00006.tar?sig={SIGNATURE}"
    proxy.add_fault("/shard-00006.tar", times=1, status=503)
    proxy.add_fault("/shard-00006.tar", times=1, drop_mid_body=True)
    texts = [str(remote.fetch_to(url, tmp_path / "ok", size=len(data), sha256=_sha(data), **FAST))]
    for status in (403, 404, None):
        if status:
            proxy.add_fault("/shard-00006.tar", times=1, status=status)
        with pytest.raises(PermanentRemoteError) as info:
            remote.fetch_to(url, tmp_path / "x", size=len(data), sha256=None if status else "1" * 64, **FAST)
        texts += [str(info.value), info.value.url, "".join(traceback.format_exception(info.value))]
    with ShardCache(tmp_path / "c", SHARD) as cache:
        proxy.add_fault("/shard-00006.tar", times=1, status=403)
        with pytest.raises(PermanentRemoteError) as info:
            cache.get(url, len(data), _sha(data))
        texts += [str(info.value), "".join(traceback.format_exception(info.value)), str(cache.path_for(url, None))]
    captured = capsys.readouterr()
    texts += [caplog.text, captured.out, captured.err]
    assert "retry 2 in" in caplog.text  # the retries were logged, redacted
    for text in texts:
        assert SECRET_KEY not in text and SIGNATURE not in text


def test_brace_patterns_expand_with_their_padding(tmp_path):
    assert remote.expand("s3://b/p/shard-{00008..00011}.tar") == [
        "s3://b/p/shard-00008.tar",
        "s3://b/p/shard-00009.tar",
        "s3://b/p/shard-00010.tar",
        "s3://b/p/shard-00011.tar",
    ]
    assert remote.expand("gs://b/{train,val}/{0..1}.tar") == [
        f"gs://b/{s}/{i}.tar" for s in ("train", "val") for i in "01"
    ]
    assert remote.expand("hf://d/{a,{b,c}}-{2..1}.tar") == [f"hf://d/{x}-{i}.tar" for x in "abc" for i in "12"]
    assert remote.expand("s3://b/{x,x,y}.tar") == ["s3://b/x.tar", "s3://b/y.tar"]
    bad_patterns = [("s3://b/{0..3.tar", "unbalanced"), ("s3://b/{abc}.tar", "neither a list")]
    for bad, words in bad_patterns + [("s3://b/{0..99999999}.tar", "more than")]:
        with pytest.raises(ValueError, match=words):
            remote.expand(bad)


def test_globs_match_local_and_s3_objects(s3_proxy, tmp_path):
    for name in ("a-0.tar", "a-1.tar", "b-0.tar"):
        (tmp_path / name).write_bytes(b"x")
    assert remote.expand(str(tmp_path / "a-*.tar")) == [str(tmp_path / "a-0.tar"), str(tmp_path / "a-1.tar")]
    assert remote.expand(f"s3://{BUCKET}/data/shard-*.tar") == [
        f"s3://{BUCKET}/data/shard-00000.tar",
        f"s3://{BUCKET}/data/shard-00001.tar",
    ]
    with pytest.raises(ValueError, match=r"shard-\*\.tgz' matches nothing"):
        remote.expand(f"s3://{BUCKET}/data/shard-*.tgz")


# --- a store that is down for a while ---------------------------------------------------------------------------


class _LateStore:
    """An http.server over ``root`` on a port that refuses connections until ``up()`` (a store restarting)."""

    def __init__(self, root: Path):
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.root, self.server, self.thread = root, None, None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def up(self) -> None:
        handler = functools.partial(_Handler, directory=str(self.root))
        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), handler)
        self.server.auth = []
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def up_after(self, seconds: float) -> threading.Timer:
        timer = threading.Timer(seconds, self.up)
        timer.start()
        return timer

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.thread.join(5)


@pytest.fixture
def late_store(http_store):
    store = _LateStore(http_store[1])
    yield store
    store.close()


def test_a_store_down_for_a_while_is_ridden_out_and_the_wait_counted(late_store, http_store, tmp_path):
    """The store refuses connections for a second and a half, then serves: a fetch with a 20 s bound retries
    until it is back and gets the exact bytes; the retries and their back-off are counted in the shard
    cache's figures. The default bound rides out a minute's outage."""
    _, _, blobs = http_store
    data = blobs["shard-00003.tar"]
    late_store.up_after(1.5)
    fetch = functools.partial(remote.fetch_to, retry_s=20.0, backoff_s=0.05, timeout_s=5.0)
    started = time.monotonic()
    with ShardCache(tmp_path / "c", 10 * SHARD, fetch=fetch) as cache:
        got = cache.get(f"{late_store.url}/shard-00003.tar", len(data), _sha(data))
        stats = cache.stats()
    assert got.read_bytes() == data
    assert 1.4 < time.monotonic() - started < 15
    assert stats["fetches"] == 1 and stats["retries"] >= 3
    assert 0.5 < stats["retry_seconds"] <= stats["fetch_seconds"]
    assert remote.RETRY_S == 60.0


def test_a_store_down_past_the_bound_stops_at_it_naming_the_flag(late_store, tmp_path):
    """Down for longer than the bound (here 1 s): the fetch gives up once the bound is reached, after one last
    attempt at it, with a message that names --store-timeout; no file is left."""
    stats = remote.FetchStats()
    started = time.monotonic()
    with pytest.raises(TransientRemoteError, match=r"still failing after \d+ attempts.*--store-timeout") as info:
        remote.fetch_to(f"{late_store.url}/big.bin", tmp_path / "b", retry_s=1.0, backoff_s=0.05, stats=stats)
    assert 0.95 < time.monotonic() - started < 5
    assert "waits longer, now 1 s" in str(info.value)
    assert stats.retries >= 3 and 0.9 < stats.retry_seconds <= 1.0 + 1e-6
    assert os.listdir(tmp_path) == []


def test_the_train_flag_bounds_the_retries_of_the_runs_shard_cache(late_store, http_store, tmp_path):
    """--store-timeout reaches the run's shard cache: 0 gives up at the first refusal, 20 waits for the store."""
    from types import SimpleNamespace

    from mmfast.train.config import TrainConfig
    from mmfast.train.data import shard_cache

    _, _, blobs = http_store
    data, url = blobs["shard-00004.tar"], f"{late_store.url}/shard-00004.tar"
    dataset = SimpleNamespace(remote_shards=lambda: [url])
    assert TrainConfig().store_timeout == 60.0
    cfg = TrainConfig(shard_cache=str(tmp_path / "c"), store_timeout=0.0)
    with shard_cache(cfg, dataset) as cache, pytest.raises(TransientRemoteError, match="after 1 attempt in"):
        cache.get(url, len(data), _sha(data))
    late_store.up_after(1.0)
    cfg = TrainConfig(shard_cache=str(tmp_path / "c"), store_timeout=20.0)
    with shard_cache(cfg, dataset) as cache:
        assert cache.get(url, len(data), _sha(data)).read_bytes() == data
        assert cache.stats()["retries"] >= 1


def test_the_runs_shard_cache_defaults_to_mmfast_cache(tmp_path, monkeypatch):
    """Without --shard-cache, remote shards go under $MMFAST_CACHE/shards (else ~/.cache/mmfast/shards)."""
    from types import SimpleNamespace

    from mmfast.train.config import TrainConfig
    from mmfast.train.data import shard_cache

    dataset = SimpleNamespace(remote_shards=lambda: ["http://127.0.0.1:9/shard-00000.tar"])
    monkeypatch.setenv("MMFAST_CACHE", str(tmp_path / "cache"))
    with shard_cache(TrainConfig(), dataset) as cache:
        assert cache.root == tmp_path / "cache" / "shards"
    monkeypatch.delenv("MMFAST_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    with shard_cache(TrainConfig(), dataset) as cache:
        assert cache.root == tmp_path / "home" / ".cache" / "mmfast" / "shards"


# --- a cache that cannot be written ------------------------------------------------------------------------------

_CACHE_ON = r"""
import subprocess, sys
from pathlib import Path
from mmfast.remote.shard_cache import ShardCache

how, folder, url, size, sha = sys.argv[1], Path(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5]
if how != "file-size limit":
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(folder)], check=True)
if how == "read-only":
    subprocess.run(["mount", "-o", "remount,ro", str(folder)], check=True)
try:
    with ShardCache(folder / "cache", 10**9) as cache:
        cache.get(url, size, sha)
except OSError as e:
    print(f"{type(e).__name__}: {e}")
"""


def _unshare_works() -> bool:
    try:
        return subprocess.run(["unshare", "-rm", "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.parametrize(
    ("how", "cause", "advice"),
    [
        ("full disk", "No space left on device", "free disk space there"),
        ("file-size limit", "File too large", "raise the file-size limit (ulimit -f)"),
        ("read-only", "Read-only file system", "use a folder on a writable file system"),
    ],
)
def test_a_cache_that_cannot_be_written_says_where_why_and_what_to_do(http_store, tmp_path, how, cause, advice):
    """The cache's folder on a full disk (a 64 KiB tmpfs), under a file-size limit (RLIMIT_FSIZE) or on a
    read-only file system: one message naming the folder, the shard, the cause, and --shard-cache /
    --cache-limit, not a bare '[Errno 28] No space left on device'."""
    if how != "file-size limit" and not _unshare_works():
        pytest.skip("needs unshare -rm (a private mount namespace) to mount a tmpfs")
    base, _, blobs = http_store
    data = blobs["shard-00005.tar"]
    folder = tmp_path / "disk"
    folder.mkdir()
    args = [sys.executable, "-c", _CACHE_ON, how, str(folder), f"{base}/shard-00005.tar", str(len(data))]
    args.append(_sha(data))

    def limit():  # Python ignores SIGXFSZ: a write over the limit fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (SHARD // 2, SHARD // 2))

    limit = limit if how == "file-size limit" else None
    cmd = args if limit else ["unshare", "-rm", *args]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, preexec_fn=limit)
    (said,) = r.stdout.splitlines() or [r.stderr[-2000:]]
    assert said.startswith(f"CacheWriteError: the shard cache at {folder / 'cache'} "), said
    if how != "read-only":
        assert f"cannot hold {base}/shard-00005.tar ({len(data)} bytes): {cause}" in said, said
    assert cause in said and f"; {advice}, or pass --shard-cache a folder on a disk with room" in said, said
    assert "--cache-limit" in said


# --- a store that answers with something else than the shard -----------------------------------------------------

_LOGIN = b"<!DOCTYPE html>\n<html><head><title>Sign in - Example Corp</title></head><body>Log in</body></html>\n"
_ANSWERS = {  # path: (Content-Type, body)
    "/login.tar": ("text/html; charset=utf-8", _LOGIN),
    "/portal.tar": ("application/octet-stream", _LOGIN),  # a portal's page, mislabelled
    "/error.tar": ("application/json", b'{"error": "quota exceeded for project demo"}'),
    "/short.tar": ("application/x-tar", b"\0" * 700),
}


class _OtherAnswers(BaseHTTPRequestHandler):
    def do_GET(self):
        kind, body = _ANSWERS[self.path.split("?", 1)[0]]
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format, *args):  # noqa: A002
        pass


@pytest.fixture(scope="module")
def other_answers():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _OtherAnswers)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(5)


@pytest.mark.parametrize(
    ("path", "said"),
    [
        ("/login.tar", f"the store answered with an HTML page ({len(_LOGIN)} bytes of text/html) that reads "
         "'Sign in - Example Corp', not the shard. It is a sign-in, error or proxy page: check the URL"),
        ("/portal.tar", f"the store answered with an HTML page ({len(_LOGIN)} bytes of application/octet-stream)"),
        ("/error.tar", "the store answered with a text answer (44 bytes of application/json) that reads "
         """'{"error": "quota exceeded for project demo"}', not the shard"""),
        ("/short.tar", "the object changed since preparation: re-run mmfast-prepare, or check that the URL still "
         "names that object (700 bytes of application/x-tar arrived)"),
    ],
)  # fmt: skip
def test_an_answer_that_is_not_the_shard_says_what_arrived(other_answers, tmp_path, path, said):
    """A store that answers 200 with a login page, a mislabelled portal page, a JSON error or other bytes: the
    message names the URL (its signature masked), the size expected and the size and type that arrived, what
    the answer reads, and what to check; only other bytes are called a changed object."""
    url = f"{other_answers}{path}?X-Amz-Signature={SIGNATURE}"
    with pytest.raises(PermanentRemoteError) as info:
        remote.fetch_to(url, tmp_path / "s.tar", size=SHARD, sha256="1" * 64, **FAST)
    message = str(info.value)
    assert message.startswith(f"{other_answers}{path}?X-Amz-Signature=***: expected {SHARD} bytes"), message
    assert said in message, message
    assert ("changed since preparation" in message) == (path == "/short.tar")
    assert SIGNATURE not in message and os.listdir(tmp_path) == []
