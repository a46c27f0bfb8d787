"""The data users already have, read as it comes: HF imagefolder metadata, a headerless CC3M-style TSV and
mapped columns, COCO captions JSON, Parquet / save_to_disk written by ``datasets`` itself; and a failed
preparation that says why. Each input is built from real photos and checked per sample after preparation:
the image (its bytes), the caption (text and token cache) and the label are those of the same input row."""

from __future__ import annotations

import csv
import hashlib
import json
import logging
import re
import shutil
from datetime import date
from pathlib import Path

import pytest
from conftest import PHOTOS_SET_N, SMALL_RUN

from mmfast.data.dataset import PreparedDataset
from mmfast.data.token_cache import TokenCache
from mmfast.data.tokenizer import load_tokenizer
from mmfast.inputs import InputOptions, read_source
from mmfast.inputs.manifest import NO_LABEL, ManifestError
from mmfast.prepare.core import PrepareConfig, failure_report_path, prepare_dataset
from tools import prepare_data
from tools import train as train_tool

N = PHOTOS_SET_N  # photos per input (conftest.photos_set): a train and a val split of every class


def _copy_images(rows: list[dict], folder: Path, by_label: bool = False) -> list[str]:
    """Copy the photos into ``folder`` (in class sub-folders when ``by_label``); their relative names."""
    names = []
    for r in rows:
        rel = f"{r['label']}/{r['path'].name}" if by_label else r["path"].name
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(r["path"], folder / rel)
        names.append(rel)
    return names


def _prepare(source: Path, out: Path, **inputs) -> dict:
    cfg = PrepareConfig(
        source=str(source), out=str(out), progress=False, workers=1, max_length=24, inputs=InputOptions(**inputs)
    )
    return prepare_dataset(cfg)


def _assert_joined(out: Path, rows: list[dict], label_of=lambda r: r["label"]) -> None:
    """Every input row is one prepared sample whose image bytes, caption (and its cached tokens) and label
    are the row's own."""
    ds = PreparedDataset(out)
    names = {i: name for name, i in ds.labels.items()}
    tok = load_tokenizer(out / "tokenizer")
    want = {r["text"]: r for r in rows}
    seen = []
    for split in ("train", "val"):
        cache = TokenCache(ds.tokens_dir, split)
        for s in ds.rows(split):
            r = want[s["text"]]
            assert hashlib.sha256(Path(s["image"]).read_bytes()).hexdigest() == r["sha"], s
            assert names[s["label"]] == label_of(r), s
            ids = cache.gather([s["id"]])["input_ids"][0].tolist()
            assert ids == tok(s["text"], truncation=True, max_length=24)["input_ids"], s
            seen.append(s["text"])
    assert sorted(seen) == sorted(want)


