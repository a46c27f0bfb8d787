"""--init-proj ridge (mmfast/train/warm_start.py): the dual encoder's projections from the closed-form ridge map
of the towers' features, its lambda picked on held-out images; the sums over two processes equal one process's;
a run records it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from mmfast.train.warm_start import (
    RIDGE_LAMBDAS,
    held_out_samples,
    pick_lambda,
    ridge_projections,
    ridge_start,
    tower_grams,
)
from tests.conftest import free_port, n_rows, spawn_two

DIM = 16


def _grams(x: torch.Tensor, t: torch.Tensor) -> dict:
    x, t = x.double(), t.double()
    return {"xx": x.T @ x, "xt": x.T @ t, "tt": t.T @ t, "n": torch.tensor(float(len(x)), dtype=torch.float64)}


def _features(n: int = 300, c: int = 12, d: int = 10, rank: int | None = None, seed: int = 0):
    """Image features of very different scales (1e-3 .. 1e3 per column) and text features an exact linear map
    of them (of rank ``rank`` when given)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c, generator=g, dtype=torch.float64) * torch.logspace(-3, 3, c, dtype=torch.float64)
    a = torch.randn(c, d, generator=g, dtype=torch.float64)
    if rank is not None:
        a = torch.randn(c, rank, generator=g, dtype=torch.float64) @ torch.randn(rank, d, generator=g).double()
    return x, x @ a


def test_the_image_projection_is_the_ridge_map_into_the_text_space():
    """Text features that are a linear map of the image features: with a negligible lambda the image
    projection recovers that map on every feature scale (the unit-RMS scaling folded back in), and the text
    projection is the identity when the embedding is as wide as the text space."""
    x, t = _features()
    image_w, text_w = ridge_projections(_grams(x, t), embed_dim=t.shape[1], lam=1e-12)
    assert torch.equal(text_w, torch.eye(t.shape[1]))
    predicted = x.float() @ image_w.T
    assert torch.allclose(predicted, t.float(), rtol=1e-3, atol=1e-3 * float(t.abs().max()))


def test_a_narrower_embedding_keeps_the_text_spaces_leading_directions():
    """Text features of rank 4 embedded in 6 dimensions: P spans their space, so an image's projection equals
    its caption's; the rows of P are orthonormal, the leading direction first."""
    x, t = _features(d=10, rank=4)
    image_w, text_w = ridge_projections(_grams(x, t), embed_dim=6, lam=1e-12)
    assert image_w.shape == (6, x.shape[1]) and text_w.shape == (6, 10)
    assert torch.allclose(text_w @ text_w.T, torch.eye(6), atol=1e-5)
    images, texts = x.float() @ image_w.T, t.float() @ text_w.T
    assert torch.allclose(images, texts, rtol=1e-3, atol=1e-3 * float(texts.abs().max()))
    energy = (texts**2).sum(0)
    assert torch.all(energy[:-1] >= energy[1:] - 1e-3 * float(energy.max()))


def test_lambda_shrinks_and_no_samples_is_refused():
    x, t = _features()
    small, _ = ridge_projections(_grams(x, t), embed_dim=10, lam=1e-6)
    large, _ = ridge_projections(_grams(x, t), embed_dim=10, lam=10.0)
    assert float((x.float() @ large.T).norm()) < 0.5 * float((x.float() @ small.T).norm())
    with pytest.raises(ValueError, match="no samples"):
        ridge_projections(_grams(x[:0], t[:0]), embed_dim=10)


