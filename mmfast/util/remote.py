"""Remote objects for streaming training data: which paths are remote, URLs safe to print, failures sorted
into transient (retry) and permanent (stop, and say what to check), whole-object downloads that are atomic
and verified, and shard patterns expanded into URLs.

Every store comes through fsspec (s3fs for s3://, gcsfs for gs://, huggingface_hub for hf://, aiohttp for
http(s)://), with credentials only from each store's own environment and config, never printed: every message
and log line here shows URLs and library errors through ``redact``. This module owns the retries (s3fs's and
botocore's are off), so that ``retries`` bounds the attempts and each one is counted.
"""

from __future__ import annotations

import contextlib
import errno
import glob as local_glob
import hashlib
import http.client
import logging
import os
import random
import re
import threading
import time
from collections import namedtuple
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from mmfast.util.commands import PREPARE
from mmfast.util.fsutil import fsync_dir

log = logging.getLogger(__name__)

_BLOCK = 8 << 20  # bytes per read: one ranged GET of a seekable store, the write unit of a streamed one
_RANGED = {"block_size": _BLOCK, "cache_type": "none"}  # how a seekable store is read: one ranged GET per read
_MAX_DELAY_S = 10.0  # the longest single back-off sleep
_PARTIAL = ".partial-"  # in the name of a download not yet complete: "." + dest name + _PARTIAL + pid-thread
_MAX_NAMES = 1_000_000  # the most names one pattern may expand to (a typo such as {0..99999999} is an error)
# Query parameters that carry a secret (AWS and GCS signed URLs, Azure SAS, CloudFront, API tokens).
_SECRET_PARAMS = (
    "x-amz-signature|x-amz-credential|x-amz-security-token|x-goog-signature|x-goog-credential|googleaccessid|"
    "signature|sig|token|access_token|id_token|refresh_token|auth|authorization|key|api_key|apikey|password|"
    "secret|client_secret|policy"
)
_SECRET_QUERY = re.compile(rf"(?i)([?&;](?:{_SECRET_PARAMS})=)[^&;#\s\"'<>]*")
_USERINFO = re.compile(r"(?<=://)[^/@\s\"'<>]+@")
# Environment variables whose values are secrets; a library message that echoes one is masked as well.
_SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "GCS_TOKEN")
# 5xx but 501 Not Implemented and 505 Version Not Supported, 408 Request Timeout, 425 Too Early, 429 Too Many
_TRANSIENT_STATUS = {408, 425, 429} | set(range(500, 600)) - {501, 505}
# S3 (and S3-compatible) error codes that mean "try again later".
_TRANSIENT_CODES = set(
    "SlowDown RequestTimeout InternalError ServiceUnavailable Throttling ThrottlingException RequestLimitExceeded "
    "TooManyRequestsException BandwidthLimitExceeded OperationAborted RequestTimeoutException "
    "PriorRequestNotComplete".split()
)
# errno values of a network that failed, and those s3fs gives SlowDown / 503 (EBUSY) and 500 (EREMOTEIO).
_TRANSIENT_ERRNOS = {
    errno.ECONNRESET, errno.ECONNREFUSED, errno.ECONNABORTED, errno.ETIMEDOUT, errno.EPIPE, errno.ENETUNREACH,
    errno.EHOSTUNREACH, errno.ENETDOWN, errno.EAGAIN, errno.EBUSY, errno.EREMOTEIO
}  # fmt: skip
# Network-library exceptions, by top-level module and class name (so that none of these optional libraries is
# imported to recognise its errors): a connection that failed, a body cut short, a timeout.
_TRANSIENT_TYPES = {
    "aiohttp": {"ClientPayloadError", "ClientConnectionError", "ServerDisconnectedError", "ServerTimeoutError"},
    "botocore": {"HTTPClientError", "ConnectionError", "IncompleteReadError", "ResponseStreamingError"},
    "urllib3": {"ProtocolError", "TimeoutError"},
    "requests": {"ConnectionError", "Timeout", "ChunkedEncodingError"},
    "httpx": {"TransportError"},
    "fsspec": {"FSTimeoutError"},
}
_CREDENTIALS_HINT = {
    "s3": "the AWS credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN, or AWS_PROFILE; "
    "AWS_ENDPOINT_URL for an S3-compatible server) and the bucket's policy",
    "gs": "the Google credentials (GOOGLE_APPLICATION_CREDENTIALS, or gcloud auth application-default login) "
    "and the bucket's permissions",
    "hf": "the Hugging Face token (HF_TOKEN, or huggingface-cli login) and access to the repository",
    "http": "the URL's token or signature (a signed URL expires) and the server's permissions",
}


