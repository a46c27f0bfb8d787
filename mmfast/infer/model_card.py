"""The model card of a model directory (its README.md): what the model is, by its task, and the lines that
load it. Meant to be edited before ``push_to_hub``, so the directory's checksums leave it out."""

from __future__ import annotations

MODEL_CARD_FILE = "README.md"
_CARD_HEAD = """---
library_name: mmfast
tags: [mmfast, multimodal, {tag}, pytorch_model_hub_mixin]
---

"""
_CARD_USE = """
```python
import mmfast
model = mmfast.load_model("THIS_DIRECTORY")  # or mmfast.MmfastModel.from_pretrained(...)
{use}```
"""
MODEL_CARDS = {  # by the model's task: what config.json's fields say it is, and how to use it
    "classification": (
        "image-text-classification",
        "An mmfast {model}-fusion classifier ({image_backbone} + {text_model}), {num_classes} classes, "
        "{image_size} px.\n",
        "",
    ),
    "contrastive": (
        "zero-shot-image-classification",
        "An mmfast dual encoder ({loss} loss; {image_backbone} + {text_model}), {embed_dim}-d embeddings, "
        "{image_size} px.\n",
        'images = model.encode_image(["cat.jpg"])  # (N, {embed_dim}) normalized\n'
        'texts = model.encode_text(["a photo of a cat."])\n'
        "similarity = images @ texts.T\n",
    ),
}


def model_card(config: dict) -> str:
    """README.md of a model directory: what the model is and the lines that load it."""
    tag, what, use = MODEL_CARDS.get(config.get("task", "classification"), MODEL_CARDS["classification"])
    if config.get("image_pool") == "multiscale":  # a timm tower built by name pools only its last map
        what += _MULTISCALE
    if "zero_shot_map" in config:  # models/prompt_map.py
        what += _ZERO_SHOT_MAP
    text = _CARD_HEAD.format(tag=tag) + what.format(**config) + _CARD_USE.format(use=use.format(**config))
    return text


_MULTISCALE = """
Its image tower pools its stages too (`--image-pool multiscale`), which open_clip and transformers do not build:
`mmfast-export` writes it as ONNX or a torch program.
"""
_ZERO_SHOT_MAP = """
Zero-shot classification scores each class half by these embeddings and half by a kernel map of the locked image
tower into the text tower as training started (`--zero-shot-map kernel`), so that class prompts are also read as
the text tower read them before it learned your captions' style. `encode_image(..., zero_shot=True)` and
`encode_text(prompts, zero_shot=True)` give those embeddings; `mmfast-predict --classes` and `mmfast-evaluate`
use them. An exported copy holds the model's own embeddings only.
"""
