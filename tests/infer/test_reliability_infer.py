"""Faults a user meets with a model directory and mmfast-predict / -evaluate / -export: each is one line naming
the file and what to do, exit status 2, never a traceback and never a silently wrong figure."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image
from test_model_out import _config

import tools.evaluate as evaluate_tool
import tools.export as export_tool
import tools.predict as predict_tool
from mmfast.infer.model_dir import MmfastModel, ModelDirError, load_model, save_model_dir
from mmfast.infer.predict import predict_rows

TOOLS = {"predict": predict_tool, "evaluate": evaluate_tool, "export": export_tool}


@pytest.fixture(scope="module")
def model_dir(prepared, tmp_path_factory) -> Path:
    """An untrained model directory (random weights) with the prepared set's tokenizer, as a run writes one."""
    torch.manual_seed(0)
    net = MmfastModel(_config(prepared))
    out = tmp_path_factory.mktemp("model") / "model"
    return save_model_dir(out, net.model.state_dict(), net.config, prepared / "tokenizer")


@pytest.fixture(scope="module")
def manifest(demo_manifest, model_dir, tmp_path_factory) -> Path:
    """Four demo rows, labeled with the model's classes (so evaluate scores them), images by absolute path."""
    rows = [json.loads(line) for line in demo_manifest.read_text().splitlines()[:4]]
    path = tmp_path_factory.mktemp("input") / "new.jsonl"
    lines = [
        {"image": str(demo_manifest.parent / r["image"]), "text": r["text"], "label": r["label"]} for r in rows
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path


def _copy(model_dir: Path, tmp_path: Path, checksums: bool = True) -> Path:
    """A copy of the model directory to damage; ``checksums=False``: as written before checksums existed."""
    copy = tmp_path / "model"
    shutil.copytree(model_dir, copy)
    if not checksums:
        (copy / "checksums.json").unlink(missing_ok=True)
    return copy


def _run(tool: str, model: Path, manifest: Path, tmp_path: Path, capsys, *flags: str) -> tuple[int, str]:
    """(exit status, stderr) of a tool run in-process on ``model`` (predict and evaluate on ``manifest``)."""
    argv = ["--model", str(model), "--out", str(tmp_path / f"out-{tool}"), *flags]
    if tool != "export":
        argv += ["--input", str(manifest)]
    capsys.readouterr()
    rc = TOOLS[tool].main(argv)
    return rc, capsys.readouterr().err


def _one_error_line(err: str, names: str) -> str:
    """The error line, checked: no traceback, the last line is ``error: ...`` and names ``names``."""
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: ") and names in last, err
    return last


def _predict_file(model_dir: Path, source: Path, out: Path) -> list:
    """mmfast-predict on ``source`` into ``out`` (which must succeed): its rows (JSONL), or its lines (CSV)."""
    assert predict_tool.main(["--model", str(model_dir), "--input", str(source), "--out", str(out)]) == 0
    text = out.read_bytes().decode("utf-8")  # valid UTF-8, whatever the input's names
    return [json.loads(line) for line in text.splitlines()] if out.suffix == ".jsonl" else text.splitlines()


def _overwrite_middle(path: Path, data: bytes) -> None:
    """``data`` written over the middle of ``path`` (same size, same length of file)."""
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(size // 2)
        f.write(data)
    assert path.stat().st_size == size


def test_garbage_in_the_weights_is_refused_by_every_tool(model_dir, manifest, tmp_path, capsys):
    """4 KiB of 0xff over the weights (same size): the checksum names the file; without checksums (a
    directory of an earlier mmfast) the weights are found not finite. Nothing is predicted or scored."""
    sums = json.loads((model_dir / "checksums.json").read_text())
    assert sorted(sums) == [
        "config.json",
        "model.safetensors",
        "tokenizer/tokenizer.json",
        "tokenizer/tokenizer_config.json",
    ]
    damaged = _copy(model_dir, tmp_path)
    _overwrite_middle(damaged / "model.safetensors", b"\xff" * 4096)
    for tool in TOOLS:
        rc, err = _run(tool, damaged, manifest, tmp_path, capsys)
        last = _one_error_line(err, f"{damaged / 'model.safetensors'}: is corrupt (checksum mismatch")
        assert rc == 2 and "RUN/model-last" in last and "retrain" in last
        assert not (tmp_path / f"out-{tool}").exists()
    (damaged / "checksums.json").unlink()
    with pytest.raises(ModelDirError, match=r"model\.safetensors: 1 weight tensor\(s\) hold NaN or inf"):
        load_model(damaged)
    rc, err = _run("evaluate", damaged, manifest, tmp_path, capsys)
    assert rc == 2 and "hold NaN or inf" in _one_error_line(err, str(damaged / "model.safetensors"))
    assert load_model(_copy(model_dir, tmp_path / "legacy", checksums=False)).class_names  # intact: loads


def _truncate_weights(d: Path) -> None:
    os.truncate(d / "model.safetensors", 10_000)


def _remove_tokenizer(d: Path) -> None:
    shutil.rmtree(d / "tokenizer")


def _shorten_class_names(d: Path) -> None:
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "class_names": config["class_names"][:3]}))


