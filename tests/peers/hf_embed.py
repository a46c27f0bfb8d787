"""Embed with transformers and sentence-transformers alone: python hf_embed.py EXPORT_DIR INPUTS.npz OUT.npz

The image folder loads as transformers' ``AutoModelForImageClassification`` (its logits: the image embedding
before normalization) with ``AutoImageProcessor``; the text folder as a ``SentenceTransformer``, and as a plain
``AutoModel`` + ``AutoTokenizer`` whose token states are averaged and projected by hand.
"""

import json
import sys
from pathlib import Path

import _isolate  # noqa: F401  (first: mmfast is not importable from here on)
import numpy as np
import torch
from PIL import Image
from safetensors.torch import load_file
from sentence_transformers import SentenceTransformer
from transformers import AutoImageProcessor, AutoModel, AutoModelForImageClassification, AutoTokenizer

folder, inputs, out = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
towers = json.loads((folder / "towers.json").read_text())
data = np.load(inputs)
captions = [str(c) for c in data["captions"]]
image_model = AutoModelForImageClassification.from_pretrained(folder / towers["image"]).eval()
processor = AutoImageProcessor.from_pretrained(folder / towers["image"])
with torch.no_grad():
    logits = image_model(pixel_values=torch.from_numpy(data["pixels"])).logits  # (N, D): the projected features
image = torch.nn.functional.normalize(logits, dim=-1)
own = processor([Image.open(p).convert("RGB") for p in data["photos"]], return_tensors="pt")["pixel_values"]
st = SentenceTransformer(str(folder / towers["text"]), device="cpu")
text_st = st.encode(captions, convert_to_tensor=True, batch_size=64)
# transformers alone: the encoder, the mean over the caption's tokens, the projection of 2_Dense
tok = AutoTokenizer.from_pretrained(folder / towers["text"])
encoder = AutoModel.from_pretrained(folder / towers["text"]).eval()
proj = load_file(str(folder / towers["text"] / "2_Dense" / "model.safetensors"))["linear.weight"]
batch = tok(captions, padding=True, truncation=True, max_length=st.max_seq_length, return_tensors="pt")
with torch.no_grad():
    states = encoder(**batch).last_hidden_state
mask = batch["attention_mask"].unsqueeze(-1).to(states.dtype)
text_hf = torch.nn.functional.normalize(((states * mask).sum(1) / mask.sum(1)) @ proj.T, dim=-1)
np.savez(
    out,
    image=image.numpy(),
    text=text_st.cpu().numpy(),
    text_transformers=text_hf.numpy(),
    ids=batch["input_ids"].numpy(),
    own_pixels=own.numpy(),
    kind=np.array(f"{type(image_model).__name__}+{type(encoder).__name__}"),
)
