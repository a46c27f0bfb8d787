"""DALI loaders on the CPU: numerics against a PIL reference, id joins, sharding, epochs, resume, WebDataset."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import first_lines_of_fresh_runs, n_rows, small_jpegs
from PIL import Image

from mmfast.data.batch import IGNORE_LABEL
from mmfast.data.preprocessing import IMAGENET_MEAN, IMAGENET_STD
from mmfast.data.token_cache import TokenCache
from mmfast.loading.image_loader import ImageLoader
from mmfast.loading.multimodal import MultimodalLoader
from mmfast.loading.sampling import epoch_order, shard_positions
from mmfast.prepare.wds_export import write_wds


def _pil_eval_reference(path: Path, size: int, crop_ratio: float = 0.875) -> np.ndarray:
    """Resize the shorter side to size / crop_ratio (bilinear, antialiased), center crop, normalize: (3, S, S)."""
    im = Image.open(path).convert("RGB")
    w, h = im.size
    s = round(size / crop_ratio)
    nw, nh = (s, round(h * s / w)) if w < h else (round(w * s / h), s)
    a = np.asarray(im.resize((nw, nh), Image.BILINEAR), dtype=np.float32)
    top, left = int((nh - size) / 2 + 0.5), int((nw - size) / 2 + 0.5)
    a = a[top : top + size, left : left + size]
    return ((a - np.array(IMAGENET_MEAN)) / np.array(IMAGENET_STD)).transpose(2, 0, 1)


def _rows(prepared: Path, split: str) -> list[dict]:
    return [json.loads(ln) for ln in (prepared / f"{split}.jsonl").read_text().splitlines()]


def _torchvision_eval_reference(path: Path, size: int) -> np.ndarray:
    """What a DataLoader over an ImageFolder gives: Resize(size / 0.875) + CenterCrop(size) + Normalize."""
    from torchvision.transforms import v2

    tf = v2.Compose(
        [
            v2.Resize(round(size / 0.875)),
            v2.CenterCrop(size),
            v2.ToImage(),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize([m / 255 for m in IMAGENET_MEAN], [s / 255 for s in IMAGENET_STD]),
        ]
    )
    return tf(Image.open(path).convert("RGB")).numpy()


@pytest.mark.parametrize("cpu_resize", ["torch", "dali"])
def test_eval_output_matches_a_pil_reference_on_real_photos(photos, cpu_resize):
    files = [str(p) for p in photos]
    loader = ImageLoader(files, batch_size=4, size=64, cpu_resize=cpu_resize, cache_decoded=False)
    out = torch.cat([images for images, _ in loader])
    assert out.shape == (len(photos), 3, 64, 64) and out.dtype == torch.float32
    for i, p in enumerate(photos):
        if cpu_resize == "torch":
            # torchvision's geometry and torch's uint8 antialiased bilinear kernel (PIL's, up to rare rounding)
            diff = np.abs(out[i].numpy() - _torchvision_eval_reference(p, 64))
            assert diff.max() < 0.018 and diff.mean() < 1e-3, (p.name, diff.max(), diff.mean())
        diff = np.abs(out[i].numpy() - _pil_eval_reference(p, 64))  # DALI's geometry rounds the long side
        # one 8-bit level is 1 / (255 * 0.226) = 0.017 in normalized units
        assert diff.mean() < 0.02 or cpu_resize == "torch", (p.name, diff.mean())
        assert np.percentile(diff, 99) < 0.25 or cpu_resize == "torch", (p.name, np.percentile(diff, 99))


def test_eval_geometry_is_torchvisions_in_image_loader_and_the_graphs_in_multimodal_loader(
    photos, prepared, tmp_path
):
    from mmfast.loading.host_finish import HostFinisher

    path = tmp_path / "wide.png"
    Image.open(photos[0]).convert("RGB").resize((150, 100)).save(path)
    # shorter side 73 = round(64 / 0.875): torchvision's Resize makes the longer one 109 (truncated), the graph 110
    tv, graph = _torchvision_eval_reference(path, 64), _pil_eval_reference(path, 64)
    assert np.abs(tv - graph).mean() > 0.05  # the two geometries really differ on this image
    ((images, labels),) = list(ImageLoader([str(path)], batch_size=1, size=64, cache_decoded=False))
    assert np.abs(images[0].numpy() - tv).mean() < 1e-3 and labels.tolist() == [0]
    # MultimodalLoader keeps its outputs: the graph's rounding, float16
    mm = MultimodalLoader(prepared, "val", batch_size=4, size=64)
    assert type(mm.images.finisher) is HostFinisher and mm.dtype == torch.float16
    finished = mm.images.finisher([torch.from_numpy(np.array(Image.open(path)))], np.zeros(1))
    assert finished.dtype == torch.float16 and np.abs(finished[0].float().numpy() - graph).mean() < 2e-3


@pytest.mark.parametrize("dtype", [None, torch.float16, torch.bfloat16])
def test_train_output_shape_dtype_and_range(photos, dtype):
    loader = ImageLoader(
        [str(p) for p in photos], batch_size=2, shuffle=True, drop_last=True, size=48, dtype=dtype
    )
    batches = list(loader)
    assert len(batches) == len(loader) == len(photos) // 2
    img = batches[0].images
    assert img.shape == (2, 3, 48, 48) and img.dtype == (dtype or torch.float32)
    assert -2.2 < float(img.min()) and float(img.max()) < 2.7  # normalized with ImageNet statistics


def _pil_resize_reference(path: Path, size: int) -> np.ndarray:
    """The whole image resized to size x size (bilinear, antialiased), normalized: (3, S, S)."""
    a = np.asarray(Image.open(path).convert("RGB").resize((size, size), Image.BILINEAR), dtype=np.float32)
    return ((a - np.array(IMAGENET_MEAN)) / np.array(IMAGENET_STD)).transpose(2, 0, 1)


@pytest.mark.parametrize("cpu_resize", ["torch", "dali"])
def test_train_output_matches_a_pil_reference_with_the_crop_fixed_to_the_whole_image(photos, tmp_path, cpu_resize):
    """With the random crop pinned to the whole image (area 1, the images' aspect ratio), the train path is
    resize + random flip + normalize: each output must equal PIL's resize of the file, mirrored or not."""
    files = []
    for k in range(3):  # 4:3 copies of each photo, so one aspect ratio pins every crop
        for p in photos:
            files.append(tmp_path / f"{k}_{p.stem}.jpg")
            Image.open(p).convert("RGB").resize((160 + 40 * k, 120 + 30 * k)).save(files[-1], quality=95)
    loader = ImageLoader(
        [str(f) for f in files], batch_size=6, shuffle=True, size=48, fp16=False, cpu_resize=cpu_resize,
        scale=(1.0, 1.0), ratio=(4 / 3, 4 / 3),
    )  # fmt: skip
    threads = torch.get_num_threads()
    flipped = []
    for batch in loader:
        assert batch.images.shape == (6, 3, 48, 48) and batch.images.dtype == torch.float32
        for img, i in zip(batch.images.numpy(), batch.ids.tolist(), strict=True):
            ref = _pil_resize_reference(files[i], 48)
            plain, mirrored = np.abs(img - ref).mean(), np.abs(img - ref[:, :, ::-1]).mean()
            # one 8-bit level is 0.017; torch's kernel is PIL's up to rare rounding (measured ~5e-5)
            tolerance = 1e-3 if cpu_resize == "torch" else 0.03
            assert min(plain, mirrored) < tolerance, (files[i].name, plain, mirrored)
            flipped.append(mirrored < plain)
    assert torch.get_num_threads() == threads  # the host finishing leaves the caller's setting alone
    assert len(flipped) == len(files) and 0 < sum(flipped) < len(flipped)  # random flips, both ways


@pytest.mark.parametrize("cpu_resize", ["torch", "dali"])
def test_color_jitter_changes_colors_but_not_geometry(photos, tmp_path, cpu_resize):
    files = []
    for p in photos:
        files.append(tmp_path / f"{p.stem}.jpg")
        Image.open(p).convert("RGB").resize((160, 120)).save(files[-1], quality=95)
    kw = dict(batch_size=len(files), shuffle=True, size=32, cpu_resize=cpu_resize, flip=False, as_dict=True)
    pinned = dict(scale=(1.0, 1.0), ratio=(4 / 3, 4 / 3))
    jittered = next(iter(ImageLoader([str(f) for f in files], color_jitter=0.4, **kw, **pinned)))
    for img, i in zip(jittered["image"].numpy(), jittered["id"].tolist(), strict=True):
        ref = _pil_resize_reference(files[i], 32)
        # brightness/contrast/saturation move values, but the picture stays where it was
        assert np.abs(img - ref).mean() > 0.03
        assert np.corrcoef(img.ravel(), ref.ravel())[0, 1] > 0.8


def test_ids_join_images_with_their_captions_and_labels(prepared):
    rows = {r["id"]: r for r in _rows(prepared, "val")}
    loader = MultimodalLoader(prepared, "val", batch_size=16, size=32, fp16=False)
    cache = TokenCache(prepared / "tokens", "val")
    seen = []
    for batch in loader:
        for k in range(len(batch["id"])):
            sid = int(batch["id"][k])
            if sid < 0:  # padding of the last eval batch
                assert batch["label"][k] == IGNORE_LABEL and batch["attention_mask"][k].sum() == 0
                continue
            seen.append(sid)
            assert int(batch["label"][k]) == rows[sid]["label"]
            n = int(batch["attention_mask"][k].sum())
            assert batch["input_ids"][k, :n].tolist() == cache.gather([sid])["input_ids"][0].tolist()
            # the image is the one its row names: compare with the eval reference of that file
            ref = _pil_eval_reference(Path(rows[sid]["image"]), 32)
            assert np.abs(batch["image"][k].numpy() - ref).mean() < 0.03
    assert sorted(seen) == sorted(rows)


def test_two_shards_cover_the_dataset_once_with_equal_batch_counts(prepared):
    all_ids = {r["id"] for r in _rows(prepared, "val")}
    per_rank = []
    for rank in range(2):
        loader = MultimodalLoader(prepared, "val", batch_size=8, size=32, shard_id=rank, num_shards=2)
        ids = [i for b in loader for i in b["id"].tolist()]
        per_rank.append((len(loader), [i for i in ids if i >= 0]))
    assert per_rank[0][0] == per_rank[1][0]
    a, b = set(per_rank[0][1]), set(per_rank[1][1])
    assert not a & b and a | b == all_ids and len(per_rank[0][1]) + len(per_rank[1][1]) == len(all_ids)
    # train (drop_last): equal counts, disjoint, and every sample at most once
    train = [MultimodalLoader(prepared, "train", batch_size=16, size=32, shard_id=r, num_shards=2) for r in (0, 1)]
    ids = [[i for b in t for i in b["id"].tolist()] for t in train]
    assert len(ids[0]) == len(ids[1]) == len(train[0]) * 16 == (n_rows(prepared, "train") // 32) * 16
    assert not set(ids[0]) & set(ids[1])


def test_epochs_reshuffle_and_the_seed_fixes_the_order(prepared):
    def order(seed, epoch):
        loader = MultimodalLoader(prepared, "train", batch_size=16, size=32, seed=seed)
        loader.set_epoch(epoch)
        return [i for b in loader for i in b["id"].tolist()]

    assert order(0, 0) == order(0, 0)
    assert order(0, 0) != order(0, 1)
    assert order(0, 0) != order(1, 0)
    loader = MultimodalLoader(prepared, "train", batch_size=16, size=32)
    first = [i for b in loader for i in b["id"].tolist()]
    second = [i for b in loader for i in b["id"].tolist()]  # the next __iter__ is the next epoch
    assert first != second and loader.epoch == 2


def test_each_iter_of_a_multimodal_loader_starts_a_new_epoch_also_after_a_peek(prepared):
    """``next(iter(loader))`` (the guide's first look), then a loop: the loop reads a whole epoch, the next one,
    as ImageLoader's does; an older iterator advanced after a newer one began raises, not a split stream."""

    def ids(loader):
        return [i for b in loader for i in b["id"].tolist()]

    reference = MultimodalLoader(prepared, "train", batch_size=16, size=32, seed=3)
    epochs = [ids(reference) for _ in range(3)]
    loader = MultimodalLoader(prepared, "train", batch_size=16, size=32, seed=3)
    peek = iter(loader)
    next(peek), next(peek)
    assert ids(loader) == epochs[1] and len(epochs[1]) == len(loader) * 16
    with pytest.raises(RuntimeError, match="replaced by a newer iter"):
        next(peek)
    assert ids(loader) == epochs[2]
    val = MultimodalLoader(prepared, "val", batch_size=16, size=32)
    whole = ids(val)
    next(iter(val))
    assert ids(val) == whole  # an evaluation after a peek sees every sample
    fresh = MultimodalLoader(prepared, "train", batch_size=16, size=32, seed=3)
    next(iter(fresh))
    fresh.set_epoch(0)  # as DistributedSampler's: the epoch asked for, from its first batch
    assert ids(fresh) == epochs[0]


def test_a_position_saved_after_an_epochs_last_batch_resumes_to_nothing_then_the_next_epoch(prepared):
    """A run stopped on an epoch's last step saves (epoch, len(loader)): the resumed loop of that epoch takes no
    batch, as the engine counts on, and the next epoch is whole (it used to be read in the ended one's place)."""
    reference = MultimodalLoader(prepared, "train", batch_size=16, size=32, seed=3)
    reference.set_epoch(4)
    want = [i for b in reference for i in b["id"].tolist()]
    loader = MultimodalLoader(prepared, "train", batch_size=16, size=32, seed=3)
    loader.set_epoch(3)
    epoch = iter(loader)
    for _ in range(len(loader)):  # the loop stops on the last batch, before asking for one more
        next(epoch)
    state = loader.state_dict()
    assert (state["epoch"], state["step"]) == (3, len(loader))
    resumed = MultimodalLoader(prepared, "train", batch_size=16, size=32, seed=3)
    resumed.load_state_dict(state)
    resumed.set_epoch(3)
    assert list(resumed) == []
    resumed.set_epoch(4)
    assert [i for b in resumed for i in b["id"].tolist()] == want


def _in_a_forked_child(work) -> str:
    """What ``work()`` raised in a child forked from this process ("" when nothing); bounded by a minute."""
    import os
    import signal
    import time

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report and leave at once, without running any destructor
        try:
            work()
            said = ""
        except BaseException as e:  # noqa: BLE001 - the parent asserts on what it was
            said = f"{type(e).__name__}: {e}"
        os.write(w, said.encode()[:8000] or b"-")
        os._exit(0)
    os.close(w)
    deadline = time.monotonic() + 60
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError("the forked child still waits after a minute")
        time.sleep(0.1)
    with os.fdopen(r, "rb") as f:
        said = f.read().decode()
    return "" if said == "-" else said


def test_a_loader_inherited_by_a_forked_child_refuses_at_once_naming_what_to_do(prepared):
    """A fork carries the loader's DALI pipelines and thread pools without their threads: its next batch
    waited for ever. The child is told to build its own loader; the parent's loader still reads."""
    loader = MultimodalLoader(prepared, "train", batch_size=16, size=32)
    first = next(iter(loader))["id"]
    for work in (lambda: next(iter(loader)), lambda: next(iter(loader.images))):
        said = _in_a_forked_child(work)
        assert said.startswith("RuntimeError: this ") and "was forked from it" in said, said
        assert "Build a new loader in this process" in said
    assert len([i for b in loader for i in b["id"].tolist()]) == len(loader) * 16 and len(first) == 16


def test_resume_from_a_mid_epoch_state_yields_exactly_the_rest(prepared):
    full = MultimodalLoader(prepared, "train", batch_size=16, size=32)
    full.set_epoch(3)
    reference = [(b["id"].clone(), b["image"].clone()) for b in full]
    part = MultimodalLoader(prepared, "train", batch_size=16, size=32)
    part.set_epoch(3)
    for i, _ in enumerate(part):
        if i == 4:
            state = json.loads(json.dumps(part.state_dict()))  # survives a JSON round trip
            break
    assert state["step"] == 5 and state["epoch"] == 3
    resumed = MultimodalLoader(prepared, "train", batch_size=16, size=32)
    resumed.load_state_dict(state)
    resumed.set_epoch(3)  # the training loop's usual call keeps the restored position
    rest = [(b["id"], b["image"]) for b in resumed]
    assert len(rest) == len(reference) - 5
    for (ref_ids, ref_img), (ids, img) in zip(reference[5:], rest, strict=True):
        assert torch.equal(ref_ids, ids)
        assert torch.equal(ref_img, img)  # same augmentation draws: DALI's checkpoint restored them
    # without DALI's checkpoint: the same remaining samples, in the same order
    state["dali_checkpoint"] = None
    fallback = MultimodalLoader(prepared, "train", batch_size=16, size=32)
    fallback.load_state_dict(state)
    fallback.set_epoch(3)
    assert [b["id"].tolist() for b in fallback] == [r[0].tolist() for r in reference[5:]]


def test_webdataset_and_file_readers_give_the_same_samples(prepared, tmp_path):
    import shutil

    copy = tmp_path / "p"
    shutil.copytree(prepared, copy)
    write_wds(copy, shard_size=25)
    for split in ("train", "val"):
        files = MultimodalLoader(copy, split, batch_size=16, size=32, shuffle=False, drop_last=False)
        wds = MultimodalLoader(copy, split, batch_size=16, size=32, shuffle=False, drop_last=False, source="wds")
        a, b = {}, {}
        for loader, seen in ((files, a), (wds, b)):
            for batch in loader:
                for k, sid in enumerate(batch["id"].tolist()):
                    if sid >= 0:
                        seen[sid] = (int(batch["label"][k]), batch["image"][k])
        assert sorted(a) == sorted(b) == [r["id"] for r in _rows(copy, split)]
        assert all(a[i][0] == b[i][0] and torch.equal(a[i][1], b[i][1]) for i in a)  # eval: same pixels


def test_bad_arguments_give_clear_errors(prepared, tmp_path):
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        MultimodalLoader(prepared, "train", batch_size=0)
    with pytest.raises(ValueError, match="shard_id must be in"):
        MultimodalLoader(prepared, "train", batch_size=8, shard_id=2, num_shards=2)
    with pytest.raises(ValueError, match="not a prepared dataset"):
        MultimodalLoader(tmp_path, "train")
    n = n_rows(prepared, "train")
    with pytest.raises(ValueError, match=f"2 processes with drop_last=True; pass batch_size={n // 2} or less"):
        MultimodalLoader(prepared, "train", batch_size=1000, shard_id=0, num_shards=2)
    with pytest.raises(ValueError, match=f"{n + 1} processes with drop_last=True; run at most {n} processes"):
        MultimodalLoader(prepared, "train", batch_size=1, shard_id=0, num_shards=n + 1)  # fewer samples than them
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            MultimodalLoader(prepared, "train", batch_size=8, device="cuda")
    with pytest.raises(ValueError, match="cpu_resize must be 'torch' or 'dali'"):
        MultimodalLoader(prepared, "train", batch_size=8, cpu_resize="pil")
    with pytest.raises(ValueError, match="unknown source"):
        MultimodalLoader(prepared, "train", batch_size=8, source="tfrecord")
    with pytest.raises(FileNotFoundError, match="--format wds"):
        MultimodalLoader(prepared, "train", batch_size=8, source="wds")
    loader = MultimodalLoader(prepared, "train", batch_size=8)
    state = loader.state_dict()
    other = MultimodalLoader(prepared, "train", batch_size=16)
    with pytest.raises(ValueError, match="batch_size was 8, now 16"):
        other.load_state_dict(state)


def test_drop_in_image_folder_loader(tmp_path):
    from conftest import save_image

    for c in ("ant", "bee"):
        for i in range(5):
            save_image(tmp_path / c / f"{i}.jpg", size=(50, 40), seed=i)
    loader = ImageLoader.from_folder(tmp_path, batch_size=4, shuffle=True, drop_last=True, num_workers=1, size=32)
    assert loader.classes == ["ant", "bee"] and len(loader) == 2
    labels = [int(x) for _, target in loader for x in target]
    assert len(labels) == 8 and set(labels) <= {0, 1}
    keep = ImageLoader.from_folder(tmp_path, batch_size=4, size=32)  # eval: keep all, a partial last batch
    sizes, ids = [], []
    for images, target in keep:
        sizes.append(len(images))
        ids += target.tolist()
    assert len(keep) == 3 and sizes == [4, 4, 2] and ids == [0] * 5 + [1] * 5


def test_shard_positions_arithmetic():
    order = epoch_order(10, 0, 0, shuffle=True)
    assert sorted(order.tolist()) == list(range(10))
    a, b = (shard_positions(order, 3, r, 2, drop_last=False) for r in (0, 1))
    assert len(a) == len(b) == 6 and sorted(x for x in [*a, *b] if x >= 0) == list(range(10))
    a, b = (shard_positions(order, 3, r, 2, drop_last=True) for r in (0, 1))
    assert len(a) == len(b) == 3 and not set(a) & set(b)


@pytest.mark.gpu
def test_gpu_loader_outputs_on_the_device_and_matches_cpu(prepared):
    gpu = MultimodalLoader(prepared, "val", batch_size=16, size=32, device="cuda", fp16=False)
    cpu = MultimodalLoader(prepared, "val", batch_size=16, size=32, device="cpu", fp16=False)
    for g, c in zip(gpu, cpu, strict=True):
        assert g["image"].is_cuda and g["input_ids"].is_cuda and g["label"].is_cuda
        assert torch.equal(g["id"].cpu(), c["id"])
        # nvJPEG and libjpeg-turbo differ by rounding: compare loosely
        assert (g["image"].cpu() - c["image"]).abs().mean() < 0.05


def test_odd_formats_pass_preparation_and_load_in_train_and_eval(tmp_path, photos):
    """Formats users bring: progressive JPEG, palette PNG with transparency, LA, 16-bit gray, RGBA TIFF and
    WebP, palette BMP, CMYK and EXIF-rotated JPEG, a 1-pixel image, a 30x2000 panorama."""
    from mmfast.prepare.core import PrepareConfig, prepare_dataset

    d = tmp_path / "odd"
    d.mkdir()
    photo = Image.open(next(p for p in photos if p.name == "astronaut.png")).convert("RGB")
    photo.resize((1600, 1200)).save(d / "progressive.jpg", progressive=True, quality=90)
    photo.convert("P", palette=Image.ADAPTIVE).save(d / "palette_trns.png", transparency=0)
    photo.convert("LA").save(d / "la.png")
    Image.fromarray(np.asarray(photo.convert("L")).astype(np.uint16) * 257).save(d / "gray16.png")
    photo.convert("RGBA").save(d / "rgba.tif")
    photo.convert("RGBA").save(d / "rgba.webp", lossless=True)
    photo.convert("P").save(d / "pal.bmp")
    photo.convert("CMYK").save(d / "cmyk.jpg")
    exif = photo.getexif()
    exif[0x0112] = 6  # "rotate 90" orientation tag
    photo.save(d / "exif_rot.jpg", exif=exif)
    Image.new("RGB", (1, 1), (255, 0, 0)).save(d / "onepx.png")
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (30, 2000, 3), dtype=np.uint8)).save(d / "pano.jpg")
    files = sorted(d.iterdir())
    rows = [{"image": f.name, "text": f"légende {f.stem} 日本語", "label": f.suffix} for f in files]
    (d / "m.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    summary = prepare_dataset(
        PrepareConfig(source=str(d / "m.jsonl"), out=str(tmp_path / "p"), val_fraction=0, progress=False)
    )
    assert summary["counts"]["accepted"] == len(files) == 11 and summary["counts"]["rejected"] == 0
    for train in (True, False):
        loader = MultimodalLoader(tmp_path / "p", "train", 4, size=48, train=train, shuffle=train, drop_last=False)
        ids = []
        for batch in loader:
            assert batch["image"].shape[1:] == (3, 48, 48) and torch.isfinite(batch["image"].float()).all()
            ids += [i for i in batch["id"].tolist() if i >= 0]
        assert sorted(ids) == list(range(11)) and not loader.skipped


