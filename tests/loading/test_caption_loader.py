"""CaptionLoader: captioned pictures for a CLIP trainer, (images, texts) joined by row id. Any tokenizer's own
rows, the trainer's preprocess (bicubic included) with its pixels, no placeholder in a batch, the finishing
off the training thread, and a decoded cache only for pictures read twice."""

from __future__ import annotations

import csv
import json
import logging
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision import transforms as T

from mmfast.data.caption_tokens import tokenize_captions
from mmfast.data.captions import read_captioned
from mmfast.loading.caption_loader import CaptionLoader, Pairs
from mmfast.loading.transforms import options_from_transform

open_clip = pytest.importorskip("open_clip")

SIZE = 32
N = 21  # good pictures: no batch size used here divides it


@pytest.fixture(scope="module")
def pictures(tmp_path_factory) -> list[dict]:
    """N real photos (cut from scikit-image's) of different sizes, each with a caption naming it."""
    from tools.benchmarks.benchlib.data import photo_manifest

    manifest = photo_manifest(tmp_path_factory.mktemp("pictures"), n=N, width=60, height=45, seed=5)
    rows = [json.loads(line) for line in manifest.read_text().splitlines()]
    for k, r in enumerate(rows):  # sizes differ, so the resize rounds every way; aspects within 3:4 .. 4:3
        path = manifest.parent / r["image"]
        Image.open(path).resize((40 + k, 46 + 3 * k % 8)).save(path, quality=92)
        r["path"] = str(path)
    return rows


def write_csv(path: Path, rows: list[dict], sep: str = "\t") -> Path:
    with open(path, "w", newline="") as f:
        out = csv.writer(f, delimiter=sep)
        out.writerow(["filepath", "title"])
        out.writerows([r["path"], r["text"]] for r in rows)
    return path


@pytest.fixture(scope="module")
def tokenizer():
    return open_clip.get_tokenizer("RN50")


def with_bad_pictures(pictures: list[dict], tmp_path: Path) -> tuple[list[dict], set[int]]:
    """The pictures with a broken file and one over a 20,000-pixel budget among them; their row ids."""
    broken = tmp_path / "broken.jpg"
    broken.write_text("not a picture")
    huge = tmp_path / "huge.png"
    Image.new("RGB", (400, 300), (200, 30, 30)).save(huge)
    rows = list(pictures)
    rows.insert(3, {"path": str(broken), "text": "a broken file"})
    rows.insert(11, {"path": str(huge), "text": "a picture over the budget"})
    return rows, {3, 11}


def reference(path: str, transform) -> torch.Tensor:
    """What the trainer's own preprocess makes of the file (PIL); for a train preprocess of scale (1, 1), the
    whole picture resized to S x S (what its crop is for a picture whose aspect is within its ratios)."""
    if transform.transforms[0].__class__.__name__ == "RandomResizedCrop":
        bicubic = T.InterpolationMode.BICUBIC
        transform = T.Compose([T.Resize((SIZE, SIZE), interpolation=bicubic), *transform.transforms[1:]])
    return transform(Image.open(path))


# -- the text side ------------------------------------------------------------------------------------------
def test_open_clips_tokenizer_keeps_its_fixed_77_rows(pictures, tokenizer, tmp_path):
    captions = [r["text"] for r in pictures]
    tokens = tokenize_captions(captions, tokenizer)
    assert tokens.input_ids.shape == (N, 77) and tokens.attention_mask is None
    assert torch.equal(torch.from_numpy(tokens.input_ids), tokenizer(captions))
    cached = tokenize_captions(captions, tokenizer, cache_dir=tmp_path)  # written, then read back mapped
    again = tokenize_captions(captions, tokenizer, cache_dir=tmp_path)
    assert isinstance(again.input_ids, np.memmap) and np.array_equal(again.input_ids, cached.input_ids)
    assert len(list(tmp_path.glob("captions-*.ids.npy"))) == 1
    other = tokenize_captions(captions, open_clip.get_tokenizer("RN50", context_length=32), cache_dir=tmp_path)
    assert other.input_ids.shape == (N, 32) and len(list(tmp_path.glob("captions-*.ids.npy"))) == 2


