#!/usr/bin/env python
"""Several sessions at once through two peers, chain against star, with the client far away.

    sudo .venv/bin/python scripts/bench_pipeline.py [--rtt-ms 80] [--sessions 1 4] [--tokens 32] [--repeats 3]

The namespaces of scripts/support/wan.py (the peers', a WAN one with the user-space delaying
relay, the client's: every byte between the client and a peer crosses --rtt-ms of round trip,
bytes between the peers none) and `diffuse join` peers of SmolLM2-135M, blocks 1:15 pinned to
core 0 and 15:30 pinned to core 1 (taskset, one torch thread each: a machine of their own each):
P1 and P2, and G1 and G2 that gather no company for a batch (DIFFUSE_GATHER=0: every step is
computed as soon as its turn comes, with whatever has queued by then). A client process in the
client's namespace runs N greedy sessions at once, each its own prompt, over P1 and P2 as a star
(each hop's output comes back to the client) and as a chain (hops forward to each other), and
over G1 and G2 as a chain, the three alternated, --repeats times. Prints aggregate decode tokens/s
(every session's tokens after its first, over the time from the first session's first token to
the last token), the ratios to the star, and from the peers' batch traces (DIFFUSE_BATCH_TRACE,
scripts/support/batch_trace.py): the mean steps per forward pass, and the share of the second
peer's compute time during which the first computed too (on a chain: the two peers on different
sessions at once). Then whether star and chain gave the same answers at each session count, and
the first session's as alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS))

from support import batch_trace  # noqa: E402
from support.procs import Procs  # noqa: E402
from support.wan import BASE_PORT, PUBLIC, Wan, listen, start_relay  # noqa: E402

PEERS = {"P1": ("1:15", 0), "P2": ("15:30", 1), "G1": ("1:15", 0), "G2": ("15:30", 1)}  # name: (blocks, core)
NO_GATHER = ("G1", "G2")  # computing every step as soon as its turn comes (DIFFUSE_GATHER=0)
SHAPES = {"star": ("star", ("P1", "P2")), "chain": ("chain", ("P1", "P2")),
          "chain, no gathering": ("chain", NO_GATHER)}  # route shape, peers
QUESTIONS = ["Name three famous rivers and the countries they flow through.", "Write a haiku about rain.",
             "Explain in two sentences what a compiler does.", "Why is the sky blue?",
             "List the planets of the solar system in order.", "Say hello in French, Spanish and German.",
             "What is the capital of France?", "Describe a cat in one sentence."]


def start_swarm(procs: Procs, wan: Wan, tmp: Path, dtype: str) -> tuple[str, list[int], dict[str, str], dict]:
    """The sentinel and the pinned peers in the peers' namespace; (bootstrap, ports to relay, the
    peers' ids and batch traces by name)."""
    from diffuse.control.host import parse_peer_addr
    from diffuse.data.scheduler import GATHER_ENV, TRACE_ENV

    inside = wan.prefix("peers")
    sentinel = procs.start("sentinel", "--identity", str(tmp / "s.key"), *listen(BASE_PORT), "--mode", "private",
                           prefix=inside)
    boot = f"/ip4/{PUBLIC}/tcp/{BASE_PORT}/p2p/{parse_peer_addr(sentinel.readline(timeout=120)).peer_id.to_base58()}"
    peers = {}
    for i, (name, (blocks, core)) in enumerate(PEERS.items(), 1):
        env = {TRACE_ENV: str(tmp)} | ({GATHER_ENV: "0"} if name in NO_GATHER else {})
        peers[name] = procs.start("join", "--identity", str(tmp / f"{name}.key"), "--bootstrap", boot,
                                  *listen(BASE_PORT + i), "--blocks", blocks, "--dtype", dtype,
                                  "--mode", "private", prefix=(*inside, "taskset", "-c", str(core)),
                                  env=env)  # `ip netns exec` and taskset exec: the pid is the peer's
    ids = {name: parse_peer_addr(p.read_until("serving", timeout=600)[0]).peer_id.to_base58()
           for name, p in peers.items()}
    traces = {name: str(batch_trace.trace_file(tmp, p.p.pid)) for name, p in peers.items()}
    return boot, [BASE_PORT + i for i in range(len(PEERS) + 1)], ids, traces


