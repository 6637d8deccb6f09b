"""`diffuse demo`: a whole swarm on this machine, one question through it, then shut down.

Starts a sentinel and four peers as separate processes (every remote block served twice), asks
the question as a client that keeps the first block local, prints the answer and the route,
and stops every process, even on Ctrl-C or error. The swarm is private by default, with a swarm
key made for it in its temporary directory (gone with the demo, so no key is left in the home).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from diffuse.control.modes import MODES, PRIVATE
from diffuse.errors import DiffuseError
from diffuse.home import data_home
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


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="start a loopback swarm, ask one question through it, stop it")
    p.add_argument("question", nargs="?", default="What is the capital of France?")
    p.add_argument("--peers", type=int, default=4, help="peers (even; each remote block is served twice)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--timeout", type=float, default=180.0, help="seconds allowed for the swarm to start")
    p.add_argument("--mode", default=PRIVATE, choices=MODES,
                   help="private (default: a swarm key made for this demo) or public (no key, the full trust plane)")
    p.set_defaults(func=cmd_demo)


def spans(n_blocks: int, peers: int) -> list[tuple[int, int]]:
    """Cut the model into peers/2 spans and give each to two peers: every block twice."""
    parts = max(1, peers // 2)
    cuts = [round(i * n_blocks / parts) for i in range(parts + 1)]
    return [(cuts[i], cuts[i + 1]) for i in range(parts)] * 2


def cmd_demo(args) -> int:
    home = data_home(args.home)
    model_dir = store.resolve(home, None)
    n = ModelConfig.load(model_dir).num_layers
    children: list[Child] = []
    with tempfile.TemporaryDirectory(prefix="diffuse-demo-") as tmp:
        logs = Path(tmp)
        base = ["--home", str(home)]
        swarm = _swarm_args(args.mode, logs)
        try:
            print(f"starting a sentinel of a {args.mode} swarm...", file=sys.stderr, flush=True)
            sentinel = Child("sentinel", base + ["sentinel", "--identity", str(logs / "sentinel.key"),
                                                 "--listen", "/ip4/127.0.0.1/tcp/0", *swarm], logs / "sentinel.log")
            children.append(sentinel)
            boot = sentinel.wait_for("/ip4/", args.timeout)
            for i, (a, b) in enumerate(spans(n, args.peers)):
                print(f"starting peer {i} on blocks {a}:{b}...", file=sys.stderr, flush=True)
                children.append(Child(f"peer {i}", base + [
                    "join", "--bootstrap", boot, "--blocks", f"{a}:{b}", "--dtype", args.dtype,
                    "--identity", str(logs / f"peer{i}.key"), "--listen", "/ip4/127.0.0.1/tcp/0",
                    "--heartbeat", "5", *swarm], logs / f"peer{i}.log"))
            for c in children[1:]:
                c.wait_for("serving ", args.timeout)
            print("swarm ready; asking through it...", file=sys.stderr, flush=True)
            ask = subprocess.run(CLI + base + ["--client-only", "ask", "--bootstrap", boot, "--json",
                                               "--max-tokens", str(args.max_tokens), "--dtype", args.dtype,
                                               *swarm, args.question],
                                 capture_output=True, text=True, timeout=args.timeout)
            if ask.returncode != 0:
                raise DiffuseError(f"the client failed: {ask.stderr.strip()}")
            result = json.loads(ask.stdout)
        finally:
            for c in reversed(children):
                c.stop()
    print(result["text"])
    print(f"\nroute: client blocks 0:{result['local_blocks'][0]} (local), then " + ", ".join(
        f"peer …{hop['peer'][-8:]} blocks {hop['blocks'][0]}:{hop['blocks'][1]}" for hop in result["route"]))
    print(f"{result['completion_tokens']} tokens at {result['tokens_per_s']:.1f} tokens/s, "
          f"{len(result['failovers'])} failovers; a {result['swarm_mode']} swarm, trust plane {result['trust']}")
    return 0


def _swarm_args(mode: str, tmp: Path) -> list[str]:
    """What every process of the demo swarm is given: a key made now in `tmp`, or --mode public."""
    if mode != PRIVATE:
        return ["--mode", mode]
    from diffuse.control.swarm_key import SwarmKey, write_key

    write_key(tmp / "swarm.key", SwarmKey.generate())
    return ["--swarm-key", str(tmp / "swarm.key")]
