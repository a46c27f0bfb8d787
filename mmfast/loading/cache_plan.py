"""The one policy of the decoded-image cache: which splits a process holds decoded in memory, with what
budget, and why the others are streamed. The training engine (``--cache-decoded``), ``ImageLoader`` and
``MultimodalLoader`` (``cache_decoded=``) and predict all call ``plan_decoded_cache``; the loaders carry
out the ``CachePlan`` it returns (``mmfast.loading.decoded`` holds the images).

One list of reasons (``_obstacle``), each naming the setting in the caller's words (a flag for the
command line, an argument for the library: ``util.voice``), and one rule for how many processes share this
machine's memory (``processes_on_machine``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mmfast.loading.decoded import DecodedImages, auto_plan, default_budget
from mmfast.util import voice

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CachePlan:
    """What a loader does with one split's decoded images."""

    cache: bool  # hold them decoded (else stream)
    why: str  # the reason, said in the log and the run summary
    budget: int | None = None  # bytes the cache may hold (None: its share of what is available when it fills)
    share: int = 1  # processes of this machine whose caches share that memory


@dataclass(frozen=True)
class SplitImages:
    """One split a plan is asked about."""

    name: str
    train: bool  # random crops (and colour jitter, when asked) rather than the eval resize
    color_jitter: float = 0.0
    epochs: int | None = None  # how many epochs will read it (None: unknown)
    # decoded bytes of its images if they fit in the given limit, else None (a prepared directory knows its
    # images' sizes); None: estimated from a sample of the files' headers (``decoded.auto_plan``)
    need: Callable[[int], int | None] | None = None
    files: Sequence[str] = ()  # for the estimate
    size: int = 224  # output side, for the estimate


def processes_on_machine(num_shards: int, device_type: str) -> int:
    """How many of the run's processes share this machine's memory and cores: the launcher's
    ``LOCAL_WORLD_SIZE`` when it set one (torchrun, accelerate), else one per visible GPU on a GPU machine,
    else all of them (a multi-process CPU run is one machine's)."""
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    if local.isdigit() and int(local) > 0:
        return int(local)
    if device_type == "cuda":
        import torch  # only asked on a GPU machine, where torch is loaded already

        return max(1, min(torch.cuda.device_count(), num_shards))
    return max(1, num_shards)


def plan_decoded_cache(
    splits: Sequence[SplitImages],
    setting: bool | int | str,
    *,
    device_type: str,
    host_finish: bool,
    source,
    processes: int,
    budget: int | None = None,
) -> dict[str, CachePlan]:
    """Which of ``splits`` are held decoded, in order, while their decoded pixels fit together in the budget.

    Args:
        splits: the splits of one process, the one read most first.
        setting: "auto" (where it pays and fits; the reasons of the others are logged, never raised), True
            (hold them, up to half the memory available when each fills), a budget in bytes (hold them in
            it), False (stream). With True or a budget, an obstacle is a ValueError saying why.
        device_type: where the batches are decoded ("cuda": nvJPEG, never cached).
        host_finish: the decoded crops are finished on the host (``cpu_resize="torch"``).
        source: the image source (``mmfast.loading.sources``): cached only when the loader orders its reads.
        processes: processes of this machine (``processes_on_machine``): each holds its own copy.
        budget: the memory to share (default: ``decoded.default_budget()``, half of what is available now).

    Returns:
        {split name: CachePlan}.
    """
    if setting is False or setting is None:
        off = voice.setting("cache_decoded", "--no-cache-decoded", value=False)
        return {s.name: CachePlan(False, off) for s in splits}
    explicit = not (setting is True or (isinstance(setting, str) and setting == "auto"))
    if explicit and (isinstance(setting, bool) or not isinstance(setting, int) or setting < 1 << 20):
        raise ValueError(
            f"cache_decoded must be 'auto', True, False or a budget in bytes of at least 1 MiB, got {setting!r}"
        )
    plans: dict[str, CachePlan] = {}
    left = None
    for split in splits:
        why = _obstacle(split, device_type, host_finish, source)
        if why and setting != "auto":
            raise ValueError(f"cache_decoded: {why}")
        if why:
            plans[split.name] = CachePlan(False, why)
        elif setting is True:
            plans[split.name] = CachePlan(True, voice.setting("cache_decoded", value=True))
        elif setting != "auto":
            plans[split.name] = CachePlan(True, f"a budget of {setting / 2**20:.0f} MiB", budget=setting)
        else:
            if left is None:
                left = (default_budget() if budget is None else budget) // processes
            plans[split.name], left = _auto(split, left, processes)
    return plans


def _obstacle(split: SplitImages, device_type: str, host_finish: bool, source) -> str:
    """Why ``split`` cannot be held decoded, or ""."""
    if device_type == "cuda":
        return "the GPU decodes them (nvJPEG); the cache is for CPU decoding"
    if not host_finish:
        needed = voice.setting("cpu_resize", value="torch")
        return f"{voice.setting('cpu_resize', value='dali')}: held images need {needed}"
    if not source.ordered_by_loader:
        return (
            f"read by the {source.name} source, which orders its reads itself; only image files are held decoded"
        )
    if not source.needs_paths:
        return f"read from shards by the {source.name} source; only image files are held decoded"
    if split.train and split.color_jitter > 0:
        return voice.said(
            "--color-jitter is applied while streaming",
            "colour jitter (color_jitter=, or a ColorJitter in the dataset's transform) is applied by DALI while "
            "streaming; drop it or leave cache_decoded off",
        )
    if split.train and split.epochs == 1:  # and the cache's first epoch decodes whole images
        return "one epoch reads each image once"
    return ""


def _auto(split: SplitImages, left: int, processes: int) -> tuple[CachePlan, int]:
    """``setting="auto"`` for one split with ``left`` bytes of this process's share: its plan and what is left."""
    if split.need is None:  # the files' headers say
        cache, why = auto_plan(list(split.files), split.size, split.train, left)
        return CachePlan(cache, why, share=processes), left  # its budget is taken when it fills
    need = split.need(left)
    if need is None:
        why = f"decoded, they would not fit in the {left / 2**20:.0f} MiB left of half the memory"
        return CachePlan(False, why), left
    # the loader's own guard gets all that is left
    return CachePlan(True, f"decoded once, held in memory ({need / 2**20:.0f} MiB)", budget=left), left - need


def decoded_images_for(setting: bool | int | str | CachePlan, loader) -> DecodedImages | None:
    """A loader's decoded cache (``ImageLoader(cache_decoded=...)``): the plan given, or
    ``plan_decoded_cache``'s for its files, carried out. ``loader``: an ``ImageLoader`` whose settings, source,
    file health and host finishing are set."""
    plan = setting
    if not isinstance(plan, CachePlan):
        jitter = loader.pipeline_kwargs.get("color_jitter", 0.0)
        split = SplitImages("images", loader.train, jitter, files=loader.files, size=loader.size)
        plan = plan_decoded_cache(
            [split], setting, device_type=loader.device.type, host_finish=loader.finisher is not None,
            source=loader.source, processes=processes_on_machine(loader.num_shards, loader.device.type),
        )["images"]  # fmt: skip
        if isinstance(setting, str):
            log.info(
                "cache_decoded='auto': %s (%s)",
                "decoding each image once" if plan.cache else "streaming",
                plan.why,
            )
    if not plan.cache:
        return None
    return DecodedImages(loader.health, loader.num_threads, plan.budget, share=plan.share)
