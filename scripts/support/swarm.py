"""Loopback swarms of real processes: a sentinel and `diffuse join` peers, each on an identity
file of its own, so that a SIGKILLed peer restarts as itself (Swarm, as tests start them); the
benchmark swarm of bench_swarm.py, bench_failover.py and hop_breakdown.py (the spans of PATHS and
REPLICA: Peers); and greedy decoding timed token by token."""

from __future__ import annotations

import signal
import time
from collections.abc import Sequence
from pathlib import Path

from diffuse.client.generate import stream_tokens
from diffuse.client.pipeline import Pipeline
from diffuse.client.sampling import Sampler, SamplingParams
from diffuse.control.host import parse_peer_addr
from diffuse.control.modes import PRIVATE

from .procs import Procs

LOCAL = "/ip4/127.0.0.1/tcp/0"
# Records expired fast, so that a dead peer's record goes soon, and renewed three times in their
# life, no more: every beat costs each idle peer signatures and DHT stores (scripts/bench_idle.py),
# and two test swarms share two cores.
QUICK_RECORDS = ("--heartbeat", "10", "--ttl", "30")
PROMPT = "1, 2, 3, 4, 5, 6, 7, 8,"  # a count: greedy decoding never ends it by itself
PATHS = {"1 hop": {"P": "0:30"}, "2 hops": {"Q0": "0:15", "Q1": "15:30"},
         "3 hops": {"T0": "0:10", "T1": "10:20", "T2": "20:30"}}
REPLICA = {"R": "15:30"}  # with Q0 and Q1: the failover group


class Swarm:
    """A sentinel plus peers, children of `procs`: each peer's process, address and id, restartable
    by name. `join`: what every peer's command line adds (model, dtype, mode, record timing);
    `extra`: what one peer's adds (`--listen` included: LOCAL where it names none); `sentinel`:
    what the sentinel's adds."""

    def __init__(self, procs: Procs, tmp: Path, spans: dict[str, str], extra: dict[str, list[str]] | None = None,
                 join: Sequence[str] = QUICK_RECORDS, sentinel: Sequence[str] = (), timeout: float = 180.0):
        tmp.mkdir(parents=True, exist_ok=True)
        self.procs, self.tmp, self.extra, self.join, self.timeout = procs, tmp, extra or {}, join, timeout
        boot = procs.start("sentinel", "--identity", str(tmp / "sentinel.key"), "--listen", LOCAL, *sentinel)
        self.boot = boot.readline(timeout=120)
        self.spans, self.proc, self.ids, self.addrs = spans, {}, {}, {}
        for name in spans:
            self.start(name)
        for name in spans:
            self.wait(name)

    def start(self, name: str) -> None:
        extra = self.extra.get(name, [])
        listen = [] if "--listen" in extra else ["--listen", LOCAL]
        self.proc[name] = self.procs.start("join", "--identity", str(self.tmp / f"{name}.key"), "--bootstrap",
                                           self.boot, *listen, "--blocks", self.spans[name], *self.join, *extra)

    def wait(self, name: str) -> None:
        lines = self.proc[name].read_until("serving", timeout=self.timeout)
        self.addrs[name] = lines[0]
        self.ids[name] = parse_peer_addr(lines[0]).peer_id.to_base58()

    def kill(self, name: str) -> None:
        """SIGKILL the peer and reap it."""
        self.proc[name].signal(signal.SIGKILL)
        self.proc[name].wait(timeout=10)

    def name_of(self, peer_id: str) -> str:
        return next(n for n, p in self.ids.items() if p == peer_id)


class Peers:
    """The benchmark swarm, launched on demand: the spans of PATHS and REPLICA (or `spans`, set
    before `launch`), in `mode`: public, or private on the key that in-process nodes take as
    `swarm_key`. Its peers take every core, as a peer lending its machine would."""

    def __init__(self, home: Path, tmp: Path, dtype: str, timeout: float = 300.0, mode: str = "public"):
        self.tmp, self.dtype, self.timeout, self.mode = tmp, dtype, timeout, mode
        self.spans = {n: s for group in [*PATHS.values(), REPLICA] for n, s in group.items()}
        self.procs = Procs(home, one_thread=False)
        self.swarm_key = self.procs.swarm_key if mode == PRIVATE else None

    def launch(self) -> None:
        mode = ["--mode", self.mode]
        self.swarm = Swarm(self.procs, self.tmp, self.spans, join=["--dtype", self.dtype, *mode], sentinel=mode,
                           timeout=self.timeout)
        self.boot, self.ids = self.swarm.boot, self.swarm.ids

    def start(self, name: str) -> None:
        self.swarm.start(name)

    def wait(self, name: str) -> None:
        self.swarm.wait(name)

    def kill(self, name: str) -> None:
        self.swarm.kill(name)

    def stop(self) -> None:
        self.procs.close()


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

