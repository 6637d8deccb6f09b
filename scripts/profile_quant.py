#!/usr/bin/env python
"""Where a decode step's time goes with bf16, int8 and int4 blocks, and what bounds the speedup.

    .venv/bin/python scripts/profile_quant.py [--home H] [--models SmolLM2-135M-Instruct,gemma-3-270m] [--repeats 15]

Per model and scheme, one thread, all blocks in one span (as a peer serving every block holds them):

- products: one pass of a single row through every projection of every block, in the model's
  order, with nothing else (weights streamed from memory as decoding streams them: the whole
  model does not fit in cache), on the kernels the engine uses (`kernels.linear` for bf16,
  `Packed.matmul` for int8/int4);
- step: one decode step through all blocks (products, attention, norms, RoPE, the KV cache);
- rest: step - products, what the quantization does not touch;
- head: the client's LM head for one row (bf16, not quantized), for reference.

The bound column is the decode speedup over bf16 if only the products changed: (bf16 step + head)
/ (scheme's products + bf16's rest + head); a peer's decode adds the hop on top of both sides, so
its ratio is lower still. Each figure is the fastest of --repeats runs (the machine may be shared),
the schemes taking turns.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

SCHEMES = ("none", "int8", "int4")


def products(span, x_by_k) -> float:
    """Seconds for one row through every projection of `span`, nothing else."""
    from diffuse.model.kernels import Linear, linear

    t = time.perf_counter()
    for m in span.modules():
        if isinstance(m, Linear):
            if m.packed is not None:
                m.packed.matmul(x_by_k[m.packed.k])
            else:
                linear(x_by_k[m.weight.shape[1]], m.weight, None)
    return time.perf_counter() - t


def step(span, cache, x, position: int) -> float:
    import torch

    t = time.perf_counter()
    span(x, torch.tensor([position]), cache)
    cache.rollback(position)
    return time.perf_counter() - t


def profile(path: Path, repeats: int) -> list[dict]:
    import torch

    from diffuse.model.config import ModelConfig
    from diffuse.model.kernels import Linear
    from diffuse.model.load import load_head, load_span

    cfg = ModelConfig.load(path)
    head = load_head(path, torch.bfloat16)
    spans = {s: load_span(path, 0, cfg.num_layers, torch.bfloat16, quant=s) for s in SCHEMES}
    ks = {m.packed.k if m.packed is not None else m.weight.shape[1]
          for span in spans.values() for m in span.modules() if isinstance(m, Linear)}
    x_by_k = {k: torch.randn(1, k, dtype=torch.bfloat16) for k in ks}
    caches, context = {}, 64
    for s, span in spans.items():  # a context of 64 tokens, as a short chat's decode sees
        caches[s] = span.new_cache(context + 1)
        span(torch.randn(1, context, cfg.hidden_size, dtype=torch.bfloat16), torch.arange(context), caches[s])
    x = torch.randn(1, 1, cfg.hidden_size, dtype=torch.bfloat16)
    best = {s: [float("inf"), float("inf")] for s in SCHEMES}
    head_s = float("inf")
    with torch.inference_mode():
        for _ in range(repeats):
            for s, span in spans.items():
                best[s][0] = min(best[s][0], products(span, x_by_k))
                best[s][1] = min(best[s][1], step(span, caches[s], x, context))
            t = time.perf_counter()
            head.logits(x[:, 0])
            head_s = min(head_s, time.perf_counter() - t)
    rest_bf16 = best["none"][1] - best["none"][0]
    rows = []
    for s in SCHEMES:
        prod, st = best[s]
        bound = (best["none"][1] + head_s) / (prod + rest_bf16 + head_s)
        rows.append({"model": path.name, "quant": s, "products_ms": prod * 1e3, "step_ms": st * 1e3,
                     "rest_ms": (st - prod) * 1e3, "head_ms": head_s * 1e3,
                     "products_x": best["none"][0] / prod, "step_x": best["none"][1] / st, "bound_x": bound})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--home", type=Path, help="the store (default: ~/.diffuse)")
    ap.add_argument("--models", default="SmolLM2-135M-Instruct,gemma-3-270m")
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    import torch

    from diffuse.home import data_home, models_dir

    torch.set_num_threads(1)
    home = data_home(args.home)
    rows = [r for name in args.models.split(",") for r in profile(models_dir(home) / name, args.repeats)]
    print("| model | quant | products ms | x bf16 | step ms (all blocks) | x bf16 | rest ms | head ms | bound x bf16 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['quant']} | {r['products_ms']:.2f} | {r['products_x']:.2f} | {r['step_ms']:.2f} | "
              f"{r['step_x']:.2f} | {r['rest_ms']:.2f} | {r['head_ms']:.2f} | {r['bound_x']:.2f} |")


if __name__ == "__main__":
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")
    main()
