"""Models out to the peer libraries (mmfast/infer/export_open_clip.py, export_hf.py): a dual encoder trained by
mmfast-train is exported, then loaded in a fresh process where mmfast cannot be imported, by open_clip's own
factory and by transformers / sentence-transformers. On the same pixels and captions their embeddings match
mmfast's (cosine >= 0.9999) and the val split's retrieval figures are the same; the preprocessing each peer
applies to image files is compared with mmfast's, and so are the token ids."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from mmfast.infer.encode_inputs import pil_transform
from mmfast.infer.model_dir import load_model
from mmfast.infer.predict import prepared_rows
from mmfast.tasks.retrieval import caption_groups, retrieval_figures
from mmfast.util.fsutil import MARKER

PEERS = Path(__file__).parents[1] / "peers"
TINY_CLIP = ["--model", "clip", "--preset", "tiny", "--image-backbone", "timm:test_efficientnet", "--epochs", "1"]
TINY_CLIP += ["--embed-dim", "16", "--batch-size", "16", "--image-size", "32", "--no-progress"]
TINY_CLIP += ["--mixed-precision", "no"]
PHOTO_CAPTIONS = ["a rocket on its launch pad", "galaxies of the deep field", "a retina", "a cat, Chelsea"]
PHOTO_CAPTIONS += ["an astronaut in a white suit", "a cup of coffee on a saucer"]


def run_peer(script: str, folder: Path, inputs: Path, tmp_path: Path, *flags: str, fails: bool = False):
    """Run a peer script in a fresh interpreter without mmfast on its path; its outputs as a dict (its stderr,
    where it is to fail)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = tmp_path / f"{script}.npz"
    proc = subprocess.run(
        [sys.executable, str(PEERS / f"{script}.py"), str(folder), str(inputs), str(out), *flags],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if fails:
        assert proc.returncode != 0
        return proc.stderr
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(np.load(out))


def mmfast_inputs(model_dir: Path, prepared: Path, photos: list[Path], tmp_path: Path) -> tuple[Path, dict]:
    """INPUTS.npz for the peer scripts (the val split's images as mmfast preprocesses them, its captions and the
    photos' captions; the photo files) and mmfast's own embeddings of the same."""
    model = load_model(model_dir)
    rows = prepared_rows(prepared, "val")
    first, text_image = caption_groups([r["image"] for r in rows])
    transform = pil_transform(model.config)
    files = [rows[i]["image"] for i in first] + [str(p) for p in photos]
    pixels = torch.stack([transform(Image.open(f).convert("RGB")) for f in files])
    captions = [r["text"] for r in rows] + PHOTO_CAPTIONS[: len(photos)]
    inputs = tmp_path / "inputs.npz"
    np.savez(inputs, pixels=pixels.numpy(), captions=np.array(captions), photos=np.array([str(p) for p in photos]))
    ours = {
        "image": model.encode_image(pixels).numpy(),
        "text": model.encode_text(captions).numpy(),
        "n_val_images": len(first),
        "text_image": text_image,
        "model": model,
    }
    return inputs, ours


def assert_same_embeddings(ours: dict, theirs: dict, key: str = "text") -> None:
    """Row by row cosine >= 0.9999, and the val split's retrieval figures equal."""
    for name, mine in (("image", ours["image"]), (key, ours["text"])):
        got = theirs[name]
        assert got.shape == mine.shape, name
        cosine = (got * mine).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(mine, axis=1)
        assert cosine.min() >= 0.9999, (name, cosine.min())
    n_img, n_txt = ours["n_val_images"], len(ours["text_image"])
    want = retrieval_figures(
        torch.from_numpy(ours["image"][:n_img]), torch.from_numpy(ours["text"][:n_txt]), ours["text_image"]
    )
    got = retrieval_figures(
        torch.from_numpy(theirs["image"][:n_img]), torch.from_numpy(theirs[key][:n_txt]), ours["text_image"]
    )
    assert got["i2t_r1"] == want["i2t_r1"] and got["t2i_r1"] == want["t2i_r1"], (got, want)
    assert got == pytest.approx(want, abs=1e-9)


def mmfast_ids(model, captions: list[str]) -> list[list[int]]:
    enc = model.tokenizer(captions, truncation=True, max_length=model.config["max_length"])
    return enc["input_ids"]


@pytest.fixture(scope="module")
def tiny_clip(prepared, tmp_path_factory) -> Path:
    """RUN/model of a one-epoch ``mmfast-train --model clip`` run with tiny towers (a timm CNN, a 2-layer BERT on
    the data's own WordPiece vocabulary), exported to both peer formats: the export folder."""
    import tools.export as export_tool
    import tools.train as train_tool

    run = tmp_path_factory.mktemp("tiny-clip") / "run"
    assert train_tool.main(["--data", str(prepared), "--out", str(run), *TINY_CLIP]) == 0
    out = run / "export"
    argv = ["--model", str(run / "model"), "--out", str(out), "--format", "open_clip,hf"]
    assert export_tool.main(argv) == 0
    return out


def test_open_clip_loads_the_export_and_embeds_as_mmfast(tiny_clip, prepared, photos, tmp_path):
    inputs, ours = mmfast_inputs(tiny_clip.parent / "model", prepared, photos, tmp_path)
    theirs = run_peer("open_clip_embed", tiny_clip / "open_clip", inputs, tmp_path)
    assert str(theirs["kind"]) == "CustomTextCLIP"
    assert_same_embeddings(ours, theirs)
    model = ours["model"]
    captions = [str(c) for c in np.load(inputs)["captions"]]
    for row, want in zip(theirs["ids"], mmfast_ids(model, captions), strict=True):
        assert row[: len(want)].tolist() == want and not row[len(want) :].any()  # open_clip pads with [PAD]=0
    assert float(theirs["logit_scale"]) == pytest.approx(float(model.model.logit_scale))
    assert np.isnan(theirs["logit_bias"])  # the CLIP loss learns no bias
    # open_clip's transform resizes the shorter side to the image size (crop ratio 1), mmfast's eval to
    # size / 0.875 (a tighter centre): the one difference between the two
    wider = pil_transform({**model.config, "crop_ratio": 1.0})
    want = torch.stack([wider(Image.open(p).convert("RGB")) for p in photos]).numpy()
    np.testing.assert_allclose(theirs["own_pixels"], want, atol=1e-6)


def test_a_moved_open_clip_folder_loads_with_its_text_config_given_again(tiny_clip, prepared, photos, tmp_path):
    """After a move, ``text_cfg.hf_model_name`` names a folder that is gone and open_clip's factory fails inside
    huggingface_hub; the guide's call (the text config with the new path, passed to the factory) loads it, with
    the same embeddings, and edits nothing in the folder."""
    moved = tmp_path / "moved" / "open_clip"
    shutil.copytree(tiny_clip / "open_clip", moved)
    config = json.loads((moved / "open_clip_config.json").read_text())
    config["model_cfg"]["text_cfg"]["hf_model_name"] = str(tmp_path / "gone" / "open_clip")  # where it was
    (moved / "open_clip_config.json").write_text(json.dumps(config))
    before = (moved / "open_clip_config.json").read_bytes()
    inputs, ours = mmfast_inputs(tiny_clip.parent / "model", prepared, photos, tmp_path)
    assert "gone/open_clip" in run_peer("open_clip_embed", moved, inputs, tmp_path, fails=True)
    assert_same_embeddings(ours, run_peer("open_clip_embed", moved, inputs, tmp_path, "--moved"))
    assert (moved / "open_clip_config.json").read_bytes() == before


def test_zero_shot_and_image_embeddings_read_rows_whose_caption_is_empty(tiny_clip, photos_set, tmp_path, capsys):
    """img2dataset writes an empty .txt for a picture without alt text: that row was refused ("empty caption")
    by zero-shot and --embed image, which read no caption. They now predict it, its text ""; --embed text
    still refuses it, naming the shard, line and member."""
    import tools.predict as predict_tool

    wds = pytest.importorskip("webdataset")
    model = str(tiny_clip.parent / "model")
    shards = tmp_path / "shards"
    shards.mkdir()
    with wds.TarWriter(str(shards / "00000.tar")) as w:
        for j, r in enumerate(photos_set[:6]):
            sample = {"jpg": r["path"].read_bytes(), "txt": "" if j == 1 else r["text"]}
            w.write({"__key__": f"{j:04d}", **{k: v for k, v in sample.items() if j != 2 or k != "txt"}})
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("".join(json.dumps({"image": str(r["path"]), "text": " " * (j == 0)}) + "\n"
                                for j, r in enumerate(photos_set[:3])))  # fmt: skip
    for source, n in ((shards, 6), (manifest, 3)):
        out = tmp_path / f"{source.name}.jsonl"
        argv = ["--model", model, "--input", str(source), "--out", str(out)]
        assert predict_tool.main([*argv, "--classes", "a photo,a drawing"]) == 0
        got = [json.loads(line) for line in out.read_text().splitlines()]
        assert (
            len(got) == n
            and not any(r["error"] for r in got)
            and {r["class"] for r in got} <= {"a photo", "a drawing"}
        )
        assert got[0]["text"] == "" if source == manifest else got[1]["text"] == "" and got[2]["text"] == ""
        emb = tmp_path / f"{source.name}-image"
        assert (
            predict_tool.main(["--model", model, "--input", str(source), "--embed", "image", "--out", str(emb)])
            == 0
        )
        assert np.load(f"{emb}.npy").shape[0] == n
    capsys.readouterr()
    emb = tmp_path / "text"
    assert predict_tool.main(["--model", model, "--input", str(shards), "--embed", "text", "--out", str(emb)]) == 0
    assert np.load(f"{emb}.npy").shape[0] == 4
    err = capsys.readouterr().err
    assert f"{shards / '00000.tar'}:2: empty caption (0001.txt) (sample 0001)" in err
    assert f"{shards / '00000.tar'}:3: no caption member (.txt)" in err


def test_transformers_loads_the_export_and_embeds_as_mmfast(tiny_clip, prepared, photos, tmp_path):
    inputs, ours = mmfast_inputs(tiny_clip.parent / "model", prepared, photos, tmp_path)
    theirs = run_peer("hf_embed", tiny_clip / "hf", inputs, tmp_path)
    assert str(theirs["kind"]) == "TimmWrapperForImageClassification+BertModel"
    assert_same_embeddings(ours, theirs)  # sentence-transformers' text embeddings
    assert_same_embeddings(ours, theirs, key="text_transformers")  # transformers alone, pooled and projected
    # the image processor's pixels are mmfast's eval preprocessing (bilinear resize, centre crop, mean/std)
    model = ours["model"]
    want = torch.stack([pil_transform(model.config)(Image.open(p).convert("RGB")) for p in photos]).numpy()
    np.testing.assert_allclose(theirs["own_pixels"], want, atol=1e-6)
    towers = json.loads((tiny_clip / "hf" / "towers.json").read_text())
    assert towers["embed_dim"] == 16 and towers["logit_scale"] == pytest.approx(float(model.model.logit_scale))


def _model_dir(prepared: Path, tmp_path: Path, **fields) -> Path:
    """A model directory of random weights (the prepared set's tokenizer), config.json's fields as given."""
    from mmfast.data.tokenizer import load_tokenizer
    from mmfast.infer.model_dir import MmfastModel, save_model_dir

    labels = json.loads((prepared / "labels.json").read_text())
    config = {
        "model": "clip", "task": "contrastive", "loss": "clip", "embed_dim": 16, "num_classes": len(labels),
        "class_names": sorted(labels, key=labels.get), "image_backbone": "resnet10", "text_model": "bert-tiny",
        "vocab_size": len(load_tokenizer(prepared / "tokenizer")), "hidden": 32, "dropout": 0.1,
        "image_size": 32, "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225], "max_length": 32,
    } | fields  # fmt: skip
    torch.manual_seed(0)
    net = MmfastModel(config)
    return save_model_dir(tmp_path / "model", net.model.state_dict(), net.config, prepared / "tokenizer")


@pytest.mark.parametrize(
    ("fields", "fmt", "words"),
    [
        ({}, "open_clip", ["image backbone 'resnet10'", "timm's resnet18 with {'layers': [1, 1, 1, 1]}"]),
        ({"model": "concat"}, "open_clip", ["holds image-text dual encoders", "'concat' model is a classifier"]),
        ({"model": "concat"}, "open_clip,hf", ["holds image-text dual encoders", "--format hf"]),
        (
            {"image_backbone": "timm:test_efficientnet", "image_pool": "multiscale"},
            "hf",
            ["pools its stages", "train with --image-pool last"],
        ),
    ],
)
def test_a_format_that_cannot_hold_the_model_is_refused_before_anything_is_written(
    fields, fmt, words, prepared, tmp_path, capsys
):
    import tools.export as export_tool

    model_dir = _model_dir(prepared, tmp_path, **fields)
    out = tmp_path / "export"
    assert export_tool.main(["--model", str(model_dir), "--out", str(out), "--format", fmt]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --format {fmt.split(',')[0]}") and err.count("\n") == 1
    for w in words:
        assert w in err
    assert "--format onnx or --format torch" in err or "--format onnx or torch" in err
    assert not out.exists()


def test_format_all_writes_every_format_that_holds_the_model_and_names_the_rest(prepared, tmp_path, capsys):
    """--format all on a tower open_clip cannot build (ResNet-10): the other formats are written, and open_clip
    is named with its reason, on the screen and in export.json; the same formats named one by one refuse."""
    import tools.export as export_tool

    model_dir, out = _model_dir(prepared, tmp_path), tmp_path / "export"
    assert export_tool.main(["--model", str(model_dir), "--out", str(out), "--format", "all"]) == 0
    said = capsys.readouterr().out
    assert "note: --format all leaves out open_clip: --format open_clip: open_clip builds a timm image" in said
    report = json.loads((out / "export.json").read_text())
    assert set(report["left_out"]) == {"open_clip"} and "resnet10" in report["left_out"]["open_clip"]
    assert {"image.onnx", "text.onnx", "image.pt2", "text.pt2", "hf"} <= {p.name for p in out.iterdir()}
    weights = list(out.rglob("*.safetensors"))  # safetensors writes 0600: an export is for others to read too
    assert weights and all(p.stat().st_mode & 0o044 == 0o044 for p in weights), [
        oct(p.stat().st_mode) for p in weights
    ]
    assert not (out / "open_clip").exists()
    argv = ["--model", str(model_dir), "--out", str(tmp_path / "e2"), "--format", "onnx,torch,open_clip,hf"]
    assert export_tool.main(argv) == 2 and not (tmp_path / "e2").exists()


def test_exporting_again_keeps_the_same_models_formats_and_removes_another_models(
    prepared, tmp_path, capsys, monkeypatch
):
    """Into one OUT: a failed parity check, a format that fails to write, or a kill's leftover changes nothing.
    The same model exported again in one format keeps its other formats, listed. Another model's export
    removes what the earlier export.json lists and it does not write (that folder would be taken for this
    model's), and keeps a file of the user's."""
    import errno

    import mmfast.infer.export_hf as export_hf
    import tools.export as export_tool

    model_dir, out = _model_dir(prepared, tmp_path), tmp_path / "export"
    argv = ["--model", str(model_dir), "--out", str(out), "--no-check"]
    assert export_tool.main([*argv, "--format", "onnx,torch,hf"]) == 0
    (out / "notes.txt").write_text("mine")
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    report = (out / "export.json").read_bytes()
    leftover = out / ".export-killed.tmp"  # what a kill while staging leaves
    leftover.mkdir()
    (leftover / MARKER).write_text("{}")
    (leftover / "image.onnx").write_bytes(b"half")
    check = ["--model", str(model_dir), "--out", str(out), "--format", "onnx", "--atol", "-1"]
    assert export_tool.main(check) == 1  # no difference is below -1: the check fails
    with monkeypatch.context() as m:
        m.setattr(export_hf, "write_hf", lambda *a: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left")))
        assert export_tool.main([*argv, "--format", "onnx,hf"]) == 2
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    assert (out / "export.json").read_bytes() == report
    capsys.readouterr()
    assert export_tool.main([*argv, "--format", "onnx"]) == 0  # the same model: its hf and programs stay
    assert "removed" not in capsys.readouterr().out
    kept = json.loads((out / "export.json").read_text())
    assert kept["hf"] == str(out / "hf") and set(kept["torch_export"]) == {"image", "text"}
    assert (out / "hf").is_dir() and (out / "image.pt2").is_file()
    other = _model_dir(prepared, tmp_path, embed_dim=8)  # other weights in the same model folder
    assert export_tool.main(["--model", str(other), "--out", str(out), "--no-check", "--format", "onnx"]) == 0
    assert "removed the earlier export's hf, image.pt2, text.pt2: another model's" in capsys.readouterr().out
    assert {p.name for p in out.iterdir()} - {MARKER} == {"image.onnx", "text.onnx", "export.json", "notes.txt"}
    assert (out / "notes.txt").read_text() == "mine"
    assert json.loads((out / "export.json").read_text())["onnx"] == {
        "image": str(out / "image.onnx"),
        "text": str(out / "text.onnx"),
    }


def test_a_torchvision_resnet_tower_goes_to_transformers_as_timm_builds_it(prepared, tmp_path):
    """ResNet-10 (torchvision's blocks) has no timm name: the hf folder names timm's resnet18 with one block a
    stage, and transformers' TimmWrapper builds it and gives mmfast's features (its head the projection)."""
    from transformers import AutoModel, AutoModelForImageClassification

    import tools.export as export_tool

    model = load_model(_model_dir(prepared, tmp_path))
    out = tmp_path / "export"
    assert export_tool.main(["--model", str(tmp_path / "model"), "--out", str(out), "--format", "hf"]) == 0
    config = json.loads((out / "hf" / "image" / "config.json").read_text())
    assert (config["architecture"], config["model_args"]) == ("resnet18", {"layers": [1, 1, 1, 1]})
    pixels = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = AutoModelForImageClassification.from_pretrained(out / "hf" / "image").eval()(pixel_values=pixels)
        pooled = AutoModel.from_pretrained(out / "hf" / "image").eval()(pixel_values=pixels).pooler_output
        features, _ = model.model.image(pixels)
    torch.testing.assert_close(pooled, features, rtol=1e-5, atol=1e-5)
    got = torch.nn.functional.normalize(logits.logits, dim=-1)
    torch.testing.assert_close(got, model.model.encode_image(pixels), rtol=1e-5, atol=1e-5)


def test_a_classifier_exports_its_towers_without_projections(prepared, tmp_path):
    """A fusion classifier's --format hf: its image and text towers as transformers models (features, no head);
    the fusion head is not there (towers.json names no embedding)."""
    from transformers import AutoModel, AutoTokenizer

    import tools.export as export_tool

    model = load_model(_model_dir(prepared, tmp_path, model="concat"))
    out = tmp_path / "export"
    argv = ["--model", str(tmp_path / "model"), "--out", str(out), "--format", "hf"]
    assert export_tool.main(argv) == 0
    towers = json.loads((out / "hf" / "towers.json").read_text())
    assert towers == {"format": "mmfast-towers/1", "model": "concat", "image": "image", "text": "text"}
    assert not (out / "hf" / "text" / "2_Dense").exists()
    tok = AutoTokenizer.from_pretrained(out / "hf" / "text")
    batch = tok(["a red circle", "two small blue squares"], padding=True, return_tensors="pt")
    with torch.no_grad():
        states = AutoModel.from_pretrained(out / "hf" / "text").eval()(**batch).last_hidden_state
        pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
        pooled = AutoModel.from_pretrained(out / "hf" / "image").eval()(pixel_values=pixels).pooler_output
        want_text = model.model.text(batch["input_ids"], batch["attention_mask"])
        want_image, _ = model.model.image(pixels)
    mask = batch["attention_mask"].unsqueeze(-1).float()
    torch.testing.assert_close((states * mask).sum(1) / mask.sum(1), want_text, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pooled, want_image, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_the_lite0_clip_preset_goes_to_open_clip_and_transformers(demo_manifest, prepared, photos, tmp_path):
    """``mmfast-train --model clip --preset clip-lite0-minilm`` (EfficientNet-Lite0 locked + all-MiniLM-L6-v2,
    the captions tokenized with MiniLM's vocabulary; the default preset's multiscale tower goes to neither):
    both exports reproduce mmfast's embeddings and retrieval."""
    import tools.export as export_tool
    import tools.train as train_tool

    run = tmp_path / "run"
    argv = ["--data", str(demo_manifest), "--out", str(run), "--model", "clip", "--epochs", "1", "--no-progress"]
    assert train_tool.main([*argv, "--preset", "clip-lite0-minilm"]) == 0
    config = json.loads((run / "model" / "config.json").read_text())
    assert (config["image_backbone"], config["text_model"]) == ("efficientnet-lite0", "minilm")
    out = run / "export"
    assert export_tool.main(["--model", str(run / "model"), "--out", str(out), "--format", "open_clip,hf"]) == 0
    inputs, ours = mmfast_inputs(run / "model", run / "prepared", photos, tmp_path)
    for script, folder in (("open_clip_embed", out / "open_clip"), ("hf_embed", out / "hf")):
        theirs = run_peer(script, folder, inputs, tmp_path)
        assert_same_embeddings(ours, theirs)
    oc = json.loads((out / "open_clip" / "open_clip_config.json").read_text())["model_cfg"]
    assert (oc["vision_cfg"]["timm_model_name"], oc["text_cfg"]["hf_pooler_type"]) == (
        "tf_efficientnet_lite0",
        "mean_pooler",
    )
