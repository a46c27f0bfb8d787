"""Parameters and forward+backward time per batch of each fusion model.

    python tools/benchmarks/bench_models.py [--preset tiny] [--batch-size 64] [--mixed-precision auto|no|bf16|fp16]

Uses random inputs of the preset's image size and a 32-token caption batch; the median of --steps timed
steps after --warmup steps.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--text-model", help="override the preset's text model (e.g. bert-base-random)")
    p.add_argument("--image-backbone", help="override the preset's backbone")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--mixed-precision", default="auto", choices=["auto", "no", "bf16", "fp16"])
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--json", default="bench_out/bench_models.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from mmfast.models import MODELS, build_model, get_preset
    from mmfast.tasks.classification import training_loss
    from mmfast.train.hardware import resolve_mixed_precision
    from mmfast.util.fsutil import atomic_write_json

    args = parse_args(argv)
    preset = get_preset(args.preset)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    mp = resolve_mixed_precision(args.mixed_precision, cuda) or "no"
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(mp)
    backbone = args.image_backbone or preset.image_backbone
    text = args.text_model or preset.text_model
    b, s = args.batch_size, preset.image_size
    batch = {
        "image": torch.randn(b, 3, s, s, device=device).half(),
        "input_ids": torch.randint(5, 1000, (b, args.tokens), device=device),
        "attention_mask": torch.ones(b, args.tokens, dtype=torch.long, device=device),
        "label": torch.randint(0, args.classes, (b,), device=device),
    }
    rows = {}
    for name in [m for m in MODELS if getattr(MODELS[m], "task", "classification") == "classification"]:
        model = build_model(
            name,
            args.classes,
            image_backbone=backbone,
            text_model=text,
            vocab_size=30522,
            hidden=preset.hidden,
            channels_last=args.channels_last,
        ).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        scaler = torch.amp.GradScaler(enabled=mp == "fp16")
        times = []
        for i in range(args.warmup + args.steps):
            if cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                loss = training_loss(model(batch), batch["label"])
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()  # note: count the GPU work of this step
            if i >= args.warmup:
                times.append(time.perf_counter() - t)
        med = statistics.median(times)
        rows[name] = {
            "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
            "step_ms": med * 1e3,
            "images_per_s": b / med,
        }
    print(f"{backbone} + {text}, {s}px, batch {b}, {args.tokens} tokens, {device}, mixed precision {mp}")
    print(f"{'model':<8}{'params (M)':>12}{'fwd+bwd+step (ms)':>20}{'img/s':>10}")
    for name, r in rows.items():
        print(f"{name:<8}{r['params_m']:>12.1f}{r['step_ms']:>20.1f}{r['images_per_s']:>10.0f}")
    out = {
        "device": str(device),
        "mixed_precision": mp,
        "backbone": backbone,
        "text_model": text,
        "image_size": s,
        "batch_size": b,
        "tokens": args.tokens,
        "results": rows,
    }
    atomic_write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
