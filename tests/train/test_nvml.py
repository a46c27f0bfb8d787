"""The utilization sampler's NVML parsing, replayed from a recording of what nvidia-ml-py returned on a GPU.

tests/data/nvml_h200.json is written by tools/nvml_record.py: every NVML call the sampler made, in order,
with its arguments and result. ``ReplayNVML`` stands in for the ``pynvml`` module and serves those results
as the genuine nvidia-ml-py types (its ctypes structs and exception classes), so the sampler's parsing meets
what it meets on a GPU; a call the recording does not have next is a mismatch the tests report.
"""

from __future__ import annotations

import json
import sys
import time
import types
from pathlib import Path

import pynvml
import pytest

from mmfast.train.profiler import UtilizationSampler
from tools import nvml_record

RECORDING = json.loads((Path(__file__).parents[1] / "data" / "nvml_h200.json").read_text())
READS = ("nvmlDeviceGetUtilizationRates", "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetClockInfo")


def _decode(result: dict):
    """A recorded result as nvidia-ml-py returns it."""
    if "struct" in result:
        return getattr(pynvml, result["struct"])(**result["fields"])
    if "handle" in result:
        return pynvml.c_nvmlDevice_t()  # a NULL device pointer: opaque, only passed back
    return result["value"]


class ReplayNVML(types.ModuleType):
    """``pynvml`` as the recording saw it: each call must be the next recorded one and gets its result."""

    def __init__(self, recording: dict):
        super().__init__("pynvml")
        self.calls = recording["calls"]
        self.position = 0  # the next recorded call
        self.unexpected: list[tuple[str, list]] = []  # calls that were not the next recorded one
        self.raised: list[type] = []  # the recorded NVML errors served
        self.driver_version = recording["driver_version"]
        self.NVMLError = pynvml.NVMLError
        for name, value in recording["constants"].items():
            setattr(self, name, value)
        for name in {c["call"] for c in self.calls}:
            setattr(self, name, self._replayer(name))

    def nvmlSystemGetDriverVersion(self) -> str:  # metadata the recorder reads, not a sampler call
        return self.driver_version

    def _replayer(self, name: str):
        def replay(*args):
            entry = self.calls[self.position] if self.position < len(self.calls) else {"call": "(end)"}
            if (name, nvml_record.encode_args(args)) != (entry["call"], entry.get("args")):
                self.unexpected.append((name, nvml_record.encode_args(args)))
                raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)
            self.position += 1
            if "error" in entry:
                error = pynvml.NVMLError(entry["error"]["code"])  # the subclass of that code, as NVML raises
                self.raised.append(type(error))
                raise error
            return _decode(entry["return"])

        return replay


def _with_error(recording: dict, call: str, code: int) -> dict:
    """The recording with every ``call`` failing with NVML error ``code`` instead."""
    calls = [
        {"call": c["call"], "args": c["args"], "error": {"code": code}} if c["call"] == call else c
        for c in recording["calls"]
    ]
    return {**recording, "calls": calls}


def _expected_readings(recording: dict) -> list[dict]:
    """What read_gpu() must return for each recorded reading: %, MiB (2**20 bytes), MHz, W (from mW)."""
    out = []
    for c in recording["calls"]:
        r = c.get("return", {})
        if c["call"] == "nvmlDeviceGetUtilizationRates":
            out.append({"gpu_util": r["fields"]["gpu"], "gpu_mem_util": r["fields"]["memory"]})
        elif c["call"] == "nvmlDeviceGetMemoryInfo":
            out[-1]["gpu_mem_used_mib"] = r["fields"]["used"] / 1048576
            out[-1]["gpu_mem_total_mib"] = r["fields"]["total"] / 1048576
        elif c["call"] == "nvmlDeviceGetClockInfo" and "return" in c:
            out[-1]["sm_clock_mhz"] = r["value"]
        elif c["call"] == "nvmlDeviceGetPowerUsage" and "return" in c:
            out[-1]["power_w"] = r["value"] / 1000
    return out


def _install(monkeypatch, recording: dict) -> ReplayNVML:
    fake = ReplayNVML(recording)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    return fake


def _replay_readings(monkeypatch, recording: dict) -> tuple[UtilizationSampler, list[dict], ReplayNVML]:
    """Open the sampler on the replay, read_gpu() once per recorded reading, close it."""
    fake = _install(monkeypatch, recording)
    # an interval longer than the test: the background thread never samples, the reads below are the only ones
    with UtilizationSampler(3600, device_index=recording["device_index"]) as sampler:
        readings = [sampler.read_gpu() for _ in _expected_readings(recording)]
    return sampler, readings, fake


def test_the_recording_is_one_the_sampler_would_make():
    calls = [c["call"] for c in RECORDING["calls"]]
    assert calls[:3] == ["nvmlInit", "nvmlDeviceGetHandleByIndex", "nvmlDeviceGetName"]
    assert calls[-1] == "nvmlShutdown"
    assert len(_expected_readings(RECORDING)) >= 3
    if not RECORDING["recorded"]:  # typed-in values, until the lent GPU machine records real ones
        assert "tools/nvml_record.py" in RECORDING["note"]


