"""ImageLoader as a drop-in for torch's DataLoader over a torchvision ImageFolder: same batches, shards,
epochs, arguments and attributes, and torchvision-style scripts that change only their loader construction
give the same validation results (tests/loading/test_dropin.py::test_the_example_script_*)."""

from __future__ import annotations

import difflib
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ROOT, free_port
from PIL import Image
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, SequentialSampler, Subset
from torchvision import datasets
from torchvision import transforms as T
from torchvision.transforms import v2

from mmfast.loading.dropin import options_from_transform
from mmfast.loading.image_loader import ImageLoader

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
EVAL_TF = T.Compose([T.Resize(73), T.CenterCrop(64), T.ToTensor(), T.Normalize(MEAN, STD)])  # 64 / 0.875 = 73
PHOTOS = [
    "rocket.jpg",
    "chelsea.png",
    "astronaut.png",
    "coffee.png",
    "motorcycle_left.png",
    "hubble_deep_field.jpg",
]


def photo_folder(root: Path, per_class: dict[str, int], seed: int = 0) -> Path:
    """An ImageFolder tree of JPEGs cut from scikit-image's real photos at random sizes (48-200 px a side, so
    the eval resize rounds every way): class k's images come from photo k."""
    import skimage

    rng = np.random.default_rng(seed)
    for k, (name, count) in enumerate(per_class.items()):
        photo = Image.open(Path(skimage.data_dir) / PHOTOS[k % len(PHOTOS)]).convert("RGB")
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(count):
            w, h = photo.size
            cw, ch = int(w * rng.uniform(0.4, 1.0)), int(h * rng.uniform(0.4, 1.0))
            x, y = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
            size = (int(rng.integers(48, 201)), int(rng.integers(48, 201)))
            photo.crop((x, y, x + cw, y + ch)).resize(size).save(root / name / f"{i:03d}.jpg", quality=90)
    return root


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """27 photos in 3 classes (11, 9, 7): no batch size or process count used here divides it."""
    return photo_folder(tmp_path_factory.mktemp("folder"), {"cat": 11, "dog": 9, "eel": 7})


def _tiny_model(classes: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 5, stride=2),
        torch.nn.ReLU(),
        torch.nn.Conv2d(8, 16, 3, stride=2),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(16, classes),
    ).eval()


# -- batches, dataset, eval pixels --------------------------------------------------------------------------
def test_eval_batches_equal_a_dataloader_over_the_same_imagefolder(folder):
    dataset = datasets.ImageFolder(folder, EVAL_TF)
    reference = DataLoader(dataset, batch_size=8, num_workers=0)
    loader = ImageLoader(dataset, 8, num_workers=2)  # the swap: DataLoader( -> ImageLoader(
    assert len(loader) == len(reference) == 4 and loader.batch_size == 8 and loader.dataset is dataset
    model = _tiny_model(3)
    sizes = []
    for (images, target), (ref_images, ref_target) in zip(loader, reference, strict=True):
        assert images.dtype == torch.float32 and images.shape == ref_images.shape  # (B, 3, 64, 64)
        assert torch.equal(target, ref_target)
        diff = (images - ref_images).abs()
        # torch's uint8 antialiased kernel is PIL's up to rare rounding: one 8-bit level is 0.017 normalized
        assert diff.mean() < 1e-3 and diff.max() < 0.02, (diff.mean(), diff.max())
        with torch.no_grad():
            logits, ref_logits = model(images), model(ref_images)
        assert (logits - ref_logits).abs().max() < 1e-3 and torch.equal(logits.argmax(1), ref_logits.argmax(1))
        sizes.append(len(target))
    assert sizes == [8, 8, 8, 3]  # DataLoader's partial last batch, no padding


