"""Images decoded once and kept in memory (``cache_decoded``): the same pixels as the streaming path, exact
resume, bad files and a budget that does not fit (the crops' draws: tests/loading/test_draws.py)."""

from __future__ import annotations

import json
import logging
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from mmfast.data.dataset import PreparedDataset
from mmfast.loading.decoded import available_memory
from mmfast.loading.image_loader import ImageLoader
from mmfast.loading.multimodal import MultimodalLoader


def _whole_image_copies(photos: list[Path], tmp_path: Path) -> list[str]:
    """4:3 copies of each photo at three sizes, so scale (1, 1) and ratio 4/3 pin every crop to the image."""
    files = []
    for k in range(3):
        for p in photos:
            files.append(str(tmp_path / f"{k}_{p.stem}.jpg"))
            Image.open(p).convert("RGB").resize((160 + 40 * k, 120 + 30 * k)).save(files[-1], quality=95)
    return files


def _record_passing(loader) -> list[int]:
    """After each image the loader's cache decodes: how many it holds for their batch only (past the budget)."""
    cache, sizes = loader.decoded_images, []
    keep = cache._keep
    cache._keep = lambda p, image: keep(p, image) or sizes.append(len(cache._passing))
    return sizes


def _batches(loader) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(b.ids.clone(), b.images.clone()) for b in loader]


def test_cached_pixels_are_the_streamed_ones_in_train_and_eval(photos, tmp_path):
    """Where no random draw differs (the crop pinned to the whole image, no flip; the eval path), the cached
    loader must give exactly the streaming loader's tensors: the same decoder, the same finishing."""
    files = _whole_image_copies(photos, tmp_path)
    common = {"batch_size": 5, "size": 40, "fp16": False}
    train = {"shuffle": True, "scale": (1.0, 1.0), "ratio": (4 / 3, 4 / 3), "flip": False}
    for options in (train, {"shuffle": False}):
        streamed = _batches(ImageLoader(files, **common, **options, cache_decoded=False))
        cached = _batches(ImageLoader(files, **common, **options, cache_decoded=True))
        assert len(cached) == len(streamed) == math.ceil(len(files) / 5)
        for (ids, images), (ref_ids, ref_images) in zip(cached, streamed, strict=True):
            assert torch.equal(ids, ref_ids)
            assert torch.equal(images, ref_images), (options, (images - ref_images).abs().max())


def test_a_cached_loader_serves_whole_batches_of_any_size(photos, tmp_path):
    """A batch DALI would run in parts (40 = 2 x 20) comes whole from memory."""
    files = _whole_image_copies(photos, tmp_path) * 3
    loader = ImageLoader(files, batch_size=40, size=16, cache_decoded=True)
    assert loader.dali_part(np.arange(len(files))) == 20
    assert [len(b.ids) for b in loader] == [40, len(files) - 40]


def test_cached_resume_yields_exactly_the_rest_and_epochs_draw_anew(prepared):
    def loader():
        return MultimodalLoader(prepared, "train", batch_size=16, size=32, cache_decoded=True)

    full = loader()
    full.set_epoch(2)
    reference = [(b["id"].clone(), b["image"].clone()) for b in full]
    part = loader()
    part.set_epoch(2)
    for i, _ in enumerate(part):
        if i == 3:
            state = json.loads(json.dumps(part.state_dict()))
            break
    resumed = loader()
    resumed.load_state_dict(state)
    resumed.set_epoch(2)
    rest = [(b["id"], b["image"]) for b in resumed]
    assert len(rest) == len(reference) - 4
    for (ref_ids, ref_img), (ids, img) in zip(reference[4:], rest, strict=True):
        assert torch.equal(ref_ids, ids) and torch.equal(ref_img, img)
    # later epochs crop each image anew and never decode one twice
    by_id = {int(i): img for ids, imgs in reference for i, img in zip(ids, imgs, strict=True)}
    again = {}
    for _ in range(3):
        again |= {int(i): img for b in full for i, img in zip(b["id"], b["image"], strict=True)}
    cache = full.images.decoded_images
    assert cache.decoded == sum(i is not None for i in cache.images) >= len(by_id)
    assert sum(not torch.equal(by_id[i], again[i]) for i in by_id) > 0.9 * len(by_id)