class RemoteError(OSError):
    """A remote object could not be read. ``url`` is the object's URL as ``redact`` shows it."""

    def __init__(self, message: str, url: str = ""):
        super().__init__(message)
        self.url = redact(url)


class TransientRemoteError(RemoteError):
    """A failure that may pass (a dropped connection, a timeout, throttling, a 5xx): worth retrying."""


class PermanentRemoteError(RemoteError):
    """A failure a retry cannot fix (no access, no such object, an object that changed): the message says
    what to check."""


@dataclass
class FetchStats:
    """What downloads cost, summed over the calls it is passed to (one thread's at a time)."""

    fetches: int = 0  # downloads that completed
    retries: int = 0  # attempts made again after a transient failure
    bytes: int = 0  # bytes read from the store, those of failed attempts included
    seconds: float = 0.0  # time spent in fetch_to, back-off sleeps included


def is_remote(path: str | os.PathLike) -> bool:
    """Whether ``path`` names an object in a store (``s3://``, ``gs://``, ``hf://``, ``https://``, any fsspec
    protocol) rather than a local file (a plain path or ``file://``)."""
    match = re.match(r"([A-Za-z][A-Za-z0-9+.-]*)://", os.fspath(path))
    return bool(match) and match.group(1).lower() not in ("file", "local")


def redact(text: str | os.PathLike) -> str:
    """``text`` (a URL, or a message that holds URLs) safe to print or log: ``user:password@`` removed, the
    values of query parameters that carry secrets (``X-Amz-Signature``, ``token``, ``sig``, ...) replaced by
    ``***``, and the value of any secret-holding environment variable (``AWS_SECRET_ACCESS_KEY``, ``HF_TOKEN``)
    masked where a library echoed it."""
    text = _SECRET_QUERY.sub(r"\1***", _USERINFO.sub("", os.fspath(text)))
    for name in _SECRET_ENV:
        secret = os.environ.get(name, "")
        if len(secret) >= 8:
            text = text.replace(secret, "***")
    return text