async def one_round(client, tok, n: int, tokens: int, traces: list[Path]) -> dict:
    """`n` greedy sessions at once; aggregate decode tokens/s and every session's tokens."""
    import trio

    from diffuse.client.generate import Generation, session_length
    from diffuse.client.sampling import SamplingParams

    got: list[tuple[float, float, int, list[int]]] = [None] * n  # type: ignore[list-item]

    async def one(i: int) -> None:
        prompt = tok.encode_chat([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}])
        pipe = await client.session(session_length(len(prompt), tokens))
        gen = Generation(pipe, tok, prompt, SamplingParams(max_tokens=tokens))
        stamps = []
        try:
            async for _ in gen:
                stamps.append(time.perf_counter())
        finally:
            await pipe.close()
        got[i] = (stamps[0], stamps[-1], len(stamps), gen.completion.token_ids)

    offsets = [batch_trace.size(t) for t in traces]
    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(one, i)
    p1, p2 = (batch_trace.read(t, o) for t, o in zip(traces, offsets))  # the route's first and second peer
    wall = max(e for _, e, _, _ in got) - min(s for s, _, _, _ in got)
    return {"tps": sum(c - 1 for _, _, c, _ in got) / wall, "tokens": [t for *_, t in got],
            "per_pass": [batch_trace.steps_per_pass(p) for p in (p1, p2)],
            "overlap": batch_trace.overlap(p1, p2) / max(1e-9, batch_trace.busy(p2))}


def measure(args) -> None:
    """The client part, run inside a namespace: one JSON line per round, the shapes alternated."""
    import torch
    import trio
    from libp2p.crypto.ed25519 import create_new_key_pair

    from diffuse.client.swarm import SwarmClient, SwarmOptions
    from diffuse.control.node import NodeConfig, open_node
    from diffuse.control.swarm_key import read_key
    from diffuse.home import DEFAULT_MODEL, data_home, models_dir
    from diffuse.model.tokenizer import Tokenizer
    from diffuse.trust import reputation

    from support.routes import pin_route

    torch.set_num_threads(1)
    ids, traces = json.loads(args.ids), {name: Path(t) for name, t in json.loads(args.traces).items()}
    model_dir = models_dir(data_home()) / DEFAULT_MODEL
    tok = Tokenizer.load(model_dir)

    async def run() -> None:
        config = NodeConfig(listen=["/ip4/0.0.0.0/tcp/0"], bootstrap=[args.boot], server=False,
                            swarm_key=read_key(Path(os.environ["DIFFUSE_SWARM_KEY"])))
        async with open_node(create_new_key_pair(), config, codecs=reputation.swarm_codecs()) as node:
            clients = {}
            for label, (shape, names) in SHAPES.items():
                client = clients[label] = SwarmClient(node, model_dir, SwarmOptions(route=shape, trust=None))
                with trio.fail_after(120):
                    while not await client.covered():
                        await trio.sleep(0.25)
                pin_route(client, set(ids.values()), {ids[n] for n in names})
                await one_round(client, tok, 1, 4, [traces[n] for n in names])  # warm-up: routes, links
            for n in args.sessions:
                for rep in range(args.repeats):
                    for label in (list(SHAPES) if rep % 2 == 0 else list(SHAPES)[::-1]):
                        route = [traces[p] for p in SHAPES[label][1]]
                        row = await one_round(clients[label], tok, n, args.tokens, route)
                        print(json.dumps({"sessions": n, "shape": label} | row), flush=True)

    trio.run(run)


