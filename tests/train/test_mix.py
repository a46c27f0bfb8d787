"""Weighted mixing (issue: runs that change size, item 3): several prepared datasets trained as one mix
(``mmfast/prepare/mix.py``), each epoch drawn from the sources by ``--data-weights``
(``loading.sampling.MixedOrder``), per-source counts and losses in metrics.jsonl, a resume that continues the
draw exactly. Each test fails on a wrong implementation: weights ignored, the same subset every epoch, an order
that depends on the process count, rows or tokens that lose their source, a resume that draws again."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from conftest import SMALL_RUN

from mmfast.data.dataset import PreparedDataset
from mmfast.data.token_cache import TokenCache
from mmfast.loading.sampling import Layout, MixedOrder
from mmfast.prepare.mix import MixError, prepare_mix
from tools import train as train_tool

RUN = [*SMALL_RUN, "--record-ids", "--mixed-precision", "no", "--num-threads", "1", "--epochs", "2"]
RUN += ["--scheduler", "constant", "--warmup-frac", "0", "--dropout", "0", "--log-every", "1"]


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> tuple[Path, Path]:
    """Two demo sets of other images (200 and 120 rows), the second tokenized with the first's tokenizer."""
    from mmfast.prepare.core import PrepareConfig, prepare_dataset
    from mmfast.prepare.demo import demo_dataset

    root = tmp_path_factory.mktemp("mix-sources")
    a, b = root / "a", root / "b"
    raw_a, raw_b = (
        demo_dataset(n=200, seed=1, root=root / "raw-a"),
        demo_dataset(n=120, seed=2, root=root / "raw-b"),
    )
    prepare_dataset(PrepareConfig(source=str(raw_a), out=str(a), max_length=32, progress=False))
    tok = str(a / "tokenizer")
    prepare_dataset(PrepareConfig(source=str(raw_b), out=str(b), max_length=32, progress=False, tokenizer=tok))
    return a, b


def _layout(n: int, batch: int = 16, shard: int = 0, shards: int = 1, seed: int = 0) -> Layout:
    return Layout(
        n=n, batch_size=batch, shard_id=shard, num_shards=shards, seed=seed, shuffle=True, drop_last=True
    )


def test_each_epoch_draws_each_source_by_its_weight_and_other_rows_each_time():
    """Sources of 400 and 600 rows at 0.7 / 0.3 of 1000 samples: the first is drawn 700 times (every row once,
    300 twice), the second 300 (a different half each epoch); the share of each source in every window of 100
    samples stays within binomial tolerance of its weight (the draws are shuffled together, not in blocks)."""
    groups = np.repeat([0, 1], [400, 600])
    order = MixedOrder(groups, [0.7, 0.3], samples=1000)
    assert order.shares() == [700, 300]
    assert repr(order) == "MixedOrder(sources of [400, 600] rows, weights [0.7, 0.3], 1000 samples per epoch)"
    assert "weights [0.25, 0.75]," in repr(MixedOrder(groups, [1, 3]))  # normalized, as they are drawn
    layout = _layout(len(groups), batch=10)
    epochs = [order.order(layout, e) for e in range(3)]
    for drawn in epochs:
        assert len(drawn) == 1000 and np.bincount(groups[drawn], minlength=2).tolist() == [700, 300]
        a = np.bincount(drawn[groups[drawn] == 0], minlength=400)
        assert a.min() == 1 and a.max() == 2 and (a == 2).sum() == 300  # every row once, then a subset
        b = drawn[groups[drawn] == 1]
        assert len(set(b.tolist())) == 300  # within its share, no row twice
        windows = groups[drawn].reshape(10, 100).mean(axis=1)  # the share of the second source per window
        assert np.all(np.abs(windows - 0.3) < 4 * np.sqrt(0.3 * 0.7 / 100)), windows
    subsets = [set(d[groups[d] == 1].tolist()) for d in epochs]
    assert subsets[0] != subsets[1] != subsets[2]  # another subset each epoch
    assert np.array_equal(order.order(layout, 1), epochs[1])  # a function of (seed, epoch)
    assert not np.array_equal(order.order(_layout(len(groups), batch=10, seed=1), 1), epochs[1])


def test_the_order_is_the_same_on_one_process_and_on_two():
    """What 2 processes read, interleaved batch by batch (rank 0's k-th batch, then rank 1's), is the global
    order 1 process reads: 1 process's micro-batches of 16 are the 2 processes' batches of 16."""
    groups = np.repeat([0, 1, 2], [50, 30, 20])
    order = MixedOrder(groups, [1, 2, 1], samples=160)
    one = order.positions(_layout(100, batch=32), None, epoch=4)
    two = [order.positions(_layout(100, batch=16, shard=r, shards=2), None, epoch=4) for r in range(2)]
    interleaved = np.stack([t.reshape(-1, 16) for t in two], axis=1).reshape(-1)
    assert len(one) == 160 and np.array_equal(interleaved, one)
    assert order.batches(_layout(100, batch=32), None) == 5 == order.batches(_layout(100, 16, 0, 2), None)


