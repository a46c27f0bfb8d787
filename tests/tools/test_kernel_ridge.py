"""The kernel ridge baseline (tools/experiments/contrastive_baselines.py) on a map a linear one cannot fit:
captions that are a nonlinear function of the image features. It must find them far more often than the ridge
map does, and give unit embeddings, val's rows in order, and a lambda and gamma from its grid."""

from __future__ import annotations

import torch

from tools.experiments.contrastive_baselines import KERNEL_GRID, kernel_ridge_embeddings, ridge_embeddings, score


def _split(n: int, w1, w2, centres, gen) -> dict:
    x = torch.nn.functional.normalize(torch.randn(n, w1.shape[1], generator=gen), dim=-1)
    t = torch.nn.functional.normalize((x @ w1.T) ** 2 @ w2.T, dim=-1)  # even in x: no linear map fits it
    return {"x": x, "t": t, "label": (t @ centres.T).argmax(1), "group": torch.arange(n)}


def test_kernel_ridge_fits_what_a_linear_map_cannot():
    gen = torch.Generator().manual_seed(0)
    w1, w2 = torch.randn(16, 4, generator=gen), torch.randn(12, 16, generator=gen)
    centres = torch.nn.functional.normalize(torch.randn(4, 12, generator=gen), dim=-1)
    feats = {"train": _split(400, w1, w2, centres, gen), "val": _split(100, w1, w2, centres, gen)}
    feats["prompts"] = centres[:, None, :]  # one prompt per class: its centre
    img, txt, cls, picked = kernel_ridge_embeddings(feats)
    assert img.shape == (100, 12) and torch.allclose(img.norm(dim=-1), torch.ones(100))
    assert torch.allclose(txt, feats["val"]["t"]) and picked[0] in KERNEL_GRID["lambda"]
    kernel = score(img, txt, feats["val"], cls)
    linear = score(*ridge_embeddings(feats)[:2], feats["val"], cls)
    assert kernel["i2t_r1"] > linear["i2t_r1"] + 20, (kernel, linear)
    assert kernel["zero_shot_acc"] > linear["zero_shot_acc"], (kernel, linear)
