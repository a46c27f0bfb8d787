"""Processes that must not hang: pools started from a process that holds DALI pipelines, a test that runs
past its time limit, a run that a scheduler stops while it is stuck."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from conftest import ROOT, train_cmd

# A loader's live DALI pipeline left in a reference cycle (garbage not collected yet), then a preparation
# whose pool starts; the fork hook runs the garbage collector in each forked child, as it may run there by
# chance: a forked child then finalizes the inherited pipeline, whose threads do not exist after the fork,
# and waits for ever in its destructor (and so does the preparation).
_POOL_AFTER_A_LOADER = """
import gc, json, os, sys
from mmfast import ImageLoader
from mmfast.prepare.demo import demo_dataset
from mmfast.prepare.core import PrepareConfig, prepare_dataset

root = sys.argv[1]
manifest = demo_dataset(n=200, seed=2, root=root + "/demo")
rows = [json.loads(line) for line in open(manifest)]
files = [os.path.join(os.path.dirname(manifest), r["image"]) for r in rows[:32]]
loader = ImageLoader(files, batch_size=16, size=16, num_workers=2, cache_decoded=False)
next(iter(loader))
cycle = [loader]
cycle.append(cycle)
del loader, cycle
gc.disable()
os.register_at_fork(after_in_child=lambda: (gc.enable(), gc.collect()))
prepare_dataset(PrepareConfig(source=str(manifest), out=root + "/prep", workers=2, progress=False))
print(json.load(open(root + "/prep/prepare.json"))["counts"]["accepted"])
"""


def test_a_preparation_after_a_loader_does_not_hang_in_its_pool(tmp_path):
    """The pool's workers come from a fork server, never from this process (forked, they hung for ever)."""
    run = subprocess.run(
        [sys.executable, "-c", _POOL_AFTER_A_LOADER, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["200"]


def test_a_script_without_a_main_guard_prepares_once(tmp_path):
    """The pool's workers import the function they run, not the caller's script: a script without an
    ``if __name__ == "__main__":`` guard is not run again in each of them (as spawn would)."""
    script = tmp_path / "prep.py"
    script.write_text(
        textwrap.dedent(
            f"""
            from mmfast.prepare.demo import demo_dataset
            from mmfast.prepare.core import PrepareConfig, prepare_dataset
            print("script ran")
            m = demo_dataset(n=200, seed=3, root={str(tmp_path / "demo")!r})
            cfg = PrepareConfig(source=str(m), out={str(tmp_path / "prep")!r}, workers=2, progress=False)
            prepare_dataset(cfg)
            """
        )
    )
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("script ran") == 1


def test_a_test_past_its_time_limit_fails_with_its_stack(tmp_path):
    """The suite's own bound (pyproject's pytest-timeout settings): a test that sleeps past its limit is
    ended and reported with the stack of the line it was stuck on, instead of holding CI for ever."""
    test = tmp_path / "test_sleeps.py"
    test.write_text(
        "import time\nimport pytest\n\n\n@pytest.mark.timeout(3)\ndef test_sleeps():\n    time.sleep(120)\n"
    )
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(ROOT), "-c",
         str(ROOT / "pyproject.toml"), str(test)],
        capture_output=True, text=True, timeout=100, cwd=tmp_path,
    )  # fmt: skip
    out = run.stdout + run.stderr
    assert run.returncode != 0
    assert "Timeout" in out and "test_sleeps.py" in out and "time.sleep(120)" in out, out[-3000:]


def test_the_suite_is_bounded_by_its_configuration():
    """Every test runs under a limit (no per-test opt-out beyond a larger one)."""
    text = Path(ROOT / "pyproject.toml").read_text()
    assert "\ntimeout = 300\n" in text and '\ntimeout_method = "thread"\n' in text
    assert "pytest-timeout" in text


# A run whose third training step never ends (as one stuck in a read or a collective would), which tells the
# test when it is stuck there.
_STUCK_TRAIN = """
import os, sys, time
sys.path.insert(0, {root!r})
from mmfast.tasks import classification
real = classification.compute_loss
calls = []

def stuck(*args, **kwargs):
    calls.append(1)
    if len(calls) == 3:
        open(os.environ["STUCK_FLAG"], "w").write("stuck")
        time.sleep(600)  # stuck_here
    return real(*args, **kwargs)

classification.compute_loss = stuck
from tools import train
sys.exit(train.main(sys.argv[1:]))
"""


def _stuck_run(prepared, tmp_path, *flags) -> subprocess.Popen:
    wrapper = tmp_path / "stuck_train.py"
    wrapper.write_text(_STUCK_TRAIN.format(root=str(ROOT)))
    flag = tmp_path / "stuck"
    cmd = train_cmd(prepared, tmp_path / "run", "--epochs", "1", *flags)
    cmd[1] = str(wrapper)
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "STUCK_FLAG": str(flag)}
    )
    deadline = time.monotonic() + 240
    while not flag.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert flag.exists(), proc.communicate(timeout=60)[1][-3000:]
    return proc


def test_a_stuck_run_ends_within_its_grace_after_sigterm_with_every_stack(prepared, tmp_path):
    """SIGTERM asks for a checkpoint at the next step; a run that never gets there exits after --stop-grace
    seconds, saying so, with where each thread was (the handler swallowed the signal: only SIGKILL ended it)."""
    proc = _stuck_run(prepared, tmp_path, "--stop-grace", "2")
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert time.monotonic() - sent < 30
    assert "no step ended within 2 s of the stop signal" in err and "stuck_train.py" in err, err[-3000:]


def test_a_second_stop_signal_ends_a_stuck_run_at_once(prepared, tmp_path):
    proc = _stuck_run(prepared, tmp_path)  # the default grace: 60 s
    proc.send_signal(signal.SIGINT)
    time.sleep(3)  # a second signal within 2 s is the same stop (a terminal's Ctrl-C, forwarded by a launcher)
    assert proc.poll() is None
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGINT and time.monotonic() - sent < 20, err[-3000:]
    assert "a second stop signal (SIGINT)" in err


# A Ctrl-C that lands while the interpreter runs its exit handlers (DALI's pipelines tear down there): this
# handler, registered before the run, runs last of all.
_CTRL_C_AT_EXIT = """
import atexit, os, signal, sys, time
sys.path.insert(0, {root!r})

def ctrl_c_during_exit():
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(1)
    print("still here")

atexit.register(ctrl_c_during_exit)
from tools import train
sys.exit(train.main(sys.argv[1:]))
"""


def test_a_ctrl_c_during_exit_ends_the_run_quietly(prepared, tmp_path):
    """A second Ctrl-C while a finished run exits printed the traceback of an exit handler; now the process
    ends at once with 130, and no traceback."""
    wrapper = tmp_path / "exiting_train.py"
    wrapper.write_text(_CTRL_C_AT_EXIT.format(root=str(ROOT)))
    cmd = train_cmd(prepared, tmp_path / "run", "--max-steps", "1")
    cmd[1] = str(wrapper)
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert (tmp_path / "run" / "summary.json").is_file()
    assert run.returncode == 130 and "still here" not in run.stdout, (run.returncode, run.stderr[-2000:])
    assert "Traceback" not in run.stderr and "KeyboardInterrupt" not in run.stderr, run.stderr[-2000:]
