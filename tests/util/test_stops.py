"""Stops that end in bounded time, at the level of the parts (``mmfast.util.stop_watch``, the stop flag, the shard
cache, the Ray address): a stop inside native code, the grace measured to the process's exit, a cache whose close
stops its downloads, a reader told what it waits for, a Ray address where nothing answers. Each fails on an
implementation that waits for ever or says nothing. ``test_stops_process`` runs the commands whole."""

from __future__ import annotations

import hashlib
import logging
import os
import re
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from conftest import ROOT, free_port, save_image, write_jsonl

from mmfast.cli import prepare as prepare_cli
from mmfast.remote import shard_cache
from mmfast.remote.shard_cache import ShardCache

_PIECE = 4096


class _SlowHandler(BaseHTTPRequestHandler):
    """Answers GET /NAME with ``server.blobs[NAME]``, at ``server.rate`` bytes a second (None: at once)."""

    def do_GET(self):
        body = self.server.blobs.get(self.path.lstrip("/").split("?")[0])
        if body is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            for i in range(0, len(body), _PIECE):
                self.wfile.write(body[i : i + _PIECE])
                self.wfile.flush()
                if self.server.rate:
                    time.sleep(_PIECE / self.server.rate)
        except OSError:  # the client went away (a stopped download)
            pass

    def log_message(self, format, *args):  # noqa: A002
        pass


class SlowStore:
    """A loopback HTTP server of ``blobs`` ({name: bytes}) whose ``rate`` (bytes/s, None: unlimited) a test sets;
    a context manager. ``url(name)`` is the object's URL."""

    def __init__(self, blobs: dict[str, bytes]):
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _SlowHandler)
        self.server.daemon_threads = True
        self.server.blobs, self.server.rate = blobs, None
        self.base = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)

    @property
    def rate(self) -> float | None:
        return self.server.rate

    @rate.setter
    def rate(self, value: float | None) -> None:
        self.server.rate = value

    def url(self, name: str) -> str:
        return f"{self.base}/{name}"

    def __enter__(self) -> SlowStore:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(5)


def _blob(n: int) -> bytes:
    return os.urandom(n)


@pytest.fixture
def store():
    with SlowStore({"slow.tar": _blob(640 << 10), "quick.tar": _blob(192 << 10)}) as s:
        yield s


def _item(store: SlowStore, name: str) -> tuple[str, int, str]:
    data = store.server.blobs[name]
    return store.url(name), len(data), hashlib.sha256(data).hexdigest()


def test_closing_the_cache_stops_its_downloads_in_flight(store, tmp_path):
    """A prefetch of a slow shard is stopped by close(), which returns at once and leaves no partial file (a
    close that waited for the download held the process's exit for as long as the store took)."""
    store.rate = 16 << 10  # the shard would take 40 s
    cache = ShardCache(tmp_path / "cache", 10**9)
    url, size, sha = _item(store, "slow.tar")
    cache.prefetch([(url, size, sha)])
    deadline = time.monotonic() + 30
    while not list((tmp_path / "cache" / "shards").glob(".*partial*")) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # under way
    started = time.monotonic()
    cache.close()
    assert time.monotonic() - started < 10
    assert os.listdir(tmp_path / "cache" / "shards") == []  # neither a partial file nor the shard
    assert cache.stats()["fetches"] == 0


def test_a_reader_waiting_for_a_slow_shard_is_told_what_it_waits_for(store, tmp_path, monkeypatch, caplog):
    """A reader that waits for a shard past REPORT_S gets a line naming the shard (redacted) and the bytes so
    far, again every REPORT_S; the shard still arrives whole."""
    monkeypatch.setattr(shard_cache, "REPORT_S", 1.0, raising=False)
    store.rate = 48 << 10  # 4 s for the shard
    url, size, sha = _item(store, "quick.tar")
    secret_url = url.replace("http://", "http://reader:hunter2@")  # sent as basic auth, never shown
    with caplog.at_level(logging.WARNING, logger=shard_cache.__name__), ShardCache(tmp_path / "c", 10**9) as c:
        path = c.get(secret_url, size, sha)
        assert hashlib.sha256(path.read_bytes()).hexdigest() == sha
    lines = [r.getMessage() for r in caplog.records if "waiting" in r.getMessage()]
    assert len(lines) >= 2, lines
    pattern = r"waiting \d+ s for the shard http://\S*127\.0\.0\.1:\d+/quick\.tar: [\d.]+K?i?B of 192\.0KiB "
    assert all(re.match(pattern, line) for line in lines), lines
    assert not any("hunter2" in line for line in lines)
    got = [float(m[1]) for line in lines if (m := re.search(r"([\d.]+)KiB of", line))]
    assert got == sorted(got) and got[-1] > 0, lines  # the bytes so far grow


# A loop that took the stop at a step (its checkpoint written), then leaves a non-daemon thread running (as a
# shard download would): the interpreter waits for that thread at exit.
_LINGERING = """
import os, signal, sys, threading, time
sys.path.insert(0, {root!r})
from mmfast.train.stop import StopFlag

with StopFlag(3) as stop:
    os.kill(os.getpid(), signal.SIGTERM)
    while stop.signum is None:
        time.sleep(0.01)
print("stop taken at a step", flush=True)
threading.Thread(target=time.sleep, args=(120,)).start()
"""


