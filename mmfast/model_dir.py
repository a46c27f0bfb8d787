"""The model directory a run leaves behind: everything needed to use the trained model, nothing else.

Layout (Hugging Face's ``save_pretrained`` layout, so ``push_to_hub`` works as it is):
    config.json         how to rebuild the network (fusion type, encoders, sizes), class names and the
                        preprocessing (image size, crop ratio, mean/std, max_length)
    model.safetensors   the weights
    tokenizer/          the tokenizer the model was trained with (copied from the prepared dataset)

``load_model(dir)`` (or ``MmfastModel.from_pretrained(dir)``) rebuilds it offline; the data directory is not
needed any more.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from huggingface_hub import PyTorchModelHubMixin
from torch import nn

from mmfast.fsutil import atomic_dir, file_lock
from mmfast.models import build_model
from mmfast.models.encoders import _quiet_transformers

FORMAT = "mmfast-model/1"
MODEL_CARD = """---
library_name: mmfast
tags: [mmfast, multimodal, image-text-classification, pytorch_model_hub_mixin]
---

An mmfast {model}-fusion classifier ({image_backbone} + {text_model}), {num_classes} classes, {image_size} px.

```python
import mmfast
model = mmfast.load_model("THIS_DIRECTORY")  # or mmfast.MmfastModel.from_pretrained(...)
```
"""


class MmfastModel(
    nn.Module,
    PyTorchModelHubMixin,
    library_name="mmfast",
    tags=["mmfast", "multimodal", "image-text-classification"],
):
    """A trained fusion model with what it needs to be used: class names and preprocessing.

    Args:
        config: the model directory's config.json (see ``model_config``).

    ``forward(batch)`` takes the loader's batch dict (``image`` (B, 3, S, S) normalized, ``input_ids`` /
    ``attention_mask`` (B, L)) and returns logits (B, C).
    """

    def __init__(self, config: dict):
        super().__init__()
        self.config = dict(config)
        extra = {"combine": config["combine"]} if config["model"] == "late" and "combine" in config else {}
        # image_weights=None: the backbone starts random (or from the packaged Lite0 weights) and the
        # trained weights replace it; nothing is downloaded.
        with _text_model_source(config) as text_model:
            self.model = build_model(
                config["model"],
                config["num_classes"],
                image_backbone=config["image_backbone"],
                text_model=text_model,
                vocab_size=config["vocab_size"],
                hidden=config["hidden"],
                dropout=config["dropout"],
                **extra,
            )
        self.model.eval()
        self.tokenizer = None  # set by load_model / from_pretrained on a local directory

    @property
    def class_names(self) -> list[str]:
        return list(self.config["class_names"])

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.model(batch)  # (B, C)

    @classmethod
    def _from_pretrained(cls, *, model_id: str, **kwargs):
        model = super()._from_pretrained(model_id=model_id, **kwargs)
        model.eval()
        tok_dir = Path(model_id) / "tokenizer"
        if tok_dir.is_dir():
            from mmfast.tokenizer import load_tokenizer

            model.tokenizer = load_tokenizer(tok_dir)
        return model


@contextlib.contextmanager
def _text_model_source(config: dict):
    """What to build the text encoder from, offline: a pretrained one (MiniLM, a hub name) is rebuilt from the
    architecture recorded in config.json ("text_config"), in a temp directory with random weights that the
    trained ones replace, so neither its package nor the hub is needed; random configs need nothing."""
    text_config = config.get("text_config")
    if config["model"] == "image" or text_config is None:
        yield config["text_model"]
        return
    from transformers import AutoConfig, AutoModel

    spec = dict(text_config)
    hf_config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    with tempfile.TemporaryDirectory(prefix="mmfast-text-") as tmp:
        with _quiet_transformers():  # no "Writing model shards" bar
            AutoModel.from_config(hf_config).save_pretrained(tmp)
        yield tmp


def load_model(model_dir: str | os.PathLike, device: str | torch.device = "cpu") -> MmfastModel:
    """Load a model directory written at the end of a run (``RUN/model`` or ``RUN/model-last``), offline.

    Args:
        model_dir: the directory (config.json, model.safetensors, tokenizer/).
        device: where the weights go.

    Returns:
        the model in eval mode, with ``.tokenizer`` and ``.config`` (class_names, image_size, mean, std, ...).

    Raises:
        FileNotFoundError: not a model directory.
    """
    model_dir = Path(model_dir)
    for name in ("config.json", "model.safetensors"):
        if not (model_dir / name).is_file():
            raise FileNotFoundError(
                f"{model_dir / name}: missing; pass a model directory written by tools/train.py (RUN/model)"
            )
    with contextlib.redirect_stdout(io.StringIO()):  # huggingface_hub prints "Loading weights from ..."
        model = MmfastModel.from_pretrained(str(model_dir), map_location=str(device), local_files_only=True)
    return model.to(device)


def load_for_inference(
    model_dir: str | os.PathLike, device: str | None = None
) -> tuple[MmfastModel, torch.device]:
    """The start-up of predict and evaluate: the device (the given one, else CUDA when there is one) and the
    model loaded onto it.

    Returns:
        (model, device).

    Raises:
        FileNotFoundError: not a model directory.
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return load_model(model_dir, device), device


