"""A private loopback swarm whose every peer sits behind the delay relay: a sentinel and one
`diffuse join` per span as processes, each announcing a relay port, so that every byte a client
exchanges with a peer crosses the emulated wide-area link."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from diffuse.client.swarm import remote_of

from .procs import Procs, free_port
from .relay import RelayProcess
from .swarm import QUICK_RECORDS, Swarm


class LoopbackSwarm:
    """A sentinel and one peer per span, as processes, each peer behind a relay port.

    `relay.set_rtt(s)` changes the emulated link for every peer while sessions stay up;
    `proc[i]` is peer i's process (SIGKILL it to test failover), `close()` ends them all.
    """

    def __init__(self, home: Path, spans: list[str], dtype: str = "bf16", rtt: float = 0.0,
                 timeout: float = 240.0):
        self.tmp = Path(tempfile.mkdtemp(prefix="diffuse-swarm-"))
        self.procs = Procs(home, one_thread=False)
        self.swarm_key = self.procs.swarm_key  # a private swarm (the default mode)
        self.relay: RelayProcess | None = None
        try:
            ports = [free_port() for _ in spans]
            self.relay = RelayProcess([("127.0.0.1", p) for p in ports], rtt)
            self.relay_ports = set(self.relay.ports)
            names = [f"peer{i}" for i in range(len(spans))]
            extra = {name: ["--listen", f"/ip4/127.0.0.1/tcp/{port}", "--announce", f"/ip4/127.0.0.1/tcp/{rport}"]
                     for name, port, rport in zip(names, ports, self.relay.ports)}
            swarm = Swarm(self.procs, self.tmp, dict(zip(names, spans)), extra, ["--dtype", dtype, *QUICK_RECORDS],
                          timeout=timeout)
            self.boot, self.proc = swarm.boot, [swarm.proc[name] for name in names]
        except BaseException:
            self.close()
            raise

    def check_relayed(self, pipeline) -> None:
        """Every hop's connection must end at a relay port, or the numbers would be meaningless."""
        for hop in remote_of(pipeline).hops:
            address = hop.stream.get_remote_address()
            port = address[1] if address else None
            if port not in self.relay_ports:
                raise RuntimeError(f"hop to {hop.hop.peer_id} bypasses the relay (remote port {port})")

    def close(self) -> None:
        self.procs.close()
        if self.relay:
            self.relay.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> "LoopbackSwarm":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
