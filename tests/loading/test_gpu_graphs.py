"""Every GPU graph the code can build, defined and serialized on the CPU.

DALI checks each operator's argument names when a graph is defined and writes the whole graph (operators,
devices, argument values) when it is serialized; neither needs CUDA, only ``build()`` does. So a misspelled
GPU-only argument, or an operator left on the wrong device, fails here in CI instead of on the first GPU run.
The serialized graph is DALI's ``PipelineDef`` protobuf (dali/pipeline/proto/dali.proto), read below with a
small wire-format decoder because the DALI wheel ships no Python bindings for it.
"""

from __future__ import annotations

import functools
import itertools
import struct

import numpy as np
import pytest
import torch
from conftest import save_image
from nvidia.dali import types

import mmfast.loading.epoch_reader as reader_module
import mmfast.loading.graphs as image_module
from mmfast.loading.draws import DrawFeed
from mmfast.loading.graphs import image_pipeline
from mmfast.loading.image_loader import ImageLoader
from mmfast.loading.sources import read_files, read_wds

SIZE = 64
DECODER_KNOBS = {"hw_decoder_load": 0.25, "memory_padding": 16 << 20, "size_hint": 2048}  # all non-default
DEFAULT_KNOBS = {"hw_decoder_load": 0.65, "memory_padding": 64 << 20, "size_hint": 1024}  # image_pipeline's
GPU_ONLY_ARGS = {
    "hw_decoder_load",
    "device_memory_padding",
    "host_memory_padding",
    "preallocate_width_hint",
    "preallocate_height_hint",
}


