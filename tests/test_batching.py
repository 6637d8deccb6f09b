"""Many sessions at once through real peers (`diffuse join` processes, blocks 1:30 of SmolLM2 in
fp32): their steps share forward passes, and no guarantee changes.

- Exact sessions give bit-identical logits batched and alone (the peers' batch counters show
  they were batched with each other).
- Fast sessions (1, 4, 16 at once; mixed prompt lengths; plain, speculative and exact mixed)
  share forward passes and give the greedy answer they give alone, or differ only after a
  near-tie: each difference is shown with its top-2 logit gap.
- A SIGKILL of the batching peer with 8 sessions in flight fails all 8 over to the replica,
  their answers unchanged.
"""

from __future__ import annotations

import signal
import time

import httpx
import pytest
import torch
import trio
import trio.testing
from libp2p.crypto.ed25519 import create_new_key_pair

from support.procs import Procs, swarm_key
from support.swarm import LOCAL, QUICK_RECORDS, Swarm
from diffuse.client.generate import session_length, stream_tokens
from diffuse.client.sampling import Sampler, SamplingParams
from diffuse.client.speculative import SpecConfig, SpecState
from diffuse.client.swarm import SwarmClient, SwarmOptions, remote_of
from diffuse.control.node import NodeConfig, open_node
from diffuse.home import DEFAULT_MODEL, models_dir
from diffuse.model.tokenizer import Tokenizer
from diffuse.trust import reputation
from test_api_swarm import _metrics_url

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]
TOKENS = 12
QUESTIONS = ["What is the capital of France?", "Write a haiku about rain.", "Name three rivers.",
             "List the planets of the solar system in order, from the Sun outwards.", "Why is the sky blue?",
             "Explain in two sentences what a compiler does.", "2 + 2 =", "Say hello in French, Spanish and German."]


