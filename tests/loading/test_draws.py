"""Augmentation drawn per sample (mmfast/loading/draws.py): a sample's crop and flip depend on (seed, epoch, id)
only, the DALI graph and the decoded cache cut the same windows, and one process and two get the same global
batches with the same pixels (#29 item 1)."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from PIL import Image

from mmfast.loading.draws import (
    AREA,
    ATTEMPTS,
    DRAWS,
    FLIP,
    RATIO,
    DrawFeed,
    X,
    Y,
    crop_boxes,
    crop_window,
    resized_crop_boxes,
    sample_uniforms,
)
from mmfast.loading.multimodal import MultimodalLoader

SCALE, RATIO_RANGE = (0.08, 1.0), (3 / 4, 4 / 3)


def test_a_samples_draws_depend_on_seed_epoch_and_id_alone():
    ids = np.arange(1000)
    u = sample_uniforms(7, np.full(1000, 3), ids)
    assert u.shape == (1000, 8) and u.dtype == np.float32 and (u >= 0).all() and (u < 1).all()
    perm = np.random.default_rng(0).permutation(1000)
    assert np.array_equal(sample_uniforms(7, np.full(1000, 3), ids[perm]), u[perm])  # any batch, any order
    assert np.array_equal(sample_uniforms(7, np.full(10, 3), ids[:10]), u[:10])
    for other in (sample_uniforms(8, np.full(1000, 3), ids), sample_uniforms(7, np.full(1000, 4), ids)):
        assert (other != u).mean() > 0.99  # another seed or epoch: other draws
    assert abs(float(u.mean()) - 0.5) < 0.02 and abs(float(u.std()) - (1 / 12) ** 0.5) < 0.02
    assert abs(float(np.corrcoef(u[:, AREA], u[:, RATIO])[0, 1])) < 0.1  # the columns are not one draw


def test_crop_windows_fit_keep_the_area_and_the_ratio_range():
    """Every window lies inside the image with an aspect ratio in range and an area share in the scale range,
    below the largest that fits at a ratio in range; the area share is uniform in the scale range where the
    image's own ratio is in range."""
    n = 20000
    u = sample_uniforms(0, np.zeros(n), np.arange(n)).astype(np.float64)
    aspect = np.exp(np.random.default_rng(1).uniform(np.log(0.5), np.log(2.0), n))
    sides = (np.full(n, 1000.0), 1000.0 * aspect)  # height, width
    left, top, w, h = crop_window(u[:, AREA], u[:, RATIO], u[:, X], u[:, Y], *sides, SCALE, RATIO_RANGE)
    assert (left >= 0).all() and (top >= 0).all() and (left + w <= 1 + 1e-9).all() and (top + h <= 1 + 1e-9).all()
    s_fit = np.minimum(np.minimum((4 / 3) / aspect, aspect / (3 / 4)), 1.0)
    area, r = w * h, w * aspect / h  # the crop's area share, its width / height in pixels
    assert (area >= SCALE[0] - 1e-6).all() and (area <= s_fit + 1e-6).all()
    assert (r >= 3 / 4 - 1e-6).all() and (r <= 4 / 3 + 1e-6).all()
    in_range = (aspect >= 3 / 4) & (aspect <= 4 / 3)
    assert abs(float(area[in_range].mean()) - 0.54) < 0.01


def test_an_image_too_elongated_for_the_range_is_cut_whole_at_its_centre():
    """A 30 x 2000 panorama has no crop with ratio <= 4/3 of any area in range: its centre, 40 pixels wide
    (30 * 4/3), the full height; the same turned upright."""
    u = np.full((2, 8), 0.3)
    boxes = crop_boxes(np.array([[30, 2000], [2000, 30]]), u, (0.5, 1.0), RATIO_RANGE)
    assert boxes[0].tolist() == [0, 980, 30, 40]
    assert boxes[1].tolist() == [980, 0, 40, 30]


HOST_DRAWS = DRAWS + 2 * (ATTEMPTS - 1)


