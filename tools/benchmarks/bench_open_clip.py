"""open_clip's own data pipeline against mmfast's loader, on the same real captioned photos, in one run (#27).

    python tools/benchmarks/bench_open_clip.py [--data PREPARED_DIR] [--batch-size 64] [--size 224] [--workers 2]
        [--rounds 3] [--epochs 3] [--open-clip-path DIR] [--json OUT]

open_clip is a peer here, never a dependency of mmfast: install it into a folder of its own,
``python -m pip install --target DIR --no-deps open-clip-torch ftfy regex wcwidth`` (torch, torchvision,
pandas and huggingface_hub come from mmfast's environment), and pass that folder as ``--open-clip-path``.
Its row runs in a child process of this script (``--serve``) whose ``PYTHONPATH`` is that folder, so nothing
of open_clip is imported here; the child is what open_clip_train's ``get_csv_dataset`` builds for training:
``open_clip_train.data.CsvDataset`` (shipped in the open-clip-torch wheel) over a tab-separated file of the
train split (``filepath`` and ``title`` columns, open_clip_train's defaults), with the train transform
``open_clip.image_transform(size, is_train=True, mean, std)`` (for ViT-B-32 at 224 px the transform
``create_model_and_transforms("ViT-B-32")`` returns: RandomResizedCrop(scale=(0.9, 1.0), bicubic,
antialiased), to RGB, to float32, normalize with the OpenAI mean/std) and the tokenizer
``open_clip.get_tokenizer("ViT-B-32")`` (each caption tokenized to 77 ids in the workers), in a torch
DataLoader with ``--workers`` workers (shuffle, drop_last, persistent_workers; pin_memory only with CUDA).

mmfast's rows are ``MultimodalLoader(prepared, "train", batch_size, size=size, num_workers=workers)`` with
open_clip's augmentation (the same crop scale and aspect ratios, no flip, the OpenAI mean/std; mmfast resizes
with an antialiased bilinear filter, not bicubic) and the tokens from the prepared directory's cache: float16
(its default), float32 (open_clip's dtype), and float16 with ``cache_decoded=True``. Without ``--data`` the
images are 512 real 800x600 JPEGs cut from scikit-image's photos (``benchlib.data.prepared_photos``). The
variants take turns as in ``bench_loader.py``: each round runs every variant for one warm-up epoch and
``--epochs`` timed epochs; the figure is the median of a variant's timed epochs.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from bench_loader import mmfast_variant, time_epochs

# open_clip's OPENAI_DATASET_MEAN / _STD (0..1 units); the child checks them against open_clip's own.
OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)
OPEN_CLIP_SCALE = (0.9, 1.0)  # its RandomResizedCrop's scale (open_clip.transform's default AugmentationCfg)
OPEN_CLIP_MODEL = "ViT-B-32"  # whose tokenizer the child uses
OPEN_CLIP_ROW = "open_clip CsvDataset + DataLoader + its transform and tokenizer"


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", help="prepared dataset directory (default: 512 real 800x600 photos)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--workers", type=int, default=os.cpu_count(), help="DataLoader workers and DALI threads")
    p.add_argument("--rounds", type=int, default=3, help="turns every variant takes")
    p.add_argument("--epochs", type=int, default=3, help="timed epochs per turn (after one warm-up epoch)")
    p.add_argument("--n", type=int, default=512, help="photos in the built-in set (no --data)")
    p.add_argument("--open-clip-path", default="/tmp/oc-pkgs", help="the folder open-clip-torch is installed in")
    p.add_argument("--json", default="bench_out/bench_open_clip.json")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the child: open_clip's row
    p.add_argument("--csv", help=argparse.SUPPRESS)  # the child's tab-separated train split
    return p.parse_args(argv)


def serve(args) -> int:
    """The child: build open_clip's training DataLoader once, then for each line ``EPOCHS`` on stdin run a
    warm-up epoch and EPOCHS timed ones, answering ``{"images_per_s": [...]}`` on stdout."""
    import open_clip
    from open_clip_train.data import CsvDataset

    if (tuple(open_clip.OPENAI_DATASET_MEAN), tuple(open_clip.OPENAI_DATASET_STD)) != (OPENAI_MEAN, OPENAI_STD):
        raise SystemExit(f"open_clip {open_clip.__version__}'s OpenAI mean/std differ from this script's")
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    transform = open_clip.image_transform(args.size, is_train=True, mean=OPENAI_MEAN, std=OPENAI_STD)
    tokenizer = open_clip.get_tokenizer(OPEN_CLIP_MODEL)
    # open_clip_train's defaults for --csv-img-key, --csv-caption-key and --csv-separator
    dataset = CsvDataset(args.csv, transform, "filepath", "title", sep="\t", tokenizer=tokenizer)
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.workers,
        pin_memory=device.type == "cuda",
        drop_last=True,
        persistent_workers=True,
    )

    def epoch():
        for images, texts in loader:
            texts.to(device, non_blocking=True)
            yield images.to(device, non_blocking=True)

    print(json.dumps({"open_clip": open_clip.__version__, "transform": repr(transform)}), flush=True)
    for line in sys.stdin:
        print(json.dumps({"images_per_s": time_epochs(epoch, int(line), device)[0]}), flush=True)
    return 0


class _OpenClip:
    """open_clip's row in its child process (``--serve``); ``round(epochs)`` returns its epochs' images/s."""

    def __init__(self, data, args):
        from mmfast.data.dataset import PreparedDataset

        self.tmp = tempfile.TemporaryDirectory(prefix="bench_open_clip_")
        table = Path(self.tmp.name) / "train.tsv"
        with open(table, "w", newline="") as f:
            out = csv.writer(f, delimiter="\t")
            out.writerow(["filepath", "title"])
            out.writerows([r["image"], r["text"]] for r in PreparedDataset(data, verify=False).rows("train"))
        cmd = [sys.executable, __file__, "--serve", "--csv", str(table), "--batch-size", str(args.batch_size)]
        cmd += ["--size", str(args.size), "--workers", str(args.workers)]
        env = os.environ | {"PYTHONPATH": args.open_clip_path}
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.info = json.loads(self._line())  # open_clip's version and transform
        self.round(0)  # workers started and the files read once now, not while other rows are timed

    def _line(self) -> str:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the open_clip child exited with {self.proc.wait()} (its messages are above)")
        return line

    def round(self, epochs: int) -> list[float]:
        self.proc.stdin.write(f"{epochs}\n")
        self.proc.stdin.flush()
        return json.loads(self._line())["images_per_s"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()
        self.tmp.cleanup()


def mmfast_rows(data, args, device) -> dict:
    """mmfast's variants, each with open_clip's augmentation: name -> a function returning one epoch."""
    augment = {
        "scale": OPEN_CLIP_SCALE,
        "flip": False,
        "mean": tuple(m * 255 for m in OPENAI_MEAN),  # mmfast takes 0..255 units, as DALI does
        "std": tuple(s * 255 for s in OPENAI_STD),
    }
    args.threads = args.workers  # bench_loader's name for them
    variants = {
        "mmfast MultimodalLoader, float16 (default)": {},
        "mmfast MultimodalLoader, float32": {"dtype": torch.float32, "fp16": None},
        "mmfast MultimodalLoader, cache_decoded=True": {"cache_decoded": True},
    }
    return {name: mmfast_variant(data, args, device, **kwargs, **augment) for name, kwargs in variants.items()}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.serve:
        return serve(args)
    from benchlib.data import prepared_photos

    from mmfast.data.dataset import PreparedDataset
    from mmfast.util.fsutil import atomic_write_json

    data = Path(args.data) if args.data else prepared_photos(args.n)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    open_clip = _OpenClip(data, args)
    iters = {OPEN_CLIP_ROW: open_clip} | mmfast_rows(data, args, device)
    rates: dict[str, list[float]] = {name: [] for name in iters}
    for r in range(args.rounds):
        for name, make_iter in iters.items():
            if make_iter is open_clip:
                rates[name] += open_clip.round(args.epochs)
            else:
                rates[name] += time_epochs(make_iter, args.epochs, device)[0]
            last = statistics.median(rates[name][-args.epochs :])
            print(f"  round {r + 1}: {name}: {last:.1f} img/s", file=sys.stderr)
    open_clip.close()
    reference = statistics.median(rates[OPEN_CLIP_ROW])
    results = {}
    print(f"\n{'variant':<66}{'img/s':>9}{'vs open_clip':>14}")
    for name, v in rates.items():
        m = statistics.median(v)
        results[name] = {"images_per_s_median": m, "epochs": v, "ratio_vs_open_clip": m / reference}
        print(f"{name:<66}{m:>9.1f}{m / reference:>13.2f}x")
    report = {
        "device": str(device),
        "cpu_count": os.cpu_count(),
        "batch_size": args.batch_size,
        "size": args.size,
        "workers": args.workers,
        "rounds": args.rounds,
        "epochs_per_round": args.epochs,
        "data": str(data),
        "images": PreparedDataset(data, verify=False).split_size("train"),
        "torch": torch.__version__,
        "open_clip": open_clip.info,
        "results": results,
    }
    atomic_write_json(args.json, report)
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