def model_config(cfg, dataset, model: nn.Module, weights: str) -> dict:
    """config.json of a run's model directory.

    Args:
        cfg: the resolved TrainConfig.
        dataset: the PreparedDataset it trained on.
        model: the (unwrapped) network, for the normalization its image encoder expects.
        weights: "best" or "last".
    """
    from mmfast.models.encoders import RANDOM_TEXT_CONFIGS
    from mmfast.tokenizer import load_tokenizer

    image, text = getattr(model, "image", None), getattr(model, "text", None)
    prep = dataset.summary.get("config", {})
    # a pretrained text model's architecture, so load_model needs neither its package nor the hub
    text_config = (
        text.model.config.to_dict() if text is not None and cfg.text_model not in RANDOM_TEXT_CONFIGS else None
    )
    return {
        "format": FORMAT,
        "weights": weights,
        "model": cfg.model,
        "num_classes": dataset.num_classes,
        "class_names": sorted(dataset.labels, key=dataset.labels.get),
        "image_backbone": cfg.image_backbone,
        "text_model": cfg.text_model,
        **({"text_config": text_config} if text_config is not None else {}),
        "vocab_size": len(load_tokenizer(dataset.tokenizer_dir)),
        "hidden": cfg.hidden,
        "dropout": cfg.dropout,
        **({"combine": cfg.combine} if cfg.model == "late" else {}),
        "image_size": cfg.image_size,
        # 0..1 scale; the loader takes them x255
        "mean": list(image.mean) if image is not None else None,
        "std": list(image.std) if image is not None else None,
        "max_length": int(prep.get("max_length") or dataset.summary.get("max_length")),
        "eval_batch_size": cfg.eval_batch_size,
        "max_pixels": dataset.max_pixels,
    }


def save_model_dir(
    out: str | os.PathLike, state_dict: dict[str, torch.Tensor], config: dict, tokenizer_dir: Path
) -> Path:
    """Write a model directory atomically: a temp directory beside ``out`` takes its place when complete, so a
    killed run leaves the old directory or the new one, never half of one.

    Args:
        out: the directory (replaced when mmfast wrote it).
        state_dict: the network's weights (keys as in the network built by ``build_model``).
        config: ``model_config(...)``.
        tokenizer_dir: the tokenizer to copy in.
    """
    from safetensors.torch import save_file

    out = Path(out)
    # What MmfastModel.save_pretrained writes, without building the network again (MiniLM, Lite0: seconds).
    # Keys carry the wrapper's "model." prefix; clones, because safetensors refuses tensors sharing storage.
    weights = {f"model.{k}": v.detach().cpu().contiguous().clone() for k, v in state_dict.items()}
    with file_lock(out.parent / f".{out.name}.lock"), atomic_dir(out, "mmfast model directory") as tmp:
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        (tmp / "README.md").write_text(MODEL_CARD.format(**config))
        shutil.copytree(tokenizer_dir, tmp / "tokenizer")
        _readable(tmp)
    return out


def _readable(root: Path) -> None:
    """Modes as a plain mkdir / open would give them (the temp directory is 0700 and safetensors writes 0600):
    a model directory is meant to be shared."""
    umask = os.umask(0)
    os.umask(umask)
    for path in [root, *root.rglob("*")]:
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)


def write_run_models(run_dir: Path, model: nn.Module, cfg, dataset, best_checkpoint: str | None) -> None:
    """RUN/model (the best evaluation's weights, read back from its protected checkpoint) and RUN/model-last
    (the weights as the run ended). Without a best checkpoint (--no-checkpoints, no evaluation), both hold the
    last weights and config.json says so ("weights")."""
    from safetensors.torch import load_file

    last = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    best, which = last, "last"
    if best_checkpoint is not None and (Path(best_checkpoint) / "model.safetensors").is_file():
        saved = load_file(str(Path(best_checkpoint) / "model.safetensors"))
        # DDP / torch.compile wrappers prefix the names
        best = {k.removeprefix("module.").removeprefix("_orig_mod."): v for k, v in saved.items()}
        which = "best"
    save_model_dir(run_dir / "model", best, model_config(cfg, dataset, model, which), dataset.tokenizer_dir)
    save_model_dir(run_dir / "model-last", last, model_config(cfg, dataset, model, "last"), dataset.tokenizer_dir)


def read_config(model_dir: str | os.PathLike) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())
