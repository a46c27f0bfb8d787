"""Towers in (mmfast/models/start_towers.py, start_dirs.py): a dual encoder starts from a model the user has on
disk, written here by its own library (a tiny Hugging Face CLIP saved by transformers, a tiny open_clip model
saved by open_clip), locked tower by tower or not; the captions are tokenized with its tokenizer; the
preprocessing its config names is recorded in the model directory; and the trained model goes back to that
library, loaded in a fresh process without mmfast, with mmfast's embeddings and retrieval."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_peers import assert_same_embeddings, mmfast_inputs, run_peer

from mmfast.data.tokenizer import load_tokenizer, tokenizer_fingerprint

RUN = ["--model", "clip", "--epochs", "1", "--batch-size", "16", "--no-progress", "--mixed-precision", "no"]
LOGIT_SCALE = 2.0  # the starts' temperature (log scale): not CLIP's init, log(1 / 0.07)


def _tokenizer(minilm_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(minilm_dir)


def hf_clip_dir(root: Path, minilm_dir: str) -> Path:
    """A tiny CLIP (random weights) saved by transformers with a tokenizer and an image processor."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel

    tok = _tokenizer(minilm_dir)
    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
    text |= dict(vocab_size=len(tok), max_position_embeddings=64, pad_token_id=tok.pad_token_id)
    text |= dict(bos_token_id=tok.cls_token_id, eos_token_id=tok.sep_token_id)  # its captions end with [SEP]
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
    vision |= dict(image_size=32, patch_size=8)
    torch.manual_seed(0)
    model = CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=16))
    with torch.no_grad():
        model.logit_scale.fill_(LOGIT_SCALE)
    out = root / "tiny-clip"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    processor = CLIPImageProcessor(
        size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}, image_mean=[0.5, 0.4, 0.3],
        image_std=[0.2, 0.25, 0.3],
    )  # fmt: skip
    processor.save_pretrained(out)
    return out


def open_clip_dir(root: Path, minilm_dir: str) -> Path:
    """A tiny open_clip model (timm image tower, BERT text tower, random weights) saved by open_clip."""
    import open_clip
    from open_clip.push_to_hf_hub import save_for_hf
    from transformers import BertConfig, BertModel

    tok = _tokenizer(minilm_dir)
    bert = root / "tiny-bert"
    config = BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=2)
    torch.manual_seed(0)
    BertModel(config, add_pooling_layer=False).save_pretrained(bert)
    tok.save_pretrained(bert)
    model_cfg = {
        "embed_dim": 16,
        "init_logit_scale": LOGIT_SCALE,
        "vision_cfg": {"image_size": 32, "timm_model_name": "test_efficientnet", "timm_proj": "linear"},
        "text_cfg": {"context_length": 32, "hf_model_name": str(bert), "hf_tokenizer_name": str(bert),
                     "hf_proj_type": "linear", "hf_pooler_type": "mean_pooler"},
    }  # fmt: skip
    model = open_clip.model.CustomTextCLIP(**model_cfg)
    preprocess = {"size": 32, "mean": (0.4, 0.4, 0.4), "std": (0.3, 0.3, 0.3), "interpolation": "bicubic"}
    open_clip.model.set_model_preprocess_cfg(model, preprocess | {"resize_mode": "shortest"})
    out = root / "tiny-open_clip"
    tokenizer = open_clip.tokenizer.HFTokenizer(str(bert), context_length=32)
    save_for_hf(model, tokenizer, model_cfg, str(out), safe_serialization=True)
    return out


def _train(tmp_path: Path, demo_manifest: Path, *flags: str) -> Path:
    import tools.train as train_tool

    run = tmp_path / "run"
    assert train_tool.main(["--data", str(demo_manifest), "--out", str(run), *RUN, *flags]) == 0
    return run


def _same_tokenizer(run: Path, start: Path) -> None:
    """The captions were tokenized with the start's tokenizer, and the model directory carries it."""
    theirs = tokenizer_fingerprint(load_tokenizer(start))
    assert tokenizer_fingerprint(load_tokenizer(run / "prepared" / "tokenizer")) == theirs
    assert tokenizer_fingerprint(load_tokenizer(run / "model" / "tokenizer")) == theirs


