"""mmfast.util.quiet: libpng's harmless colour-profile warnings are dropped from fd 2, nothing else is."""

from __future__ import annotations

import io
import re
import struct
import subprocess
import sys
import zlib
from pathlib import Path

from conftest import ROOT
from PIL import Image


def _png_with_misplaced_srgb(path: Path) -> Path:
    """A valid PNG whose sRGB chunk comes after the image data (libpng: "sRGB: out of place")."""
    buf = io.BytesIO()
    Image.new("RGB", (16, 16), (200, 10, 10)).save(buf, format="PNG")
    png = buf.getvalue()
    chunk = b"sRGB\x00"
    srgb = struct.pack(">I", 1) + chunk + struct.pack(">I", zlib.crc32(chunk) & 0xFFFFFFFF)
    end = png.index(b"IEND") - 4
    path.write_bytes(png[:end] + srgb + png[end:])
    return path


SCRIPT = """
import os, sys
import numpy as np
from nvidia.dali import fn, pipeline_def, types
from mmfast.util.quiet import filter_native_stderr

@pipeline_def(batch_size=1, num_threads=1, device_id=None)
def decode():
    enc, _ = fn.readers.file(files=[sys.argv[1]], labels=[0])
    return fn.decoders.image(enc, device="cpu", output_type=types.RGB)

with filter_native_stderr():
    # before the pipeline exists: its threads, decoding ahead, write their warnings in pieces that another
    # thread's line could land between
    os.write(2, b"libpng warning: something else\\n")  # not a colour-profile warning: kept
    pipe = decode()
    pipe.build()
    for _ in range(3):
        (images,) = pipe.run()
    print("python stderr", file=sys.stderr)
    print("decoded", np.array(images[0]).shape)
    del images, pipe  # its prefetching threads decode ahead: stop them inside the block
    if sys.argv[2] == "abort":
        os.write(2, b"native last words\\n")
        os.abort()
"""


def _run(png: Path, mode: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    import os

    env = {**os.environ, **(env_extra or {})}
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, str(png), mode],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
    )


def test_libpng_colour_profile_warnings_are_counted_not_printed(tmp_path):
    png = _png_with_misplaced_srgb(tmp_path / "bad.png")
    raw = _run(png, "ok", {"MMFAST_RAW_STDERR": "1"})
    assert raw.returncode == 0 and raw.stderr.count("libpng warning: sRGB: out of place") >= 3, raw.stderr
    res = _run(png, "ok")
    assert res.returncode == 0 and "decoded (16, 16, 3)" in res.stdout
    assert "sRGB: out of place" not in res.stderr, res.stderr
    # one warning per decode; DALI's prefetching decodes a run or two ahead, so the count is not exact
    note = re.search(r"note: (\d+) libpng warnings about PNG colour-profile chunks", res.stderr)
    assert note and int(note[1]) >= 3, res.stderr
    assert "libpng warning: something else" in res.stderr and "python stderr" in res.stderr


def test_a_crash_keeps_its_last_native_words(tmp_path):
    res = _run(_png_with_misplaced_srgb(tmp_path / "bad.png"), "abort")
    assert res.returncode != 0 and "native last words" in res.stderr, res.stderr


HELPER = """
import os, subprocess, sys, time
from mmfast.util.quiet import filter_native_stderr

go = sys.argv[1]
with filter_native_stderr():
    os.write(2, b"libpng warning: iCCP: known incorrect sRGB profile\\n")
    # a helper that inherits fd 2 (as multiprocessing's fork server does) and holds it past the block
    helper = subprocess.Popen([sys.executable, "-c", (
        "import os, sys, time\\n"
        "while not os.path.exists(sys.argv[1]): time.sleep(0.05)\\n"
        "os.write(2, b'libpng warning: sRGB: out of place\\\\nhelper late words\\\\n')\\n"
    ), go])
    t0 = time.monotonic()
print(f"block ended in {time.monotonic() - t0:.2f} s", flush=True)
open(go, "w").close()
helper.wait()
"""


def test_the_block_ends_at_once_while_a_helper_holds_stderr_and_its_later_lines_still_come(tmp_path):
    """A helper that inherited fd 2 keeps the pipe open: the block must not wait for it (it once waited 5 s
    at every command's end), and what the helper writes afterwards is still filtered and forwarded."""
    res = subprocess.run(
        [sys.executable, "-c", HELPER, str(tmp_path / "go")], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert res.returncode == 0, res.stderr
    took = float(re.search(r"block ended in ([\d.]+) s", res.stdout)[1])
    assert took < 3.0, res.stdout
    assert "helper late words" in res.stderr and "libpng warning:" not in res.stderr, res.stderr
    # the block's own count comes first, the helper's (a line it hid afterwards) after its words
    assert res.stderr.startswith("note: 1 libpng warnings"), res.stderr
