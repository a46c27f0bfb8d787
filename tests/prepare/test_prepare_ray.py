"""``mmfast-prepare --ray``: the parts of ``prepare/parts.py`` as tasks on a real Ray cluster of two worker nodes
(Ray's own ``cluster_utils``, on loopback: a head without CPUs and two nodes of one CPU each), held against the
one-process preparation of the same input (real photos, with a truncated JPEG, a missing file and a row without
text): the same rows, split, ids, rejects, tokens and fingerprint. A worker killed mid-part is run again; a bad
flag, a missing ray or a bad input is one clear message with exit code 2."""

from __future__ import annotations

import csv
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from conftest import ROOT, write_jsonl
from test_prepare_parts import _content  # what a prepared directory holds, as the --merge tests compare it

from mmfast.cli import prepare as prepare_cli
from mmfast.prepare import ray_parts
from mmfast.prepare.config import PrepareConfig, part_dir, parts_root
from mmfast.prepare.core import prepare_dataset
from mmfast.util.fsutil import dir_lock_path
from mmfast.util.locks import file_lock
from tools.benchmarks.benchlib.data import photo_manifest

N_PARTS = 6
N_PHOTOS = 90
# Ray resolves 127.0.0.1 to the machine's address unless it runs as a one-machine Ray (this variable, read
# when ray is imported): with it, the nodes and the driver all stay on loopback.
_LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """A manifest of N_PHOTOS real photos plus a truncated JPEG, a missing file and a row without text."""
    manifest = photo_manifest(tmp_path_factory.mktemp("ray-data"), n=N_PHOTOS, width=96, height=72, seed=4)
    folder = manifest.parent
    rows = [json.loads(ln) for ln in manifest.read_text().splitlines()]
    good = (folder / rows[0]["image"]).read_bytes()
    (folder / "cut.jpg").write_bytes(good[: len(good) // 3])
    rows.insert(20, {"image": "cut.jpg", "text": "a truncated photo", "label": rows[0]["label"]})
    rows.insert(41, {"image": "gone.jpg", "text": "a photo that is not there", "label": rows[1]["label"]})
    rows.insert(62, {"image": rows[2]["image"], "label": rows[2]["label"]})  # no text
    return write_jsonl(folder / "m.jsonl", rows)


@pytest.fixture(scope="module")
def flags(minilm_dir) -> list[str]:
    # a given tokenizer: the comparisons are about the parts, not the trained vocabulary
    return ["--max-length", "16", "--tokenizer", minilm_dir, "--no-progress"]


@pytest.fixture(scope="module")
def single(data, minilm_dir, tmp_path_factory) -> dict:
    """What the one-process preparation of ``data`` holds."""
    out = tmp_path_factory.mktemp("ray-single") / "out"
    cfg = PrepareConfig(str(data), str(out), tokenizer=minilm_dir, max_length=16, workers=1, progress=False)
    prepare_dataset(cfg)
    return _content(out)


@pytest.fixture(scope="module")
def cluster():
    """The address of a Ray cluster on loopback: a head without CPUs and two worker nodes of one CPU each, shut
    down at the end (on failure too)."""
    with pytest.MonkeyPatch.context() as mp:
        for k, v in _LOOPBACK_ENV.items():
            mp.setenv(k, v)
        pytest.importorskip("ray")  # after the variables: ray reads them when imported
        from ray._private import ray_constants
        from ray.cluster_utils import Cluster

        # An earlier test may have imported ray before the variables were set (tests/cli/ runs before this
        # folder): the driver reads the flag from the module, so set it there too, or it would look for the
        # nodes at the machine's address while they listen on loopback.
        mp.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)

        temp = tempfile.mkdtemp(prefix="mmfast-ray-")  # short: Ray's socket paths must fit in 107 bytes
        # Ray writes the cluster's address under $RAY_TMPDIR/ray, /tmp/ray by default: a folder a fresh machine
        # lacks (and another user's session may own), so the test's own
        os.makedirs(os.path.join(temp, "ray"))
        mp.setenv("RAY_TMPDIR", temp)
        node = {"node_ip_address": "127.0.0.1", "temp_dir": temp, "include_dashboard": False}
        c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, **node})
        try:
            for _ in range(2):
                c.add_node(num_cpus=1, **node)
            c.wait_for_nodes(timeout=60)
            yield c.address
        finally:
            c.shutdown()
            shutil.rmtree(temp, ignore_errors=True)