@pytest.mark.slow  # a training run and a fresh process to load the export: over the fast lane's budget
def test_a_transformers_clip_starts_the_dual_encoder_locked_image_and_goes_back(
    demo_manifest, photos, minilm_dir, tmp_path
):
    from transformers import CLIPModel

    import tools.export as export_tool

    start = hf_clip_dir(tmp_path, minilm_dir)
    run = _train(tmp_path, demo_manifest, "--init-from", str(start), "--freeze-image")
    _same_tokenizer(run, start)
    config = json.loads((run / "model" / "config.json").read_text())
    assert (config["image_size"], config["embed_dim"], config["image_tower"]["kind"]) == (32, 16, "hf-clip")
    assert config["mean"] == pytest.approx([0.5, 0.4, 0.3]) and config["std"] == pytest.approx([0.2, 0.25, 0.3])
    weights = load_file(str(run / "model" / "model.safetensors"))
    ref = CLIPModel.from_pretrained(start).state_dict()
    patch = "vision_model.embeddings.patch_embedding.weight"
    assert torch.equal(weights[f"model.image.module.{patch}"], ref[patch])  # locked: as it started
    assert torch.equal(weights["model.image.module.visual_projection.weight"], ref["visual_projection.weight"])
    assert not torch.equal(weights["model.text.module.text_projection.weight"], ref["text_projection.weight"])
    assert abs(float(weights["model.logit_scale"]) - LOGIT_SCALE) < 0.1  # the start's temperature, trained on
    out = run / "export"
    assert export_tool.main(["--model", str(run / "model"), "--out", str(out), "--format", "hf"]) == 0
    inputs, ours = mmfast_inputs(run / "model", run / "prepared", photos, tmp_path)
    theirs = run_peer("clip_embed", out / "hf", inputs, tmp_path)
    assert str(theirs["kind"]) == "CLIPModel"
    assert_same_embeddings(ours, theirs)
    assert float(theirs["logit_scale"]) == pytest.approx(float(weights["model.logit_scale"]))
    # the start's own processor: its bicubic filter and shortest edge, followed in training and written back
    assert (config["interpolation"], config["resize_mode"], config["crop_ratio"]) == ("bicubic", "shortest", 1.0)
    pre = json.loads((out / "hf" / "preprocessor_config.json").read_text())
    assert (pre["size"], pre["crop_size"]) == ({"shortest_edge": 32}, {"height": 32, "width": 32})
    assert (pre["image_mean"], pre["image_std"], pre["resample"]) == (config["mean"], config["std"], 3)
    assert export_tool.main(["--model", str(run / "model"), "--out", str(out), "--format", "open_clip"]) == 2


@pytest.mark.slow
def test_an_open_clip_model_starts_the_dual_encoder_locked_text_and_goes_back(
    demo_manifest, photos, minilm_dir, tmp_path, capsys
):
    import tools.export as export_tool

    start = open_clip_dir(tmp_path, minilm_dir)
    run = _train(tmp_path, demo_manifest, "--init-from", str(start), "--freeze-text")
    _same_tokenizer(run, start)
    config = json.loads((run / "model" / "config.json").read_text())
    assert (config["image_size"], config["embed_dim"], config["text_tower"]["kind"]) == (32, 16, "open_clip")
    assert config["mean"] == pytest.approx([0.4] * 3) and config["std"] == pytest.approx([0.3] * 3)
    weights = load_file(str(run / "model" / "model.safetensors"))
    ref = load_file(str(start / "open_clip_model.safetensors"))
    assert torch.equal(weights["model.text.module.proj.weight"], ref["text.proj.weight"])  # locked
    assert not torch.equal(weights["model.image.module.head.proj.weight"], ref["visual.head.proj.weight"])
    assert abs(float(weights["model.logit_scale"]) - LOGIT_SCALE) < 0.1
    out = run / "export"
    assert export_tool.main(["--model", str(run / "model"), "--out", str(out), "--format", "open_clip"]) == 0
    inputs, ours = mmfast_inputs(run / "model", run / "prepared", photos, tmp_path)
    theirs = run_peer("open_clip_embed", out / "open_clip", inputs, tmp_path)
    assert str(theirs["kind"]) == "CustomTextCLIP"
    assert_same_embeddings(ours, theirs)
    capsys.readouterr()
    assert export_tool.main(["--model", str(run / "model"), "--out", str(out), "--format", "hf"]) == 2
    refused = "the image tower is open_clip's TimmModel, not CLIP's; export it with --format open_clip, onnx or "
    refused += "torch"
    assert refused in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["vit", "siglip"])
