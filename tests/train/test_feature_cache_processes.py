"""--feature-cache with several processes (mmfast/train/feature_build.py): the first pass is split across them and
the cache is written once per filesystem; 1 and 2 processes train the same weights on it, and 2 processes on it
train with the decoded run's losses; a build that fails on one process stops all and leaves no cache."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

# both towers locked, no dropout: the trained projections see the same features on 1 and 2 processes
TOWERS = [
    "--model", "clip", "--preset", "clip-lite0-minilm", "--image-backbone", "resnet10", "--text-model",
    "bert-tiny", "--embed-dim", "16", "--freeze-image", "--freeze-text", "--dropout", "0", "--init-proj", "random",
    "--mixed-precision", "no", "--feature-views", "2", "--seed", "3",
]  # fmt: skip
FLAGS = [*TOWERS, "--epochs", "2", "--no-checkpoints"]


def _losses(run: Path) -> list[float]:
    return [json.loads(x)["train_loss"] for x in (run / "metrics.jsonl").read_text().splitlines()]


def _weights(run: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(run / "model-last" / "model.safetensors")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_one_and_two_processes_and_two_machines_train_alike_on_one_build_of_the_cache(demo_manifest, tmp_path):
    """Two epochs over two stored views, batch 16, both towers locked: 1 process accumulating two micro-batches
    and 2 processes (one machine, then two machines of one process sharing the cache folder, each with its own
    locks) end with the same weights. Each cache (the images' and the captions') is written by one process. The
    2-process cached run has the 2-process decoded run's losses. Six train images stop being images after
    preparation: every run masks them and counts all six in ``skipped_samples``, though each process of the
    decoded run reads only its share of them."""
    import shutil

    from conftest import ROOT, free_port, train_cmd

    from mmfast.prepare.core import PrepareConfig, prepare_dataset

    source = tmp_path / "source"
    shutil.copytree(demo_manifest.parent, source)
    prepared = tmp_path / "prepared"
    prepare_dataset(
        PrepareConfig(source=str(source / demo_manifest.name), out=str(prepared), max_length=32, progress=False)
    )
    broken = [json.loads(line) for line in (prepared / "train.jsonl").read_text().splitlines()[10:70:10]]
    for row in broken:
        Path(row["image"]).write_bytes(b"<html>not found</html>")  # a failed download's page

    def launch(out: Path, nodes: tuple[int, ...], *flags: str) -> list[subprocess.Popen]:
        """One launcher per machine, n processes each; each machine with its own lock folder."""
        cmd = train_cmd(prepared, out, *FLAGS, *flags)
        port = str(free_port())
        procs = []
        for rank, n in enumerate(nodes):
            env = {**os.environ, "MMFAST_LOCK_DIR": str(tmp_path / f"locks-{rank}")}
            launcher = ["-m", "torch.distributed.run", "--nproc_per_node", str(n), "--master_port", port]
            if len(nodes) > 1:
                launcher += ["--nnodes", str(len(nodes)), "--node_rank", str(rank), "--master_addr", "127.0.0.1"]
            argv = [*cmd[:1], *(launcher if nodes != (1,) else ()), *cmd[1:]]
            procs.append(
                subprocess.Popen(
                    argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env
                )
            )
        return procs

    def run(out: Path, nodes: tuple[int, ...], *flags: str) -> dict:
        for p in launch(out, nodes, *flags):
            _, err = p.communicate(timeout=600)
            assert p.returncode == 0, err[-3000:]
        return json.loads((out / "summary.json").read_text())

    cached = ["--feature-cache", "on", "--feature-cache-dir"]
    one = run(tmp_path / "one", (1,), *cached, str(tmp_path / "fc-one"), "--grad-accum", "2")
    two = run(tmp_path / "two", (2,), *cached, str(tmp_path / "fc-two"))
    machines = run(tmp_path / "machines", (1, 1), *cached, str(tmp_path / "fc-machines"))
    # streamed, not held decoded: each process reads only its share of the files
    decoded = run(tmp_path / "decoded", (2,), "--feature-cache", "off", "--no-cache-decoded")
    for summary in (one, two, machines):
        for cache in (summary["feature_cache"], summary["feature_cache"]["text"]):
            assert cache["built"] == "no cache yet" and cache["writers"] == 1
    assert two["num_processes"] == machines["num_processes"] == 2 and "feature_cache" not in decoded
    assert json.loads((tmp_path / "fc-two" / "train" / "meta.json").read_text())["views"] == 2
    assert not list((tmp_path / "fc-machines").glob(".*claim*")) and not list((tmp_path / "fc-two").glob(".*tmp"))
    assert len(_losses(tmp_path / "two")) == 2
    assert np.allclose(_losses(tmp_path / "two"), _losses(tmp_path / "decoded"), rtol=1e-5)
    for name in ("one", "two", "machines", "decoded"):
        metrics = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(x)["skipped_samples"] for x in metrics] == [6, 6], name
        listed = [json.loads(x) for x in (tmp_path / name / "skipped.jsonl").read_text().splitlines()]
        assert [(e["id"], e["image"]) for e in listed] == sorted((r["id"], r["image"]) for r in broken), name
    assert np.allclose(_losses(tmp_path / "machines"), _losses(tmp_path / "two"), rtol=1e-6)
    a, b, c = (_weights(tmp_path / r) for r in ("one", "two", "machines"))
    assert a.keys() == b.keys() == c.keys()
    for key in a:
        assert torch.allclose(a[key], b[key], rtol=1e-4, atol=1e-6), (key, float((a[key] - b[key]).abs().max()))
        assert torch.allclose(b[key], c[key], rtol=1e-4, atol=1e-6), key


def _build_worker(rank: int, port: int, directory: str, fail_rank: int, out: str, layout: str) -> None:
    """One process of a 2-process group (gloo, through Accelerate): build the cache of 10 ids, 2 views, each
    process computing its share; ``fail_rank`` raises at its second step (-1: none does). ``layout``: one
    machine, or two sharing the cache's folder, with one lock folder or one each."""
    machines = layout != "one machine"
    os.environ.update(
        RANK=str(rank), LOCAL_RANK="0" if machines else str(rank), WORLD_SIZE="2",
        LOCAL_WORLD_SIZE="1" if machines else "2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        MMFAST_LOCK_DIR=str(Path(out, f"locks-{rank}" if layout == "machines, own locks" else "locks")),
    )  # fmt: skip
    from accelerate import Accelerator

    from mmfast.train.feature_build import Unreadable, build_shared

    accelerator = Accelerator(cpu=True)
    ids = np.arange(0, 20, 2)

    def compute(shard: int, shards: int):
        for k, view in enumerate([0, 1, None]):
            if shard == fail_rank and k == 1:
                raise OSError("disk gone")
            mine = torch.from_numpy(ids[shard::shards])
            mine = mine[mine != 2]  # process 1's sample 2: its image could not be read
            yield view, mine, mine[:, None].float().repeat(1, 3) + (0 if view is None else 100 * (view + 1))
        if shard == 1:
            yield Unreadable([{"id": 2, "image": "/nowhere/2.jpg", "reason": "not an image"}])

    try:
        features, built, writers = build_shared(
            accelerator, directory, {"k": 1}, ids, (2, 3, 8), "float32", compute
        )
        v1 = features.gather(ids, 1)[:, 0].tolist()
        result = {"built": built, "writers": writers, "v1": v1, "absent": sorted(features.absent)}
    except RuntimeError as e:
        result = {"error": str(e)}
    finally:
        # the group ended before the process: gloo's threads outliving it aborted a failed rank at exit
        torch.distributed.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