@pytest.mark.parametrize("fast", [True, False], ids=["fast-tokenizer", "python-tokenizer"])
def test_a_hugging_face_tokenizer_pads_to_the_context_length_with_its_mask(minilm_dir, fast):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(minilm_dir, use_fast=fast)
    captions = ["a cat", "a photo of a rocket number 17 over the sea", ""]
    tokens = tokenize_captions(captions, tok, context_length=12)
    expected = tok(captions, padding="max_length", truncation=True, max_length=12)
    assert tokens.input_ids.tolist() == expected["input_ids"]
    assert tokens.attention_mask.tolist() == expected["attention_mask"]
    assert tokens.input_ids.shape == (3, 12) and tokens.input_ids[0, -1] == tok.pad_token_id


def test_a_plain_callable_tokenizer_and_what_is_refused():
    def words(texts):
        return [[len(w) for w in t.split()][:4] + [0] * (4 - len(t.split()[:4])) for t in texts]

    tokens = tokenize_captions(["a b c", "dd eee"], words)
    assert tokens.input_ids.tolist() == [[1, 1, 1, 0], [2, 3, 0, 0]]
    with pytest.raises(ValueError, match="rows of 2 different lengths"):
        tokenize_captions(["a b", "a b c"], lambda texts: [t.split() and [1] * len(t.split()) for t in texts])
    with pytest.raises(ValueError, match="shape \\(1, 4\\) for 2 captions"):
        tokenize_captions(["a", "b"], lambda texts: torch.zeros(1, 4, dtype=torch.long))


def test_tables_are_read_as_open_clip_reads_them(pictures, tmp_path):
    table = write_csv(tmp_path / "train.csv", pictures)  # open_clip_train's default separator: a tab
    rows = read_captioned(table, sep="\t")
    assert rows.files == [r["path"] for r in pictures] and rows.captions == [r["text"] for r in pictures]
    jsonl = tmp_path / "train.jsonl"
    jsonl.write_text("".join(json.dumps({"image": r["path"], "text": r["text"]}) + "\n" for r in pictures))
    assert read_captioned(jsonl).captions == rows.captions
    with pytest.raises(ValueError, match="no caption column 'caption'; its columns are filepath, title"):
        read_captioned(table, sep="\t", caption_key="caption")
    with pytest.raises(ValueError, match="columns are filepath\ttitle"):
        read_captioned(table, sep=",")  # the wrong separator: one column, named in the message
    other = tmp_path / "train.txt"  # open_clip_train's --dataset-type csv reads any name; a BOM is no column
    other.write_text("\ufefffilepath,title\n" + "".join(f'{r["path"]},"{r["text"]}, too"\n' for r in pictures))
    assert read_captioned(other, sep=",").captions == [r["text"] + ", too" for r in pictures]
    with pytest.raises(ValueError, match="or give sep= for a CSV of another name"):
        read_captioned(other)


def test_paths_relative_to_the_table_read_from_another_folder_are_refused_naming_both(
    pictures, tmp_path, monkeypatch
):
    """Relative paths start from the current directory, as open_clip reads them. A table whose paths name
    files beside it, read from elsewhere, is refused at once with both folders, not 'every image is missing'
    after the first batches; from the table's folder, or with root=, it reads."""
    folder = Path(pictures[0]["path"]).parent
    table = folder / "beside.jsonl"
    rows = [{"image": Path(r["path"]).name, "text": r["text"]} for r in pictures]
    table.write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        ValueError, match=f"run from {folder} .*, or, building the loader yourself, pass root='{folder}'"
    ):
        read_captioned(table)
    assert read_captioned(table, root=folder).files == [r["path"] for r in pictures]
    monkeypatch.chdir(folder)
    assert read_captioned(table).files == [Path(r["path"]).name for r in pictures]


