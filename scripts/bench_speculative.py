#!/usr/bin/env python
"""Speculative vs plain decoding through a real swarm behind an emulated wide-area link.

    .venv/bin/python scripts/bench_speculative.py [--home DIR] [--rtts 0 20 80] [--per-class 3]
        [--tokens 96] [--dtypes bf16 fp32] [--spans 1:30] [--modes spec draft] [--exact] [--repeats 1]
        [--trust private]

A sentinel and `diffuse join` peers run as processes on 127.0.0.1; each peer listens on a port
picked here and announces the port of scripts/latency_relay.py in front of it, so every byte the
client exchanges with a peer crosses the relay (checked: the client's connection to each hop
must end at a relay port). The client runs in this process (block 0 local, as by default). For
each dtype and RTT, the same prompts (chat, code, grounded) run plain (`ask --no-speculate`) and
with `ask`'s default speculation, in alternating order: `spec` guesses by prompt lookup and the
lookahead pool, `draft` adds a draft head the client fetched from the peer (draft_fetch.py, into
an empty store; the head of `diffuse model draft-head`, trained on requests and text of its own,
never on these prompts). Every answer is a fresh `ask`: its own speculation state and cost fit.
The client's trust plane is `ask`'s in this private swarm (--trust private: its canaries vet each
peer during the warm-up, and the sessions it audits are checked behind the answer); --trust off
measures speculation alone.
Peers take all cores (`diffuse join`'s default) and so does the client (--threads): they compute
in turn, as on machines of their own, and idle OpenMP threads spin only briefly (GOMP_SPINCOUNT).

Reported per dtype, RTT, class and mode: tokens per round trip (decode steps after the prefill;
plain is 1), positions per round trip, the share of steps the planner sent as trees / kept plain /
held plain (speculation not paying, as measured), decode tokens/s and the speed-up over plain;
then the mixed tokens per round trip over only the answers equal to plain's (a fast-kernel answer
that flipped a near-tie can fall into a loop that every guess predicts). Per prompt: each mode's
median decode tokens/s over `--repeats` askings (the order of the modes alternating from one to
the next), their ratio and the share of steps held, so that no answer hides behind its class.
The model tokens/s = tokens_per_step / (RTT + c) is fitted per mode (c = fixed time per step:
compute, transfer and client work, one least-squares constant over every cell) and its
prediction error printed per cell.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("GOMP_SPINCOUNT", "10000")
os.environ["DIFFUSE_TRAIN_DRAFT"] = "0"  # the peers it starts train no draft head behind the measurement

import torch  # noqa: E402
import trio  # noqa: E402
from libp2p.crypto.ed25519 import create_new_key_pair  # noqa: E402

from diffuse.client import draft_head  # noqa: E402
from diffuse.client.generate import Generation, session_length  # noqa: E402
from diffuse.client.sampling import SamplingParams  # noqa: E402
from diffuse.client.speculative import HELD, PLAIN, TREE, SpecConfig, SpecState  # noqa: E402
from diffuse.client.swarm import SwarmClient, SwarmOptions  # noqa: E402
from diffuse.client.swarm_backend import trust_options  # noqa: E402
from diffuse.control.node import NodeConfig, open_node  # noqa: E402
from diffuse.home import DEFAULT_MODEL, data_home, models_dir  # noqa: E402
from diffuse.model.load import parse_dtype  # noqa: E402
from diffuse.model.tokenizer import Tokenizer  # noqa: E402
from diffuse.trust import reputation  # noqa: E402
from support.relayed_swarm import LoopbackSwarm  # noqa: E402
from support.swarm import LOCAL  # noqa: E402


async def run_one(client: SwarmClient, swarm: LoopbackSwarm, tok: Tokenizer, prompt: list[int],
                  params: SamplingParams, spec: SpecConfig | None, exact: bool = False) -> dict:
    pipe = await client.session(session_length(len(prompt), params.max_tokens, spec), exact=exact)
    try:
        swarm.check_relayed(pipe)
        gen = Generation(pipe, tok, prompt, params, speculate=spec, state=SpecState() if spec else None)
        async for _ in gen:
            pass
    finally:
        await pipe.close()
    c = gen.completion
    forward_s = sum(gen.state.stats.seconds) if gen.state else None
    return {"tokens": c.token_ids, "steps": c.steps, "positions": c.positions, "modes": c.modes,
            "decode_s": c.timings["decode_s"], "forward_s": forward_s}


def cell(runs: list[dict]) -> dict:
    steps = [s for r in runs for s in r["steps"]]
    modes = [m for r in runs for m in r["modes"]]
    decoded = sum(len(r["tokens"]) - 1 for r in runs)
    decode_s = sum(r["decode_s"] for r in runs)
    return {"tps": decoded / decode_s, "per_step": sum(steps) / len(steps), "step_s": decode_s / len(steps),
            "positions": sum(p for r in runs for p in r["positions"]) / len(steps), "n_steps": len(steps),
            "modes": {m: modes.count(m) / len(modes) for m in (TREE, PLAIN, HELD)}}


async def fetched_draft(node, client: SwarmClient, home: Path):
    """The draft head as a new user gets it: fetched from a peer into an empty store."""
    from diffuse.client.draft_fetch import obtain_draft_head

    with trio.fail_after(120):
        while True:
            draft = await obtain_draft_head(node, await node.records(client.model_id), home, client.model_dir)
            if draft is not None:
                return draft
            await trio.sleep(1)


def bench_dtype(args, home: Path, dtype: str, tok: Tokenizer, prompts: list, modes: list[str]) -> dict:
    spec_modes = modes[1:]
    params = SamplingParams(max_tokens=args.tokens)
    results: dict[tuple[float, str, str], list[dict]] = {}
    per_prompt: dict[tuple[float, int, str], list[dict]] = {}
    mismatches = 0
    with LoopbackSwarm(home, args.spans, dtype) as swarm:
        async def bench() -> None:
            nonlocal mismatches
            config = NodeConfig(listen=[LOCAL], bootstrap=[swarm.boot], server=False, swarm_key=swarm.swarm_key)
            async with open_node(create_new_key_pair(), config, codecs=reputation.swarm_codecs()) as node:
                model_dir = models_dir(home) / DEFAULT_MODEL
                options = SwarmOptions(dtype=parse_dtype(dtype), trust=trust_options(args.trust))
                client = SwarmClient(node, model_dir, options)
                while not await client.covered():
                    await trio.sleep(0.25)
                draft = None
                if "draft" in modes:
                    with tempfile.TemporaryDirectory(prefix="diffuse-client-") as empty:
                        draft = await fetched_draft(node, client, Path(empty))
                for rtt_ms in args.rtts:
                    swarm.relay.set_rtt(rtt_ms / 1e3)
                    configs = {"plain": None, "spec": SpecConfig(), "draft": SpecConfig(draft=draft)}
                    configs = {m: configs[m] for m in modes}
                    await run_one(client, swarm, tok, prompts[0][1], SamplingParams(max_tokens=4), None)  # warm-up
                    for i, (kind, prompt) in enumerate(prompts):
                        for r in range(args.repeats):
                            order = list(configs) if (i + r) % 2 == 0 else list(configs)[::-1]
                            got = {}
                            for mode in order:
                                got[mode] = await run_one(client, swarm, tok, prompt, params, configs[mode],
                                                          args.exact and mode != "plain")
                                results.setdefault((rtt_ms, kind, mode), []).append(got[mode])
                                per_prompt.setdefault((rtt_ms, i, mode), []).append(got[mode])
                            for m in spec_modes:
                                got[m]["same"] = got[m]["tokens"] == got["plain"]["tokens"]
                            mismatches += sum(not got[m]["same"] for m in spec_modes)
                        print(f"  {dtype} rtt {rtt_ms:g} ms {kind} {i + 1}/{len(prompts)}", file=sys.stderr,
                              flush=True)

        trio.run(bench)
    return {"results": results, "per_prompt": per_prompt, "mismatches": mismatches}


def report(args, dtype: str, results: dict, mismatches: int, prompts: list, modes: list[str]) -> None:
    from support.prompts import CLASSES

    spec_modes = modes[1:]
    kinds = list(CLASSES) + ["mixed"]
    table = {key: cell(runs) for key, runs in results.items()}
    for rtt in args.rtts:
        for mode in modes:
            table[(rtt, "mixed", mode)] = cell([r for k in CLASSES for r in results[(rtt, k, mode)]])
    # Fit c per mode: step seconds = RTT + c, least squares over the per-class cells (weighted by steps).
    fixed = {}
    for mode in modes:
        cells = [(rtt, table[(rtt, k, mode)]) for rtt in args.rtts for k in CLASSES]
        steps = sum(c["n_steps"] for _, c in cells)
        fixed[mode] = sum(c["n_steps"] * (c["step_s"] - rtt / 1e3) for rtt, c in cells) / steps

    print(f"\nSmolLM2-135M {dtype}, peers {args.spans} behind the relay, client holds block 0, "
          f"{'exact kernels when speculating' if args.exact else 'fast kernels'}, "
          f"trust {args.trust}, client threads {args.threads}, {args.per_class} prompts/class, "
          f"up to {args.tokens} tokens, greedy; "
          f"load {os.getloadavg()}")
    print("fitted fixed time per step: " + ", ".join(f"{m} {fixed[m] * 1e3:.1f} ms" for m in modes))
    print("| RTT ms | class | mode | tokens/step | positions/step | steps tree/plain/held | tok/s plain | tok/s "
          "| speed-up | model tok/s plain (err) | model tok/s (err) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    errors = []
    for rtt in args.rtts:
        for kind in kinds:
            p = table[(rtt, kind, "plain")]
            model = {m: table[(rtt, kind, m)]["per_step"] / (rtt / 1e3 + fixed[m]) for m in modes}
            err = {m: model[m] / table[(rtt, kind, m)]["tps"] - 1 for m in model}
            if kind != "mixed":
                errors += [abs(e) for e in err.values()]
            for m in spec_modes:
                s = table[(rtt, kind, m)]
                shares = "/".join(f"{s['modes'][x]:.0%}" for x in (TREE, PLAIN, HELD))
                print(f"| {rtt:g} | {kind} | {m} | {s['per_step']:.2f} | {s['positions']:.1f} | {shares} "
                      f"| {p['tps']:.1f} | {s['tps']:.1f} | {s['tps'] / p['tps']:.2f}x "
                      f"| {model['plain']:.1f} ({err['plain']:+.0%}) | {model[m]:.1f} ({err[m]:+.0%}) |")
    print(f"\nmodel prediction error over per-class cells: mean {statistics.mean(errors):.1%}, max {max(errors):.1%}")
    for rtt in args.rtts:
        for m in spec_modes:
            same = [r for k in CLASSES for r in results[(rtt, k, m)] if r["same"]]
            if same:
                print(f"{rtt:g} ms, {m}: {cell(same)['per_step']:.2f} tokens/step over the {len(same)} answers "
                      f"equal to plain's")
    print(f"greedy answers differing from plain: {mismatches} of "
          f"{len(prompts) * len(args.rtts) * len(spec_modes) * args.repeats}"
          + ("" if args.exact else " (fast kernels: near-ties may flip; scripts/eval_speculative_identity.py "
                                   "shows each one's top-2 gap)"))


def tps(run: dict) -> float:
    return (len(run["tokens"]) - 1) / run["decode_s"]


def report_prompts(args, per_prompt: dict, prompts: list, modes: list[str]) -> None:
    """Per prompt and RTT: median tokens/s per mode over the repeats, the ratio to plain's, the
    steps held or kept plain, and the client's time outside the forward passes per step."""
    from support.prompts import CLASSES

    texts = [t for ts in CLASSES.values() for t in ts[:args.per_class]]
    print(f"\nper prompt, median of {args.repeats} alternated repeats (fresh speculation state each):")
    print("| RTT ms | prompt | mode | tok/s plain | tok/s | ratio | tokens/step | steps tree/plain/held "
          "| client ms/step |")
    print("|---|---|---|---|---|---|---|---|---|")
    for rtt in args.rtts:
        worst = {}
        for i, (kind, _prompt) in enumerate(prompts):
            plain = statistics.median(tps(r) for r in per_prompt[(rtt, i, "plain")])
            words = texts[i][:32]
            for m in modes[1:]:
                runs = per_prompt[(rtt, i, m)]
                c = cell(runs)
                spec = statistics.median(tps(r) for r in runs)
                client = (sum(r["decode_s"] - r["forward_s"] for r in runs) / c["n_steps"]) * 1e3
                shares = "/".join(f"{c['modes'][x]:.0%}" for x in (TREE, PLAIN, HELD))
                worst[m] = min(worst.get(m, 9.0), spec / plain)
                print(f"| {rtt:g} | {kind} {i}: {words} | {m} | {plain:.1f} | {spec:.1f} | {spec / plain:.2f}x "
                      f"| {c['per_step']:.2f} | {shares} | {client:.1f} |")
        print(f"| {rtt:g} | lowest | " + ", ".join(f"{m} {w:.2f}x" for m, w in worst.items()) + " | | | | | | |")


