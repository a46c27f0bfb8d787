"""Image files that change under a loader: bytes that are no image, FIFOs, files replaced, deleted or truncated
after they were checked or cached. DALI 2.4 can crash the process (SIGSEGV) parsing such a file in a batch of
32 or more, so each case runs in fresh processes and asserts that they exit 0 with the exact samples masked."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from conftest import train_cmd

from mmfast import ImageLoader
from mmfast.prepare.core import PrepareConfig, prepare_dataset
from mmfast.prepare.demo import demo_dataset


def _prepared(root: Path, n: int = 320) -> Path:
    """A prepared demo set whose images the test may damage (``n`` samples, all train)."""
    manifest = demo_dataset(n=n, seed=5, root=root / "demo")
    out = root / "prepared"
    prepare_dataset(
        PrepareConfig(source=str(manifest), out=str(out), max_length=32, val_fraction=0.0, progress=False)
    )
    return out


def _rows(d: Path) -> list[dict]:
    return [json.loads(ln) for ln in (d / "train.jsonl").read_text().splitlines()]


# Three files turn to 7 bytes of text before the loader starts, three more after its first epoch; with
# shuffle off, those are read in epoch 1's batches 6, 7 and 9 (of 10), after the batches DALI reads ahead.
_GARBAGE_RUN = """
import json, sys
from pathlib import Path
from mmfast import MultimodalLoader
d = sys.argv[1]
rows = [json.loads(ln) for ln in open(d + "/train.jsonl")]
for i in (3, 40, 77):
    Path(rows[i]["image"]).write_bytes(b"garbage")
loader = MultimodalLoader(d, "train", batch_size=32, size=32, shuffle=False)
masked = []
for epoch in range(3):
    masked.append(sum(b["id"].tolist().count(-1) for b in loader))
    if epoch == 0:
        for i in (200, 250, 300):
            Path(rows[i]["image"]).write_bytes(b"garbage")
