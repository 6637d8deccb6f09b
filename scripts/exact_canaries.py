#!/usr/bin/env python
"""Whether honest peers in exact sessions pass the canaries, judged by the fast kernels'
calibration and by the exact kernels' (what an exact client's bank uses).

    .venv/bin/python scripts/exact_canaries.py [--span 1:15] [--banks 4]

An exact client's canary sessions are exact, so a peer computes them on the batch-invariant
kernels (kernels.exact_linear, attention in fp64). Each bank samples its own canaries; per bank
this scores two honest exact peers in bf16 (this machine's kernels, and the dimensions permuted
as another machine sums) against both calibrations over all canaries at once, and prints the
largest residual in honest standard deviations, log10 p and the verdict at the client's alpha.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from diffuse.home import data_home
from diffuse.model import store
from diffuse.trust import canary as C
from diffuse.trust.bank import CanaryBank


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--home")
    ap.add_argument("--span", default="1:15")
    ap.add_argument("--banks", type=int, default=4)
    args = ap.parse_args()
    start, end = map(int, args.span.split(":"))
    model_dir = store.resolve(data_home(args.home), None)
    print("| bank | peer | calibration | z_max | z_mean | log10 p | caught |")
    print("|---|---|---|---|---|---|---|")
    caught = {"fast": 0, "exact": 0}
    for bank in range(args.banks):
        home = Path(tempfile.mkdtemp())  # a fresh client: its own secret canaries
        judges = {"fast": CanaryBank(model_dir, home, torch.float16).material(start, end),
                  "exact": CanaryBank(model_dir, home, torch.float16, exact=True).material(start, end)}
        hidden = torch.stack([c.hidden for c in judges["exact"].canaries]).float()
        for seed, peer in ((None, "this machine"), (7, "permuted")):
            out = C.honest_output(judges["exact"].referee, hidden, torch.bfloat16, seed, torch.float16, exact=True)
            for name, m in judges.items():
                v = C.decide(m.calibration.for_dtype("bfloat16"),
                             [(i, C.score(out[i], c)) for i, c in enumerate(m.canaries)])
                caught[name] += v.tampered
                print(f"| {bank} | {peer} | {name} | {v.z_max:.2f} | {v.z_mean:.2f} | {v.log10_p:.2f} | "
                      f"{'yes' if v.tampered else 'no'} |", flush=True)
    print(f"\nhonest exact peers called cheats: fast calibration {caught['fast']}/{2 * args.banks}, "
          f"exact calibration {caught['exact']}/{2 * args.banks}")


if __name__ == "__main__":
    main()
