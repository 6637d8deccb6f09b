#!/usr/bin/env python
"""Quantized blocks against bf16, per model and scheme, in one run: what holding a model in 8 or 4
bits costs and buys.

    .venv/bin/python scripts/eval_quant.py [--models SmolLM2-135M-Instruct,gemma-3-270m] [--tokens 48] [--threads 1]

A fresh store (temporary, or --home) gets both models as `diffuse model pull` installs them, with
the variant each GGUF maps to kept as imported (model/variants.py); the others are made on first
use. Per model and scheme (none = bf16 compute on the source's weights, int8, int4):

- bytes per block (the largest block's weights as held) and the RSS a process gains loading all
  blocks, above a process that only imported torch;
- decode and prefill tokens/s of a `diffuse join --quant` peer serving every block, driven by a
  client in this process (no trust checks: speed alone; the three peers run at once and their
  sessions take turns), and whole-model `ask --local` decode tokens/s in this process (the
  schemes taking turns prompt by prompt);
- perplexity on scripts/support/heldout.txt (text written for this, not what the draft head is
  trained on), teacher-forced in bf16;
- greedy agreement with bf16 on the chat benchmark prompts: identical answers, and the share of
  tokens before the first difference.

Ratios are against bf16 in the same run (the machine may be shared: timings are noisy). On a
2-core machine that others use too, two torch threads per process spin against their work and
a step can take ten times as long; `--threads 1` (here, and peers lending half of 2 cores) keeps
each process on one core.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import trio
from libp2p.crypto.ed25519 import create_new_key_pair

sys.path.insert(0, str(Path(__file__).resolve().parent))
from support.procs import Procs, swarm_key  # noqa: E402
from support.prompts import CHAT  # noqa: E402
from support.swarm import LOCAL, Swarm, decode, decode_tps  # noqa: E402

SCHEMES = ("none", "int8", "int4")
HELDOUT = Path(__file__).resolve().parent / "support" / "heldout.txt"
RSS_CODE = """
import resource, sys, torch
from pathlib import Path
def rss(): return int(open('/proc/self/statm').read().split()[1]) * 4096
base = rss()
from diffuse.model.load import load_span
from diffuse.model.config import ModelConfig
p = Path(sys.argv[1]); n = ModelConfig.load(p).num_layers
span = load_span(p, 0, n, torch.bfloat16, quant=sys.argv[2])
print(rss() - base)
"""


def rss_above_torch(path: Path, scheme: str) -> int:
    out = subprocess.run([sys.executable, "-c", RSS_CODE, str(path), scheme], capture_output=True, text=True,
                         env=os.environ | {"OMP_NUM_THREADS": "1"}, timeout=600)
    if out.returncode:
        raise RuntimeError(out.stderr)
    return int(out.stdout.split()[-1])


def perplexity(model, tok, text: str, window: int = 512) -> float:
    """exp(mean NLL) of `text`'s tokens, in windows of `window` tokens (each from a fresh cache)."""
    ids = tok.encode(text)
    nll, count = 0.0, 0
    for s in range(0, len(ids) - 1, window):
        chunk = torch.tensor([ids[s:s + window + 1]])
        span, head = model.spans[0], model.head
        cache = span.new_cache(chunk.shape[1])
        h = span(head.embed_tokens(chunk[:, :-1]), torch.arange(chunk.shape[1] - 1), cache)
        logits = head.logits(h)[0]
        nll += float(torch.nn.functional.cross_entropy(logits, chunk[0, 1:], reduction="sum"))
        count += chunk.shape[1] - 1
    return math.exp(nll / count)


def greedy(model, prompt: list[int], n: int) -> tuple[list[int], float]:
    """n greedy tokens (EOS not special) and the decode tokens/s, as `ask --local` runs the model."""
    span, head = model.spans[0], model.head
    cache = span.new_cache(len(prompt) + n)
    h = span(head.embed_tokens(torch.tensor([prompt])), torch.arange(len(prompt)), cache)
    out = [int(head.logits(h[:, -1])[0].argmax())]
    t0 = time.perf_counter()
    while len(out) < n:
        h = span(head.embed_tokens(torch.tensor([[out[-1]]])), torch.tensor([cache.length]), cache)
        out.append(int(head.logits(h[:, -1])[0].argmax()))
    return out, (n - 1) / (time.perf_counter() - t0)


