"""Fault injection: bad files after preparation, kills, full disks, NaN losses, hostile manifests,
concurrent preparation. Each test asserts the exact outcome."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import re
import resource
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import SMALL_RUN as SMALL
from conftest import n_rows, train_cmd, write_jsonl

from mmfast.loading.multimodal import MultimodalLoader
from mmfast.prepare.core import PrepareConfig, prepare_dataset
from mmfast.prepare.demo import demo_dataset
from mmfast.tasks import classification
from tools import prepare_data
from tools import train as train_tool


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln]


@pytest.fixture
def own_dataset(tmp_path) -> Path:
    """A prepared demo set whose images this test may damage (160 samples, all train: 10 whole batches)."""
    manifest = demo_dataset(n=160, seed=4, root=tmp_path / "demo")
    out = tmp_path / "prepared"
    prepare_dataset(
        PrepareConfig(source=str(manifest), out=str(out), max_length=32, val_fraction=0.0, progress=False)
    )
    return out


def _damage(rows: list[dict]) -> dict[int, str]:
    """Truncate, delete, replace with text, and zero-fill (same size and mtime) four train images."""
    victims = {
        rows[2]["id"]: "truncated",
        rows[9]["id"]: "missing",
        rows[30]["id"]: "text",
        rows[77]["id"]: "zeroed",
    }
    by_id = {r["id"]: r["image"] for r in rows}
    for sid, how in victims.items():
        path = by_id[sid]
        data = Path(path).read_bytes()
        if how == "truncated":
            Path(path).write_bytes(data[: len(data) // 3])
        elif how == "missing":
            os.remove(path)
        elif how == "text":
            Path(path).write_text("this is not a jpeg\n")
        else:
            st = os.stat(path)
            Path(path).write_bytes(data[:100] + bytes(len(data) - 100))
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # invisible to a size/mtime check
    return victims


@pytest.mark.slow
def test_images_damaged_after_preparation_are_skipped_counted_and_never_mis_joined(own_dataset, tmp_path):
    rows = _jsonl(own_dataset / "train.jsonl")
    victims = _damage(rows)
    out = tmp_path / "run"
    assert (
        train_tool.main(["--data", str(own_dataset), "--out", str(out), "--epochs", "2", "--record-ids", *SMALL])
        == 0
    )
    metrics = _jsonl(out / "metrics.jsonl")
    assert [m["skipped_samples"] for m in metrics][-1] == 4
    seen = _jsonl(out / "seen_ids.rank0.jsonl")
    for epoch in (0, 1):
        ids = [i for r in seen if r["epoch"] == epoch for i in r["ids"]]
        assert len(ids) == 160 and not set(victims) & set(ids)  # masked (-1), never served under their id
        real = [i for i in ids if i >= 0]
        assert len(real) == len(set(real)) and ids.count(-1) == 160 - len(real) <= 4


def test_on_bad_image_error_stops_naming_the_file(own_dataset, tmp_path, capsys):
    rows = _jsonl(own_dataset / "train.jsonl")
    Path(rows[5]["image"]).write_bytes(b"GIF89a broken")
    rc = train_tool.main(
        [
            "--data",
            str(own_dataset),
            "--out",
            str(tmp_path / "r"),
            "--epochs",
            "1",
            "--on-bad-image",
            "error",
            *SMALL,
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and rows[5]["image"] in err and "re-run mmfast-prepare" in err


def test_a_file_deleted_after_preparation_is_found_when_read(own_dataset, monkeypatch):
    """No image is stat'ed at start-up unless asked (verify_files): a deleted one is found when DALI fails on
    it, skipped (masked, named in ``skipped``) or, with on_bad_image="error", named in the error."""
    rows = _jsonl(own_dataset / "train.jsonl")
    gone = rows[7]
    os.remove(gone["image"])
    images = {r["image"] for r in rows}
    stats = []
    real_stat = os.stat
    monkeypatch.setattr(os, "stat", lambda p, *a, **k: stats.append(str(p)) or real_stat(p, *a, **k))
    loader = MultimodalLoader(own_dataset, "train", batch_size=16, size=32, drop_last=False)
    monkeypatch.undo()
    assert not images & set(stats) and not loader.skipped  # nothing looked at the images yet
    ids = [i for batch in loader for i in batch["id"].tolist()]
    assert sorted(i for i in ids if i >= 0) == sorted(r["id"] for r in rows if r is not gone)
    assert ids.count(-1) == len(ids) - len(rows) + 1  # the deleted sample's place, masked (+ the last batch's pad)
    assert [(s["id"], s["image"]) for s in loader.skipped] == [(gone["id"], gone["image"])]

    checked = MultimodalLoader(own_dataset, "train", batch_size=16, size=32, verify_files=True)
    assert [s["id"] for s in checked.skipped] == [gone["id"]]  # found at start-up, before any batch

    strict = MultimodalLoader(own_dataset, "train", batch_size=16, size=32, on_bad_image="error", drop_last=False)
    with pytest.raises(ValueError, match=gone["image"]) as error:
        for _ in strict:
            pass
    assert "re-run mmfast-prepare" in str(error.value)  # the command that made the directory


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["foreach", "fused"])  # the step skipped on the host, or on the device
def test_nan_losses_are_skipped_and_counted(prepared, tmp_path, monkeypatch, impl):
    calls = {"n": 0}
    real = classification.compute_loss

    def flaky(logits, labels, reduction="mean"):
        loss = real(logits, labels, reduction)
        if torch.is_grad_enabled():
            calls["n"] += 1
            if calls["n"] in (3, 4):  # the 3rd and 4th training micro-batches
                return loss * float("nan")
        return loss

    monkeypatch.setattr(classification, "compute_loss", flaky)
    out = tmp_path / "run"
    argv = ["--data", str(prepared), "--out", str(out), "--epochs", "1", *SMALL, "--optimizer-impl", impl]
    assert train_tool.main(argv) == 0
    (m,) = _jsonl(out / "metrics.jsonl")
    assert m["skipped_steps"] == 2 and m["step"] == n_rows(prepared, "train") // 16  # an epoch, batch 16
    assert m["train_loss"] == m["train_loss"]  # not NaN: skipped steps are not averaged in
    from safetensors.torch import load_file

    weights = load_file(next((out / "checkpoints").iterdir()) / "model.safetensors")
    assert all(torch.isfinite(w.float()).all() for w in weights.values())


@pytest.mark.parametrize("impl", ["foreach", "fused"])  # the step skipped on the host, or on the device
def test_a_run_that_only_produces_nan_stops_with_a_clear_message(prepared, tmp_path, monkeypatch, capsys, impl):
    monkeypatch.setattr(
        classification,
        "compute_loss",
        lambda logits, labels, reduction="mean": logits.float().sum() * float("nan"),
    )
    rc = train_tool.main(
        ["--data", str(prepared), "--out", str(tmp_path / "r"), "--epochs", "1", "--max-nan-steps", "3", *SMALL]
        + ["--optimizer-impl", impl]
    )
    err = capsys.readouterr().err
    # the host check stops at the 3rd step; the device's count is read at the next log line or the epoch's end
    said = re.search(r"(\d+) consecutive optimizer steps had non-finite gradients", err)
    assert rc == 2 and said and (int(said[1]) == 3 if impl == "foreach" else int(said[1]) >= 3), err
    assert not (tmp_path / "r" / "checkpoints").exists()  # nothing trained, nothing saved


@pytest.mark.slow
def test_full_disk_during_a_checkpoint_keeps_the_previous_one(prepared, tmp_path):
    out = tmp_path / "run"
    base = train_cmd(prepared, out)
    first = subprocess.run([*base, "--epochs", "1"], capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    steps = n_rows(prepared, "train") // 16  # an epoch (batch 16)
    ckpt = out / "checkpoints" / f"step-{steps:08d}"
    before = {p.name: p.stat().st_size for p in ckpt.iterdir()}

    def small_files():  # 1 MiB per file: the model alone is ~37 MiB
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))

    full = subprocess.run(
        [*base, "--epochs", "2", "--resume", "latest", "--checkpoint-every", "2"],
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=small_files,
    )
    assert full.returncode == 2, full.stderr[-2000:]
    assert "writing checkpoint" in full.stderr and "previous checkpoint is intact" in full.stderr
    assert "Traceback" not in full.stderr
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [ckpt.name]  # no partial left
    assert {p.name: p.stat().st_size for p in ckpt.iterdir()} == before
    again = subprocess.run(
        [*base, "--epochs", "2", "--resume", "latest"], capture_output=True, text=True, timeout=300
    )
    assert again.returncode == 0, again.stderr[-2000:]
    assert json.loads((out / "summary.json").read_text())["global_step"] == 2 * steps


@pytest.mark.slow
def test_sigkill_at_random_points_then_resume_sees_each_sample_once(prepared, tmp_path):
    out = tmp_path / "run"
    log = out / "seen_ids.rank0.jsonl"
    base = train_cmd(
        prepared,
        out,
        "--epochs",
        "2",
        "--checkpoint-every",
        "1",
        "--keep-checkpoints",
        "2",
        "--record-ids",
        "--mixed-precision",
        "no",
    )
    rng = random.Random(7)
    # Random kill points between steps; a kill inside a checkpoint write is hit deterministically by
    # test_reliability_train.py::test_sigkill_inside_a_checkpoint_write_keeps_the_previous_one_and_resume_is_exact
    for attempt in range(3):
        args = base + (["--resume", "latest"] if attempt else [])
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 120
        done = len(log.read_text().splitlines()) if log.exists() else 0
        target = done + rng.randint(2, 6)
        while time.time() < deadline and (not log.exists() or len(log.read_text().splitlines()) < target):
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        ckpts = sorted((out / "checkpoints").glob("step-*"))
        assert ckpts, "a complete checkpoint exists"
        for c in ckpts:
            assert (c / "trainer_state.json").is_file() and (c / "model.safetensors").is_file()
        # what the killed run trained after its last complete checkpoint is lost: drop it from the log
        latest = json.loads((ckpts[-1] / "trainer_state.json").read_text())["global_step"]
        kept = [ln for ln in log.read_text().splitlines() if json.loads(ln)["step"] < latest]
        log.write_text("".join(ln + "\n" for ln in kept))
    final = subprocess.run(base + ["--resume", "latest"], capture_output=True, text=True, timeout=300)
    assert final.returncode == 0, final.stderr[-2000:]
    assert not list((out / "checkpoints").glob(".step-*.tmp"))  # a partial checkpoint is never kept or used
    rows = _jsonl(log)
    steps = n_rows(prepared, "train") // 16  # an epoch's steps (batch 16, the last partial batch dropped)
    for epoch in (0, 1):
        ids = [i for r in rows if r["epoch"] == epoch for i in r["ids"]]
        assert sorted(ids) == sorted(set(ids)) and len(ids) == steps * 16  # each sample exactly once
    assert [r["step"] for r in rows] == list(range(2 * steps))  # no step lost or repeated


def test_hostile_manifests_are_rejected_cleanly(tmp_path, capsys):
    from conftest import save_image

    save_image(tmp_path / "ok.jpg")
    loop = tmp_path / "loop.jpg"
    os.symlink(loop, loop)
    (tmp_path / "sub").mkdir()
    rows = [
        {"image": "ok.jpg", "text": "fine", "label": "a"},
        {"image": "ok.jpg", "text": "x" * (2 << 20), "label": "a"},  # a 2 MiB line
        {"image": 5, "text": "t", "label": "a"},
        {"image": "ok.jpg", "text": ["list"], "label": "a"},
        {"image": "ok.jpg", "text": "fine", "label": "a"},  # duplicate of line 1
        {"image": "/dev/zero", "text": "device", "label": "a"},
        {"image": "loop.jpg", "text": "loop", "label": "a"},
        {"image": "sub", "text": "dir", "label": "a"},
        {"image": "sub/../ok.jpg", "text": "dotdot is legal", "label": "a"},
        {"image": str(tmp_path / "ok.jpg"), "text": "absolute is legal", "label": "a"},
    ]
    m = write_jsonl(tmp_path / "m.jsonl", rows)
    assert prepare_data.main([str(m), "--out", str(tmp_path / "o"), "--no-progress", "--val-fraction", "0"]) == 0
    rejected = {r["line"]: r["reason"] for r in _jsonl(tmp_path / "o" / "rejected.jsonl")}
    assert set(rejected) == {2, 3, 4, 5, 6, 7, 8}
    assert "line too long" in rejected[2] and "must be a non-empty string path" in rejected[3]
    assert "must be a string" in rejected[4] and "duplicate of line 1" in rejected[5]
    assert "not a regular file" in rejected[6] and "symlink loop" in rejected[7] and "directory" in rejected[8]
    assert len(_jsonl(tmp_path / "o" / "train.jsonl")) == 3
    # nothing usable at all: a clear error naming the manifest, no traceback
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b"\xef\xbb\xbf\xff\xfe\x00garbage\r\n{not json}\r\n")
    capsys.readouterr()
    assert prepare_data.main([str(bad), "--out", str(tmp_path / "o2")]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "no usable rows out of 2" in err and "Traceback" not in err


def _prepare_in_process(args):
    manifest, out = args
    return prepare_dataset(PrepareConfig(source=manifest, out=out, max_length=32, progress=False))[
        "input_fingerprint"
    ]


@pytest.mark.slow
def test_two_processes_preparing_the_same_dataset_at_once(tmp_path):
    manifest = demo_dataset(n=300, seed=5, root=tmp_path / "demo")
    out = tmp_path / "prepared"
    with mp.get_context("spawn").Pool(2) as pool:
        fps = pool.map(_prepare_in_process, [(str(manifest), str(out))] * 2)
    assert fps[0] == fps[1]
    assert sorted(p.name for p in tmp_path.iterdir() if "prepared" in p.name) == [
        "prepared"
    ]  # no lock file beside it
    summary = json.loads((out / "prepare.json").read_text())
    assert summary["counts"]["accepted"] == 300
    from mmfast.data.token_cache import TokenCache

    assert len(TokenCache(out / "tokens", "train")) == summary["counts"]["train"]
    shutil.rmtree(out)