def client_run(procs: Procs, wan: Wan, where: str, boot: str, ids: dict, traces: dict, args) -> list[dict]:
    cmd = [*wan.prefix(where), sys.executable, str(Path(__file__).resolve()), "measure", "--boot", boot,
           "--tokens", str(args.tokens), "--repeats", str(args.repeats), "--ids", json.dumps(ids),
           "--traces", json.dumps(traces), "--sessions", *map(str, args.sessions)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=procs.env, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"the client in {where} failed:\n{done.stderr[-4000:]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def table(title: str, rows: list[dict], sessions: list[int]) -> None:
    def med(n: int, shape: str, key) -> float:
        got = [key(r) for r in rows if r["sessions"] == n and r["shape"] == shape]
        return statistics.median(got) if got else float("nan")

    labels = list(SHAPES)
    print(f"\n{title}")
    print("| sessions | " + " | ".join(f"{label} tok/s" for label in labels) + " | chain / star "
          "| chain without gathering / star | steps per pass (peer 1 / 2): " + " / ".join(labels)
          + " | peer 2's compute while peer 1 computed: " + " / ".join(labels) + " |")
    print("|---" * (3 + len(labels)) + "|---|---|")
    for n in sessions:
        tps = {label: med(n, label, lambda r: r["tps"]) for label in labels}
        per = "; ".join(" / ".join(f"{med(n, label, lambda r, i=i: r['per_pass'][i]):.2f}" for i in range(2))
                        for label in labels)
        both = " / ".join(f"{med(n, label, lambda r: r['overlap']):.0%}" for label in labels)
        print(f"| {n} | " + " | ".join(f"{tps[label]:.2f}" for label in labels)
              + f" | {tps['chain'] / tps['star']:.2f}x | {tps['chain, no gathering'] / tps['star']:.2f}x "
              f"| {per} | {both} |")
    for n in sessions:
        answers = {label: {json.dumps(r["tokens"]) for r in rows if r["sessions"] == n and r["shape"] == label}
                   for label in labels}
        alone = {json.dumps(r["tokens"][0]) for r in rows if r["sessions"] == 1}
        firsts = {json.dumps(r["tokens"][0]) for r in rows if r["sessions"] == n}
        print(f"{n} sessions: distinct answer sets " + ", ".join(f"{label} {len(a)}" for label, a in answers.items())
              + f"; star's = chain's: {answers['star'] == answers['chain']}; the first session as alone: "
              f"{firsts <= alone}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("part", nargs="?", default="bench", choices=["bench", "measure"])
    ap.add_argument("--rtt-ms", type=float, default=80.0)
    ap.add_argument("--sessions", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--loopback", action="store_true", help="also with the client in the peers' namespace (0 ms)")
    ap.add_argument("--boot", help=argparse.SUPPRESS)
    ap.add_argument("--ids", help=argparse.SUPPRESS)
    ap.add_argument("--traces", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.part == "measure":
        measure(args)
        return 0
    if os.geteuid() != 0:
        print("bench_pipeline needs root for network namespaces", file=sys.stderr)
        return 2
    from diffuse.home import data_home

    wan, relay = Wan(f"q{os.getpid() % 100}"), None
    with tempfile.TemporaryDirectory() as tmp, Procs(data_home()) as procs:  # one torch thread per process
        procs.env["DIFFUSE_TRAIN_DRAFT"] = "0"  # idle peers would train a draft head beside the runs
        try:
            wan.build()
            boot, ports, ids, traces = start_swarm(procs, wan, Path(tmp), args.dtype)
            relay = start_relay(wan, ports, args.rtt_ms)
            when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
            print(f"{when}: {os.cpu_count()} cores (shared), {args.dtype} peers pinned a core each, SmolLM2-135M, "
                  f"{args.tokens} tokens per session, median of {args.repeats}, trust off, "
                  f"load {os.getloadavg()[0]:.1f}")
            table(f"client {args.rtt_ms:g} ms from the peers (relay), peers direct to each other",
                  client_run(procs, wan, "client", boot, ids, traces, args), args.sessions)
            if args.loopback:
                table("loopback: the client in the peers' namespace (0 ms)",
                      client_run(procs, wan, "peers", boot, ids, traces, args), args.sessions)
        finally:
            wan.close(procs, relay)
    return 0


if __name__ == "__main__":
    sys.exit(main())
