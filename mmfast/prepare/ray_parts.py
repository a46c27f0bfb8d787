"""Preparation on a Ray cluster: ``mmfast-prepare SOURCE --out OUT --ray [ADDRESS]`` checks the parts that
``--shard I/N`` defines (``prepare.parts``) as Ray tasks, then joins them as ``--merge`` does: OUT is what a
one-process preparation writes (the same rows, ids, split and fingerprint).

The cluster
    no ADDRESS      ``ray.init()``: the cluster RAY_ADDRESS names, else the one last started on this machine,
                    else a new one on this machine alone
    auto, HOST:PORT, ray://HOST:PORT, local
                    passed to ``ray.init(address=...)`` as they are (``auto``: a running cluster or an error);
                    HOST:PORT must accept a connection within ``--ray-timeout`` seconds first (Ray's own
                    connect retries for many minutes where nothing answers, in native code)

The parts
    --ray-parts N   how many; by default the count of the parts already in OUT.parts/ (so a re-run after a
                    failure makes only the missing ones: ``prepare.parts`` keeps a part that is complete for
                    the same input and settings), else ``PARTS_PER_SLOT`` per part the cluster can run at once,
                    so a slow part is balanced by the others. Parts of two counts in OUT.parts/ are refused.
    --workers W     each part is one task that reserves W CPUs (``num_cpus``) and validates its images with W
                    processes (``util.pool``); 0, the default, means 1: Ray runs one part on each CPU.

Each part is a task named ``mmfast part I/N`` (its workers' process title is ``ray::mmfast part I/N``). A task
whose worker or node dies is run again, ``MAX_RETRIES`` times at most (Ray's ``max_retries``); an error of the
part itself (a bad input, an --out that is not mmfast's) is not retried: the first one stops the run, the
other parts are cancelled, and the error names the part, its node and the cause. Each part is reported as it
completes: its rows, seconds and node.

What every node needs
    - OUT's folder at the same path, on a shared filesystem (NFS, Lustre, ...): the parts are written there and
      merged from there. The command writes a token file into OUT.parts/ first, and a part that does not read it
      back fails, naming its node.
    - the input at the same path (on the shared filesystem) or at a URL (s3://...); relative paths are taken
      from the command's working directory, which then must exist on every node.
    - mmfast importable, in the environment the node's ``ray start`` runs in (on one machine: the same venv).
      Ray's ``runtime_env`` (``py_modules``, ``pip``) can ship it instead, for instance through
      ``ray job submit --runtime-env-json ...``; mmfast does not ship its own code.
    - a part is locked per machine (``locks.lock_dir``): MMFAST_LOCK_DIR, set to one shared folder in the
      environment of every node's ``ray start``, makes the locks cluster-wide (two runs into one OUT at once).
With ``ray://`` (Ray Client) the merge runs where the command runs: that machine must see OUT too.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import signal
import socket
import threading
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from mmfast.inputs.manifest import ManifestError
from mmfast.prepare.config import PrepareConfig, part_dir, parts_root
from mmfast.prepare.core import prepare_dataset
from mmfast.prepare.fingerprint import input_fingerprint
from mmfast.remote.objects import is_remote
from mmfast.util.commands import PREPARE
from mmfast.util.fsutil import atomic_write_text
from mmfast.util.listener import UnknownHost, wait_for_listener

log = logging.getLogger(__name__)
RAY_HINT = "pip install 'mmfast[ray]'"
MAX_RETRIES = 3  # runs again of a part whose worker or node died (Ray's max_retries)
PARTS_PER_SLOT = 2  # default parts for each part the cluster runs at once
CONNECT_TIMEOUT_S = 60.0  # default of --ray-timeout: how long a HOST:PORT address may take to answer
_SAY_EVERY_S = 10.0  # how often a wait for the head node is said
_HOST_PORT = re.compile(r"\[?([^\[\]/]+?)\]?:(\d{1,5})")  # HOST:PORT or [IPv6]:PORT (not ray://, auto, local)
_TOKEN_PREFIX = ".ray-token-"  # OUT.parts/.ray-token-<hex>: the file every part must see
_PART_NAME = re.compile(r"(\d{5})-of-(\d{5})")


class RayPartsError(ValueError):
    """A Ray preparation that cannot start or did not complete; the message says why and what to do."""


class PartFailed(Exception):
    """Raised in a part's task for an error of the part itself (never retried): the message, and for an error
    that is a bug rather than bad input, the task's traceback as text."""

    def __init__(self, message: str, detail: str = ""):
        super().__init__(message, detail)  # both in args: the exception travels pickled to the driver

    def __str__(self) -> str:
        return self.args[0]


