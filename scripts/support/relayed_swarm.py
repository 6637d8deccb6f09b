"""A private loopback swarm whose every peer sits behind the delay relay: a sentinel and one
`diffuse join` per span as processes, each announcing a relay port, so that every byte a client
exchanges with a peer crosses the emulated wide-area link."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from diffuse.client.swarm import remote_of
from diffuse.control.swarm_key import SwarmKey, write_key

from .relay import RelayProcess

LOCAL = "/ip4/127.0.0.1/tcp/0"
DIFFUSE = [sys.executable, "-m", "diffuse"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LoopbackSwarm:
    """A sentinel and one peer per span, as processes, each peer behind a relay port.

    `relay.set_rtt(s)` changes the emulated link for every peer while sessions stay up;
    `proc[i]` is peer i's process (SIGKILL it to test failover), `close()` ends them all.
    """

    def __init__(self, home: Path, spans: list[str], dtype: str = "bf16", rtt: float = 0.0,
                 timeout: float = 240.0):
        self.tmp = Path(tempfile.mkdtemp(prefix="diffuse-swarm-"))
        self.swarm_key = SwarmKey.generate()  # a private swarm of its own (the default mode)
        write_key(self.tmp / "swarm.key", self.swarm_key)
        key = ["--swarm-key", str(self.tmp / "swarm.key")]
        self.env = os.environ | {"DIFFUSE_HOME": str(home), "PYTHONUNBUFFERED": "1"}
        self.procs: list[subprocess.Popen] = []
        self.relay: RelayProcess | None = None
        try:
            sentinel = self._start("sentinel", "--identity", str(self.tmp / "sentinel.key"), "--listen", LOCAL, *key)
            self.boot = self._line(sentinel, timeout)
            ports = [free_port() for _ in spans]
            self.relay = RelayProcess([("127.0.0.1", p) for p in ports], rtt)
            self.relay_ports = set(self.relay.ports)
            self.proc = [self._start("join", "--identity", str(self.tmp / f"peer{i}.key"), "--bootstrap", self.boot,
                                     "--listen", f"/ip4/127.0.0.1/tcp/{port}",
                                     "--announce", f"/ip4/127.0.0.1/tcp/{rport}", "--blocks", span,
                                     "--dtype", dtype, "--heartbeat", "2", "--ttl", "30", *key)
                         for i, (span, port, rport) in enumerate(zip(spans, ports, self.relay.ports))]
            for p in self.proc:
                while not self._line(p, timeout).startswith("serving"):
                    pass
        except BaseException:
            self.close()
            raise

    def _start(self, *args: str) -> subprocess.Popen:
        log = open(self.tmp / f"{args[0]}-{len(self.procs)}.log", "w")
        p = subprocess.Popen(DIFFUSE + list(args), stdout=subprocess.PIPE, stderr=log, text=True, env=self.env)
        self.procs.append(p)
        return p

    @staticmethod
    def _line(p: subprocess.Popen, timeout: float) -> str:
        """The next stdout line, bounded by a timeout (a stuck child must not hang the run)."""
        out: list[str] = []
        reader = __import__("threading").Thread(target=lambda: out.append(p.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout)
        if not out or not out[0]:
            raise RuntimeError(f"{' '.join(p.args[3:5])}: no output in {timeout} s or exited ({p.poll()})")
        return out[0].strip()

    def check_relayed(self, pipeline) -> None:
        """Every hop's connection must end at a relay port, or the numbers would be meaningless."""
        for hop in remote_of(pipeline).hops:
            address = hop.stream.get_remote_address()
            port = address[1] if address else None
            if port not in self.relay_ports:
                raise RuntimeError(f"hop to {hop.hop.peer_id} bypasses the relay (remote port {port})")

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait(10)
        if self.relay:
            self.relay.close()

    def __enter__(self) -> "LoopbackSwarm":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

