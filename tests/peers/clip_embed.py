"""Embed with transformers alone, a CLIP directory: python clip_embed.py EXPORT_DIR INPUTS.npz OUT.npz

The folder loads as transformers' ``AutoModel`` (a ``CLIPModel``) with ``AutoImageProcessor`` and
``AutoTokenizer``; the embeddings are its image and text towers' projected outputs, normalized.
"""

import sys

import _isolate  # noqa: F401  (first: mmfast is not importable from here on)
import numpy as np
import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoModel, AutoTokenizer

folder, inputs, out = sys.argv[1:4]
model = AutoModel.from_pretrained(folder).eval()
processor, tokenizer = AutoImageProcessor.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
data = np.load(inputs)
batch = tokenizer([str(c) for c in data["captions"]], padding=True, return_tensors="pt")
with torch.no_grad():  # the towers' own outputs, projected: what get_image_features / get_text_features give
    pooled = model.vision_model(pixel_values=torch.from_numpy(data["pixels"])).pooler_output
    image = model.visual_projection(pooled)
    text = model.text_projection(
        model.text_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).pooler_output
    )
own = processor([Image.open(p).convert("RGB") for p in data["photos"]], return_tensors="pt")["pixel_values"]
np.savez(
    out,
    image=torch.nn.functional.normalize(image, dim=-1).numpy(),
    text=torch.nn.functional.normalize(text, dim=-1).numpy(),
    own_pixels=own.numpy(),
    logit_scale=model.logit_scale.detach().numpy(),
    kind=np.array(type(model).__name__),
)