# -- the trainer's preprocess -------------------------------------------------------------------------------
def test_open_clips_preprocess_becomes_the_pipelines_with_bicubic_resizing():
    train = open_clip.image_transform(SIZE, is_train=True)
    found = options_from_transform(train)
    assert found["train"] and found["size"] == SIZE and found["interpolation"] == "bicubic"
    assert found["scale"] == (0.9, 1.0) and found["flip"] is False
    assert found["mean"] == pytest.approx([m * 255 for m in open_clip.OPENAI_DATASET_MEAN])
    val = options_from_transform(open_clip.image_transform(SIZE, is_train=False))
    assert (val["train"], val["size"], val["crop_ratio"], val["interpolation"]) == (False, SIZE, 1.0, "bicubic")
    for refused, says in [
        (open_clip.image_transform(SIZE, is_train=False, resize_mode="longest"), "ResizeKeepRatio"),
        (open_clip.image_transform(SIZE, is_train=True, aug_cfg={"color_jitter_prob": 0.5, "color_jitter": (
            0.4, 0.4, 0.4, 0.1)}), "color_jitter"),
        (T.Compose([T.Resize(SIZE, interpolation=T.InterpolationMode.NEAREST), T.CenterCrop(SIZE), T.ToTensor()]),
         "only bilinear and bicubic"),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match=says):
            options_from_transform(refused)


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train-whole-crop"])
def test_the_pictures_are_open_clips_within_a_level(pictures, tokenizer, tmp_path, train):
    """The eval preprocess, and the train one with crops of the whole picture (scale 1: no random window),
    give open_clip's own pixels (PIL's) up to the resize kernels' rounding (torch's uint8 bicubic)."""
    transform = (
        open_clip.image_transform(SIZE, is_train=True, aug_cfg={"scale": (1.0, 1.0)})
        if train
        else open_clip.image_transform(SIZE, is_train=False)
    )
    loader = CaptionLoader(write_csv(tmp_path / "t.csv", pictures), tokenizer=tokenizer, transform=transform,
                           sep="\t", batch_size=8, shuffle=train, num_workers=2)  # fmt: skip
    std = torch.tensor(open_clip.OPENAI_DATASET_STD).view(3, 1, 1) * 255
    seen = []
    for batch in loader:
        assert isinstance(batch, Pairs) and batch.images.dtype == torch.float32
        for image, row in zip(batch.images, batch.ids.tolist(), strict=True):
            levels = ((image - reference(pictures[row]["path"], transform)) * std).abs()
            assert levels.max() <= 2.0 and levels.mean() < 0.1, (row, levels.max(), levels.mean())
            seen.append(row)
    assert sorted(seen) == list(range(N))


# -- bad pictures: no placeholder, every pair right ---------------------------------------------------------
def check_pairs(batch: Pairs, rows: list[dict], tokenizer, transform) -> None:
    """Every caption is its row's, and every picture is the file of that row (open_clip's pixels)."""
    std = torch.tensor(open_clip.OPENAI_DATASET_STD).view(3, 1, 1) * 255
    captions = [rows[i]["text"] for i in batch.ids.tolist()]
    assert torch.equal(batch.texts, tokenizer(captions))
    for image, i in zip(batch.images, batch.ids.tolist(), strict=True):
        assert ((image - reference(rows[i]["path"], transform)) * std).abs().max() <= 2.0, rows[i]["path"]


def whole_picture_transform():
    return open_clip.image_transform(SIZE, is_train=True, aug_cfg={"scale": (1.0, 1.0)})


def test_skipped_pictures_leave_no_placeholder_and_drop_last_keeps_every_batch_whole(
    pictures, tokenizer, tmp_path, caplog
):
    rows, bad = with_bad_pictures(pictures, tmp_path)
    transform = whole_picture_transform()
    loader = CaptionLoader(write_csv(tmp_path / "t.csv", rows), tokenizer=tokenizer, transform=transform,
                           sep="\t", batch_size=4, shuffle=True, drop_last=True, max_pixels=20_000,
                           num_workers=2)  # fmt: skip
    assert (len(loader), loader.num_batches, loader.num_samples) == (5, 5, N + 2)
    for _epoch in range(2):
        with caplog.at_level(logging.INFO, logger="mmfast"):
            batches = list(loader)
        assert [len(b.ids) for b in batches] == [4] * 5  # 23 rows: 5 whole batches, the 2 holes filled
        ids = torch.cat([b.ids for b in batches]).tolist()
        assert not bad & set(ids) and min(ids) >= 0
        assert all(len(set(b.ids.tolist())) == 4 for b in batches)  # no pair twice in a batch
        for b in batches:
            check_pairs(b, rows, tokenizer, transform)
    assert sorted(s["id"] for s in loader.skipped) == sorted(bad)
    assert "over" in loader.skipped[1]["reason"] or "over" in loader.skipped[0]["reason"]
    assert "skipped in this epoch" in caplog.text


