"""Remote objects for streaming training data: which paths are remote, whole-object downloads that are
atomic and verified, and shard patterns expanded into URLs.

``http(s)://`` objects, and ``s3://`` ones through a URL presigned by s3fs with the store's own credentials,
are read with one plain GET each (``http_get``); every other store comes through fsspec (gcsfs for gs://,
huggingface_hub for hf://). Credentials come only from each store's own environment and config, and are
never printed: every message and log line here shows URLs and library errors through ``redact``. This module
owns the retries (s3fs's and botocore's are off), so that ``retries`` bounds the attempts and each one is
counted.
"""

from __future__ import annotations

import contextlib
import glob as local_glob
import hashlib
import logging
import os
import random
import re
import threading
import time
import urllib.parse
import urllib.request
from collections import namedtuple
from dataclasses import dataclass
from pathlib import Path

from mmfast.remote import http_get
from mmfast.remote.errors import PermanentRemoteError, TransientRemoteError, reading, redact, wrong_answer
from mmfast.util.commands import TRAIN
from mmfast.util.fsutil import fsync_dir

log = logging.getLogger(__name__)

_BLOCK = 8 << 20  # bytes per read of a store read through fsspec: one ranged GET of a seekable one
_RANGED = {"block_size": _BLOCK, "cache_type": "none"}  # how a seekable store is read: one ranged GET per read
_MAX_DELAY_S = 10.0  # the longest single back-off sleep
RETRY_S = 60.0  # how long a download retries a store that fails transiently, from its first failure
_PARTIAL = ".partial-"  # in the name of a download not yet complete: "." + dest name + _PARTIAL + pid-thread
_MAX_NAMES = 1_000_000  # the most names one pattern may expand to (a typo such as {0..99999999} is an error)
_SIGNED_FOR_S = 3600  # how long a presigned s3:// URL is valid (each attempt signs anew)
_REGION_REDIRECT = {301, 400}  # what S3 answers a URL signed for another region than the bucket's
_WRITE_BUFFER = 1 << 20  # bytes gathered before one write to the partial file
_HEAD = 1024  # the first bytes of an answer kept, to say what arrived when it is not the object


@dataclass
class FetchStats:
    """What downloads cost, summed over the calls it is passed to (one thread's at a time)."""

    fetches: int = 0  # downloads that completed
    retries: int = 0  # attempts made again after a transient failure
    retry_seconds: float = 0.0  # the back-off sleeps before them
    bytes: int = 0  # bytes read from the store, those of failed attempts included
    seconds: float = 0.0  # time spent in fetch_to, back-off sleeps included


def is_remote(path: str | os.PathLike) -> bool:
    """Whether ``path`` names an object in a store (``s3://``, ``gs://``, ``hf://``, ``https://``, any fsspec
    protocol) rather than a local file (a plain path or ``file://``)."""
    match = re.match(r"([A-Za-z][A-Za-z0-9+.-]*)://", os.fspath(path))
    return bool(match) and match.group(1).lower() not in ("file", "local")


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
    retry_s: float = RETRY_S,
    retries: int | None = None,
    backoff_s: float = 0.2,
    timeout_s: float = 30.0,
    stats: FetchStats | None = None,
    stop: threading.Event | None = None,
) -> Path:
    """Download the whole object at ``url`` to ``dest``, atomically and verified.

    The bytes go to ``partial_path(dest)``; when they are complete (and match ``size`` and ``sha256``, when
    given) they are flushed to disk and renamed to ``dest`` in one step, so a failed or killed download never
    leaves a file at ``dest``. A transient failure is retried for up to ``retry_s`` seconds, sleeping
    ``backoff_s * 2**i`` (jittered, at most 10 s each) between attempts, the last one at the bound; the bound
    starts again once an attempt gets further than any before. A seekable store's download resumes where it
    stopped, a streamed one (http) starts again. An object whose size or hash is wrong is fetched once more,
    then refused. A permanent failure is raised at once.

    Args:
        url, dest: the object (any fsspec URL, or a local path) and the file to create or replace.
        size, sha256: what the object should be (bytes, hex SHA-256), or None.
        retry_s: how long transient failures are retried (a store restarting, a network blip), in seconds.
        retries: at most this many retries as well (None: as many as ``retry_s`` allows).
        backoff_s: the first back-off sleep.
        timeout_s: how long a connection or a read may stall before the attempt fails.
        stats: counters to add this download's to.
        stop: once set, the download stops at its next piece or back-off (``FetchStopped``).

    Returns:
        ``dest``.

    Raises:
        PermanentRemoteError: no access, no such object, or the object differs from ``size`` / ``sha256``
            twice (the message names the URL, what to check, or the expected and actual size and hash).
        TransientRemoteError: still failing after ``retry_s`` (or ``retries``).
        OSError: writing ``dest`` failed (a full disk); nothing is left at ``dest``.
        FetchStopped: ``stop`` was set; nothing is left at ``dest``.
    """
    dest, stats = Path(dest), stats if stats is not None else FetchStats()
    policy = _Policy(retry_s, retries, backoff_s, timeout_s, stop)
    started, tmp = time.monotonic(), partial_path(dest)
    try:
        for again in (False, True):  # a mismatch is fetched once more: it may have been a change mid-download
            with open(tmp, "wb", buffering=_WRITE_BUFFER) as out:  # pieces off a slow link are small
                got = _download(url, out, size, policy, stats)
                wrong = _mismatch(size, sha256, got.done, got.hasher.hexdigest())
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
        arrived = wrong_answer(got.done, got.content_type, got.head)
        raise PermanentRemoteError(f"{redact(url)}: {wrong}, fetched twice: {arrived}", url)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        stats.seconds += time.monotonic() - started


