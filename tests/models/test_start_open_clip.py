"""An open_clip checkpoint with open_clip's own text transformer and tokenizer (every standard open_clip model:
ViT-B-32, RN50, ...) starts the dual encoder (mmfast/models/open_clip_text.py, start_towers.py,
mmfast/data/open_clip_tokenizer.py). The tiny model here is built and saved by open_clip itself. Its text
tower gives open_clip's embedding at any padded width; the captions are tokenized as open_clip's tokenizer
tokenizes them; a trained model goes back to open_clip, loaded in a fresh process without mmfast, with
mmfast's embeddings and retrieval."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from test_peers import assert_same_embeddings, mmfast_inputs, run_peer

from mmfast.data.tokenizer import load_tokenizer, tokenizer_fingerprint

RUN = ["--model", "clip", "--epochs", "1", "--batch-size", "16", "--no-progress", "--mixed-precision", "no"]
LOGIT_SCALE = 2.0  # the start's temperature (log scale): not CLIP's init, log(1 / 0.07)
MEAN, STD = (0.4, 0.45, 0.5), (0.3, 0.25, 0.2)
CAPTIONS = ["a red circle", "Two SMALL  blue squares &amp; a triangle", "a cat, Chelsea", "x " * 60]


VIT = {"image_size": 32, "patch_size": 8, "width": 32, "layers": 2, "head_width": 16, "mlp_ratio": 2}
RESNET = {"image_size": 32, "layers": [1, 1, 1, 1], "width": 8}  # open_clip's ModifiedResNet (RN50's kind)


def native_open_clip_dir(
    root: Path, custom_text: bool = False, vision: dict = VIT, resize: str = "shortest"
) -> Path:
    """A tiny open_clip CLIP (ViT image tower, open_clip's text transformer, random weights), saved with
    open_clip's own config writer and weight file name. Its preprocessing is bicubic, with ``resize``."""
    import open_clip
    from open_clip.push_to_hf_hub import save_config_for_hf
    from safetensors.torch import save_file

    model_cfg = {
        "embed_dim": 16,
        "init_logit_scale": LOGIT_SCALE,
        "vision_cfg": vision,
        "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 2,
                     "mlp_ratio": 2},
        **({"custom_text": True} if custom_text else {}),
    }  # fmt: skip
    torch.manual_seed(0)
    cls = open_clip.model.CustomTextCLIP if custom_text else open_clip.model.CLIP
    model = cls(**{k: v for k, v in model_cfg.items() if k != "custom_text"})
    preprocess = {"size": 32, "mean": MEAN, "std": STD, "interpolation": "bicubic", "resize_mode": resize}
    open_clip.model.set_model_preprocess_cfg(model, preprocess)
    out = root / ("tiny-open_clip-custom" if custom_text else "tiny-open_clip-native")
    suffix = ("-resnet" if vision is RESNET else "") + ("" if resize == "shortest" else "-" + resize)
    out = out.with_name(out.name + suffix)
    out.mkdir(parents=True)
    save_config_for_hf(model, out / "open_clip_config.json", model_config=model_cfg)
    save_file(model.state_dict(), str(out / "open_clip_model.safetensors"))
    return out


def _open_clip(folder: Path):
    import open_clip

    model, _, _ = open_clip.create_model_and_transforms(f"local-dir:{folder}")
    return model.eval(), open_clip.get_tokenizer(f"local-dir:{folder}")