def test_dali_batch_sizes_stay_under_the_size_dali_parses_safely():
    from mmfast.loading.arguments import dali_batch_size

    assert [dali_batch_size(b) for b in (1, 16, 31, 32, 48, 64, 96, 100, 256, 37)] == [
        1, 16, 31, 16, 24, 16, 24, 25, 16, 37,
    ]  # fmt: skip


def test_a_split_dali_batch_serves_the_same_batches(photos, tmp_path):
    """Until every file has been read once, ImageLoader runs DALI on parts of its batch (64 = 4 x 16); joined,
    they are the whole batches: eval pixels equal to one DALI batch of 64, the same ids in the same order in
    training. Then it runs whole batches."""
    files = small_jpegs(photos, tmp_path, 70)
    for train in (False, True):
        split = ImageLoader(files, batch_size=64, size=24, shuffle=train, cache_decoded=False)
        # as MultimodalLoader's: preparation decoded them
        whole = ImageLoader(files, batch_size=64, size=24, shuffle=train, cache_decoded=False, files_checked=True)
        every = np.arange(len(files))
        assert split.dali_part(every) == 16 and whole.dali_part(every) is None
        got, ref = list(split), list(whole)
        assert [len(b.ids) for b in got] == [64, 6]
        for a, b in zip(got, ref, strict=True):
            assert torch.equal(a.ids, b.ids) and torch.equal(a.mask, b.mask)
            if not train:
                assert torch.equal(a.images, b.images)
        # every file read once: the next epochs run DALI on whole batches, the same samples in the same order
        assert split.dali_part(every) is None
        assert [b.ids.tolist() for b in split] == [b.ids.tolist() for b in whole]


