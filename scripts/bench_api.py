#!/usr/bin/env python
"""`diffuse api` vs the client library: N concurrent streaming clients, time to first token and
tokens/s per client and in total, on a local model and on a loopback swarm.

    .venv/bin/python scripts/bench_api.py [--backends local,swarm] [--clients 1,4,16] [--tokens 32]
                                          [--rounds 2] [--threads N]

"direct" runs N `Generation`s concurrently in this process (each in a session of its own);
"api" runs N streaming clients of the official `openai` package (asyncio) against a
`diffuse api` subprocess serving the same weights in the same dtype: `--local`, or
`--bootstrap` into a loopback swarm (a sentinel and one peer serving every block; the API and
the direct client both run block 0 and the head themselves, as every swarm client does, and
neither runs the trust plane's canaries). Both generate the same greedy tokens from the same
prompt (a count that never ends by itself). Every client of a round starts at the same instant,
so TTFT includes waiting behind the other clients' prefills in both modes. Rounds alternate
direct and api so machine noise hits both alike; each cell is the median over rounds.

On a busy machine the model's own step time swings by more than the API costs, so a second
table measures that cost alone: the same two paths over a model that costs nothing (fixed
logits), whose per-token difference is all HTTP, JSON, SSE and client parsing. Its share of a
real token's time (direct, same N) is the number the < 5% target is about.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

os.environ.setdefault("GOMP_SPINCOUNT", "10000")  # idle OpenMP threads must not steal the server's cores
os.environ["DIFFUSE_TRAIN_DRAFT"] = "0"  # the peers and APIs it starts train no draft head behind the measurement
if "--threads" in sys.argv:  # before torch starts; the servers inherit it (and use it in every thread)
    os.environ["OMP_NUM_THREADS"] = sys.argv[sys.argv.index("--threads") + 1]

import openai  # noqa: E402
import torch  # noqa: E402
import trio  # noqa: E402

from diffuse.client.generate import Generation  # noqa: E402
from diffuse.client.local import open_local  # noqa: E402
from diffuse.client.sampling import SamplingParams  # noqa: E402
from diffuse.home import data_home  # noqa: E402
from diffuse.model import store  # noqa: E402
from diffuse.model.tokenizer import Tokenizer  # noqa: E402
from diffuse.model.weights import load_manifest  # noqa: E402
from support.procs import DIFFUSE, start_server  # noqa: E402

PROMPT = "1, 2, 3, 4, 5, 6, 7, 8,"


@dataclass
class Client:
    start: float
    first: float
    end: float
    tokens: int

    @property
    def per_token_s(self) -> float:
        return (self.end - self.first) / max(1, self.tokens - 1)


def summary(clients: list[Client]) -> dict[str, float]:
    wall = max(c.end for c in clients) - min(c.start for c in clients)
    return {"ttft_ms": 1e3 * statistics.mean(c.first - c.start for c in clients),
            "client_tps": statistics.mean(1 / c.per_token_s for c in clients),
            "total_tps": sum(c.tokens for c in clients) / wall,
            "token_ms": 1e3 * statistics.mean(c.per_token_s for c in clients)}


async def direct_round(open_session: Callable, tokenizer, prompt: list[int], n: int, tokens: int) -> list[Client]:
    """N sessions at once. They all start now: a start taken when each task first runs would
    exclude the prefills of the tasks before it (a local model never yields while it computes),
    which once made direct TTFT look 7x better than the API's at N=16."""
    out: list[Client] = []
    params = SamplingParams(temperature=0.0, max_tokens=tokens)
    start = time.perf_counter()

    async def one() -> None:
        pipeline = await open_session(len(prompt) + tokens)
        first = None
        try:
            gen = Generation(pipeline, tokenizer, prompt, params)
            async for _ in gen:
                first = first or time.perf_counter()
                # Hand the piece on, as any consumer does: a local model never waits, so without
                # this checkpoint one session would run to its end before the next could start.
                await trio.lowlevel.checkpoint()
        finally:
            await pipeline.close()
        out.append(Client(start, first, time.perf_counter(), len(gen.completion.token_ids)))

    async with trio.open_nursery() as nursery:
        for _ in range(n):
            nursery.start_soon(one)
    return out