print(json.dumps({"skipped": sorted(s["id"] for s in loader.skipped), "masked": masked}))
"""


def test_non_image_bytes_before_and_during_a_run_never_reach_dali(tmp_path):
    """The loader's defaults (whole DALI batches of 32 on every core) with prepared files overwritten by text,
    before the start and between epochs: three fresh processes each skip exactly those six (this crashed with
    SIGSEGV in every run before the loader watched the files it is about to read)."""
    for run in range(3):
        d = _prepared(tmp_path / f"r{run}")
        rows = _rows(d)
        out = subprocess.run(
            [sys.executable, "-c", _GARBAGE_RUN, str(d)], capture_output=True, text=True, timeout=300
        )
        assert out.returncode == 0, (out.returncode, out.stderr[-3000:])
        got = json.loads(out.stdout.splitlines()[-1])
        assert got["skipped"] == sorted(rows[i]["id"] for i in (3, 40, 77, 200, 250, 300))
        assert got["masked"] == [3, 6, 6]


def _train_with_garbage(tmp_path: Path, *flags: str) -> dict:
    d = _prepared(tmp_path)
    rows = _rows(d)
    for i in (3, 40, 77):
        Path(rows[i]["image"]).write_bytes(b"garbage")
    out = tmp_path / "run"
    cmd = train_cmd(d, out, "--batch-size", "64", *flags)  # the later --batch-size wins: DALI batches of 64
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, (run.returncode, run.stderr[-3000:])
    last = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()][-1]
    # the end of the run says so too: summary.json and the table
    assert json.loads((out / "summary.json").read_text())["skipped_samples"] == last["skipped_samples"]
    assert re.search(rf"skipped images +{last['skipped_samples']} unreadable", run.stdout), run.stdout[-2000:]
    # skipped.jsonl lists each: the train split's damaged files among them, by id, with the reason
    listed = [json.loads(ln) for ln in (out / "skipped.jsonl").read_text().splitlines()]
    assert len(listed) == last["skipped_samples"] and [e["id"] for e in listed] == sorted(e["id"] for e in listed)
    assert {(e["id"], e["image"]) for e in listed} <= {(rows[i]["id"], rows[i]["image"]) for i in (3, 40, 77)}
    assert listed and all(e["reason"] for e in listed)
    return last


def test_training_with_its_defaults_skips_non_image_bytes(tmp_path):
    """The issue's case: ``tools/train.py`` with its defaults on a prepared set three of whose images were
    overwritten with text (exit 139 in most runs before; the crash is threaded, so two runs)."""
    for run in range(2):
        assert _train_with_garbage(tmp_path / str(run), "--epochs", "1")["skipped_samples"] == 3


@pytest.mark.slow
def test_training_streaming_and_cached_skips_non_image_bytes(tmp_path):
    assert _train_with_garbage(tmp_path / "s", "--epochs", "2", "--no-cache-decoded")["skipped_samples"] == 3
    assert _train_with_garbage(tmp_path / "c", "--epochs", "2", "--cache-decoded")["skipped_samples"] == 3


def _pngs(folder: Path, n: int) -> list[str]:
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    files = []
    for k in range(n):
        rng = np.random.default_rng(k)
        files.append(str(folder / f"{k:03d}.png"))
        Image.fromarray(rng.integers(0, 256, (24, 24 + k % 5, 3), dtype=np.uint8)).save(files[-1])
    return files


def _bounded(fn, seconds: float = 120):
    """``fn()`` on a thread; fails the test (instead of hanging it) when it has not returned in ``seconds``."""
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("value", fn()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s"
    return result.get("value")


@pytest.mark.parametrize("cache_decoded", ["auto", False])
def test_a_fifo_among_the_files_is_skipped_without_blocking(tmp_path, cache_decoded):
    """A FIFO opened for reading blocks until a writer comes: the auto cache's header sample and DALI's reader
    both hung on one. It is refused by its stat, like preparation refuses it."""
    files = _pngs(tmp_path / "imgs", 40)
    os.remove(files[0])
    os.mkfifo(files[0])  # the first file: the one the auto estimate reads first, and the stand-in's place
    os.remove(files[17])
    os.mkfifo(files[17])

    def epoch():
        options = {"batch_size": 8, "size": 16, "num_workers": 2, "as_dict": True}
        loader = ImageLoader(files, cache_decoded=cache_decoded, **options)
        ids = [i for b in loader for i in b["id"].tolist()]
        return ids, loader.skipped

    ids, skipped = _bounded(epoch)
    assert [s["id"] for s in skipped] == [0, 17] and "not a regular file" in skipped[0]["reason"]
    assert sorted(i for i in ids if i >= 0) == [i for i in range(40) if i not in (0, 17)]


def test_the_cache_sees_files_replaced_deleted_or_truncated_after_it_filled(tmp_path):
    """The decoded cache watches its files each epoch: a replaced image is decoded again (its new pixels), a
    deleted or truncated one is skipped with its reason, instead of served from memory with no word."""
    from PIL import Image

    files = _pngs(tmp_path / "imgs", 24)
    loader = ImageLoader(files, batch_size=8, size=16, num_workers=2, cache_decoded=True, as_dict=True)
    first = {i: img for b in loader for i, img in zip(b["id"].tolist(), b["image"], strict=True)}
    assert loader.holds_decoded and len(first) == 24
    Image.new("RGB", (26, 24), (255, 0, 0)).save(files[5])  # pure red now
    os.remove(files[9])
    data = Path(files[13]).read_bytes()
    Path(files[13]).write_bytes(data[: len(data) // 2])
    second = {i: img for b in loader for i, img in zip(b["id"].tolist(), b["image"], strict=True) if i >= 0}
    assert sorted(second) == [i for i in range(24) if i not in (9, 13)]
    red = second[5]  # normalized: red far above the mean, green and blue far below
    assert red[0].min() > 2.0 and red[1].max() < -1.5 and red[2].max() < -1.5
    assert not np.allclose(first[5].numpy(), red.numpy())
    reasons = {s["id"]: s["reason"] for s in loader.skipped}
    assert sorted(reasons) == [9, 13] and "missing" in reasons[9] and "truncated" in reasons[13]


def test_a_latin1_file_name_is_read_like_any_other(tmp_path):
    """A name UTF-8 cannot encode (Latin-1 bytes): DALI refused the whole list ("Unsupported argument type with
    name files") where DataLoader(ImageFolder) reads it; it is read through a link of the loader's own."""
    from torchvision.datasets import ImageFolder

    files = _pngs(tmp_path / "imgs" / "cats", 12)
    os.rename(files[4], os.fsencode(tmp_path / "imgs" / "cats") + b"/caf\xe9.png")
    loader = ImageLoader.from_folder(tmp_path / "imgs", batch_size=4, size=16, num_workers=2, as_dict=True)
    ids = [i for b in loader for i in b["id"].tolist()]
    assert len(ImageFolder(str(tmp_path / "imgs"))) == 12
    assert sorted(ids) == list(range(12)) and not loader.skipped


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"files": "photos/"}, "got the path 'photos/'; for a folder of class folders use ImageLoader.from_"),
        ({"labels": [0.7] * 20}, "label 0 is 0.7"),
        ({"labels": [1.0] * 19 + [float("nan")]}, "label 19 is nan"),
        ({"labels": ["cat"] * 20}, "map class names to ids first"),
        ({"batch_size": 10**9}, "batch_size=1000000000 is larger than the 20 samples of each process"),
        ({"size": 100000}, "size=100000 makes 100000x100000 = 10000 MP output images, over the 64 MP budget"),
        ({"shard_id": 1.5, "num_shards": 2}, "shard_id must be an int, got 1.5"),  # failed deep in iteration
        ({"shard_id": "0"}, "shard_id must be an int, got '0'"),
        ({"num_shards": 0}, "num_shards must be >= 1, got 0"),
        ({"size": (32, 48)}, "size must be one int (square outputs"),
    ],
)
def test_drop_in_arguments_that_would_go_wrong_are_refused_naming_them(tmp_path, kwargs, error):
    """Each of these was silently wrong or a resource blow-up: a path string read as a list of one-character
    files, labels truncated to class 0, a batch padded to 10**9 entries (23 GB), outputs of 447 GiB a batch."""
    files = _pngs(tmp_path / "imgs", 20)
    args = {"files": files, "batch_size": 4, "size": 16, "num_workers": 2, **kwargs}
    with pytest.raises((TypeError, ValueError), match=re.escape(error)):
        ImageLoader(args.pop("files"), **args)
    assert ImageLoader(files, [3.0] * 20, batch_size=4, size=16).labels.tolist() == [3] * 20  # whole floats


