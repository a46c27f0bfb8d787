"""A closed-form start for the dual encoder's projections (``--init-proj ridge``): a linear probe solved in one
pass, then trained on (linear probe, then fine-tune: Kumar et al. 2022, "Fine-Tuning can Distort Pretrained
Features and Underperform Out-of-Distribution").

One no-gradient pass over the train split (resized and center-cropped, as evaluation sees it) sums, over every
process's samples, the Gram matrices of the towers' pooled features: X'X and X'T of the image features X and
the L2-normalized text features T, and T'T. From them, on every process alike:

- W = argmin ||X_s W - T||^2 + lambda n ||W||^2 with X_s the image features scaled to unit root mean square
  each (a ridge regression from image features into the text model's space, without an intercept: the
  projections have no bias);
- P: the ``embed_dim`` leading eigenvectors of T'T (the text space's main directions; the identity's first rows
  when ``embed_dim`` is at least the text width);
- text projection = P, image projection = P W' (the scaling folded in). An image then starts embedded where ridge
  puts it among the captions, and the contrastive loss trains on from there.

The preset clip-lite0-minilm starts so: on the two real dev sets its recipe then beats the frozen-tower
baselines (a ridge map, a linear probe) on R@1 both ways, where from random projections it did not
(docs/benchmarks/notes/2026-12-02-contrastive-recipes.md).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from mmfast.data.batch import PAD_ID

RIDGE_LAMBDA = 0.1  # per sample, on unit-RMS features: what a held-out fifth picked on both dev sets
# At most this many train samples (over all processes) enter the fit, a large set's first ones: a 1280 x 384
# map is well determined by far fewer, and the pass stays short on a corpus of millions.
RIDGE_SAMPLES = 50_000


@torch.no_grad()
def tower_grams(model, loader, accelerator, max_samples: int = RIDGE_SAMPLES) -> dict[str, torch.Tensor]:
    """{"xx": X'X (C, C), "xt": X'T (C, D), "tt": T'T (D, D), "n": samples (0-dim)} in float64, summed over every
    process's share of ``loader`` (padding left out; each process stops after as many batches as make its share
    of ``max_samples``):
    the pooled image features X and the L2-normalized pooled text features T of ``model``'s towers."""
    sums: dict[str, torch.Tensor] = {}
    was_training = model.training
    model.eval()
    batches = -(-max_samples // (accelerator.num_processes * loader.batch_size))  # the same on every process
    try:
        for k, batch in enumerate(loader):
            if k == batches:
                break
            keep = batch["id"] != PAD_ID
            with accelerator.autocast():
                # a feature cache's centre view is the tower's output of these pixels (--feature-cache)
                x = batch["image_features"] if "image" not in batch else model.image(batch["image"])[0]
                t = model.text_pooled(batch)  # the text tower's output, or what a feature cache stored of it
            x, t = x[keep].double(), F.normalize(t[keep].float(), dim=-1).double()
            for key, value in (("xx", x.T @ x), ("xt", x.T @ t), ("tt", t.T @ t)):
                sums[key] = sums[key] + value if key in sums else value
            sums["n"] = sums.get("n", 0) + torch.tensor(float(x.shape[0]), dtype=torch.float64, device=x.device)
    finally:
        model.train(was_training)
    if not sums:  # this process had no batch: zeros of the right shapes, so that the sum below still meets
        c, d = model.image_proj.in_features, model.text_proj.in_features
        device = accelerator.device
        sums = {
            "xx": torch.zeros(c, c, dtype=torch.float64, device=device),
            "xt": torch.zeros(c, d, dtype=torch.float64, device=device),
            "tt": torch.zeros(d, d, dtype=torch.float64, device=device),
            "n": torch.zeros((), dtype=torch.float64, device=device),
        }
    if accelerator.num_processes > 1:
        sums = {k: accelerator.reduce(v.contiguous(), reduction="sum") for k, v in sums.items()}
    return sums


def ridge_projections(
    grams: dict[str, torch.Tensor], embed_dim: int, lam: float = RIDGE_LAMBDA
) -> tuple[torch.Tensor, torch.Tensor]:
    """(image projection (embed_dim, C), text projection (embed_dim, D)) float32 from ``tower_grams``' sums: the
    ridge map from unit-RMS image features into the text space (``lam`` per sample), both sides then projected
    on the text space's ``embed_dim`` leading directions.

    Raises:
        ValueError: no samples.
    """
    n = float(grams["n"])
    if n < 1:
        raise ValueError("--init-proj ridge: the train split gave no samples to fit the projections on")
    xx, xt, tt = grams["xx"].double(), grams["xt"].double(), grams["tt"].double()
    scale = (xx.diagonal() / n).sqrt().clamp(min=1e-6)  # each image feature's root mean square
    xx_s = xx / scale[:, None] / scale[None, :]
    eye = torch.eye(xx.shape[0], dtype=xx.dtype, device=xx.device)
    w = torch.linalg.solve(xx_s + lam * n * eye, xt / scale[:, None]) / scale[:, None]  # (C, D) on raw features
    d = tt.shape[0]
    if embed_dim >= d:
        p = torch.eye(embed_dim, d, dtype=tt.dtype, device=tt.device)
    else:
        _, vectors = torch.linalg.eigh(tt)  # ascending eigenvalues
        p = vectors[:, -embed_dim:].flip(1).T  # (embed_dim, D), the leading direction first
    return (p @ w.T).float(), p.float()


def ridge_start(model, loader, accelerator, lam: float = RIDGE_LAMBDA) -> dict:
    """Set ``model``'s (a dual encoder's) projections to ``ridge_projections`` of ``loader``'s samples; returns
    the figures summary.json records under "init_proj"."""
    if not all(hasattr(model, name) for name in ("image_proj", "text_proj", "image", "text")):
        raise ValueError(
            "--init-proj ridge: the model has no image and text projections (use it with --model clip)"
        )
    t0 = time.perf_counter()
    grams = tower_grams(model, loader, accelerator)
    image_w, text_w = ridge_projections(grams, model.image_proj.out_features, lam)
    with torch.no_grad():
        model.image_proj.weight.copy_(image_w.to(model.image_proj.weight))
        model.text_proj.weight.copy_(text_w.to(model.text_proj.weight))
    return {
        "method": "ridge",
        "lambda_per_sample": lam,
        "samples": int(grams["n"]),
        "seconds": round(time.perf_counter() - t0, 2),
    }
