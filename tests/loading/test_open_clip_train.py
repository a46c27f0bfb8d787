"""open_clip's own trainer (``open_clip_train.main``) on mmfast's loader: a tiny CLIP trains one epoch on real
captioned photos from its CSV tables, the loss goes down, and every pair it is handed is right (each caption
its row's tokens, each picture that row's file through the trainer's own preprocess, within 2 levels), with a
broken picture and one over the pixel budget in the table. open-clip-torch is a test dependency only."""

from __future__ import annotations

import csv
import functools
import json
import logging
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

open_clip = pytest.importorskip("open_clip")
trainer = pytest.importorskip("open_clip_train.main")

from mmfast.loading import open_clip_data  # noqa: E402

SIZE = 32
STD = torch.tensor(open_clip.OPENAI_DATASET_STD).view(3, 1, 1) * 255  # a unit of the batches, in levels
TINY = {  # a tiny CLIP: open_clip's architectures are data, this one written by the test
    "embed_dim": 32,
    "vision_cfg": {"image_size": SIZE, "layers": 2, "width": 64, "patch_size": 8},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 64, "heads": 4, "layers": 2},
}


class Recorder:
    """A CaptionLoader seen through: every batch the trainer takes, kept (the loader's own attributes pass)."""

    def __init__(self, loader):
        self.loader, self.batches = loader, []

    def __getattr__(self, name):
        return getattr(self.loader, name)

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        for batch in self.loader:
            self.batches.append((batch.images.clone(), batch.texts.clone(), batch.ids.clone()))
            yield batch


@pytest.fixture(scope="module")
def tables(tmp_path_factory) -> dict:
    """train.csv (70 photos, a broken file, one over the budget: 72 rows, 9 batches of 8, all read) and val.csv
    (16 photos), open_clip's columns and tab separator; rows by id."""
    from tools.benchmarks.benchlib.data import photo_manifest

    root = tmp_path_factory.mktemp("tables")
    manifest = photo_manifest(root, n=86, width=64, height=48, seed=7)
    rows = [json.loads(line) for line in manifest.read_text().splitlines()]
    rows = [{"filepath": str(manifest.parent / r["image"]), "title": r["text"]} for r in rows]
    (root / "broken.jpg").write_bytes(Path(rows[0]["filepath"]).read_bytes()[:300])
    Image.new("RGB", (600, 500), (30, 90, 200)).save(root / "huge.png")
    train = rows[:70]
    train.insert(5, {"filepath": str(root / "broken.jpg"), "title": "a photo cut short"})
    train.insert(40, {"filepath": str(root / "huge.png"), "title": "a picture too large to decode"})
    out = {"train": train, "val": rows[70:], "bad": {5, 40}}
    for split in ("train", "val"):
        with open(root / f"{split}.csv", "w", newline="") as f:
            w = csv.DictWriter(f, ["filepath", "title"], delimiter="\t")
            w.writeheader()
            w.writerows(out[split])
        out[f"{split}_csv"] = str(root / f"{split}.csv")
    return out


@pytest.mark.slow
def test_open_clip_train_trains_one_epoch_on_mmfasts_loader_with_every_pair_right(tables, tmp_path, monkeypatch):
    config = tmp_path / "mmfast-tiny.json"
    config.write_text(json.dumps(TINY))
    open_clip.add_model_config(config)
    recorded, mmfasts = {}, open_clip_data.get_data

    def get_data(args, preprocess_fns, epoch=0, tokenizer=None):  # mmfast's, each loader seen through
        data = mmfasts(args, preprocess_fns, epoch, tokenizer, max_pixels=100_000)
        for split in ("train", "val"):
            recorded[split] = data[split].dataloader = Recorder(data[split].dataloader)
        recorded["preprocess"], recorded["tokenizer"] = preprocess_fns, tokenizer
        return data

    monkeypatch.setattr(open_clip_data, "get_data", get_data)
    handlers = list(logging.getLogger().handlers)
    try:  # python -m mmfast.loading.open_clip_data FLAGS: the stock trainer, its get_data mmfast's
        open_clip_data.main([
            "--model", "mmfast-tiny", "--train-data", tables["train_csv"], "--val-data", tables["val_csv"],
            "--batch-size", "8", "--epochs", "1", "--workers", "2", "--lr", "2e-3", "--warmup", "0",
            "--precision", "fp32", "--logs", str(tmp_path / "logs"), "--name", "run",
            "--log-every-n-steps", "1", "--seed", "0", "--save-frequency", "0",
            "--aug-cfg", "scale=(1.0,1.0)",  # whole pictures: each is compared with its file's pixels
        ])  # fmt: skip
    finally:
        for h in set(logging.getLogger().handlers) - set(handlers):  # the trainer's log handlers
            logging.getLogger().removeHandler(h)
            h.close()
    log = (tmp_path / "logs" / "run" / "out.log").read_text()
    losses = [float(x) for x in re.findall(r"Contrastive_loss: ([\d.]+) \(", log)]
    assert len(losses) == 9, log[-2000:]  # 72 rows, 2 skipped and their places filled: 9 steps
    assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.1, losses
    assert re.search(r"Eval Epoch: 1 .*clip_val_loss: [\d.]+.*num_samples: 16", log)
    assert trainer.get_data.__module__ == "open_clip_train.data"  # the trainer's own again

    train, val = recorded["train"], recorded["val"]
    (train_tf, val_tf), tokenizer = recorded["preprocess"], recorded["tokenizer"]
    assert [len(ids) for _, _, ids in train.batches] == [8] * 9
    every = torch.cat([ids for _, _, ids in train.batches]).tolist()
    assert set(every) == set(range(72)) - tables["bad"]  # each good row read, 2 of them twice to fill the holes
    assert sorted(s["id"] for s in train.loader.skipped) == sorted(tables["bad"])
    for split, tf, rows in (("train", whole_picture(train_tf), tables["train"]), ("val", val_tf, tables["val"])):
        for images, texts, ids in recorded[split].batches:
            assert not set(ids.tolist()) & (tables["bad"] if split == "train" else set())
            assert torch.equal(texts, tokenizer([rows[i]["title"] for i in ids.tolist()]))
            for image, i in zip(images, ids.tolist(), strict=True):  # within 2 levels of 255
                levels = ((image - reference(rows[i]["filepath"], tf)) * STD).abs()
                assert levels.max() <= 2.0, (split, rows[i]["filepath"], float(levels.max()))
    assert sorted(torch.cat([ids for _, _, ids in val.batches]).tolist()) == list(range(16))


