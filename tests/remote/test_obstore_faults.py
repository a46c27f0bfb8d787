"""obstore (the Rust ``object_store`` crate's bindings) through the faults that tests/remote/test_remote.py injects
into today's GET, for issue #46's choice of object-store client: the same loopback servers and FaultProxy.
Each test asserts what obstore 0.12 does, gaps included, so that a release that changes one fails here and
the choice is weighed again. The gaps are the tests named "...gap...". Skipped without obstore (the
``bench`` extra)."""

from __future__ import annotations

import hashlib
import os
import time
import traceback
import urllib.parse
from datetime import timedelta
from pathlib import Path

import pytest

obstore = pytest.importorskip("obstore")

from obstore.exceptions import GenericError, PermissionDeniedError  # noqa: E402
from obstore.store import HTTPStore, S3Store  # noqa: E402
from test_remote import (  # noqa: E402, F401 - fixtures are used by name
    BUCKET,
    SECRET_KEY,
    SIGNATURE,
    _sha,
    http_server,
    http_store,
    late_store,
    odd_server,
    proxy,
    s3_forward_proxy,
    s3_proxy,
    s3_store,
)

from tools.benchmarks.benchlib import fault_proxy  # noqa: E402

QUICK = {
    "max_retries": 3,
    "backoff": {"init_backoff": timedelta(milliseconds=10)},
    "retry_timeout": timedelta(seconds=10),
}
ONCE = {"max_retries": 0}


def _s3(endpoint: str) -> S3Store:
    """An S3Store on the test bucket at ``endpoint``, built as bench_fetch.py builds it, with quick retries."""
    return S3Store(
        BUCKET,
        endpoint=endpoint,
        access_key_id=os.environ["AWS_ACCESS_KEY_ID"],
        secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"],
        region="us-east-1",
        virtual_hosted_style_request=False,
        client_options={"allow_http": True, "timeout": "10s"},
        retry_config=QUICK,
    )


def _http(url: str, retry=None, **client) -> HTTPStore:
    """An HTTPStore at ``url`` (the prefix), plain HTTP allowed; ``client`` overrides the client options."""
    options = {"allow_http": True, "timeout": "10s"} | client
    return HTTPStore.from_url(url, client_options=options, retry_config=retry or QUICK)


def _fetch(store, path: str, dest: Path) -> str:
    """Stream ``path`` into ``dest`` in pieces of 1 MiB or more, as bench_fetch.py does; its SHA-256."""
    hasher = hashlib.sha256()
    with open(dest, "wb") as out:
        for piece in obstore.get(store, path).stream(min_chunk_size=1 << 20):
            hasher.update(piece)
            out.write(piece)
    return hasher.hexdigest()


def _shown(error: BaseException) -> str:
    return "".join(traceback.format_exception(error))


@pytest.fixture
def seen(monkeypatch):
    """(method, path, Range header) of every request a FaultProxy receives during the test."""
    got = []
    serve = fault_proxy._ProxyHandler._serve

    def recording(handler):
        got.append((handler.command, urllib.parse.urlsplit(handler.path).path, handler.headers.get("Range")))
        serve(handler)

    monkeypatch.setattr(fault_proxy._ProxyHandler, "_serve", recording)
    return got


def test_s3_is_read_with_one_get_and_no_head(s3_proxy, s3_store, seen, tmp_path):
    key = "data/shard-00000.tar"
    assert _fetch(_s3(s3_proxy.url), key, tmp_path / "s") == _sha(s3_store[1][key])
    assert seen == [("GET", f"/{BUCKET}/{key}", None)]


def test_a_dropped_s3_body_resumes_with_a_range_from_where_it_stopped(s3_proxy, s3_store, seen, tmp_path):
    key = "data/shard-00000.tar"
    data = s3_store[1][key]
    s3_proxy.add_fault(f"/{BUCKET}/{key}", times=1, drop_mid_body=True)
    assert _fetch(_s3(s3_proxy.url), key, tmp_path / "s") == _sha(data)
    half = len(data) // 2
    assert [r for _, _, r in seen] == [None, f"bytes={half}-{len(data) - 1}"]


def test_503_twice_on_s3_is_retried_and_503_for_ever_stops_at_max_retries(s3_proxy, s3_store, seen, tmp_path):
    key = "data/shard-00001.tar"
    s3_proxy.add_fault(f"/{BUCKET}/{key}", times=2, status=503)
    assert _fetch(_s3(s3_proxy.url), key, tmp_path / "s") == _sha(s3_store[1][key])
    assert len(seen) == 3
    s3_proxy.add_fault(f"/{BUCKET}/{key}", status=503)
    with pytest.raises(GenericError, match="after 3 retries"):
        _fetch(_s3(s3_proxy.url), key, tmp_path / "t")
    assert len(seen) == 3 + 4


def test_with_a_proxy_in_the_environment_s3_is_read_through_it(s3_forward_proxy, s3_store, tmp_path):
    """HTTP_PROXY names the FaultProxy; the endpoint is an address nothing listens on."""
    key = "data/shard-00001.tar"
    assert _fetch(_s3("http://127.0.0.3:9"), key, tmp_path / "p") == _sha(s3_store[1][key])
    assert s3_forward_proxy.count(f"/{BUCKET}/{key}") == 1