def test_from_folder_finds_what_imagefolder_finds(tmp_path):
    """torchvision's rules: hidden class folders count, files are found by extension (any case, hidden ones
    too), in nested folders, in sorted order; non-images are left out."""
    from conftest import save_image

    for rel in ("b/1.JPG", "b/sub/2.png", "b/.hidden.jpg", ".hid/3.webp", "a/4.ppm", "a/5.tif", "a/6.bmp"):
        save_image(tmp_path / rel, size=(40, 30), fmt={"JPG": "JPEG", "tif": "TIFF"}.get(rel.rsplit(".")[-1]))
    (tmp_path / "a" / "notes.txt").write_text("not an image")
    (tmp_path / "empty_file_not_folder").write_text("")
    reference = datasets.ImageFolder(tmp_path)
    loader = ImageLoader.from_folder(tmp_path, batch_size=4, size=32)
    assert loader.classes == loader.dataset.classes == reference.classes == [".hid", "a", "b"]
    assert loader.dataset.class_to_idx == reference.class_to_idx
    assert loader.dataset.samples == reference.samples and loader.dataset.targets == reference.targets
    assert len(loader.dataset) == 7 and isinstance(loader.dataset, datasets.ImageFolder)
    labels = [t for _, target in loader for t in target.tolist()]
    assert labels == reference.targets and not loader.skipped
    image, target = loader.dataset[0]  # the dataset itself works too, through the equivalent transform
    assert image.shape == (3, 32, 32) and target == 0
    with pytest.raises(FileNotFoundError, match="Couldn't find any class folder"):
        ImageLoader.from_folder(tmp_path / "a")  # the same error as ImageFolder's


def test_files_loader_has_an_imagefolder_like_dataset(folder):
    files = sorted(str(p) for p in folder.glob("*/*.jpg"))
    labels = [0 if "/cat/" in f else 1 for f in files]
    loader = ImageLoader(files, labels, batch_size=8, size=64, classes=["cat", "other"])
    ds = loader.dataset
    assert len(ds) == 27 and ds.samples == list(zip(files, labels, strict=True)) and ds.targets == labels
    assert ds.classes == ["cat", "other"] and ds.class_to_idx == {"cat": 0, "other": 1}
    # pytorch/examples' distributed validation evaluates the remainder with a DataLoader over a Subset of it
    images, target = next(iter(DataLoader(Subset(ds, range(24, 27)), batch_size=3)))
    reference = torch.stack([EVAL_TF(Image.open(f).convert("RGB")) for f in files[24:]])
    assert target.tolist() == labels[24:] and (images - reference).abs().mean() < 1e-6
    assert ImageLoader(files, labels, batch_size=8).dataset.classes == [0, 1]


def test_subset_of_an_imagefolder_reads_only_its_samples(folder):
    dataset = datasets.ImageFolder(folder, EVAL_TF)
    subset = Subset(dataset, [26, 3, 14, 0])
    loader = ImageLoader(subset, batch_size=3)
    assert [t for _, target in loader for t in target.tolist()] == [dataset.targets[i] for i in subset.indices]
    assert len(loader.dataset) == 4 and loader.classes == ["cat", "dog", "eel"]


# -- transforms ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tv", [T, v2], ids=["v1", "v2"])
def test_torchvision_transforms_become_loader_arguments(tv):
    to_float = [tv.ToTensor()] if tv is T else [v2.ToImage(), v2.ToDtype(torch.float32, scale=True)]
    train = tv.Compose(
        [tv.RandomResizedCrop(96, scale=(0.2, 1.0)), tv.RandomHorizontalFlip(), tv.ColorJitter(0.3, 0.3, 0.3)]
        + to_float
        + [tv.Normalize(MEAN, STD)]
    )
    found = options_from_transform(train)
    assert found["train"] is True and found["size"] == 96 and found["scale"] == (0.2, 1.0)
    assert (
        found["flip"] is True and found["color_jitter"] == pytest.approx(0.3) and found["dtype"] == torch.float32
    )
    assert found["mean"] == pytest.approx([m * 255 for m in MEAN]) and found["std"] == pytest.approx(
        [s * 255 for s in STD]
    )
    found = options_from_transform(tv.Compose([tv.Resize(232), tv.CenterCrop(224), *to_float]))  # no Normalize
    assert (found["train"], found["size"], found["flip"]) == (False, 224, False)
    assert round(224 / found["crop_ratio"]) == 232 and found["mean"] == (0, 0, 0) and found["std"] == (255,) * 3


