"""mmfast.LoopProfiler (mmfast/train/loop_profiler.py): the profiler's verdict on a user's own loop over the
drop-in loaders. Its figures add up, its steps are the loop's batches, and the verdict tells an input-bound loop
from a compute-bound one."""

from __future__ import annotations

import json
import time

import pytest
import torch

import mmfast
from mmfast.train.loop_profiler import batch_samples
from mmfast.train.verdict import INPUT_BOUND
from tools import profile_run as profile_tool

WARMUP = 3
MMFAST_TRAIN_FLAGS = ("--num-threads", "--image-size", "--batch-size", "--mixed-precision", "--compile", "--cache")


def _classes(prepared) -> int:
    return len(json.loads((prepared / "labels.json").read_text()))


def _train_rows(prepared) -> tuple[list[str], list[int]]:
    rows = [json.loads(line) for line in (prepared / "train.jsonl").read_text().splitlines() if line]
    return [r["image"] for r in rows], [r["label"] for r in rows]


def _step(model, optimizer, images: torch.Tensor, labels: torch.Tensor) -> None:
    loss = torch.nn.functional.cross_entropy(model(images.float()), labels, ignore_index=-100)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()


def test_the_figures_of_a_real_loop_add_up(prepared, tmp_path, capsys):
    """A small model over MultimodalLoader for an epoch, then 4 batches of the next (a break), with an
    evaluation inside the loop under untimed(): the steps are the batches taken after the warm-up, data wait and
    compute add up to the timed wall, and the evaluation is reported apart, outside it."""
    loader = mmfast.MultimodalLoader(prepared, "train", batch_size=16, size=32, num_workers=1)
    val = mmfast.MultimodalLoader(prepared, "val", batch_size=16, size=32, num_workers=1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten())
    model.append(torch.nn.Linear(8, _classes(prepared)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    profiler = mmfast.LoopProfiler(warmup_steps=WARMUP, interval=0.05)
    sizes = []
    t0 = time.perf_counter()
    with profiler:
        for epoch in range(2):
            for i, batch in enumerate(profiler.iterate(loader)):
                sizes.append(int(batch["id"].shape[0]))
                _step(model, optimizer, batch["image"], batch["label"])
                if epoch == 0 and i == 5:
                    with profiler.untimed("eval"), torch.no_grad():
                        evaluated = sum(int(model(b["image"].float()).shape[0]) for b in val)
                if epoch == 1 and i == 3:
                    break
        measured = time.perf_counter() - t0
    report = profiler.report()
    assert len(sizes) == len(loader) + 4 and evaluated > 0
    assert report["steps"] == len(sizes) - WARMUP and report["samples"] == sum(sizes[WARMUP:])
    phases = report["phase_s"]
    assert set(phases) == {"data", "compute", "eval"} and set(report["phase_frac"]) == {"data", "compute"}
    wall = report["train_wall_s"]
    assert phases["data"] + phases["compute"] == pytest.approx(wall, abs=0.02 + 0.01 * wall)
    # train_wall_s is rounded to the millisecond, data_wait_frac is of the unrounded wall
    assert report["data_wait_frac"] == pytest.approx(phases["data"] / wall, abs=0.0006 / wall)
    # the loop's own clock: the warm-up, the timed steps and the evaluation are all of it
    assert report["warmup"]["seconds"] + wall + phases["eval"] == pytest.approx(measured, abs=0.25)
    assert report["verdict"]["bound"] in ("input", "compute")
    settings = report["settings"]
    assert (settings["batch_size"], settings["image_size"], settings["dali_threads"]) == (16, 32, 1)
    assert settings["decode_device"] == "cpu" and isinstance(settings["cache_decoded"], bool)
    # saved, it is a profile like mmfast-profile's, which prints it again
    saved = profiler.save(tmp_path / "mine")
    assert json.loads((tmp_path / "mine" / "profile.json").read_text())["steps"] == saved["steps"]
    capsys.readouterr()
    assert profile_tool.main(["--run", str(tmp_path / "mine")]) == 0
    assert f"{saved['steps']} steps," in capsys.readouterr().out


def _profile_image_loop(prepared, size: int, workers: int, model: torch.nn.Module, pixels: slice) -> dict:
    files, labels = _train_rows(prepared)
    loader = mmfast.ImageLoader(
        files, labels, batch_size=16, shuffle=True, size=size, num_workers=workers, cache_decoded=False
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    profiler = mmfast.LoopProfiler(warmup_steps=WARMUP, interval=0.05)
    with profiler:
        for images, target in profiler.iterate(loader):
            _step(model, optimizer, images[:, :, pixels, pixels], target)
    report = profiler.report()
    assert report["steps"] == len(loader) - WARMUP  # tuple batches: a step per (images, labels)
    return report


def test_an_input_bound_loop_is_called_so_and_a_compute_bound_one_is_not(prepared):
    """384 px crops decoded on one thread for a model that reads one pixel wait for data nearly all the time;
    32 px crops for three convolutions of 64 to 128 channels do not, by a margin (their wait is a few percent,
    so a busy machine does not tip it). The advice speaks of the loader's arguments, not mmfast-train's flags."""
    torch.manual_seed(0)
    trivial = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3, _classes(prepared)))
    starved = _profile_image_loop(prepared, 384, 1, trivial, slice(0, 1))
    assert starved["verdict"]["bound"] == "input", starved["verdict"]
    assert starved["data_wait_frac"] > INPUT_BOUND
    assert "waits for data" in starved["verdict"]["summary"]
    assert any("num_workers=" in s or "size=" in s for s in starved["verdict"]["next_steps"])
    assert not any(flag in s for s in starved["verdict"]["next_steps"] for flag in MMFAST_TRAIN_FLAGS)
    assert (starved["settings"]["image_size"], starved["settings"]["dali_threads"]) == (384, 1)
    assert starved["settings"]["cache_decoded"] is False
    heavy = torch.nn.Sequential(
        torch.nn.Conv2d(3, 64, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.Conv2d(64, 128, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.Conv2d(128, 128, 3, padding=1),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(128, _classes(prepared)),
    )
    busy = _profile_image_loop(prepared, 32, 2, heavy, slice(None))
    assert busy["verdict"]["bound"] != "input", busy["verdict"]
    assert busy["data_wait_frac"] < INPUT_BOUND
    assert busy["phase_s"]["compute"] > busy["phase_s"]["data"]


def test_untimed_takes_only_the_phases_left_out_of_the_figures():
    with pytest.raises(ValueError, match="eval, checkpoint"):
        mmfast.LoopProfiler().untimed("forward")


def test_no_verdict_without_a_timed_step_and_a_batch_it_cannot_count_is_named():
    """A report before any step raised nothing and called the loop compute-bound; a batch of plain numbers gave
    "object of type 'int' has no len()" from deep inside."""
    profiler = mmfast.LoopProfiler(warmup_steps=0)
    with pytest.raises(RuntimeError, match=r"no step was timed.*profiler.iterate\(loader\)"):
        profiler.report()
    with pytest.raises(TypeError, match=r"batch \(list, its first item of type int\): pass iterate\(loader, samp"):
        for _ in profiler.iterate([[1, 2], [3, 4]]):
            pass
    for _ in profiler.iterate([[1, 2], [3, 4]], samples=len):
        pass
    assert profiler.report()["samples"] == 4
    assert [batch_samples(b) for b in ({"x": [1, 2, 3]}, (torch.zeros(5, 2),))] == [3, 5]


class _SlowImages(torch.utils.data.Dataset):
    """Random 3x16x16 images that take 30 ms each to "read": a loader with no workers waits on them."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int):
        time.sleep(0.03)
        return torch.rand(3, 16, 16), i % 2


def test_the_advice_for_a_torch_dataloader_names_its_own_arguments():
    """A loop over torch's DataLoader gets advice in the DataLoader's words (num_workers=, prefetch_factor=),
    with its worker count, and nothing about DALI threads or a count it does not know."""
    loader = torch.utils.data.DataLoader(_SlowImages(), batch_size=4, num_workers=0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 16 * 16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    profiler = mmfast.LoopProfiler(warmup_steps=2)
    with profiler:
        for images, labels in profiler.iterate(loader):
            _step(model, optimizer, images, labels)
    verdict = profiler.report()["verdict"]
    assert verdict["bound"] == "input", verdict
    advice = " ".join(verdict["next_steps"])
    assert "num_workers=), now 0" in advice and "prefetch_factor=" in advice, advice
    assert "DALI threads (" not in advice and "?" not in advice, advice
