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

lambda is picked on the run's own data (``pick_lambda``), as the frozen-tower ridge baseline picks its own: the
images of every fifth image group are held out of a fit, and the lambda whose start retrieves them best (mean
recall both ways, their captions as the candidates) is the one the start is then fitted with, on every sample.
A larger lambda keeps more of the text tower's geometry, which the zero-shot prompts rely on.

The clip presets start so: on the two real dev sets its recipe then beats the frozen-tower
baselines (a ridge map, a linear probe) on R@1 both ways, where from random projections it did not
(docs/benchmarks/notes/2026-12-02-contrastive-recipes.md).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from mmfast.data.batch import PAD_ID
from mmfast.tasks.retrieval import caption_groups, retrieval_figures

RIDGE_LAMBDA = 0.1  # per sample, on unit-RMS features: the start's when no held-out part can pick one
RIDGE_LAMBDAS = (0.03, 0.1, 0.3, 1.0, 3.0)  # what the held-out part picks among
HELD_OUT_EVERY = 5  # image group g is held out of the pick's fit when g % 5 == 0: on any process count alike
HELD_OUT_MAX = 4_000  # held-out samples the pick retrieves among at most (the first by sample id)
HELD_OUT_MIN = 20  # fewer held-out images than this: lambda is RIDGE_LAMBDA
# At most this many train samples (over all processes) enter the fit, a large set's first ones: a 1280 x 384
# map is well determined by far fewer, and the pass stays short on a corpus of millions.
RIDGE_SAMPLES = 50_000


