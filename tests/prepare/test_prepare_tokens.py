"""Preparing an input again keeps the tokenizer and token cache of its earlier preparation where they are what
would be written anyway: a WordPiece vocabulary trained on the same captions is not trained again, a caption an
earlier cache of the same tokenizer holds is not tokenized again, and the files written are those of a
preparation from nothing, byte for byte. Real photos from scikit-image, a real tokenizer (MiniLM's WordPiece)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from PIL import Image

from mmfast.data import tokenizer as tokenizer_mod
from mmfast.data.earlier_tokens import EarlierSplit, EarlierTokens
from mmfast.data.token_cache import TokenCache
from mmfast.prepare import tokens as prepare_tokens
from mmfast.prepare.core import PrepareConfig, prepare_dataset

PHOTOS = ("rocket.jpg", "chelsea.png", "coffee.png", "astronaut.png", "motorcycle_left.png", "camera.png")


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("MMFAST_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def trained(monkeypatch) -> list[int]:
    """How many captions each WordPiece training from now on was given."""
    sizes: list[int] = []
    real = tokenizer_mod.train_wordpiece

    def counted(texts, *args, **kwargs):
        sizes.append(len(texts))
        return real(texts, *args, **kwargs)

    monkeypatch.setattr(prepare_tokens, "train_wordpiece", counted)
    return sizes


def _photos(folder: Path, n: int) -> Path:
    import skimage

    folder.mkdir(exist_ok=True)
    rows = []
    for k in range(n):
        name = PHOTOS[k % len(PHOTOS)]
        im = Image.open(Path(skimage.data_dir) / name).convert("RGB").resize((80 + k, 64))
        im.save(folder / f"p{k}.jpg", "JPEG")
        words = " ".join(name.split(".")[0].split("_"))
        rows.append(
            {"image": f"p{k}.jpg", "text": f"photo number {k} shows a {words} " * (1 + k % 3), "label": name[:4]}
        )
    path = folder / "captions.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _prepare(source: Path, out: Path, **kw) -> dict:
    return prepare_dataset(
        PrepareConfig(str(source), str(out), progress=False, workers=1, val_fraction=0.25, vocab_size=300, **kw)
    )


def _token_files(out: Path) -> dict[str, bytes]:
    return {
        p.relative_to(out).as_posix(): p.read_bytes() for d in ("tokenizer", "tokens") for p in (out / d).iterdir()
    }


def _fresh(tmp_path: Path, manifest: Path, cache: Path, **kw) -> dict[str, bytes]:
    """The tokenizer and token files of a preparation that knows of no earlier one."""
    shutil.rmtree(cache, ignore_errors=True)
    fresh = tmp_path / "fresh"
    summary = _prepare(manifest, fresh, **kw)
    assert "tokenizer_kept_from" not in summary and all(
        "rows_copied" not in c for c in summary["token_cache"].values()
    )
    return _token_files(fresh)


def test_same_captions_keep_the_vocabulary_and_every_token_row(tmp_path, cache, trained):
    manifest = _photos(tmp_path / "photos", 12)
    out = tmp_path / "prepared"
    first = _prepare(manifest, out)
    assert trained == [first["counts"]["train"]]
    changed = manifest.parent / "p3.jpg"
    Image.open(changed).rotate(90, expand=True).save(changed, "JPEG")  # the input changes, its captions do not
    (out / "tokenizer" / "notes.txt").write_text("a file of the user's, not of the vocabulary")
    trained.clear()
    again = _prepare(manifest, out)
    assert trained == []  # the vocabulary was copied, not trained again
    assert again["tokenizer_kept_from"] == str(out)
    n = again["counts"]
    assert {s: c.get("rows_copied") for s, c in again["token_cache"].items()} == {
        "train": n["train"],
        "val": n["val"],
    }
    kept = _token_files(out)
    assert kept == _fresh(tmp_path, manifest, cache)
    assert trained == [n["train"]]


def test_a_fixed_tokenizer_tokenizes_only_the_new_captions(tmp_path, cache, minilm_dir):
    manifest = _photos(tmp_path / "photos", 12)
    out = tmp_path / "prepared"
    _prepare(manifest, out, tokenizer=minilm_dir)
    more = _photos(tmp_path / "photos", 16)  # four rows added; the first twelve as they were
    assert more == manifest
    again = _prepare(manifest, out, tokenizer=minilm_dir)
    copied = sum(c.get("rows_copied", 0) for c in again["token_cache"].values())
    assert copied == 12  # wherever the split put them; the four new captions were tokenized
    assert _token_files(out) == _fresh(tmp_path, manifest, cache, tokenizer=minilm_dir)


def test_another_vocabulary_copies_no_rows(tmp_path, cache, trained):
    manifest = _photos(tmp_path / "photos", 12)
    out = tmp_path / "prepared"
    _prepare(manifest, out)
    rows = [json.loads(line) for line in manifest.read_text().splitlines()]
    rows[0]["text"] = "zebra quagga okapi " * 4  # new words: a vocabulary trained again differs
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    trained.clear()
    again = _prepare(manifest, out)
    assert len(trained) == 1 and "tokenizer_kept_from" not in again
    assert all("rows_copied" not in c for c in again["token_cache"].values())
    assert _token_files(out) == _fresh(tmp_path, manifest, cache)


def test_a_damaged_earlier_cache_is_not_copied_from(tmp_path, cache, minilm_dir):
    manifest = _photos(tmp_path / "photos", 12)
    out = tmp_path / "prepared"
    _prepare(manifest, out, tokenizer=minilm_dir)
    ids = out / "tokens" / "train.ids.bin"
    data = bytearray(ids.read_bytes())
    data[10:14] = b"\x07\x00\x07\x00"  # the same size: only its recorded SHA-256 tells
    ids.write_bytes(bytes(data))
    changed = manifest.parent / "p5.jpg"
    Image.open(changed).rotate(90, expand=True).save(changed, "JPEG")
    again = _prepare(manifest, out, tokenizer=minilm_dir)
    assert "rows_copied" not in again["token_cache"]["train"]  # the val split's cache, intact, still lends
    assert again["token_cache"]["val"]["rows_copied"] == again["counts"]["val"]
    assert _token_files(out) == _fresh(tmp_path, manifest, cache, tokenizer=minilm_dir)


def test_a_cache_build_copies_rows_of_an_earlier_cache_of_the_same_tokenizer(tmp_path, minilm_dir):
    tok = tokenizer_mod.load_tokenizer(minilm_dir)
    old = ["a red bicycle", "", "two dogs play in the snow " * 9, "a red bicycle", "coffee"]
    new = ["coffee", "a cat", "two dogs play in the snow " * 9, "a red bicycle", "", "a cat", "tea"]
    earlier = TokenCache.build(tmp_path / "old", "train", old, tok, 16)
    lend = EarlierTokens([EarlierSplit.of_cache(earlier, old)])
    built = TokenCache.build(tmp_path / "new", "train", new, tok, 16, first_id=3, earlier=lend)
    fresh = TokenCache.build(tmp_path / "fresh", "train", new, tok, 16, first_id=3)
    assert built.copied == 4  # coffee, the dogs (cut at 16 tokens), the bicycle, the empty caption
    for name in ("train.ids.bin", "train.offsets.npy", "train.meta.json"):
        assert (tmp_path / "new" / name).read_bytes() == (tmp_path / "fresh" / name).read_bytes()
    assert fresh.copied == 0
    wider = TokenCache.build(tmp_path / "wide", "train", new, tok, 24, earlier=lend)
    assert wider.copied == 0  # rows cut at 16 tokens are not rows cut at 24


def test_captions_edited_in_the_earlier_rows_lend_no_tokens(tmp_path, cache, minilm_dir):
    manifest = _photos(tmp_path / "photos", 12)
    out = tmp_path / "prepared"
    _prepare(manifest, out, tokenizer=minilm_dir)
    rows_file = out / "train.jsonl"
    rows = [json.loads(line) for line in rows_file.read_text().splitlines()]
    rows[0]["text"], rows[1]["text"] = rows[1]["text"], rows[0]["text"]  # each would get the other's tokens
    rows_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    _photos(tmp_path / "photos", 13)  # a row added: the input changed
    again = _prepare(manifest, out, tokenizer=minilm_dir)
    assert again["token_cache"]["val"].get("rows_copied")  # the val rows file was as recorded
    assert _token_files(out) == _fresh(tmp_path, manifest, cache, tokenizer=minilm_dir)


def test_a_vocabulary_or_rows_not_as_recorded_or_of_other_libraries_are_made_again(
    tmp_path, cache, trained, monkeypatch
):
    manifest = _photos(tmp_path / "photos", 12)
    out = tmp_path / "prepared"
    _prepare(manifest, out)
    vocab = out / "tokenizer" / "tokenizer.json"
    vocab.write_text(vocab.read_text().replace('"[MASK]"', '"[MASQ]"', 1))  # edited by hand
    ids = out / "tokens" / "val.ids.bin"
    ids.unlink()
    ids.mkdir()  # a file that cannot be read
    changed = manifest.parent / "p4.jpg"
    Image.open(changed).rotate(90, expand=True).save(changed, "JPEG")
    trained.clear()
    again = _prepare(manifest, out)
    assert len(trained) == 1 and "tokenizer_kept_from" not in again
    assert _token_files(out) == _fresh(tmp_path, manifest, cache)
    other = {"tokenizers": "0.0.1", "transformers": "0.0.1"}  # what another install would have written
    monkeypatch.setattr("mmfast.prepare.tokens.library_versions", lambda: other)
    monkeypatch.setattr("mmfast.data.earlier_tokens.library_versions", lambda: other)
    Image.open(changed).rotate(90, expand=True).save(changed, "JPEG")
    trained.clear()
    again = _prepare(manifest, out)
    assert len(trained) == 1 and "tokenizer_kept_from" not in again
    assert all("rows_copied" not in c for c in again["token_cache"].values())
