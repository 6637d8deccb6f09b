"""Helpers for control-plane tests: a SmolLM2-shaped fake model store, and CLI processes that
are always killed (each test wraps them in `Procs`, whose exit kills whatever still runs).

The swarms `Procs` starts are private, as the CLI's default: every child finds one swarm key,
made once per test run, in $DIFFUSE_SWARM_KEY, and in-process nodes joining them take
`swarm_key()`."""

from __future__ import annotations

import atexit
import functools
import hashlib
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path

from diffuse.control.modes import KEY_ENV
from diffuse.control.swarm_key import SwarmKey, read_key, write_key
from diffuse.home import DEFAULT_MODEL, models_dir
from diffuse.model.config import ModelConfig

DIFFUSE = [sys.executable, "-c", "from diffuse.cli import run; run()"]
SMOLLM2_CONFIG = dict(arch="llama", hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                      num_kv_heads=3, head_dim=64, vocab_size=49152, rope_theta=100000.0,
                      max_position_embeddings=8192, tie_word_embeddings=True)


def fake_hashes(n: int, tag: str = "w") -> list[str]:
    return [hashlib.sha256(f"{tag}{i}".encode()).hexdigest() for i in range(n)]


def make_fake_model(home: Path, name: str = DEFAULT_MODEL, layers: int = 30) -> Path:
    """config.json + manifest.json of a SmolLM2-135M-shaped model, without weights: all the
    control plane reads (join announces; loading blocks is the data plane's job)."""
    from diffuse.model.weights import Manifest

    d = models_dir(home) / name
    d.mkdir(parents=True, exist_ok=True)
    cfg = ModelConfig(**(SMOLLM2_CONFIG | {"num_layers": layers}))
    (d / "config.json").write_text(json.dumps(cfg.to_hf()))
    m = Manifest(model_id=name, arch="llama", num_layers=layers, dtype="bfloat16",
                 block_hashes=fake_hashes(layers), head_hash=hashlib.sha256(b"head").hexdigest())
    (d / "manifest.json").write_text(json.dumps(asdict(m) | {"model_hash": m.model_hash}))
    return d


class Proc:
    """A `diffuse ...` child process whose stdout lines arrive through a queue (no blocking reads)."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.args = args
        self.p = subprocess.Popen(DIFFUSE + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env=env)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.stderr: list[str] = []
        threading.Thread(target=self._pump, args=(self.p.stdout, self.lines.put), daemon=True).start()
        threading.Thread(target=self._pump, args=(self.p.stderr, self._err), daemon=True).start()

    def _err(self, line: str | None) -> None:
        if line is not None:
            self.stderr.append(line)

    @staticmethod
    def _pump(stream, put) -> None:
        for line in stream:
            put(line.rstrip("\n"))
        put(None)

    def readline(self, timeout: float) -> str:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no output from diffuse {' '.join(self.args)} in {timeout} s") from None
        if line is None:
            raise RuntimeError(f"diffuse {' '.join(self.args)} exited {self.p.wait()}:\n" + "\n".join(self.stderr))
        return line

    def read_until(self, prefix: str, timeout: float) -> list[str]:
        deadline = time.monotonic() + timeout
        out: list[str] = []
        while True:
            out.append(self.readline(max(0.01, deadline - time.monotonic())))
            if out[-1].startswith(prefix):
                return out

    def signal(self, sig: int) -> None:
        if self.p.poll() is None:
            self.p.send_signal(sig)

    def wait(self, timeout: float) -> int:
        return self.p.wait(timeout=timeout)


@functools.cache
def swarm_key_file() -> Path:
    """The test run's swarm key, written once (mode 0600) and removed when the run ends."""
    tmp = Path(tempfile.mkdtemp(prefix="diffuse-test-swarm-"))
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    write_key(tmp / "swarm.key", SwarmKey.generate())
    return tmp / "swarm.key"


def swarm_key() -> SwarmKey:
    """The key of the swarms `Procs` starts, for in-process nodes that join them."""
    return read_key(swarm_key_file())


class Procs:
    """Context manager owning child processes: every one is killed on exit, pass or fail. They
    join a private swarm, whose key in-process nodes take from `swarm_key()`."""

    def __init__(self, home: Path) -> None:
        self.env = os.environ | {"DIFFUSE_HOME": str(home), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
                                 KEY_ENV: str(swarm_key_file())}
        self.env.pop("LIBP2P_DEBUG", None)
        self.swarm_key = swarm_key()
        self.procs: list[Proc] = []

    def start(self, *args: str) -> Proc:
        proc = Proc(list(args), self.env)
        self.procs.append(proc)
        return proc

    def run(self, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(DIFFUSE + list(args), capture_output=True, text=True, env=self.env, timeout=timeout)

    def __enter__(self) -> "Procs":
        return self

    def __exit__(self, *exc) -> None:
        for proc in self.procs:
            if proc.p.poll() is None:
                proc.p.send_signal(signal.SIGKILL)
        for proc in self.procs:
            try:
                proc.p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
