"""Train an image+text model: a fusion classifier, or a contrastive dual encoder (--model clip).

    mmfast-train [flags]                                  (one process)
    accelerate launch -m mmfast.cli.train [flags]         (several processes / GPUs; or torchrun -m ...)
    accelerate launch tools/train.py [flags]              (from a checkout)

With no flags it generates the built-in demo dataset and trains the tiny preset on it.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys

from mmfast.util.commands import TRAIN
from mmfast.util.quiet import filter_native_stderr
from mmfast.util.stop_watch import StopWatch
from mmfast.util.voice import command_line


def print_table(summary: dict) -> None:
    rows = [
        ("model", f"{summary['model']} ({summary['image_backbone']} + {summary['text_model']})"),
        ("device", f"{summary['device']} x {summary['num_processes']}, {summary['mixed_precision']}"),
        *_accuracy_row(summary),
        ("images/s", f"{summary['images_per_s']:.0f}"),
        ("optimizer steps", str(summary["global_step"])),
        ("skipped steps", str(summary["skipped_steps"])),
        *_skipped_row(summary),
        ("images", summary.get("images", "")),
        *_shards_row(summary),
        ("wall time", f"{summary['wall_s']:.1f} s"),
        ("run directory", summary["run_dir"]),
    ]
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows))


def _skipped_row(summary: dict) -> list[tuple[str, str]]:
    """Unreadable train images the run left out, when there were any."""
    n = summary.get("skipped_samples")
    return [("skipped images", f"{n} unreadable (listed in skipped.jsonl)")] if n else []  # report.SKIPPED_FILE


def _accuracy_row(summary: dict) -> list[tuple[str, str]]:
    """The classification task's accuracy line (another task's summary has no val_acc: no line)."""
    if "val_acc" not in summary:
        return []
    if summary["val_acc"] is None:
        return [("val_acc", "no val split")]
    return [("val_acc", f"{summary['val_acc']:.4f} (best {summary['best_val_acc']:.4f})")]


def _shards_row(summary: dict) -> list[tuple[str, str]]:
    """The shard cache's line of a run that streamed remote shards (a run on local data has none)."""
    s = summary.get("shards")
    if not s:
        return []
    return [
        (
            "shards",
            f"{s['fetches']} fetched ({s['bytes_fetched'] / 2**20:.1f} MiB in {s['fetch_seconds']:.1f} s, "
            f"{s['retries']} retries{_backed_off(s)}); {s['hits']} of {s['hits'] + s['misses']} reads found "
            f"their shard in the cache (fetched ahead or kept), {s['evictions']} evicted, "
            f"waited {s['wait_seconds']:.1f} s",
        )
    ]


def _backed_off(shards: dict) -> str:
    """How long the retries waited for the store (nothing without a retry)."""
    return f" over {shards['retry_seconds']:.1f} s" if shards.get("retry_seconds") else ""


@command_line
def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    from mmfast.train.config import TrainConfig  # no torch: --help stays quick

    # A stop before the loop ends the start-up like Ctrl-C does (a KeyboardInterrupt); once the loop runs, it
    # sets a flag and the run checkpoints at the next step (train/stop.py). The watch bounds either by the grace.
    with StopWatch(TRAIN, TrainConfig.stop_grace, follow_parent=_under_launcher()) as watch:
        try:
            with filter_native_stderr():  # libpng's harmless colour-profile warnings, once per PNG and epoch
                return _main(argv, watch)
        except BaseException:
            # a KeyboardInterrupt raised inside an import can come out wrapped (a RuntimeError from a class
            # body's __set_name__): what the watch heard tells a stop from a failure
            if watch.signum is None:
                raise
            print("interrupted before training started; nothing to resume", file=sys.stderr)
            return 130
        finally:
            # registered last, so it runs first at exit: before DALI's own teardown handler
            atexit.unregister(_quiet_interrupt_at_exit)
            atexit.register(_quiet_interrupt_at_exit)


def _under_launcher() -> bool:
    """Whether torchrun (or accelerate launch, through it) started this process: a rank whose launcher is
    killed stops as on SIGTERM instead of running on alone."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def _quiet_interrupt_at_exit() -> None:
    """At exit: a Ctrl-C while the interpreter shuts down (DALI tears its pipelines down in an exit handler of
    its own) ends the process at once with 130, instead of printing that handler's traceback."""
    signal.signal(signal.SIGINT, lambda signum, frame: os._exit(130))


def user_errors() -> tuple[type[Exception], ...]:
    """What a training run raises about the user's data, flags or machine: said in one line, exit 2."""
    # torch: imported when the command runs, so --help stays light
    from mmfast.inputs.manifest import ManifestError
    from mmfast.loading.epoch_reader import DaliFailure
    from mmfast.train.engine import NonFiniteLossError
    from mmfast.train.heartbeat import PeerFailure
    from mmfast.train.rendezvous import RendezvousError
    from mmfast.train.setup import LaunchError

    launch = (LaunchError, RendezvousError, PeerFailure)
    return (ValueError, ManifestError, NonFiniteLossError, OSError, *launch, DaliFailure)


_OUT_OF_MEMORY = ("can't allocate memory", "out of memory", "std::bad_alloc", "cannot allocate memory")


def out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` says the process ran out of memory (Python's, torch's CPU / CUDA allocators')."""
    return isinstance(error, MemoryError) or any(m in str(error).lower() for m in _OUT_OF_MEMORY)


def _main(argv: list[str] | None, watch: StopWatch) -> int:
    from mmfast.train.flags import parse_config  # torch: imported when the command runs, so --help stays light

    try:
        cfg = parse_config(argv)  # --help exits here, before torch or DALI is imported
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    watch.grace = cfg.stop_grace
    # Imported here, under main's KeyboardInterrupt handler: Ctrl-C while torch imports exits cleanly.
    from mmfast.train.run import train

    try:
        summary = train(cfg)
    except user_errors() as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (MemoryError, RuntimeError) as e:  # torch's allocators raise RuntimeError (OutOfMemoryError)
        if not out_of_memory(e):
            raise
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        print(
            f"error: out of memory ({first}); lower --batch-size (--grad-accum keeps the effective batch) or "
            "--image-size, or free memory (a limit set by ulimit -v or a cgroup counts)",
            file=sys.stderr,
        )
        return 2
    if summary.get("interrupted"):
        if summary.get("is_main_process", True):  # once, not once a process
            print("interrupted", file=sys.stderr)  # the engine said where it stopped and how to resume
        return 130
    if summary["is_main_process"] and summary.get("images_per_s") is not None:
        print_table(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
