"""Training throughput: mmfast's loop and loader against the write-up's baseline, and loop overhead.

    python tools/benchmarks/bench_train.py [--data PREPARED_DIR] [--preset tiny] [--image-size 128]
                                [--batch-size 32] [--steps 24] [--json OUT] [--png OUT]

Part 1, the write-up's claims: images/s of one model trained by the same hand-written loop under
  (a) torch DataLoader + PIL + fp32 (the baseline)     (b) DataLoader + mixed precision
  (c) mmfast loader + fp32                             (d) mmfast loader + mixed precision
and (d) for early / concat / late fusion. Ratios are against (a). The variants take turns (``--rounds``) so a
drift of the machine's speed hits all alike; each figure is the median of its turns.
Part 2, loop overhead: mmfast's training loop (Accelerate, accumulation bookkeeping, clipping, scheduler,
NaN checks, timers) vs a minimal loop, both over the same batches held in memory: overhead = 1 - ratio.
Without --data it uses 512 real 800x600 photos (see tools/benchmarks/bench_loader.py).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch

from mmfast.data.dataset import PreparedDataset


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--text-model", help="override the preset's text model (e.g. bert-base-random)")
    p.add_argument("--image-backbone", help="override the preset's backbone")
    p.add_argument("--mixed-precision", default="auto", choices=["auto", "bf16", "fp16"], help="variants b and d")
    p.add_argument("--image-size", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=24, help="timed steps per variant (after --warmup)")
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2, help="turns every claims variant takes (median)")
    p.add_argument("--repeats", type=int, default=3, help="loop-overhead repeats (median)")
    p.add_argument("--skip-claims", action="store_true")
    p.add_argument("--grad-clip", type=float, default=0.0, help="mmfast loop's clipping in the overhead run")
    p.add_argument("--json", default="bench_out/bench_train.json")
    p.add_argument("--png", default="bench_out/bench_train.png")
    return p.parse_args(argv)


def _model(args, name: str, num_classes: int, vocab: int, device):
    from mmfast.models import build_model, get_preset

    preset = get_preset(args.preset)
    torch.manual_seed(0)
    return build_model(
        name,
        num_classes,
        image_backbone=args.image_backbone or preset.image_backbone,
        text_model=args.text_model or preset.text_model,
        vocab_size=vocab,
        hidden=preset.hidden,
    ).to(device)


def _autocast(device, mp: str):
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(mp)
    return torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext()


def minimal_loop(model, batches, device, mp: str, steps: int, warmup: int) -> float:
    """The plainest correct loop; returns images/s over ``steps`` steps after ``warmup``."""
    from mmfast.tasks.classification import training_loss  # late fusion also trains each branch on its own loss

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler(enabled=mp == "fp16")
    model.train()
    n, t0 = 0, None
    for i, batch in enumerate(batches):
        if i == warmup:
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
        if i == warmup + steps:
            break
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        with _autocast(device, mp):
            loss = training_loss(model(batch), batch["label"])
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        if i >= warmup:
            n += batch["label"].shape[0]
    if device.type == "cuda":
        torch.cuda.synchronize()  # note: count the queued GPU work
    return n / (time.perf_counter() - t0)


def _endless(make_epoch):
    while True:
        yield from make_epoch()


def claims(args, data: Path, device, mp: str) -> dict:
    from benchlib.baseline import baseline_loader

    from mmfast.loading.multimodal import MultimodalLoader

    dataset = PreparedDataset(data, verify=False)
    vocab, num_classes = dataset.vocab_size, dataset.num_classes
    res = {}
    dl = baseline_loader(data, args.batch_size, args.image_size)
    mm = MultimodalLoader(data, "train", args.batch_size, size=args.image_size, device=device)
    variants = [
        ("a DataLoader+PIL fp32", dl, "no", "concat"),
        ("b DataLoader+PIL " + mp, dl, mp, "concat"),
        ("c mmfast fp32", mm, "no", "concat"),
        ("d mmfast " + mp, mm, mp, "concat"),
        ("d mmfast " + mp + " early", mm, mp, "early"),
        ("d mmfast " + mp + " late", mm, mp, "late"),
    ]
    rates: dict[str, list[float]] = {v[0]: [] for v in variants}
    for r in range(args.rounds):
        for name, loader, prec, model_name in variants:
            model = _model(args, model_name, num_classes, vocab, device)
            batches = _endless(lambda ld=loader: iter(ld))
            rates[name].append(minimal_loop(model, batches, device, prec, args.steps, args.warmup))
            print(f"  round {r + 1}: {name}: {rates[name][-1]:.1f} img/s", file=sys.stderr)
    for name, loader, prec, model_name in variants:
        res[name] = {
            "images_per_s": statistics.median(rates[name]),
            "rounds": rates[name],
            "loader": "mmfast" if loader is mm else "DataLoader",
            "mixed_precision": prec,
            "model": model_name,
        }
    base = res["a DataLoader+PIL fp32"]["images_per_s"]
    for r in res.values():
        r["ratio_vs_a"] = r["images_per_s"] / base
    return res


class _Replay:
    """Batches held in memory, replayed with the loader interface EpochRunner expects."""

    def __init__(self, batches):
        self.batches, self.step, self.epoch = batches, 0, 0

    def __len__(self):
        return len(self.batches)

    def set_epoch(self, epoch):
        self.epoch = epoch

    def state_dict(self):
        return {"epoch": self.epoch, "step": self.step}

    def __iter__(self):
        for b in self.batches[self.step :]:
            self.step += 1
            yield b
        self.step = 0


def loop_overhead(args, data: Path, device) -> dict:
    """mmfast's EpochRunner vs minimal_loop over the same in-memory batches and precision."""
    from accelerate.state import AcceleratorState, GradientState

    from mmfast.loading.multimodal import MultimodalLoader
    from mmfast.tasks.classification import ClassificationTask
    from mmfast.train.config import TrainConfig
    from mmfast.train.engine import EpochRunner, initial_state
    from mmfast.train.optim import make_scheduler, param_groups
    from mmfast.train.setup import make_accelerator

    # grad_clip=0: the same arithmetic as the minimal loop, so the difference is the loop's machinery
    cfg = TrainConfig(
        data=str(data), out="bench_out/loop", progress=False, batch_size=args.batch_size, grad_clip=args.grad_clip
    )
    acc = make_accelerator(cfg)
    mp = acc.mixed_precision
    loader = MultimodalLoader(data, "train", args.batch_size, size=args.image_size, device=acc.device)
    batches = [b for _, b in zip(range(args.steps), loader, strict=False)]
    dataset = PreparedDataset(data, verify=False)
    vocab, num_classes = dataset.vocab_size, dataset.num_classes
    task = ClassificationTask(dataset)
    mine, minimal = [], []
    for _ in range(args.repeats):
        model = _model(args, "concat", num_classes, vocab, acc.device)
        minimal.append(minimal_loop(model, iter(batches * 2), acc.device, mp, len(batches), len(batches)))
        model = _model(args, "concat", num_classes, vocab, acc.device)
        opt = torch.optim.AdamW(param_groups(model, 0.05, 1e-3), lr=1e-3)
        sched = make_scheduler(opt, "cosine", 2, 10 * len(batches))
        model, opt = acc.prepare(model, opt)
        runner = EpochRunner(
            cfg,
            acc,
            model,
            opt,
            sched,
            _Replay(batches),
            Path(cfg.out),
            10 * len(batches),
            initial_state(task),
            task,
        )
        runner.train_epoch(0)  # warm-up epoch
        t = time.perf_counter()
        runner.train_epoch(1)
        if acc.device.type == "cuda":
            torch.cuda.synchronize()
        mine.append(len(batches) * args.batch_size / (time.perf_counter() - t))
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    m, b = statistics.median(mine), statistics.median(minimal)
    return {
        "mmfast_loop_images_per_s": m,
        "minimal_loop_images_per_s": b,
        "overhead": 1 - m / b,
        "mixed_precision": mp,
        "grad_clip": args.grad_clip,
        "runs": {"mmfast": mine, "minimal": minimal},
    }


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(res)
    vals = [res[n]["images_per_s"] for n in names]
    fig, ax = plt.subplots(figsize=(9, 4))
    bars = ax.barh(
        names[::-1], vals[::-1], color=["#888" if "DataLoader" in n else "#76b900" for n in names[::-1]]
    )
    for bar, n in zip(bars, names[::-1], strict=True):
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {res[n]['ratio_vs_a']:.2f}x", va="center")
    ax.set_xlabel("training images / s (higher is better)")
    ax.set_title("mmfast vs DataLoader + PIL, fp32 vs mixed precision")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    from benchlib.data import prepared_photos

    from mmfast.train.hardware import resolve_mixed_precision
    from mmfast.util.fsutil import atomic_write_json

    args = parse_args(argv)
    data = Path(args.data) if args.data else prepared_photos()
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    mp = resolve_mixed_precision(args.mixed_precision, device.type == "cuda") or "no"
    out = {
        "device": str(device),
        "preset": args.preset,
        "image_backbone": args.image_backbone,
        "text_model": args.text_model,
        "image_size": args.image_size,
        "batch_size": args.batch_size,
        "steps": args.steps,
        "data": str(data),
        "torch": torch.__version__,
    }
    if not args.skip_claims:
        out["claims"] = claims(args, data, device, mp)
        print(f"\n{'variant':<34}{'img/s':>10}{'vs (a)':>9}")
        for n, r in out["claims"].items():
            print(f"{n:<34}{r['images_per_s']:>10.1f}{r['ratio_vs_a']:>8.2f}x")
        plot(out["claims"], args.png)
    out["loop_overhead"] = lo = loop_overhead(args, data, device)
    print(
        f"\nloop over the same in-memory batches ({lo['mixed_precision']}): mmfast "
        f"{lo['mmfast_loop_images_per_s']:.1f} img/s, minimal {lo['minimal_loop_images_per_s']:.1f} img/s, "
        f"overhead {lo['overhead']:.1%}"
    )
    atomic_write_json(args.json, out)
    print(f"wrote {args.json}" + ("" if args.skip_claims else f" and {args.png}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
