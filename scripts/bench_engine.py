#!/usr/bin/env python
"""Engine vs transformers on the same weights, dtype and prompt: prefill and decode tokens/s;
and, with --llama-cpp, the engine's bf16 and quantized blocks vs llama.cpp on the GGUF itself.

    .venv/bin/python scripts/bench_engine.py [--model gemma-3-270m] [--tokens 64] [--repeats 3] [--dtypes fp32,bf16]
                                             [--threads N] [--llama-cpp [--quants none,int8,int4] [--gguf FILE]]

--llama-cpp (the `bench` extra: pip install -e '.[bench]', llama-cpp-python builds from source)
times llama.cpp on the model's GGUF (the embedded file for the default model; --gguf for another),
the same prompt's token ids, greedy, decode tokens/s from llama.cpp's own timings (prompt
evaluation excluded), against the engine's decode in bf16 per --quants, runs alternated.

transformers runs `generate` (greedy) on the store's safetensors; the engine runs one span of all
blocks and the head, as `ask --local` does. Runs alternate (engine, transformers, engine, ...) so
machine noise hits both alike; prints the medians and the ratios engine / transformers (> 1 means
the engine is faster). A model without a chat template gets the plain prompt.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("GOMP_SPINCOUNT", "10000")  # read once, when torch loads (below, in main)

PROMPT = "Explain in a few sentences why the sky is blue, and what changes at sunset."


def bench_engine(model, prompt: list[int], n: int) -> tuple[float, float]:
    """(prefill seconds, decode tokens/s) of n greedy tokens."""
    import torch

    head, (span,) = model.head, model.spans
    cache = span.new_cache(len(prompt) + n + 1)
    ids = torch.tensor([prompt])
    t0 = time.perf_counter()
    h = span(head.embed_tokens(ids), torch.arange(len(prompt)), cache)
    logits = head.logits(h[:, -1:])[0, -1]
    t1 = time.perf_counter()
    for _ in range(n - 1):
        token = int(logits.argmax())
        h = span(head.embed_tokens(torch.tensor([[token]])), torch.tensor([cache.length]), cache)
        logits = head.logits(h)[0, -1]
    t2 = time.perf_counter()
    cache.wipe()
    return t1 - t0, (n - 1) / (t2 - t1)


def bench_hf(model, prompt: list[int], n: int) -> tuple[float, float]:
    """The same for transformers' generate: prefill is a 1-token generate, decode the rest."""
    import torch

    ids = torch.tensor([prompt])
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.inference_mode():
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
        t1 = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        t2 = time.perf_counter()
    return t1 - t0, (n - 1) / ((t2 - t1) - (t1 - t0))


def bench_llama_cpp(llm, prompt: list[int], n: int) -> float:
    """Decode tokens/s of n greedy tokens by llama.cpp, from its own timings (prefill excluded)."""
    import llama_cpp

    llm.reset()
    llama_cpp.llama_perf_context_reset(llm._ctx.ctx)
    made = 0
    for _ in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
        made += 1
        if made >= n:
            break
    perf = llama_cpp.llama_perf_context(llm._ctx.ctx)
    return perf.n_eval / (perf.t_eval_ms / 1000)


def versus_llama_cpp(args, home, threads: int) -> None:
    """The engine's decode per --quants against llama.cpp's on the GGUF, alternated, medians."""
    import llama_cpp

    from diffuse.client.local import open_local
    from diffuse.model.gguf_import import embedded_gguf_path

    gguf = args.gguf or embedded_gguf_path()
    llm = llama_cpp.Llama(str(gguf), n_threads=threads, n_threads_batch=threads, n_ctx=1024, verbose=False)
    rows = []
    for quant in args.quants.split(","):
        model, tok = open_local(home, args.model, "bf16", quant=quant)
        prompt = tok.encode_chat([{"role": "user", "content": PROMPT}])
        bench_engine(model, prompt, 4), bench_llama_cpp(llm, prompt, 4)  # warm-up
        ours, theirs = [], []
        for _ in range(args.repeats):
            ours.append(bench_engine(model, prompt, args.tokens)[1])
            theirs.append(bench_llama_cpp(llm, prompt, args.tokens))
        rows.append((quant, statistics.median(ours), statistics.median(theirs)))
        del model
    print(f"\nengine (bf16 compute) vs llama.cpp {llama_cpp.__version__} on {gguf.name}: prompt {len(prompt)} "
          f"tokens, {args.tokens} greedy tokens, decode only, {threads} threads each, median of {args.repeats}")
    print("| engine blocks | decode tok/s engine | decode tok/s llama.cpp | ratio |")
    print("|---|---|---|---|")
    for quant, de, dl in rows:
        print(f"| {quant} | {de:.1f} | {dl:.1f} | {de / dl:.2f}x |")


def median(runs: list[tuple[float, float]], i: int) -> float:
    return statistics.median(r[i] for r in runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--home")
    ap.add_argument("--model")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's, one per core)")
    ap.add_argument("--llama-cpp", action="store_true", help="also time llama.cpp on the model's GGUF")
    ap.add_argument("--quants", default="none,int8,int4", help="engine blocks against llama.cpp")
    ap.add_argument("--gguf", type=Path, help="the GGUF llama.cpp runs (default: the embedded model's)")
    args = ap.parse_args()
    import torch
    import transformers

    if args.threads:
        torch.set_num_threads(args.threads)
    from diffuse.client.local import open_local
    from diffuse.home import data_home
    from diffuse.model import kernels, store
    from diffuse.model.load import parse_dtype

    home = data_home(args.home)
    path = store.resolve(home, args.model)
    rows = []
    for dtype in args.dtypes.split(","):
        model, tok = open_local(home, args.model, dtype)
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=parse_dtype(dtype)).eval()
        prompt = tok.encode_chat([{"role": "user", "content": PROMPT}])  # plain for a base model
        bench_engine(model, prompt, 4), bench_hf(hf, prompt, 4)  # warm-up
        ours, theirs = [], []
        for _ in range(args.repeats):
            ours.append(bench_engine(model, prompt, args.tokens))
            theirs.append(bench_hf(hf, prompt, args.tokens))
        rows.append((dtype, median(ours, 0), median(theirs, 0), median(ours, 1), median(theirs, 1)))
        del model, hf
    print(f"{path.name} engine vs transformers {transformers.__version__} generate; prompt {len(prompt)} tokens, "
          f"{args.tokens} new tokens, {torch.get_num_threads()} threads, median of {args.repeats}; "
          f"kernels: {kernels.describe()}")
    print("| dtype | prefill tok/s engine | prefill tok/s transformers | prefill ratio "
          "| decode tok/s engine | decode tok/s transformers | decode ratio |")
    print("|---|---|---|---|---|---|---|")
    for dtype, pe, ph, de, dh in rows:
        n = len(prompt)
        print(f"| {dtype} | {n / pe:.0f} | {n / ph:.0f} | {ph / pe:.2f}x | {de:.1f} | {dh:.1f} | {de / dh:.2f}x |")
    if args.llama_cpp:
        versus_llama_cpp(args, home, torch.get_num_threads())


if __name__ == "__main__":
    main()
