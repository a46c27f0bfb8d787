"""A re-preparation after rows were added: what reusing the earlier checks saves.

    python tools/benchmarks/bench_reprepare.py [--n 512] [--added 16] [--elsewhere] [--workers N] [--json OUT]
    python tools/benchmarks/bench_reprepare.py --shards 10 [--per-shard 5000] [--side 16] [--workers N]
        [--baseline records|tokens] [--touch] [--tokenizer NAME] [--captions JSONL] [--json OUT]

Prepares N real 800x600 JPEG photos (cut from scikit-image's, as bench_loader's), adds --added new photos
to the manifest, and prepares again into the same directory: the baseline is the first preparation, which
decodes every image; the second decodes only the new ones (``prepare.json``'s ``reused_checks``). With
--elsewhere the second goes into a new folder, as a second run's raw --data does.

--shards S: S WebDataset shards of --per-shard tiny JPEGs (``bench_wds_scale``'s), prepared into two
directories; then one shard more is written, as a crawl's next day adds, and both are prepared again. The
baseline is the one whose ``file_reads`` records were removed first: it reads every shard, as preparation did
before those records; the other reads the new shard only. The two run one after the other, baseline first.
--baseline tokens: the baseline's tokenizer and token cache are removed instead, so it trains its WordPiece
vocabulary (or, with --tokenizer, tokenizes every caption) again, as preparation did before it kept them;
--touch: the next day rewrites the last shard's time rather than adding one (its captions are the same);
--captions: a manifest (JSON lines with "text") whose captions, numbered, the shards' rows take in turn.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=512)
    p.add_argument("--added", type=int, default=16)
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--shards", type=int, default=0, help="WebDataset shards instead of photo files")
    p.add_argument("--per-shard", type=int, default=5000)
    p.add_argument("--side", type=int, default=16, help="--shards: the JPEGs' side, pixels")
    p.add_argument("--elsewhere", action="store_true", help="prepare again into a new folder (a second run's)")
    p.add_argument("--baseline", choices=("records", "tokens"), default="records", help="--shards: what it lacks")
    p.add_argument("--touch", action="store_true", help="--shards: touch the last shard rather than add one")
    p.add_argument("--tokenizer", default=None, help="--shards: a fixed tokenizer (default: WordPiece trained)")
    p.add_argument("--captions", default=None, help="--shards: a JSON-lines manifest whose captions rows take")
    p.add_argument("--json", default="bench_out/bench_reprepare.json")
    return p.parse_args(argv)


def main(argv=None) -> int:
    from benchlib.data import photo_manifest

    from mmfast.prepare.core import PrepareConfig, prepare_dataset
    from mmfast.prepare.demo import default_cache_dir
    from mmfast.util.fsutil import atomic_write_json

    args = parse_args(argv)
    if args.shards:
        return shards_again(args)
    source = photo_manifest(default_cache_dir() / "bench", n=args.n)
    with tempfile.TemporaryDirectory(prefix="bench_reprepare_") as tmp:
        photos = Path(tmp) / "photos"
        shutil.copytree(source.parent, photos)
        manifest = photos / "manifest.jsonl"
        cfg = PrepareConfig(str(manifest), str(Path(tmp) / "out"), workers=args.workers, progress=False)
        t0 = time.perf_counter()
        first = prepare_dataset(cfg)
        t_first = time.perf_counter() - t0
        rows = [json.loads(line) for line in manifest.read_text().splitlines()]
        for k in range(args.added):  # new files: copies of earlier photos under new names
            shutil.copy(photos / rows[k]["image"], photos / f"added{k}.jpg")
            rows.append({**rows[k], "image": f"added{k}.jpg", "text": f"{rows[k]['text']} (added {k})"})
        manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
        if args.elsewhere:  # where the input was prepared last is noted under $MMFAST_CACHE
            cfg = replace(cfg, out=str(Path(tmp) / "elsewhere"))
        t0 = time.perf_counter()
        again = prepare_dataset(cfg)
        t_again = time.perf_counter() - t0
    report = {
        "images": args.n,
        "elsewhere": args.elsewhere,
        "added": args.added,
        "workers": args.workers,
        "first_s": t_first,
        "first_validate_s": first["timings_s"]["validate"],
        "again_s": t_again,
        "again_validate_s": again["timings_s"]["validate"],
        "reused_checks": again["reused_checks"],
        "speedup": t_first / t_again,
    }
    print(f"{'preparation':<52}{'wall s':>10}{'validate s':>12}")
    print(f"{f'first: {args.n} photos (baseline)':<52}{t_first:>10.2f}{report['first_validate_s']:>12.2f}")
    where = "into a new folder" if args.elsewhere else "into the same folder"
    label = f"again {where}, {args.added} added ({again['reused_checks']} reused)"
    print(f"{label:<52}{t_again:>10.2f}{report['again_validate_s']:>12.2f}   {report['speedup']:.1f}x faster")
    atomic_write_json(args.json, report)
    print(f"wrote {args.json}")
    return 0


def shards_again(args) -> int:
    """--shards: one shard added to S, prepared again with and without the earlier shards' records."""
    from bench_wds_scale import write_shards

    from mmfast.data.dataset import FILE_READS, TOKENIZER_DIR, TOKENS_DIR
    from mmfast.prepare.core import PrepareConfig, prepare_dataset
    from mmfast.util.fsutil import atomic_write_json

    with tempfile.TemporaryDirectory(prefix="bench_reprepare_") as tmp:
        root = Path(tmp)
        shards, staged = root / "shards", root / "staged"
        shards.mkdir()
        staged.mkdir()
        texts = [json.loads(line)["text"] for line in Path(args.captions).open()] if args.captions else None
        write_shards(staged, (args.shards + 1) * args.per_shard, args.per_shard, args.side, texts)
        last = sorted(staged.glob("*.tar"))[-1]
        for tar in sorted(staged.glob("*.tar"))[:-1]:
            tar.rename(shards / tar.name)
        if args.touch:
            last = sorted(shards.glob("*.tar"))[-1]

        os.environ["MMFAST_CACHE"] = str(root / "cache")  # each folder's own records only: no note of the other

        def prepare(out: str) -> tuple[float, dict]:
            shutil.rmtree(root / "cache", ignore_errors=True)
            opts = {"workers": args.workers, "val_fraction": 0.01, "progress": False, "tokenizer": args.tokenizer}
            cfg = PrepareConfig(str(shards), str(root / out), **opts)
            t0 = time.perf_counter()
            summary = prepare_dataset(cfg)
            return time.perf_counter() - t0, summary

        t_first, _ = prepare("baseline")
        prepare("records")
        for lacks in (FILE_READS,) if args.baseline == "records" else (TOKENIZER_DIR, TOKENS_DIR):
            shutil.rmtree(root / "baseline" / lacks)
        if args.touch:
            os.utime(last, ns=(time.time_ns(), time.time_ns()))  # the same shard, a new mtime
        else:
            last.rename(shards / last.name)  # the next day's shard
        t_base, base = prepare("baseline")
        t_again, again = prepare("records")
    report = {
        "shards": args.shards,
        "per_shard": args.per_shard,
        "side": args.side,
        "workers": args.workers,
        "baseline_lacks": args.baseline,
        "change": "one shard touched" if args.touch else "one shard added",
        "tokenizer": args.tokenizer or "wordpiece trained",
        "captions": args.captions or "made up",
        "first_s": t_first,
        "baseline_s": t_base,
        "again_s": t_again,
        "again_read_s": again["timings_s"]["read"],
        "baseline_read_s": base["timings_s"]["read"],
        "reused_checks": again["reused_checks"],
        "again_tokens_s": again["timings_s"]["tokenizer"] + again["timings_s"]["token_cache"],
        "baseline_tokens_s": base["timings_s"]["tokenizer"] + base["timings_s"]["token_cache"],
        "rows_copied": sum(c.get("rows_copied", 0) for c in again["token_cache"].values()),
        "tokenizer_kept": "tokenizer_kept_from" in again,
        "again_timings_s": again["timings_s"],
        "baseline_timings_s": base["timings_s"],
        "speedup": t_base / t_again,
    }
    change = report["change"]
    lacking = "every shard read" if args.baseline == "records" else "tokenizer and tokens made again"
    print(f"{'preparation':<58}{'wall s':>9}{'read s':>9}{'tokens s':>9}")
    print(f"{f'first: {args.shards} shards of {args.per_shard}':<58}{t_first:>9.2f}")
    row = f"{report['baseline_read_s']:>9.2f}{report['baseline_tokens_s']:>9.2f}"
    print(f"{f'{change}, {lacking} (baseline)':<58}{t_base:>9.2f}{row}")
    label = f"{change}, kept ({again['reused_checks']} checks, {report['rows_copied']} token rows)"
    row = f"{report['again_read_s']:>9.2f}{report['again_tokens_s']:>9.2f}"
    print(f"{label:<58}{t_again:>9.2f}{row}   {report['speedup']:.1f}x faster")
    atomic_write_json(args.json, report)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
