"""Embed with open_clip alone: python open_clip_embed.py EXPORT_DIR INPUTS.npz OUT.npz [--moved]

--moved: the folder was moved after export, so its ``text_cfg.hf_model_name`` names a place that is gone; it is
loaded as docs/guides/models-in-and-out.md says, the text config's path given again to open_clip's factory.

INPUTS.npz holds ``pixels`` (N, 3, S, S) float32, ``captions`` (M,) str and ``photos`` (K,) str (image files).
OUT.npz gets the normalized image embeddings of ``pixels``, the text embeddings of ``captions``, the token ids
open_clip's tokenizer gives them, and the pixels open_clip's own transform gives ``photos``.
"""

import json
import sys

import _isolate  # noqa: F401  (first: mmfast is not importable from here on)
import numpy as np
import open_clip
import torch
from PIL import Image

folder, inputs, out = sys.argv[1:4]
moved = {}
if "--moved" in sys.argv[4:]:
    text_cfg = json.load(open(f"{folder}/open_clip_config.json"))["model_cfg"]["text_cfg"]
    moved = {"text_cfg": {**text_cfg, "hf_model_name": folder}}
model, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{folder}", **moved)
tokenizer = open_clip.get_tokenizer(f"local-dir:{folder}")
model.eval()
data = np.load(inputs)
ids = tokenizer(list(data["captions"]))
with torch.no_grad():
    image = model.encode_image(torch.from_numpy(data["pixels"]), normalize=True)
    text = model.encode_text(ids, normalize=True)
own = torch.stack([preprocess(Image.open(p)) for p in data["photos"]])
np.savez(
    out,
    image=image.numpy(),
    text=text.numpy(),
    ids=ids.numpy(),
    own_pixels=own.numpy(),
    logit_scale=model.logit_scale.detach().numpy(),
    logit_bias=np.array(model.logit_bias.item() if model.logit_bias is not None else np.nan),
    kind=np.array(type(model).__name__),
)
