"""Every stop ends the commands whole, in bounded time, with no process left behind. Each command runs in a
process group of its own; the test stops it as ``timeout`` or a scheduler would (SIGTERM to the group) or as a
terminal's Ctrl-C does (SIGINT to the group), once it is where it used to hang, then counts the group's
processes. The hangs: a rendezvous that never completes (torch's C++ connect retries through EINTR for 30
minutes), a rank whose launcher was killed, ``--ray HOST:PORT`` with no cluster there, a run waiting on a slow
store, and the test suite itself while a test runs a command in its process."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
from conftest import ROOT, SMALL_RUN, free_port, train_cmd
from PIL import Image
from test_stops import SlowStore

GRACE_S = 5  # the --stop-grace the commands get here
SLACK_S = 10  # what a stopped command may take beyond its grace (a loaded machine's exit)
START_S = 240  # the longest a command may take to get where it is stopped (imports on a loaded machine)


@pytest.fixture
def start(tmp_path):
    """``start(cmd, log, env=None, **popen)``: ``cmd`` in a new process group (its pid is the group's id), its
    stdout and stderr into ``log``. Whatever is left of the groups is killed when the test ends (a stopped
    session too: a group of its own does not get the session's signal)."""
    procs = []

    def start_(cmd: list[str], log: Path, env: dict | None = None, **kw) -> subprocess.Popen:
        with open(log, "w") as out:
            env = {**os.environ, **(env or {})}
            procs.append(
                subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True, **kw)
            )
        return procs[-1]

    yield start_
    for proc in procs:
        _kill_all(proc.pid, str(tmp_path))
        proc.wait(timeout=30)


def _left(pgid: int, marker: str) -> list[psutil.Process]:
    """The live processes of group ``pgid``, and any other whose command line holds ``marker`` (the test's
    folder: torchrun starts each rank in a session of its own). Zombies are ended, only not yet reaped."""
    found = []
    for p in psutil.process_iter(["status", "cmdline"]):
        try:
            if p.info["status"] == psutil.STATUS_ZOMBIE or p.pid == os.getpid():
                continue
            if os.getpgid(p.pid) == pgid or any(marker in arg for arg in p.info["cmdline"] or ()):
                found.append(p)
        except (ProcessLookupError, psutil.NoSuchProcess):
            pass
    return found


def _wait_for(log: Path, *texts: str, proc: subprocess.Popen, within: float = START_S) -> str:
    """The log once it holds every one of ``texts``; fails when the command ends or ``within`` s pass first."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        out = log.read_text()
        if all(t in out for t in texts):
            return out
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    pytest.fail(f"never printed {texts} (exit {proc.poll()}):\n{log.read_text()[-3000:]}")


def _ends_within(proc: subprocess.Popen, seconds: float, log: Path) -> float:
    """Seconds until no process of ``proc``'s group (nor any naming the test's folder) is left; fails, killing
    them, past ``seconds``."""
    sent, deadline = time.monotonic(), time.monotonic() + seconds
    while time.monotonic() < deadline:
        proc.poll()  # reaps the group's leader once it ends
        if not _left(proc.pid, str(log.parent)):
            proc.wait(timeout=5)
            return time.monotonic() - sent
        time.sleep(0.1)
    left = _left(proc.pid, str(log.parent))
    names = [" ".join((p.info["cmdline"] or [])[:3]) for p in left]
    _kill_all(proc.pid, str(log.parent))
    pytest.fail(f"{len(left)} process(es) left {seconds:.0f} s after the stop: {names}\n{log.read_text()[-3000:]}")


def _kill_all(pgid: int, marker: str) -> None:
    """SIGKILL to what ``_left`` finds."""
    for p in _left(pgid, marker):
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


# A launcher as torchrun is one to its ranks: it starts them (with its run id) and waits for them.
_LAUNCHER = """
import json, os, subprocess, sys
ranks = [subprocess.Popen(json.loads(sys.argv[1]), env={**os.environ, **e}) for e in json.loads(sys.argv[2])]
print("launched", flush=True)
sys.exit(max(r.wait() for r in ranks))
"""


def _launch_two(start, prepared: Path, tmp_path: Path, port: int, *flags: str) -> tuple[subprocess.Popen, Path]:
    """Two ranks of a run whose launcher hosts the store at 127.0.0.1:``port``, as torchrun's ranks see it."""
    env = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    env |= {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "stops"}
    ranks = [{**env, "RANK": str(r), "LOCAL_RANK": str(r)} for r in range(2)]
    cmd = train_cmd(prepared, tmp_path / "run", "--stop-grace", str(GRACE_S), *flags)
    log = tmp_path / "ranks.log"
    return start([sys.executable, "-c", _LAUNCHER, json.dumps(cmd), json.dumps(ranks)], log), log


