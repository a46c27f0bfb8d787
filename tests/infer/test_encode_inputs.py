"""What ``MmfastModel.encode_image`` / ``encode_text`` take (mmfast/infer/encode_inputs.py): a folder of real
pictures with a bad one or two is embedded, the bad ones skipped by name (or raised on when asked); each
accepted way of giving an image embeds it as its file does; anything else is a one-line TypeError or ValueError
saying what is taken."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from mmfast.data.tokenizer import load_tokenizer
from mmfast.infer.model_dir import MmfastModel, pil_transform

DIM = 16
SIZE = 48


@pytest.fixture(scope="module")
def model(prepared) -> MmfastModel:
    """An untrained dual encoder (random weights) with the prepared set's tokenizer."""
    labels = json.loads((prepared / "labels.json").read_text())
    config = {
        "model": "clip", "task": "contrastive", "loss": "siglip", "embed_dim": DIM, "num_classes": len(labels),
        "class_names": sorted(labels, key=labels.get), "image_backbone": "resnet10", "text_model": "bert-tiny",
        "vocab_size": len(load_tokenizer(prepared / "tokenizer")), "hidden": 32, "dropout": 0.1,
        "image_size": SIZE, "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225], "max_length": 32,
    }  # fmt: skip
    torch.manual_seed(0)
    net = MmfastModel(config)
    net.tokenizer = load_tokenizer(prepared / "tokenizer")
    return net


