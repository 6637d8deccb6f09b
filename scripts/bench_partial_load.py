#!/usr/bin/env python
"""Peak RSS of a peer that loads some blocks of a model vs all of them, each in a fresh process.

    .venv/bin/python scripts/bench_partial_load.py [--home DIR] [--dtype bf16]

The baseline row is a bare process that only imports torch and the engine, so the table shows
what the weights themselves cost.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = """
import json, resource, sys
from diffuse.home import data_home
from diffuse.model import store
from diffuse.model.load import load_span, load_head, parse_dtype
a, b, head, home, dtype = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4], sys.argv[5]
path = store.resolve(data_home(home or None), None)
keep = [load_span(path, a, b, parse_dtype(dtype))] if b > a else []
if head:
    keep.append(load_head(path, parse_dtype(dtype)))
print(json.dumps({"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def peak(a: int, b: int, head: bool, home: str, dtype: str) -> float:
    out = subprocess.run([sys.executable, "-c", CHILD, str(a), str(b), "1" if head else "0", home, dtype],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.splitlines()[-1])["peak_rss_mb"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--home", default="")
    ap.add_argument("--dtype", default="bf16")
    args = ap.parse_args()
    base = peak(0, 0, False, args.home, args.dtype)
    rows = [("imports only (baseline)", base), ("blocks 10:20 (10 of 30)", peak(10, 20, False, args.home, args.dtype)),
            ("blocks 0:30 (all)", peak(0, 30, False, args.home, args.dtype)),
            ("blocks 0:30 + embeddings/head", peak(0, 30, True, args.home, args.dtype))]
    print(f"SmolLM2-135M, compute dtype {args.dtype}, fp32 safetensors on disk")
    print("| load | peak RSS MB | above baseline MB | ratio to all blocks |")
    print("|---|---|---|---|")
    full = rows[2][1] - base
    for name, mb in rows:
        print(f"| {name} | {mb:.0f} | {mb - base:.0f} | {(mb - base) / full:.2f} |")


if __name__ == "__main__":
    main()
