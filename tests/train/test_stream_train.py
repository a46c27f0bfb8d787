"""Training that streams its shards from an object store (``mmfast.train`` over ``mmfast.loading.stream_source``
and ``mmfast.remote.shard_cache``): moto's S3 server on loopback holds the shards of ``test_stream``, and the
FaultProxy of tools/benchmarks/benchlib stands between s3fs and it where a test injects faults. Each test
compares a run with the fault-free reference run of the same seed, batch for batch, and fails on a wrong
implementation: a transient fault that skips or repeats a batch, or goes uncounted; a permanent one that
spills a traceback, damages the last checkpoint or is retried for ever; a changed shard trained on; a resume
that is not exact once the cache is gone; a first batch that waits for the whole set; a secret written out.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import re
import shutil
import signal
import threading
import time
from contextlib import redirect_stdout
from pathlib import Path

import numpy as np
import pytest
import test_stream
from test_stream import BUCKET, FAKE_SECRET, SHARDS, _loader, prepare

from mmfast.remote.shard_cache import ShardCache
from mmfast.train import engine
from mmfast.util.commands import PREPARE
from tools import train as train_tool
from tools.benchmarks.benchlib.fault_proxy import FaultProxy

# Two epochs of 6 steps (24 train samples, batch 4), every step's loss printed, exact on CPU (no bf16).
RUN = [
    "--epochs", "2", "--batch-size", "4", "--image-size", "32", "--hidden", "32", "--log-every", "1",
    "--record-ids", "--checkpoint-every", "2", "--keep-checkpoints", "10", "--num-threads", "1",
    "--mixed-precision", "no",
]  # fmt: skip
STEP_LINE = re.compile(r"^epoch \d+ step (\d+)/\d+: loss (\S+) ", re.M)
SHARD_GETS = f"/{BUCKET}/shards/*.tar"

# test_stream's fixtures, found here by name: the shards, moto's server holding them, the set prepared from it.
shard_dir, s3_shards, prepared_s3 = test_stream.shard_dir, test_stream.s3_shards, test_stream.prepared_s3


def _train(data: Path, out: Path, cache: Path, *flags: str) -> int:
    return train_tool.main(["--data", str(data), "--out", str(out), "--shard-cache", str(cache), *RUN, *flags])


def _losses(printed: str) -> dict[int, float]:
    """{optimizer step: its loss} from the lines ``--log-every 1`` prints (the last print of a step wins)."""
    return {int(step): float(loss) for step, loss in STEP_LINE.findall(printed)}


def _seen(run: Path) -> list[dict]:
    """--record-ids: one {"epoch", "step", "ids"} per micro-batch trained, in order."""
    return [json.loads(x) for x in (run / "seen_ids.rank0.jsonl").read_text().splitlines()]


def _digest(run: Path) -> str:
    """--record-ids: the SHA-256 of the final weights."""
    return (run / "weights.rank0.sha256").read_text()


def _fetch_threads(before: set[threading.Thread] = frozenset()) -> list[str]:
    """The shard cache's download threads alive in this process, but those in ``before`` (alive before the
    run: another test's cache not yet collected): a run that ended, even by a fault, leaves none fetching
    shards it will never read."""
    return [t.name for t in threading.enumerate() if t.name.startswith("mmfast-shard-fetch") and t not in before]


def _shard_of_id(data: Path) -> dict[int, str]:
    """{train sample id: the URL of its shard}, from the prepared rows."""
    rows = [json.loads(x) for x in (data / "train.jsonl").read_text().splitlines()]
    return {r["id"]: r["tar"] for r in rows}


@pytest.fixture(scope="module")
def reference(prepared_s3, tmp_path_factory) -> dict:
    """The fault-free streaming run every test compares with: its directory, per-step losses, and the shard
    first needed last in epoch 0 (``late``: its first batch is past the step-2 checkpoint)."""
    out = tmp_path_factory.mktemp("reference")
    printed = io.StringIO()
    with redirect_stdout(printed):
        assert _train(prepared_s3, out / "run", out / "cache") == 0
    losses = _losses(printed.getvalue())
    assert sorted(losses) == list(range(1, 13))
    shard_of, first_use = _shard_of_id(prepared_s3), {}
    for row in _seen(out / "run"):
        for sid in row["ids"]:
            first_use.setdefault(shard_of[sid], row["step"])
    late = max(first_use, key=first_use.get)
    assert len(first_use) == SHARDS and first_use[late] >= 4, first_use  # the test data's order, seed 0
    return {"run": out / "run", "losses": losses, "late": late, "shard_of": shard_of}


@pytest.fixture
def proxy(s3_shards, monkeypatch):
    """A FaultProxy in front of moto, AWS_ENDPOINT_URL pointing at it; closed after the test."""
    with FaultProxy(s3_shards) as p:
        monkeypatch.setenv("AWS_ENDPOINT_URL", p.url)
        yield p


def _key(url: str) -> str:
    return url.split(f"s3://{BUCKET}/", 1)[1]


@pytest.mark.slow
def test_transient_faults_mid_run_are_retried_counted_and_change_no_batch(
    prepared_s3,
    reference,
    proxy,
    tmp_path,
    capsys,
):
    """503 twice and a connection dropped mid-body on the shard the run needs last (fetched in the background
    while the first steps train): the run finishes with the reference's batches, losses and weights, and
    retries the faults exactly (no more GETs than faults + one) and counts them in metrics.jsonl and
    summary.json."""
    late = f"/{BUCKET}/{_key(reference['late'])}"
    faults = [proxy.add_fault(late, times=2, status=503), proxy.add_fault(late, times=1, drop_mid_body=True)]
    out = tmp_path / "run"
    assert _train(prepared_s3, out, tmp_path / "cache") == 0
    printed = capsys.readouterr().out
    assert all(f.times == 0 for f in faults)  # every fault was injected
    assert proxy.count(late) == 4  # two 503s, the dropped body, the rest of it from where it stopped
    assert [r["ids"] for r in _seen(out)] == [r["ids"] for r in _seen(reference["run"])]  # nothing skipped
    assert _losses(printed) == reference["losses"]
    assert _digest(out) == _digest(reference["run"])
    summary = json.loads((out / "summary.json").read_text())
    epochs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert summary["shards"]["retries"] == epochs[0]["shards"]["retries"] == 3
    assert summary["shards"]["fetches"] == SHARDS and summary["shards"]["bytes_fetched"] > 0
    assert set(summary["shards"]) == {
        "hits", "misses", "fetches", "bytes_fetched", "retries", "evictions", "fetch_seconds", "wait_seconds",
        "retry_seconds",
    }  # fmt: skip
    assert 0 < summary["shards"]["retry_seconds"] <= summary["shards"]["fetch_seconds"]
    assert "shards           6 fetched" in printed and "3 retries" in printed  # the summary table's line


@pytest.mark.slow
def test_a_shard_gone_mid_run_stops_with_one_line_and_resume_latest_finishes_exactly(
    prepared_s3,
    reference,
    proxy,
    tmp_path,
    capsys,
):
    """404 on the shard needed last: the run stops at its batch (past the step-2 checkpoint) with one line
    naming the shard's URL and what to check, exit 2, no traceback, no retry; once the shard is back,
    ``--resume latest`` continues from that checkpoint to the reference's losses and weights."""
    late = f"/{BUCKET}/{_key(reference['late'])}"
    proxy.add_fault(late, status=404)
    out, cache = tmp_path / "run", tmp_path / "cache"
    before = set(threading.enumerate())
    assert _train(prepared_s3, out, cache) == 2
    printed = capsys.readouterr()
    errors = [line for line in printed.err.splitlines() if line.strip()]  # one line: no traceback, no retries
    assert len(errors) == 1 and errors[0].startswith(f"error: {reference['late']}: not found"), errors
    assert "check the path" in errors[0] and PREPARE in errors[0]
    assert proxy.count(late) == 1 and not _fetch_threads(before)  # a permanent fault is not retried
    done = max(_losses(printed.out))  # the steps it trained before the fault stopped it
    checkpoints = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert checkpoints and all(re.fullmatch(r"step-\d{8}", c) for c in checkpoints)  # none half-written
    step = int(checkpoints[-1][5:])
    assert 2 <= step <= done < 12 and not (out / "summary.json").exists()  # stopped mid-run
    proxy.clear_faults()
    assert _train(prepared_s3, out, cache, "--resume", "latest") == 0
    resumed = _losses(capsys.readouterr().out)
    assert resumed == {k: v for k, v in reference["losses"].items() if k > step}
    rows = _seen(out)  # the steps trained before the fault, then those resumed from the checkpoint
    assert len(rows) == done + 12 - step
    assert [r["ids"] for r in rows[:step] + rows[done:]] == [r["ids"] for r in _seen(reference["run"])]
    assert _digest(out) == _digest(reference["run"])