def _part_lines(messages: list[str]) -> dict[int, list[str]]:
    """The progress lines of a --ray run, by part."""
    lines: dict[int, list[str]] = {}
    for ln in messages:
        if m := re.match(rf"part (\d+)/{N_PARTS}: ", ln):
            lines.setdefault(int(m[1]), []).append(ln)
    return lines


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_parts_on_two_ray_nodes_are_the_one_process_preparation(cluster, data, flags, single, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger=ray_parts.__name__)
    out = tmp_path / "out"
    argv = [str(data), "--out", str(out), *flags, "--ray", cluster]
    assert prepare_cli.main([*argv, "--ray-parts", str(N_PARTS)]) == 0
    assert _content(out) == single
    rejected = [json.loads(ln) for ln in (out / "rejected.jsonl").read_text().splitlines()]
    assert sorted(r["line"] for r in rejected) == [21, 42, 63]  # the truncated JPEG, the missing file, no text
    lines = _part_lines(caplog.messages)
    assert sorted(lines) == list(range(N_PARTS)) and all(len(v) == 1 for v in lines.values()), lines
    nodes = {re.search(r"on node .*\((\S+), (\w{8})\)", v[0])[2] for v in lines.values()}
    assert len(nodes) == 2, lines  # both worker nodes checked parts
    parts = [json.loads((part_dir(out, i, N_PARTS) / "part.json").read_text()) for i in range(N_PARTS)]
    assert sum(p["counts"]["input_rows"] for p in parts) == single["counts"]["input_rows"]
    assert not list(parts_root(out).glob(".ray-token-*"))  # the shared-filesystem token is gone

    # A part lost (a node's disk, a user's rm): the same command, without --ray-parts (the count in OUT.parts),
    # checks that part alone and leaves OUT as it was.
    shutil.rmtree(part_dir(out, 2, N_PARTS))
    before = (out / "prepare.json").read_bytes()
    caplog.clear()
    assert prepare_cli.main(argv) == 0
    lines = _part_lines(caplog.messages)
    assert sorted(lines) == list(range(N_PARTS))
    assert [i for i, v in lines.items() if "complete already" not in v[0]] == [2], lines
    assert (out / "prepare.json").read_bytes() == before and _content(out) == single


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_relative_paths_mean_what_they_mean_where_the_command_runs(
    cluster, data, flags, minilm_dir, tmp_path, monkeypatch
):
    # The workers run in the folder their node was started in, not this one: each part moves to the command's.
    monkeypatch.chdir(tmp_path)
    source = os.path.relpath(data, tmp_path)
    assert not os.path.isabs(source) and Path(source).is_file()
    cfg = PrepareConfig(source, "single", tokenizer=minilm_dir, max_length=16, workers=1, progress=False)
    prepare_dataset(cfg)
    assert prepare_cli.main([source, "--out", "out", *flags, "--ray", cluster, "--ray-parts", "3"]) == 0
    assert _content(tmp_path / "out") == _content(tmp_path / "single")  # the fingerprint of the same paths too