def local_figures(home: Path, name: str, tokens: int) -> dict[str, dict]:
    """Per scheme: perplexity, greedy answers and median decode tokens/s in this process, the
    schemes taking turns prompt by prompt (so a load that comes and goes hits them alike)."""
    from diffuse.client.local import open_local

    models = {s: open_local(home, name, "bf16", quant=s) for s in SCHEMES}
    out = {s: {"answers": [], "speeds": []} for s in SCHEMES}
    for q in CHAT[:8]:
        for s, (model, tok) in models.items():
            ids, tps = greedy(model, tok.encode_chat([{"role": "user", "content": q}]), tokens)
            out[s]["answers"].append(ids)
            out[s]["speeds"].append(tps)
    return {s: {"ppl": perplexity(*models[s], HELDOUT.read_text()), "answers": o["answers"],
                "local_tps": sorted(o["speeds"])[len(o["speeds"]) // 2]} for s, o in out.items()}


async def peer_speeds(path: Path, boot: str, tokens: int) -> dict[str, tuple[float, float]]:
    """Per scheme, (prefill tokens/s of a 200-token prompt, decode tokens/s) through the peer
    holding that variant (a client accepting it alone), sessions taking turns, median of 3."""
    from diffuse.client.swarm import SwarmClient, SwarmOptions
    from diffuse.control.node import NodeConfig, open_node
    from diffuse.model.tokenizer import Tokenizer

    prompt = Tokenizer.load(path).encode(HELDOUT.read_text())[:200]
    async with open_node(create_new_key_pair(), NodeConfig(listen=[LOCAL], bootstrap=[boot], server=False,
                                                           swarm_key=swarm_key())) as node:
        clients = {s: SwarmClient(node, path, SwarmOptions(local_blocks=(0, 0), trust=None, accept_quant=s))
                   for s in SCHEMES}
        with trio.fail_after(180):
            for client in clients.values():
                while not await client.covered():
                    await trio.sleep(0.5)
        runs: dict[str, list[tuple[float, float]]] = {s: [] for s in SCHEMES}
        for _ in range(4):  # the first warms connections and caches
            for s, client in clients.items():
                pipe = await client.session(len(prompt) + tokens)
                t0 = time.perf_counter()
                _, stamps = await decode(pipe, prompt, tokens)
                runs[s].append((len(prompt) / (stamps[0] - t0), decode_tps(stamps)))
        return {s: (sorted(r[0] for r in rs[1:])[1], sorted(r[1] for r in rs[1:])[1]) for s, rs in runs.items()}


def serve_and_measure(home: Path, tmp: Path, path: Path, tokens: int) -> dict[str, tuple[float, float]]:
    """A peer per scheme, each serving every block of `path` as that variant (on one core of two
    with --threads 1: `--contribution moderate`)."""
    from diffuse.model.config import ModelConfig

    n = ModelConfig.load(path).num_layers
    lend = ["--contribution", "moderate"] if torch.get_num_threads() == 1 else []
    with Procs(home, one_thread=False) as procs:
        swarm = Swarm(procs, tmp / path.name, {s: f"0:{n}" for s in SCHEMES},
                      {s: ["--quant", s, "--model", path.name, "--throughput", "20", *lend] for s in SCHEMES},
                      timeout=600)
        return trio.run(peer_speeds, path, swarm.boot, tokens)


def agreement(answers: list[list[int]], reference: list[list[int]]) -> tuple[float, float]:
    same = sum(a == b for a, b in zip(answers, reference)) / len(reference)
    prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(b)) / len(b)
              for a, b in zip(answers, reference)]
    return same, sum(prefix) / len(prefix)


def measure(home: Path, tmp: Path, name: str, tokens: int) -> list[dict]:
    from diffuse.model import store, variants
    from diffuse.model.engine import block_parameters
    from diffuse.model.weights import load_manifest

    path = store.resolve(home, name)
    cfg = store.info(path).config
    rows = []
    for scheme in SCHEMES:
        m = load_manifest(variants.resolve(path, scheme))
        per = 2 * max(block_parameters(cfg, i) for i in range(cfg.num_layers)) if scheme == "none" \
            else max(m.block_bytes)
        rows.append({"model": name, "scheme": scheme, "block_bytes": per, "rss": rss_above_torch(path, scheme)})
    local = local_figures(home, name, tokens)
    peer = serve_and_measure(home, tmp, path, tokens)
    for row in rows:
        row |= local[row["scheme"]]
        row["prefill"], row["decode"] = peer[row["scheme"]]
        print(json.dumps({k: v for k, v in row.items() if k != "answers"}), file=sys.stderr, flush=True)
    return rows


def report(rows: list[dict]) -> None:
    print("| model | quant | bytes/block (MiB) | x bf16 | RSS above torch (MiB) | peer decode tok/s | x bf16 "
          "| peer prefill tok/s | x bf16 | ask --local decode tok/s | x bf16 | perplexity | x bf16 "
          "| same answers | agreed prefix |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        base = next(b for b in rows if b["model"] == r["model"] and b["scheme"] == "none")
        same, prefix = agreement(r["answers"], base["answers"])
        print(f"| {r['model']} | {r['scheme']} | {r['block_bytes'] / 2**20:.2f}"
              f" | {r['block_bytes'] / base['block_bytes']:.2f}"
              f" | {r['rss'] / 2**20:.0f} | {r['decode']:.1f} | {r['decode'] / base['decode']:.2f}"
              f" | {r['prefill']:.0f} | {r['prefill'] / base['prefill']:.2f} | {r['local_tps']:.1f}"
              f" | {r['local_tps'] / base['local_tps']:.2f} | {r['ppl']:.3f} | {r['ppl'] / base['ppl']:.3f}"
              f" | {same:.2f} | {prefix:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--home", type=Path, help="a store to use (default: a fresh temporary one)")
    ap.add_argument("--models", default="SmolLM2-135M-Instruct,gemma-3-270m")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, help="torch threads here (1: peers lend one core of two too)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from diffuse.model import kernels, store

    with tempfile.TemporaryDirectory(prefix="eval-quant-") as tmp:
        home = args.home or Path(tmp) / "home"
        rows = []
        for name in args.models.split(","):
            store.pull(home, None if name == "SmolLM2-135M-Instruct" else name, lambda m: None)
            rows += measure(home, Path(tmp), name, args.tokens)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads here and in the peer; kernels: "
          f"{kernels.describe()}; {args.tokens} greedy tokens, prefill of 200 tokens")
    report(rows)
    kept = next((r for r in rows if r["model"] == "gemma-3-270m" and r["scheme"] == "int4"), None)
    if kept is not None:
        base = next(r for r in rows if r["model"] == "gemma-3-270m" and r["scheme"] == "none")
        print(f"\ngemma-3-270m Q4_K_M kept as imported (int4 variant) vs the same GGUF dequantized (bf16): "
              f"perplexity {kept['ppl']:.3f} vs {base['ppl']:.3f} = {kept['ppl'] / base['ppl']:.3f}x")


if __name__ == "__main__":
    main()