@functools.cache
def reference(path: str, transform) -> torch.Tensor:
    """What ``transform`` makes of the file."""
    return transform(Image.open(path))


def whole_picture(train_transform):
    """The trainer's train preprocess under ``--aug-cfg scale=(1.0,1.0)``: its crop is the whole picture
    (whose aspect, 4:3, is within the crop's ratios), resized to S x S."""
    from torchvision import transforms as T

    resize = T.Resize((SIZE, SIZE), interpolation=T.InterpolationMode.BICUBIC)
    return T.Compose([resize, *train_transform.transforms[1:]])


def _tiny_trainer(tmp_path: Path, table: str, name: str, *flags: str) -> int:
    """open_clip_data.main on the tiny model for one epoch of ``table``; the trainer's log handlers, which write
    to this test's captured stderr, are removed after it, not left for the next tests."""
    config = tmp_path / "mmfast-tiny.json"
    config.write_text(json.dumps(TINY))
    open_clip.add_model_config(config)
    handlers = list(logging.getLogger().handlers)
    try:
        return open_clip_data.main([
            "--model", "mmfast-tiny", "--train-data", table, "--batch-size", "8", "--epochs", "1",
            "--workers", "1", "--precision", "fp32", "--logs", str(tmp_path / "logs"), "--name", name, *flags,
        ])  # fmt: skip
    finally:
        for h in set(logging.getLogger().handlers) - set(handlers):
            logging.getLogger().removeHandler(h)
            h.close()


def test_an_aug_cfg_the_loader_cannot_draw_is_one_line_naming_the_step_and_the_flag(tables, tmp_path, capsys):
    """open_clip's colour jitter (--aug-cfg color_jitter_prob) is not drawn by the pipeline: the run ends with
    one error line naming open_clip's step and the flag that adds it, not a traceback with an object's repr."""
    code = _tiny_trainer(tmp_path, tables["train_csv"], "jitter", "--aug-cfg", "color_jitter_prob=0.5",
                         "color_jitter=(0.4,0.4,0.4,0.1)")  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and trainer.get_data.__module__ == "open_clip_train.data"
    line = next(ln for ln in err.splitlines() if ln.startswith("error: "))
    assert "open_clip.transform.color_jitter (open_clip's preprocess)" in line and " object at 0x" not in line
    assert "drop the --aug-cfg entries that add it (color_jitter_prob" in line and "Traceback" not in err


def test_a_table_whose_paths_start_from_its_folder_is_one_line_saying_to_cd_there(
    tables, tmp_path, capsys, monkeypatch
):
    """Run from elsewhere, a table whose relative paths name the files beside it is refused before training,
    in one line that says where to run from: the command has no root= to pass."""
    first = Path(tables["val"][0]["filepath"])
    beside = first.parent / "beside.csv"
    beside.write_text(
        "filepath\ttitle\n" + "".join(f"{Path(r['filepath']).name}\t{r['title']}\n" for r in tables["val"])
    )
    monkeypatch.chdir(tmp_path)
    code = _tiny_trainer(tmp_path, str(beside), "elsewhere")
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert f"run from {first.parent} (cd there first" in next(
        ln for ln in err.splitlines() if ln.startswith("error: ")
    )


def test_open_clip_resize_modes_the_loader_does_not_do_are_named_as_such():
    """open_clip's 'longest' resize is not an augmentation: its refusal says which resize mode, not --aug-cfg."""
    from mmfast.loading.transforms import UnsupportedTransform, options_from_transform

    with pytest.raises(UnsupportedTransform, match="resize_mode 'longest'") as refused:
        options_from_transform(open_clip.transform.image_transform(32, False, resize_mode="longest"))
    assert "augmentation" not in refused.value.why and "ResizeKeepRatio" in refused.value.step
