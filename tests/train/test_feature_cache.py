"""--feature-cache (mmfast/data/feature_cache.py, mmfast/loading/feature_loader.py, mmfast/train/features.py): a
cache built for other data, weights, preprocessing or views is rebuilt, never read; a build that stops part-way
leaves nothing that looks whole; cached features give the loss of the pixels they were computed from; a run
trains on them and its model still takes images."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import val_figures

from mmfast.data.feature_cache import FeatureCache, open_or_build, stale_reason, weights_digest

IDS = np.array([3, 4, 7, 9], dtype=np.int64)  # ascending, with gaps: rows are found by id
WIDTH = 5
PARTS = {
    "data": "d1",
    "tower": {"weights": "w1"},
    "preprocessing": {"image_size": 32, "mean": [0.5, 0.5, 0.5]},
    "views": {"count": 2, "seed": 0},
}


def _value(view, ids) -> torch.Tensor:
    """A feature that names its view and sample: view * 100 + id in every column (the centre view: -1)."""
    v = -1 if view is None else view
    return torch.tensor(np.asarray(ids, dtype=np.float32) + 100 * v)[:, None].repeat(1, WIDTH)


def _filler(calls: list, offset: float = 0.0, stop_after: int | None = None, skip_last: bool = False):
    """A ``fill`` that puts every view of IDS in batches of two (``offset`` added), counted in ``calls``;
    ``stop_after``: it raises after that many batches; ``skip_last``: the centre view's last batch is left out."""

    def fill(writer):
        calls.append(1)
        done = 0
        for view in [*range(writer.views), None]:
            for s in range(0, len(IDS), 2):
                if skip_last and view is None and s + 2 >= len(IDS):
                    continue
                if stop_after is not None and done == stop_after:
                    raise KeyboardInterrupt("killed mid-build")
                ids = IDS[s : s + 2]
                writer.put(view, ids, _value(view, ids) + offset)
                done += 1

    return fill


def _build(directory, parts=PARTS, calls=None, **kw):
    calls = [] if calls is None else calls
    views = parts["views"]["count"]
    return open_or_build(directory, parts, IDS, views, WIDTH, "float32", _filler(calls, **kw))


def test_a_cache_serves_each_view_of_each_sample_by_id(tmp_path):
    cache, reason = _build(tmp_path / "fc")
    assert reason == "no cache yet" and cache.views == 2 and len(cache) == 4
    ids = np.array([9, -1, 3])
    for view in (0, 1, None):
        got = cache.gather(ids, view)
        want = _value(view, ids)
        want[1] = 0.0  # padding
        assert torch.equal(got, want), view
    with pytest.raises(IndexError, match=r"\[5\]"):
        cache.gather(np.array([5]), 0)


@pytest.mark.parametrize(
    "change",
    [
        {"data": "d2"},
        {"tower": {"weights": "w2"}},
        {"preprocessing": {"image_size": 48, "mean": [0.5, 0.5, 0.5]}},
        {"views": {"count": 3, "seed": 0}},
        {"views": {"count": 2, "seed": 1}},
    ],
    ids=["data", "weights", "preprocessing", "view-count", "view-seed"],
)
def test_a_cache_built_for_other_data_weights_preprocessing_or_views_is_rebuilt(tmp_path, change):
    calls = []
    _build(tmp_path / "fc", calls=calls)
    again, reason = _build(tmp_path / "fc", calls=calls)
    assert len(calls) == 1 and reason == ""  # the same parts: read, not computed
    other = {**PARTS, **change}
    cache, reason = _build(tmp_path / "fc", other, calls=calls, offset=0.5)
    assert len(calls) == 2 and reason == f"the {next(iter(change))} changed since it was built"
    assert torch.equal(cache.gather(IDS, 0), _value(0, IDS) + 0.5)  # the new features, not the old ones
    assert cache.views == other["views"]["count"]
    assert stale_reason(tmp_path / "fc", PARTS).endswith("changed since it was built")


def test_a_build_stopped_part_way_leaves_no_cache_that_looks_whole(tmp_path):
    fc = tmp_path / "fc"
    with pytest.raises(KeyboardInterrupt):
        _build(fc, stop_after=3)
    assert not fc.exists() and list(tmp_path.iterdir()) == []  # the temp directory went too
    with pytest.raises(ValueError, match="damaged or incomplete"):
        FeatureCache(fc)
    _build(fc)  # a whole one; then a rebuild for other weights is stopped: the old one stays, and is not read
    other = {**PARTS, "tower": {"weights": "w2"}}
    with pytest.raises(KeyboardInterrupt):
        _build(fc, other, stop_after=2, offset=0.5)
    assert stale_reason(fc, PARTS) == "" and stale_reason(fc, other) == "the tower changed since it was built"
    assert torch.equal(FeatureCache(fc).gather(IDS, 0), _value(0, IDS))  # untouched by the stopped build
    calls = []
    cache, _ = _build(fc, other, calls=calls, offset=0.5)
    assert calls == [1] and torch.equal(cache.gather(IDS, 1), _value(1, IDS) + 0.5)


def test_a_build_that_missed_a_sample_is_refused(tmp_path):
    with pytest.raises(ValueError, match="the centre view of sample 7 was not computed"):
        _build(tmp_path / "fc", skip_last=True)
    assert not (tmp_path / "fc").exists()