def test_a_squashing_loaders_own_transform_is_taken_back(folder):
    """resize_mode="squash" reads as Resize((S, S)) in torchvision, and an ImageFolder given that transform makes
    the same loader: the same options and the same pixels."""
    squash = ImageLoader.from_folder(
        folder, batch_size=8, size=48, train=False, resize_mode="squash", shuffle=False
    )
    transform = squash.torchvision_transform()
    found = options_from_transform(transform)
    assert (found["train"], found["size"], found["resize_mode"]) == (False, 48, "squash")
    again = ImageLoader(datasets.ImageFolder(folder, transform), batch_size=8, shuffle=False)
    (a, la), (b, lb) = next(iter(squash)), next(iter(again))
    assert torch.equal(la, lb) and torch.allclose(a, b)


@pytest.mark.parametrize(
    "transform, says",
    [
        (T.Compose([T.RandomCrop(32), T.ToTensor()]), "RandomCrop"),
        (T.Compose([T.Resize((64, 48)), T.ToTensor()]), "only Resize\\(int\\) .* and Resize\\(\\(S, S\\)\\)"),
        (T.Compose([T.Resize((64, 64)), T.CenterCrop(48), T.ToTensor()]), "followed by a smaller crop"),
        (T.Compose([T.Resize(73), T.CenterCrop(64), T.Resize((64, 64)), T.ToTensor()]), "one Resize"),
        (T.Compose([T.CenterCrop(64), T.Resize((64, 64)), T.ToTensor()]), "before the CenterCrop"),
        (
            T.Compose([T.Resize(73, interpolation=T.InterpolationMode.NEAREST), T.CenterCrop(64), T.ToTensor()]),
            "only bilinear and bicubic",
        ),
        (T.Compose([T.RandomResizedCrop(64), T.RandomHorizontalFlip(0.2), T.ToTensor()]), "probability 0.5"),
        (T.Compose([T.Resize(73), T.CenterCrop(64), T.PILToTensor()]), "never converts the image to floats"),
        (T.Compose([T.Resize(73), T.ToTensor()]), "neither a training crop nor an evaluation resize"),
        (T.Compose([T.Resize(73), T.CenterCrop(64), T.Lambda(lambda x: x), T.ToTensor()]), "Lambda"),
        (T.Compose([T.RandomResizedCrop(64), T.ColorJitter(hue=0.1), T.ToTensor()]), "not hue"),
    ],
)
def test_transforms_the_pipeline_cannot_reproduce_are_refused_by_name(folder, transform, says):
    with pytest.raises(ValueError, match=says):
        ImageLoader(datasets.ImageFolder(folder, transform), batch_size=8)


def test_arguments_that_contradict_the_datasets_transform_are_refused(folder):
    dataset = datasets.ImageFolder(folder, EVAL_TF)
    with pytest.raises(ValueError, match="size=128, but the dataset's transform says 64"):
        ImageLoader(dataset, batch_size=8, size=128)
    with pytest.raises(ValueError, match="resize_mode='squash', but the dataset's transform says 'shortest'"):
        ImageLoader(dataset, batch_size=8, resize_mode="squash")  # the transform crops the centre
    with pytest.raises(ValueError, match="train=True"):
        ImageLoader(dataset, batch_size=8, train=True)
    for dtype in ("bf16", torch.float16):  # the dtype is yours to choose
        images, _ = next(iter(ImageLoader(dataset, batch_size=8, size=64, dtype=dtype)))
        assert images.dtype == {"bf16": torch.bfloat16}.get(dtype, dtype)
    images, _ = next(iter(ImageLoader(dataset, batch_size=8, fp16=True)))
    assert images.dtype == torch.float16
    with pytest.raises(ValueError, match="target_transform"):
        ImageLoader(datasets.ImageFolder(folder, EVAL_TF, target_transform=int), batch_size=8)
    with pytest.raises(ValueError, match="has no transform"):
        ImageLoader(datasets.ImageFolder(folder), batch_size=8)
    with pytest.raises(TypeError, match="reads image files"):
        ImageLoader(torch.utils.data.TensorDataset(torch.zeros(4, 3)), batch_size=2)