@pytest.mark.slow
@pytest.mark.parametrize("stop", ["sigterm-to-the-group", "launcher-killed"])
def test_a_rendezvous_that_never_completes_ends_at_a_stop(start, prepared, tmp_path, stop):
    """Both ranks wait for a store nobody hosts. SIGTERM to the group ends them within the grace; so does the
    death of their launcher, which they notice (they waited, orphaned, for torch's 30 minutes)."""
    proc, log = _launch_two(start, prepared, tmp_path, free_port())
    waiting = [f"rank {r}: waiting for the other processes at 127.0.0.1:" for r in (0, 1)]
    _wait_for(log, *waiting, proc=proc)
    if stop == "sigterm-to-the-group":
        os.killpg(proc.pid, signal.SIGTERM)
    else:
        proc.kill()  # the launcher alone, as an out-of-memory killer or a scheduler's SIGKILL would
    _ends_within(proc, GRACE_S + SLACK_S, log)
    out = log.read_text()
    assert out.count("interrupted before training started") == 2, out[-3000:]
    if stop == "launcher-killed":
        assert out.count("the launcher (process ") == 2, out[-3000:]


@pytest.mark.slow
def test_a_rendezvous_gives_up_after_its_timeout_naming_what_to_check(start, prepared, tmp_path):
    port = free_port()
    proc, log = _launch_two(start, prepared, tmp_path, port, "--rendezvous-timeout", "8")
    _ends_within(proc, START_S, log)
    out = log.read_text()
    for r in (0, 1):
        said = f"error: rank {r}: the processes did not meet at 127.0.0.1:{port} within 8 s: nothing accepts"
        assert said in out, out[-3000:]
    assert "MASTER_ADDR and MASTER_PORT" in out and "--rendezvous-timeout sets the wait" in out, out[-3000:]
    assert proc.returncode == 2 and "Traceback" not in out, out[-3000:]


