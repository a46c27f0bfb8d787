"""--text-train-layers N with --feature-cache (mmfast/models/encoders.py, mmfast/train/features.py,
mmfast/loading/feature_loader.py): only the text tower's top N layers train; its locked lower layers' output is
cached per caption, and a cached step gives the loss of the tokens it was computed from. A cache made for another
N or other locked weights is rebuilt, not read."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import val_figures
from test_feature_cache import FLAGS, _setup


def test_the_split_tower_is_the_whole_tower_and_only_its_top_layers_train():
    """``upper(lower(x))`` is the Hugging Face forward of the same weights; the embeddings and the lower layers
    get no gradient and apply no dropout in training mode; N at least the depth trains everything."""
    from mmfast.models.encoders import TextEncoder

    torch.manual_seed(0)
    whole = TextEncoder("bert-mini", vocab_size=100)
    split = TextEncoder("bert-mini", vocab_size=100, train_layers=1)
    split.load_state_dict(whole.state_dict())
    assert split.frozen_layers == 3 and TextEncoder("bert-mini", vocab_size=100, train_layers=4).frozen_layers == 0
    ids = torch.randint(1, 100, (3, 7))
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[1, 4:] = 0
    whole.eval(), split.eval()
    assert torch.allclose(whole(ids, mask), split(ids, mask), atol=1e-6)
    split.train()
    assert not split.model.encoder.layer[2].training and split.model.encoder.layer[3].training
    split(ids, mask).sum().backward()
    trained = {n for n, p in split.named_parameters() if p.grad is not None}
    assert trained and all(n.startswith("model.encoder.layer.3.") for n in trained)
    assert {n for n, p in split.named_parameters() if p.requires_grad} == trained


@pytest.mark.timeout(300)
def test_cached_lower_layers_give_the_loss_of_the_tokens_and_are_rebuilt_for_other_n_or_weights(
    prepared, tmp_path, cpu_accelerator
):
    """bert-mini with its top layer training: a cached batch gives the uncached batch's loss (the same dropout
    draws in the top layer) and the same gradient. A second build reads the cache; another N or other locked
    weights rebuild it; a change to the layer that trains does not."""
    from mmfast.loading.feature_loader import FeatureLoader
    from mmfast.train.features import build_image_features, build_text_features, text_partly_locked

    flags = ("--feature-cache", "on", "--text-model", "bert-mini", "--text-train-layers", "1")
    cfg, dataset, task, model, norm, pixels = _setup(prepared, tmp_path, cpu_accelerator, *flags)
    assert text_partly_locked(model) and model.text.frozen_layers == 3
    images, _ = build_image_features(cfg, cpu_accelerator, dataset, model, norm)
    hidden, figures = build_text_features(cfg, cpu_accelerator, dataset, model, pixels, hidden=True)
    assert figures["built"] == "no cache yet" and figures["locked_layers"] == 3
    assert hidden.dir.name == "train-text-hidden" and hidden.width % model.text.width == 0
    cached = FeatureLoader(pixels, images, text=hidden)
    model.train()
    a, b = next(iter(pixels)), next(iter(cached))
    assert torch.equal(a["input_ids"], b["input_ids"]) and b["text_hidden"].shape[:2] == a["input_ids"].shape
    grads = []
    for batch in (a, b):
        model.zero_grad()
        torch.manual_seed(0)  # the top layer's dropout: the same draws for both
        loss = task.loss(model(batch), task.targets(batch))
        loss.backward()
        grads.append((loss.detach(), model.text.model.encoder.layer[3].output.dense.weight.grad.clone()))
    assert torch.allclose(grads[0][0], grads[1][0], rtol=1e-5, atol=1e-6), grads
    assert torch.allclose(grads[0][1], grads[1][1], rtol=1e-4, atol=1e-6)

    _, again = build_text_features(cfg, cpu_accelerator, dataset, model, pixels, hidden=True)
    assert again["built"] is None
    with torch.no_grad():  # the layer that trains is not what the cache holds
        model.text.model.encoder.layer[3].output.dense.weight.add_(1e-2)
    assert build_text_features(cfg, cpu_accelerator, dataset, model, pixels, hidden=True)[1]["built"] is None
    with torch.no_grad():
        model.text.model.encoder.layer[0].output.dense.weight.add_(1e-3)
    _, other = build_text_features(cfg, cpu_accelerator, dataset, model, pixels, hidden=True)
    assert other["built"] == "the tower changed since it was built"
    flags = ("--feature-cache", "on", "--text-model", "bert-mini", "--text-train-layers", "2")
    cfg2, _, _, model2, _, _ = _setup(prepared, tmp_path, cpu_accelerator, *flags)
    _, deeper = build_text_features(cfg2, cpu_accelerator, dataset, model2, pixels, hidden=True)
    assert deeper["built"] == "the tower changed since it was built" and deeper["locked_layers"] == 2


def test_text_train_layers_is_refused_where_the_tower_cannot_split():
    from mmfast.models.encoders import TextEncoder

    with pytest.raises(ValueError, match="give -1"):
        TextEncoder("bert-tiny", vocab_size=50, train_layers=-2)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_run_with_the_top_text_layer_training_has_the_decoded_runs_losses(prepared, tmp_path):
    """Through mmfast-train, 2 epochs of 2 stored views: the cached run trains on the locked lower layers' cached
    output and has the per-epoch losses of the run that decodes and runs the whole text tower; a second run
    reads the cache."""
    from mmfast.train import parse_config, train

    common = ["--data", str(prepared), "--feature-cache-dir", str(tmp_path / "fc"), *FLAGS, "--epochs", "2"]
    common += ["--batch-size", "32", "--no-checkpoints", "--text-train-layers", "1", "--seed", "3"]
    off = train(parse_config([*common, "--out", str(tmp_path / "off")]))
    on = train(parse_config([*common, "--out", str(tmp_path / "on"), "--feature-cache", "on"]))
    again = train(parse_config([*common, "--out", str(tmp_path / "again"), "--feature-cache", "on"]))
    assert on["feature_cache"]["text"]["built"] == "no cache yet"
    assert again["feature_cache"]["text"]["built"] is None
    assert "captions' locked text layers" in on["images"]

    def losses(run):
        return [json.loads(x)["train_loss"] for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]

    assert len(losses("on")) == 2 and on["global_step"] == off["global_step"]
    assert np.allclose(losses("on"), losses("off"), rtol=1e-5) and losses("again") == losses("on")
    # evaluation read the val split's cached centre view and lower layers' output: the decoded run's figures
    assert on["feature_cache"]["val"]["text"]["locked_layers"] == on["feature_cache"]["text"]["locked_layers"]
    assert val_figures(tmp_path / "on") == pytest.approx(val_figures(tmp_path / "off"), abs=1e-6)
