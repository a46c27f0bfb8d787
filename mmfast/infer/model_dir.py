"""The model directory a run leaves behind: everything needed to use the trained model, nothing else.

Layout (Hugging Face's ``save_pretrained`` layout, so ``push_to_hub`` works as it is):
    config.json         how to rebuild the network (fusion type, encoders, sizes), class names and the
                        preprocessing (image size, crop ratio, mean/std, max_length)
    model.safetensors   the weights
    tokenizer/          the tokenizer the model was trained with (copied from the prepared dataset)
    checksums.json      the SHA-256 of every file above (not of README.md, the model card, which is meant to
                        be edited before ``push_to_hub``)

``load_model(dir)`` (or ``MmfastModel.from_pretrained(dir)``) rebuilds it offline; the data directory is not
needed any more. It refuses, naming the file and what to do, a directory whose files are missing, damaged
(checksum mismatch; a directory written before checksums existed has none and is loaded unchecked),
inconsistent (class names, weights and config.json from different models) or holding non-finite weights.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import tempfile
from pathlib import Path

import torch
from huggingface_hub import PyTorchModelHubMixin
from torch import nn

from mmfast.data.preprocessing import EVAL_CROP_RATIO
from mmfast.models import build_model
from mmfast.models.encoders import quiet_transformers
from mmfast.util.fsutil import atomic_dir, file_lock, file_sha256

log = logging.getLogger(__name__)
FORMAT = "mmfast-model/1"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_DIR = "tokenizer"
CHECKSUMS_FILE = "checksums.json"
MODEL_CARD_FILE = "README.md"
_REMEDY = "copy the model directory again whole from its run (RUN/model, or RUN/model-last), or retrain"
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
    def _from_pretrained(cls, *, model_id: str, map_location: str = "cpu", **kwargs):
        if os.path.isdir(model_id):  # a local model directory: load_model's checks
            return load_model(model_id, map_location)
        kwargs["strict"] = True  # a hub repository: every weight must fit the network
        return super()._from_pretrained(model_id=model_id, map_location=map_location, **kwargs).eval()

    def _save_pretrained(self, save_directory: Path) -> None:
        """The mixin's weights, plus the tokenizer; an earlier checksums.json would no longer match, so it goes
        (the directory then loads unchecked, as one written before mmfast wrote checksums)."""
        super()._save_pretrained(save_directory)
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(str(save_directory / TOKENIZER_DIR))
        (save_directory / CHECKSUMS_FILE).unlink(missing_ok=True)


class ModelDirError(ValueError):
    """A model directory that cannot be used: a file missing, damaged, not matching the others, or weights that
    are not finite. The message names the file and what to do."""


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
        with quiet_transformers():  # no "Writing model shards" bar
            AutoModel.from_config(hf_config).save_pretrained(tmp)
        yield tmp


def load_model(model_dir: str | os.PathLike, device: str | torch.device = "cpu") -> MmfastModel:
    """Load a model directory written at the end of a run (``RUN/model`` or ``RUN/model-last``), offline, after
    checking it: its files against checksums.json (when it has one), config.json's fields, the weights against
    the network config.json describes, and that every weight is finite.

    Args:
        model_dir: the directory (config.json, model.safetensors, tokenizer/).
        device: where the weights go.

    Returns:
        the model in eval mode, with ``.tokenizer`` and ``.config`` (class_names, image_size, mean, std, ...).

    Raises:
        FileNotFoundError: not a model directory (a file of it missing).
        ModelDirError: a file of it is damaged or does not match the others.
    """
    model_dir = Path(model_dir)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (model_dir / name).is_file():
            raise FileNotFoundError(
                f"{model_dir / name}: missing; pass a model directory written by mmfast-train (RUN/model)"
            )
    if not (model_dir / TOKENIZER_DIR).is_dir():
        raise FileNotFoundError(
            f"{model_dir / TOKENIZER_DIR}: missing (the tokenizer the model was trained with, which predict "
            f"needs); {_REMEDY}"
        )
    verify_model_dir(model_dir)
    config = read_config(model_dir)
    try:
        model = MmfastModel(config)
    except (ValueError, KeyError, TypeError) as e:  # an unknown model or encoder name, a bad size
        raise ModelDirError(
            f"{model_dir / CONFIG_FILE}: cannot build the network it describes ({_one_line(e)}); {_REMEDY}"
        ) from e
    _load_weights(model, model_dir / WEIGHTS_FILE)
    model.tokenizer = _load_tokenizer(model_dir / TOKENIZER_DIR)
    vocab = config.get("vocab_size")
    if isinstance(vocab, int) and len(model.tokenizer) != vocab:  # another run's tokenizer/
        raise ModelDirError(
            f"{model_dir / TOKENIZER_DIR}: has {len(model.tokenizer)} tokens where {model_dir / CONFIG_FILE} says "
            f"the model was trained with {vocab}: not the tokenizer it was trained with; {_REMEDY}"
        )
    return model.eval().to(device)


def verify_model_dir(model_dir: str | os.PathLike) -> None:
    """Check a model directory's files against its checksums.json; one written before mmfast wrote checksums
    has none, and passes (``load_model`` still checks that its weights are finite).

    Raises:
        ModelDirError: a listed file is missing or not the bytes that were written, or checksums.json is
            unreadable.
    """
    model_dir = Path(model_dir)
    path = model_dir / CHECKSUMS_FILE
    if not path.exists():
        log.warning(
            "%s: no %s, so its files cannot be checked (written before mmfast wrote checksums, or the file was "
            "removed); loading it unchecked",
            model_dir,
            CHECKSUMS_FILE,
        )
        return
    try:
        sums = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelDirError(f"{path}: unreadable ({_one_line(e)}); {_REMEDY}") from None
    if not isinstance(sums, dict) or not isinstance(sums.get(WEIGHTS_FILE), str):
        raise ModelDirError(f"{path}: does not list {WEIGHTS_FILE}'s checksum; {_REMEDY}")
    for rel, want in sorted(sums.items()):
        f = model_dir / rel
        try:
            got = file_sha256(f)
        except OSError as e:  # missing, a directory, no permission
            raise ModelDirError(f"{f}: cannot be read ({e.strerror}), yet {path} lists it; {_REMEDY}") from None
        if got != want:
            edited = (
                f"; if you edited it on purpose, delete {path} to load it unchecked" if rel == CONFIG_FILE else ""
            )
            raise ModelDirError(f"{f}: is corrupt (checksum mismatch with {CHECKSUMS_FILE}); {_REMEDY}{edited}")


def _load_weights(model: MmfastModel, path: Path) -> None:
    """The weights of ``path`` into ``model``: all of them, each of the network's shape, all finite."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        state = load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise ModelDirError(f"{path}: unreadable ({_one_line(e)}): truncated or damaged; {_REMEDY}") from None
    bad = [k for k, v in state.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if bad:
        raise ModelDirError(
            f"{path}: {len(bad)} weight tensor(s) hold NaN or inf (first: {bad[0]}): the weights are unusable; "
            f"{_REMEDY}"
        )
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:  # missing or unexpected keys, another shape
        raise ModelDirError(
            f"{path}: does not fit the network {CONFIG_FILE} describes ({_one_line(e)}): the two come from "
            f"different models; {_REMEDY}"
        ) from None


def _load_tokenizer(path: Path):
    from mmfast.data.tokenizer import load_tokenizer

    try:
        return load_tokenizer(path)
    except (ValueError, OSError) as e:
        raise ModelDirError(f"{path}: the tokenizer cannot be loaded ({_one_line(e)}); {_REMEDY}") from None


def _one_line(e: BaseException, most: int = 300) -> str:
    """An exception's message on one line, cut to ``most`` characters."""
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= most else text[: most - 3] + "..."


def load_for_inference(
    model_dir: str | os.PathLike, device: str | None = None
) -> tuple[MmfastModel, torch.device]:
    """The start-up of predict and evaluate: the device (the given one, else CUDA when there is one) and the
    model loaded onto it.

    Returns:
        (model, device).

    Raises:
        FileNotFoundError, ModelDirError: as ``load_model``.
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return load_model(model_dir, device), device


def model_config(cfg, dataset, model: nn.Module, weights: str, tokenizer_dir: Path | None = None) -> dict:
    """config.json of a run's model directory.

    Args:
        cfg: the resolved TrainConfig.
        dataset: the PreparedDataset it trained on.
        model: the (unwrapped) network, for the normalization its image encoder expects.
        weights: "best" or "last".
        tokenizer_dir: the tokenizer it trained with (default: the dataset's).
    """
    from mmfast.data.tokenizer import load_tokenizer
    from mmfast.models.encoders import RANDOM_TEXT_CONFIGS

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
        "vocab_size": len(load_tokenizer(tokenizer_dir or dataset.tokenizer_dir)),
        "hidden": cfg.hidden,
        "dropout": cfg.dropout,
        **({"combine": cfg.combine} if cfg.model == "late" else {}),
        "image_size": cfg.image_size,
        "crop_ratio": EVAL_CROP_RATIO,  # eval: the shorter side resized to image_size / crop_ratio, then cropped
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
        save_file(weights, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        (tmp / MODEL_CARD_FILE).write_text(MODEL_CARD.format(**config))
        shutil.copytree(tokenizer_dir, tmp / TOKENIZER_DIR)
        (tmp / CHECKSUMS_FILE).write_text(json.dumps(_checksums(tmp), indent=2) + "\n")
        _readable(tmp)
    return out


def _checksums(root: Path) -> dict[str, str]:
    """{relative path: SHA-256} of the files ``load_model`` reads (not the model card, not mmfast's dot-files)."""
    files = [p for p in sorted(root.rglob("*")) if p.is_file() and not p.name.startswith(".")]
    return {p.relative_to(root).as_posix(): file_sha256(p) for p in files if p.name != MODEL_CARD_FILE}


def _readable(root: Path) -> None:
    """Modes as a plain mkdir / open would give them (the temp directory is 0700 and safetensors writes 0600):
    a model directory is meant to be shared."""
    umask = os.umask(0)
    os.umask(umask)
    for path in [root, *root.rglob("*")]:
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)


def write_run_models(
    run_dir: Path, model: nn.Module, cfg, dataset, best_checkpoint: str | None, tokenizer_dir: Path | None = None
) -> None:
    """RUN/model (the best evaluation's weights, read back from its protected checkpoint) and RUN/model-last
    (the weights as the run ended). Without a best checkpoint (--no-checkpoints, no evaluation), both hold the
    last weights and config.json says so ("weights"). ``tokenizer_dir``: the tokenizer the run trained with
    (the training engine's copy, taken when it opened the data: the dataset's own may have been prepared
    again since); default the dataset's."""
    from safetensors.torch import load_file

    last = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    best, which = last, "last"
    if best_checkpoint is not None and (Path(best_checkpoint) / "model.safetensors").is_file():
        saved = load_file(str(Path(best_checkpoint) / "model.safetensors"))
        # DDP / torch.compile wrappers prefix the names
        best = {k.removeprefix("module.").removeprefix("_orig_mod."): v for k, v in saved.items()}
        which = "best"
    tokenizer_dir = tokenizer_dir or dataset.tokenizer_dir
    for name, weights, kind in (("model", best, which), ("model-last", last, "last")):
        config = model_config(cfg, dataset, model, kind, tokenizer_dir)
        save_model_dir(run_dir / name, weights, config, tokenizer_dir)


def _number(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _positive_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _rgb(v) -> bool:
    return v is None or (isinstance(v, list) and len(v) == 3 and all(_number(x) for x in v))


# config.json's fields: what each must be (the test, and its words for the error)
_FIELDS = {
    "model": (lambda v: isinstance(v, str), "a model name"),
    "num_classes": (_positive_int, "a positive integer"),
    "class_names": (lambda v: isinstance(v, list) and all(isinstance(n, str) for n in v), "a list of names"),
    "image_backbone": (lambda v: isinstance(v, str), "an image backbone name"),
    "text_model": (lambda v: isinstance(v, str), "a text model name"),
    "vocab_size": (_positive_int, "a positive integer"),
    "hidden": (_positive_int, "a positive integer"),
    "dropout": (lambda v: _number(v) and 0 <= v < 1, "a number in [0, 1)"),
    "image_size": (_positive_int, "a positive integer"),
    "mean": (_rgb, "3 numbers (or null)"),
    "std": (_rgb, "3 numbers (or null)"),
    "max_length": (_positive_int, "a positive integer"),
}
_OPTIONAL_FIELDS = {
    "eval_batch_size": (lambda v: v is None or _positive_int(v), "a positive integer"),
    "max_pixels": (lambda v: v is None or _positive_int(v), "a positive integer"),
    "text_config": (lambda v: isinstance(v, dict) and isinstance(v.get("model_type"), str), "a model config"),
}


def read_config(model_dir: str | os.PathLike) -> dict:
    """A model directory's config.json, checked: JSON, every field there and of its type, one class name per
    classifier output.

    Raises:
        ModelDirError: naming config.json and the field.
    """
    path = Path(model_dir) / CONFIG_FILE
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # UnicodeDecodeError is a ValueError
        raise ModelDirError(f"{path}: not readable JSON ({_one_line(e)}); {_REMEDY}") from None
    if not isinstance(config, dict):
        raise ModelDirError(f"{path}: not a JSON object; {_REMEDY}")
    missing = [k for k in _FIELDS if k not in config]
    if missing:
        raise ModelDirError(f"{path}: missing {', '.join(map(repr, missing))}; {_REMEDY}")
    for key, (ok, what) in {**_FIELDS, **_OPTIONAL_FIELDS}.items():
        if key in config and not ok(config[key]):
            raise ModelDirError(f"{path}: {key!r} must be {what}, got {json.dumps(config[key])[:80]}; {_REMEDY}")
    names, n = config["class_names"], config["num_classes"]
    if len(names) != n or len(set(names)) != n:
        raise ModelDirError(
            f"{path}: 'class_names' holds {len(names)} names ({len(set(names))} distinct) for the classifier's "
            f"{n} outputs ('num_classes'); {_REMEDY}"
        )
    return config