# -- sharding, epochs --------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_shards", [2, 4])
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("drop_last", [False, True])
def test_shards_are_distributed_samplers(folder, num_shards, shuffle, drop_last):
    """Each rank gets DistributedSampler's samples in its order, DataLoader's batch count, and the mask
    counts every sample once across ranks."""
    dataset = datasets.ImageFolder(folder, T.Compose([T.Resize(16), T.CenterCrop(16), T.ToTensor()]))
    counted = []
    for rank in range(num_shards):
        sampler = DistributedSampler(dataset, num_shards, rank, shuffle=shuffle, seed=3)
        reference = DataLoader(dataset, batch_size=4, sampler=sampler, drop_last=drop_last)
        loader = ImageLoader(
            dataset, 4, shuffle=shuffle, seed=3, shard_id=rank, num_shards=num_shards, drop_last=drop_last
        )
        for epoch in (0, 1):
            sampler.set_epoch(epoch)
            loader.sampler.set_epoch(epoch)
            expected = list(sampler)
            assert list(loader.sampler) == expected and len(loader.sampler) == len(sampler) == len(expected)
            assert loader.sampler.epoch == epoch and loader.sampler.num_replicas == num_shards
            batches = list(loader)
            assert len(batches) == len(loader) == len(reference)
            ids = [i for b in batches for i in b.ids.tolist()]
            kept = len(reference) * 4 if drop_last else len(expected)
            assert ids == expected[:kept]  # sample ids are positions in the dataset
            assert [t for b in batches for t in b.labels.tolist()] == [dataset.targets[i] for i in ids]
            if not drop_last and epoch == 0:
                counted += [i for b in batches for i, m in zip(b.ids.tolist(), b.mask.tolist(), strict=True) if m]
    if not drop_last:
        assert sorted(counted) == list(range(27))  # each sample counted exactly once over all ranks


def test_each_iter_starts_a_new_epoch_also_after_a_break(folder):
    files = sorted(str(p) for p in folder.glob("*/*.jpg"))
    loader = ImageLoader(files, batch_size=4, shuffle=True, size=16)

    def expected(epoch):
        sampler = DistributedSampler(files, num_replicas=1, rank=0, shuffle=True, seed=0)
        sampler.set_epoch(epoch)
        return list(sampler)

    first = [i for b in loader for i in b.ids.tolist()]
    assert first == expected(0) and loader.epoch == 1
    for epoch in (1, 2):  # break after one batch: the next loop is the next epoch, from its start
        for i, batch in enumerate(loader):
            assert i == 0 and batch.ids.tolist() == expected(epoch)[:4]
            break
    assert [i for b in loader for i in b.ids.tolist()] == expected(3)
    loader.set_epoch(3)  # asking for an epoch again replays it (DistributedSampler's set_epoch does too)
    assert [i for b in loader for i in b.ids.tolist()] == expected(3)
    stale = iter(loader)
    next(stale)
    fresh = [i for b in loader for i in b.ids.tolist()]
    assert fresh == expected(5)
    with pytest.raises(RuntimeError, match="replaced by a newer iter"):  # it ended silently, a short epoch
        next(stale)
    a, b = iter(loader), iter(loader)  # the replay's case: the first one, never started, gave 0 samples
    assert [i for x in b for i in x.ids.tolist()] == expected(6)
    with pytest.raises(RuntimeError, match="replaced by a newer iter"):
        next(a)


def test_a_restored_position_survives_set_epoch_and_continues(folder):
    files = sorted(str(p) for p in folder.glob("*/*.jpg"))
    full = ImageLoader(files, batch_size=4, shuffle=True, size=16)
    full.set_epoch(2)
    reference = [b.ids.tolist() for b in full]
    part = ImageLoader(files, batch_size=4, shuffle=True, size=16)
    part.set_epoch(2)
    for i, _ in enumerate(part):
        if i == 2:
            state = part.state_dict()
            break
    resumed = ImageLoader(files, batch_size=4, shuffle=True, size=16)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    resumed.set_epoch(2)
    assert [b.ids.tolist() for b in resumed] == reference[3:]


def test_the_guides_ddp_snippet_counts_every_image_once(folder):
    """The drop-in guide's counting loop, run as-is on the two shards of 2 processes (the all_reduce: their
    sum)."""
    guide = (ROOT / "docs" / "guides" / "dropin-loader.md").read_text()
    snippet = next(b for b in re.findall(r"```python\n(.*?)```", guide, re.S) if "batch.mask" in b)
    dataset = datasets.ImageFolder(folder, EVAL_TF)
    model = _tiny_model(3)
    totals = []
    for rank in range(2):
        loader = ImageLoader(dataset, batch_size=8, shard_id=rank, num_shards=2)
        names = {"torch": torch, "val_loader": loader, "model": model, "device": "cpu"}
        names["dist"] = type("NoGroup", (), {"all_reduce": staticmethod(lambda t: t)})
        assert len(loader.sampler) == 14  # 28 served, one a repeat
        with torch.no_grad():
            exec(snippet, names)
        totals.append(names["totals"])
    correct, counted = (totals[0] + totals[1]).tolist()
    with torch.no_grad():
        expected = sum(int((model(x).argmax(1) == y).sum()) for x, y in DataLoader(dataset, batch_size=8))
    assert counted == 27 == len(dataset) and correct == expected


