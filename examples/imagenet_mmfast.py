"""A torchvision-style classification script: ImageFolder datasets, one loader each for training and validation
(sharded under DDP), a torchvision model, SGD, top-1 accuracy over every target.

    python examples/imagenet_dataloader.py DATA [--epochs 1] [--batch-size 32] [--size 224] [--evaluate]
    torchrun --nproc_per_node 2 examples/imagenet_dataloader.py DATA ...      # DDP (gloo without CUDA)

DATA holds train/<class>/<image> and val/<class>/<image>. examples/imagenet_dataloader.py (torch's DataLoader +
DistributedSampler) and examples/imagenet_mmfast.py (mmfast's ImageLoader) are the same script but for the
loader construction: the import and three lines. tests/loading/test_dropin.py checks that they differ in nothing
else and give the same validation results, on one process and on two.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from torchvision import datasets, models, transforms

from mmfast import ImageLoader


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("data", help="folder with train/ and val/ ImageFolder trees")
    p.add_argument("--arch", default="resnet18", help="a torchvision.models name")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=32, help="per process")
    p.add_argument("--size", type=int, default=224, help="train crop and eval centre crop, in pixels")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0, help="seeds the model's initial weights")
    p.add_argument("--weights", help="start from these weights (a state_dict saved with torch.save)")
    p.add_argument("--evaluate", action="store_true", help="only evaluate the initial weights")
    p.add_argument("--out", help="write each process's results to OUT.rank<N>.json")
    return p.parse_args(argv)


def train_one_epoch(model, loader, criterion, optimizer, device) -> dict:
    model.train()
    seen, loss_sum = 0, 0.0
    for images, target in loader:
        images, target = images.to(device, non_blocking=True), target.to(device, non_blocking=True)
        loss = criterion(model(images), target)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        seen += target.numel()
        loss_sum += loss.item() * target.numel()  # note: a CPU-GPU sync point
    return {"train_samples": seen, "train_loss": loss_sum / max(seen, 1)}


@torch.no_grad()
def validate(model, loader, criterion, device, distributed: bool) -> dict:
    """Top-1 accuracy over every target the loader yields (summed over processes under DDP)."""
    model.eval()
    correct, count, loss_sum, preds, logits = 0, 0, 0.0, [], []
    for batch in loader:
        images, target = batch
        images, target = images.to(device, non_blocking=True), target.to(device, non_blocking=True)
        output = model(images)  # (B, classes)
        loss_sum += criterion(output, target).item() * target.numel()
        correct += (output.argmax(1) == target).sum().item()
        count += target.numel()
        preds += output.argmax(1).tolist()
        logits += output.float().cpu().tolist()
    totals = torch.tensor([correct, count, loss_sum], dtype=torch.float64)
    if distributed:
        dist.all_reduce(totals)
    correct, count, loss_sum = totals.tolist()
    return {
        "acc1": 100.0 * correct / count,
        "count": int(count),
        "loss": loss_sum / count,
        "preds": preds,
        "logits": logits,
    }


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)

    normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train_tf = transforms.Compose(
        [
            transforms.RandomResizedCrop(args.size),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            normalize,
        ]
    )
    val_tf = transforms.Compose(
        [
            transforms.Resize(round(args.size / 0.875)),
            transforms.CenterCrop(args.size),
            transforms.ToTensor(),
            normalize,
        ]
    )
    train_set = datasets.ImageFolder(os.path.join(args.data, "train"), train_tf)
    val_set = datasets.ImageFolder(os.path.join(args.data, "val"), val_tf)
    kw = dict(num_workers=args.workers, pin_memory=True)
    kw.update(shard_id=rank, num_shards=world_size)  # each process's share, as DistributedSampler's
    train_loader = ImageLoader(train_set, args.batch_size, shuffle=True, **kw)
    val_loader = ImageLoader(val_set, args.batch_size, shuffle=False, **kw)

    torch.manual_seed(args.seed)
    model = models.__dict__[args.arch](num_classes=len(train_loader.dataset.classes))
    if args.weights:
        model.load_state_dict(torch.load(args.weights, map_location="cpu"))
    model = model.to(device)
    if distributed:
        model = torch.nn.parallel.DistributedDataParallel(model)
    criterion = torch.nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=0.9, weight_decay=1e-4)

    results = {"rank": rank, "world_size": world_size, "val_batches": len(val_loader), "epochs": []}
    if args.evaluate:
        results["val"] = validate(model, val_loader, criterion, device, distributed)
    else:
        for epoch in range(args.epochs):
            if distributed:
                train_loader.sampler.set_epoch(epoch)
            stats = train_one_epoch(model, train_loader, criterion, optimizer, device)
            stats["val"] = validate(model, val_loader, criterion, device, distributed)
            results["epochs"].append(stats)
            if rank == 0:
                print(
                    f"epoch {epoch}: train loss {stats['train_loss']:.3f}, val acc@1 {stats['val']['acc1']:.2f}%"
                )
    if args.out:
        with open(f"{args.out}.rank{rank}.json", "w") as f:
            json.dump(results, f)
    if distributed:
        dist.destroy_process_group()
    return results


if __name__ == "__main__":
    main()
