#!/usr/bin/env python
"""Chain against star routes with the client far from peers that are near each other.

    sudo .venv/bin/python scripts/bench_wan.py [--rtt-ms 80] [--tokens 32] [--repeats 2] [--trust private off]

Three network namespaces: the peers' (a sentinel and `diffuse join` peers for routes of 1, 2, 3
and 4 peers over SmolLM2-135M, all at 10.98.0.1, so they reach each other directly), the client's,
and between them a WAN namespace whose only way through is a user-space delaying TCP relay
(scripts/latency_relay.py: this kernel has no netem) listening at the peers' announced address:
every byte between the client and any peer crosses --rtt-ms of round trip, peer-to-peer bytes
none. Then, for each route length, a client process in the client's namespace decodes one greedy
answer per shape (star: each hop's output comes back to the client; chain: hops forward to each
other, protocol 1.2), plainly and speculating, alternating shapes, and the same from the peers'
own namespace (0 ms: loopback). Prints tokens/s (decode, after the first token; the median of
--repeats), chain / star, and n peers / 1 peer, all measured in this one run, for each --trust
form in turn: by default "private", what `ask` checks with in this swarm (--mode private: canaries
and spot checks, unpublished); "off" and "public" on request, each in tables of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS))

from support.procs import Procs  # noqa: E402
from support.wan import BASE_PORT, PUBLIC, Wan, listen, start_relay  # noqa: E402

SPANS = {1: {"A1": "1:30"}, 2: {"B1": "1:15", "B2": "15:30"}, 3: {"C1": "1:10", "C2": "10:20", "C3": "20:30"},
         4: {"D1": "1:8", "D2": "8:15", "D3": "15:23", "D4": "23:30"}}
QUESTION = "Name three famous rivers and the countries they flow through."


def start_swarm(procs: Procs, wan: Wan, tmp: Path, dtype: str) -> tuple[str, dict[str, str], list[int]]:
    """The sentinel and every peer of SPANS in the peers' namespace; (bootstrap, ids, ports)."""
    from diffuse.control.host import parse_peer_addr

    inside = wan.prefix("peers")
    mode = ["--mode", "private"]  # and the default heartbeat: at 2 s ten idle peers took a core
    sentinel = procs.start("sentinel", "--identity", str(tmp / "s.key"), *listen(BASE_PORT), "--mode", "private",
                           prefix=inside)
    line = sentinel.readline(timeout=120)
    boot = f"/ip4/{PUBLIC}/tcp/{BASE_PORT}/p2p/{parse_peer_addr(line).peer_id.to_base58()}"
    names = [n for spans in SPANS.values() for n in spans]
    spans = {n: s for group in SPANS.values() for n, s in group.items()}
    peers = {}
    for i, name in enumerate(names, 1):
        peers[name] = procs.start("join", "--identity", str(tmp / f"{name}.key"), "--bootstrap", boot,
                                  *listen(BASE_PORT + i), "--blocks", spans[name], "--dtype", dtype, *mode,
                                  prefix=inside)
    ids = {}
    for name, proc in peers.items():
        ids[name] = parse_peer_addr(proc.read_until("serving", timeout=600)[0]).peer_id.to_base58()
    return boot, ids, [BASE_PORT + i for i in range(len(names) + 1)]


