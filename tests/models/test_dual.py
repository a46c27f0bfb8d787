"""The dual encoder ("clip", mmfast/models/dual.py) and its model out: normalized outputs, the temperature's
init and clamp per loss, LiT, a model directory that round-trips with encode_image / encode_text, and
mmfast-predict --embed / mmfast-evaluate / mmfast-export on it."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import n_rows

import mmfast
from mmfast.data.tokenizer import load_tokenizer
from mmfast.infer.model_dir import MmfastModel, model_config, pil_transform, save_model_dir
from mmfast.models import MODELS, PRESETS, build_model
from mmfast.models.dual import DualEncoder

DIM = 16
TEMPLATES = ["a photo of a {}.", "{}"]


def _dual(loss: str = "clip", **kwargs) -> DualEncoder:
    torch.manual_seed(0)
    return build_model(
        "clip", 0, image_backbone="resnet10", text_model="bert-tiny", vocab_size=120, loss=loss, embed_dim=DIM,
        hidden=32, **kwargs,
    )  # fmt: skip


def _batch(b: int = 3, length: int = 7) -> dict:
    g = torch.Generator().manual_seed(1)
    mask = (torch.arange(length)[None, :] < torch.tensor([length, 4, 2][:b])[:, None]).long()
    return {
        "image": torch.randn(b, 3, 32, 32, generator=g),
        "input_ids": torch.randint(5, 120, (b, length), generator=g) * mask,
        "attention_mask": mask,
    }


def test_clip_is_registered_with_its_task_and_options():
    assert MODELS["clip"] is DualEncoder
    assert DualEncoder.task == "contrastive" and DualEncoder.config_options == ("loss", "embed_dim")
    preset = PRESETS["clip-lite0-minilm"]
    assert (preset.image_backbone, preset.text_model, preset.freeze_image, preset.batch_size) == (
        "efficientnet-lite0",
        "minilm",
        True,
        64,
    )
    assert preset.image_size in (128, 160)
    with pytest.raises(ValueError, match="num_classes must be >= 2"):  # a classifier still needs classes
        build_model("concat", 0, image_backbone="resnet10", text_model="bert-tiny", vocab_size=120)
    with pytest.raises(ValueError, match="unknown loss 'infonce'"):
        _dual("infonce")


@pytest.mark.parametrize("loss", ["clip", "siglip"])
def test_outputs_are_normalized_float32_and_match_the_towers(loss):
    model = _dual(loss).eval()
    batch = _batch()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(batch)
    assert set(out) == {"image", "text", "logit_scale", "logit_bias"}
    for name in ("image", "text"):
        assert out[name].shape == (3, DIM) and out[name].dtype == torch.float32
        torch.testing.assert_close(out[name].norm(dim=1), torch.ones(3), rtol=0, atol=1e-5)
    assert out["logit_scale"].dim() == 0 and out["logit_bias"].dim() == 0
    with torch.no_grad():
        out = model(batch)
        torch.testing.assert_close(model.encode_image(batch["image"]), out["image"], rtol=0, atol=0)
        torch.testing.assert_close(
            model.encode_text(batch["input_ids"], batch["attention_mask"]), out["text"], rtol=0, atol=0
        )
    # padding is not read: the caption's embedding is the same without its padded tail
    with torch.no_grad():
        short = model.encode_text(batch["input_ids"][2:, :2], batch["attention_mask"][2:, :2])
    torch.testing.assert_close(short[0], out["text"][2], rtol=1e-5, atol=1e-6)


def test_temperature_init_per_loss_and_clamped_at_100():
    clip, siglip = _dual("clip"), _dual("siglip")
    out = clip(_batch())
    assert out["logit_scale"].item() == pytest.approx(1 / 0.07, rel=1e-6) and out["logit_bias"].item() == 0.0
    assert clip.logit_scale.requires_grad and "logit_bias" not in dict(clip.named_parameters())
    out = siglip(_batch())
    assert out["logit_scale"].item() == pytest.approx(10.0, rel=1e-6) and out["logit_bias"].item() == -10.0
    assert siglip.logit_bias.requires_grad  # SigLIP's bias learns
    for model in (clip, siglip):
        with torch.no_grad():
            model.logit_scale.fill_(math.log(1000.0))
        assert model(_batch())["logit_scale"].item() == pytest.approx(100.0, rel=1e-6)
        with torch.no_grad():
            model.logit_scale.fill_(math.log(50.0))
        assert model(_batch())["logit_scale"].item() == pytest.approx(50.0, rel=1e-6)  # below the cap: exp(t)


def test_freeze_image_locks_the_image_tower_only():
    model = _dual(freeze_image=True).train()
    assert not model.image.training  # batch-norm statistics stay as they are
    out = model(_batch())
    (out["image"] @ out["text"].T * out["logit_scale"]).logsumexp(1).mean().backward()
    assert all(p.grad is None for p in model.image.parameters())
    assert model.image_proj.weight.grad is not None and model.logit_scale.grad is not None
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.text.parameters())


def _config(prepared: Path, loss: str = "siglip") -> dict:
    labels = json.loads((prepared / "labels.json").read_text())
    return {
        "model": "clip",
        "task": "contrastive",
        "loss": loss,
        "embed_dim": DIM,
        "zero_shot_templates": TEMPLATES,
        "num_classes": len(labels),
        "class_names": sorted(labels, key=labels.get),
        "image_backbone": "resnet10",
        "text_model": "bert-tiny",
        "vocab_size": len(load_tokenizer(prepared / "tokenizer")),
        "hidden": 32,
        "dropout": 0.1,
        "image_size": 32,
        "mean": [0.485, 0.456, 0.406],
        "std": [0.229, 0.224, 0.225],
        "max_length": 32,
        "eval_batch_size": 16,
    }


@pytest.fixture(scope="module")
def net(prepared) -> MmfastModel:
    torch.manual_seed(0)
    model = MmfastModel(_config(prepared))
    with torch.no_grad():  # not the init: load_model must bring these back
        model.model.logit_scale.fill_(3.0)
        model.model.logit_bias.fill_(-4.0)
    return model


@pytest.fixture(scope="module")
def clip_dir(prepared, net, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("clip") / "model"
    return save_model_dir(out, net.model.state_dict(), net.config, prepared / "tokenizer")


def test_model_config_records_the_dual_encoder(prepared, net):
    from mmfast.data.dataset import PreparedDataset

    fields = ("model", "image_backbone", "text_model", "hidden", "dropout", "loss", "embed_dim")
    cfg = SimpleNamespace(**{k: _config(prepared)[k] for k in fields})
    cfg.image_size, cfg.eval_batch_size, cfg.task = 32, 16, None
    cfg.zero_shot_templates = "a {} photo|art of {}"
    config = model_config(cfg, PreparedDataset(prepared), net.model, "best")
    assert (config["model"], config["task"], config["loss"], config["embed_dim"]) == (
        "clip",
        "contrastive",
        "siglip",
        DIM,
    )
    assert config["zero_shot_templates"] == ["a {} photo", "art of {}"]
    assert "combine" not in config


def test_model_dir_round_trips_encode_image_and_encode_text(prepared, net, clip_dir, demo_manifest):
    config = json.loads((clip_dir / "config.json").read_text())
    assert (config["model"], config["loss"], config["embed_dim"]) == ("clip", "siglip", DIM)
    assert "dual encoder" in (clip_dir / "README.md").read_text()
    loaded = mmfast.load_model(clip_dir)
    assert loaded.embeds and not loaded.training
    assert loaded.model.logit_scale.item() == 3.0 and loaded.model.logit_bias.item() == -4.0
    texts = ["a red circle", "two small blue squares on a green field", ""]
    got = loaded.encode_text(texts, batch_size=2)  # batches of 2: padded to each batch's longest
    enc = load_tokenizer(prepared / "tokenizer")(
        texts, truncation=True, max_length=32, padding=True, return_tensors="pt"
    )
    with torch.no_grad():
        want = net.model.encode_text(enc["input_ids"], enc["attention_mask"])
    assert got.shape == (3, DIM) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loaded.encode_text("a red circle"), want[:1], rtol=1e-5, atol=1e-6)
    images = _batch(2)["image"]
    with torch.no_grad():
        torch.testing.assert_close(loaded.encode_image(images), net.model.encode_image(images), rtol=0, atol=0)
    # files: PIL + torchvision preprocessing as config.json records it
    rows = [json.loads(line) for line in demo_manifest.read_text().splitlines()[:3]]
    paths = [str(demo_manifest.parent / r["image"]) for r in rows]
    from PIL import Image

    tf = pil_transform(config)
    assert torch.equal(
        loaded.transform(Image.open(paths[0]).convert("RGB")), tf(Image.open(paths[0]).convert("RGB"))
    )
    rgba = Image.open(paths[0]).convert("RGBA")  # the transform takes any mode, as encode_image does
    rgba.putalpha(90)
    assert torch.equal(loaded.transform(rgba), tf(Image.open(paths[0]).convert("RGB")))
    assert torch.equal(loaded.transform(Image.open(paths[0]).convert("L")), tf(Image.open(paths[0]).convert("LA")))
    with torch.no_grad():
        want = net.model.encode_image(torch.stack([tf(Image.open(p).convert("RGB")) for p in paths]))
    torch.testing.assert_close(loaded.encode_image(paths, batch_size=2), want, rtol=1e-5, atol=1e-6)
    # one image, as encode_text takes one string (a path was iterated as its characters: "no such file 'i'")
    for one in (paths[0], Path(paths[0]), Image.open(paths[0])):
        torch.testing.assert_close(loaded.encode_image(one), want[:1], rtol=1e-5, atol=1e-6)
    classifier = MmfastModel({**_config(prepared), "model": "concat"})
    with pytest.raises(TypeError, match="needs a dual encoder"):
        classifier.encode_text(["x"])


def test_predict_embed_writes_embeddings_with_their_ids(prepared, clip_dir, tmp_path):
    import pyarrow.parquet as pq

    import tools.predict as predict_tool
    from mmfast.data.dataset import PreparedDataset

    val = PreparedDataset(prepared).rows("val")
    n = n_rows(prepared, "val")
    out = tmp_path / "val-text"
    assert (
        predict_tool.main(
            ["--model", str(clip_dir), "--data", str(prepared), "--embed", "text", "--out", str(out)]
        )
        == 0
    )
    emb, ids = np.load(tmp_path / "val-text.npy"), np.load(tmp_path / "val-text.ids.npy")
    assert emb.shape == (n, DIM) and emb.dtype == np.float32 and ids.dtype == np.int64
    assert ids.tolist() == [r["id"] for r in val]  # the prepared sample ids, in the split's order
    model = mmfast.load_model(clip_dir)
    np.testing.assert_allclose(emb, model.encode_text([r["text"] for r in val]).numpy(), rtol=1e-5, atol=1e-6)
    table = pq.read_table(tmp_path / "val-text.parquet")
    assert table.column("id").to_pylist() == ids.tolist() and table.column("text").to_pylist()[0] == val[0]["text"]
    np.testing.assert_allclose(np.asarray(table.column("embedding").to_pylist(), np.float32), emb)
    # a second run replaces its own files; a file of the user's under one of those names is refused
    assert (
        predict_tool.main(
            ["--model", str(clip_dir), "--data", str(prepared), "--embed", "text", "--out", str(out)]
        )
        == 0
    )
    (tmp_path / "mine.ids.npy").write_text("my notes")
    argv = ["--model", str(clip_dir), "--data", str(prepared), "--embed", "text", "--out", str(tmp_path / "mine")]
    assert predict_tool.main(argv) == 2 and (tmp_path / "mine.ids.npy").read_text() == "my notes"


def test_predict_embed_into_a_folder_writes_inside_it_and_says_where(prepared, clip_dir, tmp_path, capsys):
    import tools.predict as predict_tool

    n = n_rows(prepared, "val")
    folder = tmp_path / "embeddings"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    for modality in ("text", "image"):
        argv = ["--model", str(clip_dir), "--data", str(prepared), "--embed", modality, "--out", str(folder)]
        assert predict_tool.main(argv) == 0
        files = [folder / f"{modality}{suffix}" for suffix in (".npy", ".ids.npy", ".parquet")]
        said = f"wrote {n} {modality} embeddings ({DIM}-d): {', '.join(map(str, files))}\n"
        assert capsys.readouterr().out == said
        assert np.load(files[0]).shape == (n, DIM)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["embeddings"]  # nothing beside the folder
    names = [f"{m}{s}" for m in ("image", "text") for s in (".npy", ".ids.npy", ".parquet")] + ["notes.txt"]
    assert sorted(p.name for p in folder.iterdir()) == sorted(names)
    assert (folder / "notes.txt").read_text() == "mine"
    # a name ending in / is a folder to make
    argv = ["--model", str(clip_dir), "--data", str(prepared), "--embed", "text", "--out", f"{tmp_path / 'new'}/"]
    assert predict_tool.main(argv) == 0
    assert np.load(tmp_path / "new" / "text.npy").shape == (n, DIM)
    assert str(tmp_path / "new" / "text.npy") in capsys.readouterr().out


def test_predict_embed_image_skips_bad_rows_and_keeps_each_rows_embedding(
    prepared, clip_dir, demo_manifest, tmp_path
):
    import tools.predict as predict_tool

    rows = [json.loads(line) for line in demo_manifest.read_text().splitlines()[:5]]
    good = [{**r, "image": str(demo_manifest.parent / r["image"])} for r in rows]
    manifest = tmp_path / "new.jsonl"
    lines = [good[0], good[1], {"image": str(tmp_path / "missing.jpg"), "text": "x"}, good[2], good[3]]
    manifest.write_text("".join(json.dumps(r) + "\n" for r in lines))
    out = tmp_path / "emb.npy"  # the .npy is the files' stem
    assert (
        predict_tool.main(
            ["--model", str(clip_dir), "--input", str(manifest), "--embed", "image", "--out", str(out)]
        )
        == 0
    )
    emb, ids = np.load(tmp_path / "emb.npy"), np.load(tmp_path / "emb.ids.npy")
    assert ids.tolist() == [0, 1, 3, 4] and emb.shape == (4, DIM)  # row 2 (the missing image) left out
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, rtol=0, atol=1e-5)
    # each row's embedding is its own image's: the same as that image embedded alone
    for row, pos in ((good[2], 3), (good[1], 1)):  # input row 3 is good[2]
        single = tmp_path / f"single-{pos}"
        argv = ["--model", str(clip_dir), "--image", row["image"], "--embed", "image", "--out", str(single)]
        assert predict_tool.main(argv) == 0
        np.testing.assert_allclose(np.load(f"{single}.npy")[0], emb[ids.tolist().index(pos)], rtol=1e-4, atol=1e-5)


def test_predict_with_a_dual_encoder_is_zero_shot_among_its_classes(prepared, clip_dir, tmp_path):
    """Without --embed, a dual encoder trained with labels predicts among its classes: each image against the
    class prompts. Its right answers on val are the zero-shot accuracy mmfast-evaluate reports."""
    import tools.evaluate as evaluate_tool
    import tools.predict as predict_tool
    from mmfast.tasks.retrieval import caption_groups

    out = tmp_path / "val.jsonl"
    argv = ["--model", str(clip_dir), "--data", str(prepared), "--split", "val", "--out", str(out), "--top-k", "2"]
    assert predict_tool.main(argv) == 0
    got = [json.loads(line) for line in out.read_text().splitlines()]
    names = mmfast.load_model(clip_dir).class_names
    for r in got:
        assert r["class"] in names and [c for c, _ in r["top_k"]][0] == r["class"], r
        assert len(r["top_k"]) == 2 and 1 >= r["prob"] == r["top_k"][0][1] >= r["top_k"][1][1] > 0, r
    assert len({r["class"] for r in got}) > 1  # not one class for every image
    ev = tmp_path / "ev"
    assert evaluate_tool.main(["--model", str(clip_dir), "--data", str(prepared), "--out", str(ev)]) == 0
    figures = json.loads((ev / "metrics.json").read_text())
    first = caption_groups([r["image"] for r in got])[0]  # evaluate scores one row per image
    right = sum(got[i]["class"] == got[i]["label"] for i in first)
    assert 100 * right / len(first) == pytest.approx(figures["zero_shot_acc"], abs=1e-6)


def test_predict_with_the_users_class_names_scores_each_image_against_their_prompts(
    prepared, clip_dir, tmp_path, capsys
):
    """--classes and --templates: each image's probabilities are the softmax of the model's scaled cosines to
    the prompts of those names, ensembled, computed here from encode_image / encode_text."""
    import tools.predict as predict_tool
    from mmfast.infer.embed import embed_rows
    from mmfast.infer.predict import prepared_rows

    classes = ["a red square", "a green circle", "a blue triangle", "noise"]
    names_file = tmp_path / "classes.txt"
    names_file.write_text("# my classes\n" + "\n".join(classes) + "\n\n")
    out = tmp_path / "mine.jsonl"
    argv = ["--model", str(clip_dir), "--data", str(prepared), "--split", "val", "--out", str(out)]
    assert (
        predict_tool.main(
            [*argv, "--classes", str(names_file), "--templates", "{}|a drawing of {}", "--top-k", "4"]
        )
        == 0
    )
    got = [json.loads(line) for line in out.read_text().splitlines()][:6]
    model = mmfast.load_model(clip_dir)
    _, img, _ = embed_rows(model, prepared_rows(prepared, "val")[:6], "image")  # the images as predict embeds them
    with torch.no_grad():
        prompts = [t.format(c) for c in classes for t in ("{}", "a drawing of {}")]
        text = model.encode_text(prompts).reshape(4, 2, -1)
        cls = torch.nn.functional.normalize(torch.nn.functional.normalize(text, dim=-1).mean(1), dim=-1)
        img = torch.from_numpy(img)
        probs = torch.softmax(model.model.scale_and_bias()[0] * img @ cls.T, dim=1)
    for r, p in zip(got, probs, strict=True):
        assert r["class"] == classes[int(p.argmax())] and r["prob"] == pytest.approx(float(p.max()), abs=1e-3)
        assert dict(r["top_k"]) == pytest.approx(dict(zip(classes, p.tolist(), strict=True)), abs=1e-3)
    refusals = {
        "only one": "give at least two class names",
        "cat,dog,cat": "'cat' given more than once",
        "my-classes.txt": "my-classes.txt: no such file",
        ",".join(f"class number {k}" for k in range(40)): None,  # a long list is no file name: no OSError
    }
    for value, said in refusals.items():
        capsys.readouterr()
        code = predict_tool.main([*argv, "--classes", value, "--templates", "{"])
        assert code == 2 and (said or "must hold exactly one {}") in capsys.readouterr().err
    embed = ["--model", str(clip_dir), "--data", str(prepared), "--embed", "image", "--out", str(tmp_path / "e")]
    assert predict_tool.main([*embed, "--classes", "cat,dog"]) == 2
    assert "--embed writes embeddings instead: drop one or the other" in capsys.readouterr().err


def test_evaluate_reports_retrieval_and_zero_shot(prepared, clip_dir, tmp_path, capsys):
    import tools.evaluate as evaluate_tool
    from mmfast.data.dataset import PreparedDataset
    from mmfast.infer.embed import embed_rows
    from mmfast.infer.predict import prepared_rows
    from mmfast.tasks.retrieval import caption_groups, retrieval_figures

    assert (
        evaluate_tool.main(["--model", str(clip_dir), "--data", str(prepared), "--out", str(tmp_path / "ev")]) == 0
    )
    figures = json.loads((tmp_path / "ev" / "metrics.json").read_text())
    val = PreparedDataset(prepared).rows("val")
    first, text_image = caption_groups([r["image"] for r in val])
    assert figures["texts"] == len(val) and figures["images"] == len(first) and figures["errors"] == 0
    # the same figures as embedding the split's images and captions and ranking them
    model = mmfast.load_model(clip_dir)
    rows = prepared_rows(prepared, "val")
    _, img, kept = embed_rows(model, [rows[i] for i in first], "image")
    assert kept == list(range(len(first)))
    texts = [r["text"] for r in rows]
    same = torch.tensor([texts.index(t) for t in texts])  # the demo's captions repeat: one candidate each
    assert len(set(texts)) < len(texts)
    want = retrieval_figures(torch.from_numpy(img), model.encode_text(texts), text_image, same)
    for key, value in want.items():
        assert figures[key] == pytest.approx(value, abs=1e-6), key
    assert 0 <= figures["zero_shot_acc"] <= 100 and figures["zero_shot_samples"] == len(first)
    assert figures["zero_shot_classes"] == len(model.class_names)
    assert "image -> text" in capsys.readouterr().out


def test_a_model_trained_without_labels_predicts_no_class_and_scores_no_zero_shot(
    prepared, net, clip_dir, tmp_path, capsys
):
    """A --no-labels input's rows are all class 'unlabeled': the model knows no classes, so predicting one is
    refused (not a confident 'unlabeled'), and evaluating unlabeled rows reports retrieval without a zero-shot
    figure (one class: every image would be right)."""
    import tools.evaluate as evaluate_tool
    import tools.predict as predict_tool
    from mmfast.data.dataset import PreparedDataset

    config = {**net.config, "num_classes": 1, "class_names": ["unlabeled"]}
    model_dir = save_model_dir(tmp_path / "model", net.model.state_dict(), config, prepared / "tokenizer")
    assert not mmfast.load_model(model_dir).knows_classes and mmfast.load_model(clip_dir).knows_classes
    val = PreparedDataset(prepared).rows("val")
    rows = tmp_path / "pairs.jsonl"
    rows.write_text("".join(json.dumps({"image": r["image"], "text": r["text"]}) + "\n" for r in val))
    assert predict_tool.main(["--model", str(model_dir), "--image", val[0]["image"]]) == 2
    assert "is a dual encoder and it was trained without labels: pass --classes NAMES" in capsys.readouterr().err
    out = tmp_path / "named.jsonl"  # the user's own class names: zero-shot without any trained class
    argv = ["--model", str(model_dir), "--input", str(rows), "--classes", "dog, cat,bird", "--out", str(out)]
    assert predict_tool.main(argv) == 0
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(got) == len(val) and {r["class"] for r in got} <= {"dog", "cat", "bird"}
    assert all(sum(p for _, p in r["top_k"]) == pytest.approx(1.0, abs=1e-5) for r in got)  # top 3 of 3 classes
    argv = ["--model", str(model_dir), "--input", str(rows), "--no-labels", "--out", str(tmp_path / "ev")]
    assert evaluate_tool.main(argv) == 0
    figures = json.loads((tmp_path / "ev" / "metrics.json").read_text())
    assert figures["texts"] == len(val) and "i2t_r1" in figures and "zero_shot_acc" not in figures
    assert not (tmp_path / "ev" / "errors.jsonl").exists()
    missing = [{"image": str(tmp_path / f"gone-{k}.png"), "text": "a picture not there"} for k in range(12)]
    with rows.open("a") as f:  # more than the ten rows stderr names: the file lists them all
        f.write("".join(json.dumps(r) + "\n" for r in missing))
    capsys.readouterr()
    assert evaluate_tool.main(argv) == 0
    errors = [json.loads(line) for line in (tmp_path / "ev" / "errors.jsonl").read_text().splitlines()]
    assert [e["image"] for e in errors] == [r["image"] for r in missing] and all(e["error"] for e in errors)
    err = capsys.readouterr().err
    assert f"wrote {tmp_path / 'ev' / 'errors.jsonl'}: the 12 rows left out" in err
    assert f"{len(val)} rows evaluated, 12 more left out for errors" in err  # not 12 of those evaluated
    rows.write_text("".join(json.dumps({"image": r["image"], "text": r["text"]}) + "\n" for r in val))
    assert evaluate_tool.main(argv) == 0 and not (tmp_path / "ev" / "errors.jsonl").exists()  # none now


def test_onnx_export_of_both_towers_matches_pytorch(clip_dir, tmp_path, monkeypatch):
    """The towers' ONNX files embed as PyTorch does; export.json names them wherever it is read from, though --out
    was given relative to the working directory."""
    import tools.export as export_tool
    from mmfast.infer.export import example_inputs, towers_parity

    monkeypatch.chdir(tmp_path.parent)
    assert export_tool.main(["--model", str(clip_dir), "--out", tmp_path.name, "--format", "onnx"]) == 0
    report = json.loads((tmp_path / "export.json").read_text())
    assert report["onnx"] == {name: str(tmp_path.resolve() / f"{name}.onnx") for name in ("image", "text")}
    assert (
        set(report["onnx_max_abs_diff"]) == {"image", "text"} and max(report["onnx_max_abs_diff"].values()) <= 1e-4
    )
    model = mmfast.load_model(clip_dir)
    paths = {name: tmp_path / f"{name}.onnx" for name in ("image", "text")}
    diffs = towers_parity(model, paths, example_inputs(model, batch=5, length=20, seed=3))  # other dynamic sizes
    assert max(diffs.values()) <= 1e-4


@pytest.mark.slow
def test_a_trained_clip_run_evaluates_as_the_engine_did(prepared, tmp_path):
    """RUN/model of a contrastive run: mmfast-evaluate on the val split gives the figures of the engine's last
    evaluation (one evaluation: the best weights are the last)."""
    import tools.evaluate as evaluate_tool
    import tools.train as train_tool

    run = tmp_path / "run"
    argv = [
        "--data",
        str(prepared),
        "--out",
        str(run),
        "--model",
        "clip",
        "--preset",
        "tiny",  # the demo set's tokenizer (clip's default preset tokenizes with MiniLM's)
        "--epochs",
        "1",
        "--embed-dim",
        str(DIM),
    ]
    argv += ["--batch-size", "16", "--image-size", "32", "--no-progress", "--mixed-precision", "no"]
    argv += ["--max-steps", "3"]  # the evaluation compared runs once, at the end, whatever the steps before it
    assert train_tool.main(argv) == 0
    config = json.loads((run / "model" / "config.json").read_text())
    assert (config["model"], config["task"], config["loss"], config["embed_dim"]) == (
        "clip",
        "contrastive",
        "clip",
        DIM,
    )
    engine = [
        json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if "val_i2t_r1" in line
    ][-1]
    assert (
        evaluate_tool.main(["--model", str(run / "model"), "--data", str(prepared), "--out", str(tmp_path / "ev")])
        == 0
    )
    figures = json.loads((tmp_path / "ev" / "metrics.json").read_text())
    for key in ("i2t_r1", "i2t_r10", "t2i_r1", "t2i_r10", "i2t_median_rank", "mean_recall", "zero_shot_acc"):
        assert figures[key] == pytest.approx(engine[f"val_{key}"], abs=1e-6), key
