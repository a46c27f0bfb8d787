"""TokenCache: exactness against direct tokenization, padding, staleness, damage and concurrency."""

from __future__ import annotations

import json
import multiprocessing as mp
import time

import numpy as np
import pytest

from mmfast.data.token_cache import TokenCache
from mmfast.data.tokenizer import load_tokenizer, train_wordpiece

TEXTS = [
    "a small red circle",
    "Ünïcödé façade — naïve café",
    "",
    "深宇宙の銀河",
    "x " * 100,
    "emoji 🐱 and tabs\tand\nnewlines",
    "the same caption",
    "the same caption",
]


@pytest.fixture(scope="module")
def minilm_tok(minilm_dir):
    return load_tokenizer(minilm_dir)


@pytest.mark.parametrize("which", ["wordpiece", "minilm"])
def test_cached_ids_equal_direct_tokenization_for_every_row(tmp_path, which, minilm_tok):
    tok = minilm_tok if which == "minilm" else train_wordpiece(TEXTS * 3, vocab_size=300)
    cache = TokenCache.build(tmp_path, "train", TEXTS, tok, max_length=24, first_id=100)
    for i, text in enumerate(TEXTS):
        direct = tok(text, truncation=True, max_length=24)["input_ids"]
        got = cache.gather([100 + i])
        assert got["input_ids"][0].tolist() == direct
        assert got["attention_mask"][0].tolist() == [1] * len(direct)


def test_gather_pads_to_the_longest_row_in_the_batch(tmp_path, minilm_tok):
    cache = TokenCache.build(tmp_path, "val", TEXTS, minilm_tok, max_length=64)
    batch = cache.gather(np.array([0, 6, -1]))  # -1: a padding sample
    lens = [len(minilm_tok(TEXTS[i], truncation=True, max_length=64)["input_ids"]) for i in (0, 6)]
    assert batch["input_ids"].shape == (3, max(lens)) < (3, 64)
    assert batch["attention_mask"].sum(1).tolist() == [*lens, 0]
    assert batch["input_ids"][2].eq(minilm_tok.pad_token_id).all()
    assert cache.meta["dtype"] == "uint16"  # a 30k vocabulary fits 16 bits
    with pytest.raises(IndexError, match="not in split 'val'"):
        cache.gather([len(TEXTS)])


def test_fingerprint_change_triggers_a_rebuild(tmp_path, minilm_tok, caplog):
    caplog.set_level("INFO")
    a = TokenCache.build(tmp_path, "train", TEXTS, minilm_tok, max_length=16)
    stamp = (tmp_path / "train.ids.bin").stat().st_mtime_ns
    TokenCache.build(tmp_path, "train", TEXTS, minilm_tok, max_length=16)
    assert (tmp_path / "train.ids.bin").stat().st_mtime_ns == stamp  # unchanged: reused
    b = TokenCache.build(tmp_path, "train", TEXTS, minilm_tok, max_length=8)
    assert b.fingerprint != a.fingerprint and b.gather([4])["input_ids"].shape[1] == 8
    assert "fingerprint changed" in caplog.text
    c = TokenCache.build(tmp_path, "train", [*TEXTS[:-1], "a different last caption"], minilm_tok, max_length=8)
    assert c.fingerprint != b.fingerprint
    wp = train_wordpiece(TEXTS, vocab_size=200)
    d = TokenCache.build(tmp_path, "train", [*TEXTS[:-1], "a different last caption"], wp, max_length=8)
    assert d.fingerprint != c.fingerprint and d.meta["vocab_size"] == len(wp)


def test_truncated_or_damaged_cache_is_detected_and_rebuilt(tmp_path, minilm_tok, caplog):
    caplog.set_level("INFO")
    TokenCache.build(tmp_path, "train", TEXTS, minilm_tok, max_length=16)
    ids = tmp_path / "train.ids.bin"
    ids.write_bytes(ids.read_bytes()[:-6])
    with pytest.raises(ValueError, match="damaged .*bytes, expected"):
        TokenCache(tmp_path, "train")
    rebuilt = TokenCache.build(tmp_path, "train", TEXTS, minilm_tok, max_length=16)
    assert (
        rebuilt.gather([1])["input_ids"][0].tolist()
        == minilm_tok(TEXTS[1], max_length=16, truncation=True)["input_ids"]
    )
    assert "expected" in caplog.text
    (tmp_path / "train.meta.json").write_text("{not json")
    TokenCache.build(tmp_path, "train", TEXTS, minilm_tok, max_length=16)
    assert json.loads((tmp_path / "train.meta.json").read_text())["n_rows"] == len(TEXTS)


def _build_in_process(args):
    directory, tok_dir, texts = args
    tok = load_tokenizer(tok_dir)
    cache = TokenCache.build(directory, "train", texts, tok, max_length=32)
    return cache.fingerprint, cache.gather(list(range(len(texts))))["input_ids"].tolist()


