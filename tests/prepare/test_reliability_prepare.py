"""Fault injection on the preparation side: output directories that are not mmfast's, kills during the
directory swap and during validation, labels of any kind, un-encodable text, huge images, full disks, and
inputs that are not what they look like. Each test asserts the exact outcome."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from conftest import ROOT, save_image, write_jsonl

from mmfast import fsutil
from mmfast.data.validate import pixel_budget_reason
from mmfast.inputs import read_source
from mmfast.inputs.manifest import ManifestError, read_input
from mmfast.prepare.core import PREPARE_VERSION, PrepareConfig, prepare_dataset
from mmfast.prepare.demo import demo_dataset
from mmfast.prepare.fingerprint import input_fingerprint, listing
from mmfast.util.fsutil import MARKER, RUN_MARKER, claim_output_dir, file_sha256
from tools import prepare_data

FILES = {"train.jsonl", "val.jsonl", "labels.json", "rejected.jsonl"}


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln]


def _tree(root: Path) -> dict[str, bytes]:
    """Every file below ``root`` with its bytes (to assert that a directory was left exactly as it was)."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _manifest(folder: Path, labels: list, n_img: int = 4, text: str = "a small picture number {i}") -> Path:
    """A manifest with one row per label, cycling over ``n_img`` tiny images in ``folder/img``."""
    for k in range(n_img):
        save_image(folder / "img" / f"{k}.png", size=(16, 12), seed=k)
    rows = [
        {"image": f"img/{i % n_img}.png", "text": text.format(i=i), "label": lab} for i, lab in enumerate(labels)
    ]
    return write_jsonl(folder / "m.jsonl", rows)


def _prepare(manifest: Path, out: Path, **kw) -> dict:
    kw = {"max_length": 16, "vocab_size": 200, "workers": 1, "progress": False, **kw}
    return prepare_dataset(PrepareConfig(source=str(manifest), out=str(out), **kw))


# 1. What the user owns is never deleted or overwritten.