def test_bad_weights_are_refused():
    with pytest.raises(ValueError, match="positive"):
        MixedOrder([0, 1], [0.5, 0])
    with pytest.raises(ValueError, match="source 1 of the mix has no rows"):
        MixedOrder([0, 0], [0.5, 0.5])
    from mmfast.train.config import TrainConfig

    with pytest.raises(ValueError, match="2 shares for 3 --data"):
        TrainConfig(data=["a", "b", "c"], data_weights="0.5,0.5")
    with pytest.raises(ValueError, match="positive numbers"):
        TrainConfig(data=["a", "b"], data_weights="0.5,x")
    from mmfast.train.flags import parse_config

    # a negative share given as its own argument: argparse took it for a flag ("expected one argument")
    with pytest.raises(ValueError, match="positive numbers separated by commas, got '-0.7,1.7'"):
        parse_config(["--data", "a", "--data", "b", "--data-weights", "-0.7,1.7"])
    assert parse_config(["--data", "a", "--data", "b", "--data-weights", "0.7,0.3"]).data_weights == "0.7,0.3"


def test_the_mix_keeps_each_rows_source_label_name_and_tokens(sources, tmp_path):
    """Every row of the mix is a row of its source (same image, caption, label name, and token ids), ids are
    new and contiguous (train, then val), and a second call with the same sources reuses the directory."""
    a, b = sources
    summary = prepare_mix([a, b], tmp_path / "mix")
    mix, srcs = PreparedDataset(tmp_path / "mix"), [PreparedDataset(a), PreparedDataset(b)]
    assert [s["name"] for s in mix.mix_sources] == ["a", "b"] and summary["counts"]["classes"] == mix.num_classes
    next_id = 0
    for split in ("train", "val"):
        rows, tokens = mix.rows(split), TokenCache(mix.tokens_dir, split)
        assert [r["id"] for r in rows] == list(range(next_id, next_id + len(rows)))
        next_id += len(rows)
        assert len(rows) == sum(s.split_size(split) for s in srcs)
        for i, src in enumerate(srcs):
            theirs = {r["id"]: r for r in src.rows(split)}
            mine = [r for r in rows if r["source"] == i]
            assert len(mine) == len(theirs)
            names = {v: k for k, v in src.labels.items()}
            mix_names = {v: k for k, v in mix.labels.items()}
            src_tokens = TokenCache(src.tokens_dir, split)
            got = tokens.gather([r["id"] for r in mine])["input_ids"]
            want = src_tokens.gather([r["source_id"] for r in mine])["input_ids"]
            assert got.shape == want.shape and bool((got == want).all())
            for r in mine:
                s = theirs[r["source_id"]]
                assert (r["image"], r["text"], r["size"]) == (s["image"], s["text"], s["size"])
                assert mix_names[r["label"]] == names[s["label"]]
    before = (tmp_path / "mix" / "train.jsonl").stat().st_mtime_ns
    assert prepare_mix([a, b], tmp_path / "mix") == summary
    assert (tmp_path / "mix" / "train.jsonl").stat().st_mtime_ns == before  # reused, not written again


def test_sources_that_cannot_be_mixed_are_refused_naming_them(sources, tmp_path, demo_manifest):
    from mmfast.prepare.core import PrepareConfig, prepare_dataset

    a, _ = sources
    other_tok = tmp_path / "other-tokenizer"  # a WordPiece trained on its own captions
    prepare_dataset(PrepareConfig(source=str(demo_manifest), out=str(other_tok), max_length=32, progress=False))
    with pytest.raises(MixError, match=rf"{other_tok} was tokenized with another tokenizer.*--tokenizer {a}"):
        prepare_mix([a, other_tok], tmp_path / "m1")
    longer = tmp_path / "longer"
    tok = str(a / "tokenizer")
    prepare_dataset(
        PrepareConfig(source=str(demo_manifest), out=str(longer), max_length=48, progress=False, tokenizer=tok)
    )
    with pytest.raises(MixError, match="to 48 tokens"):
        prepare_mix([a, longer], tmp_path / "m2")
    with pytest.raises(MixError, match="given twice"):
        prepare_mix([a, a], tmp_path / "m3")
    from mmfast.inputs.base import InputOptions

    unlabelled, shards = tmp_path / "unlabelled", tmp_path / "shards"
    common = dict(source=str(demo_manifest), max_length=32, progress=False, tokenizer=tok)
    prepare_dataset(PrepareConfig(out=str(unlabelled), inputs=InputOptions(no_labels=True), **common))
    with pytest.raises(MixError, match=rf"{unlabelled} has no labels.*prepare {a} with --no-labels"):
        prepare_mix([unlabelled, a], tmp_path / "m4")
    prepare_dataset(PrepareConfig(out=str(shards), format="wds", **common))
    with pytest.raises(MixError, match=rf"{shards}: its images are read from WebDataset shards"):
        prepare_mix([a, shards], tmp_path / "m5")
    assert not any(
        p.name.startswith(("m1", "m2", "m3", "m4", "m5")) for p in tmp_path.iterdir()
    )  # nothing written


