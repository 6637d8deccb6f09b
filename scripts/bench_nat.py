#!/usr/bin/env python
"""Direct, relayed and hole-punched: greedy decoding to a public peer and to a peer behind NAT
(through the sentinel's circuit relay, or over the direct connection DCUtR opens), in Linux
network namespaces, from one run. Needs root, iproute2 and iptables.

    sudo .venv/bin/python scripts/bench_nat.py [--tokens 32] [--repeats 3] [--pings 200] [--dtype bf16] [--home DIR]

An "internet" bridge holds a sentinel (10.97.0.1, the relay) and a public peer (10.97.0.2); a
second peer sits behind a home router (MASQUERADE, unsolicited inbound dropped), and the client
behind another. Both peers serve every remote block (1..29; the client keeps block 0 and the
head), so each answer crosses one hop: direct to the public peer; client -> relay -> peer behind
NAT; or, as `ask` does by default, directly to that peer through both routers (hole punching; the
first two paths ask with `--no-hole-punch`). Repeats alternate
the three (the client's --allow-peers names the one peer to use), so machine noise hits all
alike; each cell is the median over repeats. Reported: decode tokens/s, time per token (one round
trip through the hop per token), first-token time, PING/PONG round trips on an inference stream
(the hop alone), how the hop was reached (ask --json), and the ratios to the direct path. Greedy
tokens must be the same on every path; the script says so.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ["DIFFUSE_TRAIN_DRAFT"] = "0"  # the peers it starts train no draft head behind the measurement

from diffuse.peer.loopback import CLI, Child  # noqa: E402
from diffuse.control.modes import KEY_ENV  # noqa: E402
from diffuse.control.swarm_key import SwarmKey, write_key  # noqa: E402

QUESTION = "Name three famous rivers and the countries they flow through."


def ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


class Internet:
    """The topology of tests/test_nat.py: a bridge, public hosts on it, home routers with one
    masqueraded host each."""

    def __init__(self, tag: str):
        self.tag, self.made, self.links, self.ns = tag, [], 0, {}
        self.switch = self._netns("sw")
        ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        ip("-n", self.switch, "link", "set", "br0", "up")

    def _netns(self, name: str) -> str:
        ns = f"df{self.tag}{name}"
        ip("netns", "add", ns)
        self.made.append(ns)
        ip("-n", ns, "link", "set", "lo", "up")
        return ns

    def _veth(self, a: str, b: str) -> tuple[str, str]:
        self.links += 1
        ia, ib = f"df{self.tag}v{self.links}a", f"df{self.tag}v{self.links}b"
        ip("link", "add", ia, "netns", a, "type", "veth", "peer", "name", ib, "netns", b)
        ip("-n", a, "link", "set", ia, "up")
        ip("-n", b, "link", "set", ib, "up")
        return ia, ib

    def _wan(self, ns: str, addr: str) -> str:
        inner, outer = self._veth(ns, self.switch)
        ip("-n", self.switch, "link", "set", outer, "master", "br0")
        ip("-n", ns, "addr", "add", f"{addr}/24", "dev", inner)
        return inner

    def public(self, name: str, addr: str) -> None:
        self.ns[name] = self._netns(name)
        self._wan(self.ns[name], addr)

    def home(self, name: str, wan: str, lan: int) -> None:
        router = self._netns(f"r{lan}")
        host = self.ns[name] = self._netns(name)
        wan_if = self._wan(router, wan)
        a, b = self._veth(router, host)
        ip("-n", router, "addr", "add", f"192.168.{lan}.1/24", "dev", a)
        ip("-n", host, "addr", "add", f"192.168.{lan}.2/24", "dev", b)
        ip("-n", host, "route", "add", "default", "via", f"192.168.{lan}.1")
        rules = [["-t", "nat", "-A", "POSTROUTING", "-o", wan_if, "-j", "MASQUERADE"]]
        for chain in ("FORWARD", "INPUT"):
            rules += [["-A", chain, "-i", wan_if, "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j",
                       "ACCEPT"], ["-A", chain, "-i", wan_if, "-j", "DROP"]]
        for rule in [["sysctl", "-qw", "net.ipv4.ip_forward=1"], *(["iptables", *r] for r in rules)]:
            subprocess.run(["ip", "netns", "exec", router, *rule], check=True, capture_output=True, timeout=20)

    def prefix(self, name: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns[name]]

    def destroy(self) -> None:
        for ns in reversed(self.made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)


def ping_main(boot: str, peer: str, rounds: int, hole_punch: bool) -> int:
    """In the client's namespace: PING/PONG round trips to `peer` over one inference stream,
    on whatever connection its record's addresses give (direct, or through its relay)."""
    import trio
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.custom_types import TProtocol
    from libp2p.peer.id import ID
    from libp2p.peer.peerinfo import PeerInfo

    from diffuse.control.host import parse_multiaddr
    from diffuse.control.modes import resolve
    from diffuse.control.node import NodeConfig, open_node
    from diffuse.data.codec import PROTOCOL_ID, FrameDecoder, Ping, Pong, encode

    async def run() -> None:
        key = resolve("private", Path(tempfile.gettempdir())).key
        listen = ["/ip4/0.0.0.0/tcp/0" if hole_punch else "/ip4/127.0.0.1/tcp/0"]
        async with open_node(create_new_key_pair(), NodeConfig(listen=listen, bootstrap=[boot], server=False,
                                                               swarm_key=key, hole_punch=hole_punch)) as node:
            record = None
            for _ in range(100):
                record = await node.peer_record(peer)
                if record is not None:
                    break
                await trio.sleep(0.2)
            pid = ID.from_base58(peer)
            node.host.get_peerstore().clear_addrs(pid)  # as the swarm client dials: fresh addresses,
            node.host.get_network().unblock_peer(pid)  # and no memory of a DHT query's failed dial
            await node.host.connect(PeerInfo(pid, [parse_multiaddr(a) for a in record.addrs]))
            stream = await node.host.new_stream(pid, [TProtocol(PROTOCOL_ID)])
            rtts, dec = [], FrameDecoder()
            for i in range(rounds + 5):
                t0 = time.perf_counter()
                await stream.write(encode(Ping(i + 1)))
                while not any(isinstance(m, Pong) for m in dec.feed(await stream.read(4096))):
                    pass
                if i >= 5:  # warm-up
                    rtts.append(time.perf_counter() - t0)
            await stream.close()
            print(json.dumps({"rtt_ms": [r * 1000 for r in rtts], "reached": node.relaying.reached(peer)}))

    trio.run(run)
    return 0


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--ping":
        return ping_main(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5] == "1")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "fp16"])
    ap.add_argument("--pings", type=int, default=200, help="PING/PONG round trips per path and repeat")
    ap.add_argument("--home", default=os.environ.get("DIFFUSE_HOME", str(Path.home() / ".diffuse")),
                    help="the store holding the default model (make run pulls it)")
    args = ap.parse_args()
    home = ["--home", args.home]
    if os.geteuid() != 0 or not shutil.which("iptables"):
        print("needs root and iptables", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="bench-nat-"))
    write_key(tmp / "swarm.key", SwarmKey.generate())
    os.environ[KEY_ENV] = str(tmp / "swarm.key")
    net = Internet(os.urandom(3).hex())
    children: list[Child] = []
    try:
        net.public("sentinel", "10.97.0.1")
        net.public("direct", "10.97.0.2")
        net.home("natted", "10.97.0.11", 1)
        net.home("client", "10.97.0.12", 2)
        sentinel = Child("sentinel", [*home, "sentinel", "--identity", str(tmp / "s.key"), "--listen",
                                      "/ip4/10.97.0.1/tcp/0"], tmp / "sentinel.log", prefix=net.prefix("sentinel"))
        children.append(sentinel)
        boot = sentinel.wait_for("/ip4/", 120)
        ids = {}
        for name in ("direct", "natted"):
            children.append(Child(name, [*home, "join", "--bootstrap", boot, "--blocks", "1:30", "--dtype",
                                         args.dtype, "--identity", str(tmp / f"{name}.key")],
                                  tmp / f"{name}.log", prefix=net.prefix(name)))
        for child in children[1:]:
            ids[child.name] = child.wait_for("/ip4/", 180).rsplit("/p2p/", 1)[1]
            child.wait_for("serving ", 300)
        for name, pid in ids.items():
            (tmp / f"{name}.allow").write_text(pid + "\n")
        paths = {"direct": ("direct", ["--no-hole-punch"]), "natted": ("natted", ["--no-hole-punch"]),
                 "punched": ("natted", [])}
        runs: dict[str, list[dict]] = {name: [] for name in paths}
        for r in range(args.repeats):
            for name, (target, extra) in paths.items():
                out = subprocess.run(net.prefix("client") + CLI + [
                    *home, "--client-only", "ask", "--bootstrap", boot, "--allow-peers", str(tmp / f"{target}.allow"),
                    "--json", "--max-tokens", str(args.tokens), "--wait", "60", "--no-speculate", "--dtype",
                    args.dtype, *extra, QUESTION], capture_output=True, text=True, timeout=600)
                if out.returncode != 0:
                    raise RuntimeError(f"ask via {name} failed: {out.stderr[-2000:]}")
                got = json.loads(out.stdout)
                runs[name].append(got)
                print(f"repeat {r + 1} {name}: {got['tokens_per_s']:.1f} tok/s, "
                      f"reached {got['route'][0].get('reached')}", file=sys.stderr, flush=True)
        pings: dict[str, list[float]] = {name: [] for name in paths}
        for _ in range(args.repeats):
            for name, (target, extra) in paths.items():
                out = subprocess.run(net.prefix("client") + [sys.executable, __file__, "--ping", boot, ids[target],
                                                             str(args.pings), "0" if extra else "1"],
                                     capture_output=True, text=True, timeout=300)
                if out.returncode != 0:
                    raise RuntimeError(f"ping via {name} failed: {out.stderr[-2000:]}")
                pings[name] += json.loads(out.stdout.strip().splitlines()[-1])["rtt_ms"]
        same = len({tuple(g["token_ids"]) for rs in runs.values() for g in rs}) == 1
        cells = {}
        for name, rs in runs.items():
            tps = statistics.median(g["tokens_per_s"] for g in rs)
            first = statistics.median(g["timings"]["first_token_s"] for g in rs)
            cells[name] = dict(tps=tps, ms=1000 / tps, first=first, reached=rs[-1]["route"][0].get("reached"))
        print(f"\nbench_nat: {args.tokens} tokens, {args.repeats} repeats, {args.dtype}, one hop (blocks 1-29), "
              f"{time.strftime('%Y-%m-%d')}")
        print(f"{'path':<30} {'tokens/s':>9} {'ms/token':>9} {'first token s':>14} {'PING ms':>8}  reached")
        labels = {"direct": "direct (public peer)", "natted": "relayed (peer behind NAT)",
                  "punched": "hole-punched (same peer)"}
        for name, label in labels.items():
            c = cells[name]
            c["ping"] = statistics.median(pings[name])
            print(f"{label:<30} {c['tps']:>9.2f} {c['ms']:>9.1f} {c['first']:>14.2f} {c['ping']:>8.2f}  "
                  f"{(c['reached'] or {}).get('state')}")
        d = cells["direct"]
        for name in ("natted", "punched"):
            c = cells[name]
            print(f"{labels[name]} / direct: tokens/s x{c['tps'] / d['tps']:.2f}, time per token "
                  f"x{c['ms'] / d['ms']:.2f} ({c['ms'] - d['ms']:+.1f} ms), PING x{c['ping'] / d['ping']:.2f} "
                  f"({c['ping'] - d['ping']:+.2f} ms per round trip)")
        print("greedy tokens identical on every path:", "yes" if same else "NO")
        return 0 if same else 1
    finally:
        for child in reversed(children):
            child.stop()
        net.destroy()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