def test_a_sample_whose_image_could_not_be_read_is_stored_absent(tmp_path):
    """A sample the build declares unreadable has zeros in every view and is listed with its file; any other
    sample left out still refuses the build."""
    bad = tmp_path / "bad.jpg"
    bad.write_bytes(b"not an image")
    entry = {"id": 7, "image": str(bad), "reason": "not an image"}

    def fill(writer):
        writer.put(0, IDS, _value(0, IDS))  # sample 7 too: absent() zeroes what was put
        writer.absent([entry])
        for view in [*range(writer.views), None]:
            ids = IDS[IDS != 7]
            writer.put(view, ids, _value(view, ids))

    cache, _ = open_or_build(tmp_path / "fc", PARTS, IDS, 2, WIDTH, "float32", fill)
    assert set(cache.absent) == {7} and cache.absent[7]["image"] == str(bad)
    assert not cache.gather(np.array([7]), 0).any() and torch.equal(cache.gather(IDS[:2], 1), _value(1, IDS[:2]))
    assert stale_reason(tmp_path / "fc", PARTS) == ""

    def leaves_out_9(writer):
        writer.absent([entry])
        for view in [*range(writer.views), None]:
            writer.put(view, IDS[:2], _value(view, IDS[:2]))

    with pytest.raises(ValueError, match="view 0 of sample 9 was not computed"):
        open_or_build(tmp_path / "fc2", PARTS, IDS, 2, WIDTH, "float32", leaves_out_9)


def test_a_cache_built_from_image_files_that_changed_since_is_stale(tmp_path):
    """The meta records the digest of the image files' sizes; a caller whose files' sizes differ finds the cache
    stale, one that does not check (None) reads it, and the digest is not asked for when the cache is stale
    anyway."""
    from mmfast.data.feature_cache import build_into, files_digest

    sizes = np.array([100, 200])
    with build_into(tmp_path / "fc", IDS, 2, WIDTH, "float32", PARTS, files_digest(sizes)) as writer:
        _filler([])(writer)
    assert stale_reason(tmp_path / "fc", PARTS, lambda: files_digest(sizes)) == ""
    assert stale_reason(tmp_path / "fc", PARTS) == ""
    sizes[1] = 22  # one file replaced in place: an error page in place of the image
    assert (
        stale_reason(tmp_path / "fc", PARTS, lambda: files_digest(sizes))
        == "image files changed since it was built"
    )

    def never():
        raise AssertionError("the files were stat'ed for a cache that is stale anyway")

    assert stale_reason(tmp_path / "fc", {**PARTS, "views": {"count": 3}}, never).endswith(
        "changed since it was built"
    )


@pytest.mark.parametrize(
    "damage", ["truncate-views", "truncate-centre", "no-meta", "meta-garbage", "no-ids", "overwrite-views"]
)
def test_a_damaged_cache_is_refused_and_rebuilt(tmp_path, damage):
    """Bytes overwritten in place (the size kept: fp16 0xFFFF is NaN) are found by content, before a run reads
    them, and rebuilt."""
    fc = tmp_path / "fc"
    _build(fc)
    if damage == "overwrite-views":
        with open(fc / "views.bin", "r+b") as f:
            f.seek(8)
            f.write(b"\xff" * 8)
        assert stale_reason(fc, PARTS) == "views.bin changed since it was built (its SHA-256 differs)"
    elif damage.startswith("truncate"):
        path = fc / f"{damage.split('-')[1]}.bin"
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size - 4)
    elif damage == "no-meta":
        (fc / "meta.json").unlink()
    elif damage == "meta-garbage":
        (fc / "meta.json").write_text("{not json")
    else:
        (fc / "ids.npy").unlink()
    assert stale_reason(fc, PARTS) != ""
    if damage != "overwrite-views":  # every process's open checks sizes; the content is checked once, above
        with pytest.raises(ValueError, match="damaged or incomplete"):
            FeatureCache(fc)
    calls = []
    cache, reason = _build(fc, calls=calls)
    assert calls == [1] and reason and torch.equal(cache.gather(IDS, None), _value(None, IDS))


def test_a_folder_that_is_not_a_feature_cache_is_left_alone(tmp_path):
    """Refused before any feature is computed, and left as it was."""
    mine = tmp_path / "fc"
    mine.mkdir()
    (mine / "notes.txt").write_text("the user's")
    calls = []
    with pytest.raises(Exception, match="not written by mmfast|not mmfast's"):
        _build(mine, calls=calls)
    assert (mine / "notes.txt").read_text() == "the user's" and calls == []


def test_the_weights_digest_sees_parameters_and_batch_norm_statistics():
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
    first = weights_digest(net)
    assert weights_digest(net) == first
    net[1].running_mean += 1e-3
    second = weights_digest(net)
    with torch.no_grad():
        net[0].weight[0, 0, 0, 0] += 1e-3
    assert len({first, second, weights_digest(net)}) == 3


# --- the cache in a run ----------------------------------------------------------------------------------------

FLAGS = [
    "--model", "clip", "--preset", "clip-lite0-minilm", "--image-backbone", "resnet10", "--text-model",
    "bert-tiny", "--embed-dim", "16", "--image-size", "32", "--freeze-image", "--batch-size", "8", "--init-proj",
    "random", "--no-progress", "--mixed-precision", "no", "--feature-views", "2",
]  # fmt: skip