def test_a_raw_input_or_mismatched_weights_in_a_mix_stop_the_run_with_one_line(
    sources, demo_manifest, tmp_path, capsys
):
    a, b = sources
    out = tmp_path / "run"
    assert train_tool.main(["--data", str(a), "--data", str(demo_manifest), "--out", str(out), *RUN]) == 2
    err = capsys.readouterr().err
    assert f"--data {demo_manifest}: a mix (--data given 2 times) takes prepared datasets" in err
    assert "mmfast-prepare" in err and not out.exists()
    argv = ["--data", str(a), "--data", str(b), "--data-weights", "1,1,1", "--out", str(out), *RUN]
    assert train_tool.main(argv) == 2
    assert "--data-weights gives 3 shares for 2 --data" in capsys.readouterr().err
    # fewer samples an epoch than one batch: refused before a run that would train nothing (it exited 0, with
    # an untrained model written)
    argv = ["--data", str(a), "--data", str(b), "--samples-per-epoch", "10", "--out", str(out), *RUN]
    assert train_tool.main(argv) == 2
    err = capsys.readouterr().err
    assert "an epoch of 10 samples (--samples-per-epoch) cannot fill one batch" in err, err
    assert not (out / "model").exists()


def test_an_epoch_too_large_to_order_in_memory_is_refused_naming_the_flag(sources, tmp_path, capsys):
    """--samples-per-epoch holds an epoch's order in memory: above both the split's rows and the bound it is
    refused at once, naming the flag and the bound, instead of allocating gigabytes and blaming --batch-size;
    the bound itself is taken (the order is drawn lazily, per epoch)."""
    from mmfast.train.config import TrainConfig
    from mmfast.train.data import MAX_EPOCH_SAMPLES, train_sampling

    a, b = sources
    dataset = PreparedDataset(a)
    rows = dataset.split_size("train")
    assert isinstance(train_sampling(TrainConfig(samples_per_epoch=MAX_EPOCH_SAMPLES), dataset), MixedOrder)
    limit = MAX_EPOCH_SAMPLES
    want = rf"--samples-per-epoch {limit + 1}: .*use at most {limit} \(the train split has {rows} rows\)"
    with pytest.raises(ValueError, match=want):
        train_sampling(TrainConfig(samples_per_epoch=MAX_EPOCH_SAMPLES + 1), dataset)
    out = tmp_path / "run"
    argv = ["--data", str(a), "--data", str(b), "--samples-per-epoch", "1000000000", "--out", str(out), *RUN]
    assert train_tool.main(argv) == 2
    err = capsys.readouterr().err
    assert "--samples-per-epoch 1000000000: an epoch's order is held in memory" in err and "7.5 GiB" in err, err
    assert "--batch-size" not in err and not (out / "model").exists()


def _seen(run: Path) -> dict[int, list[int]]:
    """{epoch: the sample ids it trained, in order} over every segment of the run (--record-ids)."""
    out: dict[int, list[int]] = {}
    for line in (run / "seen_ids.rank0.jsonl").read_text().splitlines():
        row = json.loads(line)
        out.setdefault(row["epoch"], []).extend(row["ids"])
    return out