@pytest.mark.parametrize("custom_text", [False, True])
def test_open_clip_text_tower_embeds_as_open_clip_at_any_padded_width(custom_text, tmp_path):
    from mmfast.data.token_cache import TokenCache
    from mmfast.models.start_towers import text_tower_from

    start = native_open_clip_dir(tmp_path, custom_text)
    theirs, their_tok = _open_clip(start)
    ours = text_tower_from(start).eval()
    tok = load_tokenizer(start)
    want_ids = their_tok(CAPTIONS)  # (N, 77): open_clip's cleaning (spaces, HTML entities), padded with 0
    cache = TokenCache.build(tmp_path / "tokens", "val", CAPTIONS, tok, max_length=77)
    with torch.no_grad():
        want = theirs.encode_text(want_ids)
        for padding in ("longest", "buckets", "max"):
            batch = cache.gather(np.arange(len(CAPTIONS)), padding)
            width = batch["input_ids"].shape[1]
            torch.testing.assert_close(batch["input_ids"], want_ids[:, :width])
            torch.testing.assert_close(ours(**batch), want, rtol=1e-5, atol=1e-5)
        short = tok(CAPTIONS[:3], max_length=77, padding=True, return_tensors="pt")  # 12 tokens at most
        assert short["input_ids"].shape[1] < 16
        torch.testing.assert_close(ours(**short), want[:3], rtol=1e-5, atol=1e-5)
        wide = TokenCache.build(tmp_path / "wide", "val", CAPTIONS, tok, max_length=100).gather(range(4), "max")
        assert wide["input_ids"].shape[1] == 100  # --max-length beyond the context: rows still end at 77
        torch.testing.assert_close(ours(**wide), want, rtol=1e-5, atol=1e-5)
    assert ours.record["kind"] == "open_clip" and float(ours.start["logit_scale"]) == pytest.approx(LOGIT_SCALE)


@pytest.mark.parametrize("vision", [VIT, RESNET], ids=["vit", "modified-resnet"])
def test_open_clip_image_tower_embeds_as_open_clip_with_its_preprocessing(vision, tmp_path):
    from mmfast.models.start_dirs import start_preprocess
    from mmfast.models.start_towers import image_tower_from

    start = native_open_clip_dir(tmp_path, vision=vision)
    theirs, _ = _open_clip(start)
    ours = image_tower_from(start, freeze=True)
    ours.train()  # a locked tower stays in eval mode (ModifiedResNet's batch norms keep their statistics)
    pixels = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, _ = ours(pixels)
        torch.testing.assert_close(got, theirs.encode_image(pixels), rtol=1e-5, atol=1e-5)
    assert not ours.module.training and (ours.mean, ours.std) == (MEAN, STD)
    geometry = {"interpolation": "bicubic", "resize_mode": "shortest", "crop_ratio": 1.0}
    assert start_preprocess(start) == {"image_size": 32, "mean": MEAN, "std": STD, **geometry}


@pytest.mark.parametrize("resize", ["shortest", "squash"])
def test_the_centre_view_is_the_checkpoints_own_preprocess(resize, photos, tmp_path):
    """The start's filter (bicubic) and resize mode reach the loaders: the eval view of real photos equals
    open_clip's PIL preprocess within a level of 255 (torchvision's geometry); the graph's geometry, which
    training's evaluation and predict use, rounds the crop's offset and size otherwise, moving a few pixels."""
    import open_clip
    from PIL import Image

    from mmfast.loading.image_loader import ImageLoader
    from mmfast.models.start_towers import image_tower_from
    from mmfast.train.data import image_norm

    start = native_open_clip_dir(tmp_path, resize=resize)
    _, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{start}")
    want = torch.stack([preprocess(Image.open(p)) for p in photos])
    mean, std, geometry = image_norm(image_tower_from(start, freeze=True))
    crop = {"crop_ratio": 1.0} if resize == "shortest" else {}  # open_clip crops no margin
    assert geometry == {"interpolation": "bicubic", "resize_mode": resize} | crop
    norm = {"mean": tuple(255 * m for m in mean), "std": tuple(255 * s for s in std)}
    levels = torch.tensor(STD).view(3, 1, 1) * 255  # one normalized unit in 8-bit levels
    for eval_geometry, most, on_average in (("torchvision", 1.01, 0.01), ("dali", 255, 1.5)):
        files = [str(p) for p in photos]
        loader = ImageLoader(files, batch_size=len(files), train=False, size=32, dtype=torch.float32,
                             eval_geometry=eval_geometry, cache_decoded=False, **norm, **geometry)  # fmt: skip
        diff = ((next(iter(loader))[0] - want) * levels).abs()
        assert float(diff.max()) <= most and float(diff.mean()) <= on_average, (eval_geometry, diff.mean())


