#!/usr/bin/env python
"""Continuous batching: N concurrent greedy sessions through one peer, and N requests through the API.

    .venv/bin/python scripts/bench_batching.py [--dtypes fp32,bf16] [--sessions 1,4,8,16] [--tokens 48]
                                               [--exact] [--no-api] [--threads N]
    .venv/bin/python scripts/bench_batching.py --pipeline [--dtypes fp32] [--sessions 1,8,16]
    .venv/bin/python scripts/bench_batching.py --fixed-threads [--own-caches] [--no-api] ...

Per dtype, a sentinel and one `diffuse join --blocks 1:30` process; this process is the load
generator: a SwarmClient that runs block 0 and the LM head itself, batched across its sessions as
`diffuse api` does, and no trust plane (its canaries would add sessions of their own). Each
session has its own chat prompt (mixed lengths) and generates --tokens greedy tokens, no end of
turn. Baseline, measured in the same run: one session alone.

    aggregate   tokens of all sessions / wall time from their common start to the last token
    session     a session's tokens / its own wall time (prefill included), mean over sessions

Through the API (`diffuse api --bootstrap`, same peer): the same table for N streaming requests
of ~23-token prompts, and time to first token: p50 and max of 16 concurrent requests against
one lone request's, and against prefilling all 16 prompts back to back (16 requests of one token
in a row); and, as the median's floor, the time until 8 concurrent requests all have their first
token (median of three bursts): the median of 16 cannot have its first token before 8 prompts
went through the model, and 8 alone go through no later than with 8 more beside them. Beside it,
two floors of that ratio without HTTP: this process's SwarmClient giving 8 prompts their first
token at once against one, and the compute alone (every block and the head in this process, 8
prompts in one forward against one), from which the median's floor if all 16 arrived at once (a
lone request's time with one prompt's compute replaced by 8 prompts'); and the cores the peer, the
API and this process used during the burst.
--exact adds exact sessions (batch-invariant kernels everywhere) and their ratio to fast ones.
The peer's batch counters (/metrics) say how many steps shared a forward pass.
--fixed-threads adds the peer's table with every batch on the configured thread count
(DIFFUSE_THREADS=fixed in the peer and this process) and the ratio of the measured choice to it.
--own-caches adds the peer's table with every session's cache in memory of its own
(DIFFUSE_SLABS=0: one attention call per session and layer, not one per slab) and the ratio of
slabs to it.
--pipeline compares two peers of half the blocks each, on a core each, with one peer of all the
blocks on one core: while one group of sessions computes at one peer, another can at the other.
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
from pathlib import Path

os.environ.setdefault("GOMP_SPINCOUNT", "10000")
os.environ["DIFFUSE_TRAIN_DRAFT"] = "0"  # the peers and APIs it starts train no draft head behind the measurement
if "--threads" in sys.argv:
    os.environ["OMP_NUM_THREADS"] = sys.argv[sys.argv.index("--threads") + 1]

import httpx  # noqa: E402
import openai  # noqa: E402
import torch  # noqa: E402
import trio  # noqa: E402
from libp2p.crypto.ed25519 import create_new_key_pair  # noqa: E402

from diffuse.client.generate import stream_tokens  # noqa: E402
from diffuse.client.local import open_local  # noqa: E402
from diffuse.client.sampling import Sampler, SamplingParams  # noqa: E402
from diffuse.client.swarm import SwarmClient, SwarmOptions  # noqa: E402
from diffuse.control.node import NodeConfig, open_node  # noqa: E402
from diffuse.control.swarm_key import read_key  # noqa: E402
from diffuse.data.scheduler import THREADS_ENV  # noqa: E402
from diffuse.home import data_home  # noqa: E402
from diffuse.model import store  # noqa: E402
from diffuse.model.engine import SLABS_ENV, SpanStep  # noqa: E402
from diffuse.model.load import parse_dtype  # noqa: E402
from diffuse.model.tokenizer import Tokenizer  # noqa: E402
from diffuse.model.weights import load_manifest  # noqa: E402
from diffuse.trust import reputation  # noqa: E402
from support.procs import DIFFUSE, free_port, start_server  # noqa: E402

LISTEN = ["--listen", "/ip4/127.0.0.1/tcp/0"]
TOPICS = ["the ocean", "volcanoes", "the moon", "bread", "rivers", "trains", "bees", "glass", "chess", "rain",
          "deserts", "owls", "copper", "tea", "clocks", "maps"]


def questions(n: int) -> list[str]:
    """n chat questions of mixed lengths (a short one, a longer one, in turn)."""
    return [f"Tell me about {TOPICS[i % len(TOPICS)]}." if i % 2 == 0 else
            f"Write a long and careful explanation, for a curious child, of {TOPICS[i % len(TOPICS)]} and why "
            f"it matters to people." for i in range(n)]


def completion_prompts(n: int) -> list[str]:
    """n raw prompts of ~23 tokens each, all different."""
    return [f"Here is a short story about {TOPICS[i % len(TOPICS)]}, written for children who are learning to "
            f"read. Once upon a time" for i in range(n)]


async def peer_round(client: SwarmClient, prompts: list[list[int]], tokens: int, exact: bool) -> list[tuple]:
    """The prompts as sessions at once; per session (start, end, tokens)."""
    out: list[tuple] = []
    start = time.perf_counter()

    async def one(prompt: list[int]) -> None:
        pipe = await client.session(len(prompt) + tokens, exact=exact)
        count = 0
        try:
            async for _ in stream_tokens(pipe, prompt, Sampler(SamplingParams(max_tokens=tokens)), set()):
                count += 1
        finally:
            await pipe.close()
        out.append((start, time.perf_counter(), count))

    async with trio.open_nursery() as nursery:
        for p in prompts:
            nursery.start_soon(one, p)
    return out


async def prefill_floor(client: SwarmClient, tok: Tokenizer) -> tuple[float, float]:
    """Seconds to the first token of one completion prompt alone, and of the last of 8 at once
    (medians of three): what the API's TTFT figures cost in compute alone, without HTTP."""
    prompts = [tok.encode(p) for p in completion_prompts(8)]
    times = {}
    for n in (1, 8):
        times[n] = statistics.median([max(e for _, e, _ in got) - got[0][0]
                                      for got in [await peer_round(client, prompts[:n], 1, False) for _ in range(3)]])
    return times[1], times[8]


