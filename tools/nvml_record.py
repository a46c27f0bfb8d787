"""Record what NVML returns to mmfast's utilization sampler, for tests/train/test_nvml.py to replay without a GPU.

    python tools/nvml_record.py --out tests/data/nvml_h200.json [--samples 5 --interval 0.2 --device 0]

The sampler itself makes the calls (``UtilizationSampler``: open, ``read_gpu`` ``--samples`` times, close),
through a stand-in for the ``pynvml`` module that forwards each call to nvidia-ml-py and writes down, in
order, the call, its arguments and what came back: every field of a returned struct, ints, strings, or the
NVML error it raised. So the recording holds exactly the calls the sampler makes, and a change to those
calls shows up as a replay mismatch. Exits 1 on a machine without nvidia-ml-py, NVML or a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import sys
import time
from importlib.metadata import version


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--samples", type=int, default=5, help="read_gpu() calls to record")
    p.add_argument("--interval", type=float, default=0.2, help="seconds between them")
    p.add_argument("--device", type=int, default=0, help="NVML index of the GPU")
    return p.parse_args(argv)


def encode(value) -> dict:
    """A JSON form of an NVML return value: {"struct", "fields"}, {"handle": type} or {"value"}."""
    if isinstance(value, ctypes.Structure):
        return {"struct": type(value).__name__, "fields": {f[0]: getattr(value, f[0]) for f in value._fields_}}
    if isinstance(value, ctypes._Pointer):  # nvmlDevice_t: opaque, only passed back to NVML
        return {"handle": type(value).__name__}
    return {"value": value}


def encode_args(args: tuple) -> list:
    return [a if isinstance(a, int | float | str) else type(a).__name__ for a in args]


class Recorder:
    """Stands in for the ``pynvml`` module: forwards to it and appends every call to ``calls``."""

    def __init__(self, nvml):
        self._nvml = nvml
        self.calls: list[dict] = []
        self.constants: dict[str, int] = {}  # the module's constants the sampler read (NVML_CLOCK_SM)

    def __getattr__(self, name: str):
        attr = getattr(self._nvml, name)
        if name.startswith("NVML_"):
            self.constants[name] = attr
        if not callable(attr):
            return attr

        def call(*args):
            entry = {"call": name, "args": encode_args(args)}
            self.calls.append(entry)
            try:
                result = attr(*args)
            except self._nvml.NVMLError as e:
                entry["error"] = {"class": type(e).__name__, "code": e.value, "message": str(e)}
                raise
            entry["return"] = encode(result)
            return result

        return call


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import pynvml
    except ImportError:
        print("nvml_record: nvidia-ml-py is not installed (pip install nvidia-ml-py)", file=sys.stderr)
        return 1
    from mmfast.train.profiler import UtilizationSampler
    from mmfast.util.fsutil import atomic_write_json

    recorder = Recorder(pynvml)
    sys.modules["pynvml"] = recorder  # what the sampler's `import pynvml` gets
    try:
        # an interval longer than the recording: the background thread never samples, the reads below
        # are the only ones
        with UtilizationSampler(interval=3600, device_index=args.device) as sampler:
            if sampler.gpu_error is not None:
                print(f"nvml_record: {sampler.gpu_error}", file=sys.stderr)
                return 1
            for i in range(args.samples):
                time.sleep(args.interval if i else 0.0)
                with contextlib.suppress(pynvml.NVMLError):  # recorded; the sampler would skip the sample
                    sampler.read_gpu()
            driver = pynvml.nvmlSystemGetDriverVersion()  # context for the reader, not a sampler call
    finally:
        sys.modules["pynvml"] = pynvml
    atomic_write_json(
        args.out,
        {
            "recorded": True,
            "note": f"recorded by tools/nvml_record.py on {sampler.gpu_name}, driver {driver}",
            "bindings": f"nvidia-ml-py {version('nvidia-ml-py')}",
            "driver_version": driver,
            "device_index": args.device,
            "interval_s": args.interval,
            "constants": recorder.constants,
            "calls": recorder.calls,
        },
    )
    reads = sum(c["call"] == "nvmlDeviceGetUtilizationRates" for c in recorder.calls)
    print(f"{args.out}: {len(recorder.calls)} NVML calls, {reads} readings, {sampler.gpu_name}, driver {driver}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
