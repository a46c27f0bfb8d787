"""The profiler's verdict: whether a loop is input-bound, host-bound or compute-bound, and what to change next.

``verdict(report)`` reads a report of ``profiler.build_report`` (its data-wait share, utilization and the
settings it ran with). Its advice names the knobs in the words of where the loop is set up: ``TRAIN_FLAGS``
for ``mmfast-train`` and ``mmfast-profile``, ``OWN_LOOP`` for a user's own loop over the drop-in loaders
(``mmfast.train.loop_profiler``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

INPUT_BOUND = 0.20  # the loop waits for data in more than 20% of its time
GPU_BUSY = 70.0  # mean GPU utilization below this with little data wait: the host is the bottleneck


@dataclass(frozen=True)
class Knobs:
    """How the reader of a verdict sets each knob its advice names."""

    image_size: str
    threads: str  # the DALI threads, "{}" for how many there are now
    prefetch: str
    batch_size: str
    cache_decoded: str  # why every image was decoded every epoch, and what helps
    reduce_overhead: str  # CUDA graphs
    mixed_precision: str  # "{}" for the dtype
    channels_last: str
    compile: str
    all_gpus: str  # "{}" for the number of GPUs


TRAIN_FLAGS = Knobs(
    image_size="--image-size",
    threads="DALI threads (--num-threads)",
    prefetch="the prefetch depth",
    batch_size="--batch-size",
    cache_decoded=(
        "this run decoded every image every epoch (--cache-decoded, the default, holds them when they fit in half "
        "the available memory, from image files, without colour jitter or --cpu-resize dali): prepare with "
        "--max-side to shrink them"
    ),
    reduce_overhead="--compile-mode reduce-overhead",
    mixed_precision="--mixed-precision {}",
    channels_last="--channels-last",
    compile="--compile",
    all_gpus="accelerate launch --multi_gpu --num_processes {} ...",
)

OWN_LOOP = Knobs(
    image_size="the loader's size=",
    threads="the loader's DALI threads (num_workers=)",
    prefetch="its prefetch= depth",
    batch_size="batch_size=",
    cache_decoded=(
        "this loop decoded every image every epoch (the loader's cache_decoded= holds them decoded when they "
        "fit in half the available memory, from image files, without color_jitter): shrink the images "
        "offline (mmfast-prepare --max-side)"
    ),
    reduce_overhead="torch.compile(model, mode='reduce-overhead')",
    mixed_precision="torch.autocast in {}",
    channels_last="the channels_last memory format (the model's and the images')",
    compile="torch.compile(model)",
    all_gpus="torchrun --nproc_per_node {} ..., each loader given its shard_id= and num_shards=",
)

TORCH_LOADER = replace(  # a user's own loop over torch's DataLoader (or another iterable that is not mmfast's)
    OWN_LOOP,
    image_size="the transform's crop size",
    threads="the DataLoader's worker processes (num_workers=)",
    prefetch="its prefetch_factor= (or mmfast.ImageLoader, which decodes with DALI threads)",
)


def verdict(report: dict, words: Knobs = TRAIN_FLAGS) -> dict:
    """Classify a run and say what to change.

    Args:
        report: phase shares, utilization and settings (``profiler.build_report``).
        words: how the advice names each knob (``TRAIN_FLAGS``, ``OWN_LOOP`` or ``TORCH_LOADER``).

    Returns:
        {"bound": "input" | "host" | "compute", "summary": one line, "next_steps": [...]}
    """
    wait = report.get("data_wait_frac", 0.0)
    util = report.get("utilization") or {}
    gpu = util.get("gpu", {})
    gpu_util = gpu.get("gpu_util", {}).get("mean") if isinstance(gpu.get("gpu_util"), dict) else None
    settings = report.get("settings", {})
    on_gpu = gpu_util is not None
    if wait > INPUT_BOUND:
        bound, steps = "input", _input_advice(settings, util.get("cpu_util_mean"), on_gpu, words)
        summary = f"input-bound: the loop waits for data {wait:.0%} of the time"
    elif on_gpu and gpu_util < GPU_BUSY:
        bound = "host"
        if settings.get("compile_mode") != "reduce-overhead":
            steps = [
                f"the GPU idles between kernels: {words.reduce_overhead} (CUDA graphs: the step's kernels "
                f"launched at once; captions padded to a few widths), or a larger {words.batch_size}"
            ]
        else:
            steps = [f"the GPU idles between kernels even with CUDA graphs: a larger {words.batch_size}"]
        steps.append("check for per-step host syncs (.item(), printing) in your own code")
        summary = f"host-bound: data arrives in time ({wait:.0%} wait) but the GPU is only {gpu_util:.0f}% busy"
    else:
        bound, steps = "compute", _compute_advice(settings, on_gpu, words)
        busy = f", GPU {gpu_util:.0f}% busy" if on_gpu else ""
        summary = f"compute-bound: data wait is {wait:.0%}{busy}; speed comes from the model side"
    cpu, machine = util.get("cpu_util_mean"), util.get("machine_cpu_util_mean")
    if cpu is not None and machine is not None and machine > 80 and machine - cpu > 30:
        steps.insert(
            0,
            f"other processes kept the machine {machine:.0f}% busy while this run used {cpu:.0f}% of it: "
            "profile on a quiet machine before acting on this verdict",
        )
    return {"bound": bound, "summary": summary, "next_steps": steps}


def _input_advice(settings: dict, cpu: float | None, on_gpu: bool, words: Knobs) -> list[str]:
    """What feeds an input-bound loop faster: the GPU's decoder, fewer pixels, more threads, larger batches."""
    steps = []
    if settings.get("feature_views") is not None:  # cached features: no image is decoded, no image tower runs
        return ["the steps read cached image features, not pixels: a larger batch amortizes per-batch costs"]
    if on_gpu and settings.get("decode_device") == "cpu":
        steps.append("decode on the GPU (DALI device 'mixed'; mmfast does this when the loader's device is cuda)")
    if cpu is not None and cpu > 85:
        steps.append(
            f"the CPU is saturated ({cpu:.0f}% mean): smaller {words.image_size}, pre-resize large images "
            "offline, or move decoding to the GPU"
        )
        if not on_gpu and settings.get("cache_decoded") is False:
            steps.append(words.cache_decoded)
    else:
        now = settings.get("dali_threads")
        threads = words.threads + (f", now {now}" if now is not None else "")
        steps.append(f"raise {threads}, and {words.prefetch}; the CPU is not saturated")
    steps.append("a larger batch amortizes per-batch costs")
    return steps


