"""prepare.json's ``largest_image`` names the image where the user finds it, with its real size: a member of
a WebDataset shard (local or over HTTP), a file written into OUT from Parquet bytes (or its --max-side copy),
or the user's own file. mmfast-prepare's memory note prints that name."""

from __future__ import annotations

import functools
import io
import json
import tarfile
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from conftest import save_image
from PIL import Image

from mmfast.cli import prepare as prepare_cli

FLAGS = ["--max-length", "16", "--vocab-size", "200", "--workers", "1", "--no-progress"]
SIZES = [(16, 12)] * 6 + [(40, 30)] + [(16, 12)] * 3  # the largest is sample 6, in the second shard of two


def _pictures(folder: Path) -> list[bytes]:
    return [save_image(folder / f"{k}.png", size=size, seed=k).read_bytes() for k, size in enumerate(SIZES)]


def _shards(folder: Path, pictures: list[bytes]) -> Path:
    """img2dataset's layout: NNNNN.tar holding NNNNNNNNN.png + .txt + .json (the label a field of the json)."""
    folder.mkdir()
    for s in range(2):
        with tarfile.open(folder / f"{s:05d}.tar", "w") as tar:
            for k in range(s * 5, s * 5 + 5):
                meta = {"key": f"{k:09d}", "label": "ab"[k % 2]}
                for ext, data in (
                    ("png", pictures[k]),
                    ("txt", f"picture {k}".encode()),
                    ("json", json.dumps(meta)),
                ):
                    data = data if isinstance(data, bytes) else data.encode()
                    info = tarfile.TarInfo(f"{k:09d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return folder


def _summary(out: Path) -> dict:
    return json.loads((out / "prepare.json").read_text())


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # noqa: A002
        pass


@pytest.fixture
def served(tmp_path):
    """Shards served by http.server: (their folder, the URL pattern of both)."""
    folder = _shards(tmp_path / "served", _pictures(tmp_path / "pictures"))
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(folder)))
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield folder, f"http://127.0.0.1:{server.server_address[1]}/{{00000..00001}}.tar"
    server.shutdown()
    server.server_close()
    thread.join(5)


def test_webdataset_shards_name_the_shard_and_member_with_its_size(tmp_path, capsys, monkeypatch):
    shards = _shards(tmp_path / "shards", _pictures(tmp_path / "pictures"))
    monkeypatch.setattr(prepare_cli, "LARGE_IMAGE_PIXELS", 1000)  # a 40x30 image is "large" here
    out = tmp_path / "out"
    assert prepare_cli.main([str(shards), "--out", str(out), "--wds-label-field", "label", *FLAGS]) == 0
    name = f"{(shards / '00001.tar').resolve()}:000000006.png"
    assert _summary(out)["largest_image"] == {"image": name, "width": 40, "height": 30}
    assert f"note: the largest image decodes to 40x30 (0 MB; {name})" in capsys.readouterr().out


def test_shards_over_http_name_the_url_and_member(served, tmp_path):
    _, pattern = served
    out = tmp_path / "out"
    assert prepare_cli.main([pattern, "--out", str(out), "--wds-label-field", "label", *FLAGS]) == 0
    url = pattern.replace("{00000..00001}", "00001")
    assert _summary(out)["largest_image"] == {"image": f"{url}:000000006.png", "width": 40, "height": 30}


def _parquet(path: Path, pictures: list[bytes]) -> Path:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    images = [{"bytes": data, "path": f"{k}.png"} for k, data in enumerate(pictures)]
    texts = [f"picture {k}" for k in range(len(pictures))]
    pq.write_table(
        pa.table({"image": images, "text": texts, "label": ["ab"[k % 2] for k in range(len(texts))]}), path
    )
    return path


def test_parquet_image_bytes_are_named_by_their_file_in_out(tmp_path):
    pictures = _pictures(tmp_path / "pictures")
    source = _parquet(tmp_path / "train.parquet", pictures)
    out = tmp_path / "out"
    assert prepare_cli.main([str(source), "--out", str(out), *FLAGS]) == 0
    big = _summary(out)["largest_image"]
    assert (big["width"], big["height"]) == (40, 30)
    assert Path(big["image"]).parent.parent == (out / "images").resolve()
    assert Path(big["image"]).read_bytes() == pictures[6]  # the file is there, after the temp folder is gone


def test_a_max_side_copy_of_parquet_bytes_is_named_by_the_copy_in_out(tmp_path):
    source = _parquet(tmp_path / "train.parquet", _pictures(tmp_path / "pictures"))
    out = tmp_path / "out"
    assert prepare_cli.main([str(source), "--out", str(out), "--max-side", "20", *FLAGS]) == 0
    big = _summary(out)["largest_image"]
    assert Path(big["image"]).is_relative_to(out.resolve())
    with Image.open(big["image"]) as im:
        assert im.size == (big["width"], big["height"]) == (20, 15)


def test_a_manifest_image_is_named_by_the_users_file(tmp_path):
    pictures = _pictures(tmp_path / "data")
    rows = [{"image": f"{k}.png", "text": f"picture {k}", "label": "ab"[k % 2]} for k in range(len(pictures))]
    (tmp_path / "data" / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    assert prepare_cli.main([str(tmp_path / "data" / "m.jsonl"), "--out", str(out), *FLAGS]) == 0
    big = {"image": str((tmp_path / "data" / "6.png").resolve()), "width": 40, "height": 30}
    assert _summary(out)["largest_image"] == big


def test_a_prepare_into_a_log_says_how_far_it_got(tmp_path, monkeypatch, caplog):
    """With stderr no terminal (a log, CI), a progress bar shows nothing: a 40-minute preparation said nothing
    until its summary. Lines now say how many shards, and how many image files, are done (every 30 s; here
    every item)."""
    import logging

    from mmfast.util import pool

    monkeypatch.setattr(pool, "LOG_EVERY_S", 0.0)
    pictures = _pictures(tmp_path / "pictures")
    flags = [f for f in FLAGS if f != "--no-progress"]
    with caplog.at_level(logging.INFO, logger="mmfast.util.pool"):
        assert (
            prepare_cli.main(
                [
                    str(_shards(tmp_path / "shards", pictures)),
                    "--out",
                    str(tmp_path / "a"),
                    "--wds-label-field",
                    "label",
                    *flags,
                ]
            )
            == 0
        )
        lines = [r.getMessage() for r in caplog.records if r.name == "mmfast.util.pool"]
        assert [line.split(" in ")[0] for line in lines] == ["reading and checking shards: 1 of 2 shards (50%)"]
        caplog.clear()
        manifest = tmp_path / "pictures" / "rows.jsonl"
        manifest.write_text("".join(json.dumps({"image": f"{k}.png", "text": f"p {k}"}) + "\n" for k in range(10)))
        assert prepare_cli.main([str(manifest), "--out", str(tmp_path / "b"), *flags, "--no-labels"]) == 0
        lines = [r.getMessage() for r in caplog.records if r.name == "mmfast.util.pool"]
        assert [line.split(" in ")[0] for line in lines] == [
            f"validating images: {n} of 10 images ({n}0%)" for n in range(1, 10)
        ]
