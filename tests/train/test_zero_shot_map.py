"""--zero-shot-map kernel (mmfast/models/prompt_map.py, mmfast/train/prompt_map_fit.py): zero-shot scores half by
the model and half by a kernel ridge map of the locked image tower into the text tower as it started; the
model's retrieval and its training are untouched."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import tools.train as train_tool
from mmfast.infer.embed import _class_embeddings, embed_rows, zero_shot_rows
from mmfast.infer.model_dir import load_model
from mmfast.models.encoders import TextEncoder
from mmfast.models.prompt_map import PromptMap
from mmfast.tasks.retrieval import class_embeddings, class_prompts, read_templates
from mmfast.train.prompt_map_fit import kernel_fit

ARGS = ["--model", "clip", "--preset", "tiny", "--freeze-image", "--text-train-layers", "1", "--embed-dim", "16"]
ARGS += ["--epochs", "2", "--batch-size", "32", "--image-size", "32", "--no-progress", "--mixed-precision", "no"]
MAP = ["--zero-shot-map", "kernel"]


def _train(prepared: Path, out: Path, *extra: str) -> Path:
    assert train_tool.main(["--data", str(prepared), "--out", str(out), *ARGS, *extra]) == 0
    return out


def _metrics(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(prepared, tmp_path_factory) -> dict[str, Path]:
    """The same run with and without the map, and one whose steps move nothing (its text tower: the start)."""
    root = tmp_path_factory.mktemp("zero-shot-map")
    return {
        "map": _train(prepared, root / "map", *MAP),
        "plain": _train(prepared, root / "plain"),
        "still": _train(prepared, root / "still", *MAP, "--lr", "1e-12", "--encoder-lr", "0"),
    }


def test_the_map_leaves_training_and_retrieval_as_they_were(runs):
    with_map, plain = _metrics(runs["map"]), _metrics(runs["plain"])
    for a, b in zip(with_map, plain, strict=True):
        assert a["train_loss"] == b["train_loss"]
        retrieval = [k for k in a if k.startswith("val_") and "zero_shot" not in k]
        assert len(retrieval) >= 8 and all(a[k] == b[k] for k in retrieval)
    summary = json.loads((runs["map"] / "summary.json").read_text())["zero_shot_map"]
    assert summary["method"] == "kernel" and summary["text_start"] == "layers:1" and summary["weight"] == 0.5
    assert summary["pick"]["held_out_images"] >= 20 and len(summary["pick"]["mean_recall"]) == 20
    assert "zero_shot_map" not in json.loads((runs["plain"] / "summary.json").read_text())
    config = json.loads((runs["map"] / "model-last" / "config.json").read_text())
    assert config["zero_shot_map"]["rows"] == summary["samples"]
    assert "--zero-shot-map kernel" in (runs["map"] / "model-last" / "README.md").read_text()  # the model card
    assert "zero_shot" not in (runs["plain"] / "model-last" / "README.md").read_text()
    a = load_model(runs["map"] / "model-last")
    b = load_model(runs["plain"] / "model-last")
    images = torch.randn(4, 3, 32, 32)
    assert torch.equal(a.encode_image(images), b.encode_image(images))  # --embed image: the model's own
    assert torch.equal(a.encode_text(["a cat"]), b.encode_text(["a cat"]))


def test_zero_shot_is_the_weighted_sum_of_the_models_and_the_start_towers_cosines(runs, prepared):
    """A class's score is w x the model's cosine + (1 - w) x the map's, the prompts of the map's side read by
    the text tower as the run started (the still run's), not the trained one; predict ranks by it."""
    model, still = load_model(runs["map"] / "model-last"), load_model(runs["still"] / "model-last")
    net, pmap = model.model, model.model.prompt_map
    start = still.model.text.model.encoder.layer[-1].state_dict()
    trained = net.text.model.encoder.layer[-1].state_dict()
    copied = pmap.upper[0].state_dict()
    assert all(torch.allclose(copied[k], start[k], atol=1e-8) for k in start)
    assert any(not torch.allclose(trained[k], start[k]) for k in start)  # the top layer trained
    names, w = model.class_names, float(pmap.weight)
    flat = [p for per in class_prompts(names, read_templates(None)) for p in per]
    tok = model.tokenizer(flat, padding=True, truncation=True, max_length=model.config["max_length"])
    tok = {k: torch.tensor(v) for k, v in tok.items()}
    pixels = torch.stack([model.transform(_rgb(r["image"])) for r in _val_rows(prepared)])
    with torch.no_grad():  # by hand: the model alone; the map's features and the start tower's prompts
        start_text = still.model.text(tok["input_ids"], tok["attention_mask"])
        k_cls = class_embeddings(start_text.reshape(len(names), -1, start_text.shape[1]))
        m_cls = class_embeddings(model.encode_text(flat).reshape(len(names), -1, net.embed_dim))
        pooled = net.image(pixels)[0]
        m_img, k_img = net.encode_image_features(pooled), pmap.image(pooled)
    by_hand = w * m_img @ m_cls.T + (1 - w) * k_img @ k_cls.T
    joined_cls = _class_embeddings(model, names, None)
    assert torch.allclose(model.encode_image(pixels, zero_shot=True) @ joined_cls.T, by_hand, atol=1e-5)
    assert torch.allclose(joined_cls, torch.cat([w**0.5 * m_cls, (1 - w) ** 0.5 * k_cls], 1), atol=1e-6)
    assert not torch.allclose(by_hand, m_img @ m_cls.T, atol=1e-2)  # the map moves the scores
    # mmfast-predict --classes: its images through the DALI pipeline, ranked by the joined scores
    got = zero_shot_rows(model, _val_rows(prepared), top_k=len(names))
    _, img, _ = embed_rows(model, _val_rows(prepared), "image", zero_shot=True)
    want = torch.softmax(net.scale_and_bias()[0] * torch.from_numpy(img) @ joined_cls.T, dim=1)
    for row, probs in zip(got, want, strict=True):
        assert row["class_id"] == int(probs.argmax())
        assert sorted(p for _, p in row["top_k"]) == pytest.approx(sorted(probs.tolist()), abs=1e-5)


def _val_rows(prepared: Path) -> list[dict]:
    return [json.loads(x) for x in (prepared / "val.jsonl").read_text().splitlines()][:24]  # absolute paths


def _rgb(path: str):
    from PIL import Image

    with Image.open(path) as im:
        return im.convert("RGB")


def test_training_and_evaluation_give_one_zero_shot_figure(runs, prepared, capsys):
    from mmfast.cli import evaluate

    assert evaluate.main(["--model", str(runs["map"] / "model-last"), "--data", str(prepared)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("zero-shot accuracy"))
    assert line.startswith(f"zero-shot accuracy {_metrics(runs['map'])[-1]['val_zero_shot_acc']:.1f}%")


def test_the_kernel_map_finds_a_smooth_function_of_the_features():
    """Held-out rows of a smooth function of the features' standardized direction are mapped onto their targets;
    lambda and gamma are picked on the held rows, and the landmarks are the standardized unit rows."""
    g = torch.Generator().manual_seed(0)
    scales = torch.linspace(0.5, 20, 6)  # scales standardization must undo
    x = torch.randn(400, 6, generator=g) * scales + 3
    u = F.normalize((x - 3) / scales, dim=-1)
    a, b = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
    t = F.normalize(torch.cat([u @ a, (u @ b) ** 2], 1), dim=-1)
    held = torch.tensor([i % 5 == 0 for i in range(400)])
    test = torch.arange(400) >= 350
    fit, (lam, gamma), picked = kernel_fit(x[~test], t[~test], held[~test], list(range(350)))
    assert picked["held_out_images"] == 70 and len(picked["mean_recall"]) == 20
    assert picked["mean_recall"][f"{lam:g},{gamma:g}"] == max(picked["mean_recall"].values())
    pmap = PromptMap(350, 6, 12, gamma, 0.5, TextEncoder("bert-tiny", vocab_size=30), "tower")
    pmap.set_fit(*fit)
    assert torch.allclose(pmap.landmarks.norm(dim=1), torch.ones(350), atol=1e-5)
    cos = (pmap.image(x[test]) * t[test]).sum(1)
    assert cos.min() > 0.95  # the targets' mean, what a map without its fit gives, is 0.43 on average
    unscaled = PromptMap(350, 6, 12, gamma, 0.5, TextEncoder("bert-tiny", vocab_size=30), "tower")
    unscaled.set_fit(torch.zeros(6), torch.ones(6), *fit[2:])  # the same map, the standardization left out
    assert (unscaled.image(x[test]) * t[test]).sum(1).mean() < 0.9


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["--text-train-layers", "1"], "needs a locked image tower (--freeze-image)"),  # ARGS less --freeze-image
        (["--model", "concat", "--freeze-image"], "needs a dual encoder (--model clip)"),
    ],
)
def test_a_map_the_run_cannot_keep_is_refused(prepared, tmp_path, capsys, extra, words):
    args = [a for a in ARGS if a != "--freeze-image"]
    argv = ["--data", str(prepared), "--out", str(tmp_path / "run"), *args, *extra, *MAP]
    assert train_tool.main(argv) != 0
    assert words in capsys.readouterr().err


