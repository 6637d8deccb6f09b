#!/usr/bin/env python
"""Speculative vs plain greedy decoding, in process or through a swarm: identity, acceptance, speed.

    .venv/bin/python scripts/eval_speculative_identity.py [--home DIR] [--out DIR] [--tokens 128]
        [--per-class 17] [--bf16-per-class 4] [--sweep-per-class 4] [--threads 1] [--costs idle]
        [--swarm] [--draft]

--swarm runs phases 2-4 through a real loopback swarm instead (a sentinel and two `diffuse join`
processes serving blocks 1-14 and 15-29 in the phase's dtype, fp16 on the wire, the client
holding block 0 and the head), planning with the idle cost table; phase 5 is in-process only.

Phases (each cached as JSON under --out, so an interrupted run resumes where it stopped):
1. step costs: seconds per forward of T positions at a 300-token context, fp32, median of 3
   (--costs measure), or a table measured on an idle 2-core AVX2 machine (--costs idle: a
   busy shared box inflates and distorts the curve); the planner's model: the T=1 cost, and
   a + b*T fitted on 2 <= T <= 32.
2. fp32 plain greedy, every prompt, exactly --tokens tokens (end-of-turn ignored, so every
   prompt compares the same number of tokens), recording the top-2 logit gap at each token.
3. fp32 speculative greedy, planned as over an 80 ms round trip (so candidate trees are really
   sent): any token that differs from phase 2 is a mismatch.
4. bf16 plain vs speculative on a subset: flips are expected there, from near-ties that a
   multi-position pass rounds differently; the top-2 gap at the first divergence tells.
5. speculative fp32 planned for 0 and 20 ms round trips on a subset: acceptance per class.
Modelled speed: tok/s = tokens / sum over steps of (RTT + measured cost of the step's width).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Awaitable, Callable

os.environ.setdefault("GOMP_SPINCOUNT", "10000")

import torch  # noqa: E402
import trio  # noqa: E402

from diffuse.client.generate import stream_tokens  # noqa: E402
from diffuse.client.local import open_local  # noqa: E402
from diffuse.model import store  # noqa: E402
from diffuse.model.tokenizer import Tokenizer  # noqa: E402
from diffuse.client.sampling import Sampler, SamplingParams  # noqa: E402
from diffuse.client.speculative import Cost, SpecConfig, SpecState, kv_headroom, speculative_tokens  # noqa: E402
from diffuse.home import data_home  # noqa: E402
from support.prompts import CLASSES  # noqa: E402
from support.speculation import FixedCost  # noqa: E402

# fp32, 2 threads, 300-token context, an idle 2-core AVX2 machine, seconds.
IDLE_FP32 = {"1": 0.038, "2": 0.058, "8": 0.055, "16": 0.067, "32": 0.092, "64": 0.145, "128": 0.240}


async def cached(path: Path, compute: Callable[[], Awaitable]):
    if path.exists():
        return json.loads(path.read_text())
    path.write_text(json.dumps(await compute()))
    return json.loads(path.read_text())  # the same types (string keys) whether fresh or cached


class Recording:
    """A pipeline proxy that keeps the top-2 logit gap of the last position of each forward."""

    def __init__(self, pipe):
        self.pipe, self.gaps = pipe, []

    def __getattr__(self, name):
        return getattr(self.pipe, name)

    async def close(self) -> None:
        await self.pipe.close()

    async def forward(self, *args, **kw):
        logits = await self.pipe.forward(*args, **kw)
        top = logits[0, -1].topk(2).values
        self.gaps.append(float(top[0] - top[1]))
        return logits


def prompts_of(tok, per_class: int) -> list[tuple[str, list[int]]]:
    return [(kind, tok.encode_chat([{"role": "user", "content": text}]))
            for kind, texts in CLASSES.items() for text in texts[:per_class]]


async def measure_costs(sessions: "Sessions") -> dict[int, float]:
    pipe = await sessions(300 + 65)
    await pipe.forward(torch.randint(100, 40000, (1, 300)), rows=slice(-1, None))
    times: dict[int, list[float]] = {}
    for _ in range(3):
        for t in (1, 2, 4, 8, 16, 32, 64):
            ids = torch.randint(100, 40000, (1, t))
            t0 = time.perf_counter()
            await pipe.forward(ids, commit=False)
            times.setdefault(t, []).append(time.perf_counter() - t0)
            await pipe.rollback(300)
    await pipe.close()
    return {t: statistics.median(v) for t, v in times.items()}


def fit_cost(costs: dict[int, float], rtt: float) -> Cost:
    """The planner's cost model for the measured curve plus a round trip."""
    pts = [(int(t), s) for t, s in costs.items() if 2 <= int(t) <= 32]
    mt = sum(t for t, _ in pts) / len(pts)
    ms = sum(s for _, s in pts) / len(pts)
    b = sum((t - mt) * (s - ms) for t, s in pts) / sum((t - mt) ** 2 for t, _ in pts)
    return Cost(rtt + costs["1"], rtt + ms - b * mt, b)


