"""The dual encoder (CLIP / SigLIP): an image tower and a text tower, each projected into one shared embedding
space and L2-normalized, with the learnable temperature (and SigLIP's bias) that the contrastive task's loss
scales their dot products by; they start from that loss's own values (``tasks/losses.py``). Named "clip" in
``registry``; its objective is the "contrastive" task.

Locked-image tuning (LiT) is ``--freeze-image``: the image tower stays as it is (the encoder keeps its batch-norm
statistics in eval mode), its projection and the text tower learn. ``--text-train-layers N`` trains only the
text tower's top N layers; a feature cache may then hold the locked lower layers' output (``text_pooled``).

A zero-shot map (``--zero-shot-map kernel``: ``prompt_map``) may join the model's embeddings for zero-shot
classification only: ``encode_image`` / ``encode_text`` with ``zero_shot=True``, and "zero_shot_image" in the
output of ``forward`` in eval mode. Retrieval stays the model's own.

A tower that starts from a pretrained pair (``start_towers``: CLIP, open_clip) is ``projected``: it brings its own
projection, so none is added after it, and the pair's learned temperature (and SigLIP's bias) is the start.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from mmfast.models.encoders import ImageEncoder, TextEncoder
from mmfast.models.prompt_map import PromptMap
from mmfast.tasks.registry import LOSSES
from mmfast.util.voice import setting

MAX_LOGIT_SCALE = 100.0  # exp(logit_scale) is clamped to this (CLIP: "to prevent scaling the logits by more")


class DualEncoder(nn.Module):
    """Image and text towers (pooled encoder features) with a bias-free linear projection each into
    ``embed_dim``; the outputs are L2-normalized float32 whatever the autocast dtype.

    ``forward(batch)`` returns {"image": (B, D), "text": (B, D), "logit_scale": exp(t) clamped to 100 (0-dim),
    "logit_bias": b (0-dim; a fixed 0 for CLIP)}. ``num_classes``, ``hidden`` and ``dropout`` are the factory's
    common arguments and are not used (no classifier head).

    Above the clamp the temperature's gradient is zero, as ``torch.clamp`` gives it: it then holds at 100.
    """

    modalities = ("image", "text")
    task = "contrastive"  # the objective --task defaults to (mmfast.train.resolve.resolve_preset)
    default_preset = "clip-lite2-minilm"  # what --preset defaults to: the best measured recipe, offline (#45)
    start_preset = "clip-lite0-minilm"  # and with --init-from: the recipe the starts were tested with
    config_options = ("loss", "embed_dim")  # TrainConfig fields build_model passes as keyword arguments
    classifies = False  # no classifier head: build_model does not ask for two or more classes
    image_proj_start = True  # its projections can start from the ridge fit (--init-proj ridge: train/warm_start)
    takes_image_features = True  # a batch may carry the locked image tower's output (--feature-cache)
    takes_text_features = True  # and the locked text tower's, or its locked lower layers' (text_pooled)

    def __init__(
        self,
        image: ImageEncoder,
        text: TextEncoder,
        num_classes: int = 0,
        hidden: int = 512,
        dropout: float = 0.1,
        loss: str = "clip",
        embed_dim: int | None = 256,
    ):
        super().__init__()
        init = LOSSES.pick(loss)  # its initial temperature and bias (tasks/losses.py); ValueError if unknown
        embed_dim = _embed_dim(image, text, embed_dim)
        self.image, self.text = image, text
        self.loss, self.embed_dim = loss, embed_dim
        self.image_proj = _projection(image, embed_dim)
        self.text_proj = _projection(text, embed_dim)
        start = _shared_start(image, text)
        scale = start.get("logit_scale")
        self.logit_scale = nn.Parameter(torch.tensor(init.init_logit_scale if scale is None else float(scale)))
        if init.init_logit_bias is not None:  # a loss that learns a bias (SigLIP)
            bias = start.get("logit_bias")
            self.logit_bias = nn.Parameter(torch.tensor(init.init_logit_bias if bias is None else float(bias)))
        else:  # no bias would learn (CLIP's softmax is shift-invariant): kept as a constant 0
            self.register_buffer("logit_bias", torch.tensor(0.0))
        self.prompt_map: PromptMap | None = None  # set by the map's fit, or as a model directory records it

    def encode_image(self, images: torch.Tensor, zero_shot: bool = False) -> torch.Tensor:
        """Normalized image embeddings (B, D) float32 of a normalized image batch (B, 3, S, S); ``zero_shot``:
        joined with the zero-shot map's where the model has one (``PromptMap.join``: (B, D + D_txt))."""
        pooled, _ = self.image(images)  # (B, C_img)
        return self.encode_image_features(pooled, zero_shot)

    def encode_image_features(self, pooled: torch.Tensor, zero_shot: bool = False) -> torch.Tensor:
        """Normalized image embeddings (B, D) float32 of the image tower's output (B, C_img): what
        ``encode_image`` computes after the tower, for features a feature cache stored."""
        emb = F.normalize(self.image_proj(pooled).float(), dim=-1)
        if zero_shot and self.prompt_map is not None:
            return self.prompt_map.join(emb, self.prompt_map.image(pooled))
        return emb

    def encode_text(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, zero_shot: bool = False):
        """Normalized text embeddings (B, D) float32 of token ids and their attention mask (B, L); ``zero_shot``:
        joined with the start text tower's where the model has a zero-shot map (class prompts)."""
        pooled = self.text(input_ids, attention_mask)  # (B, D_txt)
        emb = self.encode_text_features(pooled)
        if zero_shot and self.prompt_map is not None:
            return self.prompt_map.join(emb, self.prompt_map.text(self.text, input_ids, attention_mask))
        return emb

    def encode_text_features(self, pooled: torch.Tensor) -> torch.Tensor:
        """Normalized text embeddings (B, D) float32 of the text tower's output (B, D_txt): what ``encode_text``
        computes after the tower, for features a feature cache stored."""
        return F.normalize(self.text_proj(pooled).float(), dim=-1)

    def text_pooled(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The text tower's output (B, D_txt) for a batch: its cached ``text_features`` (a locked tower), the top
        layers run on its cached ``text_hidden`` (B, T, D_txt) (the locked lower layers' output), or the
        whole tower run on its ``input_ids`` / ``attention_mask``."""
        if "text_features" in batch:
            return batch["text_features"]
        if "text_hidden" in batch:
            return self.text.upper(batch["text_hidden"], batch["attention_mask"])
        return self.text(batch["input_ids"], batch["attention_mask"])

    def scale_and_bias(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(exp(t) clamped to MAX_LOGIT_SCALE, b), both 0-dim float32."""
        scale = self.logit_scale.float().clamp(max=math.log(MAX_LOGIT_SCALE)).exp()
        return scale, self.logit_bias.float()

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The embeddings of a batch: its ``image`` (B, 3, S, S), or the locked tower's output of it stored in a
        feature cache, ``image_features`` (B, C_img); and its ``input_ids`` / ``attention_mask``, or what a
        feature cache stored of them (``text_pooled``). In eval mode with a zero-shot map, also "zero_shot_image"
        (``encode_image``'s with ``zero_shot``)."""
        scale, bias = self.scale_and_bias()
        image = batch.get("image")
        pooled = self.image(image)[0] if image is not None else batch["image_features"]  # (B, C_img)
        img = self.encode_image_features(pooled)  # (B, D)
        txt = self.encode_text_features(self.text_pooled(batch))  # (B, D)
        out = {"image": img, "text": txt, "logit_scale": scale, "logit_bias": bias}
        if self.prompt_map is not None and not self.training:  # evaluation's zero-shot (B, D + D_txt)
            out["zero_shot_image"] = self.prompt_map.join(img, self.prompt_map.image(pooled))
        return out


def _embed_dim(image: nn.Module, text: nn.Module, embed_dim: int | None) -> int:
    """The shared width: a projected tower's (both of them, when both are), else ``embed_dim`` (256 if None)."""
    widths = {t.width for t in (image, text) if getattr(t, "projected", False)}
    if len(widths) > 1:
        raise ValueError(
            f"the image and text towers embed into {image.width} and {text.width} dims: not one space"
        )
    if widths and embed_dim is not None and embed_dim not in widths:
        raise ValueError(
            f"{setting('embed_dim', value=str(embed_dim))}: the pretrained tower embeds into {min(widths)} dims; "
            f"leave it unset or pass {min(widths)}"
        )
    embed_dim = min(widths) if widths else (256 if embed_dim is None else embed_dim)
    if embed_dim < 1:
        raise ValueError(f"embed_dim must be >= 1, got {embed_dim}")
    return embed_dim


def _projection(tower: nn.Module, embed_dim: int) -> nn.Module:
    """None after a tower that brings its own projection, else a bias-free linear map into ``embed_dim``."""
    if getattr(tower, "projected", False):
        return nn.Identity()
    return nn.Linear(tower.width, embed_dim, bias=False)


def _shared_start(image: nn.Module, text: nn.Module) -> dict:
    """The start both towers came from (its temperature and bias), or {} when they are not one pair's."""
    a, b = getattr(image, "start", None), getattr(text, "start", None)
    return a if a is not None and b is not None and a["path"] == b["path"] else {}