LAYOUTS = [
    ("one machine", -1),
    ("machines, one lock folder", -1),  # the second machine waits for the first's lock, then reads
    ("machines, own locks", -1),  # both may write: the claims let one
    ("one machine", 1),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("layout", "fail_rank"), LAYOUTS)
def test_two_processes_build_one_cache_and_a_failure_on_one_stops_both(tmp_path, layout, fail_rank):
    """Each process computes half the samples, every process reads all of them; one process writes them, also
    when each process is the main one of its machine and the machines share the cache's folder; a sample whose
    image process 1 could not read is absent on both. When process 1's share fails, both processes raise,
    naming it, and no cache is left."""
    import torch.multiprocessing as mp
    from conftest import free_port

    from mmfast.data.feature_cache import stale_reason

    directory = tmp_path / "fc" / "train"
    mp.spawn(
        _build_worker, args=(free_port(), str(directory), fail_rank, str(tmp_path), layout), nprocs=2, join=True
    )
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    if fail_rank < 0:
        v1 = [0.0 if i == 2 else 200.0 + i for i in range(0, 20, 2)]  # the unreadable one stored as zeros
        for r in results:
            assert r == {"built": "no cache yet", "writers": 1, "v1": v1, "absent": [2]}
        assert stale_reason(directory, {"k": 1}) == "" and not list(directory.parent.glob(".*claim*"))
    else:
        for r in results:
            assert "stopped on process 1: OSError: disk gone" in r["error"], r
        assert not directory.exists() and not [p.name for p in directory.parent.iterdir()]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_processes_on_cached_features_resume_mid_epoch_exactly(prepared, tmp_path):
    """Two processes, three epochs over two views: resumed from the step-3 checkpoint (mid-epoch 0), they read
    the first run's cache, train the same remaining batches on each process and end with the same weights."""
    import shutil

    from conftest import ROOT, free_port, train_cmd
    from safetensors.torch import load_file

    def run(out: Path, *flags: str) -> None:
        launcher = ("-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()))
        cmd = train_cmd(prepared, out, *TOWERS, "--feature-cache", "on", *flags, launcher=launcher)
        cmd += ["--feature-cache-dir", str(tmp_path / "fc"), "--epochs", "3", "--checkpoint-every", "3"]
        cmd += ["--keep-checkpoints", "20", "--record-ids"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
        assert r.returncode == 0, r.stderr[-3000:]

    full, part = tmp_path / "full", tmp_path / "part"
    run(full)
    (part / "checkpoints").mkdir(parents=True)
    shutil.copy(full / ".mmfast-run", part / ".mmfast-run")
    shutil.copytree(full / "checkpoints" / "step-00000003", part / "checkpoints" / "step-00000003")
    run(part, "--resume", "latest")
    assert json.loads((part / "summary.json").read_text())["feature_cache"]["writers"] == 0  # read, not built

    def seen(run_dir: Path, rank: int) -> list:
        return [json.loads(x)["ids"] for x in (run_dir / f"seen_ids.rank{rank}.jsonl").read_text().splitlines()]

    for rank in range(2):
        assert seen(part, rank) == seen(full, rank)[3:]

    def last(run_dir: Path) -> dict:
        return load_file(sorted((run_dir / "checkpoints").iterdir())[-1] / "model.safetensors")

    a, b = last(full), last(part)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