@pytest.mark.parametrize("status,error", [(403, PermissionDeniedError), (404, FileNotFoundError)])
def test_403_and_404_on_s3_are_permanent_at_once_and_show_no_secret(s3_proxy, seen, tmp_path, status, error):
    key = "data/shard-00001.tar"
    s3_proxy.add_fault(f"/{BUCKET}/{key}", status=status)
    with pytest.raises(error) as info:
        _fetch(_s3(s3_proxy.url), key, tmp_path / "s")
    assert len(seen) == 1
    assert SECRET_KEY not in _shown(info.value) and os.environ["AWS_ACCESS_KEY_ID"] not in _shown(info.value)


def test_gap_s3_refusing_a_request_as_for_another_region_is_not_followed(s3_proxy, tmp_path):
    """Today's GET reads such an object through s3fs, whose client follows the bucket's region."""
    key = "data/shard-00001.tar"
    s3_proxy.add_fault(f"/{BUCKET}/{key}", times=1, status=301)
    with pytest.raises(GenericError, match="incorrectly configured region"):
        _fetch(_s3(s3_proxy.url), key, tmp_path / "s")


def test_gap_a_dropped_body_from_a_server_without_ranges_fails_at_once(proxy, http_store, seen, tmp_path):
    """http.server sends no ETag and ignores Range: today's GET reads the whole body again; obstore does not
    retry a cut body there at all."""
    proxy.add_fault("/big.bin", times=1, drop_mid_body=True)
    with pytest.raises(GenericError, match="response body error"):
        _fetch(_http(proxy.url), "big.bin", tmp_path / "b")
    assert len(seen) == 1


@pytest.mark.parametrize("status,error", [(403, PermissionDeniedError), (404, FileNotFoundError)])
def test_403_and_404_over_http_are_permanent_at_once(proxy, seen, tmp_path, status, error):
    proxy.add_fault("/big.bin", status=status)
    with pytest.raises(error):
        _fetch(_http(proxy.url), "big.bin", tmp_path / "b")
    assert len(seen) == 1


def test_a_redirect_is_followed_and_a_redirect_loop_stops(http_server, tmp_path):
    data = http_server.blobs["shard-00003.tar"]
    assert _fetch(_http(http_server.url), "moved/shard-00003.tar", tmp_path / "r") == _sha(data)
    with pytest.raises(GenericError, match="error following redirect"):
        _fetch(_http(http_server.url), "loop", tmp_path / "l")


def test_gap_a_password_or_signature_in_the_url_is_shown_in_errors(http_server, tmp_path):
    """A user and password in the URL are not sent as basic auth; they, and a presigned URL's signature,
    appear in the error's message. Today's GET sends the auth and redacts both."""
    host = http_server.url.removeprefix("http://")
    data = http_server.blobs["shard-00004.tar"]
    with_auth = _http(f"http://reader:{SIGNATURE}@{host}")
    assert _fetch(with_auth, "shard-00004.tar", tmp_path / "a") == _sha(data)
    assert http_server.auth[-1] is None
    with pytest.raises(FileNotFoundError) as info:
        _fetch(with_auth, "no-such.tar", tmp_path / "b")
    assert SIGNATURE in str(info.value)
    presigned = _http(f"{http_server.url}/no-such.tar?X-Amz-Signature={SIGNATURE}", retry=ONCE)
    with pytest.raises(FileNotFoundError) as info:
        _fetch(presigned, "", tmp_path / "c")
    assert SIGNATURE in str(info.value)


def test_a_trickling_body_is_cut_by_the_whole_request_timeout_only(odd_server, tmp_path):
    """``timeout`` bounds the whole request (30 s by default: it must grow with the shard's size), and
    ``read_timeout`` one read: a body trickling a byte every 0.1 s passes the second until the server ends
    it. Today's GET fails a body slower than 64 KiB per ``timeout_s``, whatever its size."""
    started = time.monotonic()
    with pytest.raises(GenericError, match="body error"):
        _fetch(_http(f"http://{odd_server}", retry=ONCE, timeout="1s"), "trickle", tmp_path / "t")
    assert time.monotonic() - started < 4
    started = time.monotonic()
    with pytest.raises(GenericError, match="body error"):
        _fetch(_http(f"http://{odd_server}", retry=ONCE, read_timeout="1s"), "trickle", tmp_path / "u")
    assert time.monotonic() - started > 4  # the server sends for 5 s, then ends the body short


def test_gap_a_body_without_content_length_is_refused(odd_server, tmp_path):
    """A chunked answer (no Content-Length) is refused outright; today's GET reads it and resumes it."""
    with pytest.raises(GenericError, match="Content-Length Header missing"):
        _fetch(_http(f"http://{odd_server}"), "end", tmp_path / "e")


def test_a_store_down_for_a_while_is_ridden_out_within_retry_timeout(late_store, http_store, tmp_path):
    data = http_store[2]["shard-00003.tar"]
    late_store.up_after(1.5)
    patient = QUICK | {"max_retries": 100, "retry_timeout": timedelta(seconds=20)}
    assert _fetch(_http(late_store.url, retry=patient), "shard-00003.tar", tmp_path / "a") == _sha(data)
    bounded = patient | {"retry_timeout": timedelta(seconds=1)}
    started = time.monotonic()
    with pytest.raises(GenericError, match="error sending request"):
        _fetch(_http("http://127.0.0.1:9", retry=bounded), "x", tmp_path / "b")
    assert time.monotonic() - started < 5
