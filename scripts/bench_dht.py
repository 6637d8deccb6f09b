#!/usr/bin/env python
"""Control-plane scaling on loopback: N peers announce blocks of a 30-block model; how long does
a fresh client take to learn full coverage, and how many bytes does announcing cost a peer? And
under a flood (--hostile): 20 honest peers plus 1,000 valid records from throwaway keys that
claim real spans with the manifest's hashes and dialable addresses (a TCP tarpit: it accepts and
never answers), so only contacting a peer tells it apart; how long, and how many bytes, until a
fresh client (SwarmClient: DHT read, then pings in order of DHT support) has a route through
peers that answer, against the same swarm without the flood.

All nodes (one sentinel, N peers, the client) run in this process, each with its own libp2p host
on 127.0.0.1, talking over real TCP sockets with Noise + yamux. One process makes byte accounting
exact: every byte any node writes to a socket is counted (Noise and yamux framing, multistream
negotiation, both directions). Peers' heartbeats are disabled during measurement, so a counter
delta is the cost of exactly the operation measured.

    python scripts/bench_dht.py                 # N = 10, 25, 50
    python scripts/bench_dht.py --peers 10 --json
    python scripts/bench_dht.py --hostile 1000  # the flood, against no flood, in one run
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from libp2p.crypto.ed25519 import create_new_key_pair  # noqa: E402
from libp2p.io.trio import TrioTCPStream  # noqa: E402

from diffuse.client.swarm import SwarmClient, SwarmOptions  # noqa: E402
from diffuse.control.announce import Serving  # noqa: E402
from diffuse.control.dht import put_set  # noqa: E402
from diffuse.control.identity import peer_id  # noqa: E402
from diffuse.control.node import Node, NodeConfig  # noqa: E402
from diffuse.control.records import PeerRecord, blocks_key, encode_set, sign, window_key, windows_of  # noqa: E402
from diffuse.control.routing import NoRoute  # noqa: E402
from diffuse.data.codec import PROTOCOL_ID, FrameDecoder, Ping, Pong, encode  # noqa: E402
from diffuse.home import DEFAULT_MODEL, data_home, models_dir  # noqa: E402
from diffuse.model.weights import load_manifest  # noqa: E402

MODEL, BLOCKS = "bench-model", 30
HASHES = [hashlib.sha256(f"block{i}".encode()).hexdigest() for i in range(BLOCKS)]
LISTEN = ["/ip4/127.0.0.1/tcp/0"]
SENT = [0]
SAMPLE = 8  # peers whose steady-state heartbeats are measured (medians are reported)


def _count_socket_writes() -> None:
    write = TrioTCPStream.write

    async def counted(self, data: bytes) -> None:
        SENT[0] += len(data)
        await write(self, data)

    TrioTCPStream.write = counted


def spans(n: int) -> list[tuple[int, int]]:
    """Two interleaved tilings of the model (even peers, odd peers): every block twice."""
    out = []
    for i in range(n):
        m = (n + 1 - i % 2) // 2  # peers in this peer's tiling
        j = i // 2
        out.append((j * BLOCKS // m, (j + 1) * BLOCKS // m))
    return out


async def measure(n: int) -> dict:
    sent = lambda: SENT[0]  # noqa: E731
    async with trio.open_nursery() as nursery:
        sentinel = await nursery.start(Node(create_new_key_pair(), NodeConfig(listen=LISTEN)).run)
        boot = sentinel.full_addrs()
        peers, join_bytes, join_s = [], [], []
        for start, end in spans(n):
            node = await nursery.start(Node(create_new_key_pair(), NodeConfig(listen=LISTEN, bootstrap=boot,
                                                                              heartbeat=1800.0, ttl=3600.0)).run)
            b0, t0 = sent(), time.perf_counter()
            await node.serve(Serving(MODEL, BLOCKS, start, end, HASHES[start:end], "bfloat16"))
            join_bytes.append(sent() - b0)
            join_s.append(time.perf_counter() - t0)
            peers.append(node)

        # Steady state, as after 10 heartbeats: every peer has re-looked-up the k closest nodes
        # of its keys in the full swarm (targets cached at join time predate later joiners).
        # Measured on SAMPLE peers spread over the join order: that heartbeat (with lookup),
        # and a plain heartbeat to the cached nodes.
        sample = set(range(0, n, max(1, n // SAMPLE))[:SAMPLE])
        full, plain = [], []
        for i, node in enumerate(peers):
            node.announcer._targets.clear()
            b0 = sent()
            await node.announcer.publish()
            if i in sample:
                full.append(sent() - b0)
        for i in sorted(sample):
            b0 = sent()
            await peers[i].announcer.publish()
            plain.append(sent() - b0)

        # A fresh client: bootstrap, read the blocks key, until it sees every peer.
        b0, t0 = sent(), time.perf_counter()
        client = await nursery.start(Node(create_new_key_pair(), NodeConfig(listen=LISTEN, bootstrap=boot,
                                                                            server=False)).run)
        reads = 0
        while True:
            cov = await client.coverage(MODEL, BLOCKS, HASHES)
            reads += 1
            if cov.servable and len(cov.peers) == n:
                break
            await trio.sleep(0.05)
        learn_s, learn_bytes = time.perf_counter() - t0, sent() - b0
        value = encode_set(client.dht.value_store.records(blocks_key(MODEL).encode())
                           or [p.announcer.current for p in peers])
        record = len(peers[0].announcer.current.payload) + 64
        for node in peers:  # tear down without 50 withdrawals: they are not being measured
            node.announcer.withdrawn = True
        nursery.cancel_scope.cancel()
    return {
        "peers": n,
        "span_blocks": round(statistics.mean(e - s for s, e in spans(n)), 1),
        "min_replicas": min(cov.replicas),
        "client_learn_s": round(learn_s, 3),
        "client_bytes": learn_bytes,
        "client_reads": reads,
        "join_s_median": round(statistics.median(join_s), 3),
        "join_bytes_median": int(statistics.median(join_bytes)),
        "heartbeat_bytes_with_lookup": int(statistics.median(full)),
        "heartbeat_bytes": int(statistics.median(plain)),
        "record_bytes": record,
        "blocks_value_bytes": len(value),
    }


async def _answer_pings(stream, remote: str) -> None:
    """An honest peer's inference stream, as far as a client probing it can tell: PONG per PING."""
    decoder = FrameDecoder()
    while data := await stream.read(65536):
        for msg in decoder.feed(data):
            if isinstance(msg, Ping):
                await stream.write(encode(Pong(msg.nonce, msg.session_id)))


