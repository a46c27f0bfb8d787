"""Profile a training configuration: where step time goes, how busy the devices are, and what to change.

    mmfast-profile [mmfast-train flags ...] [--steps 30] [--warmup 5] [--trace] [--out runs/profile]
    mmfast-profile --run RUN_DIR        (report on a run trained with --profile)

(from a checkout: python tools/profile_run.py ...; accelerate launch -m mmfast.cli.profile_run ... for several
processes).

Trains --warmup + --steps optimizer steps of the run the flags describe and times the last --steps: phases
timed with honest GPU syncs, GPU (NVML) and CPU utilization sampled in the background. Nothing else a run
does: no evaluation, checkpoint or model directory, and a dual encoder's projections start at random
(--init-proj ridge's pass is skipped: a step takes as long; so is --zero-shot-map kernel's). Writes only
``profile.json`` and ``profile.png`` in --out (plus ``trace.json``, a Chrome trace from torch.profiler, with
--trace) and prints the verdict:
input-bound / host-bound / compute-bound, with the next step to try. A raw --data (a manifest, a folder) is
prepared first, into --out's prepared/, as mmfast-train does: give a prepared directory to time only the steps.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

from mmfast.cli import HelpFormatter, Parser
from mmfast.train.config import PROFILE_WARMUP_STEPS
from mmfast.util.quiet import filter_native_stderr
from mmfast.util.voice import command_line


def parse_args(argv):
    p = Parser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--run", help="an existing run directory with profile.json (no training)")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps in the profile's figures")
    p.add_argument(
        "--warmup",
        type=int,
        default=PROFILE_WARMUP_STEPS,
        help="optimizer steps before them, left out of the figures (start-up, autotuning, the first prefetch)",
    )
    p.add_argument("--trace", action="store_true", help="also write a torch.profiler Chrome trace")
    p.add_argument(
        "--out",
        help="the profile's run directory (default: runs/profile); an earlier profile there is moved aside",
    )
    return p.parse_known_args(argv)


def print_report(report: dict) -> None:
    """Print a profile's report: its phases, throughput, utilization, notes and verdict."""
    from mmfast.train.profiler import report_text  # torch: not for --help

    print(report_text(report))


@command_line
def main(argv: list[str] | None = None) -> int:
    with filter_native_stderr():  # libpng's harmless colour-profile warnings (mmfast.util.quiet)
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    args, train_flags = parse_args(argv)
    if args.run:
        path = Path(args.run) / "profile.json"
        if not Path(args.run).is_dir():
            print(f"error: --run {args.run}: no such run directory", file=sys.stderr)
            return 2
        if not path.is_file():
            print(f"error: {path} not found; train with --profile first", file=sys.stderr)
            return 2
        report = json.loads(path.read_text())
        print_report(report)
        return 0
    from mmfast.cli.train import user_errors  # torch: imported when the command runs, so --help stays light

    try:
        report = _profile(args, train_flags)
    except user_errors() as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not report["is_main_process"]:
        return 0
    print_report(report)
    print(f"\nwrote {args.out}/profile.json, {args.out}/profile.png" + (", trace.json" if args.trace else ""))
    return 0


def profile_steps(cfg, steps: int, warmup: int = PROFILE_WARMUP_STEPS) -> dict:
    """Time ``steps`` optimizer steps of the configured run after ``warmup`` untimed ones
    (``mmfast.train.short_profile.time_steps``, run as a run's body).

    Args:
        cfg: the run to profile (a ``TrainConfig``); its --out receives profile.json and profile.png (an earlier
            profile there is moved aside as a run's would be).
        steps: optimizer steps in the figures.
        warmup: optimizer steps before them (start-up, autotuning, the first prefetch), left out.

    Returns:
        the report profile.json holds (on the main process), plus ``is_main_process``.

    Raises:
        ValueError: ``steps`` < 1, ``warmup`` < 0, or a --resume (a profile times a fresh start).
    """
    # torch: imported when the command runs, so --help stays light
    from mmfast.train.run import as_run
    from mmfast.train.short_profile import time_steps
    from mmfast.train.slices import slices

    if steps < 1 or warmup < 0:
        raise ValueError(f"--steps must be >= 1 and --warmup >= 0, got {steps} and {warmup}")
    if cfg.resume is not None:
        raise ValueError("a profile times a fresh start: leave out --resume")
    quiet = {"checkpoints": False, "report_to": None, "tensorboard": False, "progress": False}
    cfg = replace(cfg, profile=True, max_steps=warmup + steps, **quiet)

    def body(resolved, accelerator, resume_from: Path | None, t_start: float) -> dict:
        return time_steps(slices(resolved), accelerator, warmup)  # each builder takes its slice

    return as_run(cfg, body)


def _profile(args, train_flags: list[str]) -> dict:
    """The profile's steps (``profile_steps``); returns its report."""
    from mmfast.train.flags import parse_config  # torch: imported when the command runs, so --help stays light
    from mmfast.train.rundir import is_run_dir, never_started  # with it

    default_out = args.out is None
    args.out = args.out or "runs/profile"
    flags = [*train_flags, "--out", args.out]
    # profiling again is the normal use: an earlier profile is moved aside (a training run only if asked)
    if (default_out or (Path(args.out) / "profile.json").is_file()) and "--overwrite" not in train_flags:
        flags.append("--overwrite")
    elif "--overwrite" not in train_flags and is_run_dir(Path(args.out)) and not never_started(Path(args.out)):
        raise ValueError(
            f"--out {args.out} holds an earlier training run, which a profile does not continue: pass "
            "--overwrite to move it aside (nothing is deleted), or choose another --out"
        )
    cfg = parse_config(flags)
    if args.trace:
        import torch  # torch: only when asked for (--trace); --help imports none

        acts = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=acts) as prof:
            report = profile_steps(cfg, args.steps, args.warmup)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(Path(args.out) / "trace.json"))
        return report
    return profile_steps(cfg, args.steps, args.warmup)


if __name__ == "__main__":
    sys.exit(main())