@torch.no_grad()
def tower_grams(
    model, loader, accelerator, max_samples: int = RIDGE_SAMPLES, held_out: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """{"xx": X'X (C, C), "xt": X'T (C, D), "tt": T'T (D, D), "n": samples (0-dim)} in float64, summed over every
    process's share of ``loader`` (padding left out; each process stops after as many batches as make its share
    of ``max_samples``):
    the pooled image features X and the L2-normalized pooled text features T of ``model``'s towers.

    ``held_out``: (max id + 1,) bool, the samples a lambda is picked on (``pick_lambda``). Then also "held": the
    same sums over those samples only, and "held_rows": (ids (H,), X (H, C), T (H, D)) of the first
    ``HELD_OUT_MAX`` of them by id, from every process."""
    sums: dict[str, torch.Tensor] = {}
    held_sums: dict[str, torch.Tensor] = {}
    rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    was_training = model.training
    model.eval()
    batches = -(-max_samples // (accelerator.num_processes * loader.batch_size))  # the same on every process
    try:
        for k, batch in enumerate(loader):
            if k == batches:
                break
            keep = batch["id"] != PAD_ID
            x, t = tower_outputs(model, batch, accelerator)
            x, t = x[keep].double(), F.normalize(t[keep].float(), dim=-1).double()
            _add_grams(sums, x, t)
            if held_out is not None:
                ids = batch["id"][keep]
                held = held_out.to(ids.device)[ids]
                _add_grams(held_sums, x[held], t[held])
                # int64 on every process: a loader's ids may be int32, and the gather below needs one dtype
                rows.append((ids[held].long().cpu(), x[held].float().cpu(), t[held].float().cpu()))
    finally:
        model.train(was_training)
    c, d = model.image_proj.in_features, model.text_proj.in_features
    sums = _summed(sums or _zero_grams(c, d, accelerator.device), accelerator)
    if held_out is None:
        return sums
    sums["held"] = _summed(held_sums or _zero_grams(c, d, accelerator.device), accelerator)
    sums["held_rows"] = first_rows(rows, c, d, accelerator)
    return sums


def tower_outputs(model, batch: dict, accelerator) -> tuple[torch.Tensor, torch.Tensor]:
    """(the image tower's pooled features (B, C), the text tower's output (B, D)) of a batch, under the run's
    autocast: a feature cache's centre view is the image tower's output of these pixels (--feature-cache), and
    ``text_pooled`` reads what the cache stored of the text."""
    with accelerator.autocast():
        x = batch["image_features"] if "image" not in batch else model.image(batch["image"])[0]
        return x, model.text_pooled(batch)


def _add_grams(sums: dict[str, torch.Tensor], x: torch.Tensor, t: torch.Tensor) -> None:
    for key, value in (("xx", x.T @ x), ("xt", x.T @ t), ("tt", t.T @ t)):
        sums[key] = sums[key] + value if key in sums else value
    sums["n"] = sums.get("n", 0) + torch.tensor(float(x.shape[0]), dtype=torch.float64, device=x.device)


def _zero_grams(c: int, d: int, device) -> dict[str, torch.Tensor]:
    """The sums of no samples: what a process without a batch adds, so that the sum over processes still meets."""
    return {
        "xx": torch.zeros(c, c, dtype=torch.float64, device=device),
        "xt": torch.zeros(c, d, dtype=torch.float64, device=device),
        "tt": torch.zeros(d, d, dtype=torch.float64, device=device),
        "n": torch.zeros((), dtype=torch.float64, device=device),
    }


def _summed(sums: dict[str, torch.Tensor], accelerator) -> dict[str, torch.Tensor]:
    if accelerator.num_processes > 1:
        return {k: accelerator.reduce(v.contiguous(), reduction="sum") for k, v in sums.items()}
    return sums


def first_rows(
    rows: list, c: int, d: int, accelerator, most: int = HELD_OUT_MAX
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, X, T) of every process's ``rows`` (a list of (ids, X, T)), the first ``most`` by sample id."""
    ids = torch.cat([r[0] for r in rows]) if rows else torch.zeros(0, dtype=torch.int64)
    x = torch.cat([r[1] for r in rows]) if rows else torch.zeros(0, c)
    t = torch.cat([r[2] for r in rows]) if rows else torch.zeros(0, d)
    if accelerator.num_processes > 1:  # padded to the longest share (ids -1), gathered, the padding dropped
        device = accelerator.device
        ids = accelerator.pad_across_processes(ids.to(device), pad_index=-1)
        x, t = (accelerator.pad_across_processes(v.to(device)) for v in (x, t))
        ids, x, t = (accelerator.gather(v).cpu() for v in (ids, x, t))
        x, t, ids = x[ids >= 0], t[ids >= 0], ids[ids >= 0]
    order = ids.argsort()[:most]
    return ids[order], x[order], t[order]


def held_out_samples(image_groups: torch.Tensor) -> torch.Tensor:
    """(max id + 1,) bool: the samples ``pick_lambda`` holds out, those of every ``HELD_OUT_EVERY``-th image group
    (``image_groups``: per sample id its image's group, -1 for no row), so an image's captions fall on one side."""
    return (image_groups >= 0) & (image_groups % HELD_OUT_EVERY == 0)


def pick_lambda(grams: dict, embed_dim: int, image_groups: torch.Tensor) -> tuple[float, dict]:
    """The lambda of ``RIDGE_LAMBDAS`` whose start, fitted on the samples not held out (``tower_grams``' sums
    less its "held" ones), retrieves the held-out ones best: the mean recall both ways, each held-out image among
    the held-out captions. ``RIDGE_LAMBDA`` when fewer than ``HELD_OUT_MIN`` images are held out or none is fitted.

    Returns:
        (lambda, what summary.json records of the pick: the held-out images and each lambda's mean recall; empty
        when there was no pick).
    """
    held = grams["held"]
    fit = {k: grams[k] - held[k] for k in ("xx", "xt", "tt", "n")}
    ids, x, t = grams["held_rows"]
    first, text_image = caption_groups(image_groups[ids].tolist())
    if len(first) < HELD_OUT_MIN or float(fit["n"]) < 1:
        return RIDGE_LAMBDA, {}
    scores = {}
    for lam in RIDGE_LAMBDAS:
        image_w, text_w = ridge_projections(fit, embed_dim, lam)
        image = F.normalize(x[first] @ image_w.T.to(x), dim=-1)
        text = F.normalize(t @ text_w.T.to(t), dim=-1)
        scores[lam] = round(retrieval_figures(image, text, text_image)["mean_recall"], 2)
    best = max(scores, key=scores.get)  # ties: the smaller lambda (the first)
    return best, {"held_out_images": len(first), "mean_recall": {str(k): v for k, v in scores.items()}}


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


def ridge_start(
    model, loader, accelerator, lam: float | None = None, image_groups: torch.Tensor | None = None
) -> dict:
    """Set ``model``'s (a dual encoder's) projections to ``ridge_projections`` of ``loader``'s samples; returns
    the figures summary.json records under "init_proj".

    Args:
        lam: lambda per sample; None: picked on a held-out part of the samples (``pick_lambda``; that needs
            ``image_groups``, per sample id its image's group: ``ContrastiveTask.image_groups``), else
            ``RIDGE_LAMBDA``.
    """
    if not all(hasattr(model, name) for name in ("image_proj", "text_proj", "image", "text")):
        raise ValueError(
            "--init-proj ridge: the model has no image and text projections (use it with --model clip)"
        )
    t0 = time.perf_counter()
    pick = lam is None and image_groups is not None
    held = held_out_samples(image_groups) if pick else None
    grams = tower_grams(model, loader, accelerator, held_out=held)
    picked: dict = {}
    if pick:
        lam, picked = pick_lambda(grams, model.image_proj.out_features, image_groups)
    lam = RIDGE_LAMBDA if lam is None else lam
    image_w, text_w = ridge_projections(grams, model.image_proj.out_features, lam)
    with torch.no_grad():
        model.image_proj.weight.copy_(image_w.to(model.image_proj.weight))
        model.text_proj.weight.copy_(text_w.to(model.text_proj.weight))
    figures = {
        "method": "ridge",
        "lambda_per_sample": lam,
        "samples": int(grams["n"]),
        "seconds": round(time.perf_counter() - t0, 2),
    }
    if picked:
        figures["lambda_pick"] = picked
    return figures