async def one_answer(node, model_dir, tok, prompt, ids, n: int, spec: bool, shape: str, args) -> dict:
    """One greedy answer over the route of `n` peers in `shape`; its decode tokens/s and report."""
    import trio

    from support.routes import pin_route
    from diffuse.client.generate import Generation, session_length
    from diffuse.client.sampling import SamplingParams
    from diffuse.client.speculative import SpecConfig
    from diffuse.client.swarm import SwarmClient, SwarmOptions, remote_of
    from diffuse.client.swarm_backend import trust_options

    client = SwarmClient(node, model_dir, SwarmOptions(route=shape, trust=trust_options(args.trust[0])))
    with trio.fail_after(120):
        while not await client.covered():
            await trio.sleep(0.25)
    pin_route(client, set(ids.values()), {ids[p] for p in SPANS[n]})
    spec_cfg = SpecConfig() if spec else None
    pipe = await client.session(session_length(len(prompt), args.tokens, spec_cfg))
    gen = Generation(pipe, tok, prompt, SamplingParams(max_tokens=args.tokens), speculate=spec_cfg)
    stamps = []
    async for _ in gen:
        stamps.append(time.perf_counter())
    remote = remote_of(pipe)
    await pipe.close()
    return {"peers": n, "spec": spec, "shape": shape, "tokens": gen.completion.token_ids,
            "tps": (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else 0.0,
            "route": [h["output"] for h in remote.route_taken], "failovers": len(remote.stats.failovers),
            "client_bytes_sent": remote.stats.bytes_sent, **spec_modes(gen.state)}


def spec_modes(state) -> dict:
    """How a speculating answer's steps went: tokens per step and the share of each step mode."""
    if state is None or not state.stats.steps:
        return {}
    modes = state.stats.modes
    return {"tokens_per_step": state.stats.tokens_per_step,
            "modes": {m: modes.count(m) / len(modes) for m in sorted(set(modes))}}


def measure(args) -> None:
    """The client part, run inside a namespace: one JSON line per answer, the shapes alternated."""
    import torch
    import trio
    from libp2p.crypto.ed25519 import create_new_key_pair

    from diffuse.control.node import NodeConfig, open_node
    from diffuse.control.swarm_key import read_key
    from diffuse.home import DEFAULT_MODEL, data_home, models_dir
    from diffuse.model.tokenizer import Tokenizer
    from diffuse.trust import reputation

    ids = json.loads(args.ids)
    torch.set_num_threads(1)
    model_dir = models_dir(data_home()) / DEFAULT_MODEL
    tok = Tokenizer.load(model_dir)
    prompt = tok.encode_chat([{"role": "user", "content": QUESTION}])

    async def run() -> None:
        config = NodeConfig(listen=["/ip4/0.0.0.0/tcp/0"], bootstrap=[args.boot], server=False,
                            swarm_key=read_key(Path(os.environ["DIFFUSE_SWARM_KEY"])))
        async with open_node(create_new_key_pair(), config, codecs=reputation.swarm_codecs()) as node:
            for n in args.peers:
                for spec in (False, True):
                    for rep in range(args.repeats):
                        for shape in (("star", "chain") if rep % 2 == 0 else ("chain", "star")):
                            row = await one_answer(node, model_dir, tok, prompt, ids, n, spec, shape, args)
                            print(json.dumps(row), flush=True)

    trio.run(run)


def client_run(procs: Procs, wan: Wan, where: str, boot: str, ids: dict, args, trust: str) -> list[dict]:
    cmd = [*wan.prefix(where), sys.executable, str(Path(__file__).resolve()), "measure", "--boot", boot,
           "--ids", json.dumps(ids), "--tokens", str(args.tokens), "--repeats", str(args.repeats),
           "--trust", trust, "--peers", *map(str, args.peers)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=procs.env, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"the client in {where} failed:\n{done.stderr[-4000:]}")
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if args.raw:
        with open(args.raw, "a") as f:
            f.writelines(json.dumps({"where": where, "trust": trust} | r) + "\n" for r in rows)
    return rows


def table(title: str, rows: list[dict], peers: list[int]) -> None:
    def tps(n: int, spec: bool, shape: str) -> float:
        got = [r["tps"] for r in rows if r["peers"] == n and r["spec"] == spec and r["shape"] == shape]
        return statistics.median(got) if got else float("nan")

    def one_peer(spec: bool) -> float:  # a 1-peer route is the same path in both shapes: all its answers
        return statistics.median([r["tps"] for r in rows if r["peers"] == 1 and r["spec"] == spec] or [float("nan")])

    print(f"\n{title}")
    print("| peers | decoding | star tok/s | chain tok/s | chain / star | star / 1 peer | chain / 1 peer |")
    print("|---|---|---|---|---|---|---|")
    for spec in (False, True):
        for n in peers:
            s, c = tps(n, spec, "star"), tps(n, spec, "chain")
            print(f"| {n} | {'speculating' if spec else 'plain'} | {s:.2f} | {c:.2f} | {c / s:.2f}x | "
                  f"{s / one_peer(spec):.2f}x | {c / one_peer(spec):.2f}x |")
    for n in peers:
        for shape in ("star", "chain"):
            spec = [r for r in rows if r["peers"] == n and r["spec"] and r["shape"] == shape and "modes" in r]
            if spec:
                names = {m for r in spec for m in r["modes"]}
                modes = {m: statistics.mean(r["modes"].get(m, 0.0) for r in spec) for m in names}
                print(f"speculating, {n} peers, {shape}: "
                      f"{statistics.mean(r['tokens_per_step'] for r in spec):.2f} tokens/step, steps "
                      + ", ".join(f"{m} {v:.0%}" for m, v in sorted(modes.items())))
    same = all(a["tokens"] == b["tokens"] for a in rows for b in rows
               if a["peers"] == b["peers"] and a["spec"] == b["spec"] and not a["spec"])
    sent = {shape: statistics.median([r["client_bytes_sent"] for r in rows if r["shape"] == shape and r["peers"] == 3]
                                     or [0]) for shape in ("star", "chain")}
    print(f"plain answers identical across shapes: {same}; failovers: {sum(r['failovers'] for r in rows)}; "
          f"client bytes sent per answer at 3 peers: star {sent['star']}, chain {sent['chain']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("part", nargs="?", default="bench", choices=["bench", "measure"])
    ap.add_argument("--rtt-ms", type=float, default=80.0)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--peers", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--trust", nargs="+", default=["private"], choices=["public", "private", "off"],
                    help="the client's trust plane, one run each (default: private, as `ask` in this private swarm)")
    ap.add_argument("--no-loopback", dest="loopback", action="store_false")
    ap.add_argument("--raw", help="append every answer's figures to this file (JSON lines)")
    ap.add_argument("--boot", help=argparse.SUPPRESS)
    ap.add_argument("--ids", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.part == "measure":
        measure(args)
        return 0
    if os.geteuid() != 0:
        print("bench_wan needs root for network namespaces", file=sys.stderr)
        return 2
    import tempfile

    from diffuse.home import data_home

    wan = Wan(str(os.getpid() % 1000))
    relay = None
    with tempfile.TemporaryDirectory() as tmp, Procs(data_home(), one_thread=False) as procs:
        procs.env["DIFFUSE_TRAIN_DRAFT"] = "0"  # idle peers would train a draft head beside the runs
        try:
            wan.build()
            boot, ids, ports = start_swarm(procs, wan, Path(tmp), args.dtype)
            relay = start_relay(wan, ports, args.rtt_ms)
            when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
            print(f"{when}: {os.cpu_count()} cores (shared), {args.dtype} peers, SmolLM2-135M, {args.tokens} tokens, "
                  f"median of {args.repeats}")
            for trust in args.trust:
                table(f"trust {trust}: client {args.rtt_ms:g} ms from the peers (relay), peers direct to each other",
                      client_run(procs, wan, "client", boot, ids, args, trust), args.peers)
                if args.loopback:
                    table(f"trust {trust}: loopback, the client in the peers' namespace (0 ms)",
                          client_run(procs, wan, "peers", boot, ids, args, trust), args.peers)
        finally:
            wan.close(procs, relay)
    return 0


if __name__ == "__main__":
    sys.exit(main())