def compute_floor(home, model: str | None, dtype: str) -> tuple[float, float]:
    """Seconds for one completion prompt and for 8 in one forward through every block and the
    head, in this process alone (medians of five)."""
    engine, tok = open_local(home, model, dtype)
    head, (span,) = engine.head, engine.spans
    prompts = [tok.encode(p) for p in completion_prompts(8)]

    def once(n: int) -> float:
        t0 = time.perf_counter()
        steps = [SpanStep(head.embed_tokens(torch.tensor([p])), torch.arange(len(p)), span.new_cache(len(p)))
                 for p in prompts[:n]]
        head.logits(torch.cat([h[:, -1:] for h in span.forward_batch(steps)], 1))
        return time.perf_counter() - t0

    once(8)  # warm-up
    return statistics.median(once(1) for _ in range(5)), statistics.median(once(8) for _ in range(5))


def rates(sessions: list[tuple]) -> tuple[float, float]:
    """(aggregate tokens/s, mean per-session tokens/s)."""
    wall = max(e for _, e, _ in sessions) - min(s for s, _, _ in sessions)
    return sum(c for *_, c in sessions) / wall, statistics.mean(c / (e - s) for s, e, c in sessions)


def batch_counters(url: str) -> dict[str, float]:
    got = {}
    for line in httpx.get(url, timeout=10).text.splitlines():
        for name in ("diffuse_batches_total", "diffuse_batch_steps_total"):
            if line.startswith(name):
                got[name] = got.get(name, 0.0) + float(line.split()[-1])
    return got


def peer_bench(home, model: str | None, dtype: str, boot: str, key_path: str, sizes: list[int], tokens: int,
               kinds: list[bool], metrics: str, floor: bool = False) -> dict:
    """Per (exact, sessions) the rates and batch sizes; with `floor`, prefill_floor's two times
    under "floor"."""
    async def run() -> dict:
        async with open_node(create_new_key_pair(),
                             NodeConfig(listen=["/ip4/127.0.0.1/tcp/0"], bootstrap=[boot], server=False,
                                        swarm_key=read_key(Path(key_path))), codecs=reputation.swarm_codecs()) as node:
            model_dir = store.resolve(home, model)
            client = SwarmClient(node, model_dir, SwarmOptions(dtype=parse_dtype(dtype), trust=None))
            tok = Tokenizer.load(model_dir)
            while not await client.covered():
                await trio.sleep(0.25)
            chats = [tok.encode_chat([{"role": "user", "content": q}]) for q in questions(max(sizes))]
            await peer_round(client, chats[:1], 4, False)  # warm-up: route, RTTs, first forwards
            out: dict = {"floor": await prefill_floor(client, tok)} if floor else {}
            for exact in kinds:
                for n in sizes:
                    before = batch_counters(metrics)
                    agg, per = rates(await peer_round(client, chats[:n], tokens, exact))
                    after = batch_counters(metrics)
                    batches = after["diffuse_batches_total"] - before["diffuse_batches_total"]
                    steps = after["diffuse_batch_steps_total"] - before["diffuse_batch_steps_total"]
                    out[exact, n] = {"agg": agg, "per": per, "steps_per_batch": steps / max(1, batches)}
                    print(f"  {dtype} {'exact' if exact else 'fast'} x{n}: {agg:.1f} tok/s aggregate", flush=True)
            return out

    return trio.run(run)