def test_two_processes_building_at_once_produce_one_valid_cache(tmp_path, minilm_dir):
    texts = [f"caption number {i} with some words {'w' * (i % 7)}" for i in range(3000)]
    ctx = mp.get_context("spawn")
    with ctx.Pool(2) as pool:
        results = pool.map(_build_in_process, [(str(tmp_path), minilm_dir, texts)] * 2)
    assert results[0] == results[1]
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == [
        "train.ids.bin",
        "train.meta.json",
        "train.offsets.npy",
    ]
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_a_hub_name_where_the_hub_cannot_be_reached_is_refused_at_once(monkeypatch):
    """Offline, a hub name not in the cache cost transformers' 28 s of retries and five retry lines: the tokenizer
    and the text model now refuse it at once, naming the host and the download to do instead."""
    from huggingface_hub import constants

    from mmfast.models.encoders import TextEncoder

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # as a user's machine, not this suite, has it
    monkeypatch.setattr(constants, "ENDPOINT", "https://hub.invalid")  # a host no resolver knows
    for proxy in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(proxy, raising=False)
    t0 = time.monotonic()
    for load, what in ((load_tokenizer, "tokenizer"), (TextEncoder, "text model")):
        with pytest.raises(ValueError, match=f"{what} 'nobody-here/no-such-model' is not a local directory") as e:
            load("nobody-here/no-such-model")
        assert "the hub (hub.invalid) cannot be reached" in str(e.value)
        assert "huggingface-cli download nobody-here/no-such-model --local-dir DIR" in str(e.value)
    assert time.monotonic() - t0 < 10


def test_the_hub_probe_asks_the_endpoints_own_port_and_steps_aside_where_it_cannot_know(monkeypatch):
    """A mirror on another port that takes connections is not refused; nor is anything behind a proxy or in
    offline mode, where only the library knows the way (here nothing would answer on port 443)."""
    import socket

    from huggingface_hub import constants

    from mmfast.util.hub import refuse_unreachable_hub

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    for proxy in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(proxy, raising=False)
    with socket.create_server(("127.0.0.1", 0)) as mirror:
        monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{mirror.getsockname()[1]}")
        refuse_unreachable_hub("nobody-here/no-such-model", "text model")  # the mirror answers: no refusal
    monkeypatch.setattr(constants, "ENDPOINT", "https://hub.invalid")
    with pytest.raises(ValueError, match="cannot be reached"):
        refuse_unreachable_hub("nobody-here/no-such-model", "text model")
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.invalid:3128")
    refuse_unreachable_hub("nobody-here/no-such-model", "text model")
    monkeypatch.delenv("HTTP_PROXY")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    refuse_unreachable_hub("nobody-here/no-such-model", "text model")


def test_a_tokenizer_name_one_letter_off_or_a_missing_folder_is_refused_at_once(tmp_path):
    """Offline, the hub spent about a minute of retries on 'minilmm' before failing with no hint: a near miss
    of a short name, and a path that does not exist, are refused before the hub is asked."""
    with pytest.raises(ValueError, match="did you mean 'minilm'"):
        load_tokenizer("minilmm")
    with pytest.raises(ValueError, match="no such directory"):
        load_tokenizer(str(tmp_path / "tokenizer"))
    with pytest.raises(ValueError, match="no such directory"):
        load_tokenizer("./my-tokenizer")
    (tmp_path / "tok").mkdir()
    train_wordpiece(["a cat on a mat", "a dog"], vocab_size=60).save_pretrained(tmp_path / "tok")
    assert load_tokenizer(tmp_path / "tok")("a cat")["input_ids"]  # a real folder still loads


def test_a_tokenizer_folder_named_with_a_tilde_is_found(tmp_path, monkeypatch):
    """'~/tok' from a config file reaches us unexpanded (no shell): it names the home folder's tok."""
    monkeypatch.setenv("HOME", str(tmp_path))
    train_wordpiece(["a cat on a mat", "a dog"], vocab_size=60).save_pretrained(tmp_path / "tok")
    assert load_tokenizer("~/tok")("a cat")["input_ids"]


def test_a_caption_that_is_not_a_string_is_named_before_anything_is_written(tmp_path, minilm_tok):
    """A None caption gave "'NoneType' object has no attribute 'encode'" from inside the fingerprint."""
    with pytest.raises(TypeError, match=r"texts\[1\] \(sample id 11\) is NoneType, not a caption string"):
        TokenCache.build(tmp_path / "tokens", "train", ["a cat", None, "a dog"], minilm_tok, 16, first_id=10)
    assert not (tmp_path / "tokens" / "train.ids.bin").exists()
    cache = TokenCache.build(tmp_path / "tokens", "train", ["a cat", "", "a dog"], minilm_tok, 16, first_id=10)
    assert len(cache) == 3
