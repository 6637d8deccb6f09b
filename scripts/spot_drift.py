#!/usr/bin/env python
"""How close honest peers come to the spot-check thresholds deep in long contexts.

    .venv/bin/python scripts/spot_drift.py [--span 15:30] [--tokens 256] [--dtype bfloat16]

The thresholds (spotcheck.Tolerance, before bank.SPOT_MARGIN) are fitted on 16-token canaries
from position 0; real steps sit deeper. This runs an honest peer the way a session does (an
8-token prefill, then one token per step, in `--dtype`) over a long natural text (the client's
canaries back to back) and compares every output with the fp32 referee's batched recomputation,
as a spot check would. Prints the drift per position band against the fitted threshold.
"""

from __future__ import annotations

import argparse

import torch

from diffuse.home import data_home
from diffuse.model import store
from diffuse.model.load import load_head, load_span
from diffuse.trust import canary as C
from diffuse.trust.bank import CanaryBank
from diffuse.trust.spotcheck import Tolerance


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--home")
    ap.add_argument("--span", default="15:30")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = ap.parse_args()
    start, end = map(int, args.span.split(":"))
    home = data_home(args.home)
    model_dir = store.resolve(home, None)
    bank = CanaryBank(model_dir, home, torch.float16)
    material = bank.judging(start, end, args.dtype)
    threshold = Tolerance.from_outputs(material.benign).thresholds[tuple(sorted((args.dtype, "float32"))) + ("body",)]
    tokens, _ = bank._base()
    text = tokens.reshape(1, -1)[:, :args.tokens]
    t = text.shape[1]
    h = load_head(model_dir, torch.float32).embed_tokens(text).float()
    if start > 0:
        h = C.forward(load_span(model_dir, 0, start, torch.float32), h)
    sent = h.to(torch.float16)
    ref = C.forward(material.referee, sent.float()).to(torch.float16).float()
    dtype = getattr(torch, args.dtype)
    peer = load_span(model_dir, start, end, dtype)
    cache = peer.new_cache(t)
    outs = [peer(sent[:, :8].to(dtype), torch.arange(8), cache)]
    outs += [peer(sent[:, p:p + 1].to(dtype), torch.tensor([p]), cache) for p in range(8, t)]
    err = C.drift(torch.cat(outs, 1).to(torch.float16).float(), ref)[0]
    used = material.tolerance.thresholds[tuple(sorted((args.dtype, "float32"))) + ("body",)]
    print(f"blocks {start}:{end}, honest {args.dtype} peer vs fp32 referee, {t} tokens; "
          f"fitted body threshold {threshold:.4f} (used: x{used / threshold:g})")
    print("| positions | max | p99 | median | max / threshold |")
    print("|---|---|---|---|---|")
    for lo, hi in ((4, 16), (16, 64), (64, 128), (128, t)):
        e = err[lo:hi]
        if e.numel():
            print(f"| {lo}-{hi - 1} | {float(e.max()):.4f} | {float(e.quantile(0.99)):.4f} | "
                  f"{float(e.median()):.4f} | {float(e.max()) / threshold:.2f} |")


if __name__ == "__main__":
    main()