def _config_not_json(d: Path) -> None:
    (d / "config.json").write_text('{"model": "concat", ')


def _config_missing_a_key(d: Path) -> None:
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "hidden"}))


# damage -> (the file named, what the message says without checksums)
DAMAGES = {
    _truncate_weights: ("model.safetensors", "unreadable (Error while deserializing header"),
    _remove_tokenizer: ("tokenizer", "missing (the tokenizer the model was trained with"),
    _shorten_class_names: (
        "config.json",
        "'class_names' holds 3 names (3 distinct) for the classifier's 10 outputs",
    ),
    _config_not_json: ("config.json", "not readable JSON"),
    _config_missing_a_key: ("config.json", "missing 'hidden'"),
}


@pytest.mark.parametrize("checksums", [True, False], ids=["checksums", "no-checksums"])
@pytest.mark.parametrize("damage", list(DAMAGES), ids=lambda f: f.__name__.strip("_"))
def test_a_damaged_model_directory_is_one_line_naming_the_file(
    damage, checksums, model_dir, manifest, tmp_path, capsys
):
    damaged = _copy(model_dir, tmp_path, checksums)
    damage(damaged)
    name, unchecked_reason = DAMAGES[damage]
    # with checksums a changed file is caught by them first (a missing tokenizer/ is said as such)
    reason = unchecked_reason if not checksums or name == "tokenizer" else "is corrupt (checksum mismatch"
    for tool in TOOLS:
        rc, err = _run(tool, damaged, manifest, tmp_path, capsys)
        assert rc == 2, (tool, err)
        _one_error_line(err, f"{damaged / name}: {reason}")
    with pytest.raises((ModelDirError, FileNotFoundError), match=re.escape(str(damaged / name))):
        load_model(damaged)


def test_export_errors_are_one_line(model_dir, tmp_path, capsys):
    """No model directory there, or --out a file: exit 2 with one line (the export itself is tested in
    test_model_out.py)."""
    rc = export_tool.main(["--model", str(tmp_path / "nowhere"), "--out", str(tmp_path / "e")])
    assert rc == 2
    _one_error_line(capsys.readouterr().err, f"{tmp_path / 'nowhere' / 'config.json'}: missing")
    (tmp_path / "a-file").write_text("mine\n")
    rc = export_tool.main(["--model", str(model_dir), "--out", str(tmp_path / "a-file"), "--format", "torch"])
    assert rc == 2
    _one_error_line(capsys.readouterr().err, f"--out {tmp_path / 'a-file'}: is a file; pass a folder")
    assert (tmp_path / "a-file").read_text() == "mine\n"