def _setup(prepared: Path, tmp_path: Path, accelerator, *flags: str):
    from mmfast.data.dataset import PreparedDataset
    from mmfast.tasks import build_task
    from mmfast.train import parse_config
    from mmfast.train.data import build_loaders
    from mmfast.train.resolve import resolve_preset
    from mmfast.train.run import build_run_model

    cfg = parse_config(["--data", str(prepared), "--feature-cache-dir", str(tmp_path / "fc"), *FLAGS, *flags])
    cfg = resolve_preset(cfg)
    cfg = replace(cfg, eval_batch_size=cfg.eval_batch_size or cfg.batch_size)
    dataset = PreparedDataset(prepared)
    task = build_task(cfg.task, dataset, cfg)
    torch.manual_seed(0)
    model = build_run_model(cfg, dataset, task)
    norm = (model.image.mean, model.image.std)
    train_loader, _, _, _ = build_loaders(cfg, accelerator, dataset, norm, val=False)
    return cfg, dataset, task, model, norm, train_loader


@pytest.mark.timeout(300)
def test_cached_features_give_the_loss_of_the_pixels_they_were_computed_from(prepared, tmp_path, cpu_accelerator):
    """Epochs 0 and 1 read views 0 and 1: the first batch's loss from the cached features equals the loss from
    the pixels the train loader decodes in that epoch, through the frozen tower. Epoch 2 reads view 0 again."""
    from mmfast.loading.feature_loader import FeatureLoader
    from mmfast.train.features import build_image_features

    cfg, dataset, task, model, norm, pixels = _setup(prepared, tmp_path, cpu_accelerator, "--feature-cache", "on")
    features, figures = build_image_features(cfg, cpu_accelerator, dataset, model, norm)
    assert figures["built"] == "no cache yet" and figures["dtype"] == "float32"
    cached = FeatureLoader(pixels, features)
    assert len(cached) == len(pixels)
    model.train()
    losses = {}
    for epoch in (0, 1):
        pixels.set_epoch(epoch)
        cached.set_epoch(epoch)
        a, b = next(iter(pixels)), next(iter(cached))
        assert "image" not in b and torch.equal(a["id"], b["id"])
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["label"], b["label"])
        with torch.no_grad():
            from_pixels = model.image(a["image"])[0]
            assert torch.allclose(b["image_features"], from_pixels, rtol=1e-4, atol=1e-5)
            torch.manual_seed(epoch)  # the text tower's dropout: the same draws for both
            out_a = model(a)
            torch.manual_seed(epoch)
            out_b = model(b)
            loss_a = task.loss(out_a, task.targets(a))
            loss_b = task.loss(out_b, task.targets(b))
        assert torch.allclose(loss_a, loss_b, rtol=1e-5, atol=1e-6), (epoch, loss_a, loss_b)
        losses[epoch] = float(loss_b)
        pixels.set_epoch(epoch + 10)  # leave the pixel epoch unfinished: the next set_epoch starts afresh
    ids = next(iter(pixels))["id"]  # any ids: their two views differ, or a wrong view index would pass
    assert not torch.allclose(features.gather(ids, 0), features.gather(ids, 1))
    cached.set_epoch(2)
    third = next(iter(cached))
    assert torch.equal(third["image_features"], features.gather(third["id"], 0))


@pytest.mark.timeout(300)
def test_a_run_trains_on_cached_features_and_its_model_takes_images(prepared, tmp_path):
    """Through mmfast-train, accumulating windows of two micro-batches: a run with --feature-cache on computes
    the cache, trains with the decoded run's losses while the views are new (epochs 0 and 1 of two views), and a
    second run reads the cache; the model directory takes images."""
    from mmfast.infer.model_dir import load_model
    from mmfast.train import parse_config, train

    common = ["--data", str(prepared), "--feature-cache-dir", str(tmp_path / "fc"), *FLAGS, "--epochs", "2"]
    common += ["--batch-size", "32", "--grad-accum", "2", "--no-checkpoints"]  # whole windows of two
    common += ["--init-proj", "ridge"]  # the cached runs fit it on the centre view, the decoded one on pixels
    off = train(parse_config([*common, "--out", str(tmp_path / "off")]))
    on = train(parse_config([*common, "--out", str(tmp_path / "on"), "--feature-cache", "on"]))
    again = train(parse_config([*common, "--out", str(tmp_path / "again"), "--feature-cache", "on", "--profile"]))
    assert "feature_cache" not in off
    assert on["feature_cache"]["built"] == "no cache yet" and again["feature_cache"]["built"] is None
    assert on["images"].startswith("train read as cached features (2 views")
    profile = json.loads((tmp_path / "again" / "profile.json").read_text())
    assert profile["settings"]["feature_views"] == 2

    def losses(run):
        return [json.loads(x)["train_loss"] for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]

    assert len(losses("on")) == 2 and on["global_step"] == off["global_step"] == 8
    assert np.allclose(losses("on"), losses("off"), rtol=1e-5) and losses("again") == losses("on")
    # evaluation read the val split's own cache of the centre view: the decoded run's figures
    assert on["feature_cache"]["val"]["built"] == "no cache yet" and "text" not in on["feature_cache"]["val"]
    assert re.search(r"val read as cached features \(the centre view, 0\.\d MiB\)$", on["images"]), on["images"]
    assert again["feature_cache"]["val"]["built"] is None
    assert val_figures(tmp_path / "on") == pytest.approx(val_figures(tmp_path / "off"), abs=1e-6)
    model = load_model(tmp_path / "on" / "model-last")
    emb = model.encode_image(torch.zeros(2, 3, 32, 32))
    assert emb.shape == (2, 16)