def _compute_advice(settings: dict, on_gpu: bool, words: Knobs) -> list[str]:
    """What speeds up a compute-bound run on this machine: nothing that needs a GPU it does not have."""
    steps = []
    # images held decoded are not decoded again, and cached features are none decoded: the cores are the model's
    decodes = not settings.get("cache_decoded") and settings.get("feature_views") is None
    if not on_gpu and settings.get("decode_device") == "cpu" and decodes:
        steps.append(
            "the loader's decoding threads share the CPU cores with the model, so part of the compute time is "
            f"decoding: fewer pixels (a smaller {words.image_size}, images shrunk offline by mmfast-prepare "
            "--max-side) free cores for the model"
        )
    gpus, procs = settings.get("cuda_devices", 1 if on_gpu else 0), settings.get("num_processes", 1)
    bf16 = words.mixed_precision.format("bf16")
    if settings.get("mixed_precision") in (None, "no"):
        if on_gpu or gpus:
            fp16 = words.mixed_precision.format("fp16")
            steps.append(f"use mixed precision ({fp16}, or bf16 on Ampere and newer)")
        elif settings.get("cpu_fast_bf16", True):
            steps.append(f"use mixed precision ({bf16}: this CPU has native bf16)")
    elif on_gpu and settings.get("mixed_precision") == "fp16" and settings.get("cuda_bf16"):
        steps.append(f"{bf16}: this GPU computes bf16 natively, and needs no gradient scaler")
    if (on_gpu or gpus) and not settings.get("channels_last"):
        steps.append(f"{words.channels_last} for faster convolutions on tensor cores")
    if on_gpu and not settings.get("compile"):
        steps.append(f"{words.compile}: fewer, fused kernels (its warm-up steps are left out of the figures)")
    if gpus > procs:
        steps.append(f"use all {gpus} GPUs: {words.all_gpus.format(gpus)}")
    smaller = "a smaller model" + (f" or {words.image_size}" if settings.get("feature_views") is None else "")
    steps.append(smaller + (", or more GPUs" if on_gpu or gpus else ""))
    return steps
