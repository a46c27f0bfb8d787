"""Export a model directory's network: ONNX (``torch.onnx.export``) and ``torch.export`` programs, with the
ONNX file checked against PyTorch in onnxruntime.

Both take three tensors and return one: ``image`` (B, 3, S, S) float32, normalized as config.json says,
``input_ids`` and ``attention_mask`` (B, L) int64 (the tokenizer's ids, padded to the longest caption) ->
``logits`` (B, C). The batch size and caption length are dynamic. The ONNX graphs of the single-modality
baselines ("image", "text") have no input for the modality they ignore.

A dual encoder ("clip") is exported as its two towers, each a file of its own: ``image`` -> ``embedding``
(B, D) and ``input_ids``, ``attention_mask`` -> ``embedding`` (B, D), normalized (``export_towers_onnx``,
``export_towers_program``, ``towers_parity``).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

from mmfast.infer.model_dir import MmfastModel

INPUT_NAMES = ["image", "input_ids", "attention_mask"]


class LogitsModule(nn.Module):
    """Positional tensors in, logits out: the batch dict the network takes, made exportable."""

    def __init__(self, model: MmfastModel):
        super().__init__()
        self.model = model.model

    def forward(self, image: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model({"image": image, "input_ids": input_ids, "attention_mask": attention_mask})


def example_inputs(
    model: MmfastModel, batch: int = 2, length: int = 12, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    """Random inputs of the right shapes: an image batch and captions of different lengths (padding included)."""
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    size = cfg["image_size"]
    image = torch.randn(batch, 3, size, size, generator=g)
    ids = torch.randint(5, cfg["vocab_size"], (batch, length), generator=g)
    lengths = torch.linspace(length, max(3, length // 2), batch).round().long()  # (B,): the first row is full
    mask = (torch.arange(length)[None, :] < lengths[:, None]).long()  # (B, L)
    ids = torch.where(mask.bool(), ids, torch.zeros_like(ids))
    return image, ids, mask


@contextlib.contextmanager
def traceable_attention():
    """``nn.MultiheadAttention`` (open_clip's towers) without its fused inference kernel, which neither ONNX nor
    ``torch.export`` can express; the unfused path computes the same attention.

    The tracer's warnings are not printed: transformers' masking code branches on tensor sizes ("might cause
    the trace to be incorrect"), and opset 17 spells advanced indexing in several operators. What they warn of
    is what ``onnx_parity`` and ``towers_parity`` test, at another batch size and caption length than the
    trace's."""
    enabled = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
            warnings.filterwarnings("ignore", message="Exporting aten::index operator", category=UserWarning)
            yield
    finally:
        torch.backends.mha.set_fastpath_enabled(enabled)


def _longest(model: MmfastModel) -> int:
    """The longest caption an exported program takes: 512 tokens, or fewer when the text tower has fewer positions
    (an open_clip text transformer's context), less the positions early fusion's image tokens take."""
    text = getattr(model.model, "text", None)
    longest = min(512, getattr(text, "max_positions", None) or 512)
    if hasattr(model.model, "image_tokens"):  # early fusion: [CLS], the image's tokens, then the caption's
        size, training = model.config["image_size"], model.model.training
        with torch.no_grad():  # in eval mode: a batch norm's running statistics stay as they are
            longest -= model.model.eval().image_tokens(torch.zeros(1, 3, size, size)).shape[1]
        model.model.train(training)
    return longest


def export_onnx(model: MmfastModel, path: str | os.PathLike, opset: int = 17) -> Path:
    """Write an ONNX file with dynamic batch and caption length (TorchScript-based exporter: no onnxscript
    needed at export time)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    net = LogitsModule(model).eval()
    with torch.no_grad(), traceable_attention():
        torch.onnx.export(
            net,
            example_inputs(model),
            str(path),
            input_names=INPUT_NAMES,
            output_names=["logits"],
            dynamic_axes={
                "image": {0: "batch"},
                "input_ids": {0: "batch", 1: "length"},
                "attention_mask": {0: "batch", 1: "length"},
                "logits": {0: "batch"},
            },
            opset_version=opset,
            dynamo=False,
        )
    return path


def export_program(model: MmfastModel, path: str | os.PathLike) -> Path:
    """Write a ``torch.export`` program (``torch.export.load(path).module()(image, input_ids, mask)``) with a
    dynamic batch (at least 2) and caption length."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    batch, length = torch.export.Dim("batch", min=2), torch.export.Dim("length", min=3, max=_longest(model))
    with traceable_attention():
        program = torch.export.export(
            LogitsModule(model).eval(),
            example_inputs(model),
            dynamic_shapes={
                "image": {0: batch},
                "input_ids": {0: batch, 1: length},
                "attention_mask": {0: batch, 1: length},
            },
        )
    torch.export.save(program, str(path))
    return path


@torch.no_grad()
def onnx_parity(
    model: MmfastModel, onnx_path: str | os.PathLike, inputs: tuple[torch.Tensor, ...] | None = None
) -> float:
    """Largest absolute difference between onnxruntime's and PyTorch's fp32 logits on the same inputs."""
    import onnxruntime as ort  # onnxruntime: optional (mmfast[export]), only for the parity check

    inputs = inputs if inputs is not None else example_inputs(model, batch=3, length=9, seed=1)
    ref = LogitsModule(model).eval()(*inputs).float().numpy()
    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    feed = {n: t.numpy() for n, t in zip(INPUT_NAMES, inputs, strict=True)}
    # the single-modality baselines' graphs have no input for the modality they ignore
    (got,) = session.run(["logits"], {i.name: feed[i.name] for i in session.get_inputs()})
    return float(np.abs(got - ref).max())


class ImageTower(nn.Module):
    """A dual encoder's image tower: ``image`` (B, 3, S, S) -> normalized ``embedding`` (B, D)."""

    def __init__(self, model: MmfastModel):
        super().__init__()
        self.model = model.model

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.model.encode_image(image)


class TextTower(nn.Module):
    """A dual encoder's text tower: ``input_ids``, ``attention_mask`` (B, L) -> normalized ``embedding`` (B, D)."""

    def __init__(self, model: MmfastModel):
        super().__init__()
        self.model = model.model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model.encode_text(input_ids, attention_mask)


# tower: (module, its inputs' positions in example_inputs, their names, their dynamic axes)
_TOWERS = {
    "image": (ImageTower, (0,), ["image"], {"image": {0: "batch"}}),
    "text": (
        TextTower,
        (1, 2),
        ["input_ids", "attention_mask"],
        {"input_ids": {0: "batch", 1: "length"}, "attention_mask": {0: "batch", 1: "length"}},
    ),
}


def export_towers_onnx(model: MmfastModel, out_dir: str | os.PathLike, opset: int = 17) -> dict[str, Path]:
    """Write OUT_DIR/image.onnx and OUT_DIR/text.onnx (dynamic batch and caption length).

    Returns:
        {"image": path, "text": path}.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    example = example_inputs(model)
    paths = {}
    for name, (cls, which, names, axes) in _TOWERS.items():
        paths[name] = out_dir / f"{name}.onnx"
        args = tuple(example[i] for i in which)
        if name == "text" and getattr(model.model.text, "onnx_dynamo", False):
            _onnx_by_torch_export(cls(model).eval(), args, paths[name], names, _dims(model), opset)
            continue
        with torch.no_grad(), traceable_attention():
            torch.onnx.export(
                cls(model).eval(),
                args,
                str(paths[name]),
                input_names=names,
                output_names=["embedding"],
                dynamic_axes={**axes, "embedding": {0: "batch"}},
                opset_version=opset,
                dynamo=False,
            )
    return paths


def export_towers_program(model: MmfastModel, out_dir: str | os.PathLike) -> dict[str, Path]:
    """Write OUT_DIR/image.pt2 and OUT_DIR/text.pt2, ``torch.export`` programs with a dynamic batch (at least
    2) and caption length.

    Returns:
        {"image": path, "text": path}.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    example = example_inputs(model)
    paths = {}
    for name, (cls, which, names, _) in _TOWERS.items():
        with traceable_attention():
            program = torch.export.export(
                cls(model).eval(), tuple(example[i] for i in which), dynamic_shapes=_dims(model, names)
            )
        paths[name] = out_dir / f"{name}.pt2"
        torch.export.save(program, str(paths[name]))
    return paths


def _dims(model: MmfastModel, names: list[str] | tuple[str, ...] = ("input_ids", "attention_mask")) -> dict:
    """``torch.export``'s dynamic shapes of the towers' inputs: a batch of at least 2, a caption length."""
    batch, length = torch.export.Dim("batch", min=2), torch.export.Dim("length", min=3, max=_longest(model))
    dims = {"image": {0: batch}, "input_ids": {0: batch, 1: length}, "attention_mask": {0: batch, 1: length}}
    return {n: dims[n] for n in names}


def _onnx_by_torch_export(
    tower: nn.Module, args: tuple, path: Path, names: list[str], dims: dict, opset: int
) -> None:
    """Write a tower's ONNX graph through ``torch.export`` (the dynamo exporter, opset 18 at least).
    open_clip's text transformer goes this way: torch.onnx's TorchScript exporter fixes its attention at the
    example's caption length."""
    with torch.no_grad(), traceable_attention(), warnings.catch_warnings():
        # its note that two inputs' axes share one name ("batch", "length") is what the names ask for
        warnings.filterwarnings("ignore", message=".*axis name", category=UserWarning)
        program = torch.onnx.export(
            tower, args, input_names=names, output_names=["embedding"], dynamic_shapes=dims,
            opset_version=max(opset, 18), dynamo=True, verbose=False,
        )  # fmt: skip
    out = program.model.graph.outputs[0]
    for node in program.model.graph:
        for value in node.outputs:
            if value.name == "embedding" and value is not out:  # the token embedding's output takes the name too
                value.name = "token_embedding"
    program.save(str(path))


@torch.no_grad()
def towers_parity(
    model: MmfastModel, paths: dict[str, Path], inputs: tuple[torch.Tensor, ...] | None = None
) -> dict[str, float]:
    """Per tower, the largest absolute difference between onnxruntime's and PyTorch's fp32 embeddings."""
    import onnxruntime as ort  # onnxruntime: optional (mmfast[export]), only for the parity check

    inputs = inputs if inputs is not None else example_inputs(model, batch=3, length=9, seed=1)
    diffs = {}
    for name, (cls, which, names, _) in _TOWERS.items():
        args = tuple(inputs[i] for i in which)
        ref = cls(model).eval()(*args).float().numpy()
        session = ort.InferenceSession(str(paths[name]), providers=["CPUExecutionProvider"])
        feed = {n: t.numpy() for n, t in zip(names, args, strict=True)}
        # a causal text tower reads no attention mask: its graph has no such input
        (got,) = session.run(["embedding"], {i.name: feed[i.name] for i in session.get_inputs()})
        diffs[name] = float(np.abs(got - ref).max())
    return diffs