async def api_round(url: str, model_id: str, prompts: list[str], tokens: int) -> list[tuple]:
    """The prompts as concurrent streaming requests; per request (start, first token, end, tokens)."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=900)
    start = time.perf_counter()

    async def one(prompt: str) -> tuple:
        first, count = None, 0
        stream = await client.completions.create(model=model_id, prompt=prompt, max_tokens=tokens, temperature=0,
                                                 stream=True, stream_options={"include_usage": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                first = first or time.perf_counter()
            if chunk.usage:
                count = chunk.usage.completion_tokens
        return start, first or time.perf_counter(), time.perf_counter(), count

    async with client:
        return list(await asyncio.gather(*(one(p) for p in prompts)))


def cpu_seconds(pid: int) -> float:
    """User and system CPU time a process has used so far (/proc/PID/stat's utime and stime)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def api_bench(url: str, model_id: str, sizes: list[int], tokens: int, pids: dict[str, int]) -> tuple[dict, dict]:
    asyncio.run(api_round(url, model_id, completion_prompts(1), 4))  # warm-up
    table = {}
    for n in sizes:
        got = asyncio.run(api_round(url, model_id, completion_prompts(n), tokens))
        table[n] = rates([(s, e, c) for s, _, e, c in got])
    lone = statistics.median(f - s for s, f, _, _ in (asyncio.run(api_round(url, model_id, completion_prompts(1), 2))[0]
                                                       for _ in range(3)))
    t0 = time.perf_counter()
    for p in completion_prompts(16):
        asyncio.run(api_round(url, model_id, [p], 1))
    back_to_back = time.perf_counter() - t0
    before = {name: cpu_seconds(pid) for name, pid in pids.items()} | {"this process": time.process_time()}
    t0 = time.perf_counter()
    ttft = sorted(f - s for s, f, _, _ in asyncio.run(api_round(url, model_id, completion_prompts(16), tokens)))
    wall = time.perf_counter() - t0
    after = {name: cpu_seconds(pid) for name, pid in pids.items()} | {"this process": time.process_time()}
    cpu = {name: (after[name] - before[name]) / wall for name in before}
    # The median of 16 needs 8 prompts through the model: 8 requests alone, all answered, bound it from below.
    floor = statistics.median(max(f - s for s, f, _, _ in asyncio.run(
        api_round(url, model_id, completion_prompts(8), 1))) for _ in range(3))
    return table, {"lone": lone, "back_to_back": back_to_back, "p50": statistics.median(ttft), "max": ttft[-1],
                   "floor": floor, "cpu": cpu}


def print_rates(title: str, table: dict[int, tuple[float, float]], extra: dict[int, str] | None = None) -> None:
    print(f"\n{title}")
    print("| sessions | aggregate tok/s | aggregate / 1 session | per-session tok/s | per-session / alone |"
          + (" steps per batch (peer) |" if extra else ""))
    print("|---|---|---|---|---|" + ("---|" if extra else ""))
    base_agg, base_per = table[min(table)]
    for n, (agg, per) in table.items():
        print(f"| {n} | {agg:.1f} | {agg / base_agg:.2f}x | {per:.1f} | {per / base_per:.2f}x |"
              + (f" {extra[n]} |" if extra else ""), flush=True)


def pipeline_bench(home, model: str | None, dtype: str, sizes: list[int], tokens: int) -> None:
    """Pipeline parallelism through the star topology: while one group of sessions computes at the
    first peer, another computes at the second. Each peer is pinned to a core of its own (taskset),
    as a machine of its own would be; the baseline is one peer of all 29 blocks on one core."""
    base, model_arg = [*DIFFUSE, "--home", str(home)], (["--model", model] if model else [])
    results = {}
    for layout, peers in (("one", [("1:30", 1)]), ("split", [("1:15", 0), ("15:30", 1)])):
        ident, servers = tempfile.mkdtemp(prefix="bench_batching_"), []
        key = ["--swarm-key", f"{ident}/swarm.key"]
        try:
            subprocess.run([*base, "swarm", "new", "--out", f"{ident}/swarm.key"], check=True,
                           stdout=subprocess.DEVNULL)
            servers.append(start_server([*base, "sentinel", "--identity", f"{ident}/s.key", *LISTEN, *key], ready=""))
            boot, ports = servers[-1][1], []
            for i, (blocks, core) in enumerate(peers):
                ports.append(free_port())
                servers.append(start_server(["taskset", "-c", str(core), *base, "join", "--identity",
                                             f"{ident}/p{i}.key", "--bootstrap", boot, *LISTEN, *key, "--blocks",
                                             blocks, "--dtype", dtype,
                                             "--metrics", f"127.0.0.1:{ports[-1]}", *model_arg], ready="serving "))
            got = peer_bench(home, model, dtype, boot, f"{ident}/swarm.key", sizes, tokens, [False],
                             f"http://127.0.0.1:{ports[0]}/metrics")
            results[layout] = {n: got[False, n]["agg"] for n in sizes}
        finally:
            for proc, _ in reversed(servers):
                proc.terminate()
                proc.wait(30)
    print(f"\npipeline, {dtype}: two peers (1:15 on core 0, 15:30 on core 1) against one (1:30 on core 1)")
    print("| sessions | one peer tok/s | two peers tok/s | two / one |")
    print("|---|---|---|---|")
    for n in sizes:
        print(f"| {n} | {results['one'][n]:.1f} | {results['split'][n]:.1f} | "
              f"{results['split'][n] / results['one'][n]:.2f}x |", flush=True)


def baseline_bench(env: str, value: str, base, ident, boot, key, dtype, model_arg, home, args,
                   sizes) -> dict[int, dict]:
    """The fast-session peer round again, with a new peer on blocks 1:30 (the one before has left)
    and this client both run with the environment variable `env` = `value`."""
    os.environ[env] = value
    port = free_port()
    peer = start_server([*base, "join", "--identity", f"{ident}/{env}.key", "--bootstrap", boot, *LISTEN, *key,
                         "--blocks", "1:30", "--dtype", dtype,
                         "--metrics", f"127.0.0.1:{port}", *model_arg], ready="serving ")
    try:
        got = peer_bench(home, args.model, dtype, boot, f"{ident}/swarm.key", sizes, args.tokens, [False],
                         f"http://127.0.0.1:{port}/metrics")
        return {n: got[False, n] for n in sizes}
    finally:
        del os.environ[env]
        peer[0].terminate()
        peer[0].wait(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--home")
    ap.add_argument("--model")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--sessions", default="1,4,8,16")
    ap.add_argument("--tokens", type=int, default=48, help="greedy tokens per session")
    ap.add_argument("--exact", action="store_true", help="also exact sessions, as a ratio to fast ones")
    ap.add_argument("--no-api", action="store_true", help="the peer only")
    ap.add_argument("--threads", type=int, help="OpenMP threads per process")
    ap.add_argument("--fixed-threads", action="store_true",
                    help="also the peer and this client with every batch on the configured thread count "
                         "(DIFFUSE_THREADS=fixed), as a baseline for the measured choice")
    ap.add_argument("--own-caches", action="store_true",
                    help="also the peer and this client with every cache in memory of its own (DIFFUSE_SLABS=0), "
                         "as a baseline for slabs")
    ap.add_argument("--pipeline", action="store_true",
                    help="instead: two peers 1:15 and 15:30 on a core each against one peer 1:30 on one core")
    args = ap.parse_args()
    sizes = [int(n) for n in args.sessions.split(",")]
    if sizes[0] != 1:
        sys.exit("--sessions must start with 1 (the baseline)")
    home = data_home(args.home)
    model_arg = ["--model", args.model] if args.model else []
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    model_id = load_manifest(store.resolve(home, args.model)).model_id
    print(f"{model_id}: one peer (blocks 1:30), {args.tokens} greedy tokens per session, "
          f"{torch.get_num_threads()} torch threads, {os.cpu_count()} CPUs", flush=True)
    if args.pipeline:
        return pipeline_bench(home, args.model, args.dtypes.split(",")[0], sizes, args.tokens)
    for dtype in args.dtypes.split(","):
        compute = dict(zip(("one", "eight"), compute_floor(home, args.model, dtype)))
        servers: list[tuple[subprocess.Popen, str]] = []
        ident, port = tempfile.mkdtemp(prefix="bench_batching_"), free_port()
        key = ["--swarm-key", f"{ident}/swarm.key"]
        base = [*DIFFUSE, "--home", str(home)]
        try:
            subprocess.run([*base, "swarm", "new", "--out", f"{ident}/swarm.key"], check=True,
                           stdout=subprocess.DEVNULL)
            servers.append(start_server([*base, "sentinel", "--identity", f"{ident}/s.key", *LISTEN, *key], ready=""))
            boot = servers[-1][1]
            servers.append(start_server([*base, "join", "--identity", f"{ident}/p.key", "--bootstrap", boot, *LISTEN,
                                         *key, "--blocks", "1:30", "--dtype", dtype,
                                         "--metrics", f"127.0.0.1:{port}", *model_arg], ready="serving "))
            metrics = f"http://127.0.0.1:{port}/metrics"
            kinds = [False, True] if args.exact else [False]
            got = peer_bench(home, args.model, dtype, boot, f"{ident}/swarm.key", sizes, args.tokens, kinds, metrics,
                             floor=True)
            for exact in kinds:
                print_rates(f"peer, {dtype}, {'exact' if exact else 'fast'} sessions",
                            {n: (got[exact, n]["agg"], got[exact, n]["per"]) for n in sizes},
                            {n: f"{got[exact, n]['steps_per_batch']:.1f}" for n in sizes})
            one, eight = got["floor"]
            print(f"\nfirst token of ~23-token prompts in this process (no HTTP), {dtype}: 8 at once "
                  f"{eight:.2f} s = {eight / one:.2f}x one alone ({one:.2f} s)", flush=True)
            print(f"compute alone, {dtype} (every block and the head in one forward, before the swarm "
                  f"started): 8 prompts {compute['eight']:.2f} s = {compute['eight'] / compute['one']:.2f}x one "
                  f"({compute['one']:.2f} s)", flush=True)
            if args.exact:
                print(f"\nexact / fast aggregate, {dtype}: "
                      + ", ".join(f"{n} sessions {got[True, n]['agg'] / got[False, n]['agg']:.2f}x" for n in sizes))

            if not args.no_api:
                servers.append(start_server([*base, "api", "--bootstrap", boot, *key, "--listen", "127.0.0.1:0",
                                             "--dtype", dtype, "--no-trust", "--wait", "60", "--max-sessions",
                                             str(max(16, max(sizes))), *model_arg]))
                pids = {"peer": servers[1][0].pid, "API": servers[-1][0].pid}
                table, ttft = api_bench(servers[-1][1], model_id, sizes, args.tokens, pids)
                print_rates(f"API, {dtype}, streaming requests of ~23-token prompts", table)
                print(f"\nTTFT, {dtype}, 16 concurrent requests: p50 {ttft['p50']:.2f} s = "
                      f"{ttft['p50'] / ttft['lone']:.2f}x a lone request's ({ttft['lone']:.2f} s); "
                      f"max {ttft['max']:.2f} s "
                      f"= {ttft['max'] / ttft['back_to_back']:.2f}x 16 prefills back to back "
                      f"({ttft['back_to_back']:.2f} s); 8 concurrent requests all have their first token after "
                      f"{ttft['floor']:.2f} s = {ttft['floor'] / ttft['lone']:.2f}x a lone request's (the median of 16 "
                      f"waits for 8 prompts)", flush=True)
                bound = (ttft["lone"] - compute["one"] + compute["eight"]) / ttft["lone"]
                print(f"the median's floor, all 16 arriving at once: a lone request's time with its prompt's compute "
                      f"replaced by 8 prompts' in one forward = {bound:.2f}x; cores used during the burst: "
                      + ", ".join(f"{name} {share:.2f}" for name, share in ttft["cpu"].items())
                      + f" of {os.cpu_count()}", flush=True)
            for wanted, env, value, title, ratio in (
                    (args.fixed_threads, THREADS_ENV, "fixed", f"every batch on {torch.get_num_threads()} threads",
                     "threads chosen per batch / fixed"),
                    (args.own_caches, SLABS_ENV, "0", "every cache its own (one attention call per session)",
                     "slabs / own caches")):
                if not wanted:
                    continue
                for proc, _ in reversed(servers[1:]):  # the peer (and the API): a peer run the other way takes over
                    proc.terminate()
                    proc.wait(30)
                del servers[1:]
                other = baseline_bench(env, value, base, ident, boot, key, dtype, model_arg, home, args, sizes)
                print_rates(f"peer, {dtype}, fast sessions, {title}", {
                    n: (other[n]["agg"], other[n]["per"]) for n in sizes})
                print(f"\n{ratio}, aggregate, {dtype}: "
                      + ", ".join(f"{n} sessions {got[False, n]['agg'] / other[n]['agg']:.2f}x" for n in sizes))
        finally:
            for proc, _ in reversed(servers):
                proc.terminate()
                proc.wait(30)


if __name__ == "__main__":
    main()
