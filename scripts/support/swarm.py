"""bench_swarm.py's loopback swarm, shared by the scripts that decode through one: a sentinel and
`diffuse join` peers as processes on 127.0.0.1 (the spans of PATHS and REPLICA, each peer on an
identity file of its own, so a SIGKILLed peer restarts as itself), and greedy decoding timed
token by token."""

from __future__ import annotations

import time
from pathlib import Path

from diffuse.cli.demo import Child
from diffuse.client.generate import stream_tokens
from diffuse.client.pipeline import Pipeline
from diffuse.client.sampling import Sampler, SamplingParams
from diffuse.control.host import parse_peer_addr
from diffuse.control.modes import PRIVATE
from diffuse.control.swarm_key import SwarmKey, write_key

LOCAL = "/ip4/127.0.0.1/tcp/0"
PROMPT = "1, 2, 3, 4, 5, 6, 7, 8,"  # a count: greedy decoding never ends it by itself
PATHS = {"1 hop": {"P": "0:30"}, "2 hops": {"Q0": "0:15", "Q1": "15:30"},
         "3 hops": {"T0": "0:10", "T1": "10:20", "T2": "20:30"}}
REPLICA = {"R": "15:30"}  # with Q0 and Q1: the failover group


class Peers:
    """The sentinel and peer processes of one swarm; a peer can be SIGKILLed and restarted on its
    identity. mode private: a swarm key made in `tmp`, which in-process nodes take as `swarm_key`."""

    def __init__(self, home: Path, tmp: Path, dtype: str, timeout: float = 300.0, mode: str = "public"):
        self.home, self.tmp, self.dtype, self.timeout, self.mode = home, tmp, dtype, timeout, mode
        self.spans = {n: s for group in [*PATHS.values(), REPLICA] for n, s in group.items()}
        self.proc: dict[str, Child] = {}
        self.ids: dict[str, str] = {}
        self.sentinel: Child | None = None
        self.swarm_key = SwarmKey.generate() if mode == PRIVATE else None
        self.swarm_args = ["--mode", mode]
        if self.swarm_key is not None:
            tmp.mkdir(parents=True, exist_ok=True)
            write_key(tmp / "swarm.key", self.swarm_key)
            self.swarm_args += ["--swarm-key", str(tmp / "swarm.key")]

    def launch(self) -> None:
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.sentinel = Child("sentinel", ["--home", str(self.home), "sentinel", "--identity", str(self.tmp / "s.key"),
                                           "--listen", LOCAL, *self.swarm_args], self.tmp / "sentinel.log")
        self.boot = self.sentinel.wait_for("/ip4/", self.timeout)
        for name in self.spans:
            self.start(name)
        for name in self.spans:
            self.wait(name)

    def start(self, name: str) -> None:
        self.proc[name] = Child(name, ["--home", str(self.home), "join", "--bootstrap", self.boot,
                                       "--blocks", self.spans[name], "--dtype", self.dtype,
                                       "--identity", str(self.tmp / f"{name}.key"), "--listen", LOCAL,
                                       *self.swarm_args], self.tmp / f"{name}.log")

    def wait(self, name: str) -> None:
        addr = self.proc[name].wait_for("/ip4/", self.timeout)
        self.ids[name] = parse_peer_addr(addr).peer_id.to_base58()
        self.proc[name].wait_for("serving ", self.timeout)

    def kill(self, name: str) -> None:
        self.proc[name].p.kill()
        self.proc[name].p.wait()
        self.proc[name].stop()  # closes its log

    def stop(self) -> None:
        for child in [*self.proc.values(), *([self.sentinel] if self.sentinel else [])]:
            child.stop()


async def decode(pipe: Pipeline, prompt: list[int], tokens: int, on_token=None) -> tuple[list[int], list[float]]:
    """Greedy tokens and the time each one appeared; on_token(i) runs after token i."""
    ids, stamps = [], []
    try:
        async for t in stream_tokens(pipe, prompt, Sampler(SamplingParams(max_tokens=tokens)), set()):
            stamps.append(time.perf_counter())
            ids.append(t)
            if on_token is not None:
                on_token(len(ids) - 1)
    finally:
        await pipe.close()
    return ids, stamps


def decode_tps(stamps: list[float]) -> float:
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])

