#!/usr/bin/env python
"""What the codec costs a decode step, warm and right after the process wakes (cold).

    .venv/bin/python scripts/bench_codec.py [--trials 200] [--hidden 576]

On these machines a process that waited ~10 ms for a peer finds its caches cold: the first torch
or numpy call then takes ~100 us instead of ~3. "Cold" here means: an LM-head-sized matmul, then
3 ms of spinning, then the measured call, as a client between two hops. Each pair is measured
in the same run, alternating, and the table gives the ratio to its baseline:

- relaying a hop's one-token output to the next hop (decode STEP_OK, encode STEP): the decoded
  tensor sent on as received, against encoding the same values from a tensor the codec did not
  decode (converted and checked as any tensor is);
- the inf/NaN check on a one-token fp16 tensor: on its bytes (bytes.translate), against numpy on
  its integer view (what tensors over SMALL_TENSOR bytes use).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("GOMP_SPINCOUNT", "10000")  # as `diffuse` sets it; before torch starts

import numpy as np  # noqa: E402
import torch  # noqa: E402

from diffuse.data import codec  # noqa: E402
from diffuse.data.codec import FrameDecoder, Step, StepOk, encode  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=200)
    ap.add_argument("--hidden", type=int, default=576)
    args = ap.parse_args()
    sid = os.urandom(16)
    out = torch.randn(1, 1, args.hidden).to(torch.float16)
    frame = encode(StepOk(sid, 5, out))
    head, x = torch.randn(49152, args.hidden, dtype=torch.bfloat16), torch.randn(args.hidden, 1, dtype=torch.bfloat16)
    raw = out.numpy().tobytes()

    def relay(fresh: bool) -> None:
        h = FrameDecoder().feed(frame)[0].hidden
        encode(Step(sid, 6, 40, [40], out if fresh else h))  # `out`: same values, not decoded

    pairs = {
        "relay a hop's output": (lambda: relay(False), lambda: relay(True)),
        "inf/NaN check": (lambda: codec._bytes_finite(raw, torch.float16),
                          lambda: codec._check_finite(np.frombuffer(raw, np.int16), torch.float16)),
    }

    def cold() -> None:
        head @ x
        end = time.perf_counter() + 0.003
        while time.perf_counter() < end:
            pass

    def timed(fn, before) -> float:
        if before:
            before()
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    print(f"fp16 one-token tensors of {args.hidden} values; median of {args.trials} alternated trials\n")
    print("| case | state | this codec us | baseline us | ratio |")
    print("|---|---|---|---|---|")
    for name, (fast, base) in pairs.items():
        for state, before in (("warm", None), ("cold", cold)):
            a, b = [], []
            for _ in range(args.trials):
                a.append(timed(fast, before))
                b.append(timed(base, before))
            fa, fb = statistics.median(a) * 1e6, statistics.median(b) * 1e6
            print(f"| {name} | {state} | {fa:.1f} | {fb:.1f} | {fa / fb:.2f}x |")


if __name__ == "__main__":
    main()