@pytest.mark.timeout(300)
def test_a_multiscale_run_caches_the_stages_features_and_its_model_takes_images(prepared, tmp_path):
    """--image-pool multiscale on cached features: the cache holds the wider features (the decoded run's losses),
    config.json records the pooling, and the model directory rebuilds the same tower: its embeddings of the
    val images equal the ones the run's own checkpoint gives."""
    from safetensors.torch import load_file

    from mmfast.infer.model_dir import load_model
    from mmfast.models import build_model
    from mmfast.train import parse_config, train

    common = ["--data", str(prepared), "--feature-cache-dir", str(tmp_path / "fc"), *FLAGS, "--epochs", "1"]
    common += ["--batch-size", "32", "--image-pool", "multiscale"]
    off = train(parse_config([*common, "--out", str(tmp_path / "off")]))
    on = train(parse_config([*common, "--out", str(tmp_path / "on"), "--feature-cache", "on"]))
    assert on["feature_cache"]["built"] == "no cache yet"

    def losses(run):
        return [json.loads(x)["train_loss"] for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]

    assert on["global_step"] == off["global_step"] and np.allclose(losses("on"), losses("off"), rtol=1e-5)
    config = json.loads((tmp_path / "on" / "model-last" / "config.json").read_text())
    assert config["image_pool"] == "multiscale"
    model = load_model(tmp_path / "on" / "model-last")
    assert model.model.image.width == 512 + 256  # resnet10: layer3's pooled output, then layer4's
    own = build_model(
        "clip", 2, image_backbone="resnet10", text_model="bert-tiny", vocab_size=config["vocab_size"],
        embed_dim=16, hidden=config["hidden"], image_pool="multiscale",
    )  # fmt: skip
    saved = load_file(tmp_path / "on" / "model-last" / "model.safetensors")
    own.load_state_dict({k.removeprefix("model."): v for k, v in saved.items()})
    images = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        assert torch.allclose(model.encode_image(images), own.eval().encode_image(images), atol=1e-6)


def test_feature_cache_on_refuses_a_tower_that_trains(prepared, tmp_path, capsys):
    from mmfast.cli.train import main

    flags = ["--data", str(prepared), "--out", str(tmp_path / "run"), *FLAGS, "--no-freeze-image"]
    assert main([*flags, "--feature-cache", "on", "--max-steps", "1"]) != 0
    err = capsys.readouterr().err
    assert "--feature-cache on: the image tower trains; lock it with --freeze-image" in err
    assert "Traceback" not in err


def test_a_cache_folder_that_cannot_be_used_is_refused_in_one_line_before_the_first_pass(
    prepared, tmp_path, capsys, monkeypatch
):
    """--feature-cache-dir naming a file, or a folder whose train/ is the user's own (an image folder): exit 2,
    one line that names it, no traceback, no tower run over the data first, and the user's files as they were."""
    import mmfast.train.features as features
    from mmfast.cli.train import main

    passes = []
    view_steps = features._view_steps

    def counted(*args, **kwargs):
        passes.append(1)
        yield from view_steps(*args, **kwargs)

    monkeypatch.setattr(features, "_view_steps", counted)
    afile = tmp_path / "afile"
    afile.write_text("the user's")
    users = tmp_path / "userdata"
    (users / "train").mkdir(parents=True)
    (users / "train" / "cat.jpg").write_bytes(b"the user's")
    flags = ["--data", str(prepared), *FLAGS, "--feature-cache", "on", "--max-steps", "1", "--no-checkpoints"]
    for folder, says in (
        (afile, "is a file, not a directory; choose another --feature-cache-dir"),
        (users, "not written by mmfast"),
    ):
        assert (
            main([*flags, "--out", str(tmp_path / f"run-{folder.name}"), "--feature-cache-dir", str(folder)]) == 2
        )
        err = capsys.readouterr().err
        assert says in err and str(folder) in err and "Traceback" not in err, err[-2000:]
    assert passes == []
    assert afile.read_text() == "the user's" and (users / "train" / "cat.jpg").read_bytes() == b"the user's"
    assert sorted(p.name for p in users.iterdir()) == ["train"]


@pytest.mark.timeout(300)
def test_runs_on_one_raw_input_share_its_default_cache_and_no_augment_stores_one_view(
    demo_manifest, tmp_path, monkeypatch
):
    """Two runs on the same raw --data, each preparing it into its own folder, use one cache in the default
    place (under $MMFAST_CACHE when set): the second reads what the first built. Without augmentation every
    view would be the centre view, so one is stored whatever --feature-views says."""
    from mmfast.train import parse_config, train

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MMFAST_CACHE", raising=False)
    flags = ["--data", str(demo_manifest), *FLAGS, "--feature-cache", "on", "--epochs", "1", "--no-checkpoints"]
    flags += ["--no-augment", "--feature-views", "3"]
    first = train(parse_config([*flags, "--out", str(tmp_path / "first")]))
    second = train(parse_config([*flags, "--out", str(tmp_path / "second")]))
    assert first["feature_cache"]["built"] == "no cache yet" and second["feature_cache"]["built"] is None
    assert first["feature_cache"]["dir"] == second["feature_cache"]["dir"]
    assert Path(first["feature_cache"]["dir"]).is_relative_to(tmp_path / "home" / ".cache" / "mmfast" / "features")
    assert first["feature_cache"]["views"] == 1 and FeatureCache(first["feature_cache"]["dir"]).views == 1
    # $MMFAST_CACHE moves the default place: a run there builds its own
    monkeypatch.setenv("MMFAST_CACHE", str(tmp_path / "elsewhere"))
    third = train(parse_config([*flags, "--out", str(tmp_path / "third")]))
    assert third["feature_cache"]["built"] == "no cache yet"
    assert Path(third["feature_cache"]["dir"]).is_relative_to(tmp_path / "elsewhere" / "features")


