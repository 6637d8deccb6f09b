#!/usr/bin/env python
"""Sessions in one slab against caches of their own: one batched step, in one process.

    .venv/bin/python scripts/bench_slabs.py [--sessions 4,8,16] [--dtypes fp32,bf16] [--tokens 1,8]
                                            [--context 100] [--repeats 30]

N sessions hold --context tokens each (a few more for every next session, as a peer's mixed
prompts would) through SmolLM2's blocks 1-29, once in slots of one slab (`engine.Slab`: their
short steps attend in one call per layer) and once in caches of their own (one attention call per
session and layer, as `DIFFUSE_SLABS=0` makes every cache); the same batched step, of --tokens
tokens per session (1: decoding; more: a speculation tree, here two branches from the root, left
pending and rolled back), is timed on both, alternating, on every thread count from 1 to this
process's CPUs. Prints the median step
time of each and their ratio (< 1: the slab is faster), and the largest difference of the
outputs relative to their scale (fast kernels: batched bits already depend on the company).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("GOMP_SPINCOUNT", "10000")  # as `diffuse` sets it; before torch starts

import torch  # noqa: E402

from diffuse.home import data_home  # noqa: E402
from diffuse.model import store  # noqa: E402
from diffuse.model.engine import KVCache, SpanStep  # noqa: E402
from diffuse.model.load import load_span, parse_dtype  # noqa: E402


def depths(tokens: int) -> torch.Tensor:
    """Offsets of a tree's tokens from the root: two branches of (tokens - 1) / 2 after it."""
    half = tokens // 2
    return torch.tensor([0] + [1 + i % half for i in range(tokens - 1)])


def branches(tokens: int) -> torch.Tensor:
    """The tree mask of `depths`: the root, then two chains that each see the root and their own
    earlier tokens."""
    half = tokens // 2
    mask = torch.eye(tokens, dtype=torch.bool)
    mask[:, 0] = True
    for i in range(1, tokens):
        for j in range(1, i):
            mask[i, j] = (i - 1) // half == (j - 1) // half
    return mask


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--home")
    ap.add_argument("--model")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--sessions", default="4,8,16")
    ap.add_argument("--tokens", default="1,8", help="tokens per session's step (more than 1: a tree)")
    ap.add_argument("--context", type=int, default=100, help="tokens each session holds (+3 per later session)")
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    model_dir = store.resolve(data_home(args.home), args.model)
    most = len(os.sched_getaffinity(0))
    rows = []
    for name in args.dtypes.split(","):
        dtype = parse_dtype(name)
        span = load_span(model_dir, 1, 30, dtype)
        cfg, width = span.cfg, span.cfg.hidden_size
        for n in [int(s) for s in args.sessions.split(",")]:
            length = args.context + 3 * n + 8
            slab = [span.new_cache(length) for _ in range(n)]
            own = [KVCache.empty(len(span.blocks), 1, cfg.num_kv_heads, cfg.head_dim, length, dtype) for _ in range(n)]
            assert all(c.slab is not None for c in slab), "slabs are off (DIFFUSE_SLABS=0?)"
            g = torch.Generator().manual_seed(0)
            for i in range(n):
                t = args.context + 3 * i
                x = torch.randn(1, t, width, generator=g).to(dtype)
                for c in (slab[i], own[i]):
                    span(x, torch.arange(t), c)
            for tokens in [int(t) for t in args.tokens.split(",")]:
                hs = [torch.randn(1, tokens, width, generator=g).to(dtype) for _ in range(n)]
                tree = branches(tokens) if tokens > 1 else None

                def step(caches: list[KVCache], span=span, hs=hs, tree=tree) -> tuple[float, list[torch.Tensor]]:
                    steps = [SpanStep(h, c.length + depths(h.shape[1]), c, tree, tree is None)
                             for h, c in zip(hs, caches)]
                    t0 = time.perf_counter()
                    outs = span.forward_batch(steps)
                    seconds = time.perf_counter() - t0
                    for c, st in zip(caches, steps):
                        c.rollback(c.length - (1 if st.commit else 0))
                    return seconds, outs

                (_, a), (_, b) = step(slab), step(own)
                diff = max(float((x.float() - y.float()).abs().max() / y.float().abs().max()) for x, y in zip(a, b))
                for threads in range(1, most + 1):
                    torch.set_num_threads(threads)
                    times: dict[str, list[float]] = {"slab": [], "own": []}
                    for _ in range(5):
                        step(slab), step(own)
                    for _ in range(args.repeats):
                        times["slab"].append(step(slab)[0])
                        times["own"].append(step(own)[0])
                    s, o = statistics.median(times["slab"]), statistics.median(times["own"])
                    rows.append((name, n, tokens, threads, o, s, diff))
                    print(f"  {name} x{n}, {tokens} tokens, {threads} threads: own {o * 1e3:.1f} ms, "
                          f"slab {s * 1e3:.1f} ms", flush=True)
    print(f"\n{model_dir.name} blocks 1-29, a step of N sessions (~{args.context} tokens of context), "
          f"median of {args.repeats}, alternating")
    print("| dtype | sessions | tokens each | threads | own caches ms | slab ms | slab / own "
          "| outputs' largest difference |")
    print("|---|---|---|---|---|---|---|---|")
    for name, n, tokens, threads, o, s, diff in rows:
        print(f"| {name} | {n} | {tokens} | {threads} | {o * 1e3:.1f} | {s * 1e3:.1f} | {s / o:.2f}x | {diff:.1e} |")


if __name__ == "__main__":
    main()