def test_a_bad_file_is_skipped_or_named_as_on_the_streaming_path(photos, tmp_path):
    files = _whole_image_copies(photos, tmp_path)
    Path(files[4]).write_text("this is not an image\n")
    loader = ImageLoader(files, batch_size=4, size=32, cache_decoded=True)
    seen = [i for b in loader for i, m in zip(b.ids.tolist(), b.mask.tolist(), strict=True) if m]
    assert sorted(seen) == [i for i in range(len(files)) if i != 4]
    assert [s["image"] for s in loader.skipped] == [files[4]]
    strict = ImageLoader(files, batch_size=4, size=32, cache_decoded=True, on_bad_image="error")
    with pytest.raises(ValueError, match=Path(files[4]).name) as error:
        list(strict)
    assert "mmfast-prepare" not in str(error.value)  # these files were never prepared: no command to re-run


def test_a_set_over_the_budget_is_streamed_with_a_warning(prepared, caplog):
    rows = PreparedDataset(prepared, verify=False).rows("train")
    with caplog.at_level(logging.WARNING):
        small = MultimodalLoader(prepared, "train", batch_size=16, size=32, cache_decoded=1 << 20)
        passing = _record_passing(small.images)  # past the budget, images are decoded for their batch only
        ids = [b["id"].tolist() for b in small]
    assert "streaming them instead" in caplog.text
    finisher = small.images.finisher
    assert small.images.decoded_images is None and finisher.threads == finisher.streaming_threads
    assert 0 < max(passing) <= 3 * 16  # a batch's images and the DALI batches ahead, not the rest of the set
    streamed = MultimodalLoader(prepared, "train", batch_size=16, size=32)
    assert ids == [b["id"].tolist() for b in streamed] and len(ids) == len(rows) // 16
    assert [b["id"].tolist() for b in small] == [b["id"].tolist() for b in streamed]  # the next epoch streams


def test_the_run_summary_says_how_each_split_was_served(prepared, tmp_path):
    from conftest import SMALL_RUN

    from tools import train as train_tool

    for flags, expected in (
        (["--epochs", "2"], r"train decoded once, \d+ MiB in memory; val decoded once, \d+ MiB in memory"),
        (
            ["--epochs", "2", "--color-jitter", "0.2"],
            r"train streamed \(--color-jitter is applied while streaming\); val decoded once",
        ),
        (["--epochs", "1"], r"train streamed \(one epoch reads each image once\); val decoded once"),
        (
            ["--epochs", "1", "--no-cache-decoded"],
            r"train streamed \(--no-cache-decoded\); val streamed \(--no-cache-decoded\)",
        ),
    ):
        out = tmp_path / str(len(flags)) / flags[-1]
        # the plan follows --epochs, not how many steps run: two steps and the evaluation show it
        argv = ["--data", str(prepared), "--out", str(out), *flags, *SMALL_RUN, "--max-steps", "2"]
        assert train_tool.main(argv) == 0
        summary = json.loads((out / "summary.json").read_text())
        assert re.fullmatch(expected + ".*", summary["images"]), summary["images"]


def test_combinations_it_cannot_serve_are_refused_with_the_reason(prepared):
    with pytest.raises(ValueError, match="ColorJitter in the dataset's transform"):
        MultimodalLoader(prepared, "train", batch_size=16, cache_decoded=True, color_jitter=0.2)
    with pytest.raises(ValueError, match="cpu_resize='torch'"):
        MultimodalLoader(prepared, "train", batch_size=16, cache_decoded=True, cpu_resize="dali")
    for value in (0, -5, 1, 1000, 2.5, "yes", "1000"):
        with pytest.raises(ValueError, match="True, False or a budget in bytes of at least 1 MiB"):
            MultimodalLoader(prepared, "train", batch_size=16, cache_decoded=value)
    # jitter is a train augmentation: an eval loader caches with it
    assert MultimodalLoader(prepared, "val", batch_size=16, cache_decoded=True, color_jitter=0.2).holds_decoded