def test_a_runs_fingerprint_parts_follow_its_data_weights_preprocessing_and_views():
    """What ``open_or_build`` compares (``feature_parts``) changes with each thing the features depend on."""
    from types import SimpleNamespace

    from mmfast.train.config import TrainConfig
    from mmfast.train.features import feature_parts

    tower = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
    model, data = SimpleNamespace(image=tower), SimpleNamespace(fingerprint="d1")
    norm = ((0.5,) * 3, (0.5,) * 3)

    def parts(cfg=TrainConfig(), dataset=data, norm=norm, dtype="float32", split="train"):
        return json.dumps(feature_parts(cfg, dataset, model, norm, dtype, "no", split), sort_keys=True)

    first = parts()
    assert parts() == first
    changed = [
        parts(dataset=SimpleNamespace(fingerprint="d2")),
        parts(cfg=TrainConfig(feature_views=5)),
        parts(cfg=TrainConfig(seed=1)),
        parts(cfg=TrainConfig(crop_scale_min=0.5)),
        parts(cfg=TrainConfig(color_jitter=0.2)),
        parts(cfg=TrainConfig(image_size=48)),
        parts(norm=((0.4,) * 3, (0.5,) * 3)),
        parts(dtype="float16"),
    ]
    tower.pool = "last"  # the default pooling keeps the keys of the caches built before --image-pool
    assert parts() == first
    tower.pool = "multiscale"
    changed.append(parts())
    del tower.pool
    tower[1].running_var += 1.0
    changed.append(parts())
    assert first not in changed and len(set(changed)) == len(changed)
    # the val split's centre view: not the train split's, and not its augmentation, views or resize
    val = parts(split="val")
    assert val != parts() and val != parts(dataset=SimpleNamespace(fingerprint="d2"), split="val")
    for cfg in (TrainConfig(feature_views=5), TrainConfig(augment=False), TrainConfig(color_jitter=0.2)):
        assert parts(cfg=cfg, split="val") == val
    assert (
        parts(cfg=TrainConfig(cpu_resize="dali"), split="val")
        == val
        != parts(cfg=TrainConfig(image_size=48), split="val")
    )


@pytest.mark.timeout(400)
def test_a_run_on_cached_features_resumes_mid_epoch_exactly(prepared, tmp_path):
    """A run of three epochs over two views resumed from its step-3 checkpoint (mid-epoch 0) trains the same
    remaining batches, the third epoch on view 0 again, and ends with the same weights."""
    import shutil

    from safetensors.torch import load_file

    from mmfast.train import parse_config, train

    args = ["--data", str(prepared), "--feature-cache-dir", str(tmp_path / "fc"), *FLAGS, "--feature-cache", "on"]
    args += ["--epochs", "3", "--batch-size", "32", "--checkpoint-every", "3", "--keep-checkpoints", "20"]
    args += ["--record-ids"]
    full = tmp_path / "full"
    train(parse_config([*args, "--out", str(full)]))
    part = tmp_path / "part"
    (part / "checkpoints").mkdir(parents=True)
    shutil.copy(full / ".mmfast-run", part / ".mmfast-run")
    shutil.copytree(full / "checkpoints" / "step-00000003", part / "checkpoints" / "step-00000003")
    state = json.loads((part / "checkpoints" / "step-00000003" / "trainer_state.json").read_text())
    assert state["epoch"] == 0 and state["loader"][0]["step"] == 3
    summary = train(parse_config([*args, "--out", str(part), "--resume", "latest"]))
    assert summary["feature_cache"]["built"] is None  # the first run's cache, read

    def seen(run):
        return [json.loads(x)["ids"] for x in (run / "seen_ids.rank0.jsonl").read_text().splitlines()]

    assert seen(part) == seen(full)[3:]

    def last(run):
        return load_file(sorted((run / "checkpoints").iterdir())[-1] / "model.safetensors")

    a, b = last(full), last(part)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.timeout(300)
def test_the_ridge_start_from_the_cached_centre_view_equals_the_one_from_pixels(
    prepared, tmp_path, cpu_accelerator
):
    """--init-proj ridge with a feature cache reads its centre view: the same projections as the pass that
    decodes the train split as evaluation sees it."""
    from mmfast.loading.feature_loader import FeatureLoader
    from mmfast.train.data import train_view_loader
    from mmfast.train.features import build_image_features
    from mmfast.train.warm_start import ridge_start

    cfg, dataset, _, model, norm, _ = _setup(prepared, tmp_path, cpu_accelerator, "--feature-cache", "on")
    features, _ = build_image_features(cfg, cpu_accelerator, dataset, model, norm)
    view = train_view_loader(cfg, cpu_accelerator, dataset, norm, None)
    ridge_start(model, view, cpu_accelerator)
    from_pixels = model.image_proj.weight.detach().clone(), model.text_proj.weight.detach().clone()
    with torch.no_grad():
        model.image_proj.weight.zero_()
        model.text_proj.weight.zero_()
    figures = ridge_start(model, FeatureLoader(view, features, centre=True), cpu_accelerator)
    assert figures["samples"] == len(features)
    assert torch.allclose(model.image_proj.weight, from_pixels[0], rtol=1e-3, atol=1e-5)
    assert torch.allclose(model.text_proj.weight, from_pixels[1], rtol=1e-3, atol=1e-5)
    stored_view_0 = FeatureLoader(view, features)  # a wrong view would fit other features
    ridge_start(model, stored_view_0, cpu_accelerator)
    assert not torch.allclose(model.image_proj.weight, from_pixels[0], rtol=1e-3, atol=1e-5)


