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
import os
import shutil
import tempfile
from pathlib import Path

import torch
from huggingface_hub import PyTorchModelHubMixin
from torch import nn

from mmfast.data.tokenizer import load_tokenizer
from mmfast.data.validate import DEFAULT_MAX_PIXELS
from mmfast.infer.encode_inputs import (  # noqa: F401  (pil_transform, BadImageError: this module's names too)
    BadImageError,
    check_on_error,
    encode_images,
    image_inputs,
    pil_transform,
    preprocessed_batch,
    text_inputs,
)
from mmfast.infer.model_card import MODEL_CARD_FILE, model_card
from mmfast.infer.model_config import (  # noqa: F401  (model_config, ModelDirError: this module's public names too)
    CHECKSUMS_FILE,
    CONFIG_FILE,
    FORMAT,
    REMEDY,
    WEIGHTS_FILE,
    ModelConfig,
    ModelDirError,
    model_config,
    model_options,
    one_line,
    read_config,
    verify_model_dir,
)
from mmfast.models import build_model
from mmfast.models.encoders import quiet_transformers
from mmfast.models.prompt_map import PromptMap
from mmfast.models.start_towers import tower_from_record
from mmfast.tasks.retrieval import known_classes
from mmfast.util.fsutil import atomic_dir, file_sha256, shared_modes
from mmfast.util.locks import file_lock
from mmfast.util.voice import setting

log = logging.getLogger(__name__)
TOKENIZER_DIR = "tokenizer"


