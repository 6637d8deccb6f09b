#!/usr/bin/env python
"""How long a first connection to a peer takes: `make_host`'s hosts against py-libp2p's default
connection limit (the baseline, in the same run).

    .venv/bin/python scripts/bench_dial.py [--peers 20] [--repeats 3]

py-libp2p holds every dial for its happy-eyeballs delay (250 ms) unless the connection that came
fills the per-peer limit; `make_host` sets the limit to 1, so it never waits. One dialer connects
to --peers listening hosts on 127.0.0.1, each a fresh connection (TCP, Noise, yamux), once with
the limit at 1 (as every Diffuse node) and once at py-libp2p's default, alternating --repeats
times. The table: the median and 90th percentile of a dial, and the ratio of medians.
(tests/test_host_security.py asserts the mechanism: the dial returns with the delay made endless.)
"""

from __future__ import annotations

import argparse
import statistics
import time

import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.network.config import ConnectionConfig
from libp2p.peer.peerinfo import PeerInfo

from diffuse.control.host import make_host

LISTEN = "/ip4/127.0.0.1/tcp/0"


async def dials(peers: int, limit: int | None) -> list[float]:
    """Seconds per first connection from one dialer to `peers` hosts; `limit`: the dialer's
    connections per peer (None: py-libp2p's default)."""
    hosts = [make_host(create_new_key_pair(), [LISTEN]) for _ in range(peers + 1)]
    dialer = hosts[0]
    if limit is None:
        dialer.get_network().connection_config = ConnectionConfig()
    times = []
    async with trio.open_nursery() as nursery:
        for h in hosts:
            await nursery.start(_serve, h)
        for target in hosts[1:]:
            t = time.perf_counter()
            await dialer.connect(PeerInfo(target.get_id(), target.get_transport_addrs()))
            times.append(time.perf_counter() - t)
        nursery.cancel_scope.cancel()
    return times


async def _serve(host, task_status=trio.TASK_STATUS_IGNORED) -> None:
    import multiaddr

    async with host.run([multiaddr.Multiaddr(LISTEN)]):
        task_status.started()
        await trio.sleep_forever()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    got: dict[str, list[float]] = {"limit 1 (make_host)": [], "py-libp2p default (baseline)": []}
    for _ in range(args.repeats):
        got["limit 1 (make_host)"] += trio.run(dials, args.peers, 1)
        got["py-libp2p default (baseline)"] += trio.run(dials, args.peers, None)
    base = statistics.median(got["py-libp2p default (baseline)"])
    print("| dialer | dials | median ms | p90 ms | median vs baseline |\n|---|---|---|---|---|")
    for name, ts in got.items():
        ts = sorted(ts)
        print(f"| {name} | {len(ts)} | {statistics.median(ts) * 1e3:.1f} | {ts[int(0.9 * (len(ts) - 1))] * 1e3:.1f} | "
              f"{statistics.median(ts) / base:.2f}x |")


if __name__ == "__main__":
    main()
