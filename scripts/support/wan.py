"""The namespaces of the WAN benchmarks (scripts/bench_wan.py, scripts/bench_pipeline.py): the
peers' namespace, the client's, and between them a WAN one whose only way through is the
user-space delaying relay (scripts/latency_relay.py: this kernel has no netem) listening at the
peers' announced address, so every byte between the client and a peer crosses the relay's round
trip and bytes between peers none. Needs root."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1]
PUBLIC = "10.98.0.1"  # the peers' address: theirs in their namespace, the relay's in the WAN one
PEERS_SIDE, CLIENT_SIDE = ("10.96.0.1", "10.96.0.2"), ("10.97.0.1", "10.97.0.2")  # (WAN end, other end)
BASE_PORT = 4600  # the sentinel's port; peers take the next ones


def ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


class Wan:
    """Namespaces peers / wan / client; the client reaches PUBLIC only through the WAN namespace."""

    def __init__(self, tag: str):
        self.ns = {k: f"dfw{tag}{k[0]}" for k in ("peers", "wan", "client")}
        self.made: list[str] = []

    def build(self) -> None:
        for ns in self.ns.values():
            ip("netns", "add", ns)
            self.made.append(ns)
            ip("-n", ns, "link", "set", "lo", "up")
        p, w, c = self.ns["peers"], self.ns["wan"], self.ns["client"]
        ip("-n", p, "addr", "add", f"{PUBLIC}/32", "dev", "lo")
        ip("-n", w, "addr", "add", f"{PUBLIC}/32", "dev", "lo")
        for ns, (wan_end, far_end), name in ((p, PEERS_SIDE, "p"), (c, CLIENT_SIDE, "c")):
            inner, outer = f"dfw{name}i{os.getpid() % 1000}", f"dfw{name}o{os.getpid() % 1000}"
            ip("link", "add", inner, "netns", ns, "type", "veth", "peer", "name", outer, "netns", w)
            ip("-n", ns, "addr", "add", f"{far_end}/24", "dev", inner)
            ip("-n", w, "addr", "add", f"{wan_end}/24", "dev", outer)
            ip("-n", ns, "link", "set", inner, "up")
            ip("-n", w, "link", "set", outer, "up")
        ip("-n", c, "route", "add", f"{PUBLIC}/32", "via", CLIENT_SIDE[0])

    def prefix(self, name: str) -> tuple[str, ...]:
        return ("ip", "netns", "exec", self.ns[name])

    def close(self, procs, relay: subprocess.Popen | None) -> None:
        """End a bench's relay (if started) and processes, then remove the namespaces."""
        if relay is not None:
            relay.kill()
            relay.wait()
        procs.close()
        self.destroy()

    def destroy(self) -> None:
        for ns in reversed(self.made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)


def listen(port: int) -> list[str]:
    return ["--listen", f"/ip4/0.0.0.0/tcp/{port}", "--announce", f"/ip4/{PUBLIC}/tcp/{port}"]


def start_relay(wan: Wan, ports: list[int], rtt_ms: float) -> subprocess.Popen:
    args = [*wan.prefix("wan"), sys.executable, str(SCRIPTS / "latency_relay.py"), "--host", PUBLIC,
            "--rtt-ms", str(rtt_ms)] + [f"{p}:{PEERS_SIDE[1]}:{p}" for p in ports]
    relay = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    for _ in range(len(ports) + 1):
        if not relay.stdout.readline():
            raise RuntimeError("the latency relay did not start")
    return relay