def test_export_names_the_weights_by_their_checksum_with_or_without_checksums_json(model_dir, tmp_path):
    """export.json's weights_sha256 is the weights' SHA-256: read from checksums.json, which load_model checked,
    or from the file itself in a folder written before checksums existed."""
    import shutil

    from mmfast.util.fsutil import file_sha256

    want = file_sha256(model_dir / "model.safetensors")
    old = shutil.copytree(model_dir, tmp_path / "old-model")
    (old / "checksums.json").unlink()
    for model, out in ((model_dir, tmp_path / "e1"), (old, tmp_path / "e2")):
        assert export_tool.main(["--model", str(model), "--out", str(out), "--format", "torch"]) == 0
        assert json.loads((out / "export.json").read_text())["weights_sha256"] == want


@pytest.fixture(scope="module")
def bad_images(tmp_path_factory, demo_manifest) -> dict[str, Path]:
    """Images predict cannot use: text named .jpg, an empty file, a PNG whose header declares 9400x9400 (11 KB
    on disk, 88 MP decoded), a JPEG cut short (its header reads; DALI's decoder refuses it) and a good JPEG."""
    folder = tmp_path_factory.mktemp("bad-images")
    good = demo_manifest.parent / json.loads(demo_manifest.read_text().splitlines()[0])["image"]
    data = good.read_bytes()
    (folder / "text.jpg").write_text("not an image\n")
    (folder / "empty.jpg").write_bytes(b"")
    Image.new("1", (9400, 9400)).save(folder / "huge.png")
    (folder / "cut.jpg").write_bytes(data[: len(data) // 2])
    shutil.copy(good, folder / "good.jpg")
    return {p.stem: p for p in folder.iterdir()}


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("text", "image unreadable: not an image (unrecognised content); pass a JPEG, PNG"),
        ("huge", "image unreadable: image is 9400x9400 = 88.4 MP, over the 64 MP budget (--max-pixels)"),
        ("cut", "image unreadable: truncated image"),
        ("empty", "image unreadable: zero size file"),  # mmfast-prepare's words for it
    ],
)
def test_one_bad_image_exits_2_in_one_line(name, reason, model_dir, bad_images, capsys):
    argv = ["--model", str(model_dir), "--image", str(bad_images[name]), "--text", "a caption"]
    assert predict_tool.main(argv) == 2
    err = capsys.readouterr().err
    last = _one_error_line(err, f"error: cannot predict {bad_images[name]}: {reason}")
    assert [line for line in err.splitlines() if line.startswith("error:")] == [last]


def test_an_input_of_only_bad_images_exits_2_and_some_bad_ones_are_row_errors(
    model_dir, bad_images, tmp_path, capsys
):
    label = load_model(model_dir).class_names[0]
    rows = [{"image": str(bad_images[n]), "text": n, "label": label} for n in ("text", "huge", "cut")]
    all_bad = tmp_path / "bad.jsonl"
    all_bad.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for tool in (predict_tool, evaluate_tool):
        assert tool.main(["--model", str(model_dir), "--input", str(all_bad), "--out", str(tmp_path / "p")]) == 2
        _one_error_line(capsys.readouterr().err, f"error: no row of {all_bad} can be predicted (all 3 failed")
    assert not (tmp_path / "p").exists()
    mixed = tmp_path / "mixed.jsonl"
    good = {"image": str(bad_images["good"]), "text": "g", "label": label}
    mixed.write_text("".join(json.dumps(r) + "\n" for r in [*rows, good]))
    got = _predict_file(model_dir, mixed, tmp_path / "m.jsonl")
    assert [bool(r["error"]) for r in got] == [True, True, True, False]
    assert "over the 64 MP budget" in got[1]["error"] and got[3]["class"] in load_model(model_dir).class_names
    # the budget is the model's unless --max-pixels says otherwise: the 64x64 image is over 1,000 pixels
    capsys.readouterr()
    argv = ["--model", str(model_dir), "--image", str(bad_images["good"]), "--max-pixels", "1000"]
    assert predict_tool.main(argv) == 2
    _one_error_line(capsys.readouterr().err, "image is 64x64 = 0.0 MP, over the 0.001 MP budget (--max-pixels)")


