"""Image classification with PyTorch Lightning: a LightningDataModule serving mmfast's ImageLoader.

    python examples/lightning_imagefolder.py DATA [--epochs 2] [--size 224] [--devices 1]

Needs ``pip install lightning`` (not an mmfast dependency). DATA holds train/<class>/<image> and
val/<class>/<image>. Lightning iterates the loaders as they are (it only re-creates torch DataLoaders), calls
``loader.sampler.set_epoch(epoch)`` every epoch, and under DDP the data module gives each process its shard
(``shard_id=trainer.global_rank``, ``num_shards=trainer.world_size``). Validation batches are dicts
(``as_dict=True``) so that their ``mask`` survives Lightning's move to the device: the accuracy counts every
image exactly once, also when the processes do not divide the validation set.
"""

from __future__ import annotations

import argparse
import json
import os

import lightning as L
import torch
import torch.nn.functional as F
import torchvision
from torchvision.datasets.folder import find_classes

from mmfast import ImageLoader


class ImageFolderData(L.LightningDataModule):
    """train/ and val/ ImageFolder trees under ``root``, loaded by DALI."""

    def __init__(self, root: str, batch_size: int = 64, size: int = 224, workers: int | None = None):
        super().__init__()
        self.root, self.batch_size, self.size, self.workers = root, batch_size, size, workers

    def setup(self, stage: str | None = None) -> None:
        # Called on every process once the Trainer knows its rank and device.
        shard = dict(shard_id=self.trainer.global_rank, num_shards=self.trainer.world_size)
        common = dict(batch_size=self.batch_size, size=self.size, num_workers=self.workers, **shard)
        common["device"] = self.trainer.strategy.root_device
        self.train = ImageLoader.from_folder(os.path.join(self.root, "train"), shuffle=True, **common)
        self.val = ImageLoader.from_folder(os.path.join(self.root, "val"), as_dict=True, **common)

    def train_dataloader(self) -> ImageLoader:
        return self.train

    def val_dataloader(self) -> ImageLoader:
        return self.val


class Classifier(L.LightningModule):
    def __init__(self, num_classes: int, lr: float = 0.01):
        super().__init__()
        self.model = torchvision.models.resnet18(num_classes=num_classes)
        self.lr = lr
        self.val_totals = torch.zeros(2)  # correct, counted

    def training_step(self, batch, batch_idx):
        images, target = batch  # (B, 3, S, S) float32, (B,)
        loss = F.cross_entropy(self.model(images), target)
        self.log("train_loss", loss, batch_size=len(target))
        return loss

    def on_validation_epoch_start(self) -> None:
        self.val_totals = torch.zeros(2, device=self.device)

    def validation_step(self, batch, batch_idx):
        pred = self.model(batch["image"]).argmax(1)
        mask = batch["mask"]  # False for the repeats that fill up the shards
        self.val_totals += torch.stack([((pred == batch["label"]) & mask).sum(), mask.sum()])

    def on_validation_epoch_end(self) -> None:
        correct, count = self.all_gather(self.val_totals).reshape(-1, 2).sum(0)  # over all processes
        self.log("val_acc", correct / count, sync_dist=True)  # the same on every process already
        self.log("val_count", count.float(), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("data")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--out", help="write the final metrics here (JSON)")
    args = p.parse_args(argv)
    L.seed_everything(0)
    data = ImageFolderData(args.data, args.batch_size, args.size)
    classes, _ = find_classes(os.path.join(args.data, "train"))  # torchvision's, as ImageFolder's
    trainer = L.Trainer(
        max_epochs=args.epochs,
        devices=args.devices,
        accelerator="auto",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(Classifier(len(classes)), datamodule=data)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    if args.out and trainer.is_global_zero:
        with open(args.out, "w") as f:
            json.dump(metrics, f)
    return metrics


if __name__ == "__main__":
    main()
