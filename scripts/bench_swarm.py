#!/usr/bin/env python
"""Greedy decoding through a loopback swarm (1, 2 and 3 hops) against the in-process engine, and
the time to recover from a SIGKILLed peer, from one run, in a private and a public swarm.

    .venv/bin/python scripts/bench_swarm.py [--tokens 64] [--repeats 3] [--kills 3] [--dtype bf16]
                                            [--mode private --mode public] [--trust mode|off]

Per swarm, a sentinel and seven `diffuse join` processes start on 127.0.0.1: one peer with every block
(1 hop), two with 15 each (2 hops), three with 10 each (3 hops), and a replica of the second
2-hop span. The client runs in this process with `local_blocks=(0, 0)`: it keeps embeddings,
final norm and LM head, and the hops run every block. Each path's sessions are routed only over
its own peers (chained: the route shape's default, auto), and the client checks them as `ask`
does in that swarm's mode (--trust mode, the default: private or public; --trust off measures
the data plane alone, bench_trust.py the trust plane's overhead). Repeats alternate the in-process
engine (same model, same dtype, same head) and the three paths, so machine noise hits all alike;
each cell is the median over repeats of decode tokens/s (first to last generated token; prefill
excluded). Greedy tokens must be identical on every path; the script says so.

Recovery: generations over the 2-hop peers plus the replica; after a chosen token the peer on
the route for the replicated span is SIGKILLed (and reaped), so the next step fails over: ban,
new route, replay of the committed inputs, retried step. Reported per kill: the time from the
peer's death to the next token minus a normal token interval, and the client's own failover
record. The killed peer restarts (same identity) before the next kill.

Modes: each --mode (default: both) gets a swarm of its own, up at the same time: private (a swarm
key made for the run: every connection also runs the private-network layer, XSalsa20 below
Noise) and public (no key). Repeats alternate the modes too, path by path, so the difference per
hop between them is the private-network layer's cost; kills alternate the same way. Decode
times move by more than that cost between repeats, so the layer is also timed alone: PING/PONG
round trips to the 1-hop peer on one stream, in batches alternating the modes.

Before/after the transport tuning: `GOMP_SPINCOUNT=300000 PY_YAMUX_RELEASE_ON_READ=1
DIFFUSE_QUICK_IO=0` (the libraries' defaults, and py-libp2p unpatched) in the environment undoes
what `diffuse` sets by default.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from contextlib import AsyncExitStack
from pathlib import Path

os.environ.setdefault("GOMP_SPINCOUNT", "10000")  # as `diffuse` sets it; before torch starts
os.environ["DIFFUSE_TRAIN_DRAFT"] = "0"  # the peers and APIs it starts train no draft head behind the measurement

import trio  # noqa: E402
from libp2p.crypto.ed25519 import create_new_key_pair  # noqa: E402

from diffuse.client.local import open_local  # noqa: E402
from diffuse.client.pipeline import Pipeline  # noqa: E402
from diffuse.client.swarm import SwarmClient, SwarmOptions  # noqa: E402
from diffuse.client.swarm_backend import trust_options  # noqa: E402
from diffuse.control.modes import MODES  # noqa: E402
from diffuse.control.node import NodeConfig, open_node  # noqa: E402
from diffuse.control.routing import Hop  # noqa: E402
from diffuse.data.client import RemoteSpan  # noqa: E402
from diffuse.data.codec import FrameDecoder, Ping, Pong, encode  # noqa: E402
from diffuse.home import data_home  # noqa: E402
from diffuse.model import store  # noqa: E402
from diffuse.model.load import parse_dtype  # noqa: E402
from diffuse.model.tokenizer import Tokenizer  # noqa: E402
from diffuse.trust import reputation  # noqa: E402
from diffuse.trust.checked import SessionChecks  # noqa: E402
from support.swarm import LOCAL, PATHS, PROMPT, REPLICA, Peers, decode, decode_tps  # noqa: E402

TARGETS = {"1 hop": 0.9, "3 hops": 0.75}
PING_BATCHES, PINGS_PER_BATCH = 10, 100
RECOVERY_TARGET_S = 1.5


class Side:
    """One mode's swarm as the benchmark drives it: its client node, and sessions routed only
    over the peers of one path."""

    def __init__(self, peers: Peers, client: SwarmClient) -> None:
        self.peers, self.client = peers, client
        self.everyone = set(peers.ids.values())
        self.spent = {"route": 0.0, "dial": 0.0}  # seconds, for the failover breakdown

    async def dial(self, hop):
        t0 = time.perf_counter()
        try:
            return await self.client.dial(hop)
        finally:
            self.spent["dial"] += time.perf_counter() - t0

    def remote(self, names: set[str], max_len: int) -> RemoteSpan:
        """A session over every block, routed only over these peers."""
        others = self.everyone - {self.peers.ids[m] for m in names}

        async def route(start: int, end: int, exclude: set[str]):
            t0 = time.perf_counter()
            try:
                return await self.client.route(start, end, exclude | others)
            finally:
                self.spent["route"] += time.perf_counter() - t0

        c = self.client
        checks = SessionChecks(c.guard) if c.guard is not None else None
        return RemoteSpan(c.model_id, 0, c.cfg.num_layers, self.dial, route, c.bans, max_len,
                          dtype=c.opts.wire_dtype, timeout=c.opts.step_timeout, checks=checks)

    def pipeline(self, span: RemoteSpan) -> Pipeline:
        """`span` behind the head, its checks (when the client checks) run behind the answer."""
        return Pipeline(self.client.head, [span], behind=span.checks if self.client.guard is not None else None)

    async def round_trips(self, name: str, n: int) -> list[float]:
        """Seconds of `n` PING/PONG round trips to peer `name` on one inference stream."""
        rec = next(r for r in await self.client.records() if r.peer_id == self.peers.ids[name])
        stream = await self.client.dial(Hop(rec.peer_id, tuple(rec.addrs), rec.start, rec.end))
        dec, times = FrameDecoder(), []
        try:
            for i in range(n):
                t0 = time.perf_counter()
                await stream.write(encode(Ping(i)))
                while not any(isinstance(m, Pong) for m in dec.feed(await stream.read(4096))):
                    pass
                times.append(time.perf_counter() - t0)
        finally:
            await stream.close()
        return times

    async def session(self, path: str, max_len: int) -> Pipeline:
        span = self.remote(set(PATHS[path]), max_len)
        await self.client.records()  # as SwarmClient.session does: fresh records for the route
        await span.open()
        return self.pipeline(span)


async def bench(args, home: Path, swarms: dict[str, Peers]) -> None:
    model_dir = store.resolve(home, None)
    dtype = parse_dtype(args.dtype)
    tok = Tokenizer.load(model_dir)
    prompt = tok.encode(PROMPT)
    max_len = len(prompt) + args.tokens
    local, _ = open_local(home, None, args.dtype)
    async with AsyncExitStack() as stack:
        sides: dict[str, Side] = {}
        for mode, peers in swarms.items():
            node = await stack.enter_async_context(open_node(create_new_key_pair(),
                                                             NodeConfig(listen=[LOCAL], bootstrap=[peers.boot],
                                                                        server=False, swarm_key=peers.swarm_key),
                                                             codecs=reputation.swarm_codecs()))
            trust = trust_options(mode if args.trust == "mode" else "off")
            side = sides[mode] = Side(peers, SwarmClient(node, model_dir, SwarmOptions(
                local_blocks=(0, 0), dtype=dtype, trust=trust)))
            with trio.fail_after(120):
                while not side.everyone <= {r.peer_id for r in await side.client.records()}:
                    await trio.sleep(0.5)

        cells = [("in-process", "")] + [(path, mode) for path in PATHS for mode in sides]
        tps: dict[tuple[str, str], list[float]] = {c: [] for c in cells}
        tokens: dict[tuple[str, str], set[tuple[int, ...]]] = {c: set() for c in cells}
        for rep in range(args.repeats + 1):  # round 0 warms caches, connections and RTTs
            for path, mode in cells:
                pipe = local.session(max_len) if not mode else await sides[mode].session(path, max_len)
                ids, stamps = await decode(pipe, prompt, args.tokens)
                tokens[path, mode].add(tuple(ids))
                if rep:
                    tps[path, mode].append(decode_tps(stamps))
            print(f"round {rep}{' (warm-up)' if not rep else ''}: " + ", ".join(
                f"{f'{path} {mode}'.strip()} {tps[path, mode][-1]:.1f}" for path, mode in cells if rep),
                file=sys.stderr, flush=True)

        pings: dict[str, list[float]] = {mode: [] for mode in sides}
        for _ in range(PING_BATCHES):
            for mode, side in sides.items():
                pings[mode] += await side.round_trips(next(iter(PATHS["1 hop"])), PINGS_PER_BATCH)

        recoveries = []
        group = set(PATHS["2 hops"]) | set(REPLICA)
        for k in range(args.kills):
            for mode, side in sides.items():
                recoveries.append(await recover(args, side, group, k, prompt, max_len, tokens["in-process", ""]))
                recoveries[-1]["mode"] = mode
                print(f"kill {k} ({mode}): {recoveries[-1]}", file=sys.stderr, flush=True)

    report(args, tps, tokens, pings, recoveries)


async def recover(args, side: Side, group: set[str], k: int, prompt: list[int], max_len: int, reference) -> dict:
    """Kill the peer on the route of the replicated span after a chosen token; time the recovery,
    then restart it and wait until routes read its fresh record."""
    peers, client = side.peers, side.client
    kill_at = args.tokens // 4 + k * args.tokens // (2 * max(1, args.kills))
    span = side.remote(group, max_len)
    await client.records()
    await span.open()
    victim = next(m for m in group if peers.ids[m] == span.route_taken[-1]["peer"])
    died: list[float] = []

    def on_token(i: int) -> None:
        if i == kill_at:
            peers.kill(victim)
            died.append(time.perf_counter())
            side.spent.update(route=0.0, dial=0.0)

    ids, stamps = await decode(side.pipeline(span), prompt, args.tokens, on_token)
    normal = statistics.median(b - a for a, b in zip(stamps, stamps[1:]))
    record = span.stats.failovers[0] if span.stats.failovers else {}
    result = {"kill_at": kill_at, "victim": victim, "same": tuple(ids) in reference,
              "gap_s": stamps[kill_at + 1] - died[0] - normal, "normal_s": normal,
              "client_s": record.get("recovery_s", float("nan")), "failovers": len(span.stats.failovers),
              **side.spent, "replayed": record.get("replayed_tokens", 0)}
    peers.start(victim)
    peers.wait(victim)
    client.bans.bans.clear()
    with trio.fail_after(120):  # its fresh record (new port) must be what routes read
        while peers.ids[victim] not in {r.peer_id for r in await client.records()}:
            await trio.sleep(0.5)
    return result


def report(args, tps: dict[tuple[str, str], list[float]], tokens: dict[tuple[str, str], set],
           pings: dict[str, list[float]], recoveries: list[dict]) -> None:
    base = statistics.median(tps["in-process", ""])
    load = os.getloadavg()
    print(f"\nSmolLM2-135M {args.dtype}, greedy decode of {args.tokens} tokens after a "
          f"{PROMPT!r} prompt, median of {args.repeats} alternated repeats; client keeps embeddings "
          f"and head, hops run all blocks; fp16 on the wire; trust plane {args.trust}")
    print(f"GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT')} "
          f"PY_YAMUX_RELEASE_ON_READ={os.environ.get('PY_YAMUX_RELEASE_ON_READ', '0 (diffuse default)')} "
          f"DIFFUSE_QUICK_IO={os.environ.get('DIFFUSE_QUICK_IO', '1 (diffuse default)')}")
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} cores\n")
    print("| path | mode | tokens/s | ratio | ms/token | overhead ms/token | per hop ms | target |")
    print("|---|---|---|---|---|---|---|---|")
    ms: dict[tuple[str, str], float] = {}
    for (path, mode), values in tps.items():
        t = statistics.median(values)
        ms[path, mode] = 1e3 / t
        hops = _hops(path)
        over = 1e3 / t - 1e3 / base
        target = TARGETS.get(path)
        mark = "" if target is None else f">= {target}x {'met' if t / base >= target else 'MISSED'}"
        print(f"| {path} | {mode or '-'} | {t:.1f} | {t / base:.2f}x | {1e3 / t:.2f} | "
              f"{over:.2f} | {over / hops if hops else 0:.2f} | {mark} |")
    modes = sorted({m for _, m in tps if m})
    if set(modes) == set(MODES):
        per_hop = {path: (ms[path, "private"] - ms[path, "public"]) / _hops(path) for path in PATHS}
        print("\nprivate-network layer (private - public), ms per token per hop: " + ", ".join(
            f"{path} {d:+.2f}" for path, d in per_hop.items()) + f"; median {statistics.median(per_hop.values()):+.2f}")
    rtt = {mode: statistics.median(times) * 1e3 for mode, times in pings.items()}
    print(f"\nround trip to the 1-hop peer (PING/PONG on one stream, median of {len(next(iter(pings.values())))} "
          "per mode, alternated): " + ", ".join(f"{mode} {ms:.3f} ms" for mode, ms in rtt.items()) +
          (f"; private-network layer {rtt['private'] - rtt['public']:+.3f} ms per hop" if len(rtt) == 2 else ""))
    same = all(v == tokens["in-process", ""] and len(v) == 1 for v in tokens.values())
    print(f"\ngreedy tokens identical on every path and mode: {'yes' if same else 'NO'}")
    if recoveries:
        print("\n| mode | kill after token | victim | recovery s (gap - normal) | client failover s | of which route s "
              "| dial s | replayed tokens | same answer |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in recoveries:
            print(f"| {r['mode']} | {r['kill_at']} | {r['victim']} | {r['gap_s']:.3f} | {r['client_s']:.3f} | "
                  f"{r['route']:.3f} | {r['dial']:.3f} | {r['replayed']} | "
                  f"{'yes' if r['same'] and r['failovers'] == 1 else 'NO'} |")
        worst = max(r["gap_s"] for r in recoveries)
        print(f"\nrecovery: median {statistics.median(r['gap_s'] for r in recoveries):.3f} s, worst "
              f"{worst:.3f} s (target < {RECOVERY_TARGET_S} s: {'met' if worst < RECOVERY_TARGET_S else 'MISSED'})")


def _hops(path: str) -> int:
    return int(path.split()[0]) if path != "in-process" else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--home", help="data directory (default: $DIFFUSE_HOME or ~/.diffuse)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"])
    ap.add_argument("--trust", default="mode", choices=["mode", "off"],
                    help="mode: the client checks as `ask` does in each swarm's mode (default); off: no checks")
    ap.add_argument("--mode", action="append", choices=MODES,
                    help="a swarm in this mode (repeatable; default: one private and one public, alternated)")
    args = ap.parse_args()
    if args.tokens < 8 or args.repeats < 1 or args.kills < 0:
        ap.error("need --tokens >= 8, --repeats >= 1, --kills >= 0")
    modes = list(dict.fromkeys(args.mode or MODES))
    logging.basicConfig(level=logging.ERROR)  # failovers are expected here; the table reports them
    home = data_home(args.home)
    with tempfile.TemporaryDirectory(prefix="bench-swarm-") as tmp:
        swarms = {mode: Peers(home, Path(tmp) / mode, args.dtype, mode=mode) for mode in modes}
        try:
            for mode, peers in swarms.items():
                print(f"starting a {mode} swarm: a sentinel and 7 peers...", file=sys.stderr, flush=True)
                peers.launch()
            trio.run(bench, args, home, swarms)
        finally:
            for peers in swarms.values():
                peers.stop()


if __name__ == "__main__":
    main()