# -- DataLoader's arguments --------------------------------------------------------------------------------
def test_dataloader_arguments_with_a_meaning_here_take_it(folder):
    dataset = datasets.ImageFolder(folder, EVAL_TF)
    loader = ImageLoader(
        dataset, batch_size=8, shuffle=False, num_workers=2, pin_memory=True, drop_last=False, timeout=30,
        persistent_workers=True, prefetch_factor=3, multiprocessing_context="spawn", sampler=None,
        batch_sampler=None, collate_fn=None, worker_init_fn=None, generator=None, in_order=True,
    )  # fmt: skip
    assert loader.prefetch == 3 and loader.num_threads == 2 and loader.pin_memory is True
    images, target = next(iter(loader))
    # pinned where CUDA can use it; DataLoader ignores pin_memory without CUDA, and so does the loader
    assert images.is_pinned() == (torch.cuda.is_available() and images.device.type == "cpu")
    assert images.dtype == torch.float32 and len(target) == 8


@pytest.mark.parametrize(
    "kwargs, error, says",
    [
        (
            {"sampler": DistributedSampler(range(27), num_replicas=2, rank=1, shuffle=False, seed=5)},
            ValueError,
            "shard_id=1, num_shards=2, shuffle=False, seed=5",
        ),
        ({"sampler": RandomSampler(range(27))}, ValueError, "shuffle=True"),
        ({"sampler": SequentialSampler(range(27))}, ValueError, "shuffle=False"),
        ({"sampler": [0, 1, 2]}, ValueError, "select the files"),
        ({"batch_sampler": [[0, 1]]}, ValueError, "batch_size="),
        ({"collate_fn": lambda b: b}, ValueError, "as_dict=True"),
        ({"worker_init_fn": print}, ValueError, "no worker processes"),
        ({"generator": torch.Generator()}, ValueError, "seed=N"),
        ({"transform": EVAL_TF}, ValueError, "torchvision_transform"),
        ({"pin_memroy": True}, TypeError, "unexpected keyword argument 'pin_memroy'"),
        ({"timeout": -1}, ValueError, "non-negative"),
        ({"batch_size": None}, ValueError, "batch_size=None"),
        ({"dtype": torch.int64}, ValueError, "dtype must be"),
        ({"dtype": "fp16", "fp16": True}, ValueError, "not both"),
        ({"prefetch": 2, "prefetch_factor": 2}, ValueError, "not both"),
    ],
)
def test_dataloader_arguments_without_a_meaning_are_refused_at_construction(folder, kwargs, error, says):
    files = sorted(str(p) for p in folder.glob("*/*.jpg"))
    with pytest.raises(error, match=says):
        ImageLoader(files, **{"batch_size": 8, **kwargs})


@pytest.mark.parametrize(
    "dtype, expected", [(None, torch.float32), ("fp16", torch.float16), (torch.bfloat16, torch.bfloat16)]
)
def test_dtypes_and_dict_batches(folder, dtype, expected):
    files = sorted(str(p) for p in folder.glob("*/*.jpg"))[:10]
    loader = ImageLoader(files, list(range(10)), batch_size=4, size=32, dtype=dtype, as_dict=True)
    batches = list(loader)
    assert [set(b) for b in batches] == [{"image", "label", "id", "mask"}] * 3
    assert all(b["image"].dtype == expected for b in batches) and [len(b["id"]) for b in batches] == [4, 4, 2]
    assert torch.cat([b["label"] for b in batches]).tolist() == list(range(10))
    reference = torch.cat([b.images for b in ImageLoader(files, batch_size=4, size=32)])  # float32
    tolerance = {torch.float32: 0, torch.float16: 2e-3, torch.bfloat16: 2e-2}[expected]
    assert (torch.cat([b["image"] for b in batches]).float() - reference).abs().max() <= tolerance


