"""Image classification with Hugging Face Accelerate and mmfast's ImageLoader over ImageFolder trees.

    python examples/accelerate_imagefolder.py DATA [--epochs 2] [--size 224] [--batch-size 64]
    accelerate launch --multi_gpu --num_processes 8 examples/accelerate_imagefolder.py DATA
    torchrun --nproc_per_node 2 examples/accelerate_imagefolder.py DATA     # two CPU processes (gloo)

DATA holds train/<class>/<image> and val/<class>/<image>. The loaders do not go through
``accelerator.prepare`` (Accelerate cannot shard a DALI loader and hands it back unchanged): each takes its
shard and device from the accelerator (``accelerator=accelerator``). When the processes do not divide the
validation set, its shards are filled up with repeated samples, as DistributedSampler does; ``batch.mask``
marks them, so the accuracy below counts every image exactly once on any number of processes.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F
import torchvision
from accelerate import Accelerator

from mmfast import ImageLoader


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("data", help="folder with train/ and val/ ImageFolder trees")
    p.add_argument("--epochs", type=int, default=2, help="0: only evaluate the initial weights")
    p.add_argument("--batch-size", type=int, default=64, help="per process")
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--weights", help="start from these weights (a resnet18 state_dict saved with torch.save)")
    p.add_argument("--out", help="write the main process's results here (JSON)")
    return p.parse_args(argv)


@torch.no_grad()
def evaluate(model, loader, accelerator) -> tuple[float, int]:
    """(top-1 accuracy, images counted) over the whole validation set, every image once."""
    model.eval()
    totals = torch.zeros(2, device=accelerator.device)  # correct, counted
    for batch in loader:
        images, target = batch
        pred = model(images).argmax(1)
        totals += torch.stack([((pred == target) & batch.mask).sum(), batch.mask.sum()])
    correct, count = accelerator.reduce(totals, reduction="sum").tolist()  # note: a sync point
    return correct / count, int(count)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    common = dict(batch_size=args.batch_size, size=args.size, accelerator=accelerator, seed=args.seed)
    train_loader = ImageLoader.from_folder(os.path.join(args.data, "train"), shuffle=True, **common)
    val_loader = ImageLoader.from_folder(os.path.join(args.data, "val"), shuffle=False, **common)

    torch.manual_seed(args.seed)
    model = torchvision.models.resnet18(num_classes=len(train_loader.classes))
    if args.weights:
        model.load_state_dict(torch.load(args.weights, map_location="cpu"))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    model, optimizer = accelerator.prepare(model, optimizer)  # the loaders stay as they are

    for epoch in range(args.epochs):
        train_loader.set_epoch(epoch)
        model.train()
        for images, target in train_loader:  # (B, 3, S, S) float32 and (B,) on accelerator.device
            with accelerator.autocast():
                loss = F.cross_entropy(model(images), target)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        accelerator.print(f"epoch {epoch}: last train loss {loss.item():.3f}")
    acc, count = evaluate(model, val_loader, accelerator)
    accelerator.print(f"val acc@1 {100 * acc:.2f}% over {count} images")
    results = {"val_acc": acc, "val_count": count, "num_processes": accelerator.num_processes}
    if args.out and accelerator.is_main_process:
        with open(args.out, "w") as f:
            json.dump(results, f)
    accelerator.end_training()
    return results


if __name__ == "__main__":
    main()