def _metrics(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_training_on_a_weighted_mix_draws_and_counts_each_source(sources, tmp_path, capsys):
    """``--data A --data B --data-weights 0.3,0.7``: each epoch trains the global order MixedOrder draws (the
    second source, the smaller, upsampled), metrics.jsonl counts each source's samples as trained, with a
    finite mean loss each; the run's config records both paths and the weights."""
    a, b = sources
    out = tmp_path / "run"
    argv = ["--data", str(a), "--data", str(b), "--data-weights", "0.3,0.7", "--out", str(out), *RUN]
    assert train_tool.main(argv) == 0
    assert f"mixed a ({PreparedDataset(a).split_size('train')} train)" in capsys.readouterr().out
    mix = PreparedDataset(out / "prepared")
    table = mix.table("train")
    order = MixedOrder(table.sources, [0.3, 0.7])
    seen = _seen(out)
    for epoch, m in enumerate(_metrics(out)):
        want = order.positions(_layout(len(table.ids)), None, epoch)
        assert seen[epoch] == table.ids[want].tolist()
        counts = np.bincount(table.sources[want], minlength=2)
        assert [m["sources"][n]["samples"] for n in ("a", "b")] == counts.tolist()
        assert abs(counts[1] / counts.sum() - 0.7) < 0.05  # b is smaller than a, and drawn 0.7 of the time
        assert all(np.isfinite(m["sources"][n]["train_loss"]) for n in ("a", "b"))
    config = json.loads((out / "config.json").read_text())
    assert config["data"] == [str(a), str(b)] and config["data_weights"] == "0.3,0.7"


def test_a_mix_stopped_mid_epoch_resumes_the_same_draw(sources, tmp_path, capsys):
    """Stopped at step 5 of 2 epochs (--max-steps), then resumed: the same samples in the same order, the same
    losses step by step, and the same per-source counts as the run that never stopped."""
    a, b = sources
    mix = ["--data", str(a), "--data", str(b), "--data-weights", "0.6,0.4", "--samples-per-epoch", "160"]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert train_tool.main([*mix, "--out", str(whole), *RUN]) == 0
    losses_whole = capsys.readouterr().out
    assert train_tool.main([*mix, "--out", str(parts), *RUN, "--max-steps", "5"]) == 0
    first = capsys.readouterr().out
    assert train_tool.main([*mix, "--out", str(parts), *RUN, "--resume", "latest"]) == 0
    resumed = capsys.readouterr().out
    assert _seen(parts) == _seen(whole) and len(_seen(whole)[0]) == 160
    step_loss = lambda text: dict(re.findall(r"step (\d+)/\d+: loss (\S+)", text))  # noqa: E731
    assert {**step_loss(first), **step_loss(resumed)} == step_loss(losses_whole)
    assert _metrics(parts)[-1]["sources"] == _metrics(whole)[-1]["sources"]
    assert [m["sources"] for m in _metrics(parts) if m["epoch_complete"]] == [
        m["sources"] for m in _metrics(whole)
    ]
    # a resume with other sources is refused before the run's mixed data is touched
    before = (parts / "prepared" / "prepare.json").read_text()
    other = ["--data", str(b), "--data", str(a), "--data-weights", "0.4,0.6", "--samples-per-epoch", "160"]
    assert train_tool.main([*other, "--out", str(parts), *RUN, "--resume", "latest"]) == 2
    assert "holds the data the run trained on, and the --data given now differs" in capsys.readouterr().err
    assert (parts / "prepared" / "prepare.json").read_text() == before


@pytest.mark.slow
def test_a_mix_stopped_on_two_processes_resumes_on_one_with_the_same_draw(sources, tmp_path):
    """--global-batch-size 32 over a 0.7 / 0.3 mix: stopped after 3 steps on 2 processes and resumed on 1, the
    epoch trains the samples of a run on 1 process that never stopped (as a multiset: the upsampled source's
    repeats included), and metrics.jsonl's per-source counts (summed over the processes, carried in the
    checkpoint) are that run's."""
    import subprocess
    from collections import Counter

    from conftest import ROOT, free_port, train_cmd

    a, b = sources

    def launch(out: Path, n: int, *flags: str):
        launcher = ("-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()))
        cmd = train_cmd(a, out, "--data", str(b), "--data-weights", "0.3,0.7", "--epochs", "1", "--record-ids")
        cmd += ["--mixed-precision", "no", "--global-batch-size", "32", "--no-cache-decoded", *flags]
        cmd = [*cmd[:1], *(launcher if n == 2 else ()), *cmd[1:]]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)

    whole, run = tmp_path / "whole", tmp_path / "run"
    assert (r := launch(whole, 1)).returncode == 0, r.stderr[-3000:]
    assert (r := launch(run, 2, "--max-steps", "3")).returncode == 0, r.stderr[-3000:]
    assert (r := launch(run, 1, "--resume", "latest")).returncode == 0, r.stderr[-3000:]

    def ids(run_dir: Path) -> Counter:
        rows = [json.loads(x) for p in run_dir.glob("seen_ids.rank*.jsonl") for x in p.read_text().splitlines()]
        return Counter(i for r in rows for i in r["ids"])

    assert ids(run) == ids(whole) and max(ids(whole).values()) == 2  # b's rows drawn twice
    counts = lambda d: {k: v["samples"] for k, v in _metrics(d)[-1]["sources"].items()}  # noqa: E731
    table = PreparedDataset(whole / "prepared").table("train")
    drawn = MixedOrder(table.sources, [0.3, 0.7]).positions(
        _layout(len(table.ids), batch=16), None, 0
    )  # 16 x 2 accumulated
    want = np.bincount(table.sources[drawn], minlength=2).tolist()
    assert [counts(run)[n] for n in ("a", "b")] == [counts(whole)[n] for n in ("a", "b")] == want