def test_training_with_cache_decoded_decodes_each_image_once(prepared, tmp_path, caplog):
    """``--cache-decoded``: three epochs train and evaluate, and no image of either split is decoded twice."""
    import re

    from conftest import SMALL_RUN

    from tools import train as train_tool

    out = tmp_path / "run"
    with caplog.at_level(logging.INFO, logger="mmfast.loading.decoded"):
        code = train_tool.main(
            ["--data", str(prepared), "--out", str(out), "--epochs", "3", "--cache-decoded", *SMALL_RUN]
        )
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["val_acc"] is not None and (out / "model").is_dir()
    decoded = [int(n) for n in re.findall(r"decoding (\d+) images once", caplog.text)]
    rows = sum(len(PreparedDataset(prepared, verify=False).rows(s)) for s in ("train", "val"))
    assert decoded and sum(decoded) <= rows


def test_training_holds_the_splits_that_fit_in_the_budget_and_streams_the_rest(prepared, monkeypatch):
    """The engine's plan (``--cache-decoded``, on by default): train first, then val, while their decoded
    sizes (3 x width x height of every row, as preparation recorded them) fit together in the budget."""
    from types import SimpleNamespace

    from mmfast.train import data
    from mmfast.train.flags import parse_config

    dataset = PreparedDataset(prepared)
    sizes = {s: sum(3 * r["width"] * r["height"] for r in dataset.rows(s)) for s in ("train", "val")}
    assert dataset.decoded_bytes("train", sizes["train"]) == sizes["train"]
    assert dataset.decoded_bytes("train", sizes["train"] - 1) is None
    cpu = SimpleNamespace(device=torch.device("cpu"), num_processes=1)

    def plan(budget, *flags, accelerator=cpu):
        cfg = parse_config(["--data", str(prepared), *flags])
        plans = data.cache_plans(cfg, accelerator, dataset, True, budget=budget)
        assert set(plans) == {"train", "val"}
        return {split: plan.budget for split, plan in plans.items() if plan.cache}

    both = sizes["train"] + sizes["val"]
    assert plan(both) == {"train": both, "val": sizes["val"]}
    assert plan(both - 1) == {"train": both - 1}
    assert plan(sizes["train"] - 1) == {"val": sizes["train"] - 1}  # train does not fit, val does
    assert plan(sizes["val"] - 1) == {}
    assert plan(both, "--color-jitter", "0.2") == {"val": both}  # jitter is DALI's: the train split streams
    assert plan(both, "--no-cache-decoded") == plan(both, "--cpu-resize", "dali") == {}
    assert plan(2 * both, accelerator=SimpleNamespace(device=torch.device("cpu"), num_processes=2)) == {
        "train": both,
        "val": sizes["val"],
    }  # two processes on the machine: each gets half


_FILL_SCRIPT = """
import sys
from mmfast.loading.image_loader import ImageLoader
files = sys.argv[1:]
loader = ImageLoader(files, batch_size=40, size=16, cache_decoded=True)
seen = [i for b in loader for i, m in zip(b.ids.tolist(), b.mask.tolist()) if m]
print(len(seen), [s["image"] for s in loader.skipped])
"""


@pytest.mark.slow
def test_filling_past_a_file_dali_cannot_parse_raises_inside_dali_instead_of_crashing(photos, tmp_path):
    """DALI 2.4 parses a batch of 32 or more on several threads, and a file it cannot parse there crashed the
    process (SIGSEGV) about every other run instead of raising; the fill decodes in batches under 32. Three
    fresh processes over 40 images, one a text file: each must finish, with that file skipped."""
    from conftest import first_lines_of_fresh_runs, small_jpegs

    files = small_jpegs(photos, tmp_path, 40)
    bad = tmp_path / "not_a.jpg"
    bad.write_text("<html>404 not found</html>\n")
    files[2] = str(bad)
    assert first_lines_of_fresh_runs(_FILL_SCRIPT, files) == [f"39 ['{bad}']"] * 3


def test_the_planned_size_of_a_max_side_set_is_its_copies(demo_manifest, tmp_path):
    """Rows of a --max-side directory record the original's size; the plan must count the smaller copies
    the loader decodes (the 64 px demo images stored at 32 px take a quarter), not the originals."""
    from mmfast.prepare.core import PrepareConfig, prepare_dataset

    out = tmp_path / "small"
    prepare_dataset(PrepareConfig(source=str(demo_manifest), out=str(out), max_side=32, progress=False))
    dataset = PreparedDataset(out)
    planned = dataset.decoded_bytes("val", 1 << 40)
    loader = MultimodalLoader(dataset, "val", batch_size=8, size=16, cache_decoded=True)
    list(loader)
    held = loader.images.decoded_images.nbytes
    assert held <= planned <= 1.1 * held, (planned, held)
    assert planned < 0.3 * sum(3 * r["width"] * r["height"] for r in dataset.rows("val"))