def test_open_clip_tokenizer_cuts_at_max_length_and_rebuilds_from_its_directory(tmp_path):
    from mmfast.data.open_clip_tokenizer import OpenClipTokenizer

    start = native_open_clip_dir(tmp_path)
    _, their_tok = _open_clip(start)
    tok = load_tokenizer(start)
    assert isinstance(tok, OpenClipTokenizer) and len(tok) == 49408 and tok.pad_token_id == 0
    rows = tok(CAPTIONS, truncation=True, max_length=8)["input_ids"]
    assert rows == [r[r != 0].tolist() for r in their_tok(CAPTIONS, context_length=8)]  # the end-of-text id last
    tok.save_pretrained(tmp_path / "saved")
    again = load_tokenizer(tmp_path / "saved")
    assert tokenizer_fingerprint(again) == tokenizer_fingerprint(tok)
    assert again(CAPTIONS)["input_ids"] == tok(CAPTIONS)["input_ids"]
    assert tokenizer_fingerprint(OpenClipTokenizer(77, "whitespace")) != tokenizer_fingerprint(tok)


def test_without_open_clip_the_start_says_which_extra_to_install(tmp_path, monkeypatch):
    import sys

    from mmfast.models.start_towers import text_tower_from

    start = native_open_clip_dir(tmp_path)
    for name in [m for m in sys.modules if m == "open_clip" or m.startswith("open_clip.")]:
        monkeypatch.setitem(sys.modules, name, None)  # an import of it now fails, as when it is not installed
    monkeypatch.setitem(sys.modules, "open_clip", None)
    for build in (load_tokenizer, text_tower_from):
        with pytest.raises(ValueError, match=r"^\S+tiny-open_clip-native: .*pip install 'mmfast\[peers\]'"):
            build(start)


def test_a_text_tower_that_reads_the_full_context_is_refused(tmp_path):
    from mmfast.models.start_towers import text_tower_from

    (tmp_path / "oc").mkdir()
    bidirectional = {"model_cfg": {"embed_dim": 8, "text_cfg": {"width": 8, "no_causal_mask": True}}}
    (tmp_path / "oc" / "open_clip_config.json").write_text(json.dumps(bidirectional))
    with pytest.raises(ValueError, match="reads a caption padded to its full context length"):
        text_tower_from(tmp_path / "oc")