def test_labels_as_a_column_are_class_ids_and_other_shapes_are_refused(folder):
    """A column of labels (N, 1), as ``df[["label"]].values`` gives, batches as (B,) class ids, what a
    DataLoader over an ImageFolder yields and CrossEntropyLoss takes."""
    files = sorted(str(p) for p in folder.glob("*/*.jpg"))[:6]
    want = [2, 0, 1, 1, 0, 2]
    for column in (np.array(want)[:, None], torch.tensor(want)[:, None], [[y] for y in want]):
        batches = list(ImageLoader(files, column, batch_size=4, size=32))
        assert [tuple(b.labels.shape) for b in batches] == [(4,), (2,)]
        assert torch.cat([b.labels for b in batches]).tolist() == want
        assert ImageLoader(files, column, batch_size=4, size=32).dataset.targets == want
    with pytest.raises(ValueError, match=r"one integer class id per file.*got shape \(6, 3\) \(one-hot rows"):
        ImageLoader(files, np.eye(3)[want], batch_size=4)
    with pytest.raises(ValueError, match=r"got shape \(\)"):
        ImageLoader(files, 3, batch_size=4)


def test_a_skipped_image_is_masked_and_labelled_minus_100(folder, tmp_path):
    files = sorted(str(p) for p in folder.glob("*/*.jpg"))[:6]
    broken = tmp_path / "broken.jpg"
    broken.write_bytes(Path(files[2]).read_bytes()[:200])
    files[2] = str(broken)
    batches = list(ImageLoader(files, [7] * 6, batch_size=4, size=32))
    assert [b.mask.tolist() for b in batches] == [[True, True, False, True], [True, True]]
    assert batches[0].labels.tolist() == [7, 7, -100, 7] and batches[0].ids.tolist() == [0, 1, -1, 3]


def test_a_streamed_picture_over_the_pixel_budget_is_skipped_wherever_the_epoch_reads_it(folder, tmp_path):
    """Its header is read when its batch is watched, a few batches ahead of DALI's reader: the stream is
    reopened without it, so it is never decoded, and never served with its id."""
    files = sorted(str(p) for p in folder.glob("*/*.jpg"))[:20]
    huge = tmp_path / "huge.png"
    Image.new("RGB", (400, 300), (200, 30, 30)).save(huge)
    files[17] = str(huge)  # in the fifth batch of 4: past the first batches watched when the stream opens
    loader = ImageLoader(files, batch_size=4, size=32, max_pixels=40_000, num_workers=2, cache_decoded=False)
    ids = torch.cat([b.ids for b in loader]).tolist()
    assert ids == [i if i != 17 else -1 for i in range(20)]
    assert [s["id"] for s in loader.skipped] == [17] and "over the 0.04 MP budget" in loader.skipped[0]["reason"]


@pytest.mark.gpu
def test_on_a_gpu_batches_are_decoded_there_and_close_to_the_dataloaders(folder, capsys):
    """The default device is the current GPU (nvJPEG, DALI's resize there): tuples, partial last batches,
    dtypes and masks as on the CPU; the eval pixels within DALI's rounding of torchvision's; pinned CPU
    batches with pin_memory=True."""
    dataset = datasets.ImageFolder(folder, EVAL_TF)
    loader = ImageLoader(dataset, 8)
    model = _tiny_model(3).cuda()
    diffs, agree = [], 0
    for (images, target), (ref_images, ref_target) in zip(loader, DataLoader(dataset, batch_size=8), strict=True):
        assert images.is_cuda and target.is_cuda and images.dtype == torch.float32
        assert torch.equal(target.cpu(), ref_target)
        diffs.append((images.cpu() - ref_images).abs().mean(dim=(1, 2, 3)))
        with torch.no_grad():
            agree += int((model(images).argmax(1).cpu() == model(ref_images.cuda()).argmax(1).cpu()).sum())
    diffs = torch.cat(diffs)
    with capsys.disabled():
        print(
            f"\nGPU eval vs torchvision: mean |diff| {diffs.mean():.4f}, worst image {diffs.max():.4f}; "
            f"tiny model argmax agrees on {agree}/27"
        )
    assert len(diffs) == 27 and diffs.mean() < 0.05
    bf16 = ImageLoader(dataset, 8, dtype=torch.bfloat16, shard_id=1, num_shards=2)
    batches = list(bf16)
    assert [len(b.labels) for b in batches] == [8, 6] and all(b.images.dtype == torch.bfloat16 for b in batches)
    assert torch.cat([b.mask for b in batches]).tolist() == [True] * 13 + [False]  # 27 on 2: rank 1 repeats one
    pinned, _ = next(iter(ImageLoader(dataset, 8, device="cpu", pin_memory=True)))
    assert pinned.is_pinned() and not pinned.is_cuda


