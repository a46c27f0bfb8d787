"""The command-line surface: installed commands, --help that explains, and --report-to's trackers."""

from __future__ import annotations

import importlib
import importlib.util
import json
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
from conftest import ROOT

from mmfast.train.config import GROUPS, TRACKERS, TrainConfig, trackers
from mmfast.train.flags import build_parser, parse_config
from tools import train as train_tool

FAST = ["--batch-size", "32", "--image-size", "32", "--hidden", "32"]


def test_every_console_script_is_a_main_in_mmfast_cli():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert set(scripts) >= {
        "mmfast-prepare",
        "mmfast-train",
        "mmfast-profile",
        "mmfast-predict",
        "mmfast-evaluate",
    }
    for target in scripts.values():
        module, func = target.split(":")
        assert module.startswith("mmfast.cli.") and func == "main"
        assert callable(getattr(importlib.import_module(module), func))


def test_prepare_keeps_the_store_librarys_info_lines_quiet(tmp_path, capsys):
    """mmfast-prepare shows INFO lines; botocore's own ("Found credentials in environment variables.") are not
    mmfast's to print."""
    import logging

    from tools import prepare_data

    assert prepare_data.main([str(tmp_path / "none.jsonl"), "--out", str(tmp_path / "o")]) == 2
    assert all(logging.getLogger(n).level == logging.WARNING for n in ("botocore", "s3fs"))


