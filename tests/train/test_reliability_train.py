"""Fault injection on the training side: run directories the user owns, resumes that cannot continue the
same run, damaged checkpoints, prepared data changed after preparation, bad numbers, and multi-process
runs whose ranks die, stop or get signals. Real processes wherever a process boundary matters."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT, SMALL_RUN, free_port, n_rows, save_image, train_cmd, write_jsonl

from mmfast.inputs import ManifestError, read_source
from mmfast.prepare.core import PrepareConfig, prepare_dataset
from mmfast.tasks import classification
from mmfast.train import engine
from mmfast.train.rundir import LOCK_FILE, RUN_MARKER, RunDirLock
from mmfast.util.commands import PREPARE
from mmfast.util.fsutil import claim_output_dir
from tools import train as train_tool


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln]


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _run(data: Path, out: Path, *flags: str) -> int:
    return train_tool.main(["--data", str(data), "--out", str(out), *SMALL_RUN, *flags])


@pytest.fixture
def own_prepared(tmp_path, prepared) -> Path:
    """A copy of the shared prepared set that a test may edit."""
    out = tmp_path / "prepared_copy"
    shutil.copytree(prepared, out)
    return out


# --- 1. what the user owns -------------------------------------------------------------------------------


def test_out_holding_user_files_is_refused_and_left_untouched(prepared, tmp_path, capsys):
    out = tmp_path / "mine"
    (out / "notes").mkdir(parents=True)
    (out / "notes" / "thesis.txt").write_text("do not lose me")
    (out / "config.json").write_text('{"my": "own config"}')
    before = _tree(out)
    for extra in ([], ["--overwrite"], ["--resume", "latest"]):
        assert _run(prepared, out, "--max-steps", "1", *extra) == 2
        err = capsys.readouterr().err
        assert "holds files that mmfast did not write" in err and str(out) in err
        assert _tree(out) == before


def test_out_inside_a_prepared_dataset_is_refused(own_prepared, capsys):
    before = _tree(own_prepared)
    assert (own_prepared / ".mmfast-prepared").is_file()
    assert _run(own_prepared, own_prepared / "runs" / "a", "--max-steps", "1") == 2
    assert "inside the prepared dataset" in capsys.readouterr().err
    assert _tree(own_prepared) == before


def test_an_earlier_run_needs_resume_or_overwrite_and_overwrite_moves_it_aside(prepared, tmp_path, capsys):
    out = tmp_path / "run"
    assert _run(prepared, out, "--max-steps", "2", "--model", "concat") == 0
    first = _tree(out)
    assert _run(tmp_path / "typo", out, "--max-steps", "2") == 2  # the --data mistake is said first
    assert "--data" in capsys.readouterr().err and _tree(out) == first
    assert _run(prepared, out, "--max-steps", "2", "--model", "late") == 2
    assert "holds an earlier run" in capsys.readouterr().err
    assert _tree(out) == first
    assert _run(prepared, out, "--max-steps", "2", "--model", "late", "--overwrite") == 0
    (aside,) = [p for p in tmp_path.iterdir() if p.name.startswith("run.old-")]
    assert _tree(aside) == first  # the earlier run, whole, byte for byte
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model"] == "late" and len(cfg["segments"]) == 1
    assert [m["step"] for m in _jsonl(out / "metrics.jsonl")] == [2]  # no rows of the earlier run
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000002"]


def test_a_run_whose_first_batch_failed_leaves_an_out_the_next_run_may_use(prepared, tmp_path, capsys):
    """A run that stopped at its first batch (every image gone) had written config.json and its tokenizer's
    copy and nothing else: the corrected command was refused ("holds an earlier run") though there was nothing
    to resume or keep. Now it starts there; a run that checkpointed still needs --resume or --overwrite."""
    from mmfast.train.rundir import plan_run_dir

    out = tmp_path / "run"
    assert _run(prepared, out, "--max-steps", "1") == 0
    for name in ("checkpoints", "model", "model-last", "metrics.jsonl", "summary.json"):
        path = out / name
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    left = sorted(p.name for p in out.iterdir())
    assert {"config.json", "tokenizer"} <= set(left), left
    assert plan_run_dir(out, resume=False, overwrite=False, default_out=False).action == "new", left
    assert _run(prepared, out, "--max-steps", "1") == 0  # no --overwrite asked for
    assert json.loads((out / "summary.json").read_text())["global_step"] == 1
    assert _run(prepared, out, "--max-steps", "1") == 2  # this one trained: kept
    assert "holds an earlier run" in capsys.readouterr().err


def test_default_out_moves_the_previous_run_aside(prepared, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    flags = ["--data", str(prepared), *SMALL_RUN, "--max-steps", "1"]
    assert train_tool.main(flags) == 0
    first = _tree(tmp_path / "runs" / "latest")
    # A run that fails before it begins (a typo in --data; a raw --data with no usable row, whose rejects the
    # start wrote into the new run directory) puts the earlier run back where it was.
    unusable = write_jsonl(tmp_path / "none.jsonl", [{"image": "gone.jpg", "text": "t", "label": "x"}])
    for data in (tmp_path / "typo", unusable):
        assert train_tool.main(["--data", str(data), *flags[2:]]) == 2
        # a --data naming nothing is refused before --out is touched; the unusable one was being prepared
        assert ("the earlier run is back in runs/latest" in capsys.readouterr().out) == (data == unusable)
        assert _tree(tmp_path / "runs" / "latest") == first
        assert set(os.listdir(tmp_path / "runs")) <= {"latest", "latest.rejected.jsonl"}  # the reasons, beside it
    assert train_tool.main(flags) == 0
    (aside,) = [p for p in (tmp_path / "runs").iterdir() if p.name.startswith("latest.old-")]
    assert _tree(aside) == first


def test_a_second_run_on_the_same_out_exits_naming_the_first(prepared, tmp_path, capsys):
    out = tmp_path / "run"
    assert _run(prepared, out, "--max-steps", "1") == 0
    assert (out / RUN_MARKER).is_file()
    holder = RunDirLock(out)  # what a live run holds (flock: a second open file conflicts, also in-process)
    holder.acquire()
    try:
        before = _tree(out)
        assert _run(prepared, out, "--max-steps", "2", "--resume", "latest") == 2
        assert f"in use by another mmfast run (pid {os.getpid()})" in capsys.readouterr().err
        assert _run(prepared, out, "--max-steps", "2", "--overwrite") == 2  # never moved from under a live run
        assert _tree(out) == before
    finally:
        holder.release()
    assert (out / LOCK_FILE).is_file()


def test_a_run_that_fails_before_it_starts_leaves_nothing_and_the_fixed_command_runs(prepared, tmp_path, capsys):
    out, mine = tmp_path / "run", tmp_path / "mine"
    assert _run(tmp_path / "no-such-data", out, "--max-steps", "1") == 2
    assert "no such prepared directory" in capsys.readouterr().err
    assert not out.exists()  # the directory it made, gone
    save_image(tmp_path / "a.jpg")
    (tmp_path / "m.csv").write_text("picture,caption,cls\na.jpg,hello,x\n")  # columns mmfast-prepare would map
    assert _run(tmp_path / "m.csv", out, "--max-steps", "1") == 2
    err = capsys.readouterr().err
    assert "--label-column" in err and f"mmfast-prepare {tmp_path / 'm.csv'} --out DIR" in err and not out.exists()
    # A raw --data prepared into the run directory, then refused (one class) or with no usable row at all:
    # the preparation goes with the directory the run made.
    one_class = write_jsonl(
        tmp_path / "one.jsonl", [{"image": "a.jpg", "text": f"t {i}", "label": "x"} for i in range(3)]
    )
    unusable = write_jsonl(tmp_path / "none.jsonl", [{"image": "gone.jpg", "text": "t", "label": "x"}])
    for raw in (one_class, unusable):
        assert _run(raw, out, "--max-steps", "1") == 2
        assert not out.exists(), (raw, sorted(os.listdir(out)))
        if raw == one_class:
            assert "has one class ('x'); a classifier needs two or more" in capsys.readouterr().err
    capsys.readouterr()
    mine.mkdir()  # the user's own empty directory: kept, empty
    assert _run(tmp_path / "no-such-data", mine, "--max-steps", "1") == 2
    assert mine.is_dir() and not any(mine.iterdir())
    out.mkdir()  # what a start killed before it could clean up leaves: the marker and the lock file
    (out / LOCK_FILE).write_text("12345\n")
    (out / RUN_MARKER).write_text('{"kind": "mmfast run"}\n')
    assert _run(prepared, out, "--max-steps", "1") == 0  # no --overwrite needed: that start wrote nothing
    assert (out / "config.json").is_file() and not [p for p in tmp_path.iterdir() if ".old-" in p.name]


# --- 2. resume is exact or refused -----------------------------------------------------------------------


def test_resume_with_other_must_match_settings_is_refused_listing_them(prepared, tmp_path, capsys, demo_manifest):
    out = tmp_path / "run"
    assert _run(prepared, out, "--max-steps", "2") == 0
    before = _tree(out)
    for flags, expect in (
        (["--grad-accum", "2"], "grad_accum: 1 -> 2"),
        (["--lr", "0.01"], "lr: 0.002 -> 0.01"),
        (["--model", "late"], "model: 'concat' -> 'late'"),
        (["--batch-size", "8"], "batch_size: 16 -> 8"),
    ):
        assert _run(prepared, out, "--max-steps", "4", "--resume", "latest", *flags) == 2
        err = capsys.readouterr().err
        assert "cannot resume from" in err and expect in err and "Traceback" not in err
    other = tmp_path / "other"  # the same images split differently: another data fingerprint
    prepare_dataset(
        PrepareConfig(source=str(demo_manifest), out=str(other), max_length=32, seed=1, progress=False)
    )
    assert train_tool.main(["--data", str(other), "--out", str(out), *SMALL_RUN, "--resume", "latest"]) == 2
    said = capsys.readouterr().err
    assert f"data: {str(prepared)!r} -> {str(other)!r}: other prepared data than the run trained on" in said
    assert _tree(out) == before  # a refused resume changes nothing


@pytest.mark.slow
def test_max_steps_then_a_larger_max_steps_continues_the_same_epoch(prepared, tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    flags = ["--epochs", "1", "--record-ids"]
    assert _run(prepared, full, *flags, "--max-steps", "6") == 0
    assert _run(prepared, part, *flags, "--max-steps", "3") == 0
    (m,) = _jsonl(part / "metrics.jsonl")
    assert m["step"] == 3 and m["epoch_complete"] is False
    assert _run(prepared, part, *flags, "--max-steps", "6", "--resume", "latest", "--epochs", "2") == 0
    ids = [r["ids"] for r in _jsonl(part / "seen_ids.rank0.jsonl")]
    assert ids == [r["ids"] for r in _jsonl(full / "seen_ids.rank0.jsonl")]  # the same 6 batches, in order
    assert json.loads((part / "summary.json").read_text())["global_step"] == 6
    cfg = json.loads((part / "config.json").read_text())
    assert [s["max_steps"] for s in cfg["segments"]] == [3, 6] and cfg["epochs"] == 2  # may-change, recorded


# --- 3. checkpoints are verified -------------------------------------------------------------------------


@pytest.mark.slow
def test_a_damaged_latest_checkpoint_falls_back_to_the_newest_intact_one(prepared, tmp_path, capsys, caplog):
    out = tmp_path / "run"
    assert _run(prepared, out, "--epochs", "1", "--checkpoint-every", "5", "--keep-checkpoints", "3") == 0
    ckpts = sorted((out / "checkpoints").iterdir())
    steps = n_rows(prepared, "train") // 16  # an epoch (14 or 15)
    assert [p.name for p in ckpts] == [f"step-{s:08d}" for s in (5, 10, steps)]
    weights = ckpts[-1] / "model.safetensors"
    with open(weights, "r+b") as f:  # 4 KiB of garbage in the middle of the latest weights
        f.seek(weights.stat().st_size // 2)
        f.write(os.urandom(4096))
    assert _run(prepared, out, "--epochs", "2", "--resume", "latest") == 0
    err = capsys.readouterr().err + caplog.text  # the warning goes through logging
    assert f"step-{steps:08d} is damaged (model.safetensors differs" in err
    state = json.loads((sorted((out / "checkpoints").iterdir())[-1] / "trainer_state.json").read_text())
    assert state["global_step"] == 2 * steps  # from the intact step-10 checkpoint to the end of epoch 2
    for p in (out / "checkpoints").iterdir():
        (p / "trainer_state.json").write_text("{cut off")
    assert _run(prepared, out, "--epochs", "3", "--resume", "latest") == 2
    assert "every checkpoint in" in capsys.readouterr().err


def test_non_finite_weights_are_never_saved(prepared, tmp_path, monkeypatch, capsys):
    real = engine.EpochRunner.optimizer_step

    def poison(self):
        real(self)
        with torch.no_grad():
            next(self.model.parameters()).fill_(float("nan"))

    monkeypatch.setattr(engine.EpochRunner, "optimizer_step", poison)
    assert _run(prepared, tmp_path / "run", "--max-steps", "2") == 2
    assert "hold NaN/inf" in capsys.readouterr().err
    assert not list((tmp_path / "run" / "checkpoints").glob("step-*"))


# --- 4. the prepared directory is verified ---------------------------------------------------------------


@pytest.mark.parametrize(
    "fault", ["truncate-train", "edit-labels", "edit-caption", "swap-tokens", "cut-last-line"]
)
def test_prepared_files_changed_after_preparation_stop_the_run_naming_them(
    own_prepared, tmp_path, capsys, fault, demo_manifest
):
    d = own_prepared
    if fault == "truncate-train":
        lines = (d / "train.jsonl").read_text().splitlines(keepends=True)
        (d / "train.jsonl").write_text("".join(lines[:-10]))
        name = "train.jsonl"
    elif fault == "edit-labels":
        labels = json.loads((d / "labels.json").read_text())
        a, b = list(labels)[:2]
        labels[a], labels[b] = labels[b], labels[a]  # two classes swapped: same size, same keys
        (d / "labels.json").write_text(json.dumps(labels, indent=2, ensure_ascii=False) + "\n")
        name = "labels.json"
    elif fault == "edit-caption":
        text = (d / "train.jsonl").read_text()
        row = json.loads(text.splitlines()[3])
        (d / "train.jsonl").write_text(text.replace(json.dumps(row["text"]), json.dumps(row["text"][::-1]), 1))
        name = "train.jsonl"
    elif fault == "swap-tokens":  # another preparation's cache with the same counts
        other = tmp_path / "other"
        prepare_dataset(PrepareConfig(source=str(demo_manifest), out=str(other), max_length=16, progress=False))
        shutil.rmtree(d / "tokens")
        shutil.copytree(other / "tokens", d / "tokens")
        name = "tokens"
    else:
        data = (d / "val.jsonl").read_bytes()
        (d / "val.jsonl").write_bytes(data[: len(data) - 20])
        name = "val.jsonl"
    assert _run(d, tmp_path / "run", "--max-steps", "1") == 2
    err = capsys.readouterr().err
    assert name in err and "since preparation" in err and f"re-run {PREPARE}" in err and "Traceback" not in err


def test_a_directory_without_prepare_json_is_not_read_as_an_image_folder(own_prepared, tmp_path, capsys):
    (own_prepared / "prepare.json").unlink()
    assert _run(own_prepared, tmp_path / "run", "--max-steps", "1") == 2
    assert "incomplete prepared dataset (no prepare.json)" in capsys.readouterr().err


# --- 5. numbers -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flags",
    [
        ["--lr", "inf"],
        ["--lr", "nan"],
        ["--weight-decay", "-1"],
        ["--grad-clip", "nan"],
        ["--dropout", "1.5"],
        ["--warmup-frac", "nan"],
        ["--dist-timeout", "0"],
        ["--image-size", "0"],
    ],
)
def test_non_finite_or_out_of_range_numbers_are_refused(flags, tmp_path, capsys, prepared):
    assert _run(prepared, tmp_path / "run", *flags) == 2
    assert flags[0] in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_an_epoch_of_only_non_finite_losses_reports_nan_not_zero(prepared, tmp_path, monkeypatch):
    monkeypatch.setattr(
        classification,
        "compute_loss",
        lambda logits, labels, reduction="mean": logits.float().sum() * float("nan"),
    )
    out = tmp_path / "run"
    assert _run(prepared, out, "--max-steps", "3", "--max-nan-steps", "100") == 0
    (m,) = _jsonl(out / "metrics.jsonl")
    assert m["train_loss"] != m["train_loss"] and m["skipped_steps"] == 3  # NaN


# --- 7. signals and multi-process runs ------------------------------------------------------------------


def test_ctrl_c_during_start_up_exits_130_with_one_line(prepared, tmp_path):
    proc = subprocess.Popen(
        train_cmd(prepared, tmp_path / "run"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT
    )
    time.sleep(1.0)  # importing torch alone takes longer than this
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err and "interrupted before training started" in err


PAUSING_TRAIN = """
import os, sys, time
sys.path.insert(0, {root!r})
from mmfast.train import checkpoint
real = checkpoint.atomic_write_json
calls = []

