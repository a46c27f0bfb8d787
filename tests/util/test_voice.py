"""Messages shared by a command and the Python API name a setting as its caller set it (mmfast/util/voice.py):
the flag to a command-line user, the argument to a Python caller. Both sides of the pixel budget and of
on_bad_image, the flag each command has, and worker processes that keep their caller's words."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
from conftest import SMALL_RUN
from PIL import Image

import tools.predict as predict_tool
from mmfast import ImageLoader
from mmfast.prepare.core import PrepareConfig, prepare_dataset
from mmfast.prepare.demo import demo_dataset
from mmfast.util.args import Parser


def _pngs(folder: Path, n: int, side: int = 24) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    files = []
    for k in range(n):
        files.append(str(folder / f"{k:03d}.png"))
        Image.fromarray(np.random.default_rng(k).integers(0, 256, (side, side, 3), dtype=np.uint8)).save(files[-1])
    return files


def test_a_setting_is_the_running_commands_flag_or_the_callers_argument():
    from mmfast.util.voice import command_line, setting

    def named(flags: list[str]):
        @command_line
        def main(argv):
            parser = Parser()
            for flag in flags:
                parser.add_argument(flag)
            parser.parse_args(argv)
            return [
                setting("max_pixels"),
                setting("num_workers", "--num-threads", "--num-workers"),
                setting("cpu_resize", value="dali"),
                setting("cache_decoded", "--no-cache-decoded", value=False),
            ]

        return main([])

    python = ["max_pixels=", "num_workers=", "cpu_resize='dali'", "cache_decoded=False"]
    assert named(["--num-threads"]) == ["--max-pixels", "--num-threads", "--cpu-resize dali", "--no-cache-decoded"]
    assert named(["--num-workers"])[1] == "--num-workers"  # the flag this command has
    assert named([])[1] == "--num-threads"  # none of them: the first
    # outside a command, and after one returned (or raised), a Python caller's words
    assert [setting(a) for a in ("max_pixels", "num_workers")] == python[:2]
    assert setting("cpu_resize", value="dali") == python[2] and setting("cache_decoded", value=False) == python[3]

    @command_line
    def fails(argv):
        raise RuntimeError(setting("max_pixels"))

    with pytest.raises(RuntimeError, match="--max-pixels"):
        fails(None)
    assert setting("max_pixels") == "max_pixels="


def test_the_pixel_budget_is_max_pixels_to_the_drop_in_and_the_flag_to_mmfast_predict(
    prepared, tmp_path, caplog, capsys
):
    files = _pngs(tmp_path / "small", 3)
    big = Image.new("1", (9400, 9400))  # 88 MP declared, 11 KB on disk
    big.save(tmp_path / "big.png")
    files[1] = str(tmp_path / "big.png")
    with caplog.at_level(logging.WARNING):
        loader = ImageLoader(files, batch_size=3, size=16, max_pixels=1_000_000)
        assert [b.ids.tolist() for b in loader] == [[0, -1, 2]]
    reason = "image is 9400x9400 = 88.4 MP, over the 1 MP budget (max_pixels=); downscale it"
    assert [(s["image"], s["reason"]) for s in loader.skipped] == [(files[1], reason)]
    assert "(max_pixels=)" in caplog.text and "--max-pixels" not in caplog.text
    # the same image to mmfast-predict: its flag (the model's budget is 64 MP)
    model = _model_dir(prepared, tmp_path)
    assert predict_tool.main(["--model", str(model), "--image", files[1]]) == 2
    err = capsys.readouterr().err
    assert "over the 64 MP budget (--max-pixels); downscale it" in err and "max_pixels=" not in err


def _model_dir(prepared: Path, tmp_path: Path) -> Path:
    """An untrained model directory with the prepared set's tokenizer."""
    import torch
    from test_model_out import _config

    from mmfast.infer.model_dir import MmfastModel, save_model_dir

    torch.manual_seed(0)
    net = MmfastModel(_config(prepared))
    return save_model_dir(tmp_path / "model", net.model.state_dict(), net.config, prepared / "tokenizer")


def _prepared(tmp_path: Path, n: int) -> Path:
    """A prepared demo set of ``n`` samples, all train, whose images the test may damage."""
    manifest = demo_dataset(n=n, seed=4, root=tmp_path / "demo")
    out = tmp_path / "prepared"
    prepare_dataset(
        PrepareConfig(source=str(manifest), out=str(out), max_length=32, val_fraction=0.0, progress=False)
    )
    return out


def test_on_bad_image_is_the_argument_to_the_drop_in_and_the_flag_to_mmfast_train(tmp_path, capsys):
    from tools import train as train_tool

    files = _pngs(tmp_path / "pngs", 4)
    Path(files[2]).write_bytes(b"this is not a png\n")
    with pytest.raises(ValueError, match=r"Fix or remove it, or pass on_bad_image='skip'$"):
        list(ImageLoader(files, batch_size=2, size=16, on_bad_image="error"))
    prepared = _prepared(tmp_path, 48)
    rows = [json.loads(line) for line in (prepared / "train.jsonl").read_text().splitlines()]
    Path(rows[5]["image"]).write_bytes(b"this is not a png\n")
    argv = ["--data", str(prepared), "--out", str(tmp_path / "run"), "--epochs", "1", "--on-bad-image", "error"]
    assert train_tool.main([*argv, *SMALL_RUN]) == 2
    err = capsys.readouterr().err
    assert f"{rows[5]['image']}: " in err and "and re-run mmfast-prepare, or pass --on-bad-image skip" in err
    assert "on_bad_image=" not in err


def test_worker_processes_keep_their_callers_words(tmp_path):
    """validate.check_images decodes in worker processes from 65 files on: their reasons are said as the
    caller would say them."""
    from mmfast.data.validate import check_images
    from mmfast.util.voice import command_line

    files = _pngs(tmp_path, 65, side=16)  # 256 pixels each, over a budget of 100
    python = check_images(files, 2, max_pixels=100)
    flags = command_line(lambda argv: check_images(files, 2, max_pixels=100))(None)
    reason = "image is 16x16 = 0.0 MP, over the 0.0001 MP budget ({}); downscale it"
    assert {c.reason for c in python} == {reason.format("max_pixels=")}
    assert {c.reason for c in flags} == {reason.format("--max-pixels")}
