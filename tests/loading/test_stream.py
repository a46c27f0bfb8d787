"""The streaming source (``mmfast.loading.stream_source``): img2dataset-layout shards (written by webdataset's
own TarWriter from scikit-image's photos) read member by member in the loader's window order, from local tars
and from an S3-compatible server on loopback (moto's server mode, through s3fs) via the bounded shard cache.
Each test fails on a wrong implementation: a sample read at the wrong offset or twice, a resume that skips or
repeats a batch, a cache that serves a half-written shard, a limit that is not kept."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from mmfast.inputs import InputOptions
from mmfast.loading.multimodal import MultimodalLoader
from mmfast.loading.stream_source import window_order
from mmfast.prepare.core import PrepareConfig, prepare_dataset

wds = pytest.importorskip("webdataset")

SHARDS, PER_SHARD = 6, 5


def _photos() -> list[bytes]:
    """Distinct small real pictures: crops of scikit-image's photos at several offsets, PNG and JPEG."""
    import skimage.data

    out = []
    for k, name in enumerate(
        ("astronaut", "coffee", "chelsea", "rocket", "hubble_deep_field", "immunohistochemistry")
    ):
        im = Image.fromarray(getattr(skimage.data, name)()).convert("RGB").resize((96, 72))
        for j in range(PER_SHARD):
            crop = im.crop((j * 6, j * 3, j * 6 + 64, j * 3 + 48))
            buf = io.BytesIO()
            crop.save(buf, "JPEG" if (k + j) % 2 else "PNG")
            out.append(buf.getvalue())
    return out


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("stream-shards")
    photos = _photos()
    for s in range(SHARDS):
        with wds.TarWriter(str(folder / f"{s:05d}.tar")) as w:
            for j in range(PER_SHARD):
                key = f"{s:05d}{j:04d}"
                img = photos[s * PER_SHARD + j]
                ext = "png" if img[:4] == b"\x89PNG" else "jpg"
                w.write({"__key__": key, ext: img, "txt": f"picture {s} {j} of the set", "cls": str(j % 3)})
    return folder


def prepare(source: str, out: Path, minilm_dir: str) -> Path:
    prepare_dataset(
        PrepareConfig(
            source=source,
            out=str(out),
            tokenizer=minilm_dir,
            max_length=16,
            progress=False,
            workers=1,
            val_fraction=0.2,
            inputs=InputOptions(),
        )
    )
    return out


@pytest.fixture(scope="module")
def prepared_local(tmp_path_factory, shard_dir, minilm_dir) -> Path:
    return prepare(
        f"{shard_dir}/{{00000..{SHARDS - 1:05d}}}.tar", tmp_path_factory.mktemp("p") / "local", minilm_dir
    )


def _epoch(loader) -> tuple[list[int], list[torch.Tensor]]:
    ids, images = [], []
    for batch in loader:
        keep = batch["id"] >= 0
        ids += batch["id"][keep].tolist()
        images += list(batch["image"][keep])
    return ids, images


def _loader(data: Path, source: str, **kw) -> MultimodalLoader:
    args = {"batch_size": 4, "size": 32, "shuffle": True, "drop_last": False, "train": False, "dtype": "float32"}
    return MultimodalLoader(data, "train", source=source, **{**args, **kw})


def test_window_order_reads_each_shard_once_within_its_window_and_starts_on_one_shard():
    sizes = [8, 3, 12, 8, 9, 2, 10]
    shard_of = np.repeat(np.arange(7), sizes)
    rng = np.random.default_rng(0)
    shard_of = shard_of[rng.permutation(len(shard_of))]  # positions need not be grouped by shard
    order = window_order(shard_of, epoch=3, seed=11, shuffle=True, window=2)
    assert sorted(order.tolist()) == list(range(len(shard_of)))
    seq = list(dict.fromkeys(shard_of[order].tolist()))  # the shards in the order they are first needed
    first = seq[0]
    assert shard_of[order[: sizes[first]]].tolist() == [first] * sizes[first]  # the epoch begins with one shard
    # at most `window` shards are being read at any point: begun and not finished
    left = {k: m for k, m in enumerate(sizes)}
    begun: set[int] = set()
    for p in order:
        k = int(shard_of[p])
        begun.add(k)
        left[k] -= 1
        assert len([b for b in begun if left[b] > 0]) <= 2
    assert not np.array_equal(order, window_order(shard_of, epoch=4, seed=11, shuffle=True, window=2))
    assert np.array_equal(order, window_order(shard_of, epoch=3, seed=11, shuffle=True, window=2))
    assert np.array_equal(window_order(shard_of, 0, 0, False, 2), np.argsort(shard_of, kind="stable"))
    # a shard's samples are spread over its window, not read back to back
    wide = window_order(np.repeat(np.arange(10), 40), epoch=0, seed=1, shuffle=True, window=4)
    runs = np.flatnonzero(np.diff(np.repeat(np.arange(10), 40)[wide]) != 0)
    assert len(runs) > 100