Sessions = Callable[[int], Awaitable]  # max_len -> a Pipeline (in process or on the swarm)


async def run_plain(sessions: Sessions, prompts, n: int) -> list[dict]:
    out = []
    for i, (_, prompt) in enumerate(prompts):
        pipe = Recording(await sessions(len(prompt) + n + 1))
        try:
            toks = [t async for t in stream_tokens(pipe, prompt, Sampler(SamplingParams(max_tokens=n)), set())]
        finally:
            await pipe.close()
        out.append(progress({"tokens": toks, "gaps": pipe.gaps}, i, len(prompts)))
    return out


async def run_spec(sessions: Sessions, prompts, n: int, cost: Cost, draft=None) -> list[dict]:
    out = []
    for i, (_, prompt) in enumerate(prompts):
        cfg, state = SpecConfig(draft=draft), SpecState(cost=FixedCost(cost))  # measured curve + assumed round trip
        pipe = await sessions(len(prompt) + n + kv_headroom(cfg))
        try:
            sampler = Sampler(SamplingParams(max_tokens=n))
            toks = [t async for t in speculative_tokens(pipe, prompt, sampler, set(), cfg, state)]
        finally:
            await pipe.close()
        row = {"tokens": toks, "steps": state.stats.tokens, "positions": state.stats.positions}
        out.append(progress(row, i, len(prompts)))
    return out


async def run_pairs(sessions: Sessions, prompts, n: int, cost: Cost, path: Path,
                    draft=None) -> tuple[list[dict], list[dict]]:
    """Plain then speculative per prompt, each pair appended to `path` (JSON lines) as it is done,
    so a long run that is stopped keeps every finished comparison and resumes after it."""
    done = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    for i, prompt in enumerate(prompts[len(done):], len(done)):
        pair = [(await run_plain(sessions, [prompt], n))[0], (await run_spec(sessions, [prompt], n, cost, draft))[0]]
        with path.open("a") as f:
            f.write(json.dumps(pair) + "\n")
        done.append(pair)
        same = "same" if pair[0]["tokens"] == pair[1]["tokens"] else "DIFFERS"
        print(f"pair {i + 1}/{len(prompts)} {prompt[0]}: {same}",
              file=sys.stderr, flush=True)
    return [a for a, _ in done], [b for _, b in done]


def interleaved(prompts: list) -> list:
    """chat, code, grounded, chat, ...: a run stopped early still covers every class."""
    by_kind: dict[str, list] = {}
    for p in prompts:
        by_kind.setdefault(p[0], []).append(p)
    return [p for group in zip(*by_kind.values()) for p in group]


def with_sessions(home: Path, dtype: str, swarm: bool, body: Callable[[Sessions], Awaitable],
                  exact: bool = False):
    """Run body(sessions) in one trio loop, sessions from an in-process model or a fresh swarm;
    exact: batch-invariant kernels everywhere (every peer must grant them)."""
    if not swarm:
        model, _ = open_local(home, None, dtype)

        async def local(max_len: int):
            return model.session(max_len, exact=exact)

        return trio.run(body, local)
    os.environ["DIFFUSE_TRAIN_DRAFT"] = "0"  # the peers it starts train no draft head behind the measurement
    from support.relayed_swarm import LoopbackSwarm
    from libp2p.crypto.ed25519 import create_new_key_pair

    from diffuse.client.swarm import SwarmClient, SwarmOptions
    from diffuse.control.node import NodeConfig, open_node
    from diffuse.home import DEFAULT_MODEL, models_dir
    from diffuse.model.load import parse_dtype

    with LoopbackSwarm(home, ["1:15", "15:30"], dtype) as net:
        async def remote():
            async with open_node(create_new_key_pair(),
                                 NodeConfig(listen=["/ip4/127.0.0.1/tcp/0"], bootstrap=[net.boot], server=False,
                                            swarm_key=net.swarm_key)) as node:
                options = SwarmOptions(dtype=parse_dtype(dtype), exact=exact, trust=None)
                client = SwarmClient(node, models_dir(home) / DEFAULT_MODEL, options)
                with trio.fail_after(120):
                    while not await client.covered():
                        await trio.sleep(0.25)
                return await body(client.session)

        return trio.run(remote)