def test_auto_holds_what_pays_and_fits_and_streams_the_rest(tmp_path, monkeypatch, caplog):
    """``cache_decoded="auto"`` (ImageLoader's default) holds small PNGs and eval images, streams the train
    crops of JPEGs over 4x the output's pixels (their streamed decode reads only the crop), and a set over its
    budget (half the memory available, shared by LOCAL_WORLD_SIZE processes); where it cannot serve, it
    streams instead of raising."""
    from conftest import save_image

    import mmfast.loading.cache_plan as plan_module

    pngs = [str(save_image(tmp_path / "png" / f"{i}.png", size=(50, 40), seed=i)) for i in range(6)]
    jpegs = [str(save_image(tmp_path / "jpg" / f"{i}.jpg", size=(50, 40), seed=i)) for i in range(6)]
    kw = {"batch_size": 4, "size": 16}
    png_train = ImageLoader(pngs, shuffle=True, **kw)
    assert png_train.holds_decoded
    assert sorted(i for _ in range(2) for b in png_train for i in b.ids.tolist()) == sorted(list(range(6)) * 2)
    assert png_train.cached_bytes == 6 * 50 * 40 * 3
    assert not ImageLoader(jpegs, shuffle=True, **kw).holds_decoded  # 2,000 px > 4 x 16 x 16
    assert ImageLoader(jpegs, shuffle=False, **kw).holds_decoded  # eval decodes whole images anyway
    assert ImageLoader(jpegs, shuffle=True, batch_size=4, size=32).holds_decoded  # 2,000 px < 4 x 32 x 32
    assert not ImageLoader(pngs, shuffle=True, color_jitter=0.2, **kw).holds_decoded
    assert not ImageLoader(pngs, shuffle=True, cpu_resize="dali", **kw).holds_decoded

    import mmfast.loading.decoded as decoded_module

    for module in (plan_module, decoded_module):
        monkeypatch.setattr(module, "default_budget", lambda: 8 << 20)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    shared = ImageLoader(pngs, shuffle=True, **kw)
    assert shared.decoded_images.budget is None  # taken when the fill starts, from what is available then
    list(shared)
    assert shared.decoded_images.budget == 2 << 20
    monkeypatch.setattr(plan_module, "default_budget", lambda: 4 * 6 * 50 * 40 * 3)  # a quarter each: 36,000 B
    with caplog.at_level(logging.INFO, logger="mmfast.loading.cache_plan"):
        over = ImageLoader(pngs, shuffle=True, **kw)
    assert not over.holds_decoded and "over the 0 MiB budget" in caplog.text
    assert len([i for b in over for i in b.ids.tolist()]) == 6  # streamed


def test_the_first_batch_comes_before_the_whole_set_is_decoded(tmp_path):
    """The fill decodes as the batches need them (and DALI's prefetch ahead), not the whole epoch first."""
    from conftest import save_image

    files = [str(save_image(tmp_path / f"{i}.png", size=(30, 20), seed=i)) for i in range(96)]
    loader = ImageLoader(files, batch_size=4, size=16, shuffle=True, cache_decoded=True)
    it = iter(loader)
    first = next(it)
    assert len(first.ids) == 4 and loader.decoded_images.decoded <= 3 * 16  # a DALI batch, and two ahead at most
    rest = [i for b in it for i in b.ids.tolist()]
    assert sorted(first.ids.tolist() + rest) == list(range(96)) and loader.decoded_images.decoded == 96