def _part_worker(proc: subprocess.Popen, i: int, n: int, deadline: float, other_than: frozenset = frozenset()):
    """The Ray worker process running part i of n (its title is 'ray::mmfast part i/n') of the command ``proc``,
    waited for."""
    import psutil

    title = f"ray::mmfast part {i}/{n}"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the command ended ({proc.returncode}) first:\n{proc.stdout.read()[-3000:]}")
        for p in psutil.process_iter(["cmdline"]):
            cmd = p.info["cmdline"] or []
            if cmd and cmd[0] == title and p.pid not in other_than:
                return p
        time.sleep(0.05)
    raise AssertionError(f"no process titled {title!r} (other than {sorted(other_than)}) in time")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_part_whose_worker_is_killed_is_run_again_and_the_result_is_the_same(
    cluster, data, flags, single, tmp_path
):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "mmfast.cli.prepare", str(data), "--out", str(out), *flags]
    cmd += ["--ray", cluster, "--ray-parts", str(N_PARTS)]
    env = {**os.environ, **_LOOPBACK_ENV}
    # Part 1's task waits for its lock, inside the part, while the test holds it: it is killed there, for sure.
    with file_lock(dir_lock_path(part_dir(out, 1, N_PARTS))):
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        try:
            first = _part_worker(proc, 1, N_PARTS, time.monotonic() + 90)
            first.kill()  # SIGKILL: the worker dies as on an out-of-memory kill
            first.wait(10)
            again = _part_worker(proc, 1, N_PARTS, time.monotonic() + 60, other_than=frozenset({first.pid}))
        except BaseException:
            proc.kill()
            raise
    text, _ = proc.communicate(timeout=150)
    assert proc.returncode == 0, text[-4000:]
    assert again.pid != first.pid and not first.is_running()
    assert _content(out) == single
    lines = _part_lines(text.splitlines())
    assert sorted(lines) == list(range(N_PARTS)) and len(lines[1]) == 1, lines  # reported once: run once more
    assert not list(parts_root(out).glob(".*.tmp"))  # nothing left of the killed try


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_bad_input_on_the_cluster_is_one_message_naming_the_part_and_exit_2(cluster, data, flags, tmp_path):
    rows = [json.loads(ln) for ln in data.read_text().splitlines()]
    manifest = data.parent / "m.csv"
    with open(manifest, "w", newline="") as f:
        w = csv.DictWriter(f, ["image", "text", "label"])
        w.writeheader()
        w.writerows({"text": "", **r} for r in rows)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "mmfast.cli.prepare", str(manifest), "--out", str(out), *flags]
    cmd += ["--image-column", "picture", "--ray", cluster, "--ray-parts", "3"]
    run = subprocess.run(
        cmd, cwd=ROOT, env={**os.environ, **_LOOPBACK_ENV}, capture_output=True, text=True, timeout=150
    )
    assert run.returncode == 2, run.stderr[-3000:]
    errors = [ln for ln in run.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1, run.stderr[-3000:]
    assert re.match(r"error: part \d/3 \(on node .+\): .*m\.csv:1: CSV header .* lacks \['picture'\]", errors[0])
    assert "Traceback" not in run.stderr + run.stdout and "RayTaskError" not in run.stderr + run.stdout
    assert not out.exists() and not list(parts_root(out).glob("*-of-*"))


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--ray", "--shard", "0/2"], "without --shard or --merge"),
        (["--ray", "--merge"], "without --shard or --merge"),
        (["--ray-parts", "3"], "goes with --ray"),
        (["--ray", "--ray-parts", "0"], "goes with --ray"),
    ],
)
def test_a_bad_ray_flag_is_refused_with_exit_2(extra, message, data, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        prepare_cli.main([str(data), "--out", str(tmp_path / "out"), *extra])
    assert e.value.code == 2 and message in capsys.readouterr().err
    assert not parts_root(tmp_path / "out").exists()


def test_ray_before_source_names_the_mistake(data, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        prepare_cli.main(["--out", str(tmp_path / "out"), "--ray", str(data)])
    assert e.value.code == 2
    assert f"--ray took '{data}' for the cluster's address: put SOURCE before --ray" in capsys.readouterr().err


def test_without_ray_installed_ray_is_refused_with_the_install_command(data, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray: ImportError, as when it is not installed
    assert prepare_cli.main([str(data), "--out", str(tmp_path / "out"), "--ray"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "error: --ray needs Ray, which is not installed: pip install 'mmfast[ray]'"
    assert not parts_root(tmp_path / "out").exists()


def test_a_missing_input_is_refused_before_a_cluster_is_asked(tmp_path, monkeypatch, capsys):
    for k, v in _LOOPBACK_ENV.items():  # should this import ray first
        monkeypatch.setenv(k, v)
    pytest.importorskip("ray")
    assert prepare_cli.main([str(tmp_path / "nothing.jsonl"), "--out", str(tmp_path / "out"), "--ray"]) == 2
    err = capsys.readouterr().err
    assert "nothing.jsonl: no such manifest" in err and "Traceback" not in err
    assert not parts_root(tmp_path / "out").exists()


def test_the_part_count_follows_the_parts_already_there(tmp_path):
    out = tmp_path / "out"
    assert ray_parts.part_count(out, None, slots=3) == 3 * ray_parts.PARTS_PER_SLOT
    assert ray_parts.part_count(out, 5, slots=3) == 5
    with pytest.raises(ray_parts.RayPartsError, match="pass --ray-parts N"):
        ray_parts.part_count(out, None, slots=0)
    part_dir(out, 0, 4).mkdir(parents=True)
    (parts_root(out) / ".00001-of-00004.abc.tmp").mkdir()  # a killed part's leftover: not a part
    assert ray_parts.part_count(out, None, slots=3) == 4  # a re-run completes the parts that are there
    assert ray_parts.part_count(out, 4, slots=3) == 4
    with pytest.raises(ray_parts.RayPartsError, match=r"in 4 parts.*pass --ray-parts 4 .* or remove"):
        ray_parts.part_count(out, 6, slots=3)
    part_dir(out, 0, 2).mkdir()
    with pytest.raises(ray_parts.RayPartsError, match=r"in 2 and 4 parts"):
        ray_parts.part_count(out, None, slots=3)


def test_a_node_that_does_not_see_the_out_folder_is_named(tmp_path):
    token = tmp_path / "out.parts" / ".ray-token-x"
    token.parent.mkdir()
    token.write_text("abc")
    cfg = PrepareConfig(source="data/m.jsonl", out=str(tmp_path / "out"))
    check = ray_parts.SharedCheck(str(token), "abc", str(tmp_path), "head-machine")
    ray_parts.check_shared(check, cfg, "node n2 (10.0.0.2, 1234abcd)")  # sees it: no error
    for wrong in (
        ray_parts.SharedCheck(str(token), "other", str(tmp_path), "head-machine"),
        ray_parts.SharedCheck(str(tmp_path / "nothing"), "abc", str(tmp_path), "head-machine"),
    ):
        with pytest.raises(
            ray_parts.PartFailed,
            match=r"node n2 \(10\.0\.0\.2, 1234abcd\) does not see .* "
            "as head-machine.*same path, on a shared filesystem",
        ):
            ray_parts.check_shared(wrong, cfg, "node n2 (10.0.0.2, 1234abcd)")
    elsewhere = ray_parts.SharedCheck(str(token), "abc", str(tmp_path / "no-such-dir"), "head-machine")
    with pytest.raises(ray_parts.PartFailed, match="has no folder .*no-such-dir.*data/m.jsonl is relative"):
        ray_parts.check_shared(elsewhere, cfg, "node n2")
    absolute = PrepareConfig(source=str(tmp_path / "m.jsonl"), out=str(tmp_path / "out"))
    ray_parts.check_shared(elsewhere, absolute, "node n2")  # absolute paths: the folder is not needed


@pytest.fixture()
def ray_exceptions(monkeypatch):
    for k, v in _LOOPBACK_ENV.items():  # should this import ray first (see the cluster fixture)
        monkeypatch.setenv(k, v)
    return pytest.importorskip("ray.exceptions")


def test_a_failed_part_is_told_by_its_cause(ray_exceptions):
    x = ray_exceptions
    own = x.RayTaskError("run_part", "tb", ray_parts.PartFailed("part 1/4 (on node n2): m.csv: no rows", ""))
    assert str(ray_parts.part_error(x, own, 1, 4)) == "part 1/4 (on node n2): m.csv: no rows"
    bug = ray_parts.PartFailed("part 1/4 (on node n2): KeyError: 'k'", "Traceback (most recent call last): ...")
    assert str(ray_parts.part_error(x, x.RayTaskError("run_part", "tb", bug), 1, 4)).splitlines() == [
        "part 1/4 (on node n2): KeyError: 'k'",
        "Traceback (most recent call last): ...",  # a bug: the task's traceback comes along
    ]
    missing = x.RayTaskError(
        "run_part",
        "ModuleNotFoundError: No module named 'mmfast'",
        RuntimeError("failed to import"),
        ip="10.0.0.7",
    )
    assert re.fullmatch(
        r"part 2/4: mmfast cannot be imported on the Ray node 10\.0\.0\.7: install it on every node.*"
        r"\(pip install 'mmfast\[ray\]'\).*runtime_env",
        str(ray_parts.part_error(x, missing, 2, 4)),
    )
    died = str(ray_parts.part_error(x, x.WorkerCrashedError(), 3, 4))
    assert died.startswith("part 3/4 did not complete: WorkerCrashedError: ")
    assert f"died on each of {ray_parts.MAX_RETRIES + 1} tries" in died and "makes only the others" in died
