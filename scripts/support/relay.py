"""The delay relay (scripts/latency_relay.py) as a child process, driven over its stdin: a
wide-area link in front of loopback peers, changeable while connections stay up."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

RELAY = Path(__file__).resolve().parents[1] / "latency_relay.py"  # the command line the child runs


class RelayProcess:
    """The relay as a child process: `ports[i]` relays to `targets[i]`; `set_rtt` changes the
    link of every mapping (and waits until the relay applied it); `close` ends it."""

    def __init__(self, targets: list[tuple[str, int]], rtt: float = 0.0, jitter: float = 0.0,
                 mbps: float = 0.0, timeout: float = 30.0):
        args = [sys.executable, str(RELAY), "--rtt-ms", str(rtt * 1e3),
                "--jitter-ms", str(jitter * 1e3), "--mbps", str(mbps)] + [f"{h}:{p}" for h, p in targets]
        self.p = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.timeout = timeout
        self.ports = [int(self._line().split()[0]) for _ in targets]
        if self._line() != "ready":
            raise RuntimeError("latency relay did not start")

    def _line(self) -> str:
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"latency relay exited with {self.p.wait(self.timeout)}")
        return line.strip()

    def command(self, line: str) -> None:
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()
        if (answer := self._line()) != "ok":
            raise ValueError(answer)

    def set_rtt(self, seconds: float) -> None:
        self.command(f"rtt {seconds * 1e3}")

    def close(self) -> None:
        if self.p.poll() is None:
            self.p.stdin.close()
            try:
                self.p.wait(self.timeout)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()

    def __enter__(self) -> "RelayProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
