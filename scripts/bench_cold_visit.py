#!/usr/bin/env python
"""What a peer's compute costs when it runs after others had the cores: the swarm's hidden tax.

    .venv/bin/python scripts/bench_cold_visit.py [--home DIR] [--blocks 0:10] [--dtype bf16] [--steps 40]

A peer of a loopback swarm computes its span only when the hop before it is done, so it always
starts after an idle gap. This times one decode step through the span (one token, KV cache of
40-380 tokens) in one process, alternating: back to back (as the in-process engine decodes), after
30 ms asleep, after 30 ms of this thread busy in Python (torch's worker thread idle), after a
sleep plus a tiny matmul that wakes the worker first, and after sweeping 64 MB through the caches.
Medians per mode, and each one's ratio to back to back.
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
from diffuse.model.load import load_span, parse_dtype  # noqa: E402

GAP = 0.03


def before(mode: str, small: torch.Tensor, junk: torch.Tensor) -> None:
    if mode == "asleep":
        time.sleep(GAP)
    elif mode == "busy in Python":
        t = time.perf_counter()
        while time.perf_counter() - t < GAP:
            pass
    elif mode == "asleep, worker woken":
        time.sleep(GAP)
        small @ small
    elif mode == "64 MB swept":
        junk.mul_(1.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--home")
    ap.add_argument("--model")
    ap.add_argument("--blocks", default="0:10")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    start, end = map(int, args.blocks.split(":"))
    dtype = parse_dtype(args.dtype)
    span = load_span(store.resolve(data_home(args.home), args.model), start, end, dtype=dtype)
    cache = span.new_cache(400)
    span(torch.randn(1, 40, span.cfg.hidden_size, dtype=dtype), torch.arange(40), cache)
    small, junk = torch.randn(256, 256), torch.zeros(16 * 1024 * 1024)
    modes = ["back to back", "asleep", "busy in Python", "asleep, worker woken", "64 MB swept"]
    times: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(args.rounds):  # alternate, so that machine noise hits every mode alike
        for mode in modes:
            for _ in range(args.steps):
                before(mode, small, junk)
                x = torch.randn(1, 1, span.cfg.hidden_size, dtype=dtype)
                t0 = time.perf_counter()
                span(x, torch.tensor([cache.length]), cache)
                times[mode].append(time.perf_counter() - t0)
                if cache.length >= 380:
                    cache.rollback(40)
    base = statistics.median(times["back to back"])
    print(f"blocks {args.blocks} in {args.dtype}, {torch.get_num_threads()} threads, one-token steps, "
          f"median of {args.rounds} x {args.steps}; gaps of {GAP * 1e3:.0f} ms; load {os.getloadavg()[0]:.2f}")
    print("| before each step | ms per step | ratio to back to back |")
    print("|---|---|---|")
    for mode in modes:
        ms = statistics.median(times[mode])
        print(f"| {mode} | {ms * 1e3:.2f} | {ms / base:.2f}x |")


if __name__ == "__main__":
    main()