@pytest.mark.slow
def test_torchrun_with_master_port_0_is_refused_at_once(start, prepared, tmp_path):
    """torchrun --master_port 0 gives its ranks MASTER_PORT=0, where they waited for 30 minutes."""
    launcher = ("-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "0")
    log = tmp_path / "torchrun.log"
    proc = start(train_cmd(prepared, tmp_path / "run", launcher=launcher), log)
    _ends_within(proc, START_S, log)
    out = log.read_text()
    said = out.count("MASTER_PORT=0 is no port a process can connect to")
    # each rank refuses; the launcher stops the other rank as soon as the first has refused, and that one may
    # not have got as far: it then says it was stopped before training (CI saw it once in two runs)
    stopped = out.count("interrupted before training started")
    assert said >= 1 and said + stopped == 2, out[-3000:]
    assert proc.returncode != 0


@pytest.mark.slow
def test_a_ray_address_with_no_cluster_ends_at_sigterm(start, tmp_path):
    """mmfast-prepare --ray=HOST:PORT where nothing listens: SIGTERM ends it within the grace (Ray's connect
    retried, in native code, for ever)."""
    pytest.importorskip("ray")
    from mmfast.prepare.demo import demo_dataset

    manifest = demo_dataset(n=20, seed=1, root=tmp_path / "demo")
    address = f"127.0.0.1:{free_port()}"
    cmd = [sys.executable, str(ROOT / "tools" / "prepare_data.py"), str(manifest), "--out", str(tmp_path / "out")]
    cmd += [f"--ray={address}", "--stop-grace", str(GRACE_S), "--no-progress"]
    log = tmp_path / "prepare.log"
    proc = start(cmd, log)
    _wait_for(log, f"--ray {address}: waiting for the head node", proc=proc)
    os.killpg(proc.pid, signal.SIGTERM)
    _ends_within(proc, GRACE_S + SLACK_S, log)
    assert "interrupted" in log.read_text() and proc.returncode == 130, log.read_text()[-3000:]


def _big_shards(folder: Path, shards: int, per_shard: int) -> dict[str, bytes]:
    """WebDataset shards of noise JPEGs (large, so that a slow link takes long): {name: tar bytes}."""
    rng, blobs = np.random.default_rng(0), {}
    for s in range(shards):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for j in range(per_shard):
                image, noise = io.BytesIO(), rng.integers(0, 256, (256, 256, 3), dtype=np.uint8)
                Image.fromarray(noise).save(image, "JPEG", quality=95)
                members = {"jpg": image.getvalue(), "txt": f"noise {s} {j}".encode(), "cls": b"%d" % (j % 2)}
                for ext, data in members.items():
                    info = tarfile.TarInfo(f"{s:05d}{j:04d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        blobs[f"{s:05d}.tar"] = buf.getvalue()
    return blobs


@pytest.mark.slow
def test_a_run_waiting_on_a_slow_store_says_so_and_ends_within_its_grace(start, tmp_path, minilm_dir):
    """Streaming from a store that sends 16 KiB/s: the run says every REPORT_S which shard it waits for and how
    much has come, and SIGTERM ends every process within the grace (it printed nothing, and exited long after)."""
    from mmfast.prepare.core import PrepareConfig, prepare_dataset

    with SlowStore(_big_shards(tmp_path, shards=3, per_shard=6)) as store:
        data = tmp_path / "prepared"
        source = f"{store.base}/{{00000..00002}}.tar"
        cfg = PrepareConfig(source, str(data), tokenizer=minilm_dir, max_length=16, workers=1, progress=False)
        prepare_dataset(cfg)
        store.rate = 16 << 10
        flags = ("--shard-cache", str(tmp_path / "cache"), "--stop-grace", str(GRACE_S), "--batch-size", "4")
        log = tmp_path / "train.log"
        proc = start(train_cmd(data, tmp_path / "run", *flags), log)
        out = _wait_for(log, "waiting ", " for the shard http://127.0.0.1:", " fetched so far", proc=proc)
        os.killpg(proc.pid, signal.SIGTERM)
        _ends_within(proc, GRACE_S + SLACK_S, log)
    line = next(ln for ln in out.splitlines() if "for the shard" in ln)
    pattern = rf"waiting \d+ s for the shard {store.base}/(0000\d\.tar): ([\d.]+)KiB of ([\d.]+)KiB fetched so far"
    said = re.search(pattern, line)
    assert said, line
    assert 0 < float(said[2]) < float(said[3]) == round(len(store.server.blobs[said[1]]) / 1024, 1), line


# An inner test file: a quick test, then one that runs mmfast-train's main() in the pytest process.
_INNER = """
import os
from pathlib import Path
from mmfast.cli import train


def test_quick():
    pass


def test_trains_in_this_process(tmp_path):
    Path(os.environ["INNER_FLAG"]).write_text(str(tmp_path / "run"))
    argv = ["--data", os.environ["INNER_DATA"], "--out", str(tmp_path / "run"), "--epochs", "100"]
    assert train.main([*argv, *{small!r}]) == 0
"""


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_ends_the_test_session_with_its_summary(start, prepared, tmp_path, signum):
    """SIGTERM (as `timeout` sends) during start-up, or Ctrl-C (SIGINT to the group) inside the training loop,
    of a command run in pytest's process: the session stops with pytest's summary, the command's test is not
    failed, and nothing is left (SIGTERM was taken for "interrupted before training started", failing that
    test while the session went on; a later Ctrl-C was taken the same way)."""
    test = tmp_path / "test_inner.py"
    test.write_text(_INNER.format(small=SMALL_RUN))
    flag = tmp_path / "flag"
    cmd = [sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "--rootdir", str(ROOT)]
    cmd += ["-c", str(ROOT / "pyproject.toml"), str(test)]
    env = {"INNER_FLAG": str(flag), "INNER_DATA": str(prepared), "MMFAST_TEST_STOP_GRACE": str(GRACE_S * 4)}
    log = tmp_path / "pytest.log"
    proc = start(cmd, log, env, cwd=tmp_path)
    deadline = time.monotonic() + START_S
    while not flag.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert flag.exists(), log.read_text()[-3000:]
    if signum == signal.SIGINT:  # inside the loop: its config.json is written as it starts
        run = Path(flag.read_text())
        while not (run / "config.json").exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1)
    os.killpg(proc.pid, signum)
    _ends_within(proc, GRACE_S * 4 + SLACK_S, log)
    out = log.read_text()
    assert proc.returncode == pytest.ExitCode.INTERRUPTED, (proc.returncode, out[-3000:])
    assert "KeyboardInterrupt" in out and "1 passed" in out and "failed" not in out, out[-3000:]
