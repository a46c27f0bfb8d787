"""Write a dual encoder started from a standard open_clip CLIP (its ``VisionTransformer`` and its own text
transformer) as transformers' ``CLIPModel``, with a ``CLIPProcessor``, so stock transformers loads it offline:

    model = CLIPModel.from_pretrained("OUT/hf")
    processor = CLIPProcessor.from_pretrained("OUT/hf")

The weights are open_clip's under transformers' names: each attention's packed ``in_proj`` splits into its
query, key and value projections, and the projection matrices are transposed into bias-free linear layers. The
tokenizer is open_clip's BPE vocabulary and merges, read from the model's own tokenizer files. The text is pooled
at the first end-of-text id, where open_clip pools. The image processor is the model's eval preprocessing.

A tower ``CLIPModel`` cannot hold (ModifiedResNet, a timm tower, attentional pooling, layer scale, another
pooling) is refused, naming the tower and the formats that hold it. Before anything is written, the built model
embeds a probe of pixels and token rows; a difference from mmfast's towers is refused too.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from mmfast.data.preprocessing import eval_resize
from mmfast.infer.peer_towers import FormatRefusal, eval_geometry, logit_scale_and_bias, start_kinds
from mmfast.models.open_clip_text import OpenClipText

FORMAT = "hf"
HOLDERS = "export it with --format open_clip, onnx or torch"
_ACTIVATIONS = {"GELU": "gelu", "QuickGELU": "quick_gelu"}  # open_clip's MLP activations, in transformers' names
_BLOCK = {  # a residual block's tensors: open_clip's name -> transformers'
    "ln_1": "layer_norm1",
    "ln_2": "layer_norm2",
    "attn.out_proj": "self_attn.out_proj",
    "mlp.c_fc": "mlp.fc1",
    "mlp.c_proj": "mlp.fc2",
}
_RESAMPLE = {"bilinear": 2, "bicubic": 3}  # PIL's numbers, as a Hugging Face image processor names its filter
_EOT_ID = 49407  # the end-of-text id of open_clip's vocabulary, its highest


def is_open_clip_clip(model) -> bool:
    """True for a dual encoder whose towers both started from an open_clip directory."""
    return start_kinds(model) == ("open_clip", "open_clip")


def write_open_clip_as_clip(model, out: Path) -> None:
    """Write ``out`` (an empty directory): ``CLIPModel``'s config and weights, the image processor, the tokenizer.

    Raises:
        FormatRefusal: a tower ``CLIPModel`` cannot build, or a model that does not embed as mmfast's.
    """
    clip = _clip_model(model)
    clip.save_pretrained(str(out))
    _clip_processor_with_tokenizer(model, clip_processor(model.config)).save_pretrained(str(out))


def _clip_model(model):
    """The ``CLIPModel`` of the model's towers, checked against them on a probe."""
    # transformers: a slow import, only for this format
    from transformers import CLIPConfig, CLIPModel

    net = model.model
    visual, text = open_clip_towers(model)
    scale, bias = logit_scale_and_bias(model)
    if bias is not None:
        raise FormatRefusal(
            f"--format {FORMAT}: CLIPModel has no logit bias for the '{model.config.get('loss')}' loss; {HOLDERS}"
        )
    config = CLIPConfig(
        text_config=_text_config(text),
        vision_config=_vision_config(visual),
        projection_dim=int(net.embed_dim),
        logit_scale_init_value=scale,
    )
    clip = CLIPModel(config).eval()
    state = {**_vision_state(visual), **_text_state(text), "logit_scale": net.logit_scale.detach().reshape(())}
    missing, unexpected = clip.load_state_dict({k: v.detach().cpu() for k, v in state.items()}, strict=False)
    missing = [k for k in missing if not k.endswith("position_ids")]
    if missing or unexpected:
        raise FormatRefusal(
            f"--format {FORMAT}: open_clip's towers do not map onto CLIPModel ({missing[:2]} missing, "
            f"{unexpected[:2]} left over); {HOLDERS}"
        )
    _check_probe(clip, visual, net.text.module)
    return clip


