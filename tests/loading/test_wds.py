"""WebDataset in and out: shards in img2dataset / open_clip layout (written with the ``webdataset`` library's
TarWriter from scikit-image's photos) prepared in place and read by DALI's webdataset reader, each sample's
image, caption and label checked after the join; mmfast's own export read back with ``webdataset`` and
trained from with the original images moved away."""

from __future__ import annotations

import functools
import hashlib
import io
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import SMALL_RUN
from PIL import Image

from mmfast.data.tokenizer import load_tokenizer
from mmfast.inputs import InputOptions
from mmfast.inputs.manifest import ManifestError
from mmfast.loading.multimodal import MultimodalLoader
from mmfast.prepare.core import PrepareConfig, failure_report_path, prepare_dataset
from mmfast.prepare.parts import part_dir
from tools import prepare_data
from tools import train as train_tool

wds = pytest.importorskip("webdataset")

PHOTOS = [
    "rocket.jpg",
    "chelsea.png",
    "astronaut.png",
    "coffee.png",
    "hubble_deep_field.jpg",
    "motorcycle_left.png",
]
PER_SHARD = 6  # good samples per shard: each photo once


def _photo_bytes() -> dict[str, bytes]:
    """Each photo, downscaled to 80 px wide and encoded in its own format (JPEG or PNG)."""
    import skimage

    out = {}
    for name in PHOTOS:
        path = Path(skimage.data_dir) / name
        if not path.exists():
            continue
        im = Image.open(path).convert("RGB")
        im = im.resize((80, max(8, round(80 * im.height / im.width))))
        buf = io.BytesIO()
        im.save(buf, "JPEG" if name.endswith(".jpg") else "PNG")
        out[name] = buf.getvalue()
    assert len(out) >= 4, "scikit-image photos missing"
    return out


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> tuple[Path, dict]:
    """Two shards as img2dataset writes them (key.jpg|png + key.txt + key.json, here with a .cls too), plus
    one bad sample of each kind. Returns (folder, {key: {"photo", "ext", "text", "label", "bytes"}})."""
    folder = tmp_path_factory.mktemp("shards")
    photos = _photo_bytes()
    names = sorted(photos)
    samples = {}
    for shard in range(2):
        with wds.TarWriter(str(folder / f"{shard:05d}.tar")) as w:
            for j, name in enumerate(names):
                key = f"{shard:05d}{j:04d}"
                ext = name.rsplit(".", 1)[1]
                photo = name.rsplit(".", 1)[0]
                text = f"photo number {shard * 10 + j} shows the {photo.replace('_', ' ')}"
                label = names.index(name)
                meta = {"key": key, "caption": text, "status": "success", "photo": photo}
                w.write(
                    {"__key__": key, ext: photos[name], "txt": text, "cls": str(label), "json": json.dumps(meta)}
                )
                samples[key] = {"photo": photo, "ext": ext, "text": text, "label": label, "bytes": photos[name]}
            one = photos[names[0]]
            w.write({"__key__": f"{shard:05d}nojpg", "txt": "a caption without its image", "cls": "0"})
            w.write(
                {"__key__": f"{shard:05d}corrupt", "jpg": one[: len(one) // 3], "txt": "cut short", "cls": "0"}
            )
            w.write({"__key__": f"{shard:05d}empty", "jpg": one, "txt": "   ", "cls": "0"})
            w.write({"__key__": f"{shard:05d}latin1", "jpg": one, "txt": "caf\xe9".encode("latin-1"), "cls": "0"})
            w.write({"__key__": f"{shard:05d}nolabel", "jpg": one, "txt": "no label here"})
    return folder, samples


def _tree(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def _prepare(source, out: Path, minilm_dir: str, shard=None, merge=False, **inputs) -> dict:
    cfg = PrepareConfig(
        source=str(source),
        out=str(out),
        tokenizer=minilm_dir,
        max_length=24,
        progress=False,
        workers=2,
        val_fraction=0.25,
        inputs=InputOptions(**inputs),
        shard=shard,
        merge=merge,
    )
    return prepare_dataset(cfg)


@pytest.fixture(scope="module")
def prepared_wds(tmp_path_factory, shards, minilm_dir) -> Path:
    folder, _ = shards
    out = tmp_path_factory.mktemp("prepared") / "wds"
    before = _tree(folder)
    _prepare(f"{folder}/{{00000..00001}}.tar", out, minilm_dir)
    assert _tree(folder) == before  # the user's shards: not written, no index put beside them
    return out


def test_bad_samples_are_rejected_naming_shard_and_key(prepared_wds, shards):
    summary = json.loads((prepared_wds / "prepare.json").read_text())
    n_good = len(shards[1])
    assert summary["input_kind"] == "wds"
    assert summary["counts"]["accepted"] == n_good and summary["counts"]["rejected"] == 10
    rejects = [json.loads(ln) for ln in (prepared_wds / "rejected.jsonl").read_text().splitlines()]
    why = {(r["file"], r["row"]["key"]): r["reason"] for r in rejects}
    for shard in ("00000", "00001"):
        f = f"{shard}.tar"
        assert why[(f, f"{shard}nojpg")].startswith("no image member (.jpg / .jpeg / .png / .webp)")
        assert "truncated image" in why[(f, f"{shard}corrupt")] or "corrupt" in why[(f, f"{shard}corrupt")]
        assert why[(f, f"{shard}empty")].startswith("empty caption")
        assert why[(f, f"{shard}latin1")].startswith("the caption is not UTF-8 (byte 3")
        assert why[(f, f"{shard}nolabel")].startswith("no label member (.cls)")
        assert all(f"(sample {k[1]})" in reason for k, reason in why.items() if k[0] == f)


def test_index_offsets_are_dalis_own(prepared_wds, shards):
    """The index lines list exactly the accepted samples of the split, at the offsets and sizes DALI's own
    wds2idx finds for the same members."""
    from wds2idx import IndexCreator

    folder, samples = shards
    listing = {s: json.loads((prepared_wds / "wds" / f"{s}.json").read_text()) for s in ("train", "val")}
    lines = []
    for info in listing.values():
        assert all(Path(t).parent == folder.resolve() for t in info["tars"])
        for tar, idx in zip(info["tars"], info["index"], strict=True):
            body = (prepared_wds / "wds" / idx).read_text().splitlines()
            assert body[0] == f"v1.2 {len(body) - 1}"
            lines += [(tar, *ln.split()) for ln in body[1:]]
    assert sorted(ln[4].split(".")[0] for ln in lines) == sorted(samples)  # each accepted sample once
    theirs = {}
    for tar in {ln[0] for ln in lines}:
        idx = prepared_wds / "theirs.idx"
        with IndexCreator(tar, str(idx), verbose=False) as ic:
            ic.create_index()
        for ln in idx.read_text().splitlines()[1:]:
            f = ln.split()
            for k in range(0, len(f), 4):
                theirs[(tar, f[k + 3])] = (f[k + 1], f[k + 2])
        idx.unlink()
    for tar, ext, offset, size, name in lines:
        assert ext == "img" and theirs[(tar, name.split("#")[0])] == (offset, size)


def test_dali_reads_each_image_with_its_sample_id(prepared_wds, shards):
    """The real image graph over the user's shards: each decoded image (shape and pixels) is PIL's decode of
    the member that the row of its sample id names."""
    from mmfast.data.dataset import wds_split
    from mmfast.loading.graphs import image_pipeline
    from mmfast.loading.sources import read_wds

    samples = shards[1]
    rows = {r["id"]: r for s in ("train", "val") for r in map(json.loads, open(prepared_wds / f"{s}.jsonl"))}
    seen = []
    for split in ("train", "val"):
        tars, index = wds_split(prepared_wds, split)
        pipe = image_pipeline(
            read=functools.partial(read_wds, tars, index, shuffle=True),
            train=False,
            size=32,
            finish_on_host=True,
            batch_size=4,
            num_threads=2,
            device_id=None,
            seed=5,
        )
        pipe.build()
        for _ in range(-(-json.loads((prepared_wds / "wds" / f"{split}.json").read_text())["samples"] // 4)):
            images, _, ids = pipe.run()
            for k in range(len(ids)):
                sid = int(np.array(ids[k]).ravel()[0])
                row = rows[sid]
                key = row["member"].split(".")[0]
                want = np.asarray(Image.open(io.BytesIO(samples[key]["bytes"])).convert("RGB"))
                got = np.array(images[k])
                assert got.shape == want.shape, (sid, key)
                # PNG: the same pixels; JPEG: libjpeg-turbo vs PIL's IDCT, within a level or two on average
                assert np.abs(got.astype(int) - want).mean() < (2.0 if samples[key]["ext"] == "jpg" else 1e-9)
                seen.append(sid)
        del pipe
    assert set(seen) == set(rows)


def test_multimodal_loader_joins_image_caption_and_label(prepared_wds, shards, minilm_dir):
    """Per sample of MultimodalLoader over the user's shards: the tokens detokenize to the caption of the
    sample's key, the label is its .cls, and the image is its photo's (every sample of a photo gets the same
    eval image; photos differ)."""
    samples = shards[1]
    tok = load_tokenizer(minilm_dir)
    labels = json.loads((prepared_wds / "labels.json").read_text())
    for split in ("train", "val"):
        rows = {r["id"]: r for r in map(json.loads, open(prepared_wds / f"{split}.jsonl"))}
        loader = MultimodalLoader(
            prepared_wds, split, batch_size=3, size=32, shuffle=True, drop_last=False, train=False, dtype="float32"
        )
        # the rows were read as arrays (wds/<split>.rows.npy), not as JSON: no row's image path was read
        assert set(loader.files) == {str(prepared_wds / "wds" / f"{split}.rows.npy")}
        by_photo, seen = {}, []
        for batch in loader:
            for i, sid in enumerate(batch["id"].tolist()):
                if sid < 0:
                    continue
                s = samples[rows[sid]["member"].split(".")[0]]
                ids = batch["input_ids"][i][batch["attention_mask"][i].bool()]
                assert tok.decode(ids, skip_special_tokens=True) == s["text"].lower()
                assert int(batch["label"][i]) == labels[str(s["label"])]
                ref = by_photo.setdefault(s["photo"], batch["image"][i])
                assert torch.equal(batch["image"][i], ref), (sid, s["photo"])
                seen.append(sid)
        assert sorted(seen) == sorted(rows)
        refs = list(by_photo.values())
        assert all(not torch.equal(a, b) for j, a in enumerate(refs) for b in refs[j + 1 :])


def test_label_from_a_json_field_and_a_folder_source(tmp_path, shards, minilm_dir):
    folder, samples = shards
    out = tmp_path / "p"
    summary = _prepare(folder, out, minilm_dir, wds_label_field="photo")
    assert summary["counts"]["accepted"] == len(samples)  # "nolabel" has no .json: rejected with the others
    labels = json.loads((out / "labels.json").read_text())
    assert sorted(labels) == sorted({s["photo"] for s in samples.values()})
    for r in map(json.loads, open(out / "train.jsonl")):
        assert labels[samples[r["member"].split(".")[0]]["photo"]] == r["label"]


def test_unchanged_shards_are_reused_and_a_changed_shard_is_refused(tmp_path, shards, minilm_dir, caplog):
    folder = tmp_path / "mine"
    shutil.copytree(shards[0], folder)
    out = tmp_path / "p"
    _prepare(folder, out, minilm_dir)
    with caplog.at_level("INFO"):
        _prepare(folder, out, minilm_dir)
    assert "up to date" in caplog.text
    tar = folder / "00001.tar"
    os.utime(tar, ns=(tar.stat().st_atime_ns, tar.stat().st_mtime_ns + 10**9))
    with pytest.raises(ValueError, match="00001.tar: changed since preparation"):
        MultimodalLoader(out, "train", batch_size=2)


def test_shards_checked_in_two_parts_merge_into_the_one_process_preparation(
    tmp_path, prepared_wds, shards, minilm_dir
):
    folder, _ = shards
    out = tmp_path / "out"
    for part in ((0, 2), (1, 2)):
        _prepare(f"{folder}/{{00000..00001}}.tar", out, minilm_dir, shard=part)
    parts = [json.loads((part_dir(out, i, 2) / "part.json").read_text())["counts"] for i in range(2)]
    assert parts[0] == parts[1] and parts[0]["input_rows"] == len(shards[1]) // 2 + 5  # a shard each
    merged = _prepare(f"{folder}/{{00000..00001}}.tar", out, minilm_dir, merge=True)
    assert (
        merged["input_fingerprint"] == json.loads((prepared_wds / "prepare.json").read_text())["input_fingerprint"]
    )
    for name in ("train.jsonl", "val.jsonl", "rejected.jsonl", "labels.json", "wds/train.rows.npy"):
        assert (out / name).read_bytes() == (prepared_wds / name).read_bytes(), name


def test_no_usable_sample_names_shard_and_key(tmp_path, minilm_dir, capsys):
    folder = tmp_path / "bad"
    folder.mkdir()
    with wds.TarWriter(str(folder / "a.tar")) as w:
        w.write({"__key__": "k1", "jpg": b"not a jpeg", "txt": "x", "cls": "1"})
        w.write({"__key__": "k2", "txt": "y", "cls": "1"})
    rc = prepare_data.main([str(folder / "a.tar"), "--out", str(tmp_path / "out"), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2
    assert f"{folder / 'a.tar'}:1: not an image (unrecognised content): k1.jpg (sample k1)" in err
    assert f"{folder / 'a.tar'}:2: no image member" in err and "(sample k2)" in err
    assert failure_report_path(tmp_path / "out").is_file()
    with pytest.raises(ManifestError, match="no WebDataset shards"):
        _prepare(f"{folder}/{{x,y}}*.tar", tmp_path / "o2", minilm_dir)


@pytest.mark.slow
@pytest.mark.parametrize("given", ["prepared", "pattern"])
def test_train_from_img2dataset_shards(tmp_path, prepared_wds, shards, given):
    """tools/train.py from the prepared shards, or from the raw shard pattern (prepared on the fly)."""
    run = tmp_path / "run"
    data = str(prepared_wds) if given == "prepared" else f"{shards[0]}/{{00000..00001}}.tar"
    argv = ["--data", data, "--out", str(run), *SMALL_RUN, "--batch-size", "4", "--max-steps", "2"]
    assert train_tool.main(argv) == 0
    assert json.loads((run / "summary.json").read_text())["model"]
    if given == "pattern":
        assert json.loads((run / "prepared" / "prepare.json").read_text())["input_kind"] == "wds"


# -- mmfast's own export ---------------------------------------------------------------------------------


@pytest.fixture()
def exported(tmp_path, photos_manifest) -> tuple[Path, Path]:
    out = tmp_path / "prepared"
    argv = [str(photos_manifest), "--out", str(out), "--no-progress", "--format", "wds", "--shard-size", "5"]
    assert prepare_data.main(argv) == 0
    return photos_manifest, out


@pytest.fixture()
def photos_manifest(tmp_path) -> Path:
    from tools.benchmarks.benchlib.data import photo_manifest

    return photo_manifest(tmp_path / "src", n=16, width=64, height=48, seed=2)


def test_export_is_standard_webdataset(exported):
    """Read back with the webdataset library: per sample the original image bytes, the caption, the class
    id and a json naming the label and the original path; the export is recorded in prepare.json."""
    _, out = exported
    labels = {v: k for k, v in json.loads((out / "labels.json").read_text()).items()}
    summary = json.loads((out / "prepare.json").read_text())
    assert summary["config"]["format"] == "wds" and "wds/train.json" in summary["files"]
    for split in ("train", "val"):
        rows = {r["id"]: r for r in map(json.loads, open(out / f"{split}.jsonl"))}
        shards = [str(out / "wds" / t) for t in json.loads((out / "wds" / f"{split}.json").read_text())["tars"]]
        seen = []
        for s in wds.WebDataset(shards, shardshuffle=False):
            meta = json.loads(s["json"])
            r = rows[meta["id"]]
            assert s["__key__"] == f"{r['id']:09d}"
            assert s["jpg"] == Path(r["image"]).read_bytes()
            assert s["txt"].decode() == r["text"] and int(s["cls"]) == r["label"] == meta["label"]
            assert meta["label_name"] == labels[r["label"]] and meta["image"] == r["image"]
            seen.append(meta["id"])
        assert sorted(seen) == sorted(rows)


def test_export_trains_with_the_originals_moved_away(exported, tmp_path, monkeypatch):
    """--source wds reads only the shards: with the original images moved, every sample of the split comes
    with its own label and caption (and a step of training runs, in the slow lane)."""
    manifest, out = exported
    shutil.move(manifest.parent, tmp_path / "moved")
    stats = []
    real_stat = os.stat
    monkeypatch.setattr(os, "stat", lambda p, *a, **k: stats.append(str(p)) or real_stat(p, *a, **k))
    loader = MultimodalLoader(out, "val", batch_size=4, size=32, source="wds", train=False)
    monkeypatch.undo()
    assert not [p for p in stats if str(manifest.parent) in p]  # no original was stat'ed
    rows = {r["id"]: r for r in map(json.loads, open(out / "val.jsonl"))}
    tok = load_tokenizer(out / "tokenizer")
    seen = []
    for batch in loader:
        for i, sid in enumerate(batch["id"].tolist()):
            if sid >= 0:
                assert int(batch["label"][i]) == rows[sid]["label"]
                ids = batch["input_ids"][i][batch["attention_mask"][i].bool()].tolist()
                assert ids == tok(rows[sid]["text"], truncation=True, max_length=64)["input_ids"]
                seen.append(sid)
    assert sorted(seen) == sorted(rows)
    # the files source has nothing to read: found at start-up when asked, else when DALI fails on the files
    # (and says where else they are: the shards)
    with pytest.raises(ValueError, match="every image is missing.* hold them: pass source='wds'"):
        MultimodalLoader(out, "val", batch_size=4, size=32, verify_files=True)
    with pytest.raises(ValueError, match="every image is missing.* hold them: pass source='wds'"):
        next(iter(MultimodalLoader(out, "val", batch_size=4, size=32)))


def test_prepared_dataset_gives_each_split_as_arrays_and_its_source(exported, prepared_wds):
    """``PreparedDataset.table``: a split's ids and labels as arrays (from wds/<split>.rows.npy when no path is
    needed, else from the rows, with their image paths); ``loading.sources.prepared_source``: the source a loader
    reads, by name,
    and always the shards for a dataset prepared from them."""
    from mmfast.data.dataset import PreparedDataset, wds_split
    from mmfast.loading.sources import prepared_source

    _, out = exported
    dataset = PreparedDataset(out)
    rows = dataset.rows("val")
    arrays, full = dataset.table("val", images=False), dataset.table("val")
    assert arrays.images is None and full.images == [r["image"] for r in rows]
    for table in (arrays, full):
        assert table.ids.dtype == np.int64 and table.ids.tolist() == [r["id"] for r in rows]
        assert table.labels.tolist() == [r["label"] for r in rows]
    assert full.file_stats == [(r["size"], r["mtime_ns"]) for r in rows]
    files, shards = prepared_source(dataset, "val", "files"), prepared_source(dataset, "val", "wds")
    assert (files.name, files.needs_paths, shards.name, shards.needs_paths) == ("files", True, "wds", False)
    assert (shards.tars, shards.index) == wds_split(out, "val")
    with pytest.raises(ValueError, match="unknown source 'tfrecord'; choose from 'files', 'wds'"):
        prepared_source(dataset, "val", "tfrecord")
    assert prepared_source(dataset, "val").name == "files"  # by default
    from_shards = PreparedDataset(prepared_wds)  # its images are in the shards only
    assert prepared_source(from_shards, "train").name == "wds"
    assert prepared_source(from_shards, "train", "files").name == "wds"
    assert dataset.version >= 2 and dataset.vocab_size == len(load_tokenizer(out / "tokenizer"))
    assert dataset.vocab_size == dataset.summary["vocab_size"]


@pytest.mark.slow
def test_train_tool_source_wds_without_the_originals(exported, tmp_path):
    manifest, out = exported
    shutil.move(manifest.parent, tmp_path / "moved")
    run = tmp_path / "run"
    argv = ["--data", str(out), "--source", "wds", "--out", str(run), *SMALL_RUN, "--batch-size", "4"]
    assert train_tool.main([*argv, "--max-steps", "2"]) == 0
    assert json.loads((run / "summary.json").read_text())["model"]


def test_train_tool_names_the_shards_once_the_originals_are_gone(exported, tmp_path, capsys, caplog):
    """A dataset exported with --format wds whose original images are gone: the run stops with the count, ten
    names (not one line per image) and the flag that reads the shards, which then trains. The default does not
    switch by itself: a run's source is its setting, the same on every process and on resume."""
    manifest, out = exported
    shutil.move(manifest.parent, tmp_path / "moved")
    argv = ["--data", str(out), *SMALL_RUN, "--batch-size", "4", "--max-steps", "1", "--epochs", "1"]
    assert train_tool.main([*argv, "--out", str(tmp_path / "files")]) == 2
    said = capsys.readouterr()
    named = [r.getMessage() for r in caplog.records if r.getMessage().startswith("skipping ")]
    assert len(named) == 11 and named[-1].startswith("skipping more missing or undecodable images without naming")
    count = len(_train_rows(out))
    assert said.err.splitlines()[-1].startswith(f"error: every image is missing or undecodable ({count} of them")
    assert said.err.splitlines()[-1].endswith(
        "the dataset's WebDataset shards hold them: pass --source wds; nothing to load"
    )
    run = tmp_path / "run"
    assert train_tool.main([*argv, "--out", str(run), "--source", "wds"]) == 0
    streamed = (
        "streamed (read by the wds source, which orders its reads itself; only image files are held decoded)"
    )
    assert json.loads((run / "summary.json").read_text())["images"] == f"train {streamed}; val {streamed}"


def test_train_tool_says_a_dataset_prepared_from_shards_is_read_from_them(prepared_wds, tmp_path, capsys):
    """A dataset prepared from WebDataset shards has no image files: the default (files) reads its shards, and
    one line at the start says so."""
    argv = ["--data", str(prepared_wds), "--out", str(tmp_path / "run"), *SMALL_RUN, "--batch-size", "2"]
    assert train_tool.main(argv) == 0
    assert capsys.readouterr().out.splitlines()[0] == (
        f"train and val images: read from the WebDataset shards {prepared_wds} was prepared from (it has no image "
        "files)"
    )


def _train_rows(out: Path) -> list[dict]:
    """The train split's rows of a prepared directory."""
    return [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]


def test_a_changed_export_shard_is_refused(exported):
    _, out = exported
    tar = out / "wds" / "val-00000.tar"
    with open(tar, "ab") as f:  # appended bytes: the index would still point at the old members
        f.write(b"\0" * 512)
    with pytest.raises(ValueError, match="val-00000.tar: changed since preparation"):
        MultimodalLoader(out, "val", batch_size=2, source="wds")