def test_readings_parse_the_real_nvml_types_into_percent_mib_mhz_and_watts(monkeypatch):
    sampler, readings, fake = _replay_readings(monkeypatch, RECORDING)
    assert fake.unexpected == [] and fake.position == len(RECORDING["calls"])  # every call, in order
    assert readings == _expected_readings(RECORDING)
    assert sampler.gpu_error is None
    assert sampler.gpu_name == RECORDING["calls"][2]["return"]["value"] and "H200" in sampler.gpu_name
    for r in readings:  # units a slip (bytes, GiB, mW, a swapped field) would put out of range
        assert 0 <= r["gpu_util"] <= 100 and 0 <= r["gpu_mem_util"] <= 100
        assert 100_000 < r["gpu_mem_total_mib"] < 150_000  # an H200 has 143771 MiB
        assert 0 < r["gpu_mem_used_mib"] <= r["gpu_mem_total_mib"]
        assert 100 <= r["sm_clock_mhz"] <= 3000 and 20 <= r["power_w"] <= 1000


def test_stats_summarize_the_readings_the_background_thread_took(monkeypatch):
    fake = _install(monkeypatch, RECORDING)
    expected = _expected_readings(RECORDING)
    shutdown = len(RECORDING["calls"]) - 1
    with UtilizationSampler(0.01, device_index=RECORDING["device_index"]) as sampler:
        deadline = time.monotonic() + 10
        while fake.position < shutdown and time.monotonic() < deadline:
            time.sleep(0.01)
    # past the recording, the thread's further reads failed (and were skipped); nvmlShutdown came last
    assert {name for name, _ in fake.unexpected} <= {"nvmlDeviceGetUtilizationRates"}
    assert fake.position == len(RECORDING["calls"])
    gpu = sampler.stats()["gpu"]
    assert set(gpu) == {"gpu_util", "gpu_mem_used_mib", "sm_clock_mhz", "power_w"}
    for key in gpu:
        values = [r[key] for r in expected]
        assert gpu[key]["mean"] == round(sum(values) / len(values), 2)
        assert gpu[key]["max"] == max(values)


@pytest.mark.parametrize(
    "call, key", [("nvmlDeviceGetPowerUsage", "power_w"), ("nvmlDeviceGetClockInfo", "sm_clock_mhz")]
)
def test_a_reading_a_gpu_does_not_support_leaves_the_others_intact(monkeypatch, call, key):
    recording = _with_error(RECORDING, call, pynvml.NVML_ERROR_NOT_SUPPORTED)
    sampler, readings, fake = _replay_readings(monkeypatch, recording)
    assert fake.unexpected == [] and fake.position == len(recording["calls"])
    expected = _expected_readings(recording)
    assert all(key not in r for r in expected)
    assert readings == expected
    assert fake.raised == [pynvml.NVMLError_NotSupported] * len(readings)  # what the sampler met, and skipped


@pytest.mark.parametrize(
    "code, reason",
    [
        (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "Driver Not Loaded"),
        (pynvml.NVML_ERROR_NO_PERMISSION, "Insufficient Permissions"),
    ],
)
def test_nvml_that_cannot_start_is_reported_not_raised(monkeypatch, code, reason):
    recording = {**RECORDING, "calls": [{"call": "nvmlInit", "args": [], "error": {"code": code}}]}
    _install(monkeypatch, recording)
    with UtilizationSampler(0.01) as sampler:
        time.sleep(0.05)
    assert sampler.gpu_error == f"none: NVML unavailable ({reason})"
    assert sampler.read_gpu() == {}
    assert sampler.stats()["gpu"] == {"available": False, "reason": sampler.gpu_error}


def test_missing_bindings_are_reported_not_raised(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError
    sampler = UtilizationSampler()
    sampler._open_nvml()
    assert sampler.gpu_error == "NVML bindings not installed (pip install nvidia-ml-py)"
    assert sampler.read_gpu() == {}


def test_the_recorder_writes_back_what_it_is_served(monkeypatch, tmp_path):
    """tools/nvml_record.py through the sampler on the replay: the same calls, results and constants."""
    fake = _install(monkeypatch, RECORDING)
    out = tmp_path / "nvml.json"
    samples = len(_expected_readings(RECORDING))
    assert nvml_record.main(["--out", str(out), "--samples", str(samples), "--interval", "0"]) == 0
    assert fake.unexpected == []
    again = json.loads(out.read_text())
    assert again["recorded"] is True and again["driver_version"] == RECORDING["driver_version"]
    assert again["calls"] == RECORDING["calls"] and again["constants"] == RECORDING["constants"]


def test_the_recorder_exits_1_without_nvml(monkeypatch, tmp_path, capsys):
    error = {"code": pynvml.NVML_ERROR_LIBRARY_NOT_FOUND}
    _install(monkeypatch, {**RECORDING, "calls": [{"call": "nvmlInit", "args": [], "error": error}]})
    assert nvml_record.main(["--out", str(tmp_path / "nvml.json")]) == 1
    assert "NVML Shared Library Not Found" in capsys.readouterr().err
    assert not (tmp_path / "nvml.json").exists()