class MmfastModel(
    nn.Module,
    PyTorchModelHubMixin,
    library_name="mmfast",
    tags=["mmfast", "multimodal", "image-text-classification"],
):
    """A trained model with what it needs to be used: class names, tokenizer and preprocessing.

    Args:
        config: the model directory's config.json (see ``model_config``).

    ``forward(batch)`` takes the loader's batch dict (``image`` (B, 3, S, S) normalized, ``input_ids`` /
    ``attention_mask`` (B, L)) and returns the network's output: logits (B, C) for a classifier, the dual
    encoder's dict (``image``, ``text``, ``logit_scale``, ``logit_bias``) for "clip". A dual encoder also
    gives ``encode_image`` and ``encode_text``.
    """

    def __init__(self, config: dict):
        super().__init__()
        self.config = dict(config)
        # image_weights=None: the backbone starts random (or from the packaged Lite0 weights) and the
        # trained weights replace it; nothing is downloaded.
        with _text_model_source(config) as text_model:
            self.model = build_model(
                config["model"],
                config["num_classes"],
                image_backbone=config["image_backbone"],
                image_pool=config.get("image_pool", "last"),
                text_model=text_model,
                vocab_size=config["vocab_size"],
                hidden=config["hidden"],
                dropout=config["dropout"],
                **_recorded_towers(config),
                **model_options(config),
            )
        if (record := config.get("zero_shot_map")) is not None:  # its shell; load_model fills its tensors
            self.model.prompt_map = PromptMap.from_record(record, self.model.text)
        self.model.eval()
        self.tokenizer = None  # set by load_model / from_pretrained on a local directory

    @property
    def class_names(self) -> list[str]:
        return list(self.config["class_names"])

    @property
    def knows_classes(self) -> bool:
        """Whether the model was trained with labels: two classes or more. A --no-labels input's model has
        one, 'unlabeled', and predicts none."""
        return known_classes(self.config.get("class_names")) is not None

    @property
    def transform(self):
        """The image preprocessing evaluation applies, for a PIL image: resize, center crop, mean / std; returns
        (3, S, S) float32, what ``forward`` takes as a batch's "image" rows. With PIL's resize, close to the DALI
        pipeline's pixels, not bit-equal."""
        return pil_transform(self.config)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor | dict:
        """The network on a batch as the loaders give it ("image", "input_ids", "attention_mask"): a
        classifier's logits (B, C), or a dual encoder's dict of embeddings. In eval mode (as loaded) the late
        fusion model also gives logits; in train mode it gives its dict with the auxiliary heads."""
        return self.model(batch)

    @property
    def embeds(self) -> bool:
        """Whether the network is a dual encoder (``encode_image`` / ``encode_text``) rather than a classifier."""
        return hasattr(self.model, "encode_image") and hasattr(self.model, "encode_text")

    def _tower(self, name: str):
        if not hasattr(self.model, name):
            raise TypeError(
                f"{name} needs a dual encoder (a model trained with {setting('model', value='clip')}); this one "
                f"holds a '{self.config['model']}' model"
            )
        return getattr(self.model, name)

    @torch.no_grad()
    def encode_image(
        self,
        images,
        batch_size: int = 64,
        *,
        max_pixels: int | None = None,
        on_error: str = "skip",
        zero_shot: bool = False,
    ) -> torch.Tensor:
        """Normalized image embeddings of a dual encoder.

        Args:
            images: image files, PIL images, uint8 RGB arrays (H, W, 3) or uint8 tensors (3, H, W) (as
                ``torchvision.io.read_image`` gives), a list of them, or one of them (a (1, D) result). These are
                preprocessed here with PIL + torchvision (``encode_inputs.pil_transform``: the shorter side
                resized to image_size / crop_ratio, center crop, mean/std). That is close to, not bit-equal to,
                the DALI pipeline of ``mmfast-predict --embed image``: the resize filters differ. A float tensor
                is a batch already preprocessed as config.json says (what the loaders give): (N, 3, S, S), S the
                model's image_size, or one image (3, S, S); a float tensor of another shape is refused.
            batch_size: images per forward.
            max_pixels: decoded-pixel budget of an image file, read from its header (default: the model's,
                as its training data was prepared).
            on_error: what to do with a file training would refuse (missing, not an image, truncated, over
                ``max_pixels``): "skip" (log it and leave its row out) or "raise" (``encode_inputs.BadImageError``,
                naming the file and why).
            zero_shot: the embeddings zero-shot classification scores against ``encode_text(...,
                zero_shot=True)``'s prompts: with a zero-shot map (config.json's "zero_shot_map"), the image's
                embedding joined with the map's (D + the text tower's width); else the image embeddings.

        Returns:
            (K, D) float32 torch tensor on the model's device: a row per usable image, in input order, of unit
            length (cosine similarity is the dot product; ``.cpu().numpy()`` for numpy). K is N unless images
            were skipped. The tensor carries two attributes (a new tensor made from it has neither): ``kept``,
            the position in the input of each row, and ``skipped``, a dict per skipped image ({"index",
            "image", "reason"}).

        Raises:
            TypeError: an input of another type (``encode_inputs.TAKES``), or an array that is not uint8.
            ValueError: an image array of another shape, or a float tensor that is not such a batch.
        """
        tower = self._tower("encode_image")
        joined = self._zero_shot(zero_shot)
        check_on_error(on_error)
        weight = next(self.parameters())

        def encode(batch: torch.Tensor) -> torch.Tensor:  # (B, 3, S, S) -> (B, D)
            return tower(batch.to(weight.device, weight.dtype), **joined).float()

        batch = preprocessed_batch(images, self.config["image_size"])
        if batch is not None:
            chunks = [encode(batch[s : s + batch_size]) for s in range(0, len(batch), batch_size)]
            kept, skipped = list(range(len(batch))), []
        else:
            budget = max_pixels or self.config.get("max_pixels") or DEFAULT_MAX_PIXELS
            chunks, kept, skipped = encode_images(
                encode,
                image_inputs(images),
                self.config,
                batch_size=batch_size,
                max_pixels=budget,
                on_error=on_error,
            )
        out = self._rows(chunks, zero_shot)
        out.kept, out.skipped = kept, skipped
        return out

    @torch.no_grad()
    def encode_text(self, texts: list[str] | str, batch_size: int = 256, zero_shot: bool = False) -> torch.Tensor:
        """Normalized text embeddings of a dual encoder: the texts tokenized as in training (the model's
        tokenizer, truncated to its max_length, padded to the longest in each batch).

        Args:
            texts: a str, or a list (any iterable) of str.
            batch_size: texts per forward.
            zero_shot: class prompts, as zero-shot classification embeds them: with a zero-shot map, joined with
                the start text tower's embedding (``encode_image``'s ``zero_shot``).

        Returns:
            (N, D) float32 torch tensor on the model's device, rows of unit length.

        Raises:
            TypeError: ``texts`` is not a str or a list of str.
        """
        encode = self._tower("encode_text")
        joined = self._zero_shot(zero_shot)
        texts = text_inputs(texts)
        device = next(self.parameters()).device
        out = []
        for s in range(0, len(texts), batch_size):
            enc = self.tokenizer(
                texts[s : s + batch_size],
                truncation=True,
                max_length=self.config["max_length"],
                padding=True,
                return_tensors="pt",
                return_token_type_ids=False,
            )
            ids, mask = enc["input_ids"].to(device), enc["attention_mask"].to(device)
            out.append(encode(ids, mask, **joined).float())
        return self._rows(out, zero_shot)

    def _zero_shot(self, zero_shot: bool) -> dict:
        """The towers' keyword for zero-shot embeddings: only where the model has a zero-shot map."""
        return {"zero_shot": True} if zero_shot and getattr(self.model, "prompt_map", None) is not None else {}

    def embedding_width(self, zero_shot: bool = False) -> int:
        """D of ``encode_image`` / ``encode_text``: the model's embedding width, and with ``zero_shot`` the start
        text tower's on top where the model has a zero-shot map (``PromptMap.join``)."""
        joined = self.config.get("zero_shot_map", {}).get("text_width", 0) if zero_shot else 0
        return self.config["embed_dim"] + joined

    def _rows(self, chunks: list[torch.Tensor], zero_shot: bool = False) -> torch.Tensor:
        """The embeddings of each batch as one (N, D) tensor; (0, D) for none."""
        if chunks:
            return torch.cat(chunks)
        return torch.zeros(0, self.embedding_width(zero_shot), device=next(self.parameters()).device)

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


