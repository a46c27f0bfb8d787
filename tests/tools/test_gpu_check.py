"""tools/gpu_check.py's plumbing on the CPU: wheel parts installed offline, the source-tree copy importable,
steps time-boxed by the budget, outputs packed into the three files a device call brings back."""

from __future__ import annotations

import base64
import hashlib
import json
import subprocess
import sys
import tarfile
import zipfile

import pytest
from conftest import ROOT

SCRIPT = str(ROOT / "tools" / "gpu_check.py")


def _check(args, tmp_path, timeout=600):
    out = tmp_path / "out"
    res = subprocess.run(
        [sys.executable, SCRIPT, "--out", str(out), *args], capture_output=True, text=True, timeout=timeout
    )
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else None
    return res, out, summary


def _wheel(path, name="mmfast_probe", version="1.0"):
    """A minimal pure-Python wheel, written by hand (no network, no build tools)."""
    files = {f"{name}.py": b"VALUE = 42\n"}
    dist = f"{name}-{version}.dist-info"
    files[f"{dist}/METADATA"] = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode()
    files[f"{dist}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    record = [
        f"{p},sha256={base64.urlsafe_b64encode(hashlib.sha256(b).digest()).rstrip(b'=').decode()},{len(b)}"
        for p, b in files.items()
    ]
    files[f"{dist}/RECORD"] = ("\n".join(record + [f"{dist}/RECORD,,"]) + "\n").encode()
    whl = path / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        for p, b in files.items():
            z.writestr(p, b)
    return whl


def test_wheel_parts_install_offline_and_the_budget_skips_what_does_not_fit(tmp_path):
    staging = tmp_path / "staging"
    staging.mkdir()
    _wheel(staging)
    tar = tmp_path / "wheels.tar"
    with tarfile.open(tar, "w") as t:
        t.add(staging, arcname=".")
    blob = tar.read_bytes()
    parts = tmp_path / "parts"
    parts.mkdir()
    half = len(blob) // 2  # two parts, as split -b writes them: only their concatenation is a tar
    (parts / "part.aa").write_bytes(blob[:half])
    (parts / "part.ab").write_bytes(blob[half:])

    res, out, summary = _check(["--dry-run", "--wheel-parts", str(parts), "--only", "environment"], tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert (parts / "site" / "mmfast_probe.py").read_text() == "VALUE = 42\n"
    assert "installed 1 wheels" in (out / "log.txt").read_text()
    (env,) = summary["steps"]
    assert env["status"] == "ok"
    # the environment step imported mmfast from the source-tree copy
    assert "mmfast-gpucheck-" in "\n".join(env["tail"])
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.tar.gz", "log.txt", "summary.json"]

    # a step is not started once less than 15 s of the budget is left (10 s are kept for packing)
    res, out, summary = _check(["--dry-run", "--budget", "20", "--only", "quickstart"], tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert summary["steps"] == [{"name": "quickstart", "status": "skipped", "note": "budget spent"}]


def test_a_missing_part_is_named(tmp_path):
    parts = tmp_path / "parts"
    parts.mkdir()
    (parts / "part.aa").write_bytes(b"not a tar at all" * 64)
    res, _, _ = _check(["--dry-run", "--wheel-parts", str(parts), "--only", "environment"], tmp_path)
    assert res.returncode != 0
    assert "a part is missing or cut short" in res.stderr


@pytest.mark.slow
@pytest.mark.timeout(900)  # the dry run's own --budget: its steps are time-boxed inside it
def test_dry_run_runs_every_step_and_packs_their_outputs(tmp_path):
    res, out, summary = _check(["--dry-run", "--budget", "900"], tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    names = [s["name"] for s in summary["steps"]]
    assert names == [
        "environment",
        "nvml",
        "gpu-tests",
        "quickstart",
        "photos",
        "models",
        "loader",
        "train-bench",
        "models-256",
        "train-256",
        "profile",
        "profile-graphs",
    ]
    assert all(s["status"] == "ok" for s in summary["steps"]), summary["steps"]
    # the benchmarks' JSON is in the summary, and every file the steps wrote is in the tarball
    assert set(summary["bench_train"]["claims"]) >= {"a DataLoader+PIL fp32", "c mmfast fp32"}
    assert summary["profile"]["verdict"]
    assert summary["profile_graphs"]["settings"]["compile_mode"] == "reduce-overhead"
    assert summary["train_256"]["images_per_s"] > 0 and summary["train_256"]["hardware_choices"]
    assert summary["bench_models_256"]
    with tarfile.open(out / "gpu_check.tar.gz") as t:
        packed = set(t.getnames())
    for f in (
        "bench_models.json",
        "bench_models_256.json",
        "run-256/summary.json",
        "profile-graphs/profile.json",
        "bench_loader.json",
        "bench_train.png",
        "gpu_tests.xml",
        "profile/profile.json",
    ):
        assert f"gpu_check/{f}" in packed
    assert {f"gpu_check/logs/{n}.log" for n in names} <= packed
    assert not [n for n in packed if n.endswith((".safetensors", ".bin", ".pt"))]  # no weights carried back
    assert len(list(out.iterdir())) == 3
