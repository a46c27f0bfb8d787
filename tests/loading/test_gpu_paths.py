"""Every loader and training path, run on each device: the CPU here and in CI, CUDA where there is one.

The same assertions on both devices, so that the GPU variants (nvJPEG / hardware decoder, DALI's GPU resize,
jitter and normalize, fp16 autocast + GradScaler) are held to what the CPU variants already prove, and the
tests themselves are proven on every CPU run. Real 800x600 JPEGs cut from scikit-image's photos.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mmfast.data.preprocessing import IMAGENET_MEAN, IMAGENET_STD
from mmfast.loading.multimodal import MultimodalLoader
from mmfast.prepare.core import PrepareConfig, prepare_dataset
from mmfast.prepare.wds_export import write_wds
from tools import train as train_tool
from tools.benchmarks.benchlib.data import photo_manifest

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
LO = torch.tensor([(0 - m) / s for m, s in zip(IMAGENET_MEAN, IMAGENET_STD, strict=True)])
HI = torch.tensor([(255 - m) / s for m, s in zip(IMAGENET_MEAN, IMAGENET_STD, strict=True)])


@pytest.fixture(scope="module")
def photo_set(tmp_path_factory) -> Path:
    """48 real 800x600 JPEGs (36 train / 12 val) with WebDataset shards beside the files."""
    root = tmp_path_factory.mktemp("gpu-photos")
    manifest = photo_manifest(root, n=48)
    out = root / "prepared"
    prepare_dataset(PrepareConfig(source=str(manifest), out=str(out), val_fraction=0.25, progress=False))
    write_wds(out, shard_size=10)
    return out


def _rows(data: Path, split: str) -> list[dict]:
    return [json.loads(ln) for ln in (data / f"{split}.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("source", ["files", "wds"])
@pytest.mark.parametrize("fp16", [True, False], ids=["fp16", "fp32"])
@pytest.mark.parametrize("split", ["train", "val"])
def test_every_loader_path_serves_normalized_batches_on_its_device(photo_set, device, source, fp16, split):
    jitter = {"color_jitter": 0.4} if split == "train" else {}
    loader = MultimodalLoader(
        photo_set, split, batch_size=8, size=48, device=device, fp16=fp16, source=source, **jitter
    )
    seen = []
    for batch in loader:
        img = batch["image"]
        assert img.device.type == device and batch["input_ids"].device.type == device
        assert img.dtype == (torch.float16 if fp16 else torch.float32) and img.shape[1:] == (3, 48, 48)
        real = batch["id"] >= 0
        x = img[real].float().cpu()
        assert torch.isfinite(x).all()
        # normalized pixel values stay inside [(0 - mean) / std, (255 - mean) / std] per channel
        # (jitter saturates, it never leaves the range); real photos are not flat
        assert (x >= LO.view(1, 3, 1, 1) - 0.01).all() and (x <= HI.view(1, 3, 1, 1) + 0.01).all()
        assert x.std(dim=(2, 3)).mean() > 0.2
        seen += batch["id"][real].tolist()
    ids = sorted(r["id"] for r in _rows(photo_set, split))
    if split == "val":  # no drop_last: every sample exactly once
        assert sorted(seen) == ids
    else:
        assert len(seen) == len(set(seen)) == len(ids) // 8 * 8 and set(seen) <= set(ids)


@pytest.mark.gpu
@pytest.mark.parametrize("source", ["files", "wds"])
def test_gpu_eval_pixels_match_the_cpu_decoder(photo_set, source):
    """Eval is deterministic: nvJPEG (or the hardware decoder) + GPU resize vs libjpeg-turbo + CPU resize."""
    gpu = MultimodalLoader(photo_set, "val", batch_size=6, size=64, device="cuda", fp16=True, source=source)
    cpu = MultimodalLoader(photo_set, "val", batch_size=6, size=64, device="cpu", fp16=True, source=source)
    for g, c in zip(gpu, cpu, strict=True):
        assert torch.equal(g["id"].cpu(), c["id"]) and torch.equal(g["input_ids"].cpu(), c["input_ids"])
        assert (g["image"].float().cpu() - c["image"].float()).abs().mean() < 0.05


@pytest.mark.parametrize("device", DEVICES)
def test_images_damaged_after_preparation_are_skipped_on_each_device(tmp_path, device):
    data = tmp_path / "prepared"  # its own photos: this test damages them
    manifest = photo_manifest(tmp_path / "photos", n=24)
    prepare_dataset(PrepareConfig(source=str(manifest), out=str(data), val_fraction=0.25, progress=False))
    rows = _rows(data, "train")
    truncated, text = rows[3], rows[10]
    blob = Path(truncated["image"]).read_bytes()
    Path(truncated["image"]).write_bytes(blob[: len(blob) // 3])
    Path(text["image"]).write_text("not a jpeg\n")
    loader = MultimodalLoader(data, "train", batch_size=6, size=32, device=device, on_bad_image="skip")
    n = len(rows) // 6 * 6
    for _ in range(2):  # the second epoch knows the bad files already
        served = [i for b in loader for i in b["id"].tolist()]
        assert len(served) == n and truncated["id"] not in served and text["id"] not in served
        real = [i for i in served if i >= 0]
        assert len(real) == len(set(real)) and n - 2 <= len(real) < n  # masked (-1) in their place
    assert sorted(s["id"] for s in loader.skipped) == sorted([truncated["id"], text["id"]])


@pytest.mark.parametrize("device", DEVICES)
def test_late_fusion_trains_with_accumulation_and_mixed_precision_on_each_device(photo_set, tmp_path, device):
    mp = "fp16" if device == "cuda" else "no"  # fp16 + GradScaler is the GPU's
    out = tmp_path / "run"
    flags = ["--data", str(photo_set), "--out", str(out), "--model", "late", "--epochs", "2"]
    flags += ["--batch-size", "6", "--grad-accum", "2", "--image-size", "48", "--mixed-precision", mp]
    flags += ["--checkpoint-every", "2", "--no-progress", "--num-threads", "2"]
    if device == "cuda":
        flags.append("--channels-last")
    assert train_tool.main(flags) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["device"].startswith(device) and summary["mixed_precision"] == mp
    # 36 train samples, 6 per batch: 6 batches an epoch, 3 optimizer steps of 2 micro-batches each
    assert summary["global_step"] == 6
    metrics = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2 and all(m["train_loss"] == m["train_loss"] for m in metrics)
    assert 0.0 <= metrics[-1]["val_acc"] <= 1.0