def test_a_vision_model_directory_is_an_image_tower_rebuilt_without_it(kind, prepared, tmp_path):
    """--image-backbone DIR: a Hugging Face ViT (its pooled output, then a new projection) or SigLIP's vision
    tower (its own head: no projection after it). The model directory's record rebuilds it once DIR is gone."""
    import shutil

    from transformers import SiglipConfig, SiglipModel, ViTConfig, ViTModel

    from mmfast.infer.model_dir import MmfastModel
    from mmfast.models import build_model

    shape = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    folder = tmp_path / kind
    torch.manual_seed(0)
    if kind == "vit":
        ViTModel(ViTConfig(**shape, image_size=32, patch_size=8)).save_pretrained(folder)
    else:
        vision = dict(shape, image_size=32, patch_size=8)
        config = SiglipConfig(text_config=dict(shape, vocab_size=99), vision_config=vision)
        SiglipModel(config).save_pretrained(folder)
    vocab = len(load_tokenizer(prepared / "tokenizer"))
    net = build_model(
        "clip", 0, image_backbone=str(folder), text_model="bert-tiny", vocab_size=vocab, embed_dim=None
    ).eval()
    assert isinstance(net.image_proj, torch.nn.Identity) == (kind == "siglip")
    assert net.embed_dim == (32 if kind == "siglip" else 256)
    config = {
        "model": "clip", "task": "contrastive", "loss": "clip", "embed_dim": net.embed_dim, "num_classes": 2,
        "class_names": ["a", "b"], "image_backbone": str(folder), "text_model": "bert-tiny", "vocab_size": vocab,
        "hidden": 32, "dropout": 0.1, "image_size": 32, "mean": [0.5] * 3, "std": [0.5] * 3, "max_length": 32,
        "image_tower": net.image.record,
    }  # fmt: skip
    shutil.rmtree(folder)
    rebuilt = MmfastModel(config)
    rebuilt.model.load_state_dict(net.state_dict(), strict=True)
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(rebuilt.model.encode_image(pixels), net.encode_image(pixels))


@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_a_processors_resize_is_the_starts_eval_geometry(kind, tmp_path):
    """A Hugging Face start's image processor, as transformers saves it, sets mmfast's eval resize: CLIP's
    bicubic shortest edge and centre crop (224 of 256: a crop ratio of 0.875), SigLIP's square resize."""
    from transformers import CLIPImageProcessor, SiglipImageProcessor

    from mmfast.models.start_dirs import start_preprocess

    folder = tmp_path / kind
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": kind}))
    if kind == "clip":
        CLIPImageProcessor(size={"shortest_edge": 256}, crop_size=224).save_pretrained(folder)
        want = {"image_size": 224, "interpolation": "bicubic", "resize_mode": "shortest", "crop_ratio": 0.875}
    else:
        SiglipImageProcessor(size={"height": 224, "width": 224}).save_pretrained(folder)
        want = {"image_size": 224, "interpolation": "bicubic", "resize_mode": "squash"}
    got = start_preprocess(folder)
    assert {k: v for k, v in got.items() if k not in ("mean", "std")} == want


def test_init_from_refuses_what_is_not_a_pair(minilm_dir):
    from mmfast.models.start_dirs import start_fields
    from mmfast.train.config import TrainConfig

    with pytest.raises(ValueError, match="--init-from .*: not an open_clip model directory"):
        start_fields(TrainConfig(model="clip", init_from=minilm_dir))


def test_a_tower_from_a_directory_pools_as_it_was_trained(minilm_dir, tmp_path):
    """--init-from without --preset takes clip-lite0-minilm's recipe, the one the starts were tested with, not the
    default's. A preset's --image-pool multiscale and --text-train-layers 4 are for the towers it names: a
    directory's towers keep their own pooling and train whole, and asking a directory's tower for multiscale by
    flag is refused, naming the flag."""
    from mmfast.models import build_model
    from mmfast.train.config import TrainConfig
    from mmfast.train.resolve import resolve_preset

    clip = hf_clip_dir(tmp_path, minilm_dir)
    assert resolve_preset(TrainConfig(model="clip")).image_pool == "multiscale"  # the default, clip-lite2-minilm
    started = resolve_preset(TrainConfig(model="clip", init_from=str(clip)))
    assert (started.preset, started.loss, started.image_pool, started.text_train_layers) == (
        "clip-lite0-minilm",
        "clip",
        "last",
        None,
    )
    lite2 = resolve_preset(TrainConfig(model="clip", init_from=str(clip), preset="clip-lite2-minilm"))
    assert (lite2.loss, lite2.image_pool, lite2.text_train_layers) == ("siglip", "last", None)
    assert resolve_preset(TrainConfig(model="clip")).text_train_layers == 4
    assert resolve_preset(TrainConfig(model="clip", image_pool="last")).image_pool == "last"
    with pytest.raises(ValueError, match="pools as it was trained to; multiscale reads a CNN's stages"):
        build_model("clip", 2, image_backbone=str(clip), text_model=str(clip), image_pool="multiscale")