def _recorded_towers(config: dict) -> dict:
    """The towers config.json records as started from a directory (``image_tower`` / ``text_tower``), rebuilt
    with random weights without it, as ``build_model``'s ``image_encoder`` / ``text_encoder``."""
    return {
        f"{name}_encoder": tower_from_record(config[f"{name}_tower"], name, config.get("image_pool", "last"))
        for name in ("image", "text")
        if f"{name}_tower" in config
    }


@contextlib.contextmanager
def _text_model_source(config: dict):
    """What to build the text encoder from, offline: a pretrained one (MiniLM, a hub name) is rebuilt from the
    architecture recorded in config.json ("text_config"), in a temp directory with random weights that the
    trained ones replace, so neither its package nor the hub is needed; random configs need nothing."""
    text_config = config.get("text_config")
    if config["model"] == "image" or text_config is None or "text_tower" in config:
        yield config["text_model"]
        return
    # transformers: a slow import, only for a Hugging Face model or tokenizer
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
            f"needs); {REMEDY}"
        )
    verify_model_dir(model_dir)
    config = read_config(model_dir)
    try:
        model = MmfastModel(config)
    except (ValueError, KeyError, TypeError) as e:  # an unknown model or encoder name, a bad size
        raise ModelDirError(
            f"{model_dir / CONFIG_FILE}: cannot build the network it describes ({one_line(e)}); {REMEDY}"
        ) from e
    _load_weights(model, model_dir / WEIGHTS_FILE)
    model.tokenizer = _load_tokenizer(model_dir / TOKENIZER_DIR)
    vocab = config.get("vocab_size")
    if isinstance(vocab, int) and len(model.tokenizer) != vocab:  # another run's tokenizer/
        raise ModelDirError(
            f"{model_dir / TOKENIZER_DIR}: has {len(model.tokenizer)} tokens where {model_dir / CONFIG_FILE} says "
            f"the model was trained with {vocab}: not the tokenizer it was trained with; {REMEDY}"
        )
    return model.eval().to(device)


def _load_weights(model: MmfastModel, path: Path) -> None:
    """The weights of ``path`` into ``model``: all of them, each of the network's shape, all finite."""
    from safetensors import SafetensorError  # safetensors: only when weights are read or written
    from safetensors.torch import load_file

    try:
        state = load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise ModelDirError(f"{path}: unreadable ({one_line(e)}): truncated or damaged; {REMEDY}") from None
    bad = [k for k, v in state.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if bad:
        raise ModelDirError(
            f"{path}: {len(bad)} weight tensor(s) hold NaN or inf (first: {bad[0]}): the weights are unusable; "
            f"{REMEDY}"
        )
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:  # missing or unexpected keys, another shape
        raise ModelDirError(
            f"{path}: does not fit the network {CONFIG_FILE} describes ({one_line(e)}): the two come from "
            f"different models; {REMEDY}"
        ) from None


def _load_tokenizer(path: Path):
    try:
        return load_tokenizer(path)
    except (ValueError, OSError) as e:
        raise ModelDirError(f"{path}: the tokenizer cannot be loaded ({one_line(e)}); {REMEDY}") from None


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
    from safetensors.torch import save_file  # safetensors: only when weights are read or written

    out = Path(out)
    # What MmfastModel.save_pretrained writes, without building the network again (MiniLM, Lite0: seconds).
    # Keys carry the wrapper's "model." prefix; clones, because safetensors refuses tensors sharing storage.
    weights = {f"model.{k}": v.detach().cpu().contiguous().clone() for k, v in state_dict.items()}
    with file_lock(out.parent / f".{out.name}.lock"), atomic_dir(out, "mmfast model directory") as tmp:
        save_file(weights, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        (tmp / MODEL_CARD_FILE).write_text(model_card(config))
        shutil.copytree(tokenizer_dir, tmp / TOKENIZER_DIR)
        (tmp / CHECKSUMS_FILE).write_text(json.dumps(_checksums(tmp), indent=2) + "\n")
        shared_modes(tmp)
    return out


def _checksums(root: Path) -> dict[str, str]:
    """{relative path: SHA-256} of the files ``load_model`` reads (not the model card, not mmfast's dot-files)."""
    files = [p for p in sorted(root.rglob("*")) if p.is_file() and not p.name.startswith(".")]
    return {p.relative_to(root).as_posix(): file_sha256(p) for p in files if p.name != MODEL_CARD_FILE}


def write_run_models(
    run_dir: Path,
    model: nn.Module,
    cfg: ModelConfig,
    dataset,
    best_checkpoint: str | None,
    tokenizer_dir: Path | None = None,
) -> None:
    """RUN/model (the best evaluation's weights, read back from its protected checkpoint) and RUN/model-last
    (the weights as the run ended). Without a best checkpoint (--no-checkpoints, no evaluation), both hold the
    last weights and config.json says so ("weights"). ``tokenizer_dir``: the tokenizer the run trained with
    (the training engine's copy, taken when it opened the data: the dataset's own may have been prepared
    again since); default the dataset's."""
    from safetensors.torch import load_file  # safetensors: only when weights are read or written

    model = getattr(model, "_orig_mod", model)  # torch.compile's wrapper: its names carry a prefix
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