# --- a locked text tower's features, one per caption ------------------------------------------------------------


@pytest.mark.timeout(300)
def test_locked_text_features_are_the_eval_mode_towers_and_rebuilt_for_other_weights_or_tokens(
    prepared, tmp_path, cpu_accelerator
):
    """Each caption's stored feature is the locked text tower's output in eval mode (bert-tiny's dropout 0.1 is
    off), the tower's mode is left as it was, and the batches carry them in place of tokens. A second build
    reads them; other weights or another padding of the tokens rebuild them."""
    from mmfast.loading.feature_loader import FeatureLoader
    from mmfast.train.features import build_image_features, build_text_features, text_locked

    cfg, dataset, _, model, norm, loader = _setup(
        prepared, tmp_path, cpu_accelerator, "--feature-cache", "on", "--freeze-text"
    )
    assert text_locked(model) and cfg.dropout > 0
    model.train()
    text, figures = build_text_features(cfg, cpu_accelerator, dataset, model, loader)
    assert figures["built"] == "no cache yet" and text.views == 0 and len(text) == len(loader.ids)
    assert text.dir.name == "train-text" and model.text.training  # the run's mode, back
    ids = np.asarray(loader.ids)[:8]
    tokens = loader.tokens.gather(ids, loader.text_padding)
    model.text.eval()
    with torch.no_grad():
        want = model.text(tokens["input_ids"], tokens["attention_mask"])
    assert torch.allclose(text.gather(ids, None), want, rtol=1e-5, atol=1e-6)
    model.text.train()
    torch.manual_seed(0)
    with torch.no_grad():  # the tower in training mode differs: dropout is on, so eval mode was used
        assert not torch.allclose(model.text(tokens["input_ids"], tokens["attention_mask"]), want, atol=1e-4)

    images, _ = build_image_features(cfg, cpu_accelerator, dataset, model, norm)
    served = FeatureLoader(loader, images, text=text)
    batch = next(iter(served))
    assert "input_ids" not in batch and "image" not in batch
    assert torch.equal(batch["text_features"], text.gather(batch["id"], None))
    served.load_state_dict({**served.state_dict(), "epoch": 0, "step": len(served)})  # stopped on the last step
    served.set_epoch(0)
    assert list(served) == []  # the resumed epoch has no batch left; epoch 1 was read in its place
    served.set_epoch(1)
    assert len(list(served)) == len(served)

    _, again = build_text_features(cfg, cpu_accelerator, dataset, model, loader)
    assert again["built"] is None
    loader.text_padding = "max"
    _, padded = build_text_features(cfg, cpu_accelerator, dataset, model, loader)
    assert padded["built"] == "the tokens changed since it was built"
    with torch.no_grad():
        next(model.text.parameters()).add_(1e-3)
    _, other = build_text_features(cfg, cpu_accelerator, dataset, model, loader)
    assert other["built"] == "the tower changed since it was built"


def _val_batches(prepared: Path, tmp_path: Path, accelerator, text_figures: dict, *flags: str):
    """The val split's decoded batches beside the ones its cache serves (``feature_val_loader``, the train
    split's text cache described by ``text_figures``), under no_grad with the model in eval mode: (model, the
    val cache's figures, an iterator of (decoded, cached, keep: the real samples)). The iterator asserts that
    both have the same ids and that every val sample came once."""
    from mmfast.loading.feature_loader import FeatureLoader
    from mmfast.train.data import build_loaders
    from mmfast.train.features import feature_val_loader

    cfg, dataset, _, model, norm, _ = _setup(prepared, tmp_path, accelerator, "--feature-cache", "on", *flags)
    _, val_loader, _, _ = build_loaders(cfg, accelerator, dataset, norm)
    figures = {"text": text_figures}
    served = feature_val_loader(cfg, accelerator, dataset, model, norm, None, val_loader, figures)
    assert isinstance(served, FeatureLoader)
    model.eval()

    def pairs():
        seen = 0
        with torch.no_grad():
            for decoded, cached in zip(val_loader, served, strict=True):
                assert torch.equal(decoded["id"], cached["id"])
                keep = decoded["id"] >= 0
                yield decoded, cached, keep
                seen += int(keep.sum())
        assert seen == len(val_loader.ids)

    return model, figures["val"], pairs()


def test_the_val_cache_serves_what_evaluation_computes_from_the_decoded_val_batches(
    prepared, tmp_path, cpu_accelerator
):
    """The val split's cache, served in the val loader's order: each batch's image features are the locked
    tower's output on the decoded val batch (the val loader's resize, not the train split's --cpu-resize), and
    its text features the locked text tower's on the batch's tokens; a sample padding a batch is -1 there too."""
    built = {"built": None}  # the train split's cache figures: the captions' cached too
    model, val, pairs = _val_batches(
        prepared, tmp_path, cpu_accelerator, built, "--freeze-text", "--cpu-resize", "dali"
    )
    assert val["views"] == 0 and val["built"] == "no cache yet" and val["text"]["built"] == "no cache yet"
    for decoded, cached, keep in pairs:
        want = model.image(decoded["image"].float())[0][keep]
        assert torch.allclose(cached["image_features"][keep], want, rtol=1e-4, atol=1e-5)
        text = model.text(decoded["input_ids"], decoded["attention_mask"])[keep]
        assert torch.allclose(cached["text_features"][keep], text, rtol=1e-4, atol=1e-5)