async def api_round(url: str, model_id: str, n: int, tokens: int) -> list[Client]:
    """A client per round: its connection pool belongs to this round's event loop."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)

    async def one() -> Client:
        start, first, count = time.perf_counter(), None, 0
        stream = await client.completions.create(model=model_id, prompt=PROMPT, max_tokens=tokens, temperature=0,
                                                 stream=True, stream_options={"include_usage": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                first = first or time.perf_counter()
            if chunk.usage:
                count = chunk.usage.completion_tokens
        return Client(start, first, time.perf_counter(), count)

    async with client:
        return list(await asyncio.gather(*(one() for _ in range(n))))


class NullPipeline:
    """A model that costs nothing: the same logits at every step, never an end of turn."""

    def __init__(self, logits: torch.Tensor):
        self.logits = logits

    async def forward(self, ids, positions=None, tree_mask=None, commit=True, rows=None) -> torch.Tensor:
        return self.logits

    async def close(self) -> None:
        pass

    def defer_checks(self) -> None:  # no trust plane here: nothing is ever checked behind the answer
        pass

    def unverified_from(self) -> int | None:
        return None

    async def settle(self) -> None:
        pass


class NullBackend:
    """The Backend protocol over NullPipeline, with the real tokenizer (detokenising is real work)."""

    def __init__(self, home, name: str | None):
        path = store.resolve(home, name)
        self.model_id, self.tok = load_manifest(path).model_id, Tokenizer.load(path)
        self.logits = torch.zeros(1, 1, self.tok.vocab_size)
        self.logits[0, 0, self.tok.encode(" 1")[-1]] = 1.0

    async def open_session(self, max_len: int) -> NullPipeline:
        return NullPipeline(self.logits)

    async def models(self) -> list[dict]:
        return []

    def tokenizer(self, model_id: str) -> Tokenizer:
        return self.tok

    def context_length(self, model_id: str) -> int:
        return 1 << 20

    async def session(self, model_id: str, max_len: int) -> NullPipeline:
        return await self.open_session(max_len)


def serve_null(home: str, name: str | None) -> None:
    """The null server's process: the real API app over NullBackend."""
    from diffuse.api.app import Settings, create_app
    from diffuse.http import serve_http

    app = create_app(NullBackend(data_home(home), name), Settings(max_sessions=1024))

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            print("listening on", (await nursery.start(serve_http, app, "127.0.0.1:0"))[0], flush=True)

    trio.run(main)


def start_swarm(home: str, model: list[str], dtype: str, max_sessions: int, servers: list) -> tuple[str, str]:
    """A sentinel, one peer serving every block, and `diffuse api --bootstrap` (appended to
    `servers` as they start); returns the bootstrap address and the API's URL."""
    base = [*DIFFUSE, "--home", home]
    listen = ["--listen", "/ip4/127.0.0.1/tcp/0"]
    ident = tempfile.mkdtemp(prefix="bench_api_")
    servers.append(start_server([*base, "sentinel", "--identity", f"{ident}/s.key", *listen], ready=""))
    boot = servers[-1][1]
    servers.append(start_server([*base, "join", "--identity", f"{ident}/p.key", "--bootstrap", boot, *listen,
                                 "--blocks", "0:30", "--dtype", dtype, *model],
                                ready="serving "))
    servers.append(start_server([*base, "api", "--bootstrap", boot, "--listen", "127.0.0.1:0", "--dtype", dtype,
                                 "--no-trust", "--wait", "60", "--max-sessions", str(max_sessions), *model]))
    return boot, servers[-1][1]


def swarm_direct(home, model: str | None, dtype: str, boot: str, tokenizer, prompt: list[int], n: int,
                 tokens: int) -> list[Client]:
    """A round of direct clients through the swarm: a client node of its own (as `diffuse ask`),
    warmed by one short session (the API's client has measured its route already)."""
    from libp2p.crypto.ed25519 import create_new_key_pair

    from diffuse.client.swarm import SwarmClient, SwarmOptions
    from diffuse.control.node import NodeConfig, open_node
    from diffuse.model.load import parse_dtype

    async def run() -> list[Client]:
        async with open_node(create_new_key_pair(), NodeConfig(listen=["/ip4/127.0.0.1/tcp/0"], bootstrap=[boot],
                                                               server=False)) as node:
            options = SwarmOptions(dtype=parse_dtype(dtype))
            options.trust = None  # as the API's --no-trust
            client = SwarmClient(node, store.resolve(home, model), options)
            while not await client.covered():
                await trio.sleep(0.25)
            await direct_round(client.session, tokenizer, prompt, 1, 2)
            return await direct_round(client.session, tokenizer, prompt, n, tokens)

    return trio.run(run)


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time of this process and of `pids` (Linux /proc), all threads."""
    total = time.process_time()
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()  # fields from the 3rd on: utime is the 14th
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def compare(sizes: list[int], rounds: int, direct: Callable, api: Callable, server: int) -> dict[int, dict[str, dict]]:
    """Per N, the median over rounds of each summary, direct and api alternating; CPU time counts
    this process (the clients) and, for api, the server's."""
    out = {}
    for n in sizes:
        runs: dict[str, list[dict[str, float]]] = {"direct": [], "api": []}
        for _ in range(rounds):
            for mode, run, pids in (("direct", direct, []), ("api", api, [server])):
                cpu = cpu_seconds(pids)
                clients = run(n)
                cpu = cpu_seconds(pids) - cpu
                runs[mode].append(summary(clients) | {"cpu_us": 1e6 * cpu / sum(c.tokens for c in clients)})
        out[n] = {mode: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for mode, rs in runs.items()}
    return out