def progress(result: dict, i: int, n: int) -> dict:
    print(f"  {i + 1}/{n}", file=sys.stderr, flush=True)
    return result


def divergences(plain: list[dict], spec: list[dict]) -> list[tuple[int, float]]:
    """(index, top-2 gap of the plain run there) of the first differing token per prompt."""
    found = []
    for p, s in zip(plain, spec):
        i = next((i for i, (x, y) in enumerate(zip(p["tokens"], s["tokens"])) if x != y), None)
        if i is not None:
            found.append((i, p["gaps"][i]))
    return found


def answer_steps(run: dict, eos: set[int]) -> list[tuple[int, int]]:
    """(tokens, positions) of the steps that started before the answer's first end-of-turn."""
    end = next((i for i, t in enumerate(run["tokens"]) if t in eos), len(run["tokens"]))
    steps, at = [], 1  # token 0 comes from the prefill
    for tokens, positions in zip(run["steps"], run["positions"]):
        if at >= end:
            break
        steps.append((tokens, positions))
        at += tokens
    return steps


def cost_at(costs: dict[int, float], t: int) -> float:
    """Measured seconds for t positions, linear between measured widths."""
    pts = sorted((int(k), v) for k, v in costs.items())
    for (t0, c0), (t1, c1) in zip(pts, pts[1:]):
        if t <= t1:
            return c0 + (c1 - c0) * (t - t0) / (t1 - t0)
    (t0, c0), (t1, c1) = pts[-2:]
    return c1 + (c1 - c0) * (t - t1) / (t1 - t0)