@dataclass(frozen=True)
class RayOptions:
    """Where and in how many parts (``mmfast-prepare --ray [ADDRESS] --ray-parts N``)."""

    address: str | None = None  # None: ray.init()'s own choice (RAY_ADDRESS, a local cluster, a new one)
    parts: int | None = None  # None: ``part_count``'s default
    timeout_s: float = CONNECT_TIMEOUT_S  # how long a HOST:PORT address may take to answer

    def __post_init__(self):
        if self.parts is not None and self.parts < 1:
            raise ValueError(f"--ray-parts must be at least 1, got {self.parts}")
        if not self.timeout_s > 0:
            raise ValueError(f"--ray-timeout must be > 0 seconds, got {self.timeout_s}")


@dataclass(frozen=True)
class SharedCheck:
    """What a part checks before it starts: that its node sees the file the command wrote into OUT.parts/
    (the same filesystem), and the folder relative paths are taken from."""

    token: str  # the token file's path
    value: str  # what the command wrote into it
    cwd: str  # the command's working directory
    host: str  # the machine the command runs on (for messages)


def prepare_on_ray(cfg: PrepareConfig, opts: RayOptions) -> dict:
    """Check ``cfg``'s input in parts as Ray tasks, then merge them into ``cfg.out``.

    Args:
        cfg: the preparation's settings (without ``shard`` or ``merge``); ``cfg.workers`` is the CPUs and
            processes of each part (0: 1).
        opts: the cluster's address and the number of parts.

    Returns:
        the merged directory's prepare.json.

    Raises:
        RayPartsError: no ray, no cluster, a part that failed (naming it, its node and the cause).
        ManifestError, OutputDirError: from the merge, as for ``--merge``.
    """
    if cfg.shard is not None or cfg.merge:
        raise ValueError("--ray runs every part and merges them: pass it without --shard or --merge")
    ray = import_ray()
    input_fingerprint(cfg)  # the input is there (ManifestError), before a cluster is asked for anything
    started = _connect(ray, opts.address, opts.timeout_s)
    try:
        per_part = cfg.workers or 1
        cpus = int(ray.cluster_resources().get("CPU", 0))
        n = part_count(cfg.out, opts.parts, cpus // per_part)
        if cpus < per_part:
            log.warning(
                "the Ray cluster has %d CPUs now and a part reserves %d (--workers): the parts wait "
                "for a node that has them",
                cpus,
                per_part,
            )
        log.info("checking %d parts on Ray (%d CPUs, %d a part)", n, cpus, per_part)
        with _shared_token(cfg) as check:
            _run_parts(ray, replace(cfg, workers=per_part, progress=False), n, check)
    finally:
        if started:
            ray.shutdown()
    return prepare_dataset(replace(cfg, merge=True))


def import_ray():
    """The ``ray`` module. Raises RayPartsError naming the install command when it is missing."""
    try:
        import ray  # here, not at the top: an optional extra, and --ray is the only user of it
    except ImportError:
        raise RayPartsError(f"--ray needs Ray, which is not installed: {RAY_HINT}") from None
    return ray


def part_count(out: str | os.PathLike, requested: int | None, slots: int) -> int:
    """How many parts a Ray preparation into ``out`` makes: ``requested``, else the count of the parts already
    in OUT.parts/, else ``PARTS_PER_SLOT * slots`` (``slots``: parts the cluster runs at once).

    Raises:
        RayPartsError: OUT.parts/ holds parts of another count (or of two), or there is nothing to count by.
    """
    root = parts_root(out)
    counts = sorted({int(m[2]) for p in _listing(root) if (m := _PART_NAME.fullmatch(p.name)) and p.is_dir()})
    others = [c for c in counts if c != requested]
    if others and (requested is not None or len(counts) > 1):
        raise RayPartsError(
            f"{root} holds the parts of a preparation in {' and '.join(map(str, counts))} parts, and a merge "
            f"takes the parts of one count: pass --ray-parts {others[0]} to complete them (the complete ones are "
            f"kept), or remove {root} (rm -r {root})"
        )
    if requested is not None:
        return requested
    if counts:
        return counts[0]
    if slots < 1:
        raise RayPartsError(
            "the Ray cluster has no CPU for a part now (an autoscaling cluster?): pass --ray-parts N"
        )
    return PARTS_PER_SLOT * slots


def _listing(root: Path) -> list[Path]:
    try:
        return list(root.iterdir())
    except OSError:  # no parts yet
        return []


def _connect(ray, address: str | None, timeout_s: float) -> bool:
    """Connect to the cluster (unless this process already is a Ray driver); True when this call did."""
    if ray.is_initialized():
        return False
    if address is not None and (m := _HOST_PORT.fullmatch(address)):
        _await_head(address, m[1], int(m[2]), timeout_s)
    on_term = signal.getsignal(signal.SIGTERM)
    try:
        ray.init(address=address)
    except Exception as e:  # ConnectionError, ValueError (a malformed address), RuntimeError, ...
        where = f"at {address}" if address else "(ray.init(): RAY_ADDRESS, else a local one)"
        raise RayPartsError(f"--ray: no Ray cluster {where}: {_first_line(e)}") from None
    finally:
        if threading.current_thread() is threading.main_thread() and on_term is not None:
            signal.signal(signal.SIGTERM, on_term)  # ray.init sets its own (sys.exit): the command's stays
    return True


def _await_head(address: str, host: str, port: int, timeout_s: float) -> None:
    """Return once the head node at ``host:port`` accepts a connection: Ray's own connect to an address where
    no cluster answers retries for many minutes, in native code where a stop signal waits."""
    if not 0 < port < 65536:
        raise RayPartsError(f"--ray {address}: {port} is no port (1 to 65535)")
    start = time.monotonic()
    said = [start]  # when the last line was printed

    def waiting(failure: str) -> None:
        now = time.monotonic()
        if now - said[0] >= _SAY_EVERY_S:
            said[0] = now
            log.warning("--ray %s: waiting for the head node (%.0f s of --ray-timeout %g): %s", address,
                        now - start, timeout_s, failure)  # fmt: skip
        if now - start > timeout_s:
            raise RayPartsError(
                f"--ray {address}: no Ray cluster answers there within {timeout_s:g} s ({failure}): check the "
                "address that `ray start --head` printed on the head node (its port is 6379 unless --port said "
                "otherwise), that the head node runs, and that no firewall blocks the port; --ray-timeout sets "
                "the wait"
            )

    try:
        wait_for_listener(host, port, waiting)
    except UnknownHost as e:
        raise RayPartsError(f"--ray {address}: {e}: check the head node's name or address") from None


@contextmanager
def _shared_token(cfg: PrepareConfig):
    """Write the token file every part must see into OUT.parts/ for the block; remove it (and OUT.parts/
    when this created it and nothing else is in it) afterwards."""
    root = parts_root(cfg.out)
    created = not os.path.lexists(root)
    root.mkdir(parents=True, exist_ok=True)
    value = secrets.token_hex(16)
    token = root / f"{_TOKEN_PREFIX}{value}"
    atomic_write_text(token, value)
    try:
        yield SharedCheck(str(token.resolve()), value, os.getcwd(), socket.gethostname())
    finally:
        token.unlink(missing_ok=True)
        if created:
            try:
                root.rmdir()
            except OSError:  # parts in it (the usual case)
                pass


def _run_parts(ray, cfg: PrepareConfig, n: int, check: SharedCheck) -> None:
    """Run parts 0..n-1 as tasks and report each as it completes.

    Raises:
        RayPartsError: the first part that failed (the others are cancelled).
    """
    task = ray.remote(num_cpus=cfg.workers, max_retries=MAX_RETRIES, retry_exceptions=False)(run_part)
    pending = {task.options(name=f"mmfast part {i}/{n}").remote(cfg, i, n, check): i for i in range(n)}
    t0, rows = time.perf_counter(), 0
    try:
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            for ref in ready:
                i = pending.pop(ref)
                done = _result(ray, ref, i, n)
                rows += done["input_rows"]
                log.info(
                    "%s  [%d/%d parts, %.0f s]", _done_line(done, n), n - len(pending), n, time.perf_counter() - t0
                )
    finally:
        _cancel(ray, list(pending))
    log.info(
        "%d parts checked (%d input rows) in %.1f s; merging them into %s",
        n,
        rows,
        time.perf_counter() - t0,
        cfg.out,
    )


def _result(ray, ref, i: int, n: int) -> dict:
    """A finished part's report, or the RayPartsError that says why it failed."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayError as e:
        raise part_error(ray.exceptions, e, i, n) from None


def part_error(exceptions, e: Exception, i: int, n: int) -> RayPartsError:
    """What to tell the user of part i of n that failed with ``e`` (a ``ray.exceptions`` error): the part's own
    error (``PartFailed``), mmfast missing on a node, or the worker or node dying on every try."""
    cause = e.cause if isinstance(e, exceptions.RayTaskError) else None
    if isinstance(cause, PartFailed):
        return RayPartsError(f"{cause}\n{cause.args[1]}".rstrip())
    if "No module named 'mmfast" in str(e):  # the task's function could not be imported on the worker
        return RayPartsError(
            f"part {i}/{n}: mmfast cannot be imported on the Ray node {getattr(e, 'ip', '?')}: install it on "
            f"every node, in the environment its `ray start` runs in ({RAY_HINT}), or hand it to Ray's runtime_env"
        )
    if cause is not None:
        return RayPartsError(f"part {i}/{n} failed on the cluster: {type(cause).__name__}: {_first_line(cause)}")
    died = (exceptions.WorkerCrashedError, exceptions.NodeDiedError, exceptions.OutOfMemoryError)
    why = (
        f" (its worker or node died on each of {MAX_RETRIES + 1} tries: an image that crashes the decoder, or a "
        "node out of memory?)"
        if isinstance(e, died)
        else ""
    )
    return RayPartsError(
        f"part {i}/{n} did not complete: {type(e).__name__}: {_first_line(e)}{why}; the complete parts are kept, "
        "so the same command again makes only the others"
    )


def _done_line(done: dict, n: int) -> str:
    i, rows = done["part"], f"{done['accepted']} of {done['input_rows']} rows kept"
    if done["kept"]:
        return f"part {i}/{n}: complete already ({rows}, {done['node']})"
    return f"part {i}/{n}: {rows} in {done['seconds']:.1f} s on {done['node']}"


def _cancel(ray, refs: list) -> None:
    """Cancel the parts still running after a failure, and collect their outcome for a few seconds (an outcome
    never collected would be printed by Ray as an unhandled error)."""
    if not refs:
        return
    for ref in refs:
        ray.cancel(ref)
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=10)
    for ref in ready:
        try:
            ray.get(ref)
        except Exception:  # TaskCancelledError, or the part's own error: the first failure was reported
            pass


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]


def run_part(cfg: PrepareConfig, i: int, n: int, check: SharedCheck) -> dict:
    """The task: check part ``i`` of ``n`` into OUT.parts/ (``prepare.parts``), in the command's working
    directory. Returns {"part", "input_rows", "accepted", "seconds", "kept", "node"}.

    Raises:
        PartFailed: OUT or the input is not there as the command sees it, or the part failed.
    """
    node = node_name()
    with _working_dir(check.cwd):
        check_shared(check, cfg, node)
        summary_path = part_dir(cfg.out, i, n) / "part.json"
        before = _mtime_ns(summary_path)
        t0 = time.perf_counter()
        try:
            summary = prepare_dataset(replace(cfg, shard=(i, n)))
        except (ManifestError, ValueError, OSError) as e:  # bad input, --out, disk: the message says it all
            raise PartFailed(f"part {i}/{n} (on {node}): {e}") from None
        except Exception as e:  # a bug: the traceback comes along
            raise PartFailed(
                f"part {i}/{n} (on {node}): {type(e).__name__}: {e}", traceback.format_exc()
            ) from None
        kept = before is not None and before == _mtime_ns(summary_path)
    c = summary["counts"]
    return {
        "part": i,
        "input_rows": c["input_rows"],
        "accepted": c["accepted"],
        "seconds": time.perf_counter() - t0,
        "kept": kept,
        "node": node,
    }


def node_name() -> str:
    """This Ray node, for messages: host name, IP and the start of its node id."""
    import ray  # here: only ever called inside a Ray task (see import_ray)

    node_id = ray.get_runtime_context().get_node_id()
    return f"node {socket.gethostname()} ({ray.util.get_node_ip_address()}, {node_id[:8]})"


def check_shared(check: SharedCheck, cfg: PrepareConfig, node: str) -> None:
    """Refuse to check a part on a node that does not see OUT.parts/ as the command wrote it, or that lacks the
    command's working directory while a path is relative to it.

    Raises:
        PartFailed: the token file is missing or different here, its folder is not writable, or a relative
            path has no folder to be relative to.
    """
    folder = os.path.dirname(check.token)
    try:
        seen = Path(check.token).read_text(encoding="utf-8")
    except OSError:
        seen = None
    if seen != check.value:
        raise PartFailed(
            f"{node} does not see {folder} as {check.host}, where {PREPARE} runs, wrote it: every Ray node "
            "must see --out's folder at the same path, on a shared filesystem (NFS, Lustre, ...)"
        )
    if not os.access(folder, os.W_OK | os.X_OK):
        raise PartFailed(f"{node} cannot write to {folder}: the parts are written there by every node")
    relative = [p for p in (cfg.source, cfg.out, cfg.inputs.image_root) if _is_relative(p)]
    if relative and not os.path.isdir(check.cwd):
        raise PartFailed(
            f"{node} has no folder {check.cwd} ({PREPARE}'s working directory, which {relative[0]} is relative "
            "to): pass absolute paths on the shared filesystem"
        )


@contextmanager
def _working_dir(cwd: str):
    """Run the block in the command's working directory when this node has it: relative paths mean there what
    they meant where the command was typed (``check_shared`` refused them on a node without it)."""
    old = os.getcwd()
    try:
        os.chdir(cwd)
    except OSError:  # only absolute paths (checked)
        pass
    try:
        yield
    finally:
        os.chdir(old)


def _is_relative(path: str | None) -> bool:
    return bool(path) and not is_remote(path) and not os.path.isabs(path)


def _mtime_ns(path: Path) -> int | None:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return None