def classify(exc: BaseException) -> Literal["transient", "permanent"]:
    """Whether a failure to read a remote object is worth retrying.

    An S3 error code or an HTTP status anywhere in the exception's chain decides (SlowDown, RequestTimeout,
    InternalError, 5xx, 408, 429: transient; NoSuchKey, AccessDenied, 401, 403, 404: permanent); otherwise the
    innermost recognised exception does: timeouts, refused or reset connections, bodies cut short and s3fs's
    EBUSY / EREMOTEIO are transient; missing objects and refused permissions are permanent; so is anything
    unrecognised, so that a bug is reported rather than retried.
    """
    chain = _chain(exc)
    for e in chain:
        code, status = _s3_code(e), _http_status(e)
        if code is not None and not code.isdigit():
            return "transient" if code in _TRANSIENT_CODES else "permanent"
        if status is not None:
            return "transient" if status in _TRANSIENT_STATUS else "permanent"
    for e in reversed(chain):  # innermost first: fsspec wraps a refused connection in a FileNotFoundError
        if isinstance(e, PermanentRemoteError | FileNotFoundError | PermissionError | IsADirectoryError):
            return "permanent"
        if (
            isinstance(e, TransientRemoteError | TimeoutError | ConnectionError | http.client.HTTPException)
            or (isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS)
            or any(c.__name__ in _TRANSIENT_TYPES.get(c.__module__.split(".")[0], ()) for c in type(e).__mro__)
        ):
            return "transient"
    return "permanent"


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and what caused it (``__cause__``, else ``__context__``), outermost first, at most 16 deep."""
    out = [exc]
    while len(out) < 16 and (e := out[-1].__cause__ or out[-1].__context__) is not None and e not in out:
        out.append(e)
    return out


def _s3_code(e: BaseException) -> str | None:
    """The error code of a botocore ``ClientError`` (``e.response["Error"]["Code"]``), else None."""
    error = getattr(e, "response", None)
    error = error.get("Error") if isinstance(error, dict) else None
    return str(error["Code"]) if isinstance(error, dict) and error.get("Code") else None


def _http_status(e: BaseException) -> int | None:
    """The HTTP status of an error response: aiohttp's ``.status``, requests' / httpx's
    ``.response.status_code``, botocore's ``ResponseMetadata`` (or a numeric code), and ``.code`` of urllib's
    ``HTTPError`` and gcsfs's ``HttpError`` only (aiohttp's parse errors have a ``.code`` that is no status)."""
    response = getattr(e, "response", None)
    found = [getattr(e, "status", None), getattr(response, "status_code", None)]
    if type(e).__name__ in ("HTTPError", "HttpError"):
        found.append(getattr(e, "code", None))
    if isinstance(response, dict):
        code = _s3_code(e)
        found += [
            int(code) if code and code.isdigit() else None,
            response.get("ResponseMetadata", {}).get("HTTPStatusCode"),
        ]
    valid = [v for v in found if isinstance(v, int) and not isinstance(v, bool) and 100 <= v <= 599]
    return valid[0] if valid else None


def _wrap(url: str, e: BaseException) -> RemoteError:
    """``e``, raised while reading ``url``, as a Transient- or PermanentRemoteError whose message says what
    failed (the innermost cause, redacted) and, for a permanent one, what to check."""
    chain = _chain(e)
    root = chain[-1]
    what = " ".join(redact(f"{type(root).__name__}: {root}").split())[:300]
    u = redact(url)
    if classify(e) == "transient":
        return TransientRemoteError(f"{u}: {what}", url)
    statuses = {_http_status(x) for x in chain} | {_s3_code(x) for x in chain}
    if statuses & {401, 403, "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken"} or any(
        isinstance(x, PermissionError) for x in chain
    ):
        scheme = url.split("://", 1)[0].lower()
        hint = _CREDENTIALS_HINT.get({"s3a": "s3", "gcs": "gs"}.get(scheme, scheme), _CREDENTIALS_HINT["http"])
        return PermanentRemoteError(f"{u}: access denied ({what}); check {hint}", url)
    if statuses & {404, "NoSuchKey", "NoSuchBucket"} or any(isinstance(x, FileNotFoundError) for x in chain):
        return PermanentRemoteError(
            f"{u}: not found ({what}); check the path: the bucket or host, the prefix and the shard's name "
            f"(the shards recorded by {PREPARE} may have been moved or deleted since)",
            url,
        )
    return PermanentRemoteError(f"{u}: cannot be read ({what})", url)


@contextlib.contextmanager
def _reading(url: str):
    """Turn whatever the store's library raises inside the block into a Transient- or PermanentRemoteError.
    The library's exception stays reachable as ``__context__`` but is not printed with the traceback: its
    text may hold the unredacted URL."""
    try:
        yield
    except RemoteError:
        raise
    except Exception as e:
        raise _wrap(url, e) from None


def partial_path(dest: Path) -> Path:
    """Where ``fetch_to`` writes ``dest`` until it is complete: a hidden sibling whose name marks it as
    partial and is unique to this process and thread (``.NAME.partial-PID-THREAD``)."""
    return dest.with_name(f".{dest.name}{_PARTIAL}{os.getpid()}-{threading.get_ident()}")


def partial_of(name: str) -> str | None:
    """The name of the file that the partial download named ``name`` is for; None if ``name`` is no partial."""
    return name[1:].rsplit(_PARTIAL, 1)[0] if name.startswith(".") and _PARTIAL in name else None


def fetch_to(
    url: str,
    dest: str | os.PathLike,
    *,
    size: int | None = None,
    sha256: str | None = None,
    retries: int = 5,
    backoff_s: float = 0.2,
    timeout_s: float = 30.0,
    stats: FetchStats | None = None,
) -> Path:
    """Download the whole object at ``url`` to ``dest``, atomically and verified.

    The bytes go to ``partial_path(dest)``; when they are complete (and match ``size`` and ``sha256``, when
    given) they are flushed to disk and renamed to ``dest`` in one step, so a failed or killed download never
    leaves a file at ``dest``. A transient failure is retried up to ``retries`` times, sleeping
    ``backoff_s * 2**i`` (jittered, at most 10 s each) between attempts; a seekable store's download resumes
    where it stopped, a streamed one (http) starts again. An object whose size or hash is wrong is fetched once
    more, then refused. A permanent failure is raised at once.

    Args:
        url, dest: the object (any fsspec URL, or a local path) and the file to create or replace.
        size, sha256: what the object should be (bytes, hex SHA-256), or None.
        retries, backoff_s: how many times a transient failure is retried, and the first back-off sleep.
        timeout_s: how long a connection or a read may stall before the attempt fails.
        stats: counters to add this download's to.

    Returns:
        ``dest``.

    Raises:
        PermanentRemoteError: no access, no such object, or the object differs from ``size`` / ``sha256``
            twice (the message names the URL, what to check, or the expected and actual size and hash).
        TransientRemoteError: still failing after ``retries`` retries.
        OSError: writing ``dest`` failed (a full disk); nothing is left at ``dest``.
    """
    dest, stats = Path(dest), stats if stats is not None else FetchStats()
    policy = _Policy(retries, backoff_s, timeout_s)
    started, tmp = time.monotonic(), partial_path(dest)
    try:
        for again in (False, True):  # a mismatch is fetched once more: it may have been a change mid-download
            with open(tmp, "wb") as out:
                wrong = _mismatch(size, sha256, *_download(url, out, size, policy, stats))
                if not wrong:
                    out.flush()
                    os.fsync(out.fileno())
            if not wrong:
                os.replace(tmp, dest)
                fsync_dir(dest.parent)
                stats.fetches += 1
                return dest
            if not again:
                log.warning("%s: %s; fetching it once more", redact(url), wrong)
        raise PermanentRemoteError(
            f"{redact(url)}: {wrong}, fetched twice: the object changed since preparation: re-run {PREPARE}", url
        )
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        stats.seconds += time.monotonic() - started


def remote_size_and_sha256(
    url: str, *, retries: int = 5, backoff_s: float = 0.2, timeout_s: float = 30.0
) -> tuple[int, str]:
    """The size and SHA-256 of the object at ``url``, reading it once as a stream (nothing is written), with
    ``fetch_to``'s retries: what preparation records so that training can verify each shard it fetches."""
    return _download(url, _Discard(), None, _Policy(retries, backoff_s, timeout_s), FetchStats())