@pytest.mark.slow
def test_a_shard_changed_after_preparation_is_refused_and_never_trained_on(
    prepared_s3,
    s3_shards,
    reference,
    tmp_path,
    capsys,
):
    """The shard needed last replaced on the server by bytes of the same size (one byte of an image flipped):
    the run stops naming its URL and saying to re-run mmfast-prepare, and none of its samples is trained on."""
    import boto3

    url = reference["late"]
    client = boto3.client("s3", endpoint_url=s3_shards)
    original = client.get_object(Bucket=BUCKET, Key=_key(url))["Body"].read()
    row = next(json.loads(x) for x in (prepared_s3 / "train.jsonl").read_text().splitlines() if url in x)
    changed = bytearray(original)
    changed[row["offset"] + row["nbytes"] // 2] ^= 0xFF
    client.put_object(Bucket=BUCKET, Key=_key(url), Body=bytes(changed))
    try:
        out = tmp_path / "run"
        assert _train(prepared_s3, out, tmp_path / "cache") == 2
    finally:
        client.put_object(Bucket=BUCKET, Key=_key(url), Body=original)
    err = capsys.readouterr().err
    assert f"error: {url}: expected sha256 {hashlib.sha256(original).hexdigest()}" in err, err
    assert f"re-run {PREPARE}" in err and "Traceback" not in err
    trained = {sid for r in _seen(out) for sid in r["ids"]}  # the steps before its first batch
    assert trained and not {sid for sid in trained if reference["shard_of"][sid] == url}
    assert not any((tmp_path / "cache" / "shards").glob(f"*-{url.rsplit('/', 1)[1]}"))  # never cached


@pytest.mark.slow
def test_stopped_mid_epoch_and_resumed_without_the_cache_equals_the_uninterrupted_run(
    prepared_s3,
    reference,
    tmp_path,
    capsys,
    monkeypatch,
):
    """A stop after step 3 (mid-epoch 0): the run checkpoints there and exits 130; with its shard cache
    deleted, ``--resume latest`` fetches the shards again and trains steps 4..12 with the reference's
    batches and losses, to the same weights."""
    real_step = engine.EpochRunner.optimizer_step

    def stop_after_step_3(self):
        real_step(self)
        if self.state["global_step"] == 3 and self.state["epoch"] == 0:
            # what SIGTERM does in the loop (a real signal to this process would stop the test session)
            self.stop.signum = signal.SIGTERM

    out, cache = tmp_path / "run", tmp_path / "cache"
    with monkeypatch.context() as m:
        m.setattr(engine.EpochRunner, "optimizer_step", stop_after_step_3)
        assert _train(prepared_s3, out, cache) == 130
    capsys.readouterr()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000002", "step-00000003"]
    shutil.rmtree(cache)
    assert _train(prepared_s3, out, cache, "--resume", "latest") == 0
    printed = capsys.readouterr().out
    assert _losses(printed) == {k: v for k, v in reference["losses"].items() if k > 3}
    assert [r["ids"] for r in _seen(out)] == [r["ids"] for r in _seen(reference["run"])]
    assert _digest(out) == _digest(reference["run"])
    shards = json.loads((out / "summary.json").read_text())["shards"]
    first = json.loads((reference["run"] / "summary.json").read_text())["shards"]
    assert shards["fetches"] == first["fetches"] == SHARDS  # fetched again, each once
    assert shards["bytes_fetched"] == first["bytes_fetched"]


def test_the_first_batch_needs_only_the_first_shard(prepared_s3, proxy, tmp_path):
    """Every shard but the first of the epoch's order answered after 5 s: the loader's first batch comes
    sooner, with that one shard in the cache and none of the others, and the rest of the epoch follows once
    they arrive. A loader that fetched the whole set first, a window of shards first, or the shards in another
    order, waits for the slow ones."""
    later_s = 5.0
    with ShardCache(tmp_path / "cache", 2**30) as cache:
        loader = _loader(prepared_s3, "stream", train=True, seed=0, shard_cache=cache, batch_size=1)
        source = loader.images.source
        order = source.shard_of[np.asarray(list(loader.images.sampler))]  # each position's shard, in order
        first = int(order[0])
        for k in set(range(SHARDS)) - {first}:
            proxy.add_fault(f"/{BUCKET}/{_key(source.tars[k])}", delay_s=later_s)
        assert proxy.count(SHARD_GETS) == 0  # building the loader fetches nothing
        started = time.monotonic()
        epoch = iter(loader)
        batch = next(epoch)
        waited = time.monotonic() - started
        cached = [k for k, url in enumerate(source.tars) if cache.path_for(url, source.checks[k][1]).exists()]
        fetched_then = cache.stats()["fetches"]
        needed = {int(source.shard_of[p]) for p in np.flatnonzero(np.isin(loader.images.ids, batch["id"].numpy()))}
        rest = list(epoch)
    assert waited < later_s and needed == set(cached) == {first}, (waited, cached, first)
    assert fetched_then == 1
    assert len(rest) == len(loader) - 1 and cache.stats()["fetches"] == SHARDS


def test_no_secret_reaches_the_run_files_logs_or_output(prepared_s3, proxy, minilm_dir, tmp_path, capsys, caplog):
    """Shards at http:// URLs with ``user:password@`` and a ``sig=`` signature (one GET each, through
    the FaultProxy) trained on with a 503 and a dropped body retried, then refused with 403, and the S3 set
    refused with 403 with the fake AWS secret in the environment: neither secret is in config.json,
    summary.json, metrics.jsonl, the checkpoints, the cache's file names, the logs or the output, where the
    URLs are redacted and the credentials named by their variables only."""
    password, signature = "pAsSwOrD-4e9b1c", "SiGnAtUrE-77aa01"
    caplog.set_level(logging.DEBUG, logger="mmfast")
    host = proxy.url.split("://", 1)[1]
    pattern = f"http://alice:{password}@{host}/{BUCKET}/shards/{{00000..{SHARDS - 1:05d}}}.tar?sig={signature}"
    data = prepare(pattern, tmp_path / "prepared", minilm_dir)
    proxy.add_fault(SHARD_GETS, times=1, status=503)
    proxy.add_fault(SHARD_GETS, times=1, drop_mid_body=True)
    runs = [tmp_path / "run", tmp_path / "refused", tmp_path / "refused-s3"]
    before = set(threading.enumerate())
    assert _train(data, runs[0], tmp_path / "cache" / "0", "--epochs", "1") == 0
    proxy.add_fault(SHARD_GETS, status=403)
    assert _train(data, runs[1], tmp_path / "cache" / "1", "--epochs", "1") == 2
    assert _train(prepared_s3, runs[2], tmp_path / "cache" / "2", "--epochs", "1") == 2
    assert not _fetch_threads(before)  # none left to retry once the runs are over
    printed = capsys.readouterr()
    # every logger of the run's process, but moto's server (werkzeug), which logs the requests it gets
    logged = "\n".join(r.getMessage() for r in caplog.records if not r.name.startswith("werkzeug"))
    assert "?sig=***: access denied" in printed.err and "sig=***" in logged  # the URLs are there, redacted
    assert "AWS_SECRET_ACCESS_KEY" in printed.err  # what to check, by name
    written = [p.read_text(errors="replace") for r in runs for p in r.rglob("*.json*") if p.is_file()]
    names = [str(p) for p in (tmp_path / "cache").rglob("*")]
    assert len(written) >= 4 and len(names) > SHARDS
    for text in [*written, *names, logged, printed.out, printed.err]:
        for secret in (password, signature, FAKE_SECRET):
            assert secret not in text
    assert json.loads((runs[0] / "summary.json").read_text())["shards"]["retries"] == 2


@pytest.mark.slow
def test_a_shard_refused_on_two_processes_stops_both_at_the_same_batch(prepared_s3, reference, proxy, tmp_path):
    """Two processes (torchrun, gloo) streaming through one cache, the first request for the shard first needed
    last refused (403): one process gets the refusal, the other fetches the shard itself and could go on. Both
    stop at the same batch, within seconds, not after --dist-timeout (300 s): the refused one with the 403's
    line naming the URL, the other saying it stops there because of that rank's error (the URL again); both
    trained the same micro-batches, and the checkpoints are whole (the last is that batch's step). Without
    the agreement the other process is torn down by the launcher, or waits in the gradient all-reduce."""
    import subprocess
    import sys

    from conftest import ROOT, free_port

    late = f"/{BUCKET}/{_key(reference['late'])}"
    proxy.add_fault(late, status=403, times=1)
    out, cache = tmp_path / "run", tmp_path / "cache"
    torchrun = ("-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()))
    # batch 2 a process: DALI reads 3 batches ahead, so a fault shows a few batches before the batch it is in
    flags = [*RUN, "--batch-size", "2", "--checkpoint-every", "1", "--dist-timeout", "300"]
    cmd = [sys.executable, *torchrun, str(ROOT / "tools" / "train.py"), "--data", str(prepared_s3)]
    cmd += ["--out", str(out), "--shard-cache", str(cache), *flags]
    started = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=200, cwd=ROOT)
    took = time.monotonic() - started
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert done.returncode != 0 and took < 150, (took, done.stderr[-3000:])
    assert len(errors) == 2 and all(reference["late"] in e and "access denied" in e for e in errors), errors
    peers = [e for e in errors if "stopping at batch" in e and "because one could not get its batch" in e]
    assert len(peers) == 1 and str(ROOT / "mmfast") not in done.stderr, done.stderr[-3000:]  # no mmfast traceback
    seen = [(out / f"seen_ids.rank{r}.jsonl").read_text().splitlines() for r in range(2)]
    assert len(seen[0]) == len(seen[1]) >= 1  # the same micro-batches trained on both, then both stopped
    checkpoints = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert checkpoints and all(re.fullmatch(r"step-\d{8}", c) for c in checkpoints), checkpoints
    assert int(checkpoints[-1][5:]) == len(seen[0]) and not (out / "summary.json").exists()