def open_clip_towers(model) -> tuple[nn.Module, nn.Module]:
    """(open_clip's VisionTransformer, its TextTransformer).

    Raises:
        FormatRefusal: a tower that is not one ``CLIPModel`` builds.
    """
    net = model.model
    visual, text = net.image.module, net.text.module
    kind = type(visual).__name__
    if kind != "VisionTransformer" or visual.attn_pool is not None or visual.pool_type != "tok":
        what = kind if kind != "VisionTransformer" else f"VisionTransformer pooled '{visual.pool_type}'"
        raise FormatRefusal(f"--format {FORMAT}: the image tower is open_clip's {what}, not CLIP's; {HOLDERS}")
    if visual.final_ln_after_pool or isinstance(visual.ln_pre, nn.Identity):
        raise FormatRefusal(f"--format {FORMAT}: the image tower's layer norms are not CLIP's; {HOLDERS}")
    if not isinstance(text, OpenClipText) or text.tower.pool_type not in ("argmax", "eos"):
        what = type(text).__name__ if not isinstance(text, OpenClipText) else f"pooled '{text.tower.pool_type}'"
        raise FormatRefusal(f"--format {FORMAT}: the text tower ({what}) is not CLIP's; {HOLDERS}")
    pool, eos = text.tower.pool_type, getattr(text.tower, "eos_id", _EOT_ID)
    if (pool == "eos" and eos != _EOT_ID) or text.tower.token_embedding.num_embeddings != _EOT_ID + 1:
        raise FormatRefusal(f"--format {FORMAT}: the text tower's vocabulary is not CLIP's; {HOLDERS}")
    return visual, text.tower


def _blocks_config(transformer: nn.Module, where: str) -> dict:
    """Width, depth, heads, MLP width and activation of open_clip's ``Transformer``."""
    block = transformer.resblocks[0]
    act = type(block.mlp.gelu).__name__
    if act not in _ACTIVATIONS:
        raise FormatRefusal(f"--format {FORMAT}: the {where} tower's activation {act} is not CLIP's; {HOLDERS}")
    return {
        "hidden_size": int(transformer.width),
        "num_hidden_layers": len(transformer.resblocks),
        "num_attention_heads": int(block.attn.num_heads),
        "intermediate_size": int(block.mlp.c_fc.out_features),
        "hidden_act": _ACTIVATIONS[act],
        "layer_norm_eps": float(block.ln_1.eps),
    }


def _vision_config(visual: nn.Module) -> dict:
    return _blocks_config(visual.transformer, "image") | {
        "image_size": int(visual.image_size[0]),
        "patch_size": int(visual.patch_size[0]),
        "num_channels": 3,
    }


def _text_config(text: nn.Module) -> dict:
    return _blocks_config(text.transformer, "text") | {
        "vocab_size": int(text.token_embedding.num_embeddings),
        "max_position_embeddings": int(text.positional_embedding.shape[0]),
        "bos_token_id": _EOT_ID - 1,
        "eos_token_id": _EOT_ID,  # pooled at its first occurrence: open_clip's argmax for CLIP's vocabulary
        "pad_token_id": _EOT_ID,
    }


def _blocks_state(transformer: nn.Module, prefix: str) -> dict:
    """A ``Transformer``'s tensors under transformers' names: ``in_proj`` split into q, k and v."""
    state = {}
    for i, block in enumerate(transformer.resblocks):
        at = f"{prefix}.encoder.layers.{i}"
        for name, tensor in block.state_dict().items():
            if name.startswith("attn.in_proj_"):
                kind = name.removeprefix("attn.in_proj_")  # weight (3C, C) or bias (3C,)
                for part, chunk in zip("qkv", tensor.chunk(3), strict=True):
                    state[f"{at}.self_attn.{part}_proj.{kind}"] = chunk
                continue
            module, _, leaf = name.rpartition(".")
            state[f"{at}.{_BLOCK.get(module, module)}.{leaf}"] = tensor  # an unknown name stays: refused later
    return state


def _projection(proj) -> torch.Tensor:
    """A projection as a bias-free linear layer's weight (D, C)."""
    if isinstance(proj, nn.Linear):
        if proj.bias is not None:
            raise FormatRefusal(f"--format {FORMAT}: a projection with a bias is not CLIP's; {HOLDERS}")
        return proj.weight
    return proj.t()  # open_clip's parameter (C, D), applied as x @ proj