@pytest.fixture(scope="module")
def swarm(home, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("batching")
    with Procs(home) as procs:
        s = Swarm(procs, tmp, {"P": "1:30", "R": "1:30"},
                  join=["--dtype", "fp32", *QUICK_RECORDS, "--metrics", "127.0.0.1:0"], timeout=300)
        yield s, {n: _metrics_url(p) for n, p in s.proc.items()}


def batched_steps(metrics: dict[str, str]) -> float:
    total = 0.0
    for url in metrics.values():
        for line in httpx.get(url, timeout=10).text.splitlines():
            if line.startswith("diffuse_batched_steps_total"):
                total += float(line.split()[-1])
    return total


async def generate(client: SwarmClient, tok: Tokenizer, question: str, kind: str, logits: list | None = None,
                   on_token=None) -> list[int]:
    """One greedy answer: kind is plain, exact or spec (speculation, fast kernels). With `logits`,
    the logits of every step are appended (plain and exact: one row per token)."""
    prompt = tok.encode_chat([{"role": "user", "content": question}])
    cfg = SpecConfig() if kind == "spec" else None
    pipe = await client.session(session_length(len(prompt), TOKENS, cfg), exact=kind == "exact")
    try:
        if cfg is not None:
            return [t async for t in stream_tokens(pipe, prompt, Sampler(SamplingParams(max_tokens=TOKENS)), set(),
                                                   cfg, SpecState())]
        out, ids = [], torch.tensor([prompt])
        for _ in range(TOKENS):
            row = (await pipe.forward(ids, rows=slice(-1, None)))[0, -1]
            if logits is not None:
                logits.append(row)
            out.append(int(row.argmax()))
            ids = torch.tensor([[out[-1]]])
            if on_token is not None:
                on_token(pipe, len(out))
        return out
    finally:
        await pipe.close()


async def with_client(boot: str, home, body):
    model_dir = models_dir(home) / DEFAULT_MODEL
    async with open_node(create_new_key_pair(),
                         NodeConfig(listen=[LOCAL], bootstrap=[boot], server=False,
                                    swarm_key=swarm_key()), codecs=reputation.swarm_codecs()) as node:
        client = SwarmClient(node, model_dir, SwarmOptions(dtype=torch.float32, wire_dtype=torch.float32, trust=None))
        with trio.fail_after(60):
            while not await client.covered():
                await trio.sleep(0.25)
        return await body(client, Tokenizer.load(model_dir))


async def concurrently(fns) -> list:
    out: list = [None] * len(fns)

    async def one(i, fn):
        out[i] = await fn()

    async with trio.open_nursery() as nursery:
        for i, fn in enumerate(fns):
            nursery.start_soon(one, i, fn)
    return out


def test_exact_sessions_give_the_same_bits_batched_and_alone(swarm, home):
    s, metrics = swarm
    boot = s.boot
    questions = QUESTIONS[:4]

    async def body(client, tok):
        alone = []
        for q in questions:
            alone.append([])
            await generate(client, tok, q, "exact", alone[-1])
        before = batched_steps(metrics)
        together = [[] for _ in questions]
        await concurrently([lambda q=q, lg=lg: generate(client, tok, q, "exact", lg)
                            for q, lg in zip(questions, together)])
        return alone, together, batched_steps(metrics) - before

    alone, together, shared = trio.run(with_client, boot, home, body)
    assert shared > 0  # the peers computed steps of these sessions in shared forward passes
    for a, b in zip(alone, together):
        assert len(a) == len(b) == TOKENS and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("n", [1, 4, 16])
def test_concurrent_sessions_give_their_answers_alone_up_to_near_ties(swarm, home, n):
    s, metrics = swarm
    boot = s.boot
    kinds = ["plain", "spec", "exact"]
    jobs = [(QUESTIONS[i % len(QUESTIONS)] + " " * (i // len(QUESTIONS)), kinds[i % 3]) for i in range(n)]

    async def body(client, tok):
        alone, gaps = [], []
        for q, kind in jobs:
            lg: list = []
            alone.append(await generate(client, tok, q, "plain" if kind == "spec" else kind, lg))
            gaps.append([float(r.topk(2).values[0] - r.topk(2).values[1]) for r in lg])
        before = batched_steps(metrics)
        together = await concurrently([lambda q=q, k=k: generate(client, tok, q, k) for q, k in jobs])
        return alone, gaps, together, batched_steps(metrics) - before

    alone, gaps, together, shared = trio.run(with_client, boot, home, body)
    # The sessions were batched: with 4, one exact session (batched only with exact ones) and
    # three fast ones, so steps that shared a forward pass are fast sessions' steps.
    assert shared > 0 if n > 1 else shared == 0, shared
    for (q, kind), a, g, b in zip(jobs, alone, gaps, together):
        if a != b:
            i = next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
            print(f"{kind} {q!r}: differs at token {i}, where the top-2 gap alone is {g[i]:.2e}")
            assert kind != "exact" and g[i] < 1e-2, (kind, q, i, g[i])


NEAR_TIE = 1e-2  # a top-2 logit gap in fp32 that another order of summing (another batch) can reverse


@pytest.mark.parametrize("kind", ["exact", "plain"])
def test_a_batching_peer_sigkilled_with_8_sessions_in_flight_fails_all_over(swarm, home, kind):
    """Eight sessions batched on P; P SIGKILLed after their 4th token; all eight replay into R.
    Exact sessions keep every bit. Fast (plain) ones give the fault-free batched run's answer, or
    differ first at a token where that run's top two logits were a near-tie (the gap checked):
    the replay computes the history in other batches, which sum in another order."""
    s, _ = swarm
    boot, peers, ids = s.boot, s.proc, s.ids
    questions = QUESTIONS[:8]

    async def body(client, tok):
        run = next(r.started for r in await client.records() if r.peer_id == ids["R"])
        client.bans.ban(ids["R"], run)  # every session opens on P (a ban of R's current run)
        logits: list[list] = [[] for _ in questions]
        expected = await concurrently([lambda q=q, lg=lg: generate(client, tok, q, kind, lg)
                                       for q, lg in zip(questions, logits)])
        killed: list[bool] = []
        remotes = []

        def on_token(pipe, produced):
            remotes.append(remote_of(pipe)) if produced == 1 else None
            if produced == 4 and len(remotes) == len(questions) and not killed:
                client.bans.lift(ids["R"])  # the replica is usable again
                peers["P"].signal(signal.SIGKILL)
                killed.append(True)

        answers = await concurrently([lambda q=q: generate(client, tok, q, kind, on_token=on_token)
                                      for q in questions])
        return expected, logits, answers, remotes

    try:
        expected, logits, answers, remotes = trio.run(with_client, boot, home, body)
    finally:
        if peers["P"].p.poll() is not None:  # back for what follows, same identity
            s.start("P")
            s.wait("P")
    assert len(remotes) == 8
    for r in remotes:
        assert [f["peer"] for f in r.stats.failovers] == [ids["P"]], r.stats.failovers
        assert r.route_taken[0]["peer"] == ids["R"]
    if kind == "exact":
        assert answers == expected
    for q, want, got, rows in zip(questions, expected, answers, logits):
        assert len(got) == len(want) == TOKENS, (q, got)
        if got != want:
            i = next(j for j, (a, b) in enumerate(zip(got, want)) if a != b)
            top = rows[i].topk(2)
            assert set(top.indices.tolist()) == {got[i], want[i]}, (q, i, got[i], want[i], top)
            gap = float(top.values[0] - top.values[1])
            print(f"{q!r}: differs at token {i}, where the fault-free run's top-2 gap is {gap:.2e}")
            assert gap < NEAR_TIE, (q, i, gap)


# ---- in one process: the engine's batched pass and the batcher ----

@pytest.fixture(scope="module")
def span(smollm2):
    from diffuse.model.load import load_span

    return load_span(smollm2, 1, 5, torch.float32)


def _steps(span, exact: bool, seed: int = 0):
    """Four sessions' next steps, of several kinds: a prefill chunk, a decode step after a
    prompt, a candidate tree, a 2-row batch session."""
    from diffuse.model.engine import SpanStep

    g = torch.Generator().manual_seed(seed)
    H = span.cfg.hidden_size
    caches = [span.new_cache(64, b, exact) for b in (1, 1, 1, 2)]
    for c, n in zip(caches, (0, 7, 5, 3)):  # committed history first
        if n:
            span(torch.randn(c.k.shape[1], n, H, generator=g), torch.arange(n), c)
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    return [SpanStep(torch.randn(1, 20, H, generator=g), torch.arange(20), caches[0]),
            SpanStep(torch.randn(1, 1, H, generator=g), torch.tensor([7]), caches[1]),
            SpanStep(torch.randn(1, 3, H, generator=g), torch.tensor([5, 6, 6]), caches[2], tree, False),
            SpanStep(torch.randn(2, 1, H, generator=g), torch.tensor([3]), caches[3])]


@pytest.mark.parametrize("exact", [True, False])
def test_a_batched_pass_computes_each_session_as_alone(span, exact):
    alone = [span(s.h, s.positions, s.cache, s.tree_mask, s.commit) for s in _steps(span, exact)]
    steps = _steps(span, exact)
    together = span.forward_batch(steps)
    for a, b in zip(alone, together):
        if exact:
            assert torch.equal(a, b)  # batch-invariant kernels: the same bits
        else:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert [s.cache.length for s in steps] == [20, 8, 5, 4] and steps[2].cache.pending == 3


def test_the_batcher_batches_what_queued_and_lets_a_lone_step_run_at_once():
    from diffuse.data.scheduler import Batcher

    calls: list[list[int]] = []

    def compute(items: list[int]) -> list[int]:
        calls.append(list(items))
        if -1 in items:
            raise ValueError("a bad step")
        return [x * 10 for x in items]

    batcher = Batcher(compute, max_rows=3)

    async def main():
        lone = await batcher.run("k", 1, 1)
        results: dict[int, object] = {}

        async def one(x: int, key: str = "k") -> None:
            try:
                results[x] = (await batcher.run(key, 1, x))[0]
            except ValueError as e:
                results[x] = str(e)

        async with trio.open_nursery() as nursery:  # queued together, before anyone's turn
            for x in (2, 3, 4, 5):
                nursery.start_soon(one, x)
            nursery.start_soon(one, 9, "other")
            nursery.start_soon(one, -1)
        return lone, results

    lone, results = trio.run(main)
    with pytest.raises(ValueError, match="a bad step"):  # alone, a failing step fails its session only
        trio.run(batcher.run, "k", 1, -1)
    assert trio.run(batcher.run, "k", 1, 6)[0] == 60
    assert lone == (10, lone[1]) and calls[0] == [1]
    assert results == {2: 20, 3: 30, 4: 40, 5: 50, 9: 90, -1: "a bad step"}
    # Queued steps share batches, up to max_rows (trio may run the other key's task first).
    assert max(len(c) for c in calls) == 3
    assert [9] in calls and not any(9 in c and len(c) > 1 for c in calls)  # another key never joins them
    assert any(-1 in c and len(c) > 1 for c in calls) and [-1] in calls  # a failing batch is retried one by one


def test_company_counts_the_sessions_stepping_until_they_leave_or_lapse():
    """What speculation prices a position by: sessions that stepped lately, not those that closed
    or stopped stepping."""
    from diffuse.data.scheduler import Batcher

    batcher = Batcher(lambda items: items)

    async def main():
        for _ in range(3):  # a rhythm of ~10 ms each
            for who in ("a", "b", "c"):
                await batcher.run("k", 1, 0, who)
            await trio.sleep(0.01)
        stepping = batcher.company()
        batcher.leave("b")
        left = batcher.company()
        await trio.sleep(1.2)  # three of their intervals and a second without a step
        return stepping, left, batcher.company()

    assert trio.run(main) == (3, 2, 0)


def two_sessions(batcher, steps: int = 8) -> None:
    """Sessions A and B at one pace, B queueing 50 ms after A, each step tagged with its name."""
    async def session(name: str, offset: float) -> None:
        await trio.sleep(offset)
        for _ in range(steps):
            await batcher.run("k", 1, name, name, name.lower())
            await trio.sleep(0.2)  # elsewhere: the next peer, the client's head

    async def main():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(session, "A", 0.0)
            nursery.start_soon(session, "B", 0.05)

    trio.run(main)


def test_sessions_stepping_out_of_phase_are_gathered_into_one_batch():
    """Two sessions with the same pace, B queueing just after A's batch began: without waiting
    they alternate forever (each computes while the other is elsewhere); a step waits up to one
    batch's compute time for a session due by then, so they fall into step."""
    from diffuse.data.scheduler import Batcher

    sizes: list[int] = []

    def compute(items: list[str]) -> list[str]:
        sizes.append(len(items))
        time.sleep(0.1)
        return items

    two_sessions(Batcher(compute), 12)
    late = sizes[len(sizes) // 2:]
    # In step once their rhythm is known (a busy machine may knock them out of it once; without the
    # wait they alternate and every batch is single).
    assert late.count(2) >= len(late) - 2, sizes
    assert sum(sizes) == 24


def test_threads_are_chosen_by_what_batches_of_a_size_cost(monkeypatch):
    """Each thread count is tried once per size of batch, the cheaper per row is kept, every
    EXPLORE-th batch tries the other (a change of load shows), exact batches keep the configured
    count, and DIFFUSE_THREADS=fixed keeps it for all."""
    from diffuse.data.scheduler import THREADS_ENV, Threads

    monkeypatch.delenv(THREADS_ENV, raising=False)
    t = Threads(most=2)
    assert [t.choose(8) for _ in range(2)] == [2, 2]  # untried: the configured count first
    t.record(8, 2, 0.160)
    assert t.choose(8) == 1
    t.record(8, 1, 0.080)  # two threads cost twice as much per row here (the other core is busy)
    picks = [t.choose(9) for _ in range(t.EXPLORE)]  # 9 rows: the same size class as 8 (its 4th batch on)
    assert [i for i, p in enumerate(picks) if p == 2] == [t.EXPLORE - 4]  # the EXPLORE-th batch tries 2
    t.record(12, 2, 0.010)  # the load went away: two threads now win for this size
    t.record(12, 2, 0.010)
    t.record(12, 2, 0.010)
    t.record(12, 2, 0.010)
    assert t.choose(10) == 2
    assert t.choose(40) == 2  # another size class: tried afresh
    assert t.choose(300) == 2  # a long batch (prompts): the configured count
    assert t.choose(8, fixed=True) == 2  # exact batches: their kernels were checked for this count
    monkeypatch.setenv(THREADS_ENV, "fixed")
    assert Threads(most=2).choose(8) == 2
    assert Threads(most=1).choose(8) == 1


def test_prompts_queued_together_share_wider_batches_unless_a_short_step_waits():
    """Only long steps waiting (prompts that arrived together): batches up to burst_rows. A short
    step (a decode step) waiting: batches stay within max_rows, so it is not held back."""
    from diffuse.data.scheduler import Batcher

    calls: list[list[int]] = []

    def compute(items: list[int]) -> list[int]:
        calls.append(list(items))
        return items

    batcher = Batcher(compute, max_rows=64, burst_rows=256)

    async def burst(rows: list[int]) -> None:
        async with trio.open_nursery() as nursery:
            async with batcher.turn:  # a batch in progress: everyone queues behind it
                for r in rows:
                    nursery.start_soon(batcher.run, "k", r, r)
                await trio.testing.wait_all_tasks_blocked()

    trio.run(burst, [23] * 16)  # 16 prompts of 23 rows: 11 fit in 256 rows, then the other 5
    assert sorted(len(c) for c in calls) == [5, 11]
    calls.clear()
    trio.run(burst, [23] * 8 + [1])  # a decode step waits too: 64 rows at most while it does (it rides
    assert [sorted(c) for c in calls] == [[1, 23, 23], [23] * 6]  # in the first batch), then the rest at once


def test_long_batches_leave_a_core_to_what_other_programs_use(monkeypatch):
    """A batch too long to learn from takes every configured thread while the machine is free,
    and one thread less per core's worth of other programs' load past SPARE."""
    from diffuse.data.scheduler import THREADS_ENV, Threads

    monkeypatch.delenv(THREADS_ENV, raising=False)

    class Load:
        ncpus, value = 2, 0.0

        def cores(self) -> float:
            return self.value

    load = Load()
    t = Threads(most=2, others=load)
    picks = {}
    for value in (0.0, 0.15, 0.3, 1.0):
        load.value = value
        picks[value] = t.choose(300)
    assert picks == {0.0: 2, 0.15: 2, 0.3: 1, 1.0: 1}
    assert t.choose(300, fixed=True) == 2  # exact batches keep the checked count whatever the load
    load.ncpus, load.value = 8, 2.5
    assert Threads(most=8, others=load).choose(300) == 5
    assert Threads(most=4, others=load).choose(300) == 4  # a contribution level's share fits beside it


def test_other_load_counts_busy_cpu_time_less_this_process_s_own(tmp_path, monkeypatch):
    """From two samples of /proc/stat (ticks per CPU) and of this process's CPU time: others' load
    is the busy time of this process's CPUs less its own, per second of wall time."""
    from diffuse.data import cpu_share

    stat = tmp_path / "stat"
    clock = {"wall": 100.0, "own": 5.0}
    monkeypatch.setattr(cpu_share.time, "monotonic", lambda: clock["wall"])
    monkeypatch.setattr(cpu_share.time, "process_time", lambda: clock["own"])

    def write(busy0: int, busy1: int, idle: int) -> None:  # user ticks per CPU, the rest idle
        stat.write_text(f"cpu  {busy0 + busy1} 0 0 {2 * idle} 0 0 0 0 0 0\n"
                        f"cpu0 {busy0} 0 0 {idle} 0 0 0 0 0 0\ncpu1 {busy1} 0 0 {idle} 0 0 0 0 0 0\n"
                        "intr 1 2 3\n")

    write(1000, 1000, 5000)
    load = cpu_share.OtherLoad(str(stat))
    load.cpus, load.ncpus = {"cpu0", "cpu1"}, 2
    assert load.cores() == 0.0  # one sample: nothing to tell yet
    clock["wall"] += 1.0  # one second: CPU 0 busy all of it, CPU 1 half; this process used 0.5 s
    clock["own"] += 0.5
    write(1000 + cpu_share.CLOCK_TICK, 1000 + cpu_share.CLOCK_TICK // 2, 5000 + cpu_share.CLOCK_TICK // 2)
    assert load.cores() == pytest.approx(cpu_share.SMOOTHING * 1.0)  # 1.5 busy - 0.5 own, smoothed
    clock["wall"] += 0.05  # too soon for a new window: the same value
    assert load.cores() == pytest.approx(cpu_share.SMOOTHING * 1.0)
    pinned = cpu_share.OtherLoad(str(stat))  # a process pinned to CPU 1 (taskset) counts CPU 1 only
    pinned.cpus = {"cpu1"}
    pinned.cores()
    clock["wall"] += 1.0  # CPU 0 busy all the second, CPU 1 idle; this process used nothing
    write(1000 + 2 * cpu_share.CLOCK_TICK, 1000 + cpu_share.CLOCK_TICK // 2, 5000 + 2 * cpu_share.CLOCK_TICK)
    assert pinned.cores() == 0.0
    assert load.cores() == pytest.approx(cpu_share.SMOOTHING * 1.0 * (1 - cpu_share.SMOOTHING)
                                         + cpu_share.SMOOTHING * 1.0 / 1.05)  # CPU 0's second, over 1.05 s


def test_other_load_sees_another_process_busy():
    """On this machine's real /proc/stat: a child process spinning for a second shows as at
    least half a core of other programs' load (the test process itself sleeps)."""
    import os
    import subprocess
    import sys
    import time

    from diffuse.data.cpu_share import OtherLoad

    if not os.path.exists("/proc/stat"):
        pytest.skip("no /proc/stat here")
    load = OtherLoad(smoothing=1.0)  # the second below as one window
    load.cores()
    spin = subprocess.Popen([sys.executable, "-c",
                             "import time\nend = time.time() + 1.2\nwhile time.time() < end: pass"])
    try:
        time.sleep(1.0)
        seen = load.cores()
    finally:
        spin.kill()
        spin.wait(10)
    assert seen >= 0.5