def table(title: str, results: dict[int, dict[str, dict]]) -> None:
    print(f"\n{title}", flush=True)
    print("| clients | mode | TTFT ms | tok/s per client | tok/s total | ms per token per client | api/direct |")
    print("|---|---|---|---|---|---|---|")
    for n, modes in results.items():
        for mode, m in modes.items():
            ratio = m["token_ms"] / modes["direct"]["token_ms"]
            print(f"| {n} | {mode} | {m['ttft_ms']:.0f} | {m['client_tps']:.1f} | {m['total_tps']:.1f} "
                  f"| {m['token_ms']:.1f} | {ratio:.3f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--home")
    ap.add_argument("--model")
    ap.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "fp16"])
    ap.add_argument("--backends", default="local,swarm", help="local, swarm or both (comma-separated)")
    ap.add_argument("--clients", default="1,4,16", help="comma-separated numbers of concurrent clients")
    ap.add_argument("--tokens", type=int, default=32, help="tokens per client")
    ap.add_argument("--null-tokens", type=int, default=400, help="tokens per client over the null model")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, help="OpenMP threads per process (default: torch's; 1 is steadier "
                    "on a busy machine)")
    args = ap.parse_args()
    sizes = [int(n) for n in args.clients.split(",")]
    backends = args.backends.split(",")
    if not set(backends) <= {"local", "swarm"}:
        sys.exit("--backends takes local, swarm or both")

    home = data_home(args.home)
    model, tokenizer = open_local(home, args.model, args.dtype)
    null = NullBackend(home, args.model)
    prompt = tokenizer.encode(PROMPT, add_special=True)  # exactly what /v1/completions feeds the model
    model_arg = ["--model", args.model] if args.model else []
    servers: list[tuple[subprocess.Popen, str]] = []
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally: stop the servers
    real: dict[str, dict] = {}
    print(f"{null.model_id} {args.dtype}, prompt {len(prompt)} tokens, {args.tokens} greedy tokens per client, "
          f"{torch.get_num_threads()} torch threads, {os.cpu_count()} CPUs, median of {args.rounds} rounds", flush=True)

    async def local_session(max_len: int):
        return model.session(max_len)

    try:
        if "local" in backends:
            servers.append(start_server([*DIFFUSE, "--home", str(home), "api", "--local", "--listen", "127.0.0.1:0",
                                         "--dtype", args.dtype, "--max-sessions", str(max(sizes)), *model_arg]))
            url, pid = servers[-1][1], servers[-1][0].pid
            here = os.path.dirname(os.path.abspath(__file__))
            serve = f"import sys; sys.path.insert(0, {here!r}); import bench_api; bench_api.serve_null({str(home)!r}, "
            servers.append(start_server([sys.executable, "-c", serve + f"{args.model!r})"]))
            null_url, null_pid = servers[-1][1], servers[-1][0].pid
            trio.run(direct_round, local_session, tokenizer, prompt, 1, 4)  # warm-up of both sides
            asyncio.run(api_round(url, null.model_id, 1, 4))
            real["local"] = compare(sizes, args.rounds,
                                    lambda n: trio.run(direct_round, local_session, tokenizer, prompt, n, args.tokens),
                                    lambda n: asyncio.run(api_round(url, null.model_id, n, args.tokens)), pid)
            table("local: `diffuse api --local` vs Generation in this process", real["local"])
            free = compare(sizes, args.rounds,
                           lambda n: trio.run(direct_round, null.open_session, tokenizer, prompt, n, args.null_tokens),
                           lambda n: asyncio.run(api_round(null_url, null.model_id, n, args.null_tokens)), null_pid)
        if "swarm" in backends:
            boot, swarm_url = start_swarm(str(home), model_arg, args.dtype, max(sizes), servers)
            asyncio.run(api_round(swarm_url, null.model_id, 1, 4))  # warm-up: routes, RTTs, first forward
            real["swarm"] = compare(
                sizes, args.rounds,
                lambda n: swarm_direct(home, args.model, args.dtype, boot, tokenizer, prompt, n, args.tokens),
                lambda n: asyncio.run(api_round(swarm_url, null.model_id, n, args.tokens)), servers[-1][0].pid)
            table("swarm: `diffuse api --bootstrap` vs SwarmClient sessions in this process, one loopback peer "
                  "(blocks 0:30)", real["swarm"])
    finally:
        for proc, _ in reversed(servers):
            proc.terminate()
            proc.wait(30)

    if "local" in real:
        print(f"\nThe API's own cost per token: the same paths over a model that costs nothing "
              f"({args.null_tokens} tokens per client); CPU counts the clients and the server")
        print("| clients | direct us/token | api us/token | direct CPU us/token | api CPU us/token "
              "| API CPU cost us/token | share of a real token (direct) |")
        print("|---|---|---|---|---|---|---|")
        for n in sizes:
            d, a = free[n]["direct"], free[n]["api"]
            cost = a["cpu_us"] - d["cpu_us"]  # every CPU microsecond the API spends is one the model may wait for
            real_us = 1e6 / real["local"][n]["direct"]["total_tps"]
            print(f"| {n} | {1e6 / d['total_tps']:.0f} | {1e6 / a['total_tps']:.0f} | {d['cpu_us']:.0f} "
                  f"| {a['cpu_us']:.0f} | {cost:.0f} | {100 * cost / real_us:.2f}% |")


if __name__ == "__main__":
    main()