def report_speed(label: str, runs: list[dict], kinds: list[str], eos: set[int], costs, rtt: float) -> None:
    for kind in CLASSES:
        steps = [s for r, k in zip(runs, kinds) if k == kind for s in answer_steps(r, eos)]
        if not steps:
            continue
        tokens = sum(t for t, _ in steps)
        spec_s = sum(rtt + cost_at(costs, p) for _, p in steps)
        plain_tps = 1 / (rtt + cost_at(costs, 1))
        print(f"  {label:14s} {kind:9s} tokens/step {tokens / len(steps):.2f}  positions/step "
              f"{sum(p for _, p in steps) / len(steps):5.1f}  modelled {tokens / spec_s:5.1f} tok/s vs "
              f"plain {plain_tps:5.1f} = x{tokens / spec_s / plain_tps:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--home")
    ap.add_argument("--out", default="spec_eval")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--per-class", type=int, default=17)
    ap.add_argument("--bf16-per-class", type=int, default=4)
    ap.add_argument("--sweep-per-class", type=int, default=4)
    ap.add_argument("--costs", choices=["measure", "idle"], default="measure")
    ap.add_argument("--threads", type=int, default=1, help="1 on a shared box: threads that wait on "
                    "each other for small matmuls cost more than they save")
    ap.add_argument("--swarm", action="store_true", help="identity through a loopback swarm (phases 2-4)")
    ap.add_argument("--draft", action="store_true", help="speculate with the draft head too (diffuse model draft-head)")
    ap.add_argument("--exact", action="store_true", help="batch-invariant kernels (sessions opened exact): "
                    "the identity then holds by construction, not by the luck of near-ties")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the cleanup that ends the swarm
    if args.swarm:
        args.costs = "idle"  # plans must not depend on how busy the peers' box is
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    home = data_home(args.home)
    t_start = time.perf_counter()

    tok = Tokenizer.load(store.resolve(home, None))
    draft = None
    if args.draft:
        from diffuse.client import draft_head
        from diffuse.model.config import ModelConfig

        path = store.resolve(home, None)
        draft = draft_head.load(draft_head.path(home, path.name), ModelConfig.load(path).hidden_size)
        if draft is None:
            sys.exit("no draft head: run `diffuse model draft-head` first")
    eos = set(tok.eos_ids)
    prompts = interleaved(prompts_of(tok, args.per_class))
    kinds = [k for k, _ in prompts]
    sub = lambda per: [i for i, k in enumerate(kinds) if kinds[:i].count(k) < per]  # noqa: E731
    sweep = sub(args.sweep_per_class)
    tag = ("swarm_" if args.swarm else "") + ("draft_" if args.draft else "") + ("exact_" if args.exact else "")
    where = ("through a loopback swarm (2 peers, fp16 wire)" if args.swarm else "in process") + (
        ", exact kernels" if args.exact else "")

    async def fp32(sessions: Sessions):
        costs = IDLE_FP32 if args.costs == "idle" else await cached(out / "costs_fp32.json",
                                                                    lambda: measure_costs(sessions))
        plain, spec80 = await run_pairs(sessions, prompts, args.tokens, fit_cost(costs, 0.08),
                                        out / f"{tag}pairs_fp32_rtt80_{args.costs}.jsonl", draft)
        sweeps = {}
        for rtt in ((0.0, 0.02) if not args.swarm else ()):
            sweeps[rtt] = await cached(out / f"spec_fp32_rtt{int(rtt * 1e3)}_{args.costs}.json",
                                       lambda rtt=rtt: run_spec(sessions, [prompts[i] for i in sweep], args.tokens,
                                                                fit_cost(costs, rtt), draft))
        return costs, plain, spec80, sweeps

    costs, plain, spec80, sweeps = with_sessions(home, "fp32", args.swarm, fp32, args.exact)
    fit = fit_cost(costs, 0.0)
    print(f"fp32 step cost (ms) by positions: { {t: round(s * 1e3, 1) for t, s in costs.items()} }; "
          f"fit a={fit.a * 1e3:.1f} ms + b={fit.b * 1e3:.2f} ms/position")
    bad = divergences(plain, spec80)
    ties = sum(g < 0.01 for r in plain for g in r["gaps"][:args.tokens])
    print(f"\nfp32 identity {where}: {len(prompts)} prompts x {args.tokens} tokens: {len(bad)} prompts differ "
          f"{bad if bad else ''}; plain run had {ties} near-ties (top-2 gap < 0.01), smallest gap "
          f"{min(g for r in plain for g in r['gaps'][:args.tokens]):.2e}; "
          f"{sum(sum(r['steps']) - len(r['steps']) for r in spec80)} guessed tokens accepted in "
          f"{sum(len(r['steps']) for r in spec80)} verification steps")
    runs = {0.08: (spec80, kinds)}
    for rtt, res in sweeps.items():
        runs[rtt] = (res, [kinds[i] for i in sweep])
        bad += divergences([plain[i] for i in sweep], res)
    if sweeps:
        print(f"fp32 identity incl. RTT 0/20 plans: {len(prompts) + 2 * len(sweep)} runs, {len(bad)} differ")

    print("\naccepted tokens per step (answer only, up to the first end-of-turn), modelled speed:")
    for rtt, (res, ks) in sorted(runs.items()):
        report_speed(f"RTT {int(rtt * 1e3)} ms", res, ks, eos, costs, rtt)

    bprompts = [prompts[i] for i in sub(args.bf16_per_class)]

    async def bf16(sessions: Sessions):
        return await run_pairs(sessions, bprompts, args.tokens, fit_cost(costs, 0.08),
                               out / f"{tag}pairs_bf16_rtt80_{args.costs}.jsonl", draft)

    bplain, bspec = with_sessions(home, "bf16", args.swarm, bf16, args.exact)
    flips = divergences(bplain, bspec)
    bties = sum(g < 0.05 for r in bplain for g in r["gaps"][:args.tokens])
    print(f"\nbf16 {where}: {len(flips)} of {len(bprompts)} prompts diverge; (first differing token, top-2 "
          f"logit gap of plain there): {[(i, round(g, 4)) for i, g in flips]}; plain run had {bties} "
          f"tokens with a top-2 gap < 0.05")
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
