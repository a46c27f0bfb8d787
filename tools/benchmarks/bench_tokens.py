"""Token cache vs on-the-fly tokenization.

    python tools/benchmarks/bench_tokens.py [--tokenizer DIR_OR_NAME] [--rows 50000] [--batch 256] [--json OUT]

Measures (1) building the cache vs one batched fast-tokenizer pass over the same texts, and (2) serving
batches of ``--batch`` random rows: ``TokenCache.gather`` vs tokenizing those rows on the fly (batched,
padded to the longest, as a collate function would). Medians of repeated runs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--tokenizer", default="minilm", help="'minilm' (bert-base-uncased WordPiece, offline) or a path"
    )
    p.add_argument("--rows", type=int, default=50_000)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--max-length", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default="bench_out/bench_tokens.json")
    return p.parse_args(argv)


def captions(n: int, seed: int = 0) -> list[str]:
    """Varied English captions of 5-40 words (with some accents), built from a fixed word list."""
    words = (
        "a photo of the small large red blue green dog cat bird car street tree house person man woman "
        "child sitting running next to under over near with holding playing on in at café naïve garden "
        "beach mountain river city night morning sunset bright dark old new"
    ).split()
    rng = np.random.default_rng(seed)
    return [" ".join(words[i] for i in rng.integers(len(words), size=rng.integers(5, 41))) for _ in range(n)]


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    from mmfast.data.token_cache import TokenCache
    from mmfast.data.tokenizer import load_tokenizer
    from mmfast.models.encoders import resolve_text_model
    from mmfast.util.fsutil import atomic_write_json

    args = parse_args(argv)
    tok = load_tokenizer(resolve_text_model(args.tokenizer))
    texts = captions(args.rows)
    kw = dict(truncation=True, max_length=args.max_length)
    one_pass = timed(lambda: tok(texts, **kw), args.repeats)

    def build():
        with tempfile.TemporaryDirectory() as d:
            TokenCache.build(d, "train", texts, tok, args.max_length)

    build_s = timed(build, args.repeats)
    work = Path(tempfile.mkdtemp())
    cache = TokenCache.build(work, "train", texts, tok, args.max_length)
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, args.rows, args.batch) for _ in range(50)]
    gather_s = timed(lambda: [cache.gather(b) for b in batches], args.repeats) / len(batches)
    fly_s = timed(
        lambda: [tok([texts[i] for i in b], padding="longest", return_tensors="pt", **kw) for b in batches],
        args.repeats,
    ) / len(batches)
    # Check: the cache serves exactly what on-the-fly tokenization gives.
    ref = tok([texts[i] for i in batches[0]], padding="longest", return_tensors="pt", **kw)
    got = cache.gather(batches[0])
    assert (ref["input_ids"] == got["input_ids"]).all() and (ref["attention_mask"] == got["attention_mask"]).all()
    res = {
        "rows": args.rows,
        "batch": args.batch,
        "tokenizer": args.tokenizer,
        "max_length": args.max_length,
        "one_batched_pass_s": one_pass,
        "cache_build_s": build_s,
        "build_vs_pass": build_s / one_pass,
        "gather_ms_per_batch": gather_s * 1e3,
        "on_the_fly_ms_per_batch": fly_s * 1e3,
        "gather_speedup": fly_s / gather_s,
    }
    print(f"{'':<36}{'seconds':>12}{'ratio':>10}")
    print(f"{'one batched tokenizer pass':<36}{one_pass:>12.3f}{1:>9.2f}x")
    print(f"{'TokenCache.build (same texts)':<36}{build_s:>12.3f}{build_s / one_pass:>9.2f}x")
    print(f"{f'on-the-fly tokenize {args.batch} rows':<36}{fly_s:>12.5f}{1:>9.2f}x")
    print(
        f"{f'TokenCache.gather {args.batch} rows':<36}{gather_s:>12.5f}{gather_s / fly_s:>9.4f}x"
        f"   ({fly_s / gather_s:.0f}x faster)"
    )
    atomic_write_json(args.json, res)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