def _host_boxes(seed: int, epoch: int, ids: np.ndarray, shapes: np.ndarray) -> np.ndarray:
    u = sample_uniforms(seed, np.full(len(ids), epoch), ids, HOST_DRAWS)
    return resized_crop_boxes(shapes, u, SCALE, RATIO_RANGE)


def test_host_windows_lie_inside_with_torchvisions_area_and_ratio_whatever_the_batch():
    """Every window drawn on the host is inside its image, its area share in the scale range and its aspect ratio
    in the ratio range (to a pixel's rounding), or torchvision's centred fallback; the same (seed, epoch, id)
    gives the same window in any batch, in any order, on any shard."""
    n, rng = 20000, np.random.default_rng(2)
    shapes = np.stack([rng.integers(1, 1200, n), rng.integers(1, 1200, n)], axis=1)
    shapes[:50] = [30, 2000]  # too elongated for any crop in range: the fallback
    ids = np.arange(n) * 7 + 3
    boxes = _host_boxes(5, 1, ids, shapes)
    top, left, h, w = boxes.T
    assert (top >= 0).all() and (left >= 0).all() and (h >= 1).all() and (w >= 1).all()
    assert (top + h <= shapes[:, 0]).all() and (left + w <= shapes[:, 1]).all()
    big = (shapes >= 100).all(axis=1)  # rounding to whole pixels stays within a percent or so
    share, r = (h * w / shapes.prod(axis=1))[big], (w / h)[big]
    fallback = (h == shapes[:, 0])[big] | (w == shapes[:, 1])[big]  # whole along a side
    drawn = ~fallback
    assert (share[drawn] >= SCALE[0] * 0.97).all() and (share[drawn] <= 1.0).all()
    assert (r[drawn] >= 0.75 * 0.97).all() and (r[drawn] <= 4 / 3 * 1.03).all()
    assert boxes[:50].tolist() == [[0, 980, 30, 40]] * 50  # torchvision's fallback: 30 * 4/3 wide, centred
    perm = rng.permutation(n)
    assert np.array_equal(_host_boxes(5, 1, ids[perm], shapes[perm]), boxes[perm])  # another order, another batch
    for shard in (0, 1):  # two processes, each its half in batches of 16
        part = np.arange(shard, n, 2)
        got = np.concatenate([_host_boxes(5, 1, ids[b], shapes[b]) for b in np.array_split(part, len(part) // 16)])
        assert np.array_equal(got, boxes[part])
    small = _host_boxes(5, 1, ids, np.tile([[8, 8]], (n, 1)))  # every place a crop fits is reached, as randint's
    for side in (4, 5, 6):
        at = small[small[:, 2] == side]
        assert len(at) > 100 and set(at[:, 0].tolist()) == set(range(8 - side + 1)), side
    square = big & (shapes[:, 1] / shapes[:, 0] > 0.75) & (shapes[:, 1] / shapes[:, 0] < 4 / 3)
    other = (_host_boxes(5, 2, ids, shapes) != boxes).any(axis=1)
    assert other[square].mean() > 0.95  # another epoch: other windows


def test_host_windows_have_torchvisions_distribution():
    """On a 4:3 and a 16:9 image, the host windows' mean area share, mean log ratio and fallback rate match
    torchvision's ``RandomResizedCrop.get_params`` (the fits-at-once crops of ``crop_boxes`` do not: larger)."""
    import torch
    from torchvision.transforms import RandomResizedCrop

    n = 20000
    for hw in ((600, 800), (900, 1600)):
        torch.manual_seed(0)
        tv = np.array([RandomResizedCrop.get_params(torch.empty(1, *hw), SCALE, RATIO_RANGE) for _ in range(n)])
        ours = _host_boxes(3, 0, np.arange(n), np.tile([hw], (n, 1)))
        fits_at_once = crop_boxes(np.tile([hw], (n, 1)), sample_uniforms(3, np.zeros(n), np.arange(n)), SCALE,
                                  RATIO_RANGE)  # fmt: skip
        area = [b[:, 2] * b[:, 3] / (hw[0] * hw[1]) for b in (tv, ours, fits_at_once)]
        log_r = [np.log(b[:, 3] / b[:, 2]) for b in (tv, ours)]
        assert abs(area[1].mean() - area[0].mean()) < 0.01, hw
        assert area[2].mean() - area[0].mean() > 0.04, hw  # a wrong distribution is told apart
        assert abs(log_r[1].mean() - log_r[0].mean()) < 0.01, hw
        whole = [float(((b[:, 2] == hw[0]) & (b[:, 3] == hw[1])).mean()) for b in (tv, ours)]
        assert abs(whole[1] - whole[0]) < 0.01, hw


def _graph_crops(files: list[str], ids: list[int], epoch: int, seed: int, shapes=None) -> list[np.ndarray]:
    from nvidia.dali.plugin.pytorch import LastBatchPolicy

    from mmfast.loading.graphs import image_pipeline
    from mmfast.loading.host_finish import ragged_iterator
    from mmfast.loading.sources import read_files

    feed = DrawFeed(seed, np.array(ids), np.full(len(ids), epoch), shapes)
    pipe = image_pipeline(
        read=functools.partial(read_files, files, ids), train=True, size=32, finish_on_host=True, draws=feed,
        batch_size=len(files), num_threads=1, device_id=None, seed=1,
    )  # fmt: skip
    it = ragged_iterator(pipe, reader_name="Reader", auto_reset=True, last_batch_policy=LastBatchPolicy.DROP)
    out = next(it)[0]
    return [c.numpy() for c in out["crops"]], out["flips"].view(-1).numpy()


def test_the_graph_cuts_the_windows_the_host_computes(photos):
    """DALI's slice decode of the draws gives the boxes ``crop_boxes`` computes from the same draws (a PNG:
    the same pixels as the whole image decoded and cut), and the same flips; the pipeline's own seed plays
    no part."""
    files = [str(p) for p in photos]
    ids = [5, 17, 3, 40, 8, 11][: len(files)]
    crops, flips = _graph_crops(files, ids, epoch=2, seed=9)
    again, _ = _graph_crops(files[::-1], ids[::-1], epoch=2, seed=9)  # another order: the same crops
    u = sample_uniforms(9, np.full(len(ids), 2), np.array(ids))
    shapes = np.array([Image.open(f).size[::-1] for f in files])
    boxes = crop_boxes(shapes, u, SCALE, RATIO_RANGE)
    assert np.array_equal(flips, (u[:, FLIP] < 0.5).astype(np.int32))
    for k, (crop, (top, left, h, w)) in enumerate(zip(crops, boxes.tolist(), strict=True)):
        assert crop.shape[:2] == (h, w), (files[k], crop.shape, (h, w))
        assert np.array_equal(crop, again[len(files) - 1 - k])
        if files[k].endswith(".png"):
            whole = np.asarray(Image.open(files[k]).convert("RGB"))
            assert np.array_equal(crop, whole[top : top + h, left : left + w]), files[k]


def test_the_graph_cuts_the_windows_drawn_on_the_host(photos):
    """Given the images' sizes, the slice decode cuts ``resized_crop_boxes``' windows (a PNG: the same pixels as
    the whole image decoded and cut), and flips as the draws say."""
    files = [str(p) for p in photos]
    ids = [5, 17, 3, 40, 8, 11][: len(files)]
    shapes = np.array([Image.open(f).size[::-1] for f in files])
    crops, flips = _graph_crops(files, ids, epoch=2, seed=9, shapes=shapes)
    u = sample_uniforms(9, np.full(len(ids), 2), np.array(ids), HOST_DRAWS)
    boxes = resized_crop_boxes(shapes, u, SCALE, RATIO_RANGE)
    assert np.array_equal(flips, (u[:, FLIP] < 0.5).astype(np.int32))
    for k, (crop, (top, left, h, w)) in enumerate(zip(crops, boxes.tolist(), strict=True)):
        assert crop.shape[:2] == (h, w), (files[k], crop.shape, (h, w))
        if files[k].endswith(".png"):
            whole = np.asarray(Image.open(files[k]).convert("RGB"))
            assert np.array_equal(crop, whole[top : top + h, left : left + w]), files[k]


def test_exif_rotated_images_are_cut_in_the_frame_dali_decodes(tmp_path):
    """An 80 x 60 JPEG or PNG whose EXIF orientation turns it (6, 8) decodes 60 wide and 80 high: validation
    records that size (PIL's header gives the stored 80 x 60), and the host windows drawn from it are cut
    as drawn."""
    from mmfast.data.validate import check_images

    files = []
    for k, orientation in enumerate((1, 6, 8, 3)):
        im = Image.fromarray(np.random.default_rng(k).integers(0, 255, (60, 80, 3), dtype=np.uint8))
        exif = Image.Exif()
        exif[0x0112] = orientation
        for ext in ("jpg", "png"):
            files.append(str(tmp_path / f"o{orientation}.{ext}"))
            im.save(files[-1], exif=exif.tobytes())
    checks = check_images(files, 1)
    assert [(c.width, c.height) for c in checks] == [(80, 60)] * 8
    turned = [(80, 60) if "o6" in f or "o8" in f else (60, 80) for f in files]
    assert [c.decoded for c in checks] == turned
    ids = list(range(100, 108))
    crops, _ = _graph_crops(files, ids, epoch=0, seed=4, shapes=np.array(turned))
    u = sample_uniforms(4, np.zeros(8), np.array(ids), HOST_DRAWS)
    boxes = resized_crop_boxes(np.array(turned), u, SCALE, RATIO_RANGE)
    assert [c.shape[:2] for c in crops] == [tuple(b) for b in boxes[:, 2:].tolist()]


def test_prepared_rows_record_the_decoded_size_and_the_loader_draws_on_the_host(prepared):
    """Preparation records each image's size as DALI decodes it; a loader of the split gets it."""
    from mmfast.data.dataset import PreparedDataset

    data = PreparedDataset(prepared)
    rows = list(data.iter_rows("train"))
    assert all(r["decoded_shape"] == [r["height"], r["width"]] for r in rows)  # no EXIF rotation in the demo
    loader = MultimodalLoader(prepared, "train", 16, size=32, train=True, num_workers=1)
    assert np.array_equal(loader.images.image_sizes, data.table("train").decoded_shapes)


def _by_id(loader, epochs: int) -> list[dict[int, torch.Tensor]]:
    """Per epoch, each batch as {sample id: its image}."""
    out = []
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        out += [{int(i): img.clone() for i, img in zip(b["id"], b["image"], strict=True)} for b in loader]
    return out


@pytest.mark.parametrize("cache_decoded", [False, True], ids=["streamed", "decoded"])
def test_one_process_and_two_train_on_the_same_global_batches_with_the_same_pixels(prepared, cache_decoded):
    """Batch 16 on one process, two micro-batches a step, against batch 16 on each of two: step k's samples
    are the same 32 and every sample's pixels are equal, over two epochs (the second draws anew)."""
    common = dict(size=32, fp16=False, train=True, cache_decoded=cache_decoded, num_workers=1)
    one = _by_id(MultimodalLoader(prepared, "train", 16, **common), 2)
    shards = [
        _by_id(MultimodalLoader(prepared, "train", 16, shard_id=r, num_shards=2, **common), 2) for r in (0, 1)
    ]
    assert len(one) == 2 * len(shards[0]) and len(shards[0]) == len(shards[1]) > 4
    for k, (a, b) in enumerate(zip(*shards, strict=True)):
        merged = {**one[2 * k], **one[2 * k + 1]}
        assert set(merged) == set(a) | set(b) and len(merged) == 32, k
        for i, image in {**a, **b}.items():
            assert torch.equal(image, merged[i]), (k, i)
    first, second = one[0], {i: x for batch in one[len(one) // 2 :] for i, x in batch.items()}
    common_ids = set(first) & set(second)
    assert common_ids and all(not torch.equal(first[i], second[i]) for i in common_ids)


def test_a_one_pixel_image_gets_a_one_pixel_crop():
    u = sample_uniforms(0, np.zeros(4), np.arange(4))
    shapes = np.array([[1, 1], [1, 5], [5, 1], [2, 2]])
    boxes = crop_boxes(shapes, u, SCALE, RATIO_RANGE)
    assert boxes[0].tolist() == [0, 0, 1, 1]
    assert (boxes[:3, 2:] == 1).all()  # a pixel, somewhere inside
    assert (boxes[:, 0] + boxes[:, 2] <= shapes[:, 0]).all() and (boxes[:, 1] + boxes[:, 3] <= shapes[:, 1]).all()


def test_a_wide_image_gets_crops_spread_over_it_not_one_box():
    """A 16:9 image cannot hold a 4:3 crop of more than 3/4 of its area: the area is drawn among the ones that
    fit, so no box repeats (a fallback to one centred box did, in a quarter of the draws)."""
    n = 4000
    u = sample_uniforms(1, np.zeros(n), np.arange(n))
    boxes = crop_boxes(np.tile([[900, 1600]], (n, 1)), u, SCALE, RATIO_RANGE)
    _, counts = np.unique(boxes, axis=0, return_counts=True)
    assert counts.max() <= 3
    share = boxes[:, 2] * boxes[:, 3] / (900 * 1600)
    assert share.max() <= 0.75 + 0.01 and abs(float(share.mean()) - (0.08 + 0.75) / 2) < 0.02


def test_the_decoded_cache_cuts_the_host_windows_of_the_stream(photos):
    """With the images' sizes given, a loader holding the images decoded serves the pixels the streaming
    graph cuts (PNGs: the same decode either way); a size per file is required."""
    from mmfast.loading.arguments import EngineReading
    from mmfast.loading.image_loader import ImageLoader
    from mmfast.loading.sampling import DATALOADER

    files = [str(p) for p in photos if p.suffix == ".png"] * 2
    sizes = [Image.open(f).size[::-1] for f in files]
    reading = EngineReading(sampling=DATALOADER, image_sizes=sizes)
    common = dict(batch_size=3, size=32, fp16=False, shuffle=True, train=True, reading=reading, num_workers=1)
    got = [_by_id(ImageLoader(files, as_dict=True, cache_decoded=c, **common), 2) for c in (False, True)]
    assert len(got[0]) == len(got[1]) > 0
    for streamed, cached in zip(*got, strict=True):
        assert streamed.keys() == cached.keys()
        assert all(torch.equal(streamed[i], cached[i]) for i in streamed)
    with pytest.raises(ValueError, match="image_sizes must hold"):
        ImageLoader(files, reading=EngineReading(sampling=DATALOADER, image_sizes=sizes[:-1]))


def test_without_the_sizes_one_process_and_two_still_get_the_same_pixels(prepared):
    """The windows computed in the graph (a split whose rows have no decoded size: here withheld), streamed:
    the same global batches with the same pixels on one process and two."""
    common = dict(size=32, fp16=False, train=True, cache_decoded=False, num_workers=1, image_sizes=None)
    one = MultimodalLoader(prepared, "train", 16, **common)
    assert one.images.image_sizes is None
    one = _by_id(one, 1)
    halves = [MultimodalLoader(prepared, "train", 16, shard_id=r, num_shards=2, **common) for r in (0, 1)]
    shards = [_by_id(h, 1) for h in halves]
    assert len(shards[0]) > 2
    for k, (a, b) in enumerate(zip(*shards, strict=True)):
        merged = {**one[2 * k], **one[2 * k + 1]}
        assert set(merged) == set(a) | set(b) and all(torch.equal(x, merged[i]) for i, x in {**a, **b}.items()), k
