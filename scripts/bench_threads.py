#!/usr/bin/env python
"""Threads for a long batch while another program uses part of a core: all cores or one less?

    .venv/bin/python scripts/bench_threads.py [--prompts 3,12] [--busy 0,0.1,0.2,0.3] [--repeats 8]
                                              [--dtype fp32]

A batch of N prompts of 21 tokens through SmolLM2's blocks 1-29 (one peer's span, as a prefill
burst reaches it), on as many torch threads as this process may use and on one less, alternating,
while a second process spins for a share of every 10 ms (--busy: 0 = an idle machine) and sleeps
the rest. Prints the median per setting and the ratio of the fewer threads' time to all threads'
(> 1: all threads win). `scheduler.Threads` leaves a core free for long batches once
`cpu_share.OtherLoad` sees more than SPARE of a core in use by others; this is the measurement
that threshold comes from, with the load `OtherLoad` reports over each setting (the spinning
process's own share, less what it lost to this one's threads).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("GOMP_SPINCOUNT", "10000")  # as `diffuse` sets it; before torch starts

import torch  # noqa: E402

from diffuse.data.cpu_share import OtherLoad  # noqa: E402
from diffuse.home import data_home  # noqa: E402
from diffuse.model import store  # noqa: E402
from diffuse.model.engine import SpanStep  # noqa: E402
from diffuse.model.load import load_span, parse_dtype  # noqa: E402

SPIN = """
import sys, time
share = float(sys.argv[1])
while True:
    t = time.perf_counter()
    while time.perf_counter() - t < 0.01 * share:
        pass
    time.sleep(0.01 * (1 - share))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--home")
    ap.add_argument("--model")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--prompts", default="3,12", help="prompts of 21 tokens per batch")
    ap.add_argument("--busy", default="0,0.1,0.2,0.3", help="shares of a core the other process spins")
    ap.add_argument("--repeats", type=int, default=8)
    args = ap.parse_args()
    most = len(os.sched_getaffinity(0))
    if most < 2:
        sys.exit("needs at least 2 CPUs: the comparison is all of them against one less")
    dtype = parse_dtype(args.dtype)
    model_dir = store.resolve(data_home(args.home), args.model)
    span = load_span(model_dir, 1, 30, dtype)
    width = span.cfg.hidden_size
    rows = []
    for prompts in [int(p) for p in args.prompts.split(",")]:
        caches = [span.new_cache(64) for _ in range(prompts)]

        def batch(threads: int, caches: list = caches) -> float:
            torch.set_num_threads(threads)
            for c in caches:
                c.wipe()
            steps = [SpanStep(torch.randn(1, 21, width, dtype=dtype), torch.arange(21), c) for c in caches]
            t0 = time.perf_counter()
            span.forward_batch(steps)
            return time.perf_counter() - t0

        batch(most)  # first use: reordered weights, oneDNN primitives
        batch(most - 1)
        for share in [float(b) for b in args.busy.split(",")]:
            spin = subprocess.Popen([sys.executable, "-c", SPIN, str(share)]) if share > 0 else None
            try:
                seen = OtherLoad(smoothing=1.0)  # the whole setting as one window
                seen.cores()
                time.sleep(0.5)
                times: dict[int, list[float]] = {most: [], most - 1: []}
                for _ in range(args.repeats):
                    for threads in times:
                        times[threads].append(batch(threads))
                others = seen.cores()
            finally:
                if spin is not None:
                    spin.kill()
                    spin.wait(10)
            all_, fewer = (statistics.median(times[t]) for t in (most, most - 1))
            rows.append((prompts, share, others, all_, fewer))
            print(f"  {prompts} prompts, other process {share:.0%}: {all_ * 1e3:.0f} / {fewer * 1e3:.0f} ms",
                  flush=True)
    print(f"\n{model_dir.name} blocks 1-29, {args.dtype}, prompts of 21 "
          f"tokens, {most} threads against {most - 1}, median of {args.repeats}")
    print(f"| prompts | other process spins | others' load seen (cores) | {most} threads ms | {most - 1} threads ms "
          f"| {most - 1} / {most} |")
    print("|---|---|---|---|---|---|")
    for prompts, share, others, all_, fewer in rows:
        print(f"| {prompts} | {share:.0%} | {others:.2f} | {all_ * 1e3:.0f} | {fewer * 1e3:.0f} "
              f"| {fewer / all_:.2f}x |")


if __name__ == "__main__":
    main()