def test_without_drop_last_every_good_pair_comes_once(pictures, tokenizer, tmp_path):
    rows, bad = with_bad_pictures(pictures, tmp_path)
    transform = open_clip.image_transform(SIZE, is_train=False)
    loader = CaptionLoader(write_csv(tmp_path / "v.csv", rows), tokenizer=tokenizer, transform=transform,
                           sep="\t", batch_size=8, max_pixels=20_000, num_workers=2)  # fmt: skip
    batches = list(loader)
    assert [len(b.ids) for b in batches] == [8, 8, 5]
    assert sorted(torch.cat([b.ids for b in batches]).tolist()) == sorted(set(range(N + 2)) - bad)
    for b in batches:
        check_pairs(b, rows, tokenizer, transform)


def test_every_process_gets_as_many_whole_batches_whatever_it_skips(pictures, tokenizer, tmp_path):
    """The two bad pictures fall to one process: both still step len() times with whole batches (DDP)."""
    rows, bad = with_bad_pictures(pictures, tmp_path)
    table = write_csv(tmp_path / "t.csv", rows)
    got = []
    for rank in (0, 1):
        loader = CaptionLoader(table, tokenizer=tokenizer, transform=whole_picture_transform(), sep="\t",
                               batch_size=3, shuffle=False, drop_last=True, shard_id=rank, num_shards=2,
                               max_pixels=20_000, num_workers=2)  # fmt: skip
        batches = list(loader)
        got.append([len(b.ids) for b in batches])
        ids = set(torch.cat([b.ids for b in batches]).tolist())
        # rank 1's share: the odd rows, and the first row again (DistributedSampler's padding of 23 rows)
        assert not ids & bad and ids <= set(range(rank, N + 2, 2)) | {0}
    assert got == [[3] * 4, [3] * 4]


def test_on_bad_image_error_raises_on_the_training_thread_naming_the_file(pictures, tokenizer, tmp_path):
    rows, _ = with_bad_pictures(pictures, tmp_path)
    loader = CaptionLoader(write_csv(tmp_path / "t.csv", rows), tokenizer=tokenizer, sep="\t", size=SIZE,
                           batch_size=4, on_bad_image="error", max_pixels=20_000, num_workers=2)  # fmt: skip
    with pytest.raises(ValueError, match=r"(broken\.jpg|huge\.png): .* or pass on_bad_image='skip'"):
        list(loader)


# -- ready batches, and the decoded cache by use ------------------------------------------------------------
def test_batches_are_finished_off_the_training_thread_and_a_break_stops_the_producer(
    pictures, tokenizer, tmp_path, monkeypatch
):
    from mmfast.loading import host_finish

    finishing = []
    original = host_finish.HostFinisher.finish
    monkeypatch.setattr(
        host_finish.HostFinisher,
        "finish",
        lambda self, out: finishing.append(threading.current_thread().name) or original(self, out),
    )
    loader = CaptionLoader(write_csv(tmp_path / "t.csv", pictures), tokenizer=tokenizer, sep="\t", size=SIZE,
                           batch_size=4, shuffle=True, num_workers=2)  # fmt: skip
    for _ in loader:
        break
    assert finishing and threading.current_thread().name not in finishing
    assert not [t for t in threading.enumerate() if t.name == "mmfast-captions"]  # the break stopped it
    assert sum(len(b.ids) for b in loader) == N and loader.epoch == 2  # epoch 1, whole
    older = iter(loader)
    next(older)
    newer = iter(loader)
    with pytest.raises(RuntimeError, match="a newer iter\\(loader\\) replaced it"):
        next(older)
    assert sum(len(b.ids) for b in newer) == N


@pytest.mark.parametrize("epochs, held", [(1, [False, False]), (None, [False, True]), (3, [True, True])])
def test_pictures_are_held_decoded_only_when_an_epoch_reads_them_again(
    pictures, tokenizer, tmp_path, epochs, held
):
    loader = CaptionLoader(write_csv(tmp_path / "t.csv", pictures), tokenizer=tokenizer, sep="\t", size=SIZE,
                           batch_size=4, shuffle=True, epochs=epochs, num_workers=2)  # fmt: skip
    seen = []
    for _ in range(2):
        assert sum(len(b.ids) for b in loader) == N
        seen.append(loader.images.holds_decoded)
    assert seen == held
    again = CaptionLoader(write_csv(tmp_path / "t.csv", pictures), tokenizer=tokenizer, sep="\t", size=SIZE,
                          batch_size=4, shuffle=True, epochs=epochs, num_workers=2)  # fmt: skip
    assert sum(len(b.ids) for b in again) == N
    for _ in again:  # the second epoch, left early ...
        break
    images = again.images
    assert sum(len(b.ids) for b in again) == N and again.images is images  # ... is the image loader of the third
