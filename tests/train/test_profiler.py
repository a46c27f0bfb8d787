"""The profiler: data-wait accuracy against known sleeps, verdicts, NVML degradation, report files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from PIL import Image

from mmfast.train.profiler import StepTimer, UtilizationSampler, build_report, verdict
from tools import profile_run as profile_tool
from tools import train as train_tool


def _slow_loader(n: int, sleep: float):
    for i in range(n):
        time.sleep(sleep)  # decoding that takes `sleep` seconds per batch
        yield i


def _run(n: int, data_sleep: float, compute: float) -> dict:
    timer = StepTimer(cuda_sync=torch.cuda.is_available())
    with UtilizationSampler(0.05) as sampler:
        for _ in timer.iterate(_slow_loader(n, data_sleep)):
            with timer.phase("forward"):
                time.sleep(compute * 0.4)
            with timer.phase("backward"):
                time.sleep(compute * 0.5)
            with timer.phase("optimizer"):
                time.sleep(compute * 0.1)
            timer.end_step(8)
    return build_report(timer, sampler)


def test_warm_up_checkpoints_and_evaluation_stay_out_of_the_steady_state_figures():
    """Slow first steps and checkpoint writes must not make a fast run read as a slow one with an idle GPU:
    the report describes the steady training steps only."""
    timer = StepTimer(warmup_steps=3)
    with UtilizationSampler(0.02) as sampler:
        for i in timer.iterate(range(13)):
            with timer.phase("forward"):
                time.sleep(0.2 if i < 3 else 0.01)  # start-up: slow first steps
            timer.end_step(4)
            if i in (6, 9):
                with timer.phase("checkpoint"):
                    time.sleep(0.3)
        with timer.phase("eval"):
            time.sleep(0.2)
    report = build_report(timer, sampler)
    assert report["warmup"]["steps"] == 3 and report["warmup"]["seconds"] >= 0.6
    assert report["steps"] == 10 and report["samples"] == 40
    assert report["phase_s"]["forward"] == pytest.approx(0.1, abs=0.05)
    assert report["phase_s"]["checkpoint"] == pytest.approx(0.6, abs=0.1)
    assert report["train_wall_s"] < 0.35  # 10 steps of 10 ms and the loop itself, nothing else
    assert report["images_per_s"] > 40 / 0.35
    assert set(report["phase_frac"]) == {"data", "forward"}
    # utilization samples taken during the warm-up, the checkpoints and the evaluation are left out
    util = report["utilization"]
    assert util["samples"] < len(sampler.samples) / 3
    whole = sampler.stats()
    assert whole["samples"] == len(sampler.samples)


def test_data_wait_fraction_matches_known_sleeps_and_the_verdict_flips():
    slow = _run(20, data_sleep=0.03, compute=0.01)
    assert slow["data_wait_frac"] == pytest.approx(0.03 / 0.04, abs=0.05)
    assert slow["steps"] == 20 and slow["samples"] == 160
    assert slow["verdict"]["bound"] == "input" and "waits for data" in slow["verdict"]["summary"]
    fast = _run(20, data_sleep=0.0, compute=0.03)
    assert fast["data_wait_frac"] < 0.05
    assert fast["verdict"]["bound"] == "compute"
    assert fast["phase_s"]["backward"] == pytest.approx(20 * 0.015, rel=0.3)


def test_verdict_rules():
    gpu = {"gpu": {"gpu_util": {"mean": 35.0}}, "cpu_util_mean": 40.0}
    host = verdict({"data_wait_frac": 0.05, "utilization": gpu})
    assert host["bound"] == "host" and "35%" in host["summary"]
    busy_cpu = verdict(
        {
            "data_wait_frac": 0.6,
            "utilization": {"cpu_util_mean": 97.0, "gpu": {"gpu_util": {"mean": 20}}},
            "settings": {"decode_device": "cpu"},
        }
    )
    assert busy_cpu["bound"] == "input"
    assert any("GPU" in s for s in busy_cpu["next_steps"]) and any(
        "saturated" in s for s in busy_cpu["next_steps"]
    )
    cpu_only = {"data_wait_frac": 0.6, "utilization": {"cpu_util_mean": 97.0}}
    streaming = verdict({**cpu_only, "settings": {"decode_device": "cpu", "cache_decoded": False}})
    assert any("--cache-decoded" in s and "--max-side" in s for s in streaming["next_steps"])
    cached = verdict({**cpu_only, "settings": {"decode_device": "cpu", "cache_decoded": True}})
    assert not any("--cache-decoded" in s for s in cached["next_steps"] + busy_cpu["next_steps"])
    fp32 = verdict({"data_wait_frac": 0.01, "utilization": {}, "settings": {"mixed_precision": "no"}})
    assert fp32["bound"] == "compute" and any("mixed precision" in s for s in fp32["next_steps"])
    # on a CPU, a compute-bound loop shares its cores with the loader's decoding: the advice says so first
    cpu_decoding = verdict({"data_wait_frac": 0.17, "utilization": {}, "settings": {"decode_device": "cpu"}})
    assert cpu_decoding["bound"] == "compute"
    assert cpu_decoding["next_steps"][0].startswith("the loader's decoding threads share the CPU cores")
    assert "images shrunk offline by mmfast-prepare --max-side" in cpu_decoding["next_steps"][0]
    assert not any("share the CPU cores" in s for s in fp32["next_steps"] + host["next_steps"])
    assert not any("other processes" in s for s in fp32["next_steps"])
    busy_machine = {"cpu_util_mean": 37.0, "machine_cpu_util_mean": 100.0}  # this run's share, everyone's
    shared = verdict({"data_wait_frac": 0.01, "utilization": busy_machine})
    assert shared["next_steps"][0].startswith("other processes kept the machine 100% busy while this run used 37%")


def test_sampler_reports_cpu_per_core_and_degrades_without_nvml():
    with UtilizationSampler(0.05) as sampler:
        time.sleep(0.3)
    stats = sampler.stats()
    assert stats["samples"] >= 3
    assert len(stats["cpu_util_mean_per_core"]) == os.cpu_count()
    if sampler.gpu_error is not None:  # no GPU or no NVML here
        assert stats["gpu"] == {"available": False, "reason": sampler.gpu_error}
        assert sampler.gpu_error.startswith("none: ") or "not installed" in sampler.gpu_error
        assert sampler.read_gpu() == {}


@pytest.mark.gpu
def test_nvml_readings_are_parsed_from_the_real_library():
    with UtilizationSampler(0.05) as sampler:
        x = torch.randn(4096, 4096, device="cuda")
        for _ in range(50):
            x = x @ x.T / 4096
        torch.cuda.synchronize()
        reading = sampler.read_gpu()
    assert 0 <= reading["gpu_util"] <= 100
    assert 0 < reading["gpu_mem_used_mib"] <= reading["gpu_mem_total_mib"]
    assert sampler.stats()["gpu"]["gpu_util"]["max"] >= 0


def test_training_with_profile_writes_json_and_png(prepared, tmp_path, capsys):
    out = tmp_path / "run"
    assert (
        train_tool.main(
            [
                "--data",
                str(prepared),
                "--out",
                str(out),
                "--profile",
                "--epochs",
                "1",
                "--batch-size",
                "32",
                "--image-size",
                "32",
                "--hidden",
                "32",
                "--no-progress",
            ]
        )
        == 0
    )
    report = json.loads((out / "profile.json").read_text())
    # 7 steps: the first 5 are the warm-up, the figures are the 2 after them
    assert report["warmup"]["steps"] == 5 and report["steps"] == 2 and report["samples"] == 2 * 32
    assert {"data", "forward", "backward", "optimizer", "eval", "checkpoint"} <= set(report["phase_s"])
    assert "checkpoint" not in report["phase_frac"] and "eval" not in report["phase_frac"]
    assert 0 <= report["data_wait_frac"] < 1 and report["verdict"]["bound"] in ("input", "host", "compute")
    assert report["settings"]["decode_device"] == ("mixed" if torch.cuda.is_available() else "cpu")
    assert len(report["timeline"]) >= 1 and "cpu_util" in report["timeline"][0]
    with Image.open(out / "profile.png") as im:
        assert im.format == "PNG" and im.size[0] > 600
    (metrics,) = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert "data_wait_frac" in metrics and "cpu_util_mean" in metrics and "gpu_util_mean" in metrics
    capsys.readouterr()
    assert profile_tool.main(["--run", str(out)]) == 0
    assert "verdict:" in capsys.readouterr().out
    assert profile_tool.main(["--run", str(tmp_path)]) == 2


def test_the_profile_tool_writes_no_checkpoints_and_reports_the_steady_state(
    prepared, tmp_path, capsys, monkeypatch
):
    monkeypatch.chdir(tmp_path)  # the default --out: runs/profile
    out = tmp_path / "runs" / "profile"
    flags = ["--data", str(prepared), "--steps", "8", "--batch-size", "16", "--image-size", "32", "--hidden", "32"]
    assert profile_tool.main(flags) == 0
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())
    report = json.loads((out / "profile.json").read_text())
    assert report["warmup"]["steps"] == 5 and report["steps"] == 8  # 8 optimizer steps after 5 of warm-up
    assert "checkpoint" not in report["phase_s"]
    assert not (out / "summary.json").exists()
    assert "(steady state, after 5 warm-up steps)" in capsys.readouterr().out
    assert profile_tool.main(flags) == 0  # profiling again: the earlier profile is moved aside, not refused
    assert len([p for p in (tmp_path / "runs").iterdir() if p.name.startswith("profile.old-")]) == 1
    capsys.readouterr()
    assert profile_tool.main(["--data", str(tmp_path / "typo"), "--steps", "8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --data") and "Traceback" not in err and len(err.splitlines()) == 1
    assert json.loads((out / "profile.json").read_text())["steps"] == 8  # the last profile is back in place
    mine = tmp_path / "mine"  # a profile's own --out: profiled again, the earlier one is moved aside too
    assert (
        profile_tool.main([*flags, "--out", str(mine)]) == 0
        and profile_tool.main([*flags, "--out", str(mine)]) == 0
    )
    assert len([p for p in tmp_path.iterdir() if p.name.startswith("mine.old-")]) == 1
    trained = tmp_path / "trained"  # a training run's --out: a profile does not continue it, nor offers to
    assert train_tool.main(["--data", str(prepared), "--out", str(trained), "--max-steps", "1", *flags[4:]]) == 0
    capsys.readouterr()
    assert profile_tool.main([*flags, "--out", str(trained)]) == 2
    err = capsys.readouterr().err
    assert "holds an earlier training run, which a profile does not continue: pass --overwrite" in err
    assert "--resume" not in err and (trained / "summary.json").is_file()


def test_advice_fits_the_machine():
    """Never a GPU flag on a machine without one; all GPUs where a run uses fewer."""
    cpu_only = {"cuda_devices": 0, "num_processes": 1, "mixed_precision": "no", "cpu_fast_bf16": False}
    decoding = {**cpu_only, "decode_device": "cpu"}
    steps = verdict({"data_wait_frac": 0.01, "utilization": {}, "settings": decoding})["next_steps"]
    assert any("decoding threads share the CPU cores" in s for s in steps)
    held = {**decoding, "cache_decoded": True}  # decoded once: no decoding to blame
    steps = verdict({"data_wait_frac": 0.01, "utilization": {}, "settings": held})["next_steps"]
    assert not any("decoding" in s for s in steps)
    features = {**decoding, "feature_views": 2}  # cached features: nothing decoded, the image tower idle
    for wait in (0.01, 0.6):  # compute-bound, and input-bound on a saturated CPU
        util = {"cpu_util_mean": 97.0}
        steps = verdict({"data_wait_frac": wait, "utilization": util, "settings": features})["next_steps"]
        assert steps and not any("decod" in s or "--image-size" in s or "pixels (" in s for s in steps), steps
    steps = verdict({"data_wait_frac": 0.01, "utilization": {}, "settings": cpu_only})["next_steps"]
    assert not any("GPU" in s or "multi_gpu" in s or "channels-last" in s or "precision" in s for s in steps)
    bf16_cpu = {**cpu_only, "cpu_fast_bf16": True}
    steps = verdict({"data_wait_frac": 0.01, "utilization": {}, "settings": bf16_cpu})["next_steps"]
    assert any("--mixed-precision bf16" in s for s in steps) and not any("multi_gpu" in s for s in steps)
    eight = {"cuda_devices": 8, "num_processes": 1, "mixed_precision": "fp16", "channels_last": True}
    util = {"gpu": {"gpu_util": {"mean": 95.0}}}
    steps = verdict({"data_wait_frac": 0.01, "utilization": util, "settings": eight})["next_steps"]
    assert any("--multi_gpu --num_processes 8" in s for s in steps)


def test_cpu_share_counts_this_process_and_its_children():
    """A busy child process shows in the run's CPU share (the parent only sleeps)."""
    child = subprocess.Popen(
        [sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 3: pass"]
    )
    try:
        with UtilizationSampler(0.1) as sampler:
            time.sleep(1.2)
    finally:
        child.kill()
        child.wait()
    stats = sampler.stats()
    own = [s["proc_cpu_util"] for s in sampler.samples[1:]]  # the first reading of a new process is 0
    assert max(own) > 0.3 * 100 / os.cpu_count(), own  # one busy core of cpu_count, under load
    every = [s["proc_cpu_util"] for s in sampler.samples]
    assert stats["cpu_util_mean"] == round(sum(every) / len(every), 1)  # the run's share, not the machine's


@pytest.mark.parametrize(
    "reason, shown",
    [
        ("none: NVML unavailable (NVML Shared Library Not Found)", "GPU: none\n"),  # no driver: a CPU machine
        ("none: NVML unavailable (Driver Not Loaded)", "GPU: none: NVML unavailable (Driver Not Loaded)"),
    ],
)
def test_a_machine_without_an_nvidia_driver_reads_gpu_none(reason, shown):
    from mmfast.train.profiler import report_text

    report = _run(4, 0.001, 0.004)
    report["utilization"]["gpu"] = {"available": False, "reason": reason}
    report["utilization"]["samples"] = report["utilization"].get("samples") or 1
    assert shown in report_text(report) + "\n"
