"""The contrastive losses over the global batch, one class each (``ClipLoss``, ``SigLipLoss``), made by name with
``create_loss`` (``--loss``; the names are ``registry.LOSSES``). Each class also holds the temperature and bias a
dual encoder starts from when it trains with that loss (``models/dual.py`` reads them).

``contrastive_loss`` is one process's share of the loss: its rows against every process's columns
(``global_batch.gather_features``), the pairs that are no negative left out.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mmfast.data.batch import PAD_ID
from mmfast.tasks.global_batch import all_gather_rows, gather_features, gather_sizes, world
from mmfast.tasks.registry import LOSSES


@dataclass(frozen=True)
class Pairs:
    """This process's B rows against the M columns of the global batch (every process's samples)."""

    img: torch.Tensor  # (B, D) this process's image embeddings, float32
    txt: torch.Tensor  # (B, D) its text embeddings
    all_img: torch.Tensor  # (M, D) every process's
    all_txt: torch.Tensor  # (M, D)
    scale: torch.Tensor  # 0-dim: the logits' scale (the inverse temperature)
    bias: torch.Tensor  # 0-dim: the logits' bias
    rows: torch.Tensor  # (B,) each row's own column
    positive: torch.Tensor  # (B, M) a row's own pair
    excluded: torch.Tensor  # (B, M) no negative: a pair of one image or one caption group, or padding
    valid: torch.Tensor  # (B,) a row that is not padding


class ClipLoss:
    """CLIP (Radford et al. 2021): the mean of image->text and text->image cross-entropy over the logits
    ``scale * img @ txt.T``; a pair that is no negative is out of the softmax. It starts at temperature 0.07 and
    learns no bias: a softmax is shift-invariant."""

    name = "clip"
    init_logit_scale = math.log(1 / 0.07)
    init_logit_bias: float | None = None  # None: the model keeps a constant 0

    def __call__(self, p: Pairs) -> torch.Tensor:
        """The sum over this process's rows (0-dim)."""
        keep, target = p.excluded[p.valid], p.rows[p.valid]
        i2t = (p.scale * p.img[p.valid] @ p.all_txt.T).masked_fill(keep, float("-inf"))
        t2i = (p.scale * p.txt[p.valid] @ p.all_img.T).masked_fill(keep, float("-inf"))
        total = (F.cross_entropy(i2t, target, reduction="sum") + F.cross_entropy(t2i, target, reduction="sum")) / 2
        return total + 0.0 * p.bias  # every output takes part in the graph (DDP checks each parameter)


class SigLipLoss:
    """SigLIP (Zhai et al. 2023): ``-sum_i sum_j log sigmoid(z_ij (scale * img_i . txt_j + bias))``, z = 1 on the
    diagonal and -1 off it; a pair that is no negative is out of the sum. It starts at t' = log 10 and b = -10,
    so the many negative pairs of a batch start with a small loss."""

    name = "siglip"
    init_logit_scale = math.log(10.0)
    init_logit_bias: float | None = -10.0  # a learned bias

    def __call__(self, p: Pairs) -> torch.Tensor:
        """The sum over this process's rows (0-dim)."""
        logits = p.scale * p.img @ p.all_txt.T + p.bias  # (B, M)
        sign = p.positive.float() * 2 - 1
        counted = p.valid[:, None] & ~p.excluded
        return -torch.where(counted, F.logsigmoid(sign * logits), 0.0).sum()


def create_loss(name: str) -> ClipLoss | SigLipLoss:
    """The loss registered as ``name`` ("clip", "siglip").

    Raises:
        ValueError: no such loss ("unknown loss 'x'; choose from clip, siglip").
    """
    return LOSSES.pick(name)()


def contrastive_loss(
    loss: str | ClipLoss | SigLipLoss,
    out: dict,
    ids: torch.Tensor,
    groups: torch.Tensor,
    gather: Callable[[torch.Tensor, list[int]], torch.Tensor] = gather_features,
    tally: torch.Tensor | None = None,
) -> torch.Tensor:
    """This process's share of the global batch's loss: its rows against every process's columns.

    A pair (i, j != i) of one image group or one caption group is no negative; padding (id -1) is neither a row
    nor a column. Each process returns ``processes * its rows' sum / the global batch's samples``: the mean over
    processes (DDP's mean of the gradients) is the loss of one process on the whole batch.

    Args:
        loss: a loss, or its name ("clip" or "siglip").
        out: the model's output: {"image", "text": (B, D) normalized, "logit_scale", "logit_bias": 0-dim}.
        ids: (B,) sample ids, ``PAD_ID`` for padding.
        groups: (2, B) each sample's image group and caption group (``contrastive.sample_groups``).
        gather: how features reach every process (``gather_features``; a test passes one without gradient).
        tally: (2,) on the device, or None: gets this process's samples that had a negative, and its samples.

    Returns:
        The 0-dim loss.
    """
    loss = create_loss(loss) if isinstance(loss, str) else loss
    processes, rank = world()
    sizes = gather_sizes(ids.shape[0], ids.device)
    img, txt = out["image"].float(), out["text"].float()
    all_img, all_txt = gather(img, sizes), gather(txt, sizes)  # (M, D)
    all_ids, all_image_g, all_text_g = all_gather_rows(torch.cat([ids[None], groups]).T.contiguous(), sizes).T
    m = all_ids.shape[0]
    rows = torch.arange(ids.shape[0], device=ids.device) + sum(sizes[:rank])  # each row's own column
    positive = rows[:, None] == torch.arange(m, device=ids.device)[None]  # (B, M)
    same = (groups[0][:, None] == all_image_g[None]) | (groups[1][:, None] == all_text_g[None])
    excluded = (same & ~positive) | (all_ids == PAD_ID)[None]  # (B, M): not a negative
    valid = ids != PAD_ID
    samples = (all_ids != PAD_ID).sum().clamp(min=1)
    if tally is not None:  # added up on the device, read at the epoch's end
        with torch.no_grad():
            has_negative = (valid[:, None] & ~excluded & ~positive).any(1)
            tally += torch.stack([has_negative.sum(), valid.sum()]).to(tally.dtype)
    scale, bias = out["logit_scale"].float(), out["logit_bias"].float()
    total = loss(Pairs(img, txt, all_img, all_txt, scale, bias, rows, positive, excluded, valid))
    return processes * total / samples