def test_running_out_of_memory_in_training_is_one_line(prepared, tmp_path, monkeypatch, capsys):
    """Torch's CPU allocator raises a bare RuntimeError when a limit (ulimit -v) is reached: said in one line
    with what to lower, exit 2."""
    from mmfast.tasks import classification
    from tools import train as train_tool

    def no_memory(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:118] DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(classification, "compute_loss", no_memory)
    rc = train_tool.main(["--data", str(prepared), "--out", str(tmp_path / "run"), "--max-steps", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and "error: out of memory" in err and "--batch-size" in err and "Traceback" not in err


@pytest.mark.parametrize("cache_decoded", ["auto", False])
def test_an_image_over_the_pixel_budget_is_skipped_by_the_drop_in_before_it_is_decoded(tmp_path, cache_decoded):
    """A 1-bit PNG of 9400x9400 is 11 KB on disk and 265 MB decoded: the 64 MP budget applied only with
    verify_files, so the drop-in decoded it (MemoryError copying it into the cache, GBs of RSS). Its header is
    read the first time the file is seen."""
    from PIL import Image

    files = _pngs(tmp_path / "imgs", 16)
    Image.new("1", (9400, 9400)).save(files[6])
    assert os.path.getsize(files[6]) < 100_000
    loader = ImageLoader(files, batch_size=8, size=16, num_workers=2, as_dict=True, cache_decoded=cache_decoded)
    ids = [i for b in loader for i in b["id"].tolist()]
    assert sorted(i for i in ids if i >= 0) == [i for i in range(16) if i != 6]
    (skipped,) = loader.skipped
    assert skipped["id"] == 6 and "9400x9400 = 88.4 MP, over the 64 MP budget" in skipped["reason"]


def test_pickling_a_loader_or_restoring_a_foreign_state_says_what_to_do(tmp_path):
    import copy
    import pickle

    loader = ImageLoader(_pngs(tmp_path / "imgs", 8), batch_size=4, size=16, num_workers=2)
    for attempt in (pickle.dumps, copy.deepcopy):
        with pytest.raises(TypeError, match="cannot be pickled or copied .* build one in each process"):
            attempt(loader)
    with pytest.raises(ValueError, match="not a loader state .* it lacks epoch, step, seed"):
        loader.load_state_dict({"foo": 1})


def test_a_prepared_set_whose_images_all_moved_says_to_prepare_again(tmp_path):
    """Every image missing said only "nothing to load": it now names the first file and why, and that the
    prepared rows name the images where they were."""
    from mmfast import MultimodalLoader

    d = _prepared(tmp_path, n=40)
    images = Path(_rows(d)[0]["image"]).parent
    os.rename(images, images.with_name("moved"))
    with pytest.raises(ValueError, match=r"every image is missing or undecodable \(40 of them; the first, ") as e:
        next(iter(MultimodalLoader(d, "train", batch_size=8, size=16)))
    assert "missing file" in str(e.value) and "if they moved, prepare it again" in str(e.value)


@pytest.mark.parametrize("slow_stat_s", [1.0, 0.0], ids=["local: in turn", "network: threads"])
def test_many_files_are_stat_ed_alike_in_turn_or_on_threads(tmp_path, monkeypatch, slow_stat_s):
    """``stat_files`` over more paths than its probe: the rows are each path's (size, mtime_ns), in order, and
    (-1, -1) for a missing path or a folder, whether the probe judged the file system local or a network's."""
    from mmfast.loading import file_health

    monkeypatch.setattr(file_health, "_STAT_THREADS_FROM", 8)
    monkeypatch.setattr(file_health, "_STAT_PROBE", 4)
    monkeypatch.setattr(file_health, "_STAT_SLOW_S", slow_stat_s)  # 0: every probe counts as slow
    pools = []
    monkeypatch.setattr(file_health, "ThreadPoolExecutor", lambda n: pools.append(n) or ThreadPoolExecutor(n))
    paths = []
    for i in range(40):
        path = tmp_path / f"{i}.jpg"
        path.write_bytes(b"x" * i)
        paths.append(str(path))
    paths[5], paths[30] = str(tmp_path / "gone.jpg"), str(tmp_path)
    rows = file_health.stat_files(paths)
    want = [(os.stat(p).st_size, os.stat(p).st_mtime_ns) if os.path.isfile(p) else (-1, -1) for p in paths]
    assert rows.tolist() == [list(w) for w in want] and rows[7, 0] == 7
    assert pools == ([16] if slow_stat_s == 0.0 else [])  # threads for a slow file system only