def test_a_caption_that_is_not_utf8_is_one_line(model_dir, bad_images, capsys):
    """--text holding a byte the locale could not decode (it arrives as a surrogate escape) was a TypeError
    traceback from the tokenizer."""
    argv = ["--model", str(model_dir), "--image", str(bad_images["good"]), "--text", "caf\udce9"]
    assert predict_tool.main(argv) == 2
    _one_error_line(capsys.readouterr().err, "error: --text is not UTF-8 (byte 0xe9 at character 3)")


def test_a_png_cut_short_among_a_folder_is_its_rows_error_not_a_crash(model_dir, tmp_path):
    """A PNG cut at byte 300 (its header whole, its pixels not) among eight good ones (real photos, RGBA like
    the icon sets), predicted at batch 64: the header read fine, and DALI's PNG parser, parsing the batch on
    several threads, crashed the process on it (SIGSEGV, exit 139, nothing written) in 3 of 4 runs; every image
    is now decoded before DALI sees it, so the row says why and the others are predicted. Three fresh
    processes (the crash is a race: one run could miss it), each its own: a crash takes only itself."""
    import subprocess
    import sys

    import skimage.data
    from conftest import ROOT

    folder = tmp_path / "images"
    names = ("astronaut", "coffee", "chelsea", "rocket", "camera", "cat", "coins", "moon", "page")
    for k, name in enumerate(names):
        im = Image.fromarray(getattr(skimage.data, name)()).convert("RGBA").resize((128, 128))
        (folder / "ab"[k % 2]).mkdir(parents=True, exist_ok=True)
        im.save(folder / "ab"[k % 2] / f"{name}.png")
    cut = folder / "a" / "astronaut.png"
    cut.write_bytes(cut.read_bytes()[:300])
    tool = [sys.executable, str(ROOT / "tools" / "predict.py"), "--model", str(model_dir), "--batch-size", "64"]
    for run in range(3):
        out = tmp_path / f"p{run}.jsonl"
        cmd = [*tool, "--input", str(folder), "--out", str(out)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert done.returncode == 0, (run, done.returncode, done.stderr[-2000:])
        rows = {Path(r["image"]).name: r for r in map(json.loads, out.read_text().splitlines())}
        assert len(rows) == 9 and rows["astronaut.png"]["error"].startswith("image unreadable: truncated image")
        assert all(r["class"] and not r["error"] for n, r in rows.items() if n != "astronaut.png")


def test_a_latin1_file_name_is_predicted_and_written_whole(model_dir, bad_images, tmp_path):
    """A file name UTF-8 cannot encode (Latin-1 é): DALI reads it, and CSV and JSONL are written complete."""
    folder = tmp_path / "images"
    folder.mkdir()
    latin1 = os.fsdecode(os.fsencode(str(folder)) + b"/caf\xe9.jpg")  # "caf\udce9.jpg": a surrogate escape
    shutil.copy(bad_images["good"], latin1)
    shutil.copy(bad_images["good"], folder / "plain.jpg")
    lines = _predict_file(model_dir, folder, tmp_path / "p.csv")
    assert len(lines) == 3 and lines[1].startswith(f"{folder}/caf\\udce9.jpg,")  # the header and both rows
    got = _predict_file(model_dir, folder, tmp_path / "p.jsonl")
    assert [r["image"] for r in got] == [latin1, str(folder / "plain.jpg")]
    assert got[0]["class"] == got[1]["class"] and got[0]["prob"] == pytest.approx(got[1]["prob"])  # same image
    assert sorted(p.name for p in tmp_path.iterdir()) == ["images", "p.csv", "p.jsonl"]  # no temp file left


def _zeroed_parquet(path: Path, images: list[bytes], label: str, compression: str) -> Path:
    """A Parquet file of ``images`` with bytes zeroed in the middle. Uncompressed: the first image's second
    half, in its page. Compressed: the first page, from its header (just after the "PAR1" magic) to the
    middle of the file (snappy has no checksum: zeros among its literal bytes could still pass for an image)."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    n = len(images)
    table = pa.table({"image": [{"bytes": b} for b in images], "text": ["a"] * n, "label": [label] * n})
    # no statistics: they would hold another copy of the image's bytes
    pq.write_table(table, path, compression=compression, use_dictionary=False, write_statistics=False)
    raw = bytearray(path.read_bytes())
    first = raw.index(images[0]) if compression == "NONE" else 0
    at, end = (
        (first + len(images[0]) // 2, first + len(images[0])) if compression == "NONE" else (4, len(raw) // 2)
    )
    raw[at:end] = bytes(end - at)
    path.write_bytes(raw)
    return path


@pytest.mark.parametrize("compression", ["NONE", "snappy"])
def test_a_zeroed_parquet_page_exits_2_naming_the_file(compression, model_dir, bad_images, tmp_path, capsys):
    """In a compressed page the file cannot be read; in an uncompressed one its image cannot be decoded.
    Either way one line naming the file, exit 2."""
    label = load_model(model_dir).class_names[0]
    path = _zeroed_parquet(tmp_path / "in.parquet", [bad_images["good"].read_bytes()], label, compression)
    for tool in (predict_tool, evaluate_tool):
        assert tool.main(["--model", str(model_dir), "--input", str(path), "--out", str(tmp_path / "z")]) == 2
        _one_error_line(capsys.readouterr().err, str(path))
    assert not (tmp_path / "z").exists()


def test_a_zeroed_image_of_two_in_parquet_is_its_rows_error(model_dir, bad_images, tmp_path):
    data = bad_images["good"].read_bytes()
    path = _zeroed_parquet(tmp_path / "in.parquet", [data, data], load_model(model_dir).class_names[0], "NONE")
    got = _predict_file(model_dir, path, tmp_path / "p.jsonl")
    assert got[0]["image"] == f"{path} row 1" and got[0]["error"].startswith("image unreadable: ")
    assert got[1]["error"] is None and got[1]["class"] in load_model(model_dir).class_names


def test_non_finite_logits_are_a_row_error_not_a_nan_probability(prepared, manifest, tmp_path):
    """Finite weights so large that the logits overflow: each row says so instead of "prob": NaN."""
    torch.manual_seed(0)
    net = MmfastModel(_config(prepared))
    first, last = net.model.head[0], net.model.head[-1]  # concat's MLP: Linear, GELU, Dropout, Linear
    with torch.no_grad():  # every hidden unit 10, times 3e38 (float32's largest is 3.4e38): inf logits
        first.weight.zero_()
        first.bias.fill_(10.0)
        last.weight.fill_(3e38)
    save_model_dir(tmp_path / "model", net.model.state_dict(), net.config, prepared / "tokenizer")
    rows = [json.loads(line) for line in manifest.read_text().splitlines()]
    got = predict_rows(load_model(tmp_path / "model"), rows)
    assert [r.get("error") for r in got] == ["the model gave non-finite logits (NaN or inf) for this row"] * 4
    assert not any("prob" in r for r in got)


def _bytes(path: Path) -> bytes:
    return path.read_bytes()


def test_predict_never_writes_over_its_input_an_image_or_a_users_file(model_dir, manifest, tmp_path, capsys):
    """--out was written whatever it named: the input manifest (rewritten as predictions), one of its images
    (a JPEG replaced by JSONL), any file. Now those are refused, and an earlier predictions file is replaced."""
    image = Path(json.loads(manifest.read_text().splitlines()[0])["image"])
    mine = tmp_path / "notes.jsonl"
    mine.write_text('{"my": "notes"}\n')
    before = {p: _bytes(p) for p in (manifest, image, mine)}
    for out, says in ((manifest, "is one of this command's inputs"), (image, "is one of this command's inputs"),
                      (mine, "exists and is not an earlier output")):  # fmt: skip
        capsys.readouterr()
        rc = predict_tool.main(["--model", str(model_dir), "--input", str(manifest), "--out", str(out)])
        _one_error_line(capsys.readouterr().err, f"--out {out}: {says}")
        assert rc == 2
    assert {p: _bytes(p) for p in before} == before
    again = tmp_path / "p.csv"
    for _ in range(2):  # the second run replaces the first one's file
        assert predict_tool.main(["--model", str(model_dir), "--input", str(manifest), "--out", str(again)]) == 0
    assert len(again.read_text().splitlines()) == 5


def test_evaluate_and_export_never_write_into_a_folder_of_the_users(model_dir, manifest, tmp_path, capsys):
    """export replaced a user's model.onnx; evaluate wrote metrics.json, confusion.png and predictions.jsonl into
    the images' folder. A folder with files mmfast did not write is refused; a new one is marked as mmfast's
    and may be written again."""
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "model.onnx").write_text("my own onnx\n")
    (folder / "metrics.json").write_text("{}\n")
    for tool, flags in (("export", ["--format", "torch"]), ("evaluate", ["--input", str(manifest)])):
        capsys.readouterr()
        rc = TOOLS[tool].main(["--model", str(model_dir), "--out", str(folder), *flags])
        _one_error_line(capsys.readouterr().err, f"--out {folder}: holds files mmfast did not write")
        assert rc == 2
    assert sorted(p.name for p in folder.iterdir()) == ["metrics.json", "model.onnx"]
    assert (folder / "model.onnx").read_text() == "my own onnx\n"
    for _ in range(2):
        assert TOOLS["evaluate"].main(["--model", str(model_dir), "--out", str(tmp_path / "ev"), "--input",
                                       str(manifest)]) == 0  # fmt: skip
    assert (tmp_path / "ev" / "metrics.json").is_file()
    # mmfast's folders of another kind: the model directory itself (its next save would remove the export),
    # and an evaluation's folder for an export
    before = sorted(p.name for p in model_dir.iterdir())
    for out, kind in ((model_dir, "mmfast model directory"), (tmp_path / "ev", "evaluation")):
        capsys.readouterr()
        assert TOOLS["export"].main(["--model", str(model_dir), "--out", str(out), "--format", "torch"]) == 2
        _one_error_line(capsys.readouterr().err, f"--out {out}: is mmfast's {kind}, not a folder for this")
    assert sorted(p.name for p in model_dir.iterdir()) == before


def test_without_checksums_another_tokenizer_is_still_refused_and_the_load_says_unchecked(
    model_dir, manifest, tmp_path, capsys, caplog, minilm_dir
):
    """With checksums.json removed every check was off: another run's tokenizer (31 tokens for a model of 196)
    predicted with rc 0. Its size is checked against config.json, and the load says it is unchecked."""
    import logging

    model = _copy(model_dir, tmp_path, checksums=False)
    with caplog.at_level(logging.WARNING):
        load_model(model)
    assert f"{model}: no checksums.json, so its files cannot be checked" in caplog.text
    shutil.rmtree(model / "tokenizer")
    shutil.copytree(minilm_dir, model / "tokenizer")
    rc, err = _run("predict", model, manifest, tmp_path, capsys)
    assert rc == 2
    _one_error_line(err, f"{model / 'tokenizer'}: has 30522 tokens where")
    assert "not the tokenizer it was trained with" in err


def test_evaluating_an_empty_split_says_it_is_empty(model_dir, demo_manifest, tmp_path, capsys):
    from mmfast.prepare.core import PrepareConfig, prepare_dataset

    data = tmp_path / "all-train"
    prepare_dataset(PrepareConfig(source=str(demo_manifest), out=str(data), val_fraction=0.0, progress=False))
    capsys.readouterr()
    rc = evaluate_tool.main(["--model", str(model_dir), "--data", str(data), "--split", "val", "--out",
                             str(tmp_path / "ev")])  # fmt: skip
    assert rc == 2
    _one_error_line(capsys.readouterr().err, f"{data}: its val split is empty (prepared with --val-fraction 0?)")
