"""The zero-shot map (``--zero-shot-map kernel``): zero-shot classification that keeps the prompts a text tower
loses when it is fine-tuned on captions.

A dual encoder whose text tower trains on keyword-style captions finds those captions well and class prompts
("a photo of a {}.") less well than the pretrained tower did. The map keeps that tower's reading of the prompts
beside the trained one. It is a kernel ridge map from the locked image tower's features into the text tower's
space as it started, fitted on the train split once (``mmfast.train.prompt_map_fit``). A zero-shot score is
``weight`` times the model's cosine plus (1 - weight) times the map's: the cosine of the image's map embedding
and the prompts' embedding by the start's text tower. Retrieval and the embeddings ``--embed`` writes stay the
model's own.

The map holds, as frozen parameters (never trained, and not buffers: DDP would send those every step), the
train features' standardization, the landmark rows (standardized, unit length), the kernel weights, the
captions' mean, and a copy of the text tower's layers that train, as they started. An exported model
(ONNX, open_clip, Hugging Face) does not carry it.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.nn import functional as F

from mmfast.tasks.retrieval import class_embeddings


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class PromptMap(nn.Module):
    """A fitted kernel ridge map from image features (C) into the start text tower's space (D), and that start.

    Args:
        rows, width, text_width: the landmark rows M, the image features' width C, the text tower's D.
        gamma: the RBF kernel's exp(-gamma |a - b|^2), on standardized unit-length features.
        weight: the model's share of a zero-shot score (the map's: 1 - weight).
        text: the dual encoder's text tower now (at the start of training, or a shell to load weights into).
        text_start: "tower": its own output is the start's (a locked tower); "layers:K": a copy of its top K
            layers, the ones that train (the layers below stay locked); "copy": a copy of the whole tower.
    """

    def __init__(
        self, rows: int, width: int, text_width: int, gamma: float, weight: float, text: nn.Module, text_start: str
    ):
        super().__init__()
        if not 0 < weight <= 1:  # the model's part of a joined embedding is its embedding, scaled
            raise ValueError(f"the zero-shot map's weight must be in (0, 1], got {weight}")
        self.text_start = text_start
        # parameters, not attributes: a checkpoint carries them with the rest of the fit
        self.gamma = _frozen(torch.tensor(float(gamma)))
        self.weight = _frozen(torch.tensor(float(weight)))
        self.mean = _frozen(torch.zeros(width))
        self.std = _frozen(torch.ones(width))
        self.landmarks = _frozen(torch.zeros(rows, width))
        self.alpha = _frozen(torch.zeros(rows, text_width))
        self.text_mean = _frozen(torch.zeros(text_width))
        self.upper: nn.ModuleList | None = None
        self.tower: nn.Module | None = None
        if text_start.startswith("layers:"):
            k = int(text_start.split(":")[1])
            self.upper = nn.ModuleList(copy.deepcopy(list(text.model.encoder.layer[-k:])))
        elif text_start == "copy":
            self.tower = copy.deepcopy(text)
        elif text_start != "tower":
            raise ValueError(f"the zero-shot map's text start {text_start!r}: expected tower, copy or layers:K")
        self.requires_grad_(False).train(False)

    def train(self, mode: bool = True):
        return super().train(False)  # the start's text layers keep no dropout: a prompt embeds one way

    def describe(self) -> dict:
        """What config.json records to build this map's shell again (``from_record``)."""
        rows, width = self.landmarks.shape
        return {
            "kind": "kernel",
            "rows": rows,
            "width": width,
            "text_width": int(self.alpha.shape[1]),
            "gamma": float(self.gamma),
            "weight": float(self.weight),
            "text_start": self.text_start,
        }

    @classmethod
    def from_record(cls, record: dict, text: nn.Module) -> PromptMap:
        """An empty map of ``describe``'s record, its tensors to be loaded."""
        names = ("rows", "width", "text_width", "gamma", "weight")
        return cls(*(record[n] for n in names), text=text, text_start=record["text_start"])

    def set_fit(self, mean, std, landmarks, alpha, text_mean) -> None:
        """Put a fit's tensors in place (``mmfast.train.prompt_map_fit``)."""
        with torch.no_grad():
            for p, v in zip(
                (self.mean, self.std, self.landmarks, self.alpha, self.text_mean),
                (mean, std, landmarks, alpha, text_mean),
                strict=True,
            ):
                p.copy_(v.to(p))

    def image(self, pooled: torch.Tensor) -> torch.Tensor:
        """(B, D) normalized: image features (B, C) mapped into the start text tower's space."""
        with torch.autocast(pooled.device.type, enabled=False):  # the kernel in float32 under any precision
            z = F.normalize((pooled.float() - self.mean) / self.std, dim=-1)
            # |a - b|^2 = 2 - 2 a.b for unit rows
            k = torch.exp(-self.gamma * (2 - 2 * z @ self.landmarks.T).clamp(min=0))
            return F.normalize(k @ self.alpha + self.text_mean, dim=-1)

    def text(self, text: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(B, D) normalized: captions by the text tower as it started (``text``: the dual encoder's tower)."""
        if self.upper is not None:
            pooled = text.with_layers(input_ids, attention_mask, self.upper)
        else:
            pooled = (self.tower if self.tower is not None else text)(input_ids, attention_mask)
        return F.normalize(pooled.float(), dim=-1)

    def join(self, model_emb: torch.Tensor, map_emb: torch.Tensor) -> torch.Tensor:
        """The zero-shot embedding: [sqrt(w) model, sqrt(1 - w) map], unit length when both are, so that the dot
        product of two is w times the model's cosine plus (1 - w) times the map's."""
        w = self.weight.to(model_emb.dtype)
        return torch.cat([w.sqrt() * model_emb, (1 - w).sqrt() * map_emb], dim=-1)

    def ensemble(self, prompt_emb: torch.Tensor) -> torch.Tensor:
        """(C, D + D_txt): the prompt ensemble (``class_embeddings``) of joined embeddings (C, T, D + D_txt), of
        each part apart, joined again: a class's score stays w times one cosine plus (1 - w) times the other."""
        d = self.alpha.shape[1]
        return self.join(class_embeddings(prompt_emb[..., :-d]), class_embeddings(prompt_emb[..., -d:]))


def text_start(text: nn.Module) -> str:
    """How a map keeps ``text``'s start (``PromptMap``'s ``text_start``): nothing of a locked tower, a copy of
    the top layers that train, else a copy of the whole tower."""
    trains = [p.requires_grad for p in text.parameters()]
    if not any(trains):
        return "tower"
    frozen = getattr(text, "frozen_layers", 0)
    if frozen and hasattr(text, "with_layers"):
        return f"layers:{len(text.model.encoder.layer) - frozen}"
    return "copy"
