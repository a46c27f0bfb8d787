"""The input-kind seam: a toy kind defined in this file, registered with ``mmfast.inputs.register_reader``, is
read by preparation, by ``--input-kind`` and by prediction, with no change anywhere else; its registration is
undone after each test."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from mmfast.cli import prepare as prepare_cli
from mmfast.cli.input_flags import input_options
from mmfast.data.dataset import PreparedDataset
from mmfast.infer.predict_inputs import read_rows
from mmfast.inputs import READERS, InputOptions, Reader, read_source, register_reader, unregister_reader
from mmfast.inputs.manifest import check_rows
from mmfast.prepare.core import PrepareConfig, prepare_dataset


def _read_tsvx(path: Path, opts: InputOptions, confine: bool, image_dir: Path | None = None):
    """A ".tsvx" file: one row a line, image<TAB>caption<TAB>label, image paths relative to the file."""
    rows = []
    for line, text in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if text.strip():
            image, caption, label = (text.split("\t") + ["", "", ""])[:3]
            rows.append((line, {"image": image, "text": caption, "label": label}))
    return check_rows(rows, path.parent.resolve(), confine, from_csv=True, columns=opts.table_columns())


@pytest.fixture
def tsvx():
    """The toy kind, registered for one test and unregistered after it."""
    reader = register_reader(Reader("tsvx", _read_tsvx, suffixes=(".tsvx",)))
    try:
        yield reader
    finally:
        unregister_reader("tsvx")
        assert "tsvx" not in READERS


@pytest.fixture
def toy_input(photos_set, tmp_path) -> tuple[Path, list[dict]]:
    """A .tsvx input of the real photos of ``photos_set`` (every caption unique), and one row whose image is
    missing; returns (its path, the photos' rows)."""
    folder = tmp_path / "toy"
    folder.mkdir()
    lines = []
    for r in photos_set:
        shutil.copy(r["path"], folder / r["path"].name)
        lines.append(f"{r['path'].name}\t{r['text']}\t{r['label']}")
    lines.append("gone.jpg\ta photo that is not there\tc0")
    source = folder / "pairs.tsvx"
    source.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return source, photos_set


def _prepared_samples(out: Path) -> list[tuple[str, str, str]]:
    """(image file name, caption, original label) of every prepared sample, both splits, by caption."""
    ds = PreparedDataset(out)
    names = {i: name for name, i in ds.labels.items()}
    rows = [r for split in ("train", "val") for r in ds.rows(split)]
    assert sorted(r["id"] for r in rows) == list(range(len(rows)))
    return sorted((Path(r["image"]).name, r["text"], names[r["label"]]) for r in rows)


def test_a_registered_kind_is_prepared_by_its_suffix_and_by_name(tsvx, toy_input, tmp_path):
    source, photos = toy_input
    want = sorted((r["path"].name, r["text"], r["label"]) for r in photos)
    for kind in ("auto", "tsvx"):  # told from the suffix the kind declares, and named
        out = tmp_path / f"out-{kind}"
        summary = prepare_dataset(
            PrepareConfig(
                source=str(source), out=str(out), progress=False, workers=1, inputs=InputOptions(kind=kind)
            )
        )
        assert summary["input_kind"] == "tsvx"
        assert summary["counts"]["input_rows"] == len(photos) + 1 and summary["counts"]["accepted"] == len(photos)
        assert _prepared_samples(out) == want
        assert json.loads((out / "labels.json").read_text()) == {
            label: i for i, label in enumerate(sorted({r["label"] for r in photos}))
        }
        rejected = [json.loads(ln) for ln in (out / "rejected.jsonl").read_text().splitlines()]
        assert [(r["line"], r["reason"]) for r in rejected] == [
            (len(photos) + 1, f"missing file: {source.parent.resolve() / 'gone.jpg'}")
        ]


def test_a_registered_kind_is_read_through_the_input_kind_flag(tsvx, toy_input, tmp_path, capsys):
    source, photos = toy_input
    out = tmp_path / "out"
    argv = [str(source), "--out", str(out), "--input-kind", "tsvx", "--no-progress", "--workers", "1"]
    assert input_options(prepare_cli.parse_args(argv)).kind == "tsvx"
    assert prepare_cli.main(argv) == 0
    assert f"prepared dataset: {out}" in capsys.readouterr().out
    assert _prepared_samples(out) == sorted((r["path"].name, r["text"], r["label"]) for r in photos)


def test_a_registered_kind_is_read_for_prediction(tsvx, toy_input):
    source, photos = toy_input
    folder = source.parent.resolve()
    want = [{"image": str(folder / r["path"].name), "text": r["text"], "label": r["label"]} for r in photos]
    want.append({"image": str(folder / "gone.jpg"), "text": "a photo that is not there", "label": "c0"})
    assert read_rows(source, opts=InputOptions(kind="tsvx")) == want  # images are checked when predicted
    cands, rejects, kind = read_source(source)
    assert kind == "tsvx" and [c.text for c in cands] == [w["text"] for w in want] and rejects == []


def test_an_unregistered_kind_is_unknown(toy_input):
    source, _ = toy_input
    assert "tsvx" not in READERS
    with pytest.raises(ValueError, match="unknown input kind 'tsvx'; choose from auto, jsonl, csv"):
        InputOptions(kind="tsvx")
    with pytest.raises(SystemExit):
        prepare_cli.parse_args([str(source), "--out", "x", "--input-kind", "tsvx"])


def test_a_kind_name_is_registered_once(tsvx):
    with pytest.raises(ValueError, match="input kind 'tsvx' is taken"):
        register_reader(Reader("tsvx", _read_tsvx))
    with pytest.raises(ValueError, match="input kind 'auto' is taken"):
        register_reader(Reader("auto", _read_tsvx))
