"""Fault injection on the preparation side, second set: parts damaged before the merge, a Parquet file with a
zeroed page, COCO files that are not captions files, float labels, and a directory a killed swap left aside.
Each test runs the real command (``mmfast.cli.prepare.main``) or the public API on real files and asserts
the exact outcome: exit 2 with one line naming the file and what to do, or the data as it should be."""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

import pytest
from conftest import save_image, write_jsonl

from mmfast.cli.prepare import main
from mmfast.data.dataset import DatasetError, PreparedDataset
from mmfast.inputs import detect_kind
from mmfast.inputs.manifest import parse_label
from mmfast.prepare.core import failure_report_path
from mmfast.prepare.parts import part_dir
from mmfast.util.fsutil import MARKER, restore_interrupted_swap

FLAGS = ["--max-length", "16", "--vocab-size", "200", "--workers", "1", "--no-progress"]
SPLIT_FILES = ("train.jsonl", "val.jsonl", "rejected.jsonl", "labels.json")


def _images(folder: Path, n: int) -> None:
    for k in range(n):
        save_image(folder / f"{k}.png", size=(16, 12), seed=k)


def _manifest(folder: Path, labels: list, name: str = "m.jsonl") -> Path:
    """A JSONL manifest, a row per label, each with its own tiny image."""
    _images(folder, len(labels))
    rows = [{"image": f"{k}.png", "text": f"a small picture number {k}", "label": v} for k, v in enumerate(labels)]
    return write_jsonl(folder / name, rows)


def _error(capsys) -> str:
    """The command's stderr, which must be one ``error:`` line and no traceback."""
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.startswith("error: ") and err.count("\n") == 1, err
    return err.strip()


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln]


def _split_files(out: Path) -> dict[str, str]:
    return {name: (out / name).read_text() for name in SPLIT_FILES}


# 1. A part damaged after it was made is named, with the command that makes it again.


def _cut_last_row(path: Path) -> None:
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:-1]))


def _cut_mid_line(path: Path) -> None:
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) - 25])


def _relabel(path: Path) -> None:
    rows = _jsonl(path)
    rows[0]["label"] = "b" if rows[0]["label"] == "a" else "a"
    write_jsonl(path, rows)


@pytest.mark.parametrize(
    ("damage", "name"),
    [
        (_cut_last_row, "accepted.jsonl"),
        (_cut_mid_line, "accepted.jsonl"),
        (_relabel, "accepted.jsonl"),
        (_cut_last_row, "rejected.jsonl"),
    ],
    ids=["row-deleted", "cut-mid-line", "label-edited", "reject-deleted"],
)
def test_a_damaged_part_is_named_with_its_command_and_remade_by_it(tmp_path, capsys, damage, name):
    labels = ["a", "b"] * 4
    m = _manifest(tmp_path / "data", labels)
    rows = _jsonl(m)
    rows.insert(6, {"image": "missing.png", "text": "no such file", "label": "a"})  # a reject of part 1
    write_jsonl(m, rows)
    single = tmp_path / "single"
    assert main([str(m), "--out", str(single), *FLAGS]) == 0
    out = tmp_path / "out"
    for i in range(2):
        assert main([str(m), "--out", str(out), "--shard", f"{i}/2", *FLAGS]) == 0
    damaged = part_dir(out, 1, 2) / name
    damage(damaged)
    capsys.readouterr()
    assert main([str(m), "--out", str(out), "--merge", *FLAGS]) == 2
    err = _error(capsys)
    assert err.startswith(f"error: --merge: part 1/2 is damaged: {damaged} ")
    assert "the same command and --shard 1/2 instead of --merge" in err
    assert not out.exists()
    # The command the error names makes the part again (a complete part would be kept as it is).
    assert main([str(m), "--out", str(out), "--shard", "1/2", *FLAGS]) == 0
    assert main([str(m), "--out", str(out), "--merge", *FLAGS]) == 0
    assert _split_files(out) == _split_files(single)
    assert [r["line"] for r in _jsonl(out / "rejected.jsonl")] == [7]