# -- DALI's serialized graph -------------------------------------------------------------------------------
def _varint(buf: bytes, i: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        byte = buf[i]
        i += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, i


def _fields(buf: bytes) -> list[tuple[int, object]]:
    """(field number, value) of one protobuf message: varints as int, fixed32 as float, the rest as bytes."""
    out, i = [], 0
    while i < len(buf):
        key, i = _varint(buf, i)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(buf, i)
        elif wire == 5:
            value, i = struct.unpack_from("<f", buf, i)[0], i + 4
        elif wire == 2:
            n, i = _varint(buf, i)
            value, i = buf[i : i + n], i + n
        else:
            raise ValueError(f"protobuf wire type {wire} is not used by dali.proto")
        out.append((field, value))
    return out


def _argument(buf: bytes) -> tuple[str, object]:
    """dali.proto Argument: 1 name, 3 floats, 4 ints, 5 strings, 6 bools, 7 vector elements."""
    name, value, elements = "", None, []
    for field, v in _fields(buf):
        if field == 1:
            name = v.decode()
        elif field in (3, 4, 6):
            value = v
        elif field == 5:
            value = v.decode()
        elif field == 7:
            elements.append(_argument(v)[1])
    return name, elements if elements else value


def _endpoint(buf: bytes) -> tuple[str, str]:
    """dali.proto InputOutput: 1 name, 2 device."""
    fields = dict(_fields(buf))
    return fields[1].decode(), fields[2].decode()


def _graph(serialized: bytes) -> dict:
    """{"ops": [{"name", "device", "args", "inputs", "outputs"}], "outputs": [(name, device)]} of a
    PipelineDef (5: OpDef, 7: pipeline outputs; OpDef 1: operator name, 2 inputs, 3 outputs, 4 arguments)."""
    ops, outputs = [], []
    for field, v in _fields(serialized):
        if field == 5:
            op = {"name": "", "args": {}, "inputs": [], "outputs": []}
            for f, x in _fields(v):
                if f == 1:
                    op["name"] = x.decode()
                elif f == 2:
                    op["inputs"].append(_endpoint(x))
                elif f == 3:
                    op["outputs"].append(_endpoint(x))
                elif f == 4:
                    key, value = _argument(x)
                    op["args"][key] = value
            op["device"] = op["args"]["device"]
            ops.append(op)
        elif field == 7:
            outputs.append(_endpoint(v))
    return {"ops": ops, "outputs": outputs}


def _only(graph: dict, name: str) -> dict:
    found = [op for op in graph["ops"] if op["name"] == name]
    assert len(found) == 1, f"{len(found)} '{name}' operators in {[op['name'] for op in graph['ops']]}"
    return found[0]


def _names(graph: dict) -> list[str]:
    return [op["name"] for op in graph["ops"]]


def _decoder_op(train: bool, source: str) -> str:
    """The decoder a graph has: train crops from the loader's per-sample draws (a slice) on a source the loader
    orders, DALI's own random crop on one that orders itself (WebDataset); eval decodes whole images."""
    if not train:
        return "decoders__Image"
    return "decoders__ImageSlice" if source == "files" else "decoders__ImageRandomCrop"


def _define(source: str, decode_device: str, **kwargs):
    """image_pipeline on a source that need not exist: defining and serializing never open it; a train graph of
    files takes its crops from per-sample draws, as the loader's does."""
    if source == "files" and kwargs.get("train"):
        kwargs.setdefault("draws", DrawFeed(0, np.array([0, 1]), np.zeros(2, dtype=np.int64)))
    read = (
        functools.partial(read_files, ["/nowhere/0.jpg", "/nowhere/1.jpg"], [0, 1])
        if source == "files"
        else functools.partial(read_wds, ["/nowhere/a.tar"], ["/nowhere/a.idx"])
    )
    return image_pipeline(
        read=read,
        size=SIZE,
        decode_device=decode_device,
        batch_size=2,
        num_threads=1,
        device_id=None,  # a real id makes serialize() initialize CUDA
        **kwargs,
    )


# -- the matrix ----------------------------------------------------------------------------------------------
MATRIX = list(itertools.product([True, False], ["files", "wds"], [0.0, 0.4], [True, False], [True, False]))


@pytest.mark.parametrize(
    "train, source, color_jitter, fp16, finish_on_host",
    MATRIX,
    ids=[
        f"{'train' if t else 'eval'}-{s}-jitter{j}-{'fp16' if h else 'fp32'}-{'host' if f else 'dali'}"
        for t, s, j, h, f in MATRIX
    ],
)
@pytest.mark.parametrize("knobs", [DEFAULT_KNOBS, DECODER_KNOBS], ids=["default-knobs", "custom-knobs"])
def test_every_graph_variant_defines_and_serializes_on_both_decoders(
    train, source, color_jitter, fp16, finish_on_host, knobs
):
    variant = {"train": train, "color_jitter": color_jitter, "fp16": fp16, "finish_on_host": finish_on_host}
    gpu = _graph(_define(source, "mixed", **variant, **knobs).serialize())
    cpu = _graph(_define(source, "cpu", **variant, **knobs).serialize())

    decoder_name = _decoder_op(train, source)
    reader_name = "readers__File" if source == "files" else "readers__Webdataset"
    for graph, device, image_device in ((gpu, "mixed", "gpu"), (cpu, "cpu", "cpu")):
        assert _only(graph, reader_name)["device"] == "cpu"
        decoder = _only(graph, decoder_name)
        assert decoder["device"] == device and decoder["outputs"][0][1] == image_device
        # every operator downstream of the decoder follows it onto the GPU (random draws stay on the host)
        image_ops = [op for op in graph["ops"] if op["name"] in ("Resize", "ColorTwist", "CropMirrorNormalize")]
        assert all(op["device"] == image_device for op in image_ops), [(o["name"], o["device"]) for o in image_ops]
        assert _names(graph).count("ColorTwist") == (1 if train and color_jitter > 0 else 0)
        assert ("Resize" in _names(graph)) == (not finish_on_host)
        assert len(graph["outputs"]) == (3 if finish_on_host else 2)
        assert graph["outputs"][0][1] == image_device  # the images; sample ids (and flips) come from the host
        if not finish_on_host:
            cmn = _only(graph, "CropMirrorNormalize")
            assert cmn["args"]["dtype"] == int(types.FLOAT16 if fp16 else types.FLOAT)
            assert cmn["args"]["output_layout"] == "CHW"

    decoder = _only(gpu, decoder_name)["args"]
    assert decoder["hw_decoder_load"] == pytest.approx(knobs["hw_decoder_load"])
    assert decoder["device_memory_padding"] == decoder["host_memory_padding"] == knobs["memory_padding"]
    assert decoder["preallocate_width_hint"] == decoder["preallocate_height_hint"] == knobs["size_hint"]
    assert not GPU_ONLY_ARGS & set(_only(cpu, decoder_name)["args"])  # libjpeg-turbo takes none of them


# -- the net catches mistakes --------------------------------------------------------------------------------
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_a_bogus_gpu_only_decoder_argument_fails_at_definition(monkeypatch, train):
    real = image_module._decoder_kwargs

    def with_typo(decode_device, *args):
        kwargs = real(decode_device, *args)
        return {**kwargs, "hw_decoder_lod": 0.5} if kwargs else kwargs  # only the GPU decoder gets knobs

    monkeypatch.setattr(image_module, "_decoder_kwargs", with_typo)
    with pytest.raises((KeyError, RuntimeError), match="hw_decoder_lod") as raised:
        _define("files", "mixed", train=train)
    op = _decoder_op(train, "files")
    assert f'"{op}"' in str(raised.value)
    cpu = _graph(_define("files", "cpu", train=train).serialize())  # the CPU graph never sees the knobs
    assert _only(cpu, op)["device"] == "cpu"


# -- the loader's own graph ----------------------------------------------------------------------------------
@pytest.fixture
def pretend_cuda(monkeypatch):
    """torch reports one CUDA device, so the loader takes its GPU path (nothing here runs on it)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


@pytest.mark.parametrize("wds", [False, True], ids=["files", "wds"])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_the_loaders_gpu_graph_defines_with_its_own_arguments(tmp_path, monkeypatch, pretend_cuda, train, wds):
    files = [str(save_image(tmp_path / f"{i}.jpg", seed=i)) for i in range(4)]
    shards = None
    if wds:  # the loader only checks that shard and index exist; defining the graph never reads them
        shards = [str(tmp_path / "train-00000.tar")]
        for suffix in (".tar", ".idx"):
            (tmp_path / f"train-00000{suffix}").touch()
    loader = ImageLoader(
        files, batch_size=2, shuffle=train, size=SIZE, device="cuda", wds_shards=shards, **DECODER_KNOBS
    )
    calls = []

    def recording(**kwargs):
        calls.append(kwargs)
        return image_pipeline(**kwargs)

    monkeypatch.setattr(reader_module, "image_pipeline", recording)
    positions = None if wds else loader.positions(0)
    loader.define_pipeline(positions, seed_epoch=0)  # defining it checks the argument names on "mixed"

    (kwargs,) = calls
    assert kwargs["decode_device"] == "mixed" and kwargs["device_id"] == 0
    assert kwargs["finish_on_host"] is False  # the GPU path always finishes in DALI
    assert kwargs["train"] is train and kwargs["read"].func is (read_wds if wds else read_files)
    if not wds:
        assert kwargs["read"].args == (
            [files[p] for p in loader.positions(0)],
            [int(p) for p in loader.positions(0)],
        )
    # the same graph, serialized: device_id=None is the one change (a real id makes serialize() open CUDA)
    graph = _graph(image_pipeline(**{**kwargs, "device_id": None}).serialize())
    decoder = _only(graph, _decoder_op(train, "wds" if wds else "files"))
    assert decoder["device"] == "mixed"
    assert decoder["args"]["hw_decoder_load"] == pytest.approx(DECODER_KNOBS["hw_decoder_load"])
    assert decoder["args"]["preallocate_width_hint"] == DECODER_KNOBS["size_hint"]
    assert _only(graph, "CropMirrorNormalize")["device"] == "gpu"
    assert [n for n in _names(graph) if n in ("Resize", "ColorTwist")] == ["Resize"]  # no jitter by default
