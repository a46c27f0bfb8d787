"""open_clip's own text tower (its ``TextTransformer``: token and positional embeddings, a causal transformer,
the final layer norm, pooling at the end-of-text token, the projection), read at any padded width.

open_clip pads every caption to its context length. mmfast pads a batch to its longest caption (or its bucket).
Under the causal mask no token sees a later one, so the pooled token's state is the same at any width that
holds the caption: the forward takes the first L positional embeddings and the causal mask's first L rows.
"""

from __future__ import annotations

import torch
from torch import nn

# open_clip's pooling of a causal text tower that a shorter padding leaves as it is (open_clip/transformer.py's
# text_global_pool): the first token, the highest id (CLIP's end-of-text), the first end-of-text id
POOLS = ("first", "argmax", "eos")


def check_text_cfg(text_cfg: dict, where: str) -> None:
    """Refuse an open_clip text tower whose embedding depends on the padding to its full context length.

    Raises:
        ValueError: a bidirectional tower, CoCa's appended class token, or pooling at the last position.
    """
    pool = text_cfg.get("pool_type", "argmax")
    if text_cfg.get("no_causal_mask") or text_cfg.get("embed_cls") or pool not in POOLS:
        raise ValueError(
            f"{where}: its text tower reads a caption padded to its full context length (no causal mask, an "
            f"appended class token or pooling '{pool}'), and mmfast pads to the longest caption of a batch; "
            "start its image tower (--image-backbone) only"
        )


class OpenClipText(nn.Module):
    """``forward(input_ids)`` -> the caption embedding (B, D) open_clip's ``encode_text`` gives (unnormalized).

    Args:
        tower: open_clip's ``TextTransformer`` (``open_clip.model._build_text_tower``), causal, no class token.
    """

    # torch.onnx's TorchScript exporter fixes nn.MultiheadAttention at the example's caption length: the ONNX
    # graph goes through torch.export instead (mmfast.infer.export)
    onnx_dynamo = True

    def __init__(self, tower: nn.Module):
        super().__init__()
        self.tower = tower
        self.max_positions = tower.num_pos  # the context length: a longer row is cut there

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        t = self.tower
        if input_ids.shape[1] > t.num_pos:  # rows end within the context: wider padding holds no token
            input_ids = input_ids[:, : t.num_pos]
        # the first L positions and causal mask rows, by index: an exported program keeps L dynamic
        at = torch.arange(input_ids.shape[1], device=input_ids.device)  # (L,)
        x = t.token_embedding(input_ids).to(t.transformer.get_cast_dtype())  # (B, L, C)
        x = x + t.positional_embedding[at].to(x.dtype)
        causal = t.attn_mask[at][:, at]  # (L, L): -inf above the diagonal
        x = t.ln_final(t.transformer(x, attn_mask=causal))  # (B, L, C)
        if t.pool_type == "first":
            pooled = x[:, 0]
        else:  # the end-of-text token: the highest id (argmax), or the first id equal to eos_id
            at = input_ids.argmax(-1) if t.pool_type == "argmax" else (input_ids == t.eos_id).int().argmax(-1)
            pooled = x[torch.arange(x.shape[0], device=x.device), at]  # (B, C)
        proj = t.text_projection
        if proj is None:
            return pooled
        return proj(pooled) if isinstance(proj, nn.Linear) else pooled @ proj