def pausing(path, obj):
    # Stop inside the Nth checkpoint write, after the weights and before the checksums: the test kills us here.
    if path.name == checkpoint.CHECKSUMS_FILE:
        calls.append(path)
        if len(calls) == int(os.environ["PAUSE_AT"]):
            open(os.environ["PAUSED_FLAG"], "w").write(str(path.parent))
            time.sleep(600)
    real(path, obj)

checkpoint.atomic_write_json = pausing
from tools import train
sys.exit(train.main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_sigkill_inside_a_checkpoint_write_keeps_the_previous_one_and_resume_is_exact(prepared, tmp_path):
    wrapper = tmp_path / "pausing_train.py"
    wrapper.write_text(PAUSING_TRAIN.format(root=str(ROOT)))
    out, flag = tmp_path / "run", tmp_path / "paused"
    flags = ["--epochs", "1", "--checkpoint-every", "3", "--record-ids", "--mixed-precision", "no"]
    argv = train_cmd(prepared, out, *flags)[2:]  # the flags of tools/train.py, without python and script
    env = {**os.environ, "PAUSE_AT": "2", "PAUSED_FLAG": str(flag)}
    proc = subprocess.Popen([sys.executable, str(wrapper), *argv], env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not flag.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert flag.exists(), proc.stderr.read()[-2000:] if proc.poll() is not None else "never paused"
    partial = Path(flag.read_text())
    assert partial.name == ".step-00000006.tmp" and (partial / "model.safetensors").is_file()
    proc.kill()
    proc.wait(timeout=60)
    assert [p.name for p in (out / "checkpoints").glob("step-*")] == ["step-00000003"]
    seen = out / "seen_ids.rank0.jsonl"
    seen.write_text("".join(ln + "\n" for ln in seen.read_text().splitlines()[:3]))  # what step 3 saved
    assert train_tool.main(argv + ["--resume", "latest"]) == 0
    assert not list((out / "checkpoints").glob(".step-*"))  # the partial write was cleaned, never used
    ids = [i for r in _jsonl(seen) for i in r["ids"]]
    steps = n_rows(prepared, "train") // 16  # an epoch (batch 16)
    assert len(ids) == len(set(ids)) == steps * 16 and [r["step"] for r in _jsonl(seen)] == list(range(steps))


def _rank_pids(launcher_pid: int) -> dict[int, int]:
    """{rank: pid} of the training processes a torchrun launcher started (read from /proc)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        rank = [e for e in env if e.startswith(b"RANK=")]
        if ppid == launcher_pid and rank:
            found[int(rank[0][5:])] = int(entry.name)
    return found


def _torchrun(prepared: Path, out: Path, *flags: str) -> subprocess.Popen:
    torchrun = ("-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()))
    cmd = train_cmd(prepared, out, *flags, launcher=torchrun)
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_steps(log: Path, n: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if log.exists() and len(log.read_text().splitlines()) >= n:
            return
        time.sleep(0.05)
    raise AssertionError(f"{log} did not reach {n} steps")


@pytest.mark.slow
def test_a_stopped_rank_makes_the_other_exit_naming_it(prepared, tmp_path):
    out = tmp_path / "ddp"
    proc = _torchrun(prepared, out, "--epochs", "3", "--record-ids", "--dist-timeout", "15")
    _wait_for_steps(out / "seen_ids.rank1.jsonl", 2, proc)
    pids = _rank_pids(proc.pid)
    os.kill(pids[1], signal.SIGSTOP)
    try:
        deadline = time.time() + 240  # bounded: the --dist-timeout, then rank 0's own exit
        while _running(pids[0]) and time.time() < deadline:
            time.sleep(0.1)
        assert not _running(pids[0]), "rank 0 did not exit with rank 1 stopped"
        # the launcher would wait 30 s for the stopped rank to take its SIGTERM (torchrun's fixed grace)
        os.kill(pids[1], signal.SIGKILL)
        _, err = proc.communicate(timeout=240)
    finally:
        for pid in pids.values():
            with_suppress_kill(pid)
    assert proc.returncode != 0
    assert "rank 0: waiting for the other processes failed" in err and "rank(s) 1 stopped responding" in err


def _running(pid: int) -> bool:
    """Whether the process ``pid`` runs (not exited, nor a zombie left for its parent to reap)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def with_suppress_kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.mark.slow
@pytest.mark.parametrize("target", ["rank 1", "launcher"])
def test_sigterm_to_one_rank_or_the_launcher_stops_both_at_the_same_step_with_one_checkpoint(
    prepared, tmp_path, target, capsys
):
    out = tmp_path / "ddp"
    flags = ("--epochs", "2", "--record-ids", "--mixed-precision", "no", "--dist-timeout", "60")
    proc = _torchrun(prepared, out, *flags)
    _wait_for_steps(out / "seen_ids.rank0.jsonl", 2, proc)
    os.kill(_rank_pids(proc.pid)[1] if target == "rank 1" else proc.pid, signal.SIGTERM)
    out_text, err = proc.communicate(timeout=300)
    assert proc.returncode != 0 and "stop signal: checkpoint written at step" in out_text, err[-3000:]
    (ckpt,) = list((out / "checkpoints").glob("step-*"))
    state = json.loads((ckpt / "trainer_state.json").read_text())
    r0, r1 = _jsonl(out / "seen_ids.rank0.jsonl"), _jsonl(out / "seen_ids.rank1.jsonl")
    assert len(r0) == len(r1) == state["global_step"]  # both ranks stopped after the same optimizer step
    # Another number of processes cannot continue the same shards: refused, listing it
    assert train_tool.main([*train_cmd(prepared, out, *flags)[2:], "--resume", "latest"]) == 2
    assert "num_processes: 2 -> 1" in capsys.readouterr().err
    resumed = subprocess.run(
        train_cmd(
            prepared,
            out,
            *flags,
            "--resume",
            "latest",
            launcher=("-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())),
        ),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    for rank in (0, 1):
        rows = _jsonl(out / f"seen_ids.rank{rank}.jsonl")
        assert [r["step"] for r in rows] == list(range(2 * 7))  # nothing lost or repeated on either rank


def test_a_dataset_prepared_again_during_a_run_leaves_the_model_its_own_tokenizer(
    own_prepared, tmp_path, monkeypatch, demo_manifest, minilm_dir
):
    """The run trains on the data it opened (memory-mapped); RUN/model took the tokenizer/ of the directory as
    it was at the end, another vocabulary once prepared again (wrong predictions, or unloadable). It carries
    the tokenizer the run opened."""
    from mmfast.infer.model_dir import load_model

    before = _tree(own_prepared / "tokenizer")
    real = classification.compute_loss
    calls = []

    def prepare_again_midway(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:  # the user re-prepares the directory, with another tokenizer, while the run trains
            again = {"source": str(demo_manifest), "out": str(own_prepared), "tokenizer": minilm_dir}
            prepare_dataset(PrepareConfig(**again, progress=False))
        return real(*args, **kwargs)

    monkeypatch.setattr(classification, "compute_loss", prepare_again_midway)
    out = tmp_path / "run"
    assert _run(own_prepared, out, "--max-steps", "2") == 0
    assert _tree(own_prepared / "tokenizer") != before  # the dataset is the new one now
    for name in ("model", "model-last"):
        assert _tree(out / name / "tokenizer") == before
        model = load_model(out / name)
        assert model.config["vocab_size"] == len(model.tokenizer) < 30522


def test_a_prepared_split_given_as_data_is_refused_naming_its_directory(prepared, tmp_path, capsys):
    """``--data PREPARED/train.jsonl`` was prepared again as a raw manifest: class ids became class names and
    the train rows were split again, with rc 0."""
    out = tmp_path / "run"
    assert _run(prepared / "train.jsonl", out, "--max-steps", "1") == 2
    err = capsys.readouterr().err
    assert f"is a split of the prepared dataset {prepared}; pass --data {prepared}" in err
    assert "Traceback" not in err and not out.exists()


def test_a_run_folder_given_as_data_is_refused_naming_what_it_trained_on(prepared, tmp_path, capsys):
    """``--data RUN`` was read as an image folder: a line per run file ("not an image file name ('.json')"),
    the reasons written beside --out, and advice naming a prepared folder that never existed."""
    run = tmp_path / "run"
    assert _run(prepared, run, "--max-steps", "1") == 0
    capsys.readouterr()
    assert _run(run, tmp_path / "runs" / "again", "--max-steps", "1") == 2
    err = capsys.readouterr().err
    assert (
        f"error: {run} is a training run's folder, not an image folder; pass the data it trained on: {prepared}"
        in err
    )
    assert "not an image file name" not in err and "was not changed" not in err
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").iterdir())
    export = claim_output_dir(tmp_path / "export", "export")
    (export / "a.png").write_bytes((prepared / "train.jsonl").read_bytes()[:10])
    with pytest.raises(ManifestError, match=f"{export} is an mmfast export folder, not an image folder"):
        read_source(export)


def test_a_batch_larger_than_the_split_names_the_flag_not_drop_last(prepared, tmp_path, capsys):
    """mmfast-train has no drop_last: the refusal said 'with drop_last=True' and 'on each of 1 processes'."""
    assert _run(prepared, tmp_path / "run", "--batch-size", "999", "--max-steps", "1") == 2
    err = capsys.readouterr().err
    n = n_rows(prepared, "train")  # the largest batch that trains
    assert f"cannot fill one batch of 999 and training drops a partial batch; pass --batch-size {n} or less" in err
    assert "drop_last" not in err and "processes" not in err and not (tmp_path / "run").exists()


def test_resuming_a_run_already_at_its_last_step_says_nothing_is_left(prepared, tmp_path, capsys):
    """``--resume latest --max-steps 2`` on a run at step 3 printed only "resumed from ..." and wrote the model
    directories again, as if it had trained."""
    out = tmp_path / "run"
    assert _run(prepared, out, "--max-steps", "3") == 0
    capsys.readouterr()
    assert _run(prepared, out, "--max-steps", "2", "--resume", "latest") == 0
    printed = capsys.readouterr().out
    assert "nothing left to train: the checkpoint is at step 3 of 2 (--epochs / --max-steps)" in printed
    assert json.loads((out / "summary.json").read_text())["global_step"] == 3


def test_a_resume_on_changed_data_at_the_same_path_names_that_path():
    from mmfast.train.resume_rules import resume_differences

    saved, now = {"task": "classification", "data": "/p"}, {"task": "classification", "data": "/p"}
    said = resume_differences({**saved, "data_fingerprint": "a"}, {**now, "data_fingerprint": "b"})
    assert said == [
        "data at '/p': other prepared data than the run trained on (its rows, captions, images or split differ)"
    ]


def test_a_raw_input_prepared_on_the_fly_names_its_first_rejected_row(tmp_path, capsys, cpu_accelerator):
    """mmfast-train --data on a raw manifest with a row whose image is missing: the run's first line names that
    row (its file and line, its image, why) and where every rejected row is listed, not only a count. A first
    reject that is no JSON object (a broken line) is named by its line alone."""
    from mmfast.train import parse_config
    from mmfast.train.resolve import resolve_preset
    from mmfast.train.setup import resolve_data
    from mmfast.train.slices import slices

    rows = []
    for i in range(20):
        save_image(tmp_path / "img" / f"{i}.png", seed=i)
        rows.append({"image": f"img/{i}.png", "text": f"picture {i}", "label": f"c{i % 2}"})
    rows.insert(7, {"image": "img/gone.png", "text": "a picture that is not there", "label": "c0"})
    manifest = write_jsonl(tmp_path / "pairs.jsonl", rows)
    argv = ["--data", str(manifest), "--out", str(tmp_path / "run"), "--preset", "tiny"]
    cfg = resolve_preset(parse_config(argv))
    out = resolve_data(slices(cfg).data, cpu_accelerator)
    printed = capsys.readouterr().out
    gone = tmp_path / "img" / "gone.png"
    assert f"1 rejected (the first: {manifest}:8 (img/gone.png): missing file: {gone}" in printed
    assert f"all of them in {out / 'rejected.jsonl'})" in printed
    broken = tmp_path / "broken.jsonl"
    broken.write_text(manifest.read_text().replace('{"image": "img/gone.png"', '{"image": img/gone.png'))
    argv = ["--data", str(broken), "--out", str(tmp_path / "run2"), "--preset", "tiny"]
    out = resolve_data(slices(resolve_preset(parse_config(argv))).data, cpu_accelerator)
    printed = capsys.readouterr().out
    assert f"1 rejected (the first: {broken}:8: " in printed
    assert f"all of them in {out / 'rejected.jsonl'})" in printed
