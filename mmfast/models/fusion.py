"""The built-in models: three fusion families and the two single-modality baselines, each named in
``registry.MODELS``, taking the loader's batch dict and returning logits (B, num_classes).

- EarlyFusion (token level, MMBT-style): image feature-map cells projected to the text width and fed
  with the text tokens through the transformer as one sequence; classify from the joint [CLS].
- ConcatFusion (feature level): pooled image ++ pooled text -> MLP.
- LateFusion (decision level): one classifier per modality, logits combined (mean or learned weights).

- ImageOnly / TextOnly: one encoder + MLP head, the baselines every fusion result is compared with.
"""

from __future__ import annotations

import torch
from torch import nn

from mmfast.models.catalog import COMBINE
from mmfast.models.encoders import ImageEncoder, TextEncoder
from mmfast.util.voice import setting


def _mlp(d_in: int, hidden: int, num_classes: int, dropout: float) -> nn.Sequential:
    return nn.Sequential(nn.Linear(d_in, hidden), nn.GELU(), nn.Dropout(dropout), nn.Linear(hidden, num_classes))


class EarlyFusion(nn.Module):
    """Token-level fusion (MMBT-style).

    Sequence: [CLS] + K image tokens + the caption's tokens after its [CLS]; image tokens are the
    (h, w) cells of the CNN's last feature map (pooled to at most ``max_grid`` x ``max_grid``), projected
    to the text width, plus a learned grid position and a learned image-segment embedding. Image tokens
    sit right after [CLS], so their positions do not depend on how long the captions in a batch are.
    The joint attention mask is [1, 1 x K, caption mask]: caption padding stays hidden.
    """

    modalities = ("image", "text")

    def __init__(
        self,
        image: ImageEncoder,
        text: TextEncoder,
        num_classes: int,
        hidden: int = 512,
        dropout: float = 0.1,
        max_grid: int = 7,
    ):
        super().__init__()
        self.image, self.text = image, text
        d = text.width
        self.max_grid = max_grid
        self.pool = nn.AdaptiveAvgPool2d(max_grid)
        self.proj = nn.Linear(image.width, d)
        self.grid_pos = nn.Parameter(torch.zeros(max_grid * max_grid, d))
        self.segment = nn.Parameter(torch.zeros(d))
        nn.init.normal_(self.grid_pos, std=0.02)
        nn.init.normal_(self.segment, std=0.02)
        self.head = _mlp(d, hidden, num_classes, dropout)

    def image_tokens(self, images: torch.Tensor) -> torch.Tensor:
        _, fmap = self.image(images)  # (B, C, h, w)
        if fmap.shape[-1] > self.max_grid or fmap.shape[-2] > self.max_grid:
            fmap = self.pool(fmap)
        k = fmap.shape[-2] * fmap.shape[-1]
        cells = fmap.flatten(2).transpose(1, 2)  # (B, K, C)
        return self.proj(cells) + self.grid_pos[:k] + self.segment  # (B, K, D)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        ids, mask = batch["input_ids"], batch["attention_mask"]
        words = self.text.embed_tokens(ids)  # (B, T, D), T includes the caption's [CLS]
        img = self.image_tokens(batch["image"]).to(words.dtype)  # (B, K, D)
        seq = torch.cat([words[:, :1], img, words[:, 1:]], dim=1)  # (B, 1 + K + T - 1, D)
        ones = torch.ones(mask.shape[0], img.shape[1] + 1, dtype=mask.dtype, device=mask.device)
        joint_mask = torch.cat([ones, mask[:, 1:]], dim=1)
        if seq.shape[1] > self.text.max_positions:
            raise ValueError(
                f"{seq.shape[1]} tokens (image {img.shape[1]} + text {ids.shape[1]}) exceed the text "
                f"model's {self.text.max_positions} positions; lower {setting('max_length')} or the grid"
            )
        hidden = self.text.encode_embeddings(seq, joint_mask)  # (B, S, D)
        return self.head(hidden[:, 0])


