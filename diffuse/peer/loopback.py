"""A whole swarm on this machine, as separate processes: a sentinel and peers that serve every
remote block twice, then one question through it as a client would ask it (`diffuse demo`).

Every process is stopped on the way out, even on Ctrl-C or error. A private swarm gets a key made
for it in the run's temporary directory (gone with it, so no key is left in the home).
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diffuse.control.modes import PRIVATE
from diffuse.errors import DiffuseError
from diffuse.model import store
from diffuse.model.config import ModelConfig

CLI = [sys.executable, "-m", "diffuse"]


class Child:
    """A `diffuse` subprocess whose stdout lines are read without blocking the caller; `prefix`
    runs it under a wrapper that execs it (e.g. `ip netns exec NS`)."""

    def __init__(self, name: str, args: list[str], log: Path, prefix: Sequence[str] = ()):
        self.name = name
        self.log = open(log, "w")
        self.p = subprocess.Popen([*prefix, *CLI, *args], stdout=subprocess.PIPE, stderr=self.log, text=True,
                                  env=os.environ | {"PYTHONUNBUFFERED": "1"})
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.p.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def wait_for(self, prefix: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise DiffuseError(f"{self.name} printed no {prefix!r} line in {timeout:g} s "
                                   f"(log: {self.log.name})") from None
            if line is None:
                raise DiffuseError(f"{self.name} exited with {self.p.wait()} (log: {self.log.name})")
            if line.startswith(prefix):
                return line

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        self.log.close()


def spans(n_blocks: int, peers: int) -> list[tuple[int, int]]:
    """Cut the model into peers/2 spans and give each to two peers: every block twice."""
    parts = max(1, peers // 2)
    cuts = [round(i * n_blocks / parts) for i in range(parts + 1)]
    return [(cuts[i], cuts[i + 1]) for i in range(parts)] * 2


@dataclass(frozen=True)
class LoopbackConfig:
    home: Path
    peers: int = 4  # even: each remote block is served twice
    mode: str = PRIVATE  # private: a swarm key made for this run
    dtype: str = "bf16"
    max_tokens: int = 64
    timeout: float = 180.0  # seconds allowed for the swarm to start, and for the answer


def ask_loopback(config: LoopbackConfig, question: str, say: Callable[[str], None]) -> dict[str, Any]:
    """Start the swarm, ask `question` through it (the client keeps the first block local), stop
    every process; the answer as `diffuse ask --json` gives it."""
    n = ModelConfig.load(store.resolve(config.home, None)).num_layers
    children: list[Child] = []
    with tempfile.TemporaryDirectory(prefix="diffuse-demo-") as tmp:
        logs, base = Path(tmp), ["--home", str(config.home)]
        swarm = _swarm_args(config.mode, logs)
        local = ["--listen", "/ip4/127.0.0.1/tcp/0"]
        try:
            say(f"starting a sentinel of a {config.mode} swarm...")
            sentinel = Child("sentinel", base + ["sentinel", "--identity", str(logs / "sentinel.key"), *local, *swarm],
                             logs / "sentinel.log")
            children.append(sentinel)
            boot = sentinel.wait_for("/ip4/", config.timeout)
            for i, (a, b) in enumerate(spans(n, config.peers)):
                say(f"starting peer {i} on blocks {a}:{b}...")
                children.append(Child(f"peer {i}", base + [
                    "join", "--bootstrap", boot, "--blocks", f"{a}:{b}", "--dtype", config.dtype,
                    "--identity", str(logs / f"peer{i}.key"), *local, "--heartbeat", "5", *swarm],
                    logs / f"peer{i}.log"))
            for c in children[1:]:
                c.wait_for("serving ", config.timeout)
            say("swarm ready; asking through it...")
            ask = subprocess.run(CLI + base + ["--client-only", "ask", "--bootstrap", boot, "--json", "--max-tokens",
                                               str(config.max_tokens), "--dtype", config.dtype, *swarm, question],
                                 capture_output=True, text=True, timeout=config.timeout)
            if ask.returncode != 0:
                raise DiffuseError(f"the client failed: {ask.stderr.strip()}")
            return json.loads(ask.stdout)
        finally:
            for c in reversed(children):
                c.stop()


def _swarm_args(mode: str, tmp: Path) -> list[str]:
    """What every process of the demo swarm is given: a key made now in `tmp`, or --mode public."""
    if mode != PRIVATE:
        return ["--mode", mode]
    from diffuse.control.swarm_key import SwarmKey, write_key

    write_key(tmp / "swarm.key", SwarmKey.generate())
    return ["--swarm-key", str(tmp / "swarm.key")]
