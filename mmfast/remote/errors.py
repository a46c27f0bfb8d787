"""How a failed remote read is told and shown: URLs safe to print, failures sorted into transient (worth a
retry) and permanent (stop, and say what to check), whatever library raised them.

Messages and log lines about remote objects show URLs and library errors through ``redact`` only: credentials
never reach them.
"""

from __future__ import annotations

import contextlib
import errno
import http.client
import os
import re
import socket
from typing import Literal

from mmfast.util.commands import PREPARE

# Query parameters that carry a secret (AWS and GCS signed URLs, Azure SAS, CloudFront, API tokens).
_SECRET_PARAMS = (
    "x-amz-signature|x-amz-credential|x-amz-security-token|awsaccesskeyid|x-goog-signature|x-goog-credential|googleaccessid|"
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
_HTML_STARTS = (b"<!doctype html", b"<html")  # how an HTML page begins, whatever its Content-Type says
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
# getaddrinfo's answers that the name does not exist (EAI_AGAIN, a resolver that did not answer, stays transient)
_NO_SUCH_HOST = {getattr(socket, n) for n in ("EAI_NONAME", "EAI_NODATA") if hasattr(socket, n)}
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
    InternalError, 5xx, 408, 429: transient; NoSuchKey, AccessDenied, 401, 403, 404: permanent; a code not
    known as transient goes by its status when there is one); otherwise the
    innermost recognised exception does: timeouts, refused or reset connections, bodies cut short and s3fs's
    EBUSY / EREMOTEIO are transient; missing objects and refused permissions are permanent; so is anything
    unrecognised, so that a bug is reported rather than retried.
    """
    chain = _chain(exc)
    if any(isinstance(e, socket.gaierror) and e.errno in _NO_SUCH_HOST for e in chain):
        return "permanent"  # a name that does not resolve (a mistyped host, no AWS_ENDPOINT_URL): not a blip
    for e in chain:
        code, status = _s3_code(e), _http_status(e)
        if code in _TRANSIENT_CODES:
            return "transient"
        if status is not None:  # a code not known as transient goes by its status (Azure's 503 ServerBusy)
            return "transient" if status in _TRANSIENT_STATUS else "permanent"
        if code is not None and not code.isdigit():
            return "permanent"
    for e in reversed(chain):  # innermost first: fsspec wraps a refused connection in a FileNotFoundError
        if isinstance(e, PermanentRemoteError | FileNotFoundError | PermissionError | IsADirectoryError):
            return "permanent"
        if (
            isinstance(e, TransientRemoteError | TimeoutError | ConnectionError | http.client.HTTPException)
            or (isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS)
            or (isinstance(e, socket.gaierror) and e.errno == socket.EAI_AGAIN)  # the resolver did not answer
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


def as_remote_error(url: str, e: BaseException) -> RemoteError:
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
            f"(or, where {PREPARE} read it before, whether it was moved or deleted since)",
            url,
        )
    if any(isinstance(x, socket.gaierror) and x.errno in _NO_SUCH_HOST for x in chain):
        return PermanentRemoteError(
            f"{u}: cannot be read ({what}): the store's host name does not resolve; check the URL's host (an "
            "S3-compatible server: AWS_ENDPOINT_URL) and the network",
            url,
        )
    return PermanentRemoteError(f"{u}: cannot be read ({what})", url)


@contextlib.contextmanager
def reading(url: str):
    """Turn whatever the store's library raises inside the block into a Transient- or PermanentRemoteError.
    The library's exception stays reachable as ``__context__`` but is not printed with the traceback: its
    text may hold the unredacted URL."""
    try:
        yield
    except RemoteError:
        raise
    except Exception as e:
        raise as_remote_error(url, e) from None


def wrong_answer(got_size: int, content_type: str | None, head: bytes) -> str:
    """What arrived instead of the object and what to check: an HTML page (a sign-in, error or proxy page), a
    text answer (quoted, redacted), or other bytes (the object changed since preparation).

    Args:
        got_size: the bytes that arrived.
        content_type: the answer's Content-Type (None when the store gave none).
        head: its first bytes.
    """
    kind = (content_type or "").split(";")[0].strip().lower()
    html = kind in ("text/html", "application/xhtml+xml") or head.lstrip()[:64].lower().startswith(_HTML_STARTS)
    textual = kind.startswith("text/") or kind in ("application/json", "application/xml")
    arrived = f"{got_size} bytes" + (f" of {kind}" if kind else "")
    if not (html or textual):
        return (
            f"the object changed since preparation: re-run {PREPARE}, or check that the URL still names that "
            f"object ({arrived} arrived)"
        )
    title = re.search(rb"<title[^>]*>(.*?)</title>", head, re.IGNORECASE | re.DOTALL) if html else None
    text = re.sub(r"<[^>]*>", " ", (title.group(1) if title else head).decode(errors="replace"))
    quoted = redact(" ".join(text.split()))[:120]
    return (
        f"the store answered with {'an HTML page' if html else 'a text answer'} ({arrived})"
        + (f" that reads {quoted!r}" if quoted else "")
        + ", not the shard. It is a sign-in, error or proxy page: check the URL, that it needs no login (a signed "
        "URL expires), any proxy between, and the store's permissions"
    )