def _mismatch(size: int | None, sha256: str | None, got_size: int, got_sha: str) -> str:
    """What differs from what was expected ("" when nothing does)."""
    if size is not None and got_size != size:
        return f"expected {size} bytes (sha256 {sha256 or 'not recorded'}), got {got_size} (sha256 {got_sha})"
    if sha256 is not None and got_sha != sha256.lower():
        return f"expected sha256 {sha256} ({got_size} bytes), got sha256 {got_sha}"
    return ""


_Policy = namedtuple("_Policy", "retries backoff_s timeout_s")  # fetch_to's bounds, passed down as one


class _Discard:
    """A sink for bytes that are only hashed."""

    write = seek = truncate = staticmethod(lambda *args: None)


def _download(url: str, out, size: int | None, policy: _Policy, stats: FetchStats) -> tuple[int, str]:
    """Copy the object at ``url`` into the binary file ``out``, retrying transient failures (bounded);
    returns (bytes written, their SHA-256 hex)."""
    progress, started = _Progress(), time.monotonic()
    for attempt in range(policy.retries + 1):
        try:
            _transfer(url, out, size, progress, policy.timeout_s, stats)
            return progress.done, progress.hasher.hexdigest()
        except TransientRemoteError as e:
            if attempt == policy.retries:
                raise TransientRemoteError(
                    f"{e}; still failing after {attempt + 1} attempts in {time.monotonic() - started:.1f} s: the "
                    "store or the network is down or throttling; re-run when it is back, or allow more retries",
                    url,
                ) from None
            delay = min(policy.backoff_s * 2**attempt, _MAX_DELAY_S) * random.uniform(0.5, 1.0)
            stats.retries += 1
            log.warning("%s; retry %d of %d in %.2f s", e, attempt + 1, policy.retries, delay)
            time.sleep(delay)
    raise AssertionError("unreachable: the last attempt returns or raises")


