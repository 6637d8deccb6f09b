"""Several sessions at once through a 2-peer chain of real processes (a sentinel and two `diffuse
join` peers on 127.0.0.1, blocks 1:15 and 15:30, at the defaults: bf16, fp16 wire, trust on, route
auto, which chains these hops since they reach each other):

- each session gives the answer it gives alone: exact sessions bit for bit (every step's
  logits), fast ones token for token or differing only after a near-tie in bf16 (shown with its
  gap: a batched pass rounds in another order than a lone step);
- the peers computed different sessions' steps at the same time: their batch traces
  (DIFFUSE_BATCH_TRACE, on the system-wide monotonic clock, each pass naming its steps' sessions)
  hold passes of the first peer and of the second that overlap, both holding steps of these
  sessions (not only of the trust layer's canaries, which run beside them); every session's first
  hop forwarded its outputs to the second; each peer held steps of two sessions at once
  (diffuse_most_steps_in_flight).

Whether passes overlap depends on how the two cores schedule the peers, so the module runs in
the `alone` group, nothing beside it.
"""

from __future__ import annotations

import math

import httpx
import pytest
import torch
import trio
from libp2p.crypto.ed25519 import create_new_key_pair

from support import batch_trace
from test_api_swarm import _metrics_url
from support.procs import Procs, swarm_key
from support.swarm import LOCAL, QUICK_RECORDS, Swarm
from diffuse.client.generate import session_length
from diffuse.client.swarm import SwarmClient, SwarmOptions, remote_of
from diffuse.control.node import NodeConfig, open_node
from diffuse.data.scheduler import TRACE_ENV
from diffuse.home import DEFAULT_MODEL, models_dir
from diffuse.model.tokenizer import Tokenizer
from diffuse.trust import reputation

pytestmark = [pytest.mark.slow, pytest.mark.alone, pytest.mark.timeout(1200)]
TOKENS = 16
JOBS = [("Name three famous rivers and the countries they flow through.", False), ("Write a haiku about rain.", False),
        ("Explain in two sentences what a compiler does.", True), ("Why is the sky blue?", True)]  # (question, exact)
PEERS = {"Q0": "1:15", "Q1": "15:30"}


@pytest.fixture(scope="module")
def swarm(home, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pipeswarm")
    traces = tmp / "traces"
    traces.mkdir()
    with Procs(home) as procs:
        procs.env[TRACE_ENV] = str(traces)
        s = Swarm(procs, tmp, PEERS, join=[*QUICK_RECORDS, "--metrics", "127.0.0.1:0"], timeout=300)
        yield s, {name: batch_trace.trace_file(traces, s.proc[name].p.pid) for name in PEERS}, \
            {name: _metrics_url(s.proc[name]) for name in PEERS}


async def generate(client: SwarmClient, tok: Tokenizer, question: str, exact: bool) -> dict:
    """One greedy answer: its tokens, every step's logits, how its first hop's output travelled, and
    its session id at each peer (hex, as batch traces name it)."""
    prompt = tok.encode_chat([{"role": "user", "content": question}])
    pipe = await client.session(session_length(len(prompt), TOKENS), exact=exact)
    try:
        out, rows, ids = [], [], torch.tensor([prompt])
        for _ in range(TOKENS):
            row = (await pipe.forward(ids, rows=slice(-1, None)))[0, -1]
            rows.append(row)
            out.append(int(row.argmax()))
            ids = torch.tensor([[out[-1]]])
        remote = remote_of(pipe)
        return {"tokens": out, "logits": rows, "route": remote.route_taken,
                "ids": {h.hop.peer_id: h.session_id.hex() for h in remote.hops}}
    finally:
        await pipe.close()


def near_tie(logit: float) -> float:
    """A gap a batched pass can reverse in bf16: 4 units in the last place at `logit`'s magnitude
    (a batch's products round in another order than a lone step's, through every block)."""
    return 4 * 2.0 ** (math.floor(math.log2(max(abs(logit), 1e-3))) - 7)


def most_in_flight(url: str) -> float:
    for line in httpx.get(url, timeout=10).text.splitlines():
        if line.startswith("diffuse_most_steps_in_flight{"):
            return float(line.split()[-1])
    raise AssertionError(f"no diffuse_most_steps_in_flight at {url}")


def check_overlap(passes: dict[str, list[batch_trace.Batch]], ids: dict[str, set[str]]) -> None:
    """Both peers computed every session's steps, and a pass of the first peer holding steps of
    these sessions overlapped one of the second's: they computed two of them at once."""
    q0, q1 = (batch_trace.of_sessions(passes[name], ids[name]) for name in PEERS)
    for name in PEERS:
        assert batch_trace.steps_of(passes[name], ids[name]) >= len(JOBS) * TOKENS, name
    assert batch_trace.overlap(q0, q1) > 0, "the two peers never computed these sessions' steps at the same time"


def test_concurrent_sessions_through_a_chain_overlap_and_answer_as_alone(swarm, home):
    s, traces, metrics = swarm
    model_dir = models_dir(home) / DEFAULT_MODEL

    async def run():
        async with open_node(create_new_key_pair(), NodeConfig(listen=[LOCAL], bootstrap=[s.boot], server=False,
                                                               swarm_key=swarm_key()),
                             codecs=reputation.swarm_codecs()) as node:
            client = SwarmClient(node, model_dir, SwarmOptions())
            tok = Tokenizer.load(model_dir)
            with trio.fail_after(60):
                while not await client.covered():
                    await trio.sleep(0.25)
            alone = [await generate(client, tok, q, exact) for q, exact in JOBS]
            offsets = {name: batch_trace.size(path) for name, path in traces.items()}
            together: list = [None] * len(JOBS)

            async def one(i: int) -> None:
                together[i] = await generate(client, tok, *JOBS[i])

            async with trio.open_nursery() as nursery:
                for i in range(len(JOBS)):
                    nursery.start_soon(one, i)
            return alone, together, {name: batch_trace.read(path, offsets[name]) for name, path in traces.items()}

    alone, together, passes = trio.run(run)
    for (q, exact), a, b in sorted(zip(JOBS, alone, together), key=lambda job: not job[0][1]):  # exact ones first
        assert [h["output"] for h in b["route"]] == ["peer", "client"], b["route"]
        assert b["route"][0]["forwarded_steps"] >= TOKENS
        if exact:
            assert a["tokens"] == b["tokens"] and all(torch.equal(x, y) for x, y in zip(a["logits"], b["logits"])), q
        elif a["tokens"] != b["tokens"]:
            i = next(j for j, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y)
            top2 = a["logits"][i].topk(2).values
            print(f"{q!r}: differs at token {i}, where the top-2 gap alone is {float(top2[0] - top2[1]):.3f}")
            assert top2[0] - top2[1] <= near_tie(float(top2[0])), (q, i, top2)
    ids = {name: {b["ids"][s.ids[name]] for b in together} for name in PEERS}
    check_overlap(passes, ids)
    assert all(most_in_flight(metrics[name]) >= 2 for name in PEERS)
