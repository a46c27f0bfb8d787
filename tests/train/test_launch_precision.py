"""The precision a run started by ``accelerate launch`` trains in, and what the launcher said: without a config
file the launcher warns that it set --mixed_precision 'no', and the run, which chooses its own, says right
after it what it trains in and why (mmfast/train/hardware.py: launcher_precision_note)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mmfast.train.hardware import launcher_precision_note
from tests.conftest import ROOT, SMALL_RUN

LAUNCHER_DEFAULT = "`--mixed_precision` was set to a value of `'no'`"  # accelerate launch's warning line


def test_the_note_names_the_precision_trained_in_where_the_launcher_named_another(monkeypatch):
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    assert launcher_precision_note("auto", "bf16") is None  # no launcher
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    note = launcher_precision_note("auto", "bf16")
    assert note.startswith("mixed precision: this run trains in bf16 (--mixed-precision auto")
    assert "'no' is its default" in note and "--mixed-precision no for float32" in note
    assert launcher_precision_note("auto", "no") is None  # they agree
    assert launcher_precision_note("no", "no") is None
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    assert launcher_precision_note("no", "no") == (
        "mixed precision: this run trains in no (--mixed-precision no), not in accelerate launch's bf16"
    )
    assert launcher_precision_note("auto", "bf16") is None


@pytest.mark.slow
def test_a_launch_without_a_config_prints_no_precision_it_does_not_train_in(prepared, tmp_path):
    """``accelerate launch tools/train.py`` with no accelerate config file: every line that
    names a precision agrees with the one summary.json records, or is the launcher's default followed by the
    run's note that it is not the one used."""
    launcher = Path(sys.executable).parent / "accelerate"
    if not launcher.is_file():
        pytest.skip(f"no accelerate command beside {sys.executable}")
    out = tmp_path / "run"
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "PYTHONPATH": str(ROOT)}  # no accelerate config
    env.pop("ACCELERATE_MIXED_PRECISION", None)
    cmd = [str(launcher), "launch", str(ROOT / "tools" / "train.py"), "--data", str(prepared), "--out", str(out)]
    proc = subprocess.run(
        [*cmd, *SMALL_RUN, "--max-steps", "1"], capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    used = json.loads((out / "summary.json").read_text())["mixed_precision"]
    assert re.search(rf"^device +\S+ x 1, {used}$", proc.stdout, re.M), proc.stdout
    lines = proc.stderr.splitlines()
    named = [ln for ln in lines if re.search(r"mixed.precision", ln)]
    note = f"mixed precision: this run trains in {used} (--mixed-precision auto on this machine)"
    if used == "no":  # the launcher's default is what the run trains in: nothing to explain
        assert all("this run trains in" not in ln for ln in named), named
        return
    assert LAUNCHER_DEFAULT in proc.stderr  # the launcher's own warning, which the run cannot unsay
    (default_line,) = [i for i, ln in enumerate(lines) if LAUNCHER_DEFAULT in ln]
    (note_line,) = [i for i, ln in enumerate(lines) if ln.startswith(note)]
    assert note_line > default_line and "'no' is its default" in lines[note_line]
    assert set(named) == {lines[default_line], lines[note_line]}, named