def test_a_part_without_file_records_cut_mid_line_names_the_file_and_line(tmp_path, capsys):
    """A part.json without the row files' sizes and SHA-256 (as an earlier mmfast wrote it): the rows
    themselves are checked, so a cut line is named by its file and line, and missing rows by the counts."""
    m = _manifest(tmp_path / "data", ["a", "b"] * 4)
    out = tmp_path / "out"
    for i in range(2):
        assert main([str(m), "--out", str(out), "--shard", f"{i}/2", *FLAGS]) == 0
    part = part_dir(out, 0, 2)
    summary = json.loads((part / "part.json").read_text())
    del summary["files"]
    (part / "part.json").write_text(json.dumps(summary))
    accepted = part / "accepted.jsonl"
    good = accepted.read_bytes()
    _cut_mid_line(accepted)
    capsys.readouterr()
    assert main([str(m), "--out", str(out), "--merge", *FLAGS]) == 2
    err = _error(capsys)
    assert f"part 0/2 is damaged: {accepted}, line 4: not a JSON row" in err and "--shard 0/2" in err
    accepted.write_bytes(good)
    _cut_last_row(accepted)
    assert main([str(m), "--out", str(out), "--merge", *FLAGS]) == 2
    assert f"part 0/2 is damaged: {accepted} holds 3 rows, part.json counts 4" in _error(capsys)


# 2. A Parquet file with a zeroed page is named, and said to be corrupt.


def _parquet(tmp_path: Path, n: int = 24) -> Path:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    _images(tmp_path / "img", n)
    images = [{"bytes": (tmp_path / "img" / f"{k}.png").read_bytes(), "path": f"{k}.png"} for k in range(n)]
    table = pa.table(
        {"image": images, "text": [f"picture {k}" for k in range(n)], "label": ["ab"[k % 2] for k in range(n)]}
    )
    path = tmp_path / "t.parquet"
    pq.write_table(table, path, row_group_size=8, compression="snappy")
    return path


@pytest.mark.parametrize("where", ["data page", "footer"])
def test_a_parquet_file_with_zeroed_bytes_is_named_as_corrupt_and_exits_2(tmp_path, capsys, where):
    import pyarrow.parquet as pq

    path = _parquet(tmp_path)
    raw = bytearray(path.read_bytes())
    if where == "data page":  # the captions of the second row group: a page, its header included
        chunk = pq.ParquetFile(path).metadata.row_group(1).column(2)
        assert chunk.path_in_schema == "text"
        start, size = chunk.dictionary_page_offset or chunk.data_page_offset, chunk.total_compressed_size
    else:  # the footer's metadata, before its length and magic number
        start, size = len(raw) - 8 - 300, 256
    raw[start : start + size] = bytes(size)
    path.write_bytes(bytes(raw))
    out = tmp_path / "out"
    assert main([str(path), "--out", str(out), *FLAGS]) == 2
    err = _error(capsys)
    expected = (
        "the file is corrupt: reading it failed (" if where == "data page" else "it is corrupt or not Parquet"
    )
    assert err.startswith(f"error: {path}: ") and expected in err and "re-export it" in err
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["img", "t.parquet"]


# 3. A COCO file that is not a captions file is recognised as COCO and refused saying what is missing.


_CAPTIONS_HINT = "pass a captions_*.json file (it has 'images' and 'annotations' with 'image_id' and 'caption')"


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ({"info": {}, "images": "IMAGES"}, f"a COCO JSON with no 'annotations' list; {_CAPTIONS_HINT}"),
        (
            {"annotations": [{"id": 1, "image_id": 0, "caption": "x"}]},
            f"a COCO JSON with no 'images' list; {_CAPTIONS_HINT}",
        ),
        (
            {
                "images": "IMAGES",
                "annotations": [{"id": 1, "image_id": 0, "bbox": [0, 0, 4, 4], "category_id": 1}],
            },
            "its annotations have no 'caption' (an instances_*/person_keypoints_* file?); "
            "pass a captions_*.json file",
        ),
    ],
    ids=["images-only", "annotations-only", "instances"],
)
@pytest.mark.parametrize("indent", [None, 2], ids=["one-line", "indented"])
def test_a_coco_file_that_is_not_a_captions_file_says_what_is_missing(tmp_path, capsys, content, expected, indent):
    _images(tmp_path, 2)
    images = [{"id": k, "file_name": f"{k}.png"} for k in range(2)]
    content = {k: (images if v == "IMAGES" else v) for k, v in content.items()}
    path = tmp_path / "instances_val2017.json"
    path.write_text(json.dumps(content, indent=indent))
    assert detect_kind(path) == "coco"
    assert main([str(path), "--out", str(tmp_path / "out"), "--no-labels", *FLAGS]) == 2
    assert _error(capsys) == f"error: {path}: {expected}"
    assert not (tmp_path / "out").exists() and not failure_report_path(tmp_path / "out").exists()


def test_a_one_row_manifest_named_json_is_still_a_jsonl_manifest(tmp_path):
    path = tmp_path / "one.json"
    path.write_text(json.dumps({"image": "0.png", "text": "a caption", "label": "a", "images": 3}) + "\n")
    assert detect_kind(path) == "jsonl"


# 4. Labels are class names or integer ids: a float is never truncated into a class.