@pytest.fixture(scope="module")
def folder(photos, tmp_path_factory) -> Path:
    """Real photos, one PNG over the pixel budget (231 MP declared, small on disk: PIL's own limit is 179 MP)
    and one JPEG cut in half."""
    out = tmp_path_factory.mktemp("pictures")
    for p in photos[:4]:
        shutil.copy(p, out / p.name)
    Image.new("1", (16000, 14464)).save(out / "huge.png")
    jpeg = next(p for p in photos if p.suffix == ".jpg").read_bytes()
    (out / "cut.jpg").write_bytes(jpeg[: len(jpeg) // 2])
    return out


def test_a_folder_with_a_huge_and_a_cut_picture_embeds_the_others_and_names_the_two(model, folder, caplog):
    files = sorted(folder.iterdir())
    bad = {folder / "huge.png", folder / "cut.jpg"}
    good = [k for k, f in enumerate(files) if f not in bad]
    got = model.encode_image(files, batch_size=3)
    assert got.shape == (len(good), DIM) and got.kept == good
    skipped = {s["image"]: s for s in got.skipped}
    assert set(skipped) == {str(f) for f in bad}
    assert [s["index"] for s in got.skipped] == [k for k, f in enumerate(files) if f in bad]
    assert skipped[str(folder / "huge.png")]["reason"] == (
        "image is 16000x14464 = 231.4 MP, over the 64 MP budget (max_pixels=); downscale it"
    )
    assert skipped[str(folder / "cut.jpg")]["reason"].startswith("truncated image: ")
    assert all(f"skipping {f}" in caplog.text for f in bad)  # said, not only recorded
    for row, k in enumerate(good):  # each row is its picture's embedding, as encoded alone
        alone = model.encode_image(files[k])
        assert alone.kept == [0] and alone.skipped == []
        torch.testing.assert_close(got[row : row + 1], alone, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got.norm(dim=1), torch.ones(len(good)), rtol=0, atol=1e-5)


def test_on_error_raise_names_the_file_and_the_limit(model, folder, photos):
    from mmfast.infer.model_dir import BadImageError

    with pytest.raises(BadImageError) as e:
        model.encode_image([photos[0], folder / "huge.png"], on_error="raise")
    assert str(e.value) == (
        f"{folder / 'huge.png'}: image is 16000x14464 = 231.4 MP, over the 64 MP budget (max_pixels=); "
        "downscale it"
    )
    assert e.value.image == str(folder / "huge.png")
    # the budget is the caller's when given: a real photo over 0.1 MP
    with Image.open(photos[0]) as im:
        w, h = im.size
    with pytest.raises(BadImageError, match=r"over the 0.1 MP budget \(max_pixels=\)"):
        model.encode_image(photos[0], max_pixels=100_000, on_error="raise")
    assert model.encode_image(photos[0], max_pixels=w * h).shape == (1, DIM)
    with pytest.raises(ValueError, match="on_error must be 'skip' or 'raise', got 'ignore'"):
        model.encode_image(photos[0], on_error="ignore")


def test_embed_rows_and_predict_rows_skip_the_same_pictures_or_raise_when_asked(model, folder):
    """mmfast-predict's functions (the DALI eval pipeline) take the same pictures as encode_image, and the same
    on_error."""
    from mmfast.infer.embed import embed_rows
    from mmfast.infer.model_dir import BadImageError
    from mmfast.infer.predict import predict_rows

    files = sorted(folder.iterdir())
    rows = [{"image": str(f), "text": "a photo"} for f in files]
    out, emb, kept = embed_rows(model, rows, "image", batch_size=4, num_workers=1)
    alone = model.encode_image(files)
    assert kept == alone.kept and emb.shape == (len(kept), DIM)
    assert {r["image"]: r["error"] for r in out if r.get("error")} == {
        s["image"]: f"image unreadable: {s['reason']}" for s in alone.skipped
    }
    huge = "image is 16000x14464 = 231.4 MP, over the 64 MP budget (max_pixels=); downscale it"
    with pytest.raises(BadImageError, match=re.escape(f"{folder / 'huge.png'}: image unreadable: {huge}")):
        embed_rows(model, rows, "image", on_error="raise")
    classifier = MmfastModel({**model.config, "model": "concat", "num_classes": 3})
    classifier.tokenizer = model.tokenizer
    kept_rows = [rows[k] for k in kept]
    assert not any(r.get("error") for r in predict_rows(classifier, kept_rows, on_error="raise"))
    with pytest.raises(BadImageError, match=re.escape(f"{folder / 'cut.jpg'}: image unreadable: truncated image")):
        predict_rows(classifier, [*kept_rows, rows[files.index(folder / "cut.jpg")]], on_error="raise")


def test_every_way_of_giving_an_image_embeds_it_as_its_file_does(model, photos):
    path = photos[0]
    want = model.encode_image(path)
    rgb = np.array(Image.open(path).convert("RGB"))  # (H, W, 3) uint8
    chw = torch.from_numpy(rgb).permute(2, 0, 1).contiguous()  # (3, H, W), as torchvision.io.read_image gives
    batch = pil_transform(model.config)(Image.open(path).convert("RGB"))[None]  # (1, 3, S, S), preprocessed
    for given in (str(path), Image.open(path), rgb, [rgb], rgb[None], chw, [chw], chw[None], batch, batch[0]):
        torch.testing.assert_close(model.encode_image(given), want, rtol=1e-4, atol=1e-5)
    other = model.encode_image(photos[1])
    gap = (want - other).norm()
    assert gap > 0.05  # the test can tell two pictures apart
    # the same pictures as a list mixing the ways, rows in input order
    mixed = model.encode_image([chw, photos[1], Image.open(path)])
    torch.testing.assert_close(mixed, torch.cat([want, other, want]), rtol=1e-4, atol=1e-5)
    assert mixed.kept == [0, 1, 2]
    gray = np.asarray(Image.open(path).convert("L"))  # (H, W): grey is read as RGB, as a grey file is
    torch.testing.assert_close(
        model.encode_image(gray), model.encode_image(Image.open(path).convert("L")), rtol=1e-4, atol=1e-5
    )


@pytest.mark.parametrize(
    ("given", "error", "says"),
    [
        (None, TypeError, r"encode_image takes image files \(str or os.PathLike\), PIL images, uint8 RGB arrays"),
        (3, TypeError, "encode_image takes image files .*; got int"),
        (b"cat.jpg", TypeError, "encode_image takes .*; got bytes"),
        ([None], TypeError, r"encode_image: images\[0\] is a NoneType; it takes image files"),
        (np.zeros((40, 50, 3), np.float32), TypeError, r"images is a float32 array; an image array holds uint8"),
        (torch.zeros(3, 40, 50, dtype=torch.int64), TypeError, "images is a torch.int64 tensor"),
        (np.zeros((3, 40, 50), np.uint8), ValueError, r"array of shape \(3, 40, 50\); an image is \(H, W, 3\)"),
        (torch.zeros(40, 50, 3, dtype=torch.uint8), ValueError, r"shape \(40, 50, 3\); an image is \(3, H, W\)"),
        ([torch.zeros(3, SIZE, SIZE)], TypeError, "stack preprocessed images into one batch"),
        (torch.zeros(2, 3, 64, 64), ValueError, rf"a float tensor is a preprocessed batch: \(N, 3, {SIZE}"),
        (torch.zeros(2, 1, SIZE, SIZE), ValueError, r"got shape \(2, 1, 48, 48\)"),
    ],
    ids=["None", "int", "bytes", "list-of-None", "float-array", "int64-tensor", "chw-array", "hwc-tensor",
         "list-of-float", "wrong-size", "one-channel"],  # fmt: skip
)
def test_inputs_it_does_not_take_are_refused_in_one_line(model, given, error, says):
    with pytest.raises(error, match=says) as e:
        model.encode_image(given)
    assert "\n" not in str(e.value)


def test_encode_text_takes_a_str_or_a_list_of_str(model):
    want = model.encode_text(["a red circle", "a blue square"])
    torch.testing.assert_close(model.encode_text(("a red circle", "a blue square")), want)
    torch.testing.assert_close(model.encode_text("a blue square"), want[1:])
    assert model.encode_text([]).shape == (0, DIM)
    for given, says in (
        (None, "encode_text takes a str or a list of str; got NoneType"),
        (7, "encode_text takes a str or a list of str; got int"),
        (b"a cat", "got bytes"),
        (["a cat", None], r"texts\[1\] is a NoneType"),
        (torch.tensor([[101, 102]]), r"token ids go to model.model.encode_text\(input_ids, attention_mask\)"),
    ):
        with pytest.raises(TypeError, match=says):
            model.encode_text(given)