class _Progress:
    """How far a download got: bytes written and their running hash (kept across a resumed attempt)."""

    def __init__(self):
        self.done, self.hasher = 0, hashlib.sha256()

    def restart(self, out) -> None:
        out.seek(0)
        out.truncate()
        self.done, self.hasher = 0, hashlib.sha256()


def _transfer(url: str, out, size: int | None, progress: _Progress, timeout_s: float, stats: FetchStats) -> None:
    """One attempt: open the object, resume at ``progress.done`` where the file can seek (else start over),
    and copy the rest into ``out``. Store failures come out as Transient- / PermanentRemoteError; a failure to
    write ``out`` (a full disk) as the OSError it is."""
    with _reading(url):
        fs, path = _filesystem(url, timeout_s)
        streamed = "http" in fs.protocol or "https" in fs.protocol
        fs.invalidate_cache(path)  # sizes come from the store, never from a listing cached earlier
        f = fs.open(path, "rb", block_size=0, size=size) if streamed else fs.open(path, "rb", **_RANGED)
    try:
        if progress.done and (streamed or not f.seekable()):
            progress.restart(out)
        elif progress.done:
            with _reading(url):
                f.seek(progress.done)
        while True:
            with _reading(url):
                block = f.read(_BLOCK)
            if not block:
                break
            out.write(block)
            progress.hasher.update(block)
            progress.done += len(block)
            stats.bytes += len(block)
        known = getattr(f, "size", None)
        if isinstance(known, int) and progress.done < known:
            raise TransientRemoteError(f"{redact(url)}: the body ended at {progress.done} of {known} bytes", url)
    finally:
        with contextlib.suppress(Exception):
            f.close()


def _filesystem(url: str, timeout_s: float):
    """The fsspec filesystem for ``url`` (fsspec keeps one per set of options) and the path within it."""
    import fsspec  # a quarter-second import: only the commands that read remote data pay for it

    protocol = fsspec.utils.get_protocol(url)
    fs, path = fsspec.core.url_to_fs(url, **_storage_options(protocol, timeout_s))
    if protocol in ("s3", "s3a"):
        fs.retries = 1  # s3fs's own retry loop off: _download's bounds and counts the attempts
    return fs, path


def _storage_options(protocol: str, timeout_s: float) -> dict:
    """The options this module gives a store: timeouts for a stalled connection, and no retries inside the
    store's library. Credentials are never passed: each library reads its own environment and config."""
    if protocol in ("http", "https"):
        import aiohttp  # fsspec's http filesystem is built on it

        # No total limit (aiohttp's default is 5 minutes, which would cut a large shard's download short).
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=timeout_s, sock_read=timeout_s)
        return {"client_kwargs": {"timeout": timeout}}
    if protocol in ("s3", "s3a"):
        config = {"connect_timeout": timeout_s, "read_timeout": timeout_s, "retries": {"total_max_attempts": 1}}
        # botocore reads AWS_ENDPOINT_URL itself; passing it too keys fsspec's cached filesystem by it.
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        return {"config_kwargs": config} | ({"endpoint_url": endpoint} if endpoint else {})
    return {}


