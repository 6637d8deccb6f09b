#!/usr/bin/env python
"""One-query attention (a decode step) as the engine runs it against SDPA's grouped-query path.

    .venv/bin/python scripts/bench_decode_attention.py [--model NAME] [--batches 1,16,64]
                                                       [--contexts 128,512,2048] [--dtypes bf16,fp32]

For the model's head shape (default: the default model's), each row times `layers.attention` on one
query per sequence against a cache of the given length, and beside it the call the engine made
before: `scaled_dot_product_attention(..., enable_gqa=True)` on the same tensors (the baseline,
timed in the same run, alternating). On a CPU in half precision that path is the math kernel with
keys and values copied for every query head; the engine stacks a key head's query heads as its
rows instead. Prints milliseconds per call, the ratio baseline / engine (> 1: the engine is
faster), and whether both give the same bits.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch
import torch.nn.functional as F

from diffuse.home import data_home
from diffuse.model import store
from diffuse.model.config import ModelConfig
from diffuse.model.layers import Visible, attention
from diffuse.model.load import DTYPES

def per_call(f, calls: int) -> float:
    f()
    t0 = time.perf_counter()
    for _ in range(calls):
        f()
    return (time.perf_counter() - t0) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--home")
    ap.add_argument("--model", help="store name (default: the default model)")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--contexts", default="128,512,2048")
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    path = store.resolve(data_home(args.home), args.model)
    cfg = ModelConfig.load(path)
    h, kv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    seen = Visible(0, None, causal=False)
    print(f"{path.name}: {h} query heads, {kv} key heads of {d}; {torch.get_num_threads()} threads")
    print("| dtype | batch | context | SDPA GQA ms | engine ms | ratio | same bits |")
    print("|---|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for name in args.dtypes.split(","):
        for b in map(int, args.batches.split(",")):
            for n in map(int, args.contexts.split(",")):
                q, k, v = (torch.randn(b, heads, t, d, generator=g).to(DTYPES[name])
                           for heads, t in ((h, 1), (kv, n), (kv, n)))
                calls = max(3, int(2000 / (b * n / 128)))
                base = functools.partial(F.scaled_dot_product_attention, q, k, v, scale=d ** -0.5, enable_gqa=True)
                engine = functools.partial(attention, q, k, v, seen, d ** -0.5, None, False)
                times = [(per_call(base, calls), per_call(engine, calls)) for _ in range(args.repeats)]
                tb, te = (statistics.median(t[i] for t in times) for i in (0, 1))
                print(f"| {name} | {b} | {n} | {tb * 1e3:.3f} | {te * 1e3:.3f} | {tb / te:.2f}x | "
                      f"{'yes' if torch.equal(base(), engine()) else 'no'} |")


if __name__ == "__main__":
    main()