def _noisy_pairs(noise: float, n: int = 400, c: int = 300, d: int = 32):
    """More image features than a fifth of the samples, text a linear map of them plus ``noise``: a small lambda
    fits the noise, which only images outside the fit show."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, c, generator=g)
    t = x @ torch.randn(c, d, generator=g) + noise * c**0.5 * torch.randn(n, d, generator=g)
    t = torch.nn.functional.normalize(t, dim=-1).double()
    groups = torch.arange(n)  # an image each
    held = held_out_samples(groups)
    grams, held_grams = _grams(x, t), _grams(x[held], t[held])
    grams |= {"held": held_grams, "held_rows": (groups[held], x[held], t[held].float())}
    return grams, groups


def test_lambda_is_picked_on_held_out_images_the_fit_never_saw():
    """Noise-free pairs pick the smallest lambda, noisy ones a large one; the held-out images are out of the
    fit (in it, every lambda would retrieve them almost perfectly and the smallest would win)."""
    grams, groups = _noisy_pairs(0.0)
    lam, picked = pick_lambda(grams, 16, groups)
    assert lam == RIDGE_LAMBDAS[0] and picked["held_out_images"] == 80
    grams, groups = _noisy_pairs(2.0)
    lam, picked = pick_lambda(grams, 16, groups)
    assert lam >= 1.0 and max(picked["mean_recall"].values()) < 50, picked


def _tiny_dual(prepared: Path):
    from mmfast.data.dataset import PreparedDataset
    from mmfast.models import build_model

    torch.manual_seed(0)
    vocab = PreparedDataset(prepared).vocab_size
    return build_model(
        "clip", 0, image_backbone="resnet10", text_model="bert-tiny", vocab_size=vocab, embed_dim=DIM
    )


def _view_loader(prepared: Path, accelerator):
    from mmfast.loading.multimodal import MultimodalLoader

    return MultimodalLoader(
        prepared, "train", 32, shuffle=False, drop_last=False, train=False, size=32, accelerator=accelerator,
        num_workers=1, fp16=False,
    )  # fmt: skip


def _gram_worker(rank: int, port: int, prepared: str, out_dir: str) -> None:
    os.environ.update(
        {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
        | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    )
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    held = held_out_samples(_image_groups(Path(prepared)))
    grams = tower_grams(
        _tiny_dual(Path(prepared)), _view_loader(Path(prepared), accelerator), accelerator, held_out=held
    )
    if rank == 0:
        torch.save(grams, Path(out_dir) / "grams.pt")
    accelerator.wait_for_everyone()
    torch.distributed.destroy_process_group()


def _image_groups(prepared: Path) -> torch.Tensor:
    from mmfast.data.dataset import PreparedDataset
    from mmfast.tasks.contrastive import ContrastiveTask

    return ContrastiveTask(PreparedDataset(prepared)).image_groups


@pytest.mark.timeout(180)
def test_two_processes_sum_the_same_grams_as_one(prepared, tmp_path, cpu_accelerator):
    """Each of two processes reads half of the train split; the summed Gram matrices (and so the projections)
    equal one process's over the whole split, every sample counted once; so do the held-out part's sums and
    rows, and so the lambda picked."""
    spawn_two(_gram_worker, (free_port(), str(prepared), str(tmp_path)), 150)
    two = torch.load(tmp_path / "grams.pt")
    accelerator = cpu_accelerator
    groups = _image_groups(prepared)
    one = tower_grams(
        _tiny_dual(prepared), _view_loader(prepared, accelerator), accelerator, held_out=held_out_samples(groups)
    )
    assert int(one["n"]) == int(two["n"]) == n_rows(prepared, "train")
    assert 0 < int(one["held"]["n"]) == int(two["held"]["n"]) == len(one["held_rows"][0]) < int(one["n"]) / 3
    for a, b in [(one[k], two[k]) for k in ("xx", "xt", "tt")] + [
        (one["held"][k], two["held"][k]) for k in ("xx", "xt")
    ]:
        assert torch.allclose(b, a, rtol=1e-6, atol=1e-6 * float(a.abs().max()))
    assert torch.equal(one["held_rows"][0], two["held_rows"][0])
    for a, b in zip(one["held_rows"][1:], two["held_rows"][1:], strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)
    assert pick_lambda(one, DIM, groups) == pick_lambda(two, DIM, groups)


def test_the_ridge_start_embeds_train_images_near_their_captions(prepared, cpu_accelerator):
    """On the demo set's train split, the towers untrained: after ``ridge_start`` an image's nearest caption is
    its own far more often than from the random projections (which rank it near chance)."""
    from mmfast.data.dataset import PreparedDataset
    from mmfast.tasks.contrastive import ContrastiveTask

    accelerator = cpu_accelerator
    model = _tiny_dual(prepared).eval()
    task = ContrastiveTask(PreparedDataset(prepared))
    loader = _view_loader(prepared, accelerator)
    before = task.evaluate(accelerator, model, loader)
    figures = ridge_start(model, loader, accelerator, lam=1e-3)
    after = task.evaluate(accelerator, model, loader)
    assert figures["samples"] == n_rows(prepared, "train")
    assert after["val_i2t_r10"] > before["val_i2t_r10"] + 20, (before, after)
    assert after["val_t2i_r10"] > before["val_t2i_r10"] + 20, (before, after)


def test_a_run_records_its_start_and_a_classifier_refuses_it(prepared, tmp_path, capsys):
    import tools.train as train_tool

    common = ["--data", str(prepared), "--epochs", "1", "--batch-size", "16", "--image-size", "32"]
    common += ["--no-progress", "--mixed-precision", "no", "--preset", "tiny"]
    run = tmp_path / "clip"
    argv = [*common, "--out", str(run), "--model", "clip", "--embed-dim", str(DIM), "--init-proj", "ridge"]
    assert train_tool.main(argv) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["init_proj"]["method"] == "ridge"
    assert summary["init_proj"]["samples"] == n_rows(prepared, "train")
    picked = summary["init_proj"]["lambda_pick"]  # on the held-out fifth of the train images
    assert 20 <= picked["held_out_images"] < n_rows(prepared, "train") / 3
    assert summary["init_proj"]["lambda_per_sample"] == float(
        max(picked["mean_recall"], key=picked["mean_recall"].get)
    )
    choices = summary["hardware_choices"]  # on this CPU (mmfast/train/hardware.py)
    assert (choices["channels_last"], choices["optimizer_impl"], choices["grad_scaler"]) == (
        False,
        "foreach",
        False,
    )
    assert json.loads((run / "config.json").read_text())["init_proj"] == "ridge"
    assert train_tool.main([*common, "--out", str(tmp_path / "concat"), "--init-proj", "ridge"]) != 0
    assert "--init-proj ridge" in capsys.readouterr().err


def test_the_fit_reads_at_most_its_share_of_a_large_split(prepared, cpu_accelerator):
    """``max_samples`` bounds the pass: whole batches until the share is reached (40 -> two batches of 32)."""
    accelerator = cpu_accelerator
    grams = tower_grams(_tiny_dual(prepared), _view_loader(prepared, accelerator), accelerator, max_samples=40)
    assert int(grams["n"]) == 64 < n_rows(prepared, "train")