def expand(pattern: str) -> list[str]:
    """The shards a pattern names, sorted and without duplicates.

    Brace ranges keep their zero padding, as webdataset and img2dataset write them (``{00000..00099}``);
    brace lists choose (``{train,val}``), nested too; then ``*``, ``?`` and ``[...]`` match existing objects (a
    remote pattern through fsspec's ``glob``, a local one through ``glob``). Names given by braces alone are
    returned without asking the store whether they exist.

    Raises:
        ValueError: the pattern matches nothing, its braces are unbalanced or hold neither a list nor a range,
            or it names more than a million shards.
    """
    out: set[str] = set()
    for name in _expand_braces(pattern):
        globbed = re.search(r"[*?\[]", name.split("?", 1)[0] if is_remote(name) else name)  # not in a query
        out.update(_glob(name) if globbed else [name])
    if not out:
        raise ValueError(f"shard pattern {redact(pattern)!r} matches nothing; check the prefix and the names")
    return sorted(out)


def _expand_braces(pattern: str) -> list[str]:
    """Expand the innermost ``{...}`` first until none is left (so nesting works); bounded by _MAX_NAMES."""
    todo, done = [pattern], []
    while todo:
        text = todo.pop()
        match = re.search(r"\{([^{}]*)\}", text)
        if match is None:
            if "{" in text or "}" in text:
                raise ValueError(f"shard pattern {redact(pattern)!r}: unbalanced braces")
            done.append(text)
        else:
            head, tail = text[: match.start()], text[match.end() :]
            todo.extend(head + choice + tail for choice in _brace_choices(match.group(1), pattern))
        if len(done) + len(todo) > _MAX_NAMES:
            raise ValueError(f"shard pattern {redact(pattern)!r} names more than {_MAX_NAMES} shards")
    return done


def _brace_choices(inner: str, pattern: str) -> list[str]:
    """``a,b,c`` -> its items; ``000..099`` -> the numbers, as wide as a zero-padded start (either order)."""
    if "," in inner:
        return inner.split(",")
    match = re.fullmatch(r"(\d+)\.\.(\d+)", inner)
    if match is None:
        raise ValueError(
            f"shard pattern {redact(pattern)!r}: {{{inner}}} is neither a list (a,b) nor a range (0..9)"
        )
    lo, hi = sorted(match.groups(), key=int)
    width = len(lo) if len(lo) > 1 and lo.startswith("0") else 0
    if int(hi) - int(lo) >= _MAX_NAMES:
        raise ValueError(f"shard pattern {redact(pattern)!r} names more than {_MAX_NAMES} shards")
    return [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]


def _glob(pattern: str) -> list[str]:
    if not is_remote(pattern):
        return local_glob.glob(pattern.removeprefix("file://"))
    with _reading(pattern):
        fs, path = _filesystem(pattern, timeout_s=30.0)
        return [fs.unstrip_protocol(p) for p in fs.glob(path)]


def remote_version(url: str, *, timeout_s: float = 30.0) -> tuple[int, str]:
    """(size, version) of the object at ``url`` from the store's listing, without reading it: the version is
    its ETag, else its modification time (what tells preparation's fingerprint that a shard changed).

    Raises:
        PermanentRemoteError / TransientRemoteError: as ``fetch_to`` sorts the failure.
    """
    with _reading(url):
        fs, path = _filesystem(url, timeout_s)
        info = fs.info(path)
    version = info.get("ETag") or info.get("etag") or info.get("LastModified") or info.get("mtime") or ""
    return int(info.get("size") or 0), str(version)
