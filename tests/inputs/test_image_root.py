"""--image-root: every kind whose rows name images by relative path reads them from it (a manifest, HF
imagefolder metadata, a Parquet or Arrow path column; COCO in test_inputs), the kinds whose rows name no
path refuse it in one line, and the hint of a preparation whose every image is missing names the folder the
paths were read from."""

from __future__ import annotations

import csv
import json
import tarfile
from pathlib import Path

import pytest
from conftest import save_image

from mmfast.cli.prepare import build_parser, main
from mmfast.data.dataset import PreparedDataset

FLAGS = ["--max-length", "16", "--vocab-size", "200", "--workers", "1", "--no-progress"]
N = 10


def _rows(tmp_path: Path) -> list[dict]:
    """N images in tmp_path/pics, named by paths relative to tmp_path (not to the table naming them)."""
    for k in range(N):
        save_image(tmp_path / "pics" / f"{k}.png", size=(16, 12), seed=k)
    return [{"image": f"pics/{k}.png", "text": f"picture {k}", "label": "ab"[k % 2]} for k in range(N)]


def _jsonl(folder: Path, rows: list[dict]) -> Path:
    (folder / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder / "m.jsonl"


def _csv(folder: Path, rows: list[dict]) -> Path:
    with open(folder / "m.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["image", "text", "label"])
        w.writeheader()
        w.writerows(rows)
    return folder / "m.csv"


def _imagefolder(folder: Path, rows: list[dict]) -> Path:
    meta = [{"file_name": r["image"], "text": r["text"], "label": r["label"]} for r in rows]
    (folder / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in meta))
    return folder


def _table(rows: list[dict]):
    """The rows with HF's Image struct holding a path and no bytes (what ``datasets`` writes for local files)."""
    pa = pytest.importorskip("pyarrow")
    images = pa.array(
        [{"bytes": None, "path": r["image"]} for r in rows],
        pa.struct([("bytes", pa.binary()), ("path", pa.string())]),
    )
    return pa.table({"image": images, "text": [r["text"] for r in rows], "label": [r["label"] for r in rows]})


def _parquet(folder: Path, rows: list[dict]) -> Path:
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(_table(rows), folder / "train-00000-of-00001.parquet")
    return folder / "train-00000-of-00001.parquet"


def _arrow(folder: Path, rows: list[dict]) -> Path:
    pa = pytest.importorskip("pyarrow")
    table = _table(rows)
    with (
        pa.OSFile(str(folder / "data-00000-of-00001.arrow"), "wb") as sink,
        pa.ipc.new_stream(sink, table.schema) as w,
    ):
        w.write_table(table)
    return folder / "data-00000-of-00001.arrow"


KINDS = {"jsonl": _jsonl, "csv": _csv, "imagefolder": _imagefolder, "parquet": _parquet, "arrow": _arrow}


@pytest.mark.parametrize("kind", KINDS)
def test_relative_paths_are_read_from_the_image_root(tmp_path, capsys, kind):
    rows = _rows(tmp_path)
    (tmp_path / "table").mkdir()
    source = KINDS[kind](tmp_path / "table", rows)
    out = tmp_path / "out"
    assert main([str(source), "--out", str(out), "--image-root", str(tmp_path), *FLAGS]) == 0
    ds = PreparedDataset(out)
    assert ds.summary["input_kind"] == kind and ds.summary["counts"]["accepted"] == N
    images = sorted(Path(r["image"]) for split in ("train", "val") for r in ds.rows(split))
    assert images == sorted((tmp_path / r["image"]).resolve() for r in rows)

    # without it, from the table's folder: every image is missing, and the hint names that folder
    assert main([str(source), "--out", str(tmp_path / "none"), *FLAGS]) == 2
    err = capsys.readouterr().err
    where = f"relative paths are read from {(tmp_path / 'table').resolve()} (the folder of the file naming them)"
    assert f"(every image is missing: {where}; --image-root DIR reads them from DIR)" in err

    # a wrong --image-root: the hint names it, not the table's folder
    assert (
        main([str(source), "--out", str(tmp_path / "none"), "--image-root", str(tmp_path / "pics"), *FLAGS]) == 2
    )
    err = capsys.readouterr().err
    assert (
        f"(every image is missing: relative paths are read from --image-root {(tmp_path / 'pics').resolve()})"
        in err
    )


def test_confine_keeps_to_the_image_root(tmp_path, capsys):
    rows = _rows(tmp_path)
    (tmp_path / "table").mkdir()
    source = _jsonl(tmp_path / "table", rows)  # pics/ is outside the manifest's folder, inside the root
    out = tmp_path / "out"
    assert main([str(source), "--out", str(out), "--image-root", str(tmp_path), "--confine", *FLAGS]) == 0
    assert PreparedDataset(out).summary["counts"]["accepted"] == N
    outside = _jsonl(tmp_path / "table", [r | {"image": f"../{r['image']}"} for r in rows])  # found, outside
    assert (
        main([str(outside), "--out", str(out), "--image-root", str(tmp_path / "table"), "--confine", *FLAGS]) == 2
    )
    assert "image path '../pics/0.png' leaves the folder image paths are read from" in capsys.readouterr().err


def _one_shard(folder: Path) -> Path:
    folder.mkdir()
    save_image(folder / "0.png", size=(16, 12))
    with tarfile.open(folder / "00000.tar", "w") as tar:
        tar.add(folder / "0.png", "000000000.png")
    return folder


@pytest.mark.parametrize("kind", ["wds", "folder"])
def test_a_kind_whose_rows_name_no_path_refuses_the_image_root_in_one_line(tmp_path, capsys, kind):
    if kind == "wds":
        source = _one_shard(tmp_path / "shards")
    else:
        source = tmp_path / "classes"
        save_image(source / "a" / "0.png")
    assert main([str(source), "--out", str(tmp_path / "out"), "--image-root", str(tmp_path), *FLAGS]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --image-root does not apply to a {kind} input: ") and err.count("\n") == 1, err
    assert "(it applies to jsonl, csv, imagefolder, coco, parquet, arrow); drop --image-root" in err
    assert not (tmp_path / "out").exists()


def test_the_help_says_what_image_root_does():
    text = " ".join(build_parser().format_help().split())
    assert (
        "--image-root DIR folder the relative image paths of a jsonl, csv, imagefolder, coco, parquet, arrow "
        "input are read from; other kinds refuse it (default: the folder of the file naming them)"
    ) in text


def test_a_folder_of_compressed_shards_is_named_as_such(tmp_path, capsys):
    """.tar.gz shards (not read as shards) were called an image folder without class sub-folders: the error now
    names the compressed file and says to decompress it."""
    import gzip

    folder = _one_shard(tmp_path / "shards")
    packed = folder / "00000.tar.gz"
    packed.write_bytes(gzip.compress((folder / "00000.tar").read_bytes()))
    (folder / "00000.tar").unlink()
    (folder / "0.png").unlink()
    assert main([str(folder), "--out", str(tmp_path / "out"), *FLAGS]) == 2
    err = capsys.readouterr().err
    assert "holds compressed tar files (00000.tar.gz, ...)" in err and "decompress them to .tar" in err
    assert packed.is_file() and not (tmp_path / "out").exists()