def test_python_m_mmfast_lists_and_runs_every_console_script(capsys):
    """``python -m mmfast COMMAND`` is ``mmfast-COMMAND``, for every script pyproject.toml installs; alone, it
    lists them; a typo gets the near name."""
    import tomllib

    from mmfast.__main__ import COMMANDS, main

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert {f"mmfast-{name}": f"{module}:main" for name, module in COMMANDS.items()} == scripts
    assert main([]) == 0
    listed = capsys.readouterr().out
    assert all(f"  {name} " in listed for name in COMMANDS)
    assert main(["trian"]) == 2
    assert "unknown command 'trian'; did you mean 'train'?" in capsys.readouterr().err
    res = subprocess.run(
        [sys.executable, "-m", "mmfast", "export", "--help"], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert res.returncode == 0 and res.stdout.startswith("usage: mmfast-export"), res.stderr


@pytest.mark.parametrize("command", ["train", "prepare", "predict", "evaluate", "export", "profile_run"])
def test_a_malformed_flag_is_one_line_and_exit_2(command, capsys):
    main = importlib.import_module(f"mmfast.cli.{command}").main
    with pytest.raises(SystemExit) as stop:
        main(["--no-such-flag", "--lr", "abc"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and len(err.splitlines()) == 1 and err.startswith("error: ")
    assert "--help)" in err and "usage:" not in err


@pytest.mark.parametrize(
    ("command", "argv"),
    [
        ("train", ["--data", "x", "--epoch", "1"]),
        ("prepare", ["src", "--out", "o", "--val-frac", "0.1"]),
        ("predict", ["--model", "m", "--image", "a.jpg", "--tex", "a cat"]),
        ("evaluate", ["--model", "m", "--input", "x.jsonl", "--out", "o", "--batch", "8"]),
    ],
)
def test_a_prefix_of_a_flag_is_not_that_flag_and_a_renamed_flag_names_its_new_name(command, argv, capsys):
    """argparse took any unique prefix (``--epoch 1`` ran as --epochs, ``--data-weight`` as --data-weights):
    a typo passed silently, and a prefix changes meaning once another flag shares it."""
    main = importlib.import_module(f"mmfast.cli.{command}").main
    with pytest.raises(SystemExit) as stop:
        main(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and f"unrecognized arguments: {argv[-2]}" in err
    meant = {"train": "--epochs", "prepare": "--val-fraction", "predict": "--text", "evaluate": "--batch-size"}
    assert f"did you mean {meant[command]} for {argv[-2]}?" in err, err  # a hint, never taken for it
    if command == "train":
        with pytest.raises(SystemExit):
            main(["--data", "x", "--cache-limit-gb", "5"])
        assert "--cache-limit-gb is now --cache-limit" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("command", "argv", "said"),
    [
        ("train", ["--cache-limit", "-5GB"], "--cache-limit must be above 0 bytes, got '-5GB'"),
        ("train", ["--lr", "-1e-3"], "--lr must be in (0, 10], got -0.001"),
        ("train", ["--store-timeout", "-5"], "--store-timeout must be >= 0 seconds, got -5.0"),
        ("train", ["--data-weights", "-0.7,1.7"], "--data-weights must be positive numbers"),
        ("prepare", ["src", "--out", "o", "--max-side", "-5e2"], "--max-side"),
    ],
)
def test_a_negative_value_is_checked_as_the_value_it_is(command, argv, said, capsys):
    """A flag's negative value that argparse would take for a flag (-5GB, -1e-3, -0.7,1.7) reaches the value's
    own check, which names the flag and what it takes, instead of argparse's "expected one argument"."""
    main = importlib.import_module(f"mmfast.cli.{command}").main
    try:
        code = main(argv)
    except SystemExit as stop:
        code = stop.code
    err = capsys.readouterr().err
    assert code == 2 and said in err and "expected one argument" not in err, err
    assert len(err.strip().splitlines()) == 1


def test_resume_latest_with_nothing_to_resume_says_it_starts_fresh(prepared, tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["--data", str(prepared), "--out", str(out), "--resume", "latest", "--max-steps", "1", "--no-progress"]
    assert train_tool.main([*argv, "--batch-size", "16", "--image-size", "32", "--hidden", "32"]) == 0
    assert f"--resume latest: no checkpoint in {out}, so this is a fresh run" in capsys.readouterr().out


def test_a_command_imports_nothing_heavy_before_its_main_runs():
    """Ctrl-C during start-up must land under main's handler, and --help should not wait for torch."""
    code = (
        "import sys, mmfast.cli.train, mmfast.cli.predict, mmfast.cli.evaluate; "
        "print('torch' in sys.modules, 'mmfast.loading.image_loader' in sys.modules, 'nvidia.dali' in sys.modules)"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert res.stdout.split() == ["False", "False", "False"]


def test_help_gives_each_flag_its_meaning_choices_and_group():
    text = build_parser().format_help()
    for group in GROUPS:
        assert f"\n{group}:\n" in text, group
    flat = " ".join(text.split())  # argparse wraps to the terminal's width
    # meanings come from the config fields, choices from the registries (MODELS, PRESETS) and tuples
    assert "--model {early,concat,late,image,text,clip}" in text
    assert "fusion (early, concat, late), a single-modality baseline" in flat
    assert "--mixed-precision {auto,fp16,bf16,no}" in text
    assert "tiny (ResNet-10 + 2-layer BERT" in flat and "lite0-minilm (" in flat
    assert (
        "micro-batches per optimizer step; classification: their gradients averaged; contrastive: one loss" in flat
    )
    assert "tensorboard, wandb, mlflow, trackio, all" in flat
    # the flag sits in its group's section
    model_section = text.split("\nmodel:\n")[1].split("\noptimization:\n")[0]
    assert "--image-backbone" in model_section and "--lr " not in model_section


def test_every_config_field_has_a_help_text_and_a_group():
    text = " ".join(build_parser().format_help().split("options:")[1].split())
    for f in fields(TrainConfig):
        assert f.metadata.get("group") in GROUPS, f.name
        assert len(f.metadata.get("help", "")) > 10, f.name
        assert "(default: " in text.split(f"--{f.name.replace('_', '-')} ")[-1][:900], f.name  # --preset's: long


def test_choices_are_validated_from_the_registries():
    with pytest.raises(
        ValueError,
        match="--preset must be tiny, lite0-minilm, minilm, clip-lite0-minilm, clip-lite2-minilm or resnet50-bert",
    ):
        parse_config(["--preset", "huge"])
    with pytest.raises(ValueError, match="--scheduler must be cosine, linear"):
        parse_config(["--scheduler", "warmup_stable_decay"])
    with pytest.raises(ValueError, match=r"unknown tracker \['comet'\]"):
        parse_config(["--report-to", "comet,tensorboard"])


def test_report_to_names_and_the_tensorboard_alias():
    assert trackers(parse_config(["--report-to", "mlflow, TensorBoard"])) == ("tensorboard", "mlflow")
    assert trackers(parse_config(["--tensorboard"])) == ("tensorboard",)
    assert trackers(parse_config(["--report-to", "wandb", "--tensorboard"])) == ("tensorboard", "wandb")
    assert trackers(parse_config(["--report-to", "all"])) == ("all",)
    assert trackers(parse_config([])) == ()


@pytest.mark.parametrize("name", [t for t in TRACKERS if importlib.util.find_spec(t) is None][:1] or ["none"])
def test_a_tracker_that_is_not_installed_is_a_clear_error(name, prepared, tmp_path, capsys):
    if name == "none":
        pytest.skip("every tracker is installed here")
    rc = train_tool.main(["--data", str(prepared), "--out", str(tmp_path / "run"), "--report-to", name, *FAST])
    err = capsys.readouterr().err
    assert rc == 2 and f"--report-to {name}: not installed; pip install {name}" in err, err


@pytest.mark.parametrize("script", ["tools/train.py", "-m mmfast.cli.train"])
def test_train_help_runs_from_the_checkout_and_as_a_module(script):
    res = subprocess.run(
        [sys.executable, *script.split(), "--help"], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert res.returncode == 0, res.stderr
    assert "--report-to" in res.stdout and "optimization:" in res.stdout


@pytest.mark.slow
def test_report_to_tensorboard_writes_per_step_scalars(prepared, tmp_path, capsys):
    """A real run with --report-to tensorboard: the event file holds loss, lr, images/s and data-wait at steps
    2, 4, 6 (--log-every 2 of 7 steps), the epoch's figures at step 7, and the config as hyper-parameters;
    stderr is not a terminal here, so the same figures are printed as lines."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    argv = ["--data", str(prepared), "--out", str(out), *FAST, "--epochs", "1", "--report-to", "tensorboard"]
    assert train_tool.main([*argv, "--log-every", "2", "--no-checkpoints"]) == 0
    printed = capsys.readouterr().out
    assert "epoch 0 step 2/7: loss " in printed and "epoch 0 step 6/7: loss " in printed
    assert "step 7/7" not in printed  # 7 is not a multiple of --log-every
    acc = EventAccumulator(str(out / "mmfast"))
    acc.Reload()
    scalars = acc.Tags()["scalars"]
    for tag in ("train/loss", "train/lr", "train/images_per_s", "train/data_wait_frac"):
        assert [e.step for e in acc.Scalars(tag)] == [2, 4, 6], tag
    assert [e.step for e in acc.Scalars("epoch/val_acc")] == [7] and "epoch/train_loss" in scalars
    assert "train/lr_encoder" not in scalars  # no pretrained encoder in this model: one lr
    lrs = [e.value for e in acc.Scalars("train/lr")]
    assert lrs == sorted(lrs, reverse=True) and lrs[0] > 0  # cosine decay after a 0-step warm-up (7 x 0.1)
    assert all(e.value > 0 for e in acc.Scalars("train/images_per_s"))
    # The hyper-parameters sit in the run that holds the scalars, naming the epoch figures as their metrics
    # (what TensorBoard's HParams view compares runs by).
    from tensorboard.plugins.hparams import plugin_data_pb2

    content = acc.PluginTagToContent("hparams")
    session = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    experiment = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"])
    given = session.session_start_info.hparams
    assert given["model"].string_value == "concat" and given["report_to"].string_value == "tensorboard"
    assert given["batch_size"].number_value == 32
    assert {m.name.tag for m in experiment.experiment.metric_infos} >= {"epoch/val_acc", "epoch/val_loss"}
    assert [p.name for p in out.glob("mmfast/*") if p.is_dir()] == []  # no sub-run beside it


def test_file_lock_excludes_other_processes_and_leaves_nothing_beside_the_target(tmp_path):
    """locks.file_lock: a second process waits for the first; no lock file in the user's folder."""
    import time

    from mmfast.util.locks import file_lock, lock_file_for

    target = tmp_path / "data" / "prepared"
    code = (
        "import sys, time\nfrom mmfast.util.locks import file_lock\n"
        "with file_lock(sys.argv[1]):\n    print(time.time(), flush=True)\n"
    )
    with file_lock(target):
        child = subprocess.Popen(
            [sys.executable, "-c", code, str(target)], stdout=subprocess.PIPE, text=True, cwd=ROOT
        )
        time.sleep(1.5)
        released = time.time()
    acquired = float(child.communicate(timeout=60)[0])
    assert acquired >= released  # the child got the lock only after this process let it go
    assert list(tmp_path.rglob("*")) == [tmp_path / "data"]  # the parent folder is made, nothing else
    assert lock_file_for(target).parent != target.parent and lock_file_for(target) == lock_file_for(
        tmp_path / "data" / ".." / "data" / "prepared"
    )


def test_files_and_directories_mmfast_writes_get_the_users_umask(tmp_path):
    import os

    from mmfast.util.fsutil import atomic_dir, atomic_write_json, current_umask

    old = os.umask(0o027)
    try:
        assert current_umask() == 0o027
        atomic_write_json(tmp_path / "a.json", {"x": 1})
        with atomic_dir(tmp_path / "d") as tmp:
            (tmp / "f").write_text("y")
    finally:
        os.umask(old)
    assert (tmp_path / "a.json").stat().st_mode & 0o777 == 0o640  # not mkstemp's 0600
    assert (tmp_path / "d").stat().st_mode & 0o777 == 0o750  # not mkdtemp's 0700


def test_prepare_help_imports_neither_torch_nor_dali():
    """``mmfast-prepare --help`` took seconds: the WebDataset input took a constant from the DALI module, and the
    command imported the token cache (torch) before parsing its flags."""
    script = (
        "import sys\nfrom mmfast.cli import prepare\ntry:\n    prepare.main(['--help'])\nexcept SystemExit:\n"
        "    pass\nprint(sorted(m for m in ('torch', 'nvidia.dali') if m in sys.modules))\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize(
    "source,folder",
    [
        (["--data", "prepared"], "eval-val"),
        (["--data", "prepared", "--split", "train"], "eval-train"),
        (["--input", "captions.jsonl"], "eval-captions"),
        (["--input", "icons/manifest.jsonl"], "eval-icons"),
        (["--input", "shards/{00000..00003}.tar"], "eval-shards"),
        (["--input", "s3://bucket/coco/captions_val2017.json"], "eval-captions_val2017"),
    ],
)
def test_evaluate_names_its_default_folder_after_what_it_scored(tmp_path, source, folder):
    """Without --out, an evaluation of an --input is not written where the val split's would be."""
    from mmfast.cli.evaluate import output_dir, parse_args

    model = tmp_path / "run" / "model"
    assert output_dir(parse_args(["--model", str(model), *source])) == tmp_path / "run" / folder
    assert output_dir(parse_args(["--model", str(model), *source, "--out", "here"])) == Path("here")


def test_a_missing_data_folder_names_the_one_the_models_run_trained_on(prepared, tmp_path, capsys):
    from mmfast.cli import evaluate

    run = tmp_path / "runs" / "clip"  # a run given a prepared --data: it has no prepared/ of its own
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"data": str(prepared), "model": "clip"}))
    argv = ["--model", str(run / "model"), "--data", str(run / "prepared"), "--split", "val"]
    assert evaluate.main(argv) == 2
    said = capsys.readouterr().err
    assert f"no such folder; the model's run trained on {prepared}: pass --data {prepared}" in said
    assert "no prepare.json" not in said  # not "run mmfast-prepare": the data was prepared
    (run / "config.json").write_text(json.dumps({"data": str(tmp_path / "gone"), "model": "clip"}))
    assert evaluate.main(argv) == 2
    assert "no such folder; pass the folder mmfast-prepare wrote (its --out)" in capsys.readouterr().err