def test_the_val_cache_of_the_locked_lower_text_layers_is_their_output_on_each_batchs_tokens(
    prepared, tmp_path, cpu_accelerator
):
    """With the top text layer training (--text-train-layers 1), the val split caches the locked lower layers'
    output: each batch's ``text_hidden`` is those layers' output on the batch's tokens, its padding masked."""
    lower = {"built": None, "locked_layers": 1}  # the train split's: the lower layers' output cached
    model, val, pairs = _val_batches(prepared, tmp_path, cpu_accelerator, lower, "--text-train-layers", "1")
    assert val["text"]["locked_layers"] == 1
    for decoded, cached, keep in pairs:
        assert torch.equal(decoded["input_ids"], cached["input_ids"])
        mask = decoded["attention_mask"][keep].bool()
        want = model.text.lower(decoded["input_ids"], decoded["attention_mask"])[keep]
        assert cached["text_hidden"].shape == (len(keep), *want.shape[1:])
        got = cached["text_hidden"][keep]
        assert torch.allclose(got[mask], want[mask], rtol=1e-4, atol=1e-5)  # every real token's output


@pytest.mark.timeout(300)
def test_unreadable_images_are_masked_from_the_cache_as_decoding_masks_them(demo_manifest, tmp_path):
    """A train image and a val image that stop being images after a cache was built from them: the next cached
    run sees the files changed and builds the caches again, and the decoded run and it skip them alike (the
    cache stores them as absent): the same losses, val figures and skipped samples. Under --on-bad-image error
    the build stops on the file, in one line, and leaves no cache, and a cache that skipped it is refused. Once
    the train image is fixed, the cache is built again."""
    import shutil

    from mmfast.prepare.core import PrepareConfig, prepare_dataset
    from mmfast.train import parse_config, train

    source = tmp_path / "source"
    shutil.copytree(demo_manifest.parent, source)
    data = tmp_path / "prepared"
    prepare_dataset(PrepareConfig(source=str(source / demo_manifest.name), out=str(data), progress=False))
    common = ["--data", str(data), "--feature-cache-dir", str(tmp_path / "fc"), *FLAGS, "--epochs", "2"]
    common += ["--no-checkpoints"]
    first = train(
        parse_config([*common, "--out", str(tmp_path / "first"), "--feature-cache", "on", "--epochs", "1"])
    )
    assert first["feature_cache"]["built"] == "no cache yet"
    broken = []
    for split in ("train", "val"):  # replaced in place after the first cache was built
        row = json.loads((data / f"{split}.jsonl").read_text().splitlines()[5])
        Path(row["image"]).write_bytes(b"<html>not found</html>")  # what a failed download leaves
        broken.append(row["image"])

    train(parse_config([*common, "--out", str(tmp_path / "off")]))
    on = train(parse_config([*common, "--out", str(tmp_path / "on"), "--feature-cache", "on"]))
    assert (
        on["feature_cache"]["built"]
        == on["feature_cache"]["val"]["built"]
        == "image files changed since it was built"
    )
    rows = {
        run: [json.loads(x) for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        for run in ("off", "on")
    }
    assert [x["skipped_samples"] for x in rows["on"]] == [x["skipped_samples"] for x in rows["off"]] == [1, 1]
    assert np.allclose([x["train_loss"] for x in rows["on"]], [x["train_loss"] for x in rows["off"]], rtol=1e-5)
    assert val_figures(tmp_path / "on") == pytest.approx(val_figures(tmp_path / "off"), abs=1e-6)
    assert on["feature_cache"]["absent"] == on["feature_cache"]["val"]["absent"] == 1  # summary.json says so
    for split, image in zip(("train", "val"), broken, strict=True):
        assert [e["image"] for e in FeatureCache(tmp_path / "fc" / split).absent.values()] == [image]

    strict = [str(tmp_path / "fc-err") if a == str(tmp_path / "fc") else a for a in common]
    strict += ["--out", str(tmp_path / "err"), "--feature-cache", "on", "--on-bad-image", "error"]
    with pytest.raises(ValueError, match=f"{broken[0]}: not an image.* or pass .*; no cache was left"):
        train(parse_config(strict))
    assert not (tmp_path / "fc-err" / "train" / "meta.json").exists()
    strict[strict.index(str(tmp_path / "fc-err"))] = str(tmp_path / "fc")  # the cache that skipped it
    with pytest.raises(ValueError, match=f"{broken[0]}: not an image .*built with it skipped"):
        train(parse_config(strict))

    # the train image fixed: the cache is built again and reads it, as the decoded run does
    shutil.copy(Path(broken[0]).with_name("00000.jpg"), broken[0])
    fixed = train(
        parse_config([*common, "--out", str(tmp_path / "fixed"), "--feature-cache", "on", "--epochs", "1"])
    )
    assert fixed["feature_cache"]["built"] == "image files changed since it was built"
    assert list(FeatureCache(tmp_path / "fc" / "train").absent) == []


def test_a_val_cache_that_cannot_be_built_leaves_evaluation_decoding(prepared, tmp_path, monkeypatch, capsys):
    """A val split whose cache build stops (as one does when the disk fills) does not stop the run: it says so,
    and evaluation decodes the val split as without a cache."""
    from mmfast.train import features, parse_config, train

    real = features.build_image_features

    def stops_on_val(*args, split="train", **kwargs):
        if split == "val":
            raise RuntimeError("the feature cache's build stopped on process 0: a val image; no cache was left")
        return real(*args, split=split, **kwargs)

    monkeypatch.setattr(features, "build_image_features", stops_on_val)
    common = ["--data", str(prepared), "--feature-cache-dir", str(tmp_path / "fc"), *FLAGS, "--epochs", "1"]
    summary = train(
        parse_config([*common, "--no-checkpoints", "--feature-cache", "on", "--out", str(tmp_path / "r")])
    )
    assert "val features not cached (the feature cache's build stopped" in capsys.readouterr().out
    assert "val" not in summary["feature_cache"] and summary["val_mean_recall"] > 0
    assert "val decoded" in summary["images"] or "val streamed" in summary["images"]


def test_the_text_fingerprint_parts_follow_the_tower_and_the_tokens():
    """What a text cache is compared by changes with the tower's weights, the token cache's fingerprint, its
    max length and the padding."""
    from types import SimpleNamespace

    from mmfast.train.features import text_feature_parts

    tower = torch.nn.Linear(3, 4)
    model, data = SimpleNamespace(text=tower), SimpleNamespace(fingerprint="d1")

    def parts(fp="t1", max_length=32, padding="longest", dataset=data):
        tokens = SimpleNamespace(fingerprint=fp, meta={"max_length": max_length})
        loader = SimpleNamespace(tokens=tokens, text_padding=padding)
        return json.dumps(text_feature_parts(dataset, model, loader, "float32", "no"), sort_keys=True)

    first = parts()
    assert parts() == first
    changed = [parts(fp="t2"), parts(max_length=16), parts(padding="buckets"),
               parts(dataset=SimpleNamespace(fingerprint="d2"))]  # fmt: skip
    with torch.no_grad():
        tower.bias[0] += 1e-3
    changed.append(parts())
    assert first not in changed and len(set(changed)) == len(changed)


@pytest.mark.timeout(400)
def test_a_run_with_both_towers_locked_trains_on_cached_features_of_both(prepared, tmp_path):
    """With both towers locked, a cached run has the per-epoch losses of a decoded run whose locked text tower
    applies no dropout (--dropout 0: the eval mode's output); its summary says the captions are cached."""
    from mmfast.train import parse_config, train

    common = ["--data", str(prepared), "--feature-cache-dir", str(tmp_path / "fc"), *FLAGS, "--epochs", "2"]
    common += ["--batch-size", "32", "--no-checkpoints", "--freeze-text", "--dropout", "0"]
    off = train(parse_config([*common, "--out", str(tmp_path / "off")]))
    on = train(parse_config([*common, "--out", str(tmp_path / "on"), "--feature-cache", "on"]))
    assert on["feature_cache"]["text"]["built"] == "no cache yet"
    assert "captions too" in on["images"]

    def losses(run):
        return [json.loads(x)["train_loss"] for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]

    assert len(losses("on")) == 2 and on["global_step"] == off["global_step"]
    assert np.allclose(losses("on"), losses("off"), rtol=1e-5)
    # evaluation read the val split's cached centre view and captions: the decoded run's figures
    assert on["feature_cache"]["val"]["text"]["built"] == "no cache yet"
    assert val_figures(tmp_path / "on") == pytest.approx(val_figures(tmp_path / "off"), abs=1e-6)


@pytest.mark.timeout(400)
def test_a_profile_says_it_read_cached_features_how_many_views_their_size_and_build_time(
    prepared, tmp_path, capsys
):
    """mmfast-profile of a run with both towers locked and --feature-cache on: its steps read the cache, and its
    text report and profile.json say so (views, captions, MiB, computed or read, seconds)."""
    from tools import profile_run as profile_tool

    out = tmp_path / "profile"
    flags = ["--data", str(prepared), "--out", str(out), "--feature-cache-dir", str(tmp_path / "fc"), *FLAGS]
    flags += ["--freeze-text", "--feature-cache", "on", "--steps", "2", "--warmup", "1"]
    assert profile_tool.main(flags) == 0
    printed = capsys.readouterr().out
    report = json.loads((out / "profile.json").read_text())
    cache = report["settings"]["feature_cache"]
    assert report["settings"]["feature_views"] == 2 and cache["views"] == 2 and cache["built"] == "no cache yet"
    assert cache["text"]["built"] == "no cache yet" and cache["mib"] > 0 and cache["text"]["mib"] > 0
    mib = cache["mib"] + cache["text"]["mib"]
    line = f"train read as cached features: 2 views and the captions, {mib:.1f} MiB, computed (no cache yet) in "
    assert any(note.startswith(line) and note.endswith(" s") for note in report["notes"]), report["notes"]
    assert f"note: {line}" in printed
    assert profile_tool.main([*flags, "--out", str(tmp_path / "again")]) == 0
    printed = capsys.readouterr().out
    assert "note: train read as cached features: 2 views and the captions" in printed
    assert "read from an earlier run's cache in" in printed


def test_a_run_recorded_before_image_pool_resumes_as_last_and_refuses_multiscale():
    """config.json of a run before --image-pool has no such field: it pooled the last map, so a resume with
    ``last`` continues it and one with ``multiscale`` (another model) is refused, naming the setting."""
    from mmfast.train.resume_rules import resume_differences

    saved = {"task": "contrastive", "seed": 0}
    assert resume_differences(saved, {"task": "contrastive", "seed": 0, "image_pool": "last"}) == []
    now = {"task": "contrastive", "seed": 0, "image_pool": "multiscale"}
    assert resume_differences(saved, now) == ["image_pool: 'last' -> 'multiscale'"]