def test_stream_reads_every_sample_once_with_the_pixels_of_the_wds_reader(prepared_local):
    """Eval pixels per sample id equal DALI's own WebDataset reader's (the offsets are right), every train
    sample exactly once per epoch, and the order follows the shards' window."""
    ref_ids, ref_images = _epoch(_loader(prepared_local, "wds"))
    ref = dict(zip(ref_ids, ref_images, strict=True))
    loader = _loader(prepared_local, "stream")
    assert loader.images.source.name == "stream"
    ids, images = _epoch(loader)
    assert sorted(ids) == sorted(ref) and len(ids) == len(set(ids))
    for sid, img in zip(ids, images, strict=True):
        assert torch.equal(img, ref[sid]), sid
    again, _ = _epoch(loader)  # the next epoch: another order of the same samples
    assert sorted(again) == sorted(ids) and again != ids


def test_shards_grouped_by_class_get_a_note_and_mixed_ones_none(prepared_local, tmp_path, minilm_dir):
    """img2dataset-style shards often hold one class each: the stream mixes only a window of shards, so a batch
    holds few classes (a newcomer's run trained worse than --source wds, silently). One note says so; the
    fixture's shards, each of which mixes the classes, get none."""
    photos = _photos()
    folder = tmp_path / "grouped"
    folder.mkdir()
    for s in range(10):  # ten shards of ten samples, a class each: the stream reads 4 at a time
        with wds.TarWriter(str(folder / f"{s:05d}.tar")) as w:
            for j in range(10):
                img = photos[(s * 10 + j) % len(photos)]
                ext = "png" if img[:4] == b"\x89PNG" else "jpg"
                w.write({"__key__": f"{s:05d}{j:04d}", ext: img, "txt": f"picture {s} {j}", "cls": str(s)})
    grouped = prepare(f"{folder}/{{00000..00009}}.tar", tmp_path / "p", minilm_dir)
    loader = _loader(grouped, "stream")
    note = loader.source.grouped_note(loader.images.labels, 16)
    got = re.search(r"grouped by class: --source stream mixes 4 shards at a time, so a batch holds ([\d.]+) "
                    r"classes on average against ([\d.]+) shuffled; --source wds", note)  # fmt: skip
    assert got and float(got[1]) < 0.7 * float(got[2]), note
    mixed = _loader(prepared_local, "stream")
    assert mixed.source.grouped_note(mixed.images.labels, 8) == ""


def test_stream_resumes_mid_epoch_exactly(prepared_local):
    """A loader restored from the state after 2 batches gives the rest of the epoch and the next one with
    the same ids and the same augmented pixels as the uninterrupted loader."""
    full = _loader(prepared_local, "stream", train=True, seed=5)
    it = iter(full)
    head = [next(it) for _ in range(2)]
    state = full.state_dict()
    rest = list(it) + list(full)
    assert head
    resumed = _loader(prepared_local, "stream", train=True, seed=5)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    got = list(resumed) + list(resumed)
    assert len(got) == len(rest)
    for a, b in zip(got, rest, strict=True):
        assert torch.equal(a["id"], b["id"]) and torch.equal(a["image"], b["image"])


FAKE_SECRET = "fAkEsEcReT/9q8w7e6r5t4y3u2i1o0p"
BUCKET = "mmfast-stream"


