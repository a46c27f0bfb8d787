"""Profile a training configuration: where step time goes, how busy the devices are, and what to change.

    mmfast-profile [mmfast-train flags ...] [--steps 30] [--trace] [--out runs/profile]
    mmfast-profile --run RUN_DIR        (report on a run trained with --profile)

(from a checkout: python tools/profile_run.py ...; accelerate launch -m mmfast.cli.profile_run ... for several
processes).

Runs a short training (``--max-steps``) with ``--profile``: phases timed with honest GPU syncs, GPU
(NVML) and CPU utilization sampled in the background. Writes ``profile.json`` and ``profile.png`` in the
run directory (plus ``trace.json``, a Chrome trace from torch.profiler, with --trace) and prints the
verdict: input-bound / host-bound / compute-bound, with the next step to try.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from mmfast.cli import HelpFormatter, Parser
from mmfast.util.quiet import filter_native_stderr
from mmfast.util.voice import command_line


def parse_args(argv):
    p = Parser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--run", help="an existing run directory with profile.json (no training)")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps to profile")
    p.add_argument("--trace", action="store_true", help="also write a torch.profiler Chrome trace")
    p.add_argument(
        "--out",
        help="the profile's run directory (default: runs/profile, an earlier profile there moved aside)",
    )
    return p.parse_known_args(argv)


def print_report(report: dict) -> None:
    v = report["verdict"]
    print(f"\n{'phase':<12}{'seconds':>10}{'share':>8}")
    for name, sec in report["phase_s"].items():
        share = (
            f"{report['phase_frac'][name]:>8.1%}" if name in report["phase_frac"] else "   (not in training time)"
        )
        print(f"{name:<12}{sec:>10.3f}{share}")
    print(f"{'other':<12}{report['other_s']:>10.3f}")
    util = report.get("utilization") or {}
    gpu = util.get("gpu", {})
    gpu_line = (
        f"GPU {gpu['gpu_util']['mean']:.0f}% mean" if "gpu_util" in gpu else f"GPU: {gpu.get('reason', 'n/a')}"
    )
    if util and not util.get("samples"):
        gpu_line = "no utilization samples in the steady state: profile more --steps"
    warm = report.get("warmup") or {}
    after = f" (steady state, after {warm['steps']} warm-up steps)" if warm.get("steps") else ""
    print(
        f"\n{report['images_per_s']:.1f} images/s, data wait {report['data_wait_frac']:.0%}, "
        + (f"CPU {util['cpu_util_mean']:.0f}% mean, " if "cpu_util_mean" in util else "")
        + f"{gpu_line}{after}"
    )
    print(f"\nverdict: {v['summary']}")
    for s in v["next_steps"]:
        print(f"  - {s}")


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
    from mmfast.cli.train import user_errors

    try:
        summary = _profile(args, train_flags)
    except user_errors() as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not summary["is_main_process"]:
        return 0
    report = json.loads((Path(args.out) / "profile.json").read_text())
    print_report(report)
    print(f"\nwrote {args.out}/profile.json, {args.out}/profile.png" + (", trace.json" if args.trace else ""))
    return 0


def _profile(args, train_flags: list[str]) -> dict:
    """The short training run with --profile; returns its summary."""
    from mmfast.train.flags import parse_config
    from mmfast.train.run import train

    default_out = args.out is None
    args.out = args.out or "runs/profile"
    flags = [*train_flags, "--profile", "--max-steps", str(args.steps), "--out", args.out, "--no-progress"]
    flags.append("--no-checkpoints")  # a profile is thrown away: no gigabytes of optimizer state written
    if default_out and "--overwrite" not in train_flags:
        flags.append("--overwrite")  # profiling again is the normal use: the earlier profile is moved aside
    cfg = parse_config(flags)
    if args.trace:
        import torch

        acts = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=acts) as prof:
            summary = train(cfg)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(Path(args.out) / "trace.json"))
        return summary
    return train(cfg)


if __name__ == "__main__":
    sys.exit(main())