# -- 1. a preparation with no usable row says why ---------------------------------------------------------
def test_no_usable_rows_prints_the_first_reasons_and_keeps_every_one(tmp_path, capsys, photos_set):
    folder = tmp_path / "hf"
    folder.mkdir()
    rows = [{"file_name": f"missing{i}.jpg", "text": f"caption {i}", "label": "a"} for i in range(13)]
    (folder / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    assert prepare_data.main(["--source", str(folder), "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "no usable rows out of 13" in err
    for i in range(3):  # one reason for every row: the first three with their file and line, then a count
        assert f"{folder / 'metadata.jsonl'}:{i + 1}: missing file" in err
    assert "metadata.jsonl:4:" not in err and "... and 10 more (missing file (10))" in err
    assert f"every image is missing: relative paths are read from {folder}" in err
    report = failure_report_path(out)
    assert report == tmp_path / "out.rejected.jsonl" and str(report) in err
    kept = [json.loads(ln) for ln in report.read_text().splitlines()]
    assert [(r["file"], r["line"], r["row"]["file_name"]) for r in kept] == [
        ("metadata.jsonl", i + 1, f"missing{i}.jpg") for i in range(13)
    ]
    assert not out.exists() and {p.name for p in tmp_path.iterdir()} == {"hf", "out.rejected.jsonl"}

    # Fixed: the preparation succeeds and the stale report goes; a file of that name that is not mmfast's stays.
    _copy_images(photos_set[:4], folder)
    fixed = [{"file_name": r["path"].name, "text": r["text"], "label": r["label"]} for r in photos_set[:4]]
    (folder / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in fixed))
    assert prepare_data.main(["--source", str(folder), "--out", str(out), "--no-progress"]) == 0
    assert not report.exists() and (out / "prepare.json").is_file()
    other = tmp_path / "o2"
    failure_report_path(other).write_text("my notes\n")
    (folder / "metadata.jsonl").write_text(json.dumps(rows[0]) + "\n")
    assert prepare_data.main([str(folder), "--out", str(other), "--no-progress"]) == 2
    assert "not written to" in capsys.readouterr().err
    assert failure_report_path(other).read_text() == "my notes\n"
    failure_report_path(other).write_text("")  # nor an empty one
    (folder / "metadata.jsonl").write_text(json.dumps(fixed[0]) + "\n")
    assert prepare_data.main([str(folder), "--out", str(other), "--no-progress", "--val-fraction", "0"]) == 0
    assert failure_report_path(other).read_text() == ""
    (folder / "metadata.jsonl").write_text("")
    assert prepare_data.main([str(folder), "--out", str(tmp_path / "o3"), "--no-progress"]) == 2
    assert "no rows to prepare (the input is empty)" in capsys.readouterr().err
    assert not failure_report_path(tmp_path / "o3").exists()


# -- 2. Hugging Face imagefolder metadata ------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["jsonl-root", "csv-splits"])
def test_hf_imagefolder_metadata(tmp_path, photos_set, layout):
    folder = tmp_path / "hf"
    if layout == "jsonl-root":  # metadata.jsonl with file_name, caption, label beside class folders
        names = _copy_images(photos_set, folder, by_label=True)
        meta = [
            {"file_name": n, "caption": r["text"], "label": r["label"], "extra": 1}
            for n, r in zip(names, photos_set, strict=True)
        ]
        meta.append({"file_name": "nope.jpg", "caption": "gone", "label": "x"})
        (folder / "metadata.jsonl").write_text("".join(json.dumps(m) + "\n" for m in meta))
        sources = [folder, folder / "metadata.jsonl"]
    else:  # one metadata.csv per split folder, HF's train/ + test/ layout
        half = len(photos_set) // 2
        for split, part in (("train", photos_set[:half]), ("test", photos_set[half:])):
            names = _copy_images(part, folder / split)
            with open(folder / split / "metadata.csv", "w", newline="") as f:
                w = csv.writer(f)
                w.writerow(["file_name", "text", "label"])
                w.writerows([n, r["text"], r["label"]] for n, r in zip(names, part, strict=True))
        sources = [folder, folder / "test"]  # the folder: its train split; test/ prepares on its own
        _assert_hf_reads_the_same(folder, tmp_path / "hf-cache", photos_set)
    for i, src in enumerate(sources):
        cands, rejects, kind = read_source(src)
        want = photos_set if layout == "jsonl-root" else (photos_set[:half], photos_set[half:])[i]
        assert kind == "imagefolder" and not rejects  # nope.jpg is found missing when images are checked
        assert len(cands) == len(want) + (layout == "jsonl-root")
        summary = _prepare(src, tmp_path / f"out{i}")
        assert summary["input_kind"] == "imagefolder" and summary["counts"]["accepted"] == len(want)
        _assert_joined(tmp_path / f"out{i}", want)
        if layout == "jsonl-root":
            (rej,) = [json.loads(ln) for ln in (tmp_path / f"out{i}" / "rejected.jsonl").read_text().splitlines()]
            assert (
                rej["line"] == N + 1
                and rej["reason"].startswith("missing file: ")
                and rej["file"] == "metadata.jsonl"
            )


def _assert_hf_reads_the_same(folder: Path, cache: Path, rows: list[dict]) -> None:
    """datasets' own imagefolder reader joins each caption to the same pixels and label as the input rows
    (so the input is the ecosystem's format, not only mmfast's idea of it)."""
    datasets = pytest.importorskip("datasets")
    dd = datasets.load_dataset("imagefolder", data_dir=str(folder), cache_dir=str(cache))
    want = {r["text"]: (_pixels(r["path"]), r["label"]) for r in rows}
    got = {s["text"]: (_pixels(s["image"]), s["label"]) for split in dd.values() for s in split}
    assert got == want


def _pixels(image) -> str:
    from PIL import Image

    im = image if isinstance(image, Image.Image) else Image.open(image)
    return hashlib.sha256(im.convert("RGB").tobytes()).hexdigest()


def test_imagefolder_labels_from_class_folders_when_no_label_column(tmp_path, photos_set):
    folder = tmp_path / "hf"
    names = _copy_images(photos_set, folder, by_label=True)  # <label>/<image>
    meta = [{"file_name": n, "text": r["text"]} for n, r in zip(names, photos_set, strict=True)]
    (folder / "metadata.jsonl").write_text("".join(json.dumps(m) + "\n" for m in meta))
    _prepare(folder, tmp_path / "out")
    _assert_joined(tmp_path / "out", photos_set)
    shutil.move(folder / names[0], folder / photos_set[0]["path"].name)  # one image beside the metadata
    meta[0]["file_name"] = photos_set[0]["path"].name
    (folder / "metadata.jsonl").write_text("".join(json.dumps(m) + "\n" for m in meta))
    with pytest.raises(ManifestError, match=r"no label column among \['file_name', 'text'\]; pass --label-column"):
        read_source(folder)


def test_imagefolder_without_a_caption_column_names_the_flag(tmp_path, photos_set):
    folder = tmp_path / "hf"
    _copy_images(photos_set[:1], folder)
    (folder / "metadata.jsonl").write_text(
        json.dumps({"file_name": photos_set[0]["path"].name, "what": "x"}) + "\n"
    )
    with pytest.raises(ManifestError, match=r"no text column among \['file_name', 'what'\]; pass --text-column"):
        read_source(folder)
    cands, _, _ = read_source(folder, InputOptions(text_column="what", no_labels=True))
    assert [(c.text, c.label) for c in cands] == [("x", NO_LABEL)]


# -- 3. column mapping and a headerless CC3M-style TSV ----------------------------------------------------
@pytest.mark.parametrize("sep", ["\t", ","])
def test_open_clip_train_csv_is_read_as_open_clip_writes_it(tmp_path, photos_set, sep, caplog):
    """open_clip's trainer reads train.csv with columns filepath and title, tab-separated by default: the same
    file prepares as it is, with no --image-column, --text-column or --csv-separator to pass."""
    names = _copy_images(photos_set, tmp_path / "imgs")
    table = tmp_path / "train.csv"
    rows = [f"imgs/{n}{sep}{r['text']}" for n, r in zip(names, photos_set, strict=True)]
    table.write_text("\n".join([f"filepath{sep}title", *rows]) + "\n")
    with caplog.at_level("INFO"):
        cands, rejects, _ = read_source(table, InputOptions(no_labels=True))
    assert not rejects
    assert (
        "train.csv: no 'text' field; the captions read from 'title' (--text-column chooses another)" in caplog.text
    )
    assert "train.csv: no 'image' field; the images read from 'filepath'" in caplog.text
    want = [(n, r["text"]) for n, r in zip(names, photos_set, strict=True)]
    assert [(Path(c.image).name, c.text) for c in cands] == want
    with pytest.raises(ManifestError, match="no column 'image'|lacks"):  # a named column is still required
        read_source(table, InputOptions(no_labels=True, image_column="image", text_column="caption"))


def test_a_jsonl_with_other_field_names_is_read_by_them_and_says_so(tmp_path, photos_set, caplog):
    """A JSONL manifest with ``filepath`` / ``caption`` / ``category`` (as Hugging Face and open_clip users name
    them) prepares without --*-column flags, as Parquet does, and says which field it read; a field the rows
    have under the default name wins, and a named column is never replaced."""
    names = _copy_images(photos_set, tmp_path / "imgs")
    rows = [
        {"filepath": f"imgs/{n}", "caption": r["text"], "category": r["label"], "title": "not the caption"}
        for n, r in zip(names, photos_set, strict=True)
    ]
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with caplog.at_level("INFO"):
        _prepare(manifest, tmp_path / "out")
    _assert_joined(tmp_path / "out", photos_set)
    said = caplog.text
    assert "m.jsonl: no 'text' field; the captions read from 'caption' (--text-column chooses another)" in said
    assert "the images read from 'filepath'" in said and "the labels read from 'category'" in said
    cands, _, _ = read_source(manifest, InputOptions(text_column="title"))  # named: not second-guessed
    assert {c.text for c in cands} == {"not the caption"} and len(cands) == N
    # a named field no row has, or an image no row has under any usual name: one error with the rows' fields
    fields = "['caption', 'category', 'filepath', 'title']"
    with pytest.raises(
        ManifestError, match=re.escape(f"no row has the field 'captoin' (--text-column); the rows have {fields}")
    ):
        read_source(manifest, InputOptions(text_column="captoin"))
    pictures = tmp_path / "pictures.jsonl"
    pictures.write_text("".join(json.dumps({"picture": r["filepath"], "text": r["caption"]}) + "\n" for r in rows))
    with pytest.raises(
        ManifestError, match=r"no row has the field 'image' or another usual image field \(filepath"
    ):
        read_source(pictures, InputOptions(no_labels=True))
    both = [dict(r, text=f"the default field {k}") for k, r in enumerate(rows)]
    manifest.write_text("".join(json.dumps(r) + "\n" for r in both))
    cands, _, _ = read_source(manifest)
    assert sorted(c.text for c in cands) == sorted(r["text"] for r in both)
    # a field only some rows have, or a list of labels, is no column: the rows read as before, without labels
    some = [
        dict(r) if k % 3 == 0 else {k2: v for k2, v in r.items() if k2 != "category"} for k, r in enumerate(rows)
    ]
    listed = [dict(r, category=[r["category"]]) for r in rows]
    for variant in (some, listed):
        manifest.write_text("".join(json.dumps(r) + "\n" for r in variant))
        cands, rejects, _ = read_source(manifest)
        assert not cands and {r.reason for r in rejects} == {"missing field 'label'"}
        cands, rejects, _ = read_source(manifest, InputOptions(no_labels=True))
        assert len(cands) == N and not rejects


def test_a_csv_with_usual_names_is_read_by_them_with_or_without_a_header(tmp_path, photos_set, caplog):
    """A CSV whose header is ``filepath,caption,category``, and a headerless one named by ``--columns
    caption,filepath``, read as the JSONL above does: the usual names found, and said; unknown names still
    refused with the columns they lack."""
    names = _copy_images(photos_set, tmp_path / "imgs")
    pairs = list(zip(names, photos_set, strict=True))
    table = tmp_path / "t.csv"
    table.write_text(
        "filepath,caption,category\n" + "".join(f"imgs/{n},{r['text']},{r['label']}\n" for n, r in pairs)
    )
    with caplog.at_level("INFO"):
        cands, rejects, _ = read_source(table)
    assert not rejects and "t.csv: no 'text' field; the captions read from 'caption'" in caplog.text
    assert [(Path(c.image).name, c.text, c.label) for c in cands] == [(n, r["text"], r["label"]) for n, r in pairs]
    bare = tmp_path / "bare.csv"
    bare.write_text("".join(f"{r['text']},imgs/{n}\n" for n, r in pairs))
    cands, rejects, _ = read_source(bare, InputOptions(no_labels=True, columns=("caption", "filepath")))
    assert not rejects and [(Path(c.image).name, c.text) for c in cands] == [(n, r["text"]) for n, r in pairs]
    short = tmp_path / "short.csv"  # a short row is rejected on its own: the header still names the columns
    short.write_text(table.read_text() + f"imgs/{pairs[0][0]}\n")
    cands, rejects, _ = read_source(short)
    assert len(cands) == len(pairs) and [r.reason for r in rejects] == ["missing field 'caption'"]
    with pytest.raises(ManifestError, match=r"--columns cap,fp lacks \['image', 'text'\]"):
        read_source(bare, InputOptions(no_labels=True, columns=("cap", "fp")))


def test_headerless_tsv_and_mapped_columns(tmp_path, photos_set, capsys):
    names = _copy_images(photos_set, tmp_path / "imgs")
    tsv = tmp_path / "cc3m.tsv"
    # CC3M: caption<TAB>path, no header, quotes are plain characters of a caption
    lines = [f'{r["text"]} "quoted\t{"imgs/" + n}' for n, r in zip(names, photos_set, strict=True)]
    tsv.write_text("\n".join(lines) + "\nonly a caption\n")
    rows = [dict(r, text=r["text"] + ' "quoted') for r in photos_set]
    with pytest.raises(ManifestError, match="lacks"):
        read_source(tsv)
    out = tmp_path / "out"
    argv = [str(tsv), "--out", str(out), "--columns", "text,image", "--no-labels", "--no-progress"]
    assert prepare_data.main([*argv, "--max-length", "24", "--workers", "1"]) == 0
    said = capsys.readouterr().out
    assert "note: no labels (--no-labels): for a contrastive model" in said and "one class only" not in said
    _assert_joined(out, rows, label_of=lambda r: NO_LABEL)
    (rej,) = [json.loads(ln) for ln in (out / "rejected.jsonl").read_text().splitlines()]
    assert rej["line"] == N + 1 and rej["reason"] == "missing field 'image'"

    # A CSV with its own column names, mapped with --image-column/--text-column/--label-column
    with open(tmp_path / "m.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["caption", "url", "kind"])
        w.writerows([r["text"], "imgs/" + n, r["label"]] for n, r in zip(names, photos_set, strict=True))
    _prepare(tmp_path / "m.csv", tmp_path / "out2", image_column="url", text_column="caption", label_column="kind")
    _assert_joined(tmp_path / "out2", photos_set)
    # --input-kind names the format of a file whose suffix does not
    (tmp_path / "pairs.txt").write_text(
        "".join(f"{r['text']},imgs/{n}\n" for n, r in zip(names, photos_set, strict=True))
    )
    opts = InputOptions(kind="csv", columns=("text", "image"), no_labels=True)
    cands, rejects, kind = read_source(tmp_path / "pairs.txt", opts)
    assert kind == "csv" and not rejects and [c.text for c in cands] == [r["text"] for r in photos_set]
    with pytest.raises(ManifestError, match=r"--columns text lacks \['image'\]"):
        read_source(tsv, InputOptions(columns=("text",), no_labels=True))


# -- 4. COCO captions -------------------------------------------------------------------------------------
def test_coco_captions(tmp_path, photos_set):
    root = tmp_path / "val2017"
    names = _copy_images(photos_set, root)
    cats = sorted({r["label"] for r in photos_set})
    images = [{"id": 100 + i, "file_name": n, "width": 64, "height": 48} for i, n in enumerate(names)]
    anns, k = [], 1
    for i, r in enumerate(photos_set):  # two captions per image, the first one is the row's own
        for cap in (r["text"], r["text"] + " again"):
            anns.append({"id": k, "image_id": 100 + i, "caption": cap, "category_id": cats.index(r["label"]) + 1})
            k += 1
    anns.append({"id": k, "image_id": 999, "caption": "no such image", "category_id": 1})
    coco = {
        "info": {},
        "images": images,
        "annotations": anns,
        "categories": [{"id": i + 1, "name": c} for i, c in enumerate(cats)],
    }
    ann_dir = tmp_path / "annotations"
    ann_dir.mkdir()
    (ann_dir / "captions_val2017.json").write_text(json.dumps(coco))
    src = ann_dir / "captions_val2017.json"
    with pytest.raises(ManifestError, match="--label-column FIELD"):
        read_source(src)
    opts = {"image_root": str(root), "label_column": "category_id"}
    summary = _prepare(src, tmp_path / "all", **opts)  # a row per caption, the category's name as label
    assert summary["input_kind"] == "coco" and summary["counts"]["accepted"] == 2 * N
    again = [dict(r, text=r["text"] + " again") for r in photos_set]
    _assert_joined(tmp_path / "all", photos_set + again)
    (rej,) = [json.loads(ln) for ln in (tmp_path / "all" / "rejected.jsonl").read_text().splitlines()]
    assert rej["line"] == 2 * N + 1 and "image_id 999 is not an id in 'images'" in rej["reason"]

    _prepare(src, tmp_path / "first", coco_captions="first", **opts)  # a row per image
    _assert_joined(tmp_path / "first", photos_set)
    _prepare(src, tmp_path / "nolabel", coco_captions="first", image_root=str(root), no_labels=True)
    _assert_joined(tmp_path / "nolabel", photos_set, label_of=lambda r: NO_LABEL)
    shutil.rmtree(root)  # every image gone: the error names each row by its annotation, not a line of the JSON
    with pytest.raises(ManifestError, match=r"captions_val2017\.json, annotation 1: missing file"):
        _prepare(src, tmp_path / "gone", **opts)


# -- 5. Parquet and save_to_disk, written by datasets -----------------------------------------------------
def _hf_dataset(rows: list[dict], embed: bool):
    datasets = pytest.importorskip("datasets")
    names = sorted({r["label"] for r in rows})[::-1]  # ClassLabel order is not the sorted order
    features = datasets.Features(
        image=datasets.Image(), caption=datasets.Value("string"), label=datasets.ClassLabel(names=names)
    )
    images = [{"bytes": r["path"].read_bytes(), "path": r["path"].name} if embed else str(r["path"]) for r in rows]
    data = {
        "image": images,
        "caption": [r["text"] for r in rows],
        "label": [names.index(r["label"]) for r in rows],
    }
    return datasets.Dataset.from_dict(data, features=features)


def test_parquet_with_image_bytes_and_classlabel_names(tmp_path, photos_set):
    pq = pytest.importorskip("pyarrow.parquet")
    ds = _hf_dataset(photos_set, embed=True)
    data = tmp_path / "data"
    data.mkdir()
    ds.select(range(N // 2)).to_parquet(data / "train-00000-of-00002.parquet")
    ds.select(range(N // 2, N)).to_parquet(data / "train-00001-of-00002.parquet")
    held_out = [{**r, "text": f"held out: {r['text']}"} for r in photos_set[:2]]
    _hf_dataset(held_out, embed=True).to_parquet(data / "test-00000-of-00001.parquet")  # left out: not counted
    named = tmp_path / "val"  # a folder named like a split: its own files are not that split
    named.mkdir()
    _hf_dataset(held_out, embed=True).to_parquet(named / "extra.parquet")
    _hf_dataset(photos_set[2:4], embed=True).to_parquet(named / "train.parquet")
    assert len(read_source(named, image_dir=tmp_path / "img")[0]) == 4
    assert b"huggingface" in pq.ParquetFile(data / "train-00000-of-00002.parquet").schema_arrow.metadata
    summary = _prepare(data, tmp_path / "out")
    assert summary["input_kind"] == "parquet" and summary["counts"]["accepted"] == N
    _assert_joined(tmp_path / "out", photos_set)
    for s in PreparedDataset(tmp_path / "out").rows("train"):  # the images live in the prepared directory
        assert Path(s["image"]).parent.parent == (tmp_path / "out" / "images").resolve()
    assert not list(tmp_path.glob(".out.*.tmp"))  # no temp directory left
    stamp = (tmp_path / "out" / "train.jsonl").stat().st_mtime_ns
    assert _prepare(data, tmp_path / "out") == summary  # unchanged input: reused, images and all
    assert (tmp_path / "out" / "train.jsonl").stat().st_mtime_ns == stamp
    _assert_joined(tmp_path / "out", photos_set)
    from mmfast.prepare.wds_export import write_wds  # the WebDataset export reads the written-out images

    assert write_wds(tmp_path / "out")["train"]["samples"] == summary["counts"]["train"]


def test_img2dataset_metadata_given_as_input_points_to_its_shards(tmp_path):
    """img2dataset writes NNNNN.parquet beside each NNNNN.tar: its url, key, status and caption, no picture.
    Given alone, the refusal lists its columns and says where the pictures are."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    columns = {"url": ["https://example.com/a.jpg"], "caption": ["a cat"], "key": ["000000000"]}
    columns |= {"status": ["success"], "error_message": [None], "width": [256], "height": [256]}
    pq.write_table(pa.table(columns), tmp_path / "00000.parquet")
    with pytest.raises(ManifestError) as e:
        read_source(tmp_path / "00000.parquet", InputOptions(no_labels=True))
    assert "no image column among ['url', 'caption', 'key', 'status'" in str(e.value)
    assert "img2dataset's metadata, whose pictures are in the .tar shard of the same name" in str(e.value)


def test_a_table_without_captions_is_read_where_no_caption_is_needed(tmp_path, photos_set):
    """Zero-shot and image embeddings read no caption: a Parquet table of images and labels is read for them,
    each text "", and refused for anything else."""
    _hf_dataset(photos_set, embed=True).remove_columns("caption").to_parquet(tmp_path / "t.parquet")
    with pytest.raises(ManifestError, match="no text column among"):
        read_source(tmp_path / "t.parquet", image_dir=tmp_path / "img")
    cands, rejects, _ = read_source(
        tmp_path / "t.parquet", InputOptions(captions_needed=False), image_dir=tmp_path / "i"
    )
    assert not rejects and len(cands) == N and {c.text for c in cands} == {""}


def test_parquet_rows_of_one_picture_share_its_file_and_an_exact_repeat_is_a_duplicate(tmp_path, photos_set):
    rows = [photos_set[0], photos_set[0], {**photos_set[0], "text": "the same picture, another caption"}]
    rows += photos_set[1:]
    _hf_dataset(rows, embed=True).to_parquet(tmp_path / "t.parquet")
    summary = _prepare(tmp_path / "t.parquet", tmp_path / "out")
    assert summary["counts"]["accepted"] == N + 1  # the repeat of row 1 is rejected, the other caption kept
    (rej,) = [json.loads(ln) for ln in (tmp_path / "out" / "rejected.jsonl").read_text().splitlines()]
    assert rej["line"] == 2 and rej["reason"] == "duplicate of line 1"
    ds = PreparedDataset(tmp_path / "out")
    where = {s["text"]: (split, s["image"]) for split in ("train", "val") for s in ds.rows(split)}
    first, other = where[photos_set[0]["text"]], where["the same picture, another caption"]
    assert first == other  # one file for the picture, both rows on the same side of the split
    assert len([p for p in (tmp_path / "out" / "images").rglob("*") if p.is_file()]) == N


def test_parquet_bad_rows_are_rejected_with_file_and_row(tmp_path, photos_set):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    good = photos_set[0]["path"].read_bytes()
    image = [
        {"bytes": good, "path": "a.jpg"},
        {"bytes": b"not an image", "path": "b.jpg"},
        {"bytes": None, "path": None},
        {"bytes": photos_set[1]["path"].read_bytes(), "path": None},
        {"bytes": good[: len(good) // 2], "path": "cut.jpg"},
    ]
    table = pa.table(
        {
            "image": image,
            "text": ["fine", "text", "nothing", "", "cut"],
            "label": [0, 1, 0, 1, -1],
            "n": [date(2020, 1, 2)] * 5,
        },
        metadata={
            "huggingface": json.dumps(
                {"info": {"features": {"label": {"_type": "ClassLabel", "names": ["x", "y"]}}}}
            )
        },
    )
    pq.write_table(table, tmp_path / "t.parquet")
    _prepare(tmp_path / "t.parquet", tmp_path / "out")
    rej = {r["line"]: r for r in map(json.loads, (tmp_path / "out" / "rejected.jsonl").read_text().splitlines())}
    assert sorted(rej) == [2, 3, 4, 5] and all(r["file"] == "t.parquet" for r in rej.values())
    assert "not an image" in rej[2]["reason"] and rej[2]["row"]["image"] == {
        "path": "b.jpg",
        "bytes": "<12 bytes>",
    }
    assert rej[3]["reason"] == "field 'image' has no image bytes or path"
    assert rej[4]["reason"] == "empty text"
    assert rej[5]["reason"] == "field 'label': no label (-1)"
    # A caption column of another type: rejected rows, written to rejected.jsonl as JSON
    with pytest.raises(ManifestError, match=r"t.parquet, row 1: field 'n' must be a string, got date"):
        _prepare(tmp_path / "t.parquet", tmp_path / "out-n", text_column="n", no_labels=True)
    bad = [json.loads(ln) for ln in failure_report_path(tmp_path / "out-n").read_text().splitlines()]
    assert (
        bad[0]["reason"] == "field 'n' must be a string, got date"
        and bad[0]["row"]["n"] == "datetime.date(2020, 1, 2)"
    )
    (row,) = PreparedDataset(tmp_path / "out").rows("train")
    assert row["text"] == "fine" and Path(row["image"]).read_bytes() == good
    # The bytes of rejected rows are not kept: the prepared images are the samples' own.
    kept = [p for p in (tmp_path / "out" / "images").rglob("*") if p.is_file()]
    assert kept == [Path(row["image"])] and kept[0].suffix == ".jpg"


def test_damaged_parquet_and_arrow_files_name_the_file(tmp_path, photos_set):
    ds = _hf_dataset(photos_set[:2], embed=True)
    ds.to_parquet(tmp_path / "t.parquet")
    raw = (tmp_path / "t.parquet").read_bytes()
    (tmp_path / "t.parquet").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(ManifestError, match=r"t.parquet: cannot read the Parquet file"):
        read_source(tmp_path / "t.parquet", image_dir=tmp_path / "img")
    ds.save_to_disk(str(tmp_path / "ds"))
    (arrow,) = (tmp_path / "ds").glob("*.arrow")
    arrow.write_bytes(arrow.read_bytes()[:300])
    with pytest.raises(ManifestError, match=r"\.arrow: cannot read"):
        read_source(tmp_path / "ds", image_dir=tmp_path / "img")


@pytest.mark.parametrize("embed", [True, False], ids=["bytes", "paths"])
def test_save_to_disk_dataset_and_datasetdict(tmp_path, photos_set, embed, caplog):
    """A Dataset folder, one Arrow file, and a DatasetDict: its train split is read, its test split left out
    and named (training on it would leak it), and that split's folder prepares on its own."""
    ds = _hf_dataset(photos_set, embed=embed)
    ds.save_to_disk(str(tmp_path / "ds"))
    summary = _prepare(tmp_path / "ds", tmp_path / "out")
    assert summary["input_kind"] == "arrow"
    _assert_joined(tmp_path / "out", photos_set)
    (arrow,) = (tmp_path / "ds").glob("*.arrow")  # one Arrow file alone: ClassLabel names from its schema
    cands, rejects, kind = read_source(arrow, image_dir=tmp_path / "img")
    assert kind == "arrow" and not rejects
    assert [(c.text, c.label) for c in cands] == [(r["text"], r["label"]) for r in photos_set]

    import datasets

    half = N // 2
    dd = datasets.DatasetDict(train=ds.select(range(half)), test=ds.select(range(half, N)))
    dd.save_to_disk(str(tmp_path / "dd"))
    with caplog.at_level(logging.WARNING, logger="mmfast.inputs.base"):
        _prepare(tmp_path / "dd", tmp_path / "out-dd")
    _assert_joined(tmp_path / "out-dd", photos_set[:half])
    assert f"read its train split; left out its test split (test: {tmp_path / 'dd' / 'test'})" in caplog.text
    _prepare(tmp_path / "dd" / "test", tmp_path / "out-test")
    _assert_joined(tmp_path / "out-test", photos_set[half:])


@pytest.mark.slow
def test_train_from_parquet(tmp_path, photos_set):
    """Prepare a Parquet file (images as bytes) with the tool and train two steps from it."""
    ds = _hf_dataset(photos_set, embed=True)
    ds.to_parquet(tmp_path / "train.parquet")
    out = tmp_path / "prepared"
    assert prepare_data.main([str(tmp_path / "train.parquet"), "--out", str(out), "--no-progress"]) == 0
    run = tmp_path / "run"
    argv = ["--data", str(out), "--out", str(run), *SMALL_RUN, "--batch-size", "4", "--max-steps", "2"]
    assert train_tool.main(argv) == 0
    assert json.loads((run / "summary.json").read_text())["model"]


def test_full_disk_while_writing_parquet_images_leaves_the_previous_directory(tmp_path, photos):
    """The written-out images are part of the prepared directory's atomic swap: a write that fails (here
    over RLIMIT_FSIZE, as on a full disk) exits 2 and leaves the previous directory as it was."""
    import resource
    import subprocess
    import sys

    from conftest import ROOT

    big = max(photos, key=lambda p: p.stat().st_size)  # a photo of hundreds of KB
    rows = [{"path": big, "text": f"big photo {i}", "label": "ab"[i % 2]} for i in range(4)]
    _hf_dataset(rows, embed=True).to_parquet(tmp_path / "t.parquet")
    out = tmp_path / "out"
    base = [
        sys.executable,
        str(ROOT / "tools" / "prepare_data.py"),
        str(tmp_path / "t.parquet"),
        "--out",
        str(out),
    ]
    prepare_dataset(PrepareConfig(source=str(tmp_path / "t.parquet"), out=str(out), seed=1, progress=False))
    before = {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    assert len([p for p in before if p.parent.parent.name == "images"]) == 1  # 4 rows of one picture: one file

    def limit():  # Python ignores SIGXFSZ, so a write over the limit fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (big.stat().st_size // 2,) * 2)

    full = subprocess.run([*base, "--no-progress"], capture_output=True, text=True, cwd=ROOT, preexec_fn=limit)
    assert full.returncode == 2 and "Traceback" not in full.stderr, full.stderr[-2000:]
    last = full.stderr.splitlines()[-1]
    assert (
        last.startswith(f"error: writing the prepared dataset to {out} failed: File too large")
        and "/images/" in last
    )
    assert {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()} == before
    assert not [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")]