def test_the_stop_grace_bounds_the_process_exit_not_only_the_loop(tmp_path):
    """--stop-grace counts from the signal to the process's end: a thread that outlives the loop does not keep
    the process past it (the timer stopped with the loop, and the process waited for the thread)."""
    started = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-c", _LINGERING.format(root=str(ROOT))], capture_output=True, text=True, timeout=60
    )
    assert "stop taken at a step" in run.stdout, run.stderr[-2000:]
    assert run.returncode != 0 and time.monotonic() - started < 3 + 15, (run.returncode, run.stderr[-2000:])


# A main thread stuck in torch's TCPStore connect to a port nobody listens on: the C++ loop retries through
# EINTR for its whole timeout, so no Python handler runs until it gives up.
_STUCK_IN_CONNECT = """
import datetime, sys
sys.path.insert(0, {root!r})
from mmfast.util.stop_watch import StopWatch
from torch.distributed import TCPStore

with StopWatch("connect", 3) as watch:
    watch.overdue, watch.outcome = "the connect did not end", "exiting"
    print("connecting", flush=True)
    TCPStore("127.0.0.1", {port}, 2, False, timeout=datetime.timedelta(seconds=300))
"""


def test_a_stop_ends_a_main_thread_stuck_in_native_code_within_the_grace():
    proc = subprocess.Popen(
        [sys.executable, "-c", _STUCK_IN_CONNECT.format(root=str(ROOT), port=free_port())],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout.readline() == "connecting\n"
        time.sleep(2)  # inside the connect loop
        sent = time.monotonic()
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + 15 and time.monotonic() - sent < 3 + 10, (proc.returncode, err[-2000:])
    assert "connect: the connect did not end within 3 s of the stop signal: exiting" in err, err[-2000:]
    assert 'File "<string>", line 10 in <module>' in err, err[-2000:]  # where the main thread was: the connect


# A stop taken while the main thread runs code from a string, as an import does when a dataclass is made: the
# program catches it and exits with a status of its own.
_CAUGHT_IN_EXEC = """
import os, signal, sys
sys.path.insert(0, {root!r})
from mmfast.util.stop_watch import StopWatch

with StopWatch("cmd", 30):
    try:
        exec("os.kill(os.getpid(), signal.SIGTERM)\\nfor _ in range(10**8): pass")
    except KeyboardInterrupt:
        print("stopped", flush=True)
sys.exit(3)
"""


def test_a_stop_the_program_caught_ends_with_the_programs_exit_status(tmp_path):
    """A stopped test session (``python -m pytest``) ended "killed by SIGINT", not with pytest's status 2:
    CPython notes an interrupt that leaves exec'd code even when it is caught, and kills a ``-m`` module's
    process with SIGINT at exit."""
    (tmp_path / "caught_in_exec.py").write_text(_CAUGHT_IN_EXEC.format(root=str(ROOT)))
    run = subprocess.run(
        [sys.executable, "-m", "caught_in_exec"], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert run.stdout == "stopped\n" and run.returncode == 3, (run.returncode, run.stderr[-2000:])


@pytest.fixture
def tiny_manifest(tmp_path):
    images = [save_image(tmp_path / f"{k}.png", seed=k).name for k in (0, 1)]
    rows = [{"image": name, "text": f"a photo {k}", "label": k} for k, name in enumerate(images)]
    return write_jsonl(tmp_path / "m.jsonl", rows)


@pytest.mark.timeout(120)
def test_a_ray_address_where_nothing_answers_is_refused_within_ray_timeout(tiny_manifest, tmp_path, capsys):
    """Ray's own connect to HOST:PORT where no cluster answers retried for ever; the command gives up after
    --ray-timeout with one line naming the address and what to check."""
    pytest.importorskip("ray")
    address = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    argv = [str(tiny_manifest), "--out", str(tmp_path / "out"), f"--ray={address}", "--ray-timeout", "3"]
    assert prepare_cli.main([*argv, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"--ray {address}: no Ray cluster answers there within 3 s" in err and "--ray-timeout" in err, err
    assert "ray start --head" in err and "Traceback" not in err
    assert time.monotonic() - started < 60


@pytest.mark.timeout(120)
def test_a_ray_host_that_does_not_resolve_is_refused_at_once(tiny_manifest, tmp_path, capsys):
    pytest.importorskip("ray")
    argv = [str(tiny_manifest), "--out", str(tmp_path / "out"), "--ray=no-such-head.invalid:6379"]
    assert prepare_cli.main([*argv, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--ray no-such-head.invalid:6379: no-such-head.invalid resolves to no address" in err, err


@pytest.mark.parametrize("seconds", [600.0, 120.0, 1800.0])
def test_every_dist_timeout_reaches_the_process_group_accelerate_creates(seconds):
    """Accelerate passes on only options that differ from its defaults (600 s, NCCL's): --dist-timeout 600, the
    default, must still reach the process group, or gloo waits torch's 30 minutes for a stalled rank."""
    from mmfast.train.setup import dist_timeout_handler

    passed = dist_timeout_handler(seconds).to_kwargs()
    assert "timeout" in passed
    assert abs(passed["timeout"].total_seconds() - seconds) < 1e-3