class ConcatFusion(nn.Module):
    """Feature-level fusion: MLP over [LayerNorm(pooled image) (C_img) ; LayerNorm(pooled text) (D_txt)].

    The per-modality LayerNorm puts both on one scale (a 1280-d CNN vector would otherwise drown a 384-d
    sentence vector).
    """

    modalities = ("image", "text")

    def __init__(
        self,
        image: ImageEncoder,
        text: TextEncoder,
        num_classes: int,
        hidden: int = 512,
        dropout: float = 0.1,
    ):
        super().__init__()
        self.image, self.text = image, text
        self.image_norm, self.text_norm = nn.LayerNorm(image.width), nn.LayerNorm(text.width)
        self.head = _mlp(image.width + text.width, hidden, num_classes, dropout)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        img = self.image_norm(self.image(batch["image"])[0])  # (B, C_img)
        txt = self.text_norm(self.text(batch["input_ids"], batch["attention_mask"])).to(img.dtype)  # (B, D_txt)
        return self.head(torch.cat([img, txt], dim=1))


class LateFusion(nn.Module):
    """Decision-level fusion: per-modality classifiers whose logits are combined.

    combine="mean": (image_logits + text_logits) / 2; combine="learned": softmax(w) weighted sum with
    w learned end to end (starts at the mean).

    In training, with ``aux_weight`` > 0, the forward returns {"logits": combined, "aux": [image_logits,
    text_logits], "aux_weight": w}: the classification task's loss adds w x each branch's own loss, so each
    classifier learns to decide alone (a branch trained only through the sum can lean on the other one).
    """

    modalities = ("image", "text")
    config_options = ("combine",)  # TrainConfig fields build_model passes as keyword arguments

    def __init__(
        self,
        image: ImageEncoder,
        text: TextEncoder,
        num_classes: int,
        hidden: int = 512,
        dropout: float = 0.1,
        combine: str = "mean",
        aux_weight: float = 1.0,
    ):
        super().__init__()
        if combine not in COMBINE:
            raise ValueError(f"unknown combine '{combine}'; choose from {', '.join(COMBINE)}")
        self.image, self.text = image, text
        self.image_head = _mlp(image.width, hidden, num_classes, dropout)
        self.text_head = _mlp(text.width, hidden, num_classes, dropout)
        self.combine = combine
        self.aux_weight = aux_weight
        self.weights = nn.Parameter(torch.zeros(2)) if combine == "learned" else None

    def modality_logits(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        img, _ = self.image(batch["image"])
        txt = self.text(batch["input_ids"], batch["attention_mask"])
        return {"image": self.image_head(img), "text": self.text_head(txt)}

    def combine_logits(self, image_logits: torch.Tensor, text_logits: torch.Tensor) -> torch.Tensor:
        if self.weights is None:
            return (image_logits + text_logits) / 2
        w = torch.softmax(self.weights.float(), dim=0)
        return w[0] * image_logits + w[1] * text_logits

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor | dict:
        parts = self.modality_logits(batch)
        logits = self.combine_logits(parts["image"], parts["text"])
        if self.training and self.aux_weight > 0:
            return {"logits": logits, "aux": [parts["image"], parts["text"]], "aux_weight": self.aux_weight}
        return logits


class ImageOnly(nn.Module):
    """The image alone: MLP over the pooled image features (the caption is ignored)."""

    modalities = ("image",)

    def __init__(self, image: ImageEncoder, text: None, num_classes: int, hidden: int = 512, dropout: float = 0.1):
        super().__init__()
        self.image = image
        self.head = _mlp(image.width, hidden, num_classes, dropout)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.head(self.image(batch["image"])[0])


class TextOnly(nn.Module):
    """The caption alone: MLP over the pooled text features (the image is ignored)."""

    modalities = ("text",)

    def __init__(self, image: None, text: TextEncoder, num_classes: int, hidden: int = 512, dropout: float = 0.1):
        super().__init__()
        self.text = text
        self.head = _mlp(text.width, hidden, num_classes, dropout)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.head(self.text(batch["input_ids"], batch["attention_mask"]))