@pytest.mark.parametrize("vision", [VIT, RESNET], ids=["vit", "modified-resnet"])
def test_hf_export_is_a_clip_model_or_refused_naming_the_tower(vision, tmp_path):
    """--format hf: open_clip's ViT and text transformer become transformers' CLIPModel, which embeds as open_clip
    does; a ModifiedResNet image tower is refused before anything is written."""
    from transformers import CLIPModel

    from mmfast.infer.export_hf import hf_towers, write_hf
    from mmfast.infer.model_dir import MmfastModel
    from mmfast.infer.peer_towers import FormatRefusal
    from mmfast.models import build_model

    start = native_open_clip_dir(tmp_path, vision=vision)
    net = build_model("clip", 0, image_backbone=str(start), text_model=str(start), embed_dim=None)
    config = {
        "model": "clip", "task": "contrastive", "loss": "clip", "embed_dim": 16, "num_classes": 2,
        "class_names": ["a", "b"], "image_backbone": str(start), "text_model": str(start), "vocab_size": 49408,
        "hidden": 32, "dropout": 0.1, "image_size": 32, "mean": list(MEAN), "std": list(STD), "max_length": 32,
        "image_tower": net.image.record, "text_tower": net.text.record, "interpolation": "bicubic",
        "resize_mode": "shortest", "crop_ratio": 1.0,
    }  # fmt: skip
    model = MmfastModel(config)
    model.model.load_state_dict(net.state_dict(), strict=True)
    model.tokenizer = load_tokenizer(start)
    if vision is RESNET:
        refusal = r"^--format hf: the image tower is open_clip's ModifiedResNet, not CLIP's; "
        with pytest.raises(FormatRefusal, match=refusal + "export it with --format open_clip, onnx or torch$"):
            hf_towers(model)
        return
    write_hf(model, tmp_path / "hf")
    clip = CLIPModel.from_pretrained(tmp_path / "hf").eval()
    theirs, tok = _open_clip(start)
    pixels = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    ids = tok(CAPTIONS[:3])[:, :16]  # open_clip's rows, padded with 0 after the end-of-text id
    with torch.no_grad():
        image = clip.get_image_features(pixel_values=pixels)
        text = clip.get_text_features(input_ids=ids, attention_mask=(ids > 0).long())
        image, text = (getattr(x, "pooler_output", x) for x in (image, text))  # a model output in transformers 5
        torch.testing.assert_close(image, theirs.encode_image(pixels), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(text, theirs.encode_text(tok(CAPTIONS[:3])), rtol=1e-4, atol=1e-5)
    assert clip.logit_scale.item() == pytest.approx(LOGIT_SCALE)


@pytest.mark.slow  # a training run and a fresh process to load the export: over the fast lane's budget
@pytest.mark.parametrize("locked", [True, False], ids=["locked-image", "unlocked"])
def test_a_native_open_clip_model_starts_the_dual_encoder_and_goes_back(
    locked, demo_manifest, photos, tmp_path, capsys
):
    import open_clip
    from PIL import Image
    from transformers import CLIPTokenizer

    import tools.export as export_tool
    import tools.train as train_tool
    from mmfast.infer.predict import rows_loader

    start = native_open_clip_dir(tmp_path)
    run = tmp_path / "run"
    flags = ["--init-from", str(start), *(["--freeze-image"] if locked else [])]
    assert train_tool.main(["--data", str(demo_manifest), "--out", str(run), *RUN, *flags]) == 0
    theirs_fp = tokenizer_fingerprint(load_tokenizer(start))
    for folder in (run / "prepared" / "tokenizer", run / "model" / "tokenizer"):
        assert tokenizer_fingerprint(load_tokenizer(folder)) == theirs_fp
    config = json.loads((run / "model" / "config.json").read_text())
    assert (config["image_size"], config["embed_dim"], config["text_tower"]["kind"]) == (32, 16, "open_clip")
    assert config["mean"] == pytest.approx(MEAN) and config["std"] == pytest.approx(STD)
    assert (config["interpolation"], config["resize_mode"], config["crop_ratio"]) == ("bicubic", "shortest", 1.0)
    weights = load_file(str(run / "model" / "model.safetensors"))
    ref = load_file(str(start / "open_clip_model.safetensors"))
    same_image = torch.equal(weights["model.image.module.conv1.weight"], ref["visual.conv1.weight"])
    assert same_image == locked
    assert not torch.equal(weights["model.text.module.tower.text_projection"], ref["text_projection"])
    assert abs(float(weights["model.logit_scale"]) - LOGIT_SCALE) < 0.1
    out = run / "export"
    assert export_tool.main(["--model", str(run / "model"), "--out", str(out), "--format", "open_clip"]) == 0
    inputs, ours = mmfast_inputs(run / "model", run / "prepared", photos, tmp_path)
    theirs = run_peer("open_clip_embed", out / "open_clip", inputs, tmp_path)
    exported = json.loads((out / "open_clip" / "open_clip_config.json").read_text())["preprocess_cfg"]
    assert (exported["interpolation"], exported["resize_mode"]) == ("bicubic", "shortest")
    # predict's loader of the photos: open_clip's own preprocess of the export, a level of 255 on average
    _, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{out / 'open_clip'}")
    files = [str(p) for p in photos]
    loader = rows_loader(files, ["x"] * len(files), ours["model"], tmp_path / "t", 10**8, batch_size=len(files))
    got = next(iter(loader))["image"].float()[: len(files)]
    want = torch.stack([preprocess(Image.open(p)) for p in photos])
    assert float(((got - want) * torch.tensor(STD).view(3, 1, 1) * 255).abs().mean()) <= 1.5
    assert str(theirs["kind"]) == "CLIP"
    assert_same_embeddings(ours, theirs)
    model = ours["model"]
    captions = [str(c) for c in np.load(inputs)["captions"]]
    want = model.tokenizer(captions, truncation=True, max_length=model.config["max_length"])["input_ids"]
    for row, ids in zip(theirs["ids"], want, strict=True):
        assert row[: len(ids)].tolist() == ids and not row[len(ids) :].any()
    # transformers' CLIPModel and CLIPProcessor, loaded in a fresh process: the same embeddings and recall
    assert export_tool.main(["--model", str(run / "model"), "--out", str(out), "--format", "hf"]) == 0
    clip = run_peer("clip_embed", out / "hf", inputs, tmp_path)
    assert str(clip["kind"]) == "CLIPModel"
    assert_same_embeddings(ours, clip)
    assert float(clip["logit_scale"]) == pytest.approx(float(weights["model.logit_scale"]))
    assert CLIPTokenizer.from_pretrained(out / "hf")(captions, truncation=True)["input_ids"] == want
    # CLIPProcessor's own pixels of the photos: mmfast's centre view, its crop offset rounded its own way
    assert np.abs(clip["own_pixels"] - np.load(inputs)["pixels"][-len(photos) :]).mean() < 0.05
    if locked:  # once: ONNX and torch.export graphs of each tower, at a caption length other than the example's
        assert export_tool.main(["--model", str(run / "model"), "--out", str(out / "both")]) == 0  # onnx, torch
        rows = torch.tensor(theirs["ids"][:3])  # open_clip's rows (3, 32), cut to the longest caption's width
        ids = rows[:, : int((rows > 0).sum(1).max())]
        text = torch.export.load(str(out / "both" / "text.pt2")).module()(ids, (ids > 0).long())
        np.testing.assert_allclose(text.detach().numpy(), ours["text"][:3], atol=1e-5)
        import onnxruntime as ort

        session = ort.InferenceSession(str(out / "both" / "text.onnx"), providers=["CPUExecutionProvider"])
        feed = {"input_ids": ids.numpy(), "attention_mask": (ids > 0).long().numpy()}
        (text,) = session.run(["embedding"], {i.name: feed[i.name] for i in session.get_inputs()})
        np.testing.assert_allclose(text, ours["text"][:3], atol=1e-5)


@pytest.mark.slow  # a training run
def test_an_open_clip_start_keeps_its_text_tower_for_the_zero_shot_map(demo_manifest, tmp_path):
    """--zero-shot-map kernel on towers that bring their own projections: the whole text tower is copied as it
    started, and zero-shot reads the prompts with that copy."""
    import tools.train as train_tool
    from mmfast.infer.model_dir import load_model

    start = native_open_clip_dir(tmp_path)
    run = tmp_path / "run"
    flags = ["--init-from", str(start), "--freeze-image", "--zero-shot-map", "kernel"]
    assert train_tool.main(["--data", str(demo_manifest), "--out", str(run), *RUN, *flags]) == 0
    model = load_model(run / "model-last")
    record = model.config["zero_shot_map"]
    assert (record["text_start"], record["text_width"]) == ("copy", 16)  # the tower's own projection's width
    theirs, tok = _open_clip(start)
    ids = tok(CAPTIONS[:3])
    with torch.no_grad():
        joined = model.model.encode_text(ids, (ids > 0).long(), zero_shot=True)
        start_text = torch.nn.functional.normalize(theirs.encode_text(ids), dim=-1)
    assert joined.shape == (3, 16 + 16)
    w = float(model.model.prompt_map.weight)
    torch.testing.assert_close(joined[:, 16:] / (1 - w) ** 0.5, start_text, rtol=1e-4, atol=1e-5)
    trained = model.model.encode_text(ids, (ids > 0).long())
    assert not torch.allclose(trained, start_text, atol=1e-3)  # the trained tower moved; the copy did not