def test_out_holding_user_files_or_a_file_is_refused_and_left_untouched(tmp_path, capsys):
    m = _manifest(tmp_path / "data", ["a", "b"] * 3)
    mine = tmp_path / "mine"
    (mine / "sub").mkdir(parents=True)
    (mine / "thesis.tex").write_text("three years of work")
    (mine / "sub" / "prepare.json").write_text('{"not": "from mmfast"}')
    before = _tree(mine)
    assert prepare_data.main([str(m), "--out", str(mine), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"--out {mine} already exists and was not prepared by mmfast" in err and MARKER in err
    assert "nothing in it was changed" in err and err.startswith("error: ")
    assert _tree(mine) == before
    afile = tmp_path / "notes.txt"
    afile.write_text("keep")
    assert prepare_data.main([str(m), "--out", str(afile), "--no-progress"]) == 2
    assert "is a file, not a directory" in capsys.readouterr().err and afile.read_text() == "keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "mine", "notes.txt"]  # no lock files


def test_empty_marked_and_legacy_directories_are_replaced(tmp_path):
    m = _manifest(tmp_path / "data", ["a", "b"] * 3)
    empty = tmp_path / "empty"
    empty.mkdir()
    _prepare(m, empty)
    assert json.loads((empty / MARKER).read_text()) == {"kind": "mmfast prepared dataset", "version": 2}
    _prepare(m, empty, seed=3)  # a marked directory is replaced
    assert json.loads((empty / "prepare.json").read_text())["config"]["seed"] == 3
    legacy = tmp_path / "legacy"  # written by mmfast before the marker existed
    legacy.mkdir()
    (legacy / "prepare.json").write_text(json.dumps({"version": 1, "input_fingerprint": "x", "counts": {}}))
    (legacy / "train.jsonl").write_text("{}\n")
    _prepare(m, legacy)
    assert (legacy / MARKER).is_file() and json.loads((legacy / "prepare.json").read_text())[
        "version"
    ] == PREPARE_VERSION


def test_folders_mmfast_wrote_beside_the_manifest_leave_its_fingerprint_alone(tmp_path):
    """A run or an export inside the manifest's folder is not input: a run there changes as it trains, and
    each resume would prepare the data again. A file of the user's there is input, and so is a prepared
    dataset (a manifest may name its images). Where nothing is mmfast's, the listing is rglob's, so earlier
    preparations keep their fingerprint."""
    manifest = demo_dataset(n=8, seed=1, root=tmp_path)
    data = manifest.parent
    assert listing(data) == sorted(data.rglob("*"))
    cfg = PrepareConfig(source=str(manifest), out=str(tmp_path / "prepared"), max_length=16, progress=False)
    prepare_dataset(PrepareConfig(source=str(manifest), out=str(data / "prep"), max_length=16, progress=False))
    first = input_fingerprint(cfg)
    run = data / "runs" / "a"
    (run / "checkpoints").mkdir(parents=True)
    (run / RUN_MARKER).write_text("")
    (run / "checkpoints" / "step-1.pt").write_bytes(b"1")
    (claim_output_dir(data / "export", "export") / "model.onnx").write_bytes(b"2")
    assert input_fingerprint(cfg) == first
    (data / "runs" / "notes.txt").write_text("mine")  # a folder without a marker is the user's
    assert input_fingerprint(cfg) != first
    listed = {p.name for p in listing(data)}
    assert listed >= {"runs", "a", "export", "prep", "prepare.json", "notes.txt"}  # a prepared dataset's files
    assert not {"step-1.pt", "model.onnx"} & listed


def test_an_image_folder_takes_no_class_from_an_evaluation_or_run_written_into_it(tmp_path):
    """mmfast-evaluate --out photos/eval writes confusion.png there: it is no class "eval", as it is no input
    to the fingerprint."""
    root = tmp_path / "photos"
    for i, cls in enumerate(("cat", "dog")):
        save_image(root / cls / "a.jpg", seed=i)
    save_image(claim_output_dir(root / "eval", "evaluation") / "confusion.png", fmt="PNG")
    run = root / "runs"
    run.mkdir()
    (run / RUN_MARKER).write_text("")
    save_image(run / "profile.png", fmt="PNG")
    cands, _, kind = read_source(root)
    assert {c.label for c in cands} == {"cat", "dog"}, kind


def test_out_that_contains_the_input_is_refused(tmp_path, capsys):
    data = tmp_path / "data"
    m = _manifest(data, ["a", "b"] * 3)
    before = _tree(data)
    assert prepare_data.main([str(m), "--out", str(data), "--no-progress"]) == 2  # the manifest's own folder
    assert f"--out {data} contains the input {m}" in capsys.readouterr().err
    assert _tree(data) == before
    # images inside a previous (mmfast-marked) prepared directory: replacing it would delete them
    out = tmp_path / "out"
    _prepare(m, out)
    (out / "extra.png").write_bytes((data / "img" / "0.png").read_bytes())
    rows = [{"image": str(data / "img" / "1.png"), "text": "t", "label": "a"}]
    rows += [{"image": str(out / "extra.png"), "text": "u", "label": "b"}]
    m2 = write_jsonl(tmp_path / "m2.jsonl", rows)
    kept = _tree(out)
    assert prepare_data.main([str(m2), "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"{m2}, line 2: image {out / 'extra.png'} is inside --out {out}" in err
    assert _tree(out) == kept
    (tmp_path / "by-folder").symlink_to(out)  # the same image through a symlinked folder, or a symlinked file
    (tmp_path / "by-file.png").symlink_to(out / "extra.png")
    for k, linked in enumerate((tmp_path / "by-folder" / "extra.png", tmp_path / "by-file.png")):
        m3 = write_jsonl(tmp_path / f"m3-{k}.jsonl", [rows[0], {"image": str(linked), "text": "u", "label": "b"}])
        assert prepare_data.main([str(m3), "--out", str(out), "--no-progress"]) == 2
        assert f"{m3}, line 2: image {linked} is inside --out {out}" in capsys.readouterr().err
        assert _tree(out) == kept
    folder = tmp_path / "folder"  # an image folder with --out inside it would read --out as a class
    save_image(folder / "cat" / "1.png")
    assert prepare_data.main([str(folder), "--out", str(folder / "prepared"), "--no-progress"]) == 2
    assert "is inside the image folder" in capsys.readouterr().err and not (folder / "prepared").exists()
    shards = tmp_path / "shards"  # a folder of WebDataset shards is no image folder: no classes in the advice
    shards.mkdir()
    (shards / "00000.tar").write_bytes(b"")
    assert prepare_data.main([str(shards), "--out", str(shards / "prepared"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"is inside the input folder {shards}; pass an --out outside it" in err and "class" not in err


# 2. A kill at any instant of the directory swap leaves the old or the new directory.

_SWAP_CHILD = textwrap.dedent(
    """
    import importlib.util, os, shutil, signal, sys
    from pathlib import Path
    # fsutil alone (no torch, DALI): each of the many kills below costs a fresh interpreter
    spec = importlib.util.spec_from_file_location("fsutil", sys.argv[1])
    fsutil = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fsutil)
    final, kill_at, mode = Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    calls = [0]

    def counted(fn):
        def wrapper(*a, **k):
            calls[0] += 1
            if calls[0] == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return fn(*a, **k)
        return wrapper

    for mod, name in [(os, "mkdir"), (os, "replace"), (os, "rename"), (os, "rmdir"), (os, "unlink"),
                      (shutil, "rmtree"), (fsutil, "write_marker"), (fsutil, "_exchange")]:
        setattr(mod, name, counted(getattr(mod, name)))
    if mode == "fallback":  # a kernel or filesystem without renameat2(RENAME_EXCHANGE)
        fsutil._renameat2 = lambda: None
    with fsutil.atomic_dir(final) as tmp:
        (tmp / "sub").mkdir()
        for name in ("a", "b", "sub/c"):
            (tmp / name).write_text("new")
    print("completed")
    """
)


def _version(final: Path) -> str:
    """'old' or 'new' when ``final`` is one complete version; what it holds otherwise."""
    files = {p.relative_to(final).as_posix(): p.read_text() for p in final.rglob("*") if p.is_file()}
    files.pop(MARKER, None)
    for v in ("old", "new"):
        if files == {"a": v, "b": v, "sub/c": v}:
            return v
    return repr(files)


@pytest.mark.parametrize("mode", ["exchange", "fallback"])
def test_kill_at_every_step_of_the_swap_leaves_old_or_new(tmp_path, mode):
    final = tmp_path / "ds"
    outcomes = []
    for kill_at in range(1, 40):
        if final.exists():
            fsutil.remove_ours(final)
        with fsutil.atomic_dir(final) as tmp:
            (tmp / "sub").mkdir()
            for name in ("a", "b", "sub/c"):
                (tmp / name).write_text("old")
        child = subprocess.run(
            [sys.executable, "-c", _SWAP_CHILD, fsutil.__file__, str(final), str(kill_at), mode],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if child.returncode == 0:
            assert child.stdout.strip() == "completed" and _version(final) == "new"
            break
        assert child.returncode == -signal.SIGKILL, child.stderr
        if mode == "exchange":  # one atomic step: never a moment without a complete directory
            assert _version(final) in ("old", "new"), kill_at
        fsutil.recover_dir(final)  # what the next run does first, under the lock
        outcomes.append(_version(final))
        assert outcomes[-1] in ("old", "new"), kill_at
        assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"], kill_at  # no leftovers
    else:
        pytest.fail("the swap never completed")
    assert "old" in outcomes and "new" in outcomes  # the kills fell both before and after the swap


def test_leftovers_of_killed_runs_are_cleaned_and_foreign_ones_kept(tmp_path):
    m = _manifest(tmp_path / "data", ["a", "b"] * 3)
    out = tmp_path / "ds"
    first = _prepare(m, out)
    ours = tmp_path / ".ds.k1.tmp"  # a killed run's temp dir: the marker is its first file
    (ours / "tokens").mkdir(parents=True)
    (ours / MARKER).write_text("")  # killed while writing the marker
    empty = tmp_path / ".ds.k2.tmp"  # killed before even the marker
    empty.mkdir()
    foreign = tmp_path / ".ds.k3.tmp"  # the same pattern, but not mmfast's
    foreign.mkdir()
    (foreign / "keep.txt").write_text("user data")
    os.replace(out, tmp_path / ".ds.old")  # killed between the two renames of the fallback swap
    assert _prepare(m, out) == first  # the old directory is back, and reused
    assert sorted(p.name for p in tmp_path.iterdir()) == [".ds.k3.tmp", "data", "ds"]
    assert (foreign / "keep.txt").read_text() == "user data"


# 4. Labels of any kind map to contiguous class ids.


@pytest.mark.parametrize(
    "labels", [[1, 2, 3, 4], [0, 5, 17, 42], [-1, 0, 3, 10], ["10", "9", "cat", "ant"]], ids=str
)
def test_labels_map_to_contiguous_class_ids(tmp_path, labels):
    m = _manifest(tmp_path, labels * 3)
    summary = _prepare(m, tmp_path / "out", val_fraction=0.0)
    label_map = json.loads((tmp_path / "out" / "labels.json").read_text())
    ordered = sorted(labels)  # numeric order for integers, string order for strings
    assert label_map == {str(v): i for i, v in enumerate(ordered)}
    rows = _jsonl(tmp_path / "out" / "train.jsonl")
    assert [r["label"] for r in rows] == [ordered.index((labels * 3)[r["line"] - 1]) for r in rows]
    assert summary["counts"]["classes"] == 4 and summary["counts"]["rejected"] == 0


# 5. Text that cannot be encoded is a rejected row with its line and reason.


def test_unencodable_text_is_a_rejected_row_with_its_line(tmp_path):
    folder = tmp_path / "data"
    for k in range(2):
        save_image(folder / "img" / f"{k}.png", size=(16, 12), seed=k)
    lines = [
        '{"image": "img/0.png", "text": "fine caption", "label": "a"}',
        '{"image": "img/1.png", "text": "bad \\ud800 caption", "label": "a"}',
        '{"image": "img/0.png", "text": "bad label", "label": "b\\udcff"}',
        '{"image": "img/\\ud83d.png", "text": "bad path", "label": "a"}',
        '{"image": "img/1.png", "text": "another fine one", "label": "b", "note": "\\ud800"}',
        '{"text": "no image, surrogate kept in rejected.jsonl \\udfff", "label": "a"}',
    ]
    m = folder / "m.jsonl"
    m.write_text("\n".join(lines) + "\n")
    summary = _prepare(m, tmp_path / "out", val_fraction=0.0)
    rejected = {r["line"]: r for r in _jsonl(tmp_path / "out" / "rejected.jsonl")}
    assert sorted(rejected) == [2, 3, 4, 6]
    assert rejected[2]["reason"] == (
        "text cannot be encoded as UTF-8 (lone surrogate '\\ud800' at character 4); fix the text"
    )
    assert rejected[3]["reason"].startswith("label cannot be encoded as UTF-8")
    assert rejected[4]["reason"].startswith("image path cannot be encoded as UTF-8")
    assert rejected[6]["reason"] == "missing field 'image'" and rejected[6]["row"]["text"].endswith("\udfff")
    assert [r["line"] for r in _jsonl(tmp_path / "out" / "train.jsonl")] == [1, 5]
    assert summary["counts"]["accepted"] == 2

    root = tmp_path / "folder"  # an image folder: file names that are not UTF-8, a sidecar that is not
    save_image(root / "cat" / "ok.png")
    save_image(root / "cat" / "side.png")
    (root / "cat" / "side.png.txt").write_bytes(b"caf\xe9 \xed\xa0\x80")
    save_image(root / "dog" / "ok.png")
    with open(os.fsencode(root / "dog") + b"/bad\xff.png", "wb") as f:
        f.write((root / "dog" / "ok.png").read_bytes())
    cands, rejects, _ = read_input(root)
    assert [(Path(c.image).parent.name, Path(c.image).name) for c in cands] == [
        ("cat", "ok.png"),
        ("dog", "ok.png"),
    ]
    assert [(r.line, r.reason) for r in rejects] == [
        (2, "caption side.png.txt is not UTF-8 (invalid continuation byte at byte 3)"),
        (
            3,
            "image path cannot be encoded as UTF-8 (lone surrogate '\\udcff' at character 7); fix the text "
            "(rename the file or folder)",
        ),
    ]
    summary = _prepare(root, tmp_path / "out2", val_fraction=0.0)
    assert summary["counts"] == {"input_rows": 4, "accepted": 2, "rejected": 2, "train": 2, "val": 0, "classes": 2}


# 8. The prepared directory is verifiable.


def test_prepare_json_records_every_file_and_a_changed_one_is_rebuilt(tmp_path, caplog):
    caplog.set_level("INFO")
    m = _manifest(tmp_path / "data", ["a", "b"] * 4)
    out = tmp_path / "out"
    summary = _prepare(m, out)
    expected = (
        FILES
        | {f"tokens/{s}.{ext}" for s in ("train", "val") for ext in ("ids.bin", "offsets.npy", "meta.json")}
        | {f"tokenizer/{p.name}" for p in (out / "tokenizer").iterdir()}
    )
    assert summary["version"] == PREPARE_VERSION and set(summary["files"]) == expected
    for rel, rec in summary["files"].items():
        assert rec == {"size": (out / rel).stat().st_size, "sha256": file_sha256(out / rel)}
    assert json.loads((out / "prepare.json").read_text()) == summary
    newest = max(p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file())
    assert (out / "prepare.json").stat().st_mtime_ns == newest  # written last

    ids = out / "tokens" / "train.ids.bin"  # same size, other bytes: only the hash tells
    good = ids.read_bytes()
    ids.write_bytes(bytes(len(good)))
    assert _prepare(m, out) == summary and ids.read_bytes() == good
    assert "token cache changed since preparation (tokens/train.ids.bin); rebuilding it" in caplog.text

    train = out / "train.jsonl"  # an edited caption: the rows are not rebuilt from themselves
    original = train.read_bytes()
    train.write_bytes(original.replace(b"a small picture", b"A SMALL PICTURE", 1))
    again = _prepare(m, out)
    assert train.read_bytes() == original
    for rel, rec in again["files"].items():  # the tokenizer trainer breaks ties differently run to run
        assert rec == {"size": (out / rel).stat().st_size, "sha256": file_sha256(out / rel)}
    assert "train.jsonl changed since preparation; preparing again" in caplog.text


# 6. Memory is bounded by construction: a decoded-pixel budget, from the header.


def test_images_over_the_pixel_budget_are_rejected_from_the_header(tmp_path, capsys):
    from PIL import Image

    m = _manifest(tmp_path, ["a", "b"] * 3)
    for k in range(2):  # ~11 KB on disk each, 88 MP (265 MB as RGB) decoded
        Image.new("1", (9400, 9400), color=k).save(tmp_path / "img" / f"huge{k}.png")
    assert (tmp_path / "img" / "huge0.png").stat().st_size < 20_000
    with open(m, "a") as f:
        f.write(json.dumps({"image": "img/huge0.png", "text": "big", "label": "a"}) + "\n")
        f.write(json.dumps({"image": "img/huge1.png", "text": "big too", "label": "b"}) + "\n")
    reason = "image is 9400x9400 = 88.4 MP, over the 64 MP budget (max_pixels=); downscale it"  # a Python caller's
    assert pixel_budget_reason(tmp_path / "img" / "huge0.png", 64_000_000) == reason
    assert pixel_budget_reason(tmp_path / "img" / "huge0.png", 100_000_000) == ""
    assert pixel_budget_reason(tmp_path / "img" / "0.png", 191) == (
        "image is 16x12 = 0.0 MP, over the 0.000191 MP budget (max_pixels=); downscale it"
    )
    summary = _prepare(m, tmp_path / "out")
    rejected = {r["line"]: r["reason"] for r in _jsonl(tmp_path / "out" / "rejected.jsonl")}
    assert rejected == {7: reason, 8: reason}
    assert summary["config"]["max_pixels"] == 64_000_000 and summary["counts"]["accepted"] == 6
    assert prepare_data.main([str(m), "--out", str(tmp_path / "t"), "--max-pixels", "191", "--no-progress"]) == 2
    assert "over the 0.000191 MP budget (--max-pixels)" in capsys.readouterr().err  # 16x12 = 192 pixels each


# 7. Disk full anywhere in preparation: exit 2, earlier outputs intact, nothing partial left.


def _long_caption_manifest(folder: Path) -> Path:
    """Long captions over a tiny vocabulary: a small tokenizer, a large token cache and large row files."""
    words = [chr(ord("a") + k) * 2 for k in range(12)]
    text = " ".join(words[(j * 7) % 12] for j in range(120)) + " {i}"
    return _manifest(folder, ["a", "b"] * 20, text=text)


def _limited(limit: int):
    def preexec():  # Python ignores SIGXFSZ, so a write over the limit fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return preexec


@pytest.mark.slow
@pytest.mark.parametrize(
    "where, limit, flags",
    [
        ("tokenizer", 1_000, ["--max-length", "256"]),  # tokenizer.json: the tokenizers library's bare Exception
        ("tokens/train.ids.bin", 6_000, ["--max-length", "256"]),  # ~8 KB, after a ~3.5 KB tokenizer
        ("train.jsonl", 12_000, ["--max-length", "64"]),  # train.jsonl ~14 KB, after a ~4 KB token cache
        ("WebDataset shards", 60_000, ["--max-length", "64", "--format", "wds"]),  # a ~110 KB shard
    ],
)
def test_full_disk_during_preparation_exits_2_and_leaves_the_previous_directory(tmp_path, where, limit, flags):
    m = _long_caption_manifest(tmp_path / "data")
    out = tmp_path / "out"
    base = [sys.executable, str(ROOT / "tools" / "prepare_data.py"), str(m), "--out", str(out), "--no-progress"]
    base += ["--val-fraction", "0"]  # every row in train: the sizes the limits aim at do not hang on the split
    first = subprocess.run(
        [*base, *flags, "--seed", "1"],  # the second run's seed differs: it prepares again
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert first.returncode == 0, first.stderr[-2000:]
    sizes = {p.name: p.stat().st_size for p in out.rglob("*") if p.is_file()}
    before = _tree(out)
    full = subprocess.run(
        [*base, *flags], capture_output=True, text=True, timeout=300, cwd=ROOT, preexec_fn=_limited(limit)
    )
    assert full.returncode == 2, (sizes, full.stderr[-2000:])
    what = "the WebDataset shards" if where == "WebDataset shards" else "the prepared dataset"
    assert full.stderr.splitlines()[-1].startswith(f"error: writing {what} to {out} failed: "), full.stderr
    assert "File too large" in full.stderr
    assert f"; {out} was left as it was; raise the file-size limit (ulimit -f)" in full.stderr
    assert where in full.stderr.splitlines()[-1]  # it failed where the test aimed
    assert "Traceback" not in full.stderr
    assert _tree(out) == before
    assert not [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")]


# 3. Validation workers die with their parent.

# A module, not a ``-c`` script: the pool's workers come from a fork server, which unpickles ``slow_check`` by
# importing its module (a function of a ``-c`` script's __main__ cannot be found there: the preparation then
# failed at once, and whether the test saw its pool was a race).
_SLOW_PREPARE = textwrap.dedent(
    """
    import sys, time
    import mmfast.data.validate as validate
    from mmfast.prepare.core import PrepareConfig, prepare_dataset

    check = validate.check_image

    def slow_check(path, *args, **kwargs):  # a slow disk: each image takes 2 s
        time.sleep(2)
        return check(path, *args, **kwargs)

    validate.check_image = slow_check

    def main():
        # another pixel budget: the earlier preparation's checks do not apply, every image is decoded again
        prepare_dataset(PrepareConfig(source=sys.argv[1], out=sys.argv[2], workers=2, seed=1, max_length=16,
                                      vocab_size=200, progress=False, max_pixels=10**7))
    """
)


def test_killed_preparation_leaves_no_worker_and_the_previous_directory(tmp_path):
    m = _manifest(tmp_path / "data", ["a", "b"] * 40)  # 80 rows: enough for the process pool
    out = tmp_path / "out"
    previous = _prepare(m, out)
    before = _tree(out)
    (tmp_path / "slowprep.py").write_text(_SLOW_PREPARE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    cmd = [sys.executable, "-c", "import slowprep; slowprep.main()", str(m), str(out)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env)
    parent = psutil.Process(proc.pid)
    deadline = time.time() + 120
    workers: list[psutil.Process] = []
    while time.time() < deadline and len(workers) < 2 and proc.poll() is None:
        workers = [c for c in parent.children() if "python" in c.name().lower()]
        time.sleep(0.05)
    assert len(workers) >= 2 and list(tmp_path.glob(".out.*.tmp")), "validation never started its pool"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 30  # each worker has ~80 s of queued work: only its parent's death stops it
    while time.time() < deadline and any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers):
        time.sleep(0.1)
    assert not [w.pid for w in workers if w.is_running() and w.status() != psutil.STATUS_ZOMBIE]
    assert _tree(out) == before
    assert _prepare(m, out) == previous  # the next run reuses it and removes the killed run's temp dir
    assert not list(tmp_path.glob(".out.*.tmp"))


# 9. Errors name the file and say what to do.


def test_a_prepared_directory_is_not_read_as_an_image_folder(tmp_path, capsys):
    m = _manifest(tmp_path / "data", ["a", "b"] * 3)
    out = tmp_path / "out"
    _prepare(m, out)
    assert prepare_data.main([str(out), "--out", str(tmp_path / "again"), "--no-progress"]) == 2
    assert f"{out} is a prepared dataset, not an image folder" in capsys.readouterr().err
    (out / "prepare.json").unlink()
    with pytest.raises(ManifestError) as e:
        read_input(out)
    assert str(e.value) == (
        f"{out} looks like an incomplete prepared dataset (no prepare.json); re-run mmfast-prepare "
        "on the original manifest"
    )


def test_csv_problems_name_the_line_where_they_start(tmp_path):
    save_image(tmp_path / "a.jpg")
    (tmp_path / "m.csv").write_text(
        'image,text,label\n\na.jpg,"two\nlines",cat\na.jpg,x,\na.jpg,"unclosed,dog\na.jpg,swallowed,dog\n'
    )
    cands, rejects, _ = read_input(tmp_path / "m.csv")
    assert [(c.line, c.text) for c in cands] == [(3, "two\nlines")]
    assert [(r.line, r.reason) for r in rejects] == [(5, "empty label"), (6, "missing field 'label'")]
    (tmp_path / "u.csv").write_bytes("image,text,label\n".encode("utf-16"))
    with pytest.raises(ManifestError, match=r"u\.csv:1: the header is not UTF-8 \(invalid start byte at byte 0\)"):
        read_input(tmp_path / "u.csv")


# 8. An --out that cannot be renamed onto or written: refused before any work, in a private mount namespace.

_MOUNTS = r"""
import subprocess, sys
from pathlib import Path
from tools import prepare_data

manifest, mnt = sys.argv[1], Path(sys.argv[2])
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], check=True)
def run(out, *flags):
    return prepare_data.main([manifest, "--out", str(out), "--no-progress", "--workers", "1", *flags])

print("= mount point:", run(mnt), flush=True)
print("= inside:", run(mnt / "prepared"), flush=True)
subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
print("= read-only, up to date:", run(mnt / "prepared"), flush=True)
print("= read-only, changed:", run(mnt / "prepared", "--seed", "2"), flush=True)
"""


def _unshare_works() -> bool:
    try:
        return subprocess.run(["unshare", "-rm", "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.skipif(not _unshare_works(), reason="needs unshare -rm (a private mount namespace) to mount a tmpfs")
def test_a_mount_point_or_a_read_only_out_is_refused_before_any_work_naming_the_fix(tmp_path):
    """A mount point as --out (the prepared directory is renamed into place, which a mount point cannot take)
    and a read-only --out that must be written again are refused at once with one line naming --out, the
    cause and what to pass; a read-only --out that is up to date is reused (nothing to write)."""
    m = _manifest(tmp_path / "data", ["a", "b"] * 4)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = ["unshare", "-rm", sys.executable, "-c", _MOUNTS, str(m), str(mnt)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert [line for line in r.stdout.splitlines() if line.startswith("= ")] == [
        "= mount point: 2",
        "= inside: 0",
        "= read-only, up to date: 0",
        "= read-only, changed: 2",
    ], r.stderr[-3000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [
        f"error: --out {mnt} is a mount point, which mmfast-prepare cannot rename a prepared directory onto; "
        f"pass a folder inside it (--out {mnt / 'prepared'}); nothing was changed",
        f"error: --out {mnt / 'prepared'}: {mnt} is on a read-only file system, and mmfast-prepare writes the "
        "prepared directory there before it renames it into place; pass an --out on a writable disk; nothing "
        "was changed",
    ], r.stderr[-3000:]
    assert "Traceback" not in r.stderr
