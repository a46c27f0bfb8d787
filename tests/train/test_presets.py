"""A preset is a whole recipe: its towers and its training fields (loss, feature cache, views, augmentation)
fill what the user left unset, and a flag or a --config key wins over each."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

LITE0, LITE2 = "clip-lite0-minilm", "clip-lite2-minilm"


def _recipe(*argv: str) -> tuple:
    from mmfast.train.flags import parse_config
    from mmfast.train.resolve import resolve_preset

    cfg = resolve_preset(parse_config(list(argv)))
    return cfg.loss, cfg.feature_cache, cfg.feature_views, cfg.augment, cfg.freeze_text, cfg.image_pool


def test_a_preset_fills_the_recipe_fields_and_a_flag_or_config_key_wins(tmp_path):
    assert _recipe("--model", "clip", "--preset", LITE0) == ("clip", "off", 4, True, False, "last")
    assert _recipe("--model", "clip", "--preset", LITE2) == ("siglip", "auto", 1, False, False, "multiscale")
    assert _recipe("--model", "clip") == _recipe("--model", "clip", "--preset", LITE2)  # the default clip preset
    flags = ["--loss", "clip", "--feature-cache", "off", "--feature-views", "3", "--augment", "--freeze-text"]
    assert _recipe("--model", "clip", "--preset", LITE2, *flags) == ("clip", "off", 3, True, True, "multiscale")
    config = tmp_path / "run.yaml"
    config.write_text("loss: clip\naugment: true\n")
    got = _recipe("--model", "clip", "--preset", LITE2, "--config", str(config), "--no-augment")
    assert got[:4] == ("clip", "auto", 1, False)  # the file's loss; the flag's augmentation over the file's


def test_a_presets_pooling_and_top_layers_are_for_its_own_towers():
    """The default's --image-pool multiscale and --text-train-layers 4 are for Lite2 and MiniLM: another tower
    named by flag pools its last map and trains whole (a ViT has no stages; DistilBERT no BERT layer stack)."""
    from mmfast.train.flags import parse_config
    from mmfast.train.resolve import resolve_preset

    def pool_layers(*argv: str) -> tuple:
        cfg = resolve_preset(parse_config(["--model", "clip", *argv]))
        return cfg.image_pool, cfg.text_train_layers

    assert pool_layers() == ("multiscale", 4)
    assert pool_layers("--image-backbone", "efficientnet-lite2", "--text-model", "minilm") == ("multiscale", 4)
    assert pool_layers("--image-backbone", "timm:vit_tiny_patch16_224") == ("last", 4)
    assert pool_layers("--text-model", "distilbert-base-uncased") == ("multiscale", None)
    assert pool_layers("--image-backbone", "resnet18", "--image-pool", "multiscale") == ("multiscale", 4)
    assert pool_layers("--text-model", "bert-tiny", "--text-train-layers", "1") == ("multiscale", 1)


def test_a_resume_under_another_default_preset_names_the_runs():
    """A run of --model clip's earlier default (clip-lite0-minilm) resumed without --preset now meets another
    recipe: the refusal names the preset to pass, not only each field that differs."""
    from mmfast.train.resume_rules import resume_differences

    saved, now = {"task": "contrastive", "preset": LITE0}, {"task": "contrastive", "preset": LITE2}
    assert resume_differences(saved, now) == [
        f"preset: '{LITE0}' -> '{LITE2}' (pass --preset {LITE0}: the run's recipe)"
    ]


def test_a_recipe_field_given_wrong_is_refused_naming_its_flag():
    from mmfast.train.config import TrainConfig

    with pytest.raises(ValueError, match="--feature-views must be an integer >= 1, got 0"):
        TrainConfig(feature_views=0)
    with pytest.raises(ValueError, match="--feature-cache must be"):
        TrainConfig(feature_cache="always")
    with pytest.raises(ValueError, match="--loss must be"):
        TrainConfig(loss="triplet")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_default_clip_preset_trains_on_cached_multiscale_features_and_leaves_a_model_that_takes_images(
    demo_manifest: Path, tmp_path: Path
):
    """``--model clip`` as a user runs it, its preset (clip-lite2-minilm) left to default: Lite2's ImageNet
    weights (a base dependency) locked at 192 px, its centre view cached once and read every epoch, SigLIP,
    MiniLM's top 4 layers training, the zero-shot map, on a raw manifest (prepared with MiniLM's vocabulary on
    the fly). config.json records that recipe, and the model directory embeds images, not features."""
    import torch

    from mmfast.infer.model_dir import load_model
    from mmfast.train import parse_config, train

    out = tmp_path / "run"
    flags = ["--model", "clip", "--data", str(demo_manifest), "--out", str(out)]
    flags += ["--no-progress"]
    flags += ["--epochs", "2", "--feature-cache-dir", str(tmp_path / "fc")]
    summary = train(parse_config(flags))
    cache = summary["feature_cache"]
    assert cache["built"] == "no cache yet" and cache["views"] == 1, cache
    run = json.loads((out / "config.json").read_text())
    keys = ("image_backbone", "image_size", "loss", "image_pool", "text_train_layers", "augment", "epochs")
    keys += ("zero_shot_map", "preset")
    assert {k: run[k] for k in keys} == {
        "preset": LITE2,
        "image_backbone": "efficientnet-lite2",
        "image_size": 192,
        "loss": "siglip",
        "image_pool": "multiscale",
        "text_train_layers": 4,
        "augment": False,
        "epochs": 2,
        "zero_shot_map": "kernel",
    }
    model = load_model(out / "model-last")
    assert (model.config["loss"], model.config["image_pool"]) == ("siglip", "multiscale")
    assert model.config["zero_shot_map"]["text_start"] == "layers:4" and summary["zero_shot_map"]["samples"] > 0
    card = (out / "model-last" / "README.md").read_text()
    assert "--image-pool multiscale" in card and "--zero-shot-map kernel" in card  # what it is, and where it goes
    with torch.no_grad():
        emb = model.encode_image(torch.rand(2, 3, 192, 192))
    assert emb.shape == (2, run["embed_dim"]) and torch.isfinite(emb).all()