async def _tarpit(task_status=trio.TASK_STATUS_IGNORED) -> None:
    """A TCP listener that accepts every connection and never says a word."""
    held = []

    async def hold(stream) -> None:
        held.append(stream)
        await trio.sleep_forever()

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    task_status.started(listeners[0].socket.getsockname()[1])
    await trio.serve_listeners(hold, listeners)


async def flooded(n_honest: int, n_hostile: int) -> dict:
    """Time and bytes until a fresh SwarmClient has a route, with n_hostile flooded records."""
    model_dir = models_dir(data_home()) / DEFAULT_MODEL
    manifest = load_manifest(model_dir)
    n, hashes = manifest.num_layers, manifest.block_hashes
    async with trio.open_nursery() as nursery:
        sentinel = await nursery.start(Node(create_new_key_pair(), NodeConfig(listen=LISTEN)).run)
        boot = sentinel.full_addrs()
        peers = []
        for start, end in spans_of(n, n_honest):
            node = await nursery.start(Node(create_new_key_pair(),
                                            NodeConfig(listen=LISTEN, bootstrap=boot, heartbeat=1800.0,
                                                       ttl=3600.0), handlers={PROTOCOL_ID: _answer_pings}).run)
            await node.serve(Serving(manifest.model_id, n, start, end, hashes[start:end], "bfloat16",
                                     protocols=(PROTOCOL_ID,)))
            peers.append(node)
        for node in peers:  # steady state: each has re-announced to the k closest of the whole swarm
            node.announcer._targets.clear()
            await node.announcer.publish()
        if n_hostile:
            port = await nursery.start(_tarpit)
            attacker = await nursery.start(Node(create_new_key_pair(), NodeConfig(listen=LISTEN, bootstrap=boot)).run)
            now, fakes = time.time(), []
            for i in range(n_hostile):  # alternately the two halves: spans real peers serve
                start, end = (0, n // 2) if i % 2 == 0 else (n // 2, n)
                kp = create_new_key_pair()
                fakes.append(sign(PeerRecord(peer_id(kp).to_base58(), manifest.model_id, n, start, end,
                                             tuple(hashes[start:end]), "bfloat16", 50.0, 65536,
                                             (f"/ip4/127.0.0.1/tcp/{port}",), now, now + 3600, now - 600,
                                             protocols=(PROTOCOL_ID,)), kp))
            by_key: dict[str, list] = {}  # layout 1's key and the window keys each fake's span touches
            for sr in fakes:
                for key in [blocks_key(manifest.model_id), *(window_key(manifest.model_id, w)
                                                              for w in windows_of(sr.record.start, sr.record.end))]:
                    by_key.setdefault(key, []).append(sr)
            for key, recs in by_key.items():
                for i in range(0, len(recs), 32):  # each PUT within a value's bounds
                    await put_set(attacker.dht, key, recs[i:i + 32])
        held = sentinel.dht.value_store.records(blocks_key(manifest.model_id).encode())
        value_bytes = len(encode_set(held))
        b0, t0 = SENT[0], time.perf_counter()
        client_node = await nursery.start(Node(create_new_key_pair(), NodeConfig(listen=LISTEN, bootstrap=boot,
                                                                                 server=False)).run)
        client = SwarmClient(client_node, model_dir, SwarmOptions(trust=None, local_blocks=(0, 0)))
        load_s = time.perf_counter() - t0  # the client's head and tokenizer, not discovery
        while True:
            try:
                await client.route(0, n, set())
                break
            except NoRoute:
                await trio.sleep(0.1)
        route_s, client_bytes = time.perf_counter() - t0 - load_s, SENT[0] - b0
        for node in peers:
            node.announcer.withdrawn = True
        nursery.cancel_scope.cancel()
    return {"hostile": n_hostile, "route_s": route_s, "client_bytes": client_bytes, "pings": len(client.rtt),
            "held_records": len(held), "value_bytes": value_bytes}


def spans_of(blocks: int, n: int) -> list[tuple[int, int]]:
    """n spans tiling a `blocks`-block model twice over, as `spans` does for the bench model."""
    return [(s * blocks // BLOCKS, e * blocks // BLOCKS) for s, e in spans(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peers", type=int, nargs="+", default=[10, 25, 50])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--hostile", type=int, default=0, metavar="N",
                    help="instead: 20 honest peers with and without N throwaway records")
    args = ap.parse_args()
    _count_socket_writes()
    rows = []
    for n in [] if args.hostile else args.peers:
        t = time.perf_counter()
        rows.append(trio.run(measure, n))
        print(f"  N={n} done in {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
    if args.hostile:
        flood = [trio.run(flooded, 20, n) for n in (0, args.hostile)]
        print("| hostile records | client finds a route (s) | client bytes | pings "
              "| blocks value held (records, KiB) |")
        print("|---|---|---|---|---|")
        for r in flood:
            print(f"| {r['hostile']} | {r['route_s']:.2f} | {r['client_bytes'] / 1024:.0f} KiB | {r['pings']} "
                  f"| {r['held_records']}, {r['value_bytes'] / 1024:.0f} |")
        return
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print("| peers | span | min replicas | client learns all (s, reads) | client bytes | join bytes/peer "
          "| heartbeat bytes/peer (lookup / cached) | record | blocks value |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['peers']} | {r['span_blocks']} | {r['min_replicas']} "
              f"| {r['client_learn_s']:.2f} ({r['client_reads']}) "
              f"| {r['client_bytes'] / 1024:.0f} KiB | {r['join_bytes_median'] / 1024:.1f} KiB "
              f"| {r['heartbeat_bytes_with_lookup'] / 1024:.1f} / {r['heartbeat_bytes'] / 1024:.1f} KiB "
              f"| {r['record_bytes']} B | {r['blocks_value_bytes'] / 1024:.1f} KiB |")


if __name__ == "__main__":
    main()