def remote_size_and_sha256(
    url: str, *, retry_s: float = RETRY_S, backoff_s: float = 0.2, timeout_s: float = 30.0
) -> tuple[int, str]:
    """The size and SHA-256 of the object at ``url``, reading it once as a stream (nothing is written), with
    ``fetch_to``'s retries: what preparation records so that training can verify each shard it fetches."""
    got = _download(url, _Discard(), None, _Policy(retry_s, None, backoff_s, timeout_s), FetchStats())
    return got.done, got.hasher.hexdigest()


def _mismatch(size: int | None, sha256: str | None, got_size: int, got_sha: str) -> str:
    """What differs from what was expected ("" when nothing does)."""
    if size is not None and got_size != size:
        return f"expected {size} bytes (sha256 {sha256 or 'not recorded'}), got {got_size} (sha256 {got_sha})"
    if sha256 is not None and got_sha != sha256.lower():
        return f"expected sha256 {sha256} ({got_size} bytes), got sha256 {got_sha}"
    return ""


_Policy = namedtuple("_Policy", "retry_s retries backoff_s timeout_s stop", defaults=(None,))  # fetch_to's bounds


class FetchStopped(Exception):
    """A download stopped because its caller asked (``fetch_to``'s ``stop``): the shard cache closed."""


class _Discard:
    """A sink for bytes that are only hashed."""

    write = seek = truncate = staticmethod(lambda *args: None)


def _download(url: str, out, size: int | None, policy: _Policy, stats: FetchStats) -> _Progress:
    """Copy the object at ``url`` into the binary file ``out``, retrying transient failures for up to
    ``policy.retry_s`` from the first failure since the download last got further (bounded); returns what
    arrived (its size, hash, content type and first bytes)."""
    progress, started = _Progress(), time.monotonic()
    attempt, failing_since, furthest = 0, None, 0
    while True:
        try:
            _transfer(url, out, size, progress, policy, stats)
            return progress
        except TransientRemoteError as e:
            now = time.monotonic()
            if failing_since is None or progress.done > furthest:  # the outage (or a new one) starts here
                failing_since, furthest = now, max(furthest, progress.done)
            left = failing_since + policy.retry_s - now
            if left <= 0 or (policy.retries is not None and attempt >= policy.retries):
                advice = (
                    f"re-run when it is back (a training run: with --resume latest; {TRAIN} --store-timeout waits "
                    f"longer, now {policy.retry_s:g} s)"
                )
                raise _gave_up(e, url, attempt, started, advice) from None
            attempt += 1
            delay = _retry_delay(e, attempt, left, policy)
            stats.retries += 1
            stats.retry_seconds += delay
            if (policy.stop or threading.Event()).wait(delay):  # an Event never set: a plain sleep
                raise FetchStopped(f"{redact(url)}: stopped") from None