@pytest.fixture(scope="module")
def s3_shards(shard_dir):
    """moto's S3 server on loopback holding the shards under shards/, fake credentials in the environment and
    AWS_ENDPOINT_URL pointing at it (as for a user's S3-compatible store): the server's URL."""
    moto_server = pytest.importorskip("moto.server")
    boto3 = pytest.importorskip("boto3")
    pytest.importorskip("s3fs")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AWS_ACCESS_KEY_ID", "AKIAFAKESTREAMTEST00")
        mp.setenv("AWS_SECRET_ACCESS_KEY", FAKE_SECRET)
        mp.setenv("AWS_DEFAULT_REGION", "us-east-1")
        mp.delenv("AWS_PROFILE", raising=False)
        server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        url = f"http://{host}:{port}"
        mp.setenv("AWS_ENDPOINT_URL", url)
        client = boto3.client("s3", endpoint_url=url)
        client.create_bucket(Bucket=BUCKET)
        for tar in sorted(shard_dir.glob("*.tar")):
            client.upload_file(str(tar), BUCKET, f"shards/{tar.name}")
        yield url
        server.stop()


@pytest.fixture(scope="module")
def prepared_s3(tmp_path_factory, s3_shards, minilm_dir) -> Path:
    pattern = f"s3://{BUCKET}/shards/{{00000..{SHARDS - 1:05d}}}.tar"
    return prepare(pattern, tmp_path_factory.mktemp("p") / "s3", minilm_dir)


def test_prepared_from_s3_records_urls_and_checksums_and_no_secret(prepared_s3, prepared_local, shard_dir):
    import hashlib

    info = json.loads((prepared_s3 / "wds" / "train.json").read_text())
    assert all(t.startswith(f"s3://{BUCKET}/shards/") for t in info["tars"])
    for tar, (size, sha) in zip(info["tars"], info["checks"], strict=True):
        local = (shard_dir / tar.rsplit("/", 1)[1]).read_bytes()
        assert size == len(local) and sha == hashlib.sha256(local).hexdigest()
    # the same rows as the local preparation: ids, captions, labels, split
    for split in ("train", "val"):
        strip = lambda r: {k: r[k] for k in ("id", "text", "label", "member", "offset", "nbytes")}  # noqa: E731
        rows = [strip(json.loads(x)) for x in open(prepared_s3 / f"{split}.jsonl")]
        assert rows == [strip(json.loads(x)) for x in open(prepared_local / f"{split}.jsonl")]
    written = "".join(p.read_text(errors="replace") for p in prepared_s3.rglob("*.json*"))
    assert FAKE_SECRET not in written and "AKIAFAKESTREAMTEST00" not in written


def test_prediction_reads_the_images_of_shards_prepared_from_s3_or_given_as_urls(
    prepared_s3, prepared_local, shard_dir, s3_shards, tmp_path
):
    """What mmfast-predict / mmfast-evaluate read: a prepared split whose images lie inside shards (local or
    remote: fetched and verified), and an --input that is an s3:// pattern, give each row a file with the
    bytes of the image as the local shards hold it, named by its shard's URL."""
    from mmfast.infer.predict import prepared_rows
    from mmfast.infer.predict_inputs import read_rows

    def images(rows):
        return [(r["text"], Path(r["path"]).read_bytes()) for r in rows]

    local = prepared_rows(prepared_local, "val", tmp_path / "l")
    remote = prepared_rows(prepared_s3, "val", tmp_path / "r")
    assert local and images(remote) == images(local)
    assert all(r["image"].startswith(f"s3://{BUCKET}/shards/") and ".tar:" in r["image"] for r in remote)
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["images"]  # the fetched shards removed
    pattern = f"{{00000..{SHARDS - 1:05d}}}.tar"
    from_urls = read_rows(f"s3://{BUCKET}/shards/{pattern}", tmp_path / "u")
    from_disk = read_rows(str(shard_dir / pattern), tmp_path / "d")
    assert len(from_urls) == SHARDS * PER_SHARD and images(from_urls) == images(from_disk)
    assert from_urls[0]["image"] == f"s3://{BUCKET}/shards/00000.tar:{from_disk[0]['image'].rsplit(':', 1)[1]}"