def _vision_state(visual: nn.Module) -> dict:
    embeddings = "vision_model.embeddings"
    return {
        f"{embeddings}.patch_embedding.weight": visual.conv1.weight,
        f"{embeddings}.class_embedding": visual.class_embedding,
        f"{embeddings}.position_embedding.weight": visual.positional_embedding,
        "vision_model.pre_layrnorm.weight": visual.ln_pre.weight,  # transformers' own spelling
        "vision_model.pre_layrnorm.bias": visual.ln_pre.bias,
        "vision_model.post_layernorm.weight": visual.ln_post.weight,
        "vision_model.post_layernorm.bias": visual.ln_post.bias,
        "visual_projection.weight": _projection(visual.proj),
        **_blocks_state(visual.transformer, "vision_model"),
    }


def _text_state(text: nn.Module) -> dict:
    return {
        "text_model.embeddings.token_embedding.weight": text.token_embedding.weight,
        "text_model.embeddings.position_embedding.weight": text.positional_embedding,
        "text_model.final_layer_norm.weight": text.ln_final.weight,
        "text_model.final_layer_norm.bias": text.ln_final.bias,
        "text_projection.weight": _projection(text.text_projection),
        **_blocks_state(text.transformer, "text_model"),
    }


def _check_probe(clip, visual: nn.Module, text: nn.Module) -> None:
    """Refuse a ``CLIPModel`` whose embeddings of random pixels and token rows differ from the towers'."""
    gen = torch.Generator().manual_seed(0)
    size = int(visual.image_size[0])
    pixels = torch.randn(2, 3, size, size, generator=gen)
    ids = torch.randint(1, _EOT_ID - 1, (2, 6), generator=gen)
    ids[:, 0], ids[0, 3], ids[1, 5] = _EOT_ID - 1, _EOT_ID, _EOT_ID  # a start, then an end at 3 and at 5
    ids[0, 4:] = 0  # padding after the first row's end
    with torch.no_grad():
        pairs = (
            (clip.get_image_features(pixel_values=pixels), visual(pixels)),
            (clip.get_text_features(input_ids=ids, attention_mask=(ids > 0).long()), text(ids)),
        )
    for name, (theirs, ours) in zip(("image", "text"), pairs, strict=True):
        theirs = getattr(theirs, "pooler_output", theirs)  # a model output in some transformers versions
        if not torch.allclose(theirs.float(), ours.float(), rtol=1e-3, atol=1e-4):
            raise FormatRefusal(
                f"--format {FORMAT}: CLIPModel's {name} tower does not embed as mmfast's; {HOLDERS}"
            )


def _clip_processor_with_tokenizer(model, image_processor):
    """A ``CLIPProcessor``: the image processor, and open_clip's BPE as transformers' ``CLIPTokenizer``."""
    from transformers import CLIPProcessor, CLIPTokenizer  # transformers: a slow import, only for this format

    tok = model.tokenizer
    if getattr(tok, "clean", None) != "lower":
        raise FormatRefusal(
            f"--format {FORMAT}: transformers' CLIPTokenizer lower-cases, and this tokenizer cleans "
            f"'{getattr(tok, 'clean', None)}'; {HOLDERS}"
        )
    vocab, merges = tok.bpe()
    names = {i: token for token, i in vocab.items()}  # open_clip spells them <start_of_text>, <end_of_text>
    tokenizer = CLIPTokenizer(
        vocab=vocab,
        merges=merges,
        bos_token=names[_EOT_ID - 1],
        eos_token=names[_EOT_ID],
        unk_token=names[_EOT_ID],
        pad_token=names[_EOT_ID],  # transformers' CLIP pads so; "!" (open_clip's id 0) would not split as text
        model_max_length=min(int(model.config["max_length"]), int(tok.context_length)),
    )
    return CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer)


def clip_processor(config: dict):
    """A ``CLIPImageProcessor`` giving the model's eval preprocessing: its filter, its shorter side and centre
    crop (or the whole picture squashed to the size), its mean and std."""
    from transformers import CLIPImageProcessor  # transformers: a slow import, only for this format

    size, resized = eval_geometry(config)
    resize = eval_resize(config)
    squash = resize["resize_mode"] == "squash"
    return CLIPImageProcessor(
        size={"height": size, "width": size} if squash else {"shortest_edge": resized},
        crop_size={"height": size, "width": size},
        do_center_crop=not squash,
        resample=_RESAMPLE[resize["interpolation"]],
        image_mean=list(config["mean"]),
        image_std=list(config["std"]),
    )