class _Progress:
    """How far a download got: bytes written, their running hash and the first of them (kept across a resumed
    attempt), and the answer's content type."""

    def __init__(self):
        self.done, self.hasher, self.head, self.content_type = 0, hashlib.sha256(), b"", None

    def restart(self, out) -> None:
        out.seek(0)
        out.truncate()
        self.done, self.hasher, self.head = 0, hashlib.sha256(), b""

    def add(self, piece: bytes) -> None:
        if len(self.head) < _HEAD:
            self.head += piece[: _HEAD - len(self.head)]
        self.hasher.update(piece)
        self.done += len(piece)


def _transfer(url: str, out, size: int | None, progress: _Progress, policy: _Policy, stats: FetchStats) -> None:
    """One attempt: open the object at ``progress.done`` (where the store serves a range; else from the
    start) and copy the rest into ``out``. Store failures come out as Transient- / PermanentRemoteError; a
    failure to write ``out`` (a full disk) as the OSError it is."""
    with reading(url):
        body = _open(url, progress.done, policy.timeout_s)
    with body:
        if body.offset != progress.done:
            progress.restart(out)
        progress.content_type = getattr(body, "content_type", None) or progress.content_type
        pieces = body.pieces()
        while True:
            with reading(url):
                piece = next(pieces, None)
            if piece is None:
                break
            if policy.stop is not None and policy.stop.is_set():
                raise FetchStopped(f"{redact(url)}: stopped at {progress.done} bytes")
            out.write(piece)
            progress.add(piece)
            stats.bytes += len(piece)
        if body.total is not None and progress.done < body.total:
            ended = f"the body ended at {progress.done} of {body.total} bytes"
            raise TransientRemoteError(f"{redact(url)}: {ended}", url)


def _open(url: str, offset: int, timeout_s: float):
    """The object's bytes from ``offset`` on (an ``http_get.Body``, or an fsspec file in its shape): one GET
    for http(s):// and for a presigned s3:// URL, fsspec's ranged reads for any other store, and for an
    s3:// object whose presigned GET S3 answers with a redirect or 400 (a bucket in another region than the
    one signed for: s3fs's client follows S3's region redirects)."""
    if url.split("://", 1)[0].lower() in ("http", "https"):
        return http_get.open_body(url, offset, timeout_s=timeout_s)
    signed = _presigned(url, timeout_s)
    if signed is not None:
        try:
            return http_get.open_body(signed, offset, timeout_s=timeout_s)
        except http_get.HTTPStatusError as e:
            if e.status not in _REGION_REDIRECT:
                raise
            log.debug("%s: the presigned GET was answered %s; reading it through s3fs", redact(url), e)
    fs, path = _filesystem(url, timeout_s)
    fs.invalidate_cache(path)  # sizes come from the store, never from a listing cached earlier
    return _FsspecBody(fs.open(path, "rb", **_RANGED), offset)


def _presigned(url: str, timeout_s: float) -> str | None:
    """An https GET URL for an s3:// object, signed by s3fs with the store's credentials (the signature is
    masked by ``redact`` wherever the URL is shown); None for other stores, when s3fs cannot sign (no
    credentials: then s3fs reads the object and its error says what is wrong), or when the environment names
    a proxy for the endpoint."""
    if url.split("://", 1)[0].lower() not in ("s3", "s3a"):
        return None
    fs, path = _filesystem(url, timeout_s)
    try:
        signed = fs.sign(path, expiration=_SIGNED_FOR_S)
    except Exception as e:  # botocore's NoCredentialsError and kin: the unsigned read reports it
        log.debug("%s: not presigned (%s); reading it through s3fs", redact(url), type(e).__name__)
        return None
    parts = urllib.parse.urlsplit(signed)
    if parts.scheme in urllib.request.getproxies() and not urllib.request.proxy_bypass(parts.hostname or ""):
        return None  # HTTPS_PROXY / HTTP_PROXY: s3fs's reads go through the proxy, a plain GET would not
    return signed


class _FsspecBody:
    """An fsspec file read from ``offset`` (where it can seek; else from 0), in ``http_get.Body``'s shape."""

    def __init__(self, f, offset: int):
        self._f, self.offset = f, offset if offset and f.seekable() else 0
        known = getattr(f, "size", None)
        self.total = known if isinstance(known, int) else None
        if self.offset:
            try:
                f.seek(self.offset)
            except BaseException:
                f.close()
                raise

    def pieces(self):
        while block := self._f.read(_BLOCK):
            yield block

    def __enter__(self) -> _FsspecBody:
        return self

    def __exit__(self, *exc) -> None:
        with contextlib.suppress(Exception):
            self._f.close()