@pytest.mark.slow
def test_a_resumed_run_fits_the_same_map_and_ends_as_the_full_run(prepared, tmp_path):
    full = _train(prepared, tmp_path / "full", *MAP, "--keep-checkpoints", "10")
    first = sorted((full / "checkpoints").iterdir())[0]
    part = tmp_path / "part"
    (part / "checkpoints").mkdir(parents=True)
    shutil.copy(full / ".mmfast-run", part / ".mmfast-run")
    shutil.copytree(first, part / "checkpoints" / first.name)
    _train(prepared, part, *MAP, "--keep-checkpoints", "10", "--resume", "latest")
    a = load_file(full / "model-last" / "model.safetensors")
    b = load_file(part / "model-last" / "model.safetensors")
    assert {"model.prompt_map.gamma", "model.prompt_map.weight", "model.prompt_map.alpha"} <= a.keys()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert _metrics(full)[-1]["val_zero_shot_acc"] == _metrics(part)[-1]["val_zero_shot_acc"]


def test_an_export_says_the_map_stays_behind(runs, tmp_path, capsys):
    from mmfast.cli import export

    assert (
        export.main(
            ["--model", str(runs["map"] / "model-last"), "--format", "torch", "--out", str(tmp_path / "a")]
        )
        == 0
    )
    assert "zero-shot map (--zero-shot-map) is not exported" in capsys.readouterr().out
    assert (
        export.main(
            ["--model", str(runs["plain"] / "model-last"), "--format", "torch", "--out", str(tmp_path / "b")]
        )
        == 0
    )
    assert "zero-shot map" not in capsys.readouterr().out


def test_a_presets_map_is_left_out_where_it_cannot_work_and_a_flags_is_refused():
    from mmfast.train.config import TrainConfig
    from mmfast.train.resolve import resolve_preset

    lite2 = {"preset": "clip-lite2-minilm"}
    assert resolve_preset(TrainConfig(model="clip", **lite2)).zero_shot_map == "kernel"
    assert resolve_preset(TrainConfig(model="concat", **lite2)).zero_shot_map == "none"
    assert resolve_preset(TrainConfig(model="clip", freeze_image=False, **lite2)).zero_shot_map == "none"
    with pytest.raises(ValueError, match="needs a locked image tower"):
        resolve_preset(TrainConfig(model="clip", freeze_image=False, zero_shot_map="kernel", **lite2))
