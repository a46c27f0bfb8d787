"""The zero-shot map's fit (``--zero-shot-map kernel``; the map itself: ``mmfast.models.prompt_map``).

One no-gradient pass over the train split, as evaluation sees it (resized and center-cropped; a feature cache's
centre view), before the first step: the locked image tower's features X and the text tower's L2-normalized
output T of each sample, the towers as they start. Every process takes its first share of ``MAP_ROWS`` samples
in the seeded order of epoch 0 (a split sorted by class gives rows of every class), and all processes gather
them: each then fits the same map. A split of at most ``MAP_ROWS`` samples is used whole.

Each feature is standardized on those rows and made unit length. Kernel ridge with an RBF kernel
exp(-gamma |a - b|^2) maps it to T less T's mean. lambda and gamma are picked as ``--init-proj ridge`` picks its
lambda: the images of every fifth image group are held out of a fit, and the pair whose map retrieves them best
(mean recall both ways among their captions) is the one the map is then fitted with, on every row.

Nothing here depends on what training changes (a locked image tower, the text tower's start), so a resumed run
fits the same map again before its checkpoint is loaded. On the project's dev sets the map, beside the trained
model at weight 0.5, kept the ridge map's zero-shot accuracy where the model alone lost it
(docs/benchmarks/notes/2026-12-07-recipes-15.md offline, 2026-12-07-recipes-18.md in mmfast).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from mmfast.data.batch import PAD_ID
from mmfast.models.prompt_map import PromptMap, text_start
from mmfast.tasks.retrieval import caption_groups, retrieval_figures
from mmfast.train.warm_start import HELD_OUT_MIN, first_rows, held_out_samples, tower_outputs

MAP_ROWS = 2048  # samples the map is fitted on at most (its landmarks): a kernel solve of M x M per pick
MAP_WEIGHT = 0.5  # the model's share of a zero-shot score, the map's the rest
LAMBDAS = (1e-3, 1e-2, 1e-1, 1.0)  # kernel ridge's lambda, picked among on held-out images
GAMMAS = (0.25, 0.5, 1.0, 2.0, 4.0)  # the RBF kernel's gamma, on standardized unit-length features
DEFAULT_PICK = (1e-2, 1.0)  # (lambda, gamma) where too few images are held out to pick


@torch.no_grad()
def map_rows(model, loader, accelerator, most: int = MAP_ROWS) -> tuple[torch.Tensor, ...]:
    """(ids (N,), X (N, C) float32, T (N, D) float32 normalized) of the first ``most`` samples of ``loader`` over
    all processes (each process its share), ordered by sample id, on the CPU."""
    per_process = -(-most // accelerator.num_processes)
    rows, taken = [], 0
    was_training = model.training
    model.eval()
    try:
        for batch in loader:
            if taken >= per_process:
                break
            keep = batch["id"] != PAD_ID
            x, t = tower_outputs(model, batch, accelerator)
            ids = batch["id"][keep].long()[: per_process - taken]
            n = len(ids)
            rows.append((ids.cpu(), x[keep][:n].float().cpu(), F.normalize(t[keep][:n].float(), dim=-1).cpu()))
            taken += n
    finally:
        model.train(was_training)
    return first_rows(rows, model.image.width, model.text.width, accelerator, most)


def _unit(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    return F.normalize((x - mean) / std, dim=-1)


def _standardization(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    std = x.std(0) if len(x) > 1 else torch.ones(x.shape[1], dtype=x.dtype)
    return x.mean(0), std.clamp(min=1e-6)


def _kernel(a: torch.Tensor, b: torch.Tensor, gamma: float) -> torch.Tensor:
    return torch.exp(-gamma * (2 - 2 * a @ b.T).clamp(min=0))  # unit rows: |a - b|^2 = 2 - 2 a.b


def _pick(x: torch.Tensor, t: torch.Tensor, held: torch.Tensor, groups: list[int]) -> tuple[tuple, dict]:
    """(lambda, gamma) whose map, fitted on the rows not ``held``, retrieves the held rows best; and what
    summary.json records of the pick ({} when too few images are held out)."""
    first, text_image = caption_groups([g for g, h in zip(groups, held.tolist(), strict=True) if h])
    if len(first) < HELD_OUT_MIN or int((~held).sum()) < 2:
        return DEFAULT_PICK, {}
    mean, std = _standardization(x[~held])
    fit, test = _unit(x[~held], mean, std), _unit(x[held], mean, std)
    t_fit, t_test = t[~held], t[held]
    t_mean = t_fit.mean(0)
    scores = {}
    for gamma in GAMMAS:
        values, vectors = torch.linalg.eigh(_kernel(fit, fit, gamma))  # one decomposition, every lambda
        across = _kernel(test, fit, gamma) @ vectors  # (H, M)
        projected = vectors.T @ (t_fit - t_mean)  # (M, D)
        for lam in LAMBDAS:
            pred = F.normalize(across @ (projected / (values + lam)[:, None]) + t_mean, dim=-1)
            scores[lam, gamma] = retrieval_figures(pred[first].float(), t_test.float(), text_image)["mean_recall"]
    best = max(scores, key=lambda k: (scores[k], -LAMBDAS.index(k[0]), -GAMMAS.index(k[1])))
    record = {f"{lam:g},{gamma:g}": round(v, 2) for (lam, gamma), v in scores.items()}
    return best, {"held_out_images": len(first), "mean_recall": record}


def fit_prompt_map(model, loader, accelerator, image_groups: torch.Tensor, weight: float = MAP_WEIGHT) -> dict:
    """Fit ``model``'s (a dual encoder's) zero-shot map on ``loader``'s samples (the train split's centre view)
    and set it as ``model.prompt_map``; returns what summary.json records under "zero_shot_map".

    Args:
        image_groups: per sample id its image's group (``ContrastiveTask.image_groups``).

    A dual encoder with a locked image tower, as ``resolve_preset`` asks of every run with the map.

    Raises:
        ValueError: the pass gave no sample.
    """
    t0 = time.perf_counter()
    ids, x, t = map_rows(model, loader, accelerator)
    if len(ids) == 0:
        raise ValueError("--zero-shot-map kernel: the train split gave no samples to fit the map on")
    fit, (lam, gamma), picked = kernel_fit(x, t, held_out_samples(image_groups)[ids], image_groups[ids].tolist())
    pmap = PromptMap(len(ids), x.shape[1], t.shape[1], gamma, weight, model.text, text_start(model.text))
    pmap.set_fit(*fit)
    model.prompt_map = pmap.to(next(model.parameters()).device)
    figures = {"method": "kernel", "samples": len(ids), "lambda": lam, "gamma": gamma, "weight": weight}
    figures["text_start"] = pmap.text_start
    if picked:
        figures["pick"] = picked
    return figures | {"seconds": round(time.perf_counter() - t0, 2)}


def kernel_fit(x: torch.Tensor, t: torch.Tensor, held: torch.Tensor, groups: list[int]) -> tuple:
    """The kernel ridge map from features ``x`` (N, C) to normalized ``t`` (N, D), (lambda, gamma) picked with
    the rows ``held`` (N,) bool held out (``groups``: each row's image group), then fitted on every row.

    Returns:
        ((mean, std, landmarks, alpha, t mean): ``PromptMap.set_fit``'s tensors, float64; (lambda, gamma);
        what summary.json records of the pick, {} when there was none).
    """
    x, t = x.double(), t.double()
    (lam, gamma), picked = _pick(x, t, held, groups)
    mean, std = _standardization(x)
    z = _unit(x, mean, std)
    t_mean = t.mean(0)
    alpha = torch.linalg.solve(_kernel(z, z, gamma) + lam * torch.eye(len(z), dtype=z.dtype), t - t_mean)
    return (mean, std, z, alpha, t_mean), (lam, gamma), picked