# -- the examples: a torchvision-style script with only its loader swapped, Accelerate, Lightning ----------------
EXAMPLES = ROOT / "examples"


def _example(name: str):
    """examples/<name>.py as a module (its main(argv) runs in this process)."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """train/ (36 photos) and val/ (27) ImageFolder trees."""
    root = tmp_path_factory.mktemp("data")
    photo_folder(root / "train", {"cat": 14, "dog": 12, "eel": 10}, seed=1)
    photo_folder(root / "val", {"cat": 11, "dog": 9, "eel": 7}, seed=2)
    return root


@pytest.fixture(scope="module")
def weights(data, tmp_path_factory) -> Path:
    """ResNet-18 weights whose predictions differ from image to image: a fresh network predicts one class for
    all (its batch-norm statistics are 0 and 1), so its statistics are first measured on the train split."""
    import torchvision

    torch.manual_seed(5)  # a seed whose validation logits have no near tie (see _compare_validation)
    model = torchvision.models.resnet18(num_classes=3)
    for module in model.modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            module.momentum = None  # a plain average over the batches
    with torch.no_grad():
        for images, _ in DataLoader(datasets.ImageFolder(data / "train", EVAL_TF), batch_size=12):
            model(images)  # train mode: updates the running statistics only
    path = tmp_path_factory.mktemp("weights") / "resnet18.pt"
    torch.save(model.state_dict(), path)
    return path


def test_the_example_scripts_differ_only_in_the_loader_construction():
    before = (EXAMPLES / "imagenet_dataloader.py").read_text().splitlines()
    after = (EXAMPLES / "imagenet_mmfast.py").read_text().splitlines()
    diff = [ln for ln in difflib.unified_diff(before, after, lineterm="", n=0) if ln[:3] not in ("+++", "---")]
    added = [ln[1:] for ln in diff if ln.startswith("+") and ln[1:].strip()]
    removed = [ln[1:] for ln in diff if ln.startswith("-") and ln[1:].strip()]
    assert len(added) <= 4 and all("ImageLoader" in ln or "shard_id=rank" in ln for ln in added), added
    assert all("DataLoader" in ln or "DistributedSampler" in ln for ln in removed), removed


def _compare_validation(ref: dict, got: dict, count: int) -> None:
    assert got["val"]["count"] == ref["val"]["count"] == count and got["val_batches"] == ref["val_batches"]
    assert got["val"]["preds"] == ref["val"]["preds"]
    assert got["val"]["acc1"] == ref["val"]["acc1"]
    logits = np.array(ref["val"]["logits"])  # (N, classes)
    diff = np.abs(np.array(got["val"]["logits"]) - logits).max()
    top2 = np.sort(logits, axis=1)[:, -2:]
    # measured: diff 0.005 (pixels within one 8-bit level), smallest margin 0.2: equal predictions are no luck
    assert diff < 0.01 and (top2[:, 1] - top2[:, 0]).min() > 10 * diff


def test_the_example_script_on_one_process_gives_the_dataloader_versions_results(data, weights):
    argv = [str(data), "--size", "64", "--batch-size", "8", "--workers", "0", "--weights", str(weights)]
    ref = _example("imagenet_dataloader").main([*argv, "--evaluate"])
    got = _example("imagenet_mmfast").main([*argv, "--evaluate"])
    _compare_validation(ref, got, 27)
    assert got["val_batches"] == 4 and len(set(got["val"]["preds"])) > 1  # 8 + 8 + 8 + 3; not one class for all


@pytest.mark.slow
def test_the_example_script_trains_on_one_process_like_the_dataloader_version(data, weights):
    argv = [str(data), "--size", "64", "--batch-size", "8", "--workers", "0", "--weights", str(weights)]
    ref = _example("imagenet_dataloader").main([*argv, "--epochs", "2"])
    got = _example("imagenet_mmfast").main([*argv, "--epochs", "2"])
    for r, g in zip(ref["epochs"], got["epochs"], strict=True):  # every training sample once per epoch
        assert g["train_samples"] == r["train_samples"] == 36 and np.isfinite(g["train_loss"])
        assert g["val"]["count"] == r["val"]["count"] == 27


def _torchrun(script: str, *argv: str) -> None:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
    ]
    proc = subprocess.run([*cmd, str(EXAMPLES / script), *argv], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.slow
def test_the_example_script_on_two_processes_gives_the_dataloader_versions_results(data, weights, tmp_path):
    argv = [str(data), "--size", "64", "--batch-size", "8", "--weights", str(weights)]
    for name in ("imagenet_dataloader", "imagenet_mmfast"):
        _torchrun(f"{name}.py", *argv, "--evaluate", "--out", str(tmp_path / name))
    preds = []
    for rank in (0, 1):
        ref = json.loads((tmp_path / f"imagenet_dataloader.rank{rank}.json").read_text())
        got = json.loads((tmp_path / f"imagenet_mmfast.rank{rank}.json").read_text())
        assert ref["world_size"] == got["world_size"] == 2
        # 27 images on 2 processes: 14 each, one repeated (DistributedSampler's padding, counted by both)
        _compare_validation(ref, got, 28)
        assert len(got["val"]["preds"]) == 14 and got["val_batches"] == 2
        preds += got["val"]["preds"]
    assert len(set(preds)) > 1
    # training under DDP: each process gets DistributedSampler's 18 of the 36 samples per epoch
    _torchrun("imagenet_mmfast.py", *argv, "--epochs", "2", "--out", str(tmp_path / "train"))
    for rank in (0, 1):
        epochs = json.loads((tmp_path / f"train.rank{rank}.json").read_text())["epochs"]
        assert [e["train_samples"] for e in epochs] == [18, 18] and all(
            np.isfinite(e["train_loss"]) for e in epochs
        )


def test_the_accelerate_example_counts_every_image_once(data, weights):
    from accelerate.state import AcceleratorState, GradientState

    argv = [str(data), "--size", "64", "--batch-size", "8", "--weights", str(weights)]
    try:
        evaluated = _example("accelerate_imagefolder").main([*argv, "--epochs", "0"])
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    assert evaluated["val_count"] == 27 and evaluated["num_processes"] == 1
    # the same weights through the DataLoader version of the torchvision-style script
    ref = _example("imagenet_dataloader").main([*argv, "--workers", "0", "--evaluate"])
    assert evaluated["val_acc"] == pytest.approx(ref["val"]["acc1"] / 100)


@pytest.mark.slow
def test_the_accelerate_example_on_two_processes_counts_every_image_once(data, weights, tmp_path):
    argv = [str(data), "--size", "64", "--batch-size", "8", "--weights", str(weights)]
    _torchrun("accelerate_imagefolder.py", *argv, "--epochs", "0", "--out", str(tmp_path / "eval.json"))
    evaluated = json.loads((tmp_path / "eval.json").read_text())
    ref = _example("imagenet_dataloader").main([*argv, "--workers", "0", "--evaluate"])
    # 14 + 14 served, the repeat masked: 27 counted, and the accuracy of one process
    assert evaluated["num_processes"] == 2 and evaluated["val_count"] == 27
    assert evaluated["val_acc"] == pytest.approx(ref["val"]["acc1"] / 100)
    _torchrun("accelerate_imagefolder.py", *argv, "--epochs", "1", "--out", str(tmp_path / "train.json"))
    assert json.loads((tmp_path / "train.json").read_text())["val_count"] == 27


@pytest.mark.slow
def test_the_lightning_example(data, tmp_path):
    pytest.importorskip("lightning")
    out = tmp_path / "metrics.json"
    cmd = [sys.executable, str(EXAMPLES / "lightning_imagefolder.py"), str(data), "--epochs", "1"]
    proc = subprocess.run(
        [*cmd, "--size", "64", "--batch-size", "8", "--out", str(out)], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads(out.read_text())
    assert metrics["val_count"] == 27 and 0 <= metrics["val_acc"] <= 1 and np.isfinite(metrics["train_loss"])