_BAD_FILE_SCRIPT = """
import sys
from mmfast.loading.image_loader import ImageLoader
loader = ImageLoader(sys.argv[1:], batch_size=64, size=16, cache_decoded=False)
seen = sum(int(m) for b in loader for m in b.mask)
print(seen, [s["image"] for s in loader.skipped])
"""


@pytest.mark.slow
def test_a_non_image_among_unchecked_files_is_skipped_not_a_crash(photos, tmp_path):
    """A text file named .jpg in a batch of 64: DALI 2.4 parsing a batch that size on several threads crashed
    the process (SIGSEGV) 8 runs in 10 instead of raising; ImageLoader's graph runs it in parts of 16. Three
    fresh processes must each finish with that file skipped."""
    files = small_jpegs(photos, tmp_path, 64)
    Path(files[2]).write_text("<html>404 not found</html>\n")
    assert first_lines_of_fresh_runs(_BAD_FILE_SCRIPT, files) == [f"63 ['{files[2]}']"] * 3


def test_a_shard_runs_whole_dali_batches_once_it_has_read_its_own_files(photos, tmp_path):
    """Each process reads only its shard: once it has read every file its next chunk reads, DALI runs whole
    batches, though the other shard's files were never read here."""
    files = small_jpegs(photos, tmp_path, 64)
    for shuffle in (False, True):
        loader = ImageLoader(
            files, batch_size=32, size=16, shuffle=shuffle, shard_id=0, num_shards=2, cache_decoded=False
        )
        assert loader.dali_part(loader.positions(0)) == 16
        list(loader)
        assert loader.files_read.sum() == 32
        assert (loader.dali_part(loader.positions(1)) is None) == (not shuffle)  # shuffled: other files


def test_resume_inside_an_epoch_of_split_dali_batches_is_exact(photos, tmp_path):
    """The chunk in the state records the DALI batch its checkpoint belongs to: a resume in the first epoch
    (parts of 16) rebuilds that pipeline and yields exactly the rest, augmentation draws included."""
    files = small_jpegs(photos, tmp_path, 96)

    def loader():
        return ImageLoader(files, batch_size=32, size=24, shuffle=True, seed=5, cache_decoded=False)

    reference = [(b.ids.clone(), b.images.clone()) for b in loader()]
    part = loader()
    for i, _ in enumerate(part):
        if i == 0:
            state = json.loads(json.dumps(part.state_dict()))
            break
    assert state["chunk"]["dali_batch"] == 16
    resumed = loader()
    resumed.load_state_dict(state)
    rest = [(b.ids, b.images) for b in resumed]
    assert len(rest) == len(reference) - 1
    for (ref_ids, ref_img), (ids, img) in zip(reference[1:], rest, strict=True):
        assert torch.equal(ref_ids, ids) and torch.equal(ref_img, img)