def test_a_bad_first_file_is_stood_in_for_without_decoding_ahead(tmp_path):
    """The first file stands in for padding and bad files; found bad, the next one takes its place at once:
    the fill neither decodes the whole epoch first nor, past a small budget, holds it for the batch."""
    from conftest import save_image

    files = [str(save_image(tmp_path / f"{i}.png", size=(30, 20), seed=i)) for i in range(200)]
    Path(files[0]).write_text("<html>not an image</html>\n")
    for budget in (None, 1 << 20):
        loader = ImageLoader(files, batch_size=4, size=16, shuffle=True, cache_decoded=budget or True)
        if budget:
            loader.decoded_images.budget = 5 * 30 * 20 * 3  # five images held, the rest for their batch only
        passing = _record_passing(loader)
        it = iter(loader)
        first = next(it)
        assert loader.decoded_images.decoded <= 4 * 16, loader.decoded_images.decoded
        assert len(list(it)) == 49
        assert bool(budget) == bool(passing[-1]) and max(passing) <= 4 * 16
        assert [s["image"] for s in loader.skipped] == [files[0]] and len(first.ids) == 4


def test_a_batch_that_failed_comes_again(tmp_path):
    """A bad file with on_bad_image="error" fails its batch; once the file is fixed, iterating again serves
    the whole epoch, that batch included."""
    from conftest import save_image

    files = [str(save_image(tmp_path / f"{i}.png", size=(30, 20), seed=i)) for i in range(24)]
    Path(files[6]).write_text("not an image\n")
    loader = ImageLoader(files, batch_size=4, size=16, cache_decoded=True, on_bad_image="error")
    with pytest.raises(ValueError, match=Path(files[6]).name):
        list(loader)
    save_image(Path(files[6]), size=(30, 20), seed=6)
    loader.health.bad.clear()  # the user fixed it
    assert [i for b in loader for i in b.ids.tolist()] == list(range(24))


def _cgroup(folder: Path, limit: str, usage: int, v2: bool = True) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    names = ("memory.max", "memory.current") if v2 else ("memory.limit_in_bytes", "memory.usage_in_bytes")
    (folder / names[0]).write_text(limit + "\n")
    (folder / names[1]).write_text(f"{usage}\n")


def test_the_budget_reads_the_process_own_cgroups_not_only_the_root(tmp_path):
    """A Slurm job or a systemd unit limits the process's own cgroup, deep in the tree: under a 3 GiB job limit
    the budget planned 11,620 MiB from the root's (unlimited) files. Every cgroup over the process counts."""
    root, proc = tmp_path / "cgroup", tmp_path / "proc"
    proc.mkdir()
    (proc / "meminfo").write_text("MemTotal:       24000000 kB\nMemAvailable:   20000000 kB\n")
    job = root / "system.slice" / "slurmstepd.scope" / "job_42"
    _cgroup(root, "max", 5 << 30)
    _cgroup(job.parent, str(16 << 30), 4 << 30)  # the step: 12 GiB left
    _cgroup(job, str(3 << 30), 1 << 30)  # the job: 2 GiB left
    (proc / "cgroup").write_text("0::/system.slice/slurmstepd.scope/job_42\n")
    assert available_memory(str(root), str(proc)) == 2 << 30
    _cgroup(job.parent, str(2 << 30), 1 << 30)  # a parent's tighter limit binds its children too
    assert available_memory(str(root), str(proc)) == 1 << 30
    # cgroup v1: the memory controller's own hierarchy
    v1 = tmp_path / "v1"
    _cgroup(v1 / "memory" / "slurm" / "uid_0" / "job_7", str(5 << 30), 2 << 30, v2=False)
    (proc / "cgroup").write_text("5:cpu,cpuacct:/slurm/uid_0/job_7\n4:memory:/slurm/uid_0/job_7\n0::/\n")
    assert available_memory(str(v1), str(proc)) == 3 << 30
    (proc / "cgroup").write_text("0::/\n")  # no limit anywhere: MemAvailable
    assert available_memory(str(tmp_path / "none"), str(proc)) == 20000000 * 1024


def test_the_budget_respects_the_address_space_limit():
    """``ulimit -v``: the training cache filled past it and the run died in backward; the budget is now what
    the limit leaves over what the process maps already."""
    script = (
        "import resource\nfrom mmfast.loading.decoded import available_memory\n"
        "vm = next(int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('VmSize:'))\n"
        "resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), resource.RLIM_INFINITY))\n"
        "print(available_memory())\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert (1 << 30) - (64 << 20) < int(out.stdout) <= 1 << 30