def main() -> None:
    from support.prompts import CLASSES

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--home")
    ap.add_argument("--trust", default="private", choices=["public", "private", "off"],
                    help="the client's trust plane (default: private, as `ask` in this private swarm)")
    ap.add_argument("--rtts", type=float, nargs="+", default=[0, 20, 80], help="round trips in ms")
    ap.add_argument("--per-class", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=["fp32", "bf16"])
    ap.add_argument("--spans", nargs="+", default=["1:30"], help="one peer per span")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="torch threads of the client (default: all cores). Peers take all cores, as "
                         "`diffuse join` does; client and peers compute in turn, as on machines of their own")
    ap.add_argument("--modes", nargs="+", default=["spec", "draft"], choices=["spec", "draft"],
                    help="speculative modes against plain: spec (prompt lookup + lookahead), draft (+ a fetched "
                         "draft head)")
    ap.add_argument("--repeats", type=int, default=1, help="askings of each prompt per mode, the modes' order "
                    "alternating; per-prompt figures are their medians")
    ap.add_argument("--exact", action="store_true", help="speculative sessions use exact (batch-invariant) "
                    "kernels, as `ask --exact` does; plain keeps the fast ones, the baseline to beat")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the cleanup that ends the swarm
    torch.set_num_threads(args.threads)
    home = data_home(args.home)
    model_dir = models_dir(home) / DEFAULT_MODEL
    tok = Tokenizer.load(model_dir)
    if "draft" in args.modes and not draft_head.path(home, DEFAULT_MODEL).exists():
        sys.exit("no draft head for the peer to serve: run `diffuse model draft-head` first, or pass --modes spec")
    modes = ["plain"] + list(dict.fromkeys(args.modes))
    prompts = [(kind, tok.encode_chat([{"role": "user", "content": t}]))
               for kind, texts in CLASSES.items() for t in texts[:args.per_class]]
    t_start = time.perf_counter()
    runs = {dtype: bench_dtype(args, home, dtype, tok, prompts, modes) for dtype in args.dtypes}
    for dtype, run in runs.items():
        report(args, dtype, run["results"], run["mismatches"], prompts, modes)
        report_prompts(args, run["per_prompt"], prompts, modes)
    print(f"total {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