def _filesystem(url: str, timeout_s: float):
    """The fsspec filesystem for ``url`` (fsspec keeps one per set of options) and the path within it."""
    import fsspec  # a slow import: only the commands that read remote data pay for it

    protocol = fsspec.utils.get_protocol(url)
    fs, path = fsspec.core.url_to_fs(url, **_storage_options(protocol, timeout_s))
    if protocol in ("s3", "s3a"):
        fs.retries = 1  # s3fs's own retry loop off: _download's bounds and counts the attempts
    return fs, path


def _storage_options(protocol: str, timeout_s: float) -> dict:
    """The options this module gives a store: timeouts for a stalled connection, and no retries inside the
    store's library. Credentials are never passed: each library reads its own environment and config."""
    if protocol in ("http", "https"):
        import aiohttp  # only for an http(s) store: fsspec's http filesystem is built on it

        # No total limit (aiohttp's default is 5 minutes, which would cut a large shard's download short).
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=timeout_s, sock_read=timeout_s)
        return {"client_kwargs": {"timeout": timeout}}
    if protocol in ("s3", "s3a"):
        config = {"connect_timeout": timeout_s, "read_timeout": timeout_s, "retries": {"total_max_attempts": 1}}
        config["signature_version"] = "s3v4"  # presigned URLs too: buckets made since 2020 refuse SigV2
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

    def listing() -> list[str]:
        fs, path = _filesystem(pattern, timeout_s=30.0)
        return [fs.unstrip_protocol(p) for p in fs.glob(path)]

    return _retrying(pattern, listing)


def remote_version(url: str, *, timeout_s: float = 30.0) -> tuple[int, str]:
    """(size, version) of the object at ``url`` from the store's listing, without reading it: the version is
    its ETag, else its modification time (what tells preparation's fingerprint that a shard changed).

    Raises:
        PermanentRemoteError / TransientRemoteError: as ``fetch_to`` sorts the failure.
    """

    def stat() -> dict:
        fs, path = _filesystem(url, timeout_s)
        return fs.info(path)

    info = _retrying(url, stat)
    version = info.get("ETag") or info.get("etag") or info.get("LastModified") or info.get("mtime") or ""
    return int(info.get("size") or 0), str(version)


def _retrying(url: str, call, retry_s: float = RETRY_S, backoff_s: float = 0.5):
    """``call()`` under ``reading(url)``, its transient failures retried for up to ``retry_s`` seconds: a listing
    or a stat at preparation rides out what a download would (a store restarting, a network blip)."""
    policy, started, attempt = _Policy(retry_s, None, backoff_s, None), time.monotonic(), 0
    while True:
        try:
            with reading(url):
                return call()
        except TransientRemoteError as e:
            left = started + retry_s - time.monotonic()
            if left <= 0:
                advice = "check that the store answers (an S3-compatible server: AWS_ENDPOINT_URL) and re-run"
                raise _gave_up(e, url, attempt, started, advice) from None
            attempt += 1
            time.sleep(_retry_delay(e, attempt, left, policy))


def _retry_delay(e: Exception, attempt: int, left: float, policy: _Policy) -> float:
    """How long to wait before retry ``attempt`` (from 1): twice the last wait, from ``policy.backoff_s``, jittered
    and capped, and never past the ``left`` seconds of the bound (the last attempt is made at the bound)."""
    delay = min(policy.backoff_s * 2 ** min(attempt - 1, 16), _MAX_DELAY_S) * random.uniform(0.5, 1.0)
    delay = min(delay, left)
    log.warning("%s; retry %d in %.2f s (retrying for up to %g s)", e, attempt, delay, policy.retry_s)
    return delay


def _gave_up(e: Exception, url: str, attempts: int, started: float, advice: str) -> TransientRemoteError:
    """The error once retries are spent: the last failure, how many attempts in how long, and ``advice``."""
    took = time.monotonic() - started
    return TransientRemoteError(
        f"{e}; still failing after {attempts + 1} attempt{'s' if attempts else ''} in {took:.1f} s: the store or "
        f"the network is down or throttling; {advice}",
        url,
    )
