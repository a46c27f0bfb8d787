"""Process and data setup for a run: the Accelerator (CPU/GPU, mixed precision, process group) and the
prepared dataset (demo, raw input prepared on the fly, or a prepared directory). ``make_accelerator`` takes
the run's ``ProcessConfig``, the data functions its ``DataConfig`` (``train/slices.py``); a whole ``TrainConfig``
stands for either."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from mmfast.data.dataset import COMPLETE, REJECTED_FILE, SPLITS, TOKENIZER_DIR, prepared_state, split_file
from mmfast.data.tokenizer import load_tokenizer, tokenizer_fingerprint
from mmfast.inputs import claimed
from mmfast.inputs.base import InputOptions, reader_named
from mmfast.inputs.manifest import ManifestError
from mmfast.loading.cache_plan import processes_on_machine
from mmfast.models.encoders import RANDOM_TEXT_CONFIGS, resolve_text_model
from mmfast.prepare.config import PrepareConfig, failure_report_path
from mmfast.prepare.core import prepare_dataset
from mmfast.prepare.demo import default_cache_dir, demo_dataset
from mmfast.prepare.mix import prepare_mix
from mmfast.remote.errors import redact
from mmfast.remote.objects import is_remote
from mmfast.tasks import TASKS
from mmfast.train.config import TRACKERS, trackers
from mmfast.train.data_flags import data_sources
from mmfast.train.hardware import launcher_precision_note, resolve_mixed_precision
from mmfast.train.rendezvous import meet
from mmfast.train.rundir import RAW_DATA_DIR
from mmfast.train.slices import DataConfig, ProcessConfig
from mmfast.util.commands import PREPARE, TRAIN
from mmfast.util.fsutil import restore_interrupted_swap

if TYPE_CHECKING:
    from accelerate.utils import InitProcessGroupKwargs


class LaunchError(RuntimeError):
    """The processes of a launch are not set up the way training needs."""


def check_process_group(num_processes: int, launcher_world_size: str | None) -> None:
    """Refuse a launch whose processes did not join one group: each would train alone on its shard and
    the results would be silently wrong.

    Args:
        num_processes: what the Accelerator sees.
        launcher_world_size: the WORLD_SIZE the launcher exported (None when there was no launcher).
    """
    world = int(launcher_world_size or 1)
    if world > 1 and num_processes != world:
        raise LaunchError(
            f"the launcher started {world} processes but they did not form one process group "
            f"(this one sees {num_processes}); on a CPU-only machine launch with "
            "'torchrun --nproc_per_node N' or 'accelerate launch --multi_gpu' (mmfast then "
            "uses Accelerator(cpu=True) and gloo)"
        )


def processes_per_machine(accelerator) -> int:
    """How many of the run's processes share this machine's cores and memory (the loaders' one rule,
    ``cache_plan.processes_on_machine``)."""
    return processes_on_machine(accelerator.num_processes, accelerator.device.type)


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity: taskset, a container's cpuset), else all of them."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


def dist_timeout_handler(seconds: float) -> InitProcessGroupKwargs:
    """Accelerate's process-group options with ``seconds`` as the collectives' timeout.

    Accelerate passes on only the options that differ from its class defaults, and its default timeout is
    NCCL's 600 s: a timeout of exactly 600 s would be dropped, and gloo would wait torch's 30 minutes. A
    microsecond more keeps it.
    """
    from accelerate.utils import InitProcessGroupKwargs  # as make_accelerator: --help imports no torch

    timeout = timedelta(seconds=seconds)
    if "timeout" not in InitProcessGroupKwargs(timeout=timeout).to_kwargs():
        timeout += timedelta(microseconds=1)
    return InitProcessGroupKwargs(timeout=timeout)


def make_accelerator(cfg: ProcessConfig):
    """Create the Accelerator; CPU mode when CUDA is absent; refuse unconnected multi-process launches."""
    from accelerate import Accelerator  # accelerate: a slow import, only once a run starts
    from accelerate.utils import ProjectConfiguration

    cuda = torch.cuda.is_available()
    kwargs = {
        "cpu": not cuda,
        "mixed_precision": resolve_mixed_precision(cfg.mixed_precision, cuda),
        "project_config": ProjectConfiguration(project_dir=cfg.out, automatic_checkpoint_naming=False),
    }
    log_with = installed_trackers(trackers(cfg))
    if log_with:
        kwargs["log_with"] = log_with
    # A collective that waits longer than this for another process raises instead of hanging forever
    # (gloo on CPUs; NCCL's watchdog on GPUs): a rank that died, stopped or stalls cannot block the rest.
    kwargs["kwargs_handlers"] = [dist_timeout_handler(cfg.dist_timeout)]
    meet(cfg.rendezvous_timeout)  # bounded and stoppable: torch's own connect retries in C++ for 30 minutes
    accelerator = Accelerator(**kwargs)
    check_process_group(accelerator.num_processes, os.environ.get("WORLD_SIZE"))
    note = launcher_precision_note(cfg.mixed_precision, accelerator.mixed_precision)
    if note and accelerator.is_main_process:  # beside the launcher's warning, which names its own default
        print(note, file=sys.stderr)
    if not cuda:
        # Launchers set OMP_NUM_THREADS=1 per process; on a CPU run the cores are the compute: share them.
        want = max(1, usable_cores() // processes_per_machine(accelerator))
        if torch.get_num_threads() < want:
            torch.set_num_threads(want)
    return accelerator


# The package each tracker needs (what `pip install` gets), and the module that shows it is installed.
_TRACKER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow", "trackio": "trackio"}


def installed_trackers(names: tuple[str, ...]) -> list[str]:
    """The Accelerate ``log_with`` names for ``names`` (from ``config.trackers``): "all" keeps the installed
    ones of TRACKERS; a tracker named on its own that is not installed is an error.

    Raises:
        ValueError: a named tracker's package is not installed (the message gives the pip command).
    """
    have = {t for t, module in _TRACKER_PACKAGES.items() if importlib.util.find_spec(module) is not None}
    if names == ("all",):
        return [t for t in TRACKERS if t in have]
    missing = [t for t in names if t not in have]
    if missing:
        pkgs = " ".join(_TRACKER_PACKAGES[t] for t in missing)
        raise ValueError(
            f"--report-to {','.join(missing)}: not installed; pip install {pkgs} (or pip install 'mmfast[track]')"
        )
    return list(names)


def resolve_data(cfg: DataConfig, accelerator) -> Path:
    """The prepared dataset directory: the demo set by default, a raw input prepared on the fly into
    ``<out>/prepared``, a prepared directory as given, or the mix of several (``--data`` given twice or more)
    made into ``<out>/prepared``. The main process prepares; the others reuse."""
    if len(data_sources(cfg)) > 1:
        return _mix(cfg, accelerator)
    if cfg.data is not None and _looks_prepared(Path(cfg.data)):
        return Path(cfg.data)  # PreparedDataset verifies it (and explains an incomplete one)
    if cfg.data is not None and _is_prepared_split(Path(cfg.data)):
        raise ValueError(
            f"--data {cfg.data}: is a split of the prepared dataset {Path(cfg.data).parent}; pass --data "
            f"{Path(cfg.data).parent} (as a raw manifest its class ids would become class names, and its rows "
            "would be split again)"
        )
    with accelerator.main_process_first():
        if cfg.data is None:
            source = demo_dataset(n=cfg.demo_size, seed=0)
            out = default_cache_dir() / "prepared" / f"{source.parent.name}-len{cfg.max_length}"
        else:
            # a URL pattern stays a string (Path would fold its "//")
            source = cfg.data if is_remote(cfg.data) else Path(cfg.data)
            out = Path(cfg.out) / RAW_DATA_DIR
        prep = PrepareConfig(
            source=str(source),
            out=str(out),
            tokenizer=cfg.tokenizer or pretrained_tokenizer(cfg.text_model),
            max_length=cfg.max_length,
            seed=0,
            progress=cfg.progress and accelerator.is_local_main_process,
        )
        try:
            summary = _prepare_raw(prep, cfg)
            if cfg.data is not None:
                c = summary["counts"]
                rows = f"{c['train']} train, {c['val']} val rows"
                dropped = (
                    f", {c['rejected']} rejected ({_first_rejected(out, source, summary.get('input_kind'))})"
                    if c["rejected"]
                    else ""
                )
                accelerator.print(f"prepared {redact(source)} into {out}: {rows}{dropped}")
        except ManifestError as e:
            if cfg.data is None:
                raise
            raise _raw_data_error(e, source, out, Path(cfg.out)) from e
    return out


def _first_rejected(out: Path, source, kind: str | None) -> str:
    """The first row preparation left out, where the input holds it (file and line, or the reader's row) and
    why, and the file that lists them all; only that file when its first entry cannot be read."""
    path = out / REJECTED_FILE
    try:
        with open(path, encoding="utf-8") as f:
            first = json.loads(f.readline())
        place = source
        if first.get("file") and not is_remote(source):  # a reject's file is relative to the input's folder
            place = (source if source.is_dir() else source.parent) / first["file"]
        where = reader_named(kind or "manifest").where(place, first["line"])
        row = first.get("row")  # the row as read; text where it was no JSON object
        image = f" ({row['image']})" if isinstance(row, dict) and isinstance(row.get("image"), str) else ""
        return redact(f"the first: {where}{image}: {first['reason']}; all of them in {path}")  # a URL's secrets
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # what it cannot read, the file says
        return f"see {path}"


def _prepare_raw(prep, cfg: DataConfig) -> dict:
    """Prepare the demo set or a raw --data. For an objective that needs no labels (contrastive), an input
    without them is prepared as ``--no-labels`` would: image-caption pairs train as they are; an input with
    labels keeps them (zero-shot evaluation uses them)."""

    try:
        return prepare_dataset(prep)
    except ManifestError:
        task = TASKS.get(cfg.task or "classification")
        if cfg.data is None or getattr(task, "needs_labels", True) or prep.inputs.no_labels:
            raise
    report = failure_report_path(Path(prep.out))  # the first try's: written by this run, about labels
    summary = prepare_dataset(replace(prep, inputs=replace(prep.inputs or InputOptions(), no_labels=True)))
    report.unlink(missing_ok=True)
    return summary


def _raw_data_error(e: Exception, source: Path, prepared: Path, run_dir: Path) -> Exception:
    """A raw --data's preparation failed: the error as the user should read it. The rejects of a preparation
    that found no usable row move from the run directory to beside it (the failed start leaves nothing in
    the run directory: ``rundir``), and the reader's advice that names mmfast-prepare's input flags, which
    mmfast-train does not take, says to prepare first."""

    msg = str(e)
    report, kept = failure_report_path(prepared), failure_report_path(run_dir)
    if report.is_file():
        os.replace(report, kept)
        msg = msg.replace(str(report), str(kept))
    msg = msg.replace(f" ({prepared} was not changed)", "")  # the run's own copy, which it never made
    if "--" in msg:
        msg += (
            f"\n({TRAIN} reads a raw --data with the default input settings; to pass those flags, prepare it "
            f"first: {PREPARE} {source} --out DIR ..., then {TRAIN} --data DIR)"
        )
    return ManifestError(msg)


def check_data_exists(cfg: DataConfig) -> None:
    """A --data that names nothing is refused (by the engine, before the run directory is touched)."""
    for data in data_sources(cfg):
        restore_interrupted_swap(data)  # a preparation killed while replacing it left it aside
        if not Path(data).exists() and not claimed(data):
            raise ValueError(f"--data {data}: no such prepared directory, manifest or image folder")


def _mix(cfg: DataConfig, accelerator) -> Path:
    """The mix of the prepared datasets --data names, made (or reused) in ``<out>/prepared``."""
    given = data_sources(cfg)
    for data in given:
        if not _looks_prepared(Path(data)):
            raise ValueError(
                f"--data {data}: a mix (--data given {len(given)} times) takes prepared datasets; prepare it "
                f"first: {PREPARE} {data} --out DIR, then pass --data DIR"
            )
    out = Path(cfg.out) / RAW_DATA_DIR
    with accelerator.main_process_first():
        summary = prepare_mix(given, out, keep=cfg.resume is not None)
    shares = ", ".join(f"{s['name']} ({s['train']} train)" for s in summary["mix"]["sources"])
    accelerator.print(f"mixed {shares} into {out}")
    return out


def _is_prepared_split(path: Path) -> bool:
    """``train.jsonl`` / ``val.jsonl`` of a prepared directory (which it lies in)."""
    return path.name in map(split_file, SPLITS) and prepared_state(path.parent) == COMPLETE


def _looks_prepared(path: Path) -> bool:
    """A prepared directory, complete or not (``PreparedDataset`` explains an incomplete one)."""
    return prepared_state(path) is not None


def all_processes_ok(accelerator, ok: bool) -> bool:
    """True when ``ok`` holds on every process (a collective call: every process must make it)."""
    if accelerator.num_processes == 1:
        return ok
    flag = torch.tensor([int(ok)], device=accelerator.device)
    return bool(accelerator.reduce(flag, reduction="sum").item() == accelerator.num_processes)


def pretrained_tokenizer(text_model: str | None) -> str | None:
    """The tokenizer that goes with a pretrained text model (its own directory or hub name); None for the
    randomly initialized configs, which train on the dataset's own WordPiece vocabulary."""

    if text_model is None or text_model in RANDOM_TEXT_CONFIGS:
        return None
    return resolve_text_model(text_model)


def check_tokenizer_matches(text_model: str, data_dir: Path) -> None:
    """Refuse to feed a pretrained text model token ids from another vocabulary (it would train, badly)."""

    own = pretrained_tokenizer(text_model)
    if own is None:
        return
    try:
        model_tok = load_tokenizer(own)
    except ValueError:
        return  # the model ships no tokenizer: nothing to compare with
    data_tok = load_tokenizer(data_dir / TOKENIZER_DIR)
    if tokenizer_fingerprint(model_tok) != tokenizer_fingerprint(data_tok):
        raise ValueError(
            f"{data_dir} was tokenized with another vocabulary than text model '{text_model}' "
            f"uses; prepare it with --tokenizer {text_model} ({PREPARE} SOURCE --out DIR --tokenizer "
            f"{text_model}), or pass the raw input as --data (prepared on the fly with that vocabulary)"
        )