def test_parse_label_keeps_names_and_integers_and_refuses_fractions():
    assert parse_label(3.0) == (3, "") and parse_label(-2.0) == (-2, "") and parse_label(7) == (7, "")
    assert parse_label(" cat ") == ("cat", "") and parse_label("0.7") == ("0.7", "")  # a JSON string: a name
    assert parse_label("3.0", from_text=True) == (3, "") and parse_label("+4", from_text=True) == (4, "")
    assert parse_label("nan", from_text=True) == ("nan", "") and parse_label("v1.5", from_text=True) == (
        "v1.5",
        "",
    )
    assert parse_label(0.7) == (
        None,
        "label 0.7 is not a whole number: labels are class names or integer ids; write a class name as a "
        'string ("0.7")',
    )
    assert parse_label("1.50", from_text=True) == (
        None,
        "label 1.50 is not a whole number: labels are class names or integer ids; give the class a name that "
        "is not a number",
    )
    assert parse_label(math.nan)[0] is None and "NaN" in parse_label(math.nan)[1]
    assert parse_label(math.inf)[0] is None and parse_label(True)[0] is None and parse_label("  ")[0] is None


def test_fraction_labels_are_refused_naming_the_row_and_whole_floats_are_their_integer(tmp_path, capsys):
    m = _manifest(tmp_path / "same", [0.7] * 6)
    assert main([str(m), "--out", str(tmp_path / "out"), *FLAGS]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"{m}: no usable rows out of 6" in err
    assert f"{m}:1: label 0.7 is not a whole number" in err
    m = _manifest(tmp_path / "mixed", [1.5, 1.2, 3.0, 4, 3, 4.0, 1.2, 4])
    out = tmp_path / "out"
    assert main([str(m), "--out", str(out), "--val-fraction", "0", *FLAGS]) == 0
    assert json.loads((out / "labels.json").read_text()) == {"3": 0, "4": 1}
    assert [(r["line"], r["label"]) for r in _jsonl(out / "train.jsonl")] == [
        (3, 0),
        (4, 1),
        (5, 0),
        (6, 1),
        (8, 1),
    ]
    rejected = _jsonl(out / "rejected.jsonl")
    assert [(r["line"], r["reason"].split(":")[0]) for r in rejected] == [
        (1, "label 1.5 is not a whole number"),
        (2, "label 1.2 is not a whole number"),
        (7, "label 1.2 is not a whole number"),
    ]


def test_csv_and_parquet_labels_follow_the_same_rule(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    _images(tmp_path, 5)
    values = ["3", "3.0", "0.7", "cat", "4"]
    lines = ["image,text,label"] + [f"{k}.png,picture {k},{v}" for k, v in enumerate(values)]
    (tmp_path / "m.csv").write_text("\n".join(lines) + "\n")
    out = tmp_path / "csv"
    assert main([str(tmp_path / "m.csv"), "--out", str(out), "--val-fraction", "0", *FLAGS]) == 0
    assert json.loads((out / "labels.json").read_text()) == {"3": 0, "4": 1}  # "3" and "3.0": one class
    assert [(r["line"], r["label"]) for r in _jsonl(out / "train.jsonl")] == [(2, 0), (3, 0), (6, 1)]
    assert [(r["line"], r["reason"].split(":")[0]) for r in _jsonl(out / "rejected.jsonl")] == [
        (4, "label 0.7 is not a whole number"),
        (5, "mixed label types"),
    ]
    # pandas writes an integer column with a gap as float64 with NaN
    images = [{"bytes": (tmp_path / f"{k}.png").read_bytes(), "path": None} for k in range(4)]
    table = pa.table({"image": images, "text": [f"p {k}" for k in range(4)], "label": [2.0, math.nan, 5.0, 2.5]})
    pq.write_table(table, tmp_path / "t.parquet")
    out = tmp_path / "pq"
    assert main([str(tmp_path / "t.parquet"), "--out", str(out), "--val-fraction", "0", *FLAGS]) == 0
    assert json.loads((out / "labels.json").read_text()) == {"2": 0, "5": 1}
    assert [(r["line"], r["reason"].split(" (")[0].split(":")[0]) for r in _jsonl(out / "rejected.jsonl")] == [
        (2, "label is NaN"),
        (4, "label 2.5 is not a whole number"),
    ]


# 5. A directory a killed swap left aside is put back by whoever opens it next.


def _swap_killed_between_renames(tmp_path: Path) -> tuple[Path, Path, dict[str, str]]:
    """A prepared ``ds`` as the fallback swap leaves it when killed between its two renames: only ``.ds.old``."""
    m = _manifest(tmp_path / "data", ["a", "b"] * 3)
    out = tmp_path / "ds"
    assert main([str(m), "--out", str(out), *FLAGS]) == 0
    files = _split_files(out)
    aside = tmp_path / ".ds.old"
    os.replace(out, aside)  # the first rename of atomic_dir's fallback swap; the kill falls here
    return m, out, files


def test_opening_a_dataset_puts_back_the_directory_a_killed_swap_left_aside(tmp_path, caplog):
    _, out, files = _swap_killed_between_renames(tmp_path)
    with caplog.at_level(logging.INFO):
        dataset = PreparedDataset(out)  # what training does first
    assert dataset.root == out and _split_files(out) == files
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "ds"]
    assert f"put {out} back from .ds.old (a preparation was killed while replacing it)" in caplog.text
    assert restore_interrupted_swap(out) is False  # nothing left to put back


def test_a_training_run_on_it_puts_it_back_and_trains(tmp_path, capsys):
    from tools import train as train_tool

    _, out, files = _swap_killed_between_renames(tmp_path)
    flags = ["--max-steps", "1", "--batch-size", "2", "--image-size", "16", "--hidden", "16", "--no-progress"]
    assert train_tool.main(["--data", str(out), "--out", str(tmp_path / "run"), *flags]) == 0
    assert _split_files(out) == files and (tmp_path / "run" / "summary.json").is_file()


def test_the_next_preparation_puts_it_back_and_logs_it(tmp_path, capsys, caplog):
    m, out, files = _swap_killed_between_renames(tmp_path)
    with caplog.at_level(logging.INFO):
        assert main([str(m), "--out", str(out), *FLAGS]) == 0
    assert f"put {out} back from .ds.old" in caplog.text and f"{out} is up to date; reusing it" in caplog.text
    assert _split_files(out) == files and sorted(p.name for p in tmp_path.iterdir()) == ["data", "ds"]


def test_a_foreign_old_directory_or_an_existing_one_is_left_alone(tmp_path):
    out, aside = tmp_path / "ds", tmp_path / ".ds.old"
    aside.mkdir()
    (aside / "notes.txt").write_text("mine")  # not mmfast's: no marker
    assert restore_interrupted_swap(out) is False
    with pytest.raises(DatasetError, match="not a prepared dataset"):
        PreparedDataset(out)
    assert (aside / "notes.txt").read_text() == "mine" and not out.exists()
    (aside / "notes.txt").unlink()
    (aside / MARKER).write_text("")
    out.mkdir()  # the directory is there: the one aside is not moved (and not deleted)
    assert restore_interrupted_swap(out) is False and aside.is_dir() and not any(out.iterdir())


# 6. Images within the pixel budget but huge decoded: preparation says what a batch of them costs.


def test_a_huge_image_within_the_budget_is_noted_with_its_batch_memory(tmp_path, capsys):
    """Sixteen 62 MP 1-bit PNGs (120 KB on disk) took 7.3 GB in training with no word; preparation now names
    the largest image, what a batch of such images holds decoded, and --max-side."""
    from PIL import Image

    m = _manifest(tmp_path / "data", ["a", "b"] * 3)
    Image.new("1", (6000, 4000)).save(tmp_path / "data" / "0.png")  # 24 MP, a few KB on disk
    out = tmp_path / "ds"
    assert main([str(m), "--out", str(out), *FLAGS]) == 0
    printed = capsys.readouterr().out
    assert "note: the largest image decodes to 6000x4000 (72 MB;" in printed and "0.png" in printed
    assert "a batch of 64 such images holds 4.6 GB decoded" in printed and "--max-side" in printed
    summary = json.loads((out / "prepare.json").read_text())
    assert summary["largest_image"]["width"] == 6000 and summary["largest_image"]["height"] == 4000
    small = tmp_path / "small"
    assert main([str(m), "--out", str(small), "--max-side", "1024", *FLAGS]) == 0
    assert "note: the largest image" not in capsys.readouterr().out  # its copy is 1024x683


def test_a_manifest_without_a_suffix_is_told_about_input_kind(tmp_path, capsys):
    """``mmfast-prepare <(cat m.jsonl)``: a pipe's name has no suffix, and the error did not say how to name
    the format."""
    m = _manifest(tmp_path / "data", ["a", "b"] * 3)
    bare = tmp_path / "data" / "manifest"
    bare.write_bytes(m.read_bytes())
    assert main([str(bare), "--out", str(tmp_path / "ds"), *FLAGS]) == 2
    assert "name the format with --input-kind" in _error(capsys)
    assert main([str(bare), "--out", str(tmp_path / "ds"), "--input-kind", "jsonl", *FLAGS]) == 0