def test_streamed_from_s3_equals_local_disk_within_a_cache_limit(prepared_s3, prepared_local, tmp_path, caplog):
    """Through a cache of about two shards: the same ids and augmented pixels as the local shards for two
    epochs, the cache never past its limit plus one shard, and every shard fetched again only after eviction."""
    from mmfast.remote.shard_cache import ShardCache

    sizes = [p.stat().st_size for p in sorted((prepared_local.parent.parent).rglob("*.tar"))] or [0]
    limit = 2 * max(json.loads((prepared_s3 / "wds" / "train.json").read_text())["checks"], key=lambda c: c[0])[0]
    with ShardCache(tmp_path / "cache", limit) as cache:  # its fetch threads end with the test
        local = _loader(prepared_local, "stream", train=True, seed=3)
        streamed = _loader(prepared_s3, "stream", train=True, seed=3, shard_cache=cache)
        assert streamed.images.source.cache is cache and sizes
        biggest = limit // 2
        for _ in range(2):
            for a, b in zip(local, streamed, strict=True):
                assert torch.equal(a["id"], b["id"]) and torch.equal(a["image"], b["image"])
                held = sum(p.stat().st_size for p in (tmp_path / "cache" / "shards").glob("*") if p.is_file())
                assert held <= limit + biggest, (held, limit)
        stats = cache.stats()
        assert stats["fetches"] >= SHARDS and stats["evictions"] >= 1, stats
        next(iter(_loader(prepared_s3, "stream", train=True, seed=4, shard_cache=cache)))  # a second loader
    # a cache smaller than the window and two shards is said to cost fetches, with the limit that would not,
    # once for the cache however many loaders read through it
    warned = [r.getMessage() for r in caplog.records if "raise limit_bytes=" in r.getMessage()]  # Python's words
    assert len(warned) == 1 and "fewer than the 4 the order reads from at once" in warned[0], warned


def test_training_streams_from_s3_and_writes_no_secret(s3_shards, tmp_path, capsys):
    """mmfast-train on the shards' s3:// pattern: prepared on the fly where they lie, then streamed (two
    epochs through a small cache); neither the run's files nor its output hold the fake secret key."""
    from tools import train as train_tool

    out = tmp_path / "run"
    argv = [
        "--data",
        f"s3://{BUCKET}/shards/{{00000..{SHARDS - 1:05d}}}.tar",
        "--out",
        str(out),
        "--epochs",
        "2",
        "--batch-size",
        "4",
        "--image-size",
        "32",
    ]
    argv += [
        "--hidden",
        "32",
        "--no-progress",
        "--shard-cache",
        str(tmp_path / "cache"),
        "--cache-limit",
        "1MiB",
    ]
    assert train_tool.main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["epochs_done"] == 2
    assert (out / "model" / "model.safetensors").is_file()
    text = capsys.readouterr()
    written = "".join(p.read_text(errors="replace") for p in out.rglob("*.json*")) + text.out + text.err
    assert FAKE_SECRET not in written
    assert any((tmp_path / "cache" / "shards").iterdir())


def test_the_cache_limit_takes_bytes_or_a_unit_and_may_change_on_resume():
    """--cache-limit: bytes or a size with a decimal or binary unit, refused naming the flag otherwise; where
    the cache lies and how much it holds are this machine's, not the training's: a resume may change them (a
    run recorded before --cache-limit too)."""
    from mmfast.train.flags import parse_config
    from mmfast.train.resume_rules import resume_differences
    from mmfast.util.args import parse_size

    assert [parse_size(t) for t in ("1234", "500MB", "20GiB", "20 gib", "3KiB", "1.5g")] == [
        1234,
        500 * 10**6,
        20 * 2**30,
        20 * 2**30,
        3072,
        1_500_000_000,
    ]
    assert parse_config(["--data", "x", "--cache-limit", "2GB"]).cache_limit == "2GB"
    for bad in ("0", "-1", "lots", "5PB"):
        with pytest.raises(ValueError, match="--cache-limit must be"):
            parse_config(["--data", "x", "--cache-limit", bad])
    saved = {"task": "clip", "shard_cache": "/scratch/a", "cache_limit_gb": 20.0, "seed": 0}
    assert (
        resume_differences(saved, {"task": "clip", "shard_cache": "/tmp/b", "cache_limit": "5GiB", "seed": 0})
        == []
    )
    assert resume_differences(saved, {"task": "clip", "seed": 1}) == ["seed: 0 -> 1"]
