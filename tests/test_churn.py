"""Faults noticed in seconds, each named by its cause, and peers that come back used at once:
a sentinel and four `diffuse join` peers as OS processes (blocks 1:15 and 15:30, twice each),
a client in this process at the defaults (trust, bf16), one swarm for the module.

Each test asserts what the failover record says (its cause, its deadline), never how long it
took: scripts/chaos.py measures the times."""

from __future__ import annotations

import signal
from collections.abc import Awaitable, Callable

import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair

from support.procs import Procs, swarm_key
from support.swarm import LOCAL, Swarm
from test_swarm import QUESTION, TOKENS, reference_answer
from diffuse.client.generate import Generation
from diffuse.client.sampling import SamplingParams
from diffuse.client.swarm import SwarmClient, SwarmOptions, remote_of, route_report
from diffuse.control.node import NodeConfig, open_node
from diffuse.data.chain import LINK_WRITE_S
from diffuse.data.hop import FLOOR_S
from diffuse.home import DEFAULT_MODEL, models_dir
from diffuse.model.tokenizer import Tokenizer
from diffuse.trust import reputation

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
SPANS = {"A": "1:15", "A2": "1:15", "B": "15:30", "B2": "15:30"}


@pytest.fixture(scope="module")
def reference(home) -> list[int]:
    return reference_answer(home)


@pytest.fixture(scope="module")
def swarm(home, tmp_path_factory):
    with Procs(home) as procs:
        yield Swarm(procs, tmp_path_factory.mktemp("churn"), SPANS)


def restart(swarm: Swarm, name: str) -> None:
    """Back under the same identity (on new ports), once it is serving."""
    swarm.proc[name].wait(10)
    swarm.start(name)
    swarm.wait(name)


def answer(home, swarm: Swarm, body: Callable[[SwarmClient, list[int]], Awaitable[dict]]) -> dict:
    """Run `body(client, prompt)` with a fresh in-process client of the swarm at the defaults."""
    model_dir = models_dir(home) / DEFAULT_MODEL

    async def run() -> dict:
        async with open_node(create_new_key_pair(),
                             NodeConfig(listen=[LOCAL], bootstrap=[swarm.boot], server=False,
                                        swarm_key=swarm_key()), codecs=reputation.swarm_codecs()) as node:
            client = SwarmClient(node, model_dir, SwarmOptions())
            with trio.fail_after(60):
                while not await client.covered():
                    await trio.sleep(0.5)
            prompt = Tokenizer.load(model_dir).encode_chat([{"role": "user", "content": QUESTION}])
            return await body(client, prompt)

    return trio.run(run)


async def generate(client: SwarmClient, prompt: list[int], at: int = 0,
                   fault: Callable[[str], None] | None = None, half: int = 0) -> dict:
    """One greedy answer; `fault(name of the route's peer for `half`)` after `at` tokens."""
    pipe = await client.session(len(prompt) + TOKENS)
    remote = remote_of(pipe)
    victim = remote.route_taken[half]["peer"] if remote.route_taken else None
    gen = Generation(pipe, Tokenizer.load(client.model_dir), prompt, SamplingParams(max_tokens=TOKENS))
    n = 0
    try:
        async for _ in gen:
            n += 1
            if n == at and fault is not None:
                fault(victim)
    finally:
        await pipe.close()
    report = route_report(pipe, len(prompt) + len(gen.completion.token_ids))
    return {**report, "computed": report["tokens"], "tokens": gen.completion.token_ids, "victim": victim}


def offering_first(client: SwarmClient, peer_id: str) -> None:
    """The client's next route for blocks 1-14 goes through `peer_id` (as its lowest-RTT replica
    would): the fault then meets a session, whichever replica routing would have picked."""
    route, used = client.route, []

    async def first(start: int, end: int, exclude: set[str]):
        hops = await route(start, end, exclude)
        if not used and start == 1:
            used.append(peer_id)
            rec = next(r for r in await client.records(30.0) if r.peer_id == peer_id)
            from diffuse.control.routing import Hop

            hops = [Hop(peer_id, tuple(rec.addrs), 1, 15, rec.started, rec.throughput, 0.01)] + [
                h for h in hops if h.start >= 15]
        return hops

    client.route = first  # type: ignore[method-assign]


def test_a_frozen_peer_is_replaced_at_its_steps_deadline(home, swarm, reference):
    """SIGSTOP mid-answer: the TCP connection stays up and nothing comes back. The step's
    deadline, sized by its rows (not --step-timeout's 30 s), names it."""
    frozen: list[str] = []

    def freeze(peer: str) -> None:
        frozen.append(swarm.name_of(peer))
        swarm.proc[frozen[0]].signal(signal.SIGSTOP)

    try:
        got = answer(home, swarm, lambda client, prompt: generate(client, prompt, at=2, fault=freeze))
    finally:
        for name in frozen:
            swarm.proc[name].signal(signal.SIGCONT)
    assert got["tokens"] == reference
    first = got["failovers"][0]
    assert first["peer"] == got["victim"] and first["cause"] == "timeout", got["failovers"]
    # a decode step's deadline: the floor (plus, for a hop forwarding to the next, the forward's), not 30 s
    assert any(f"in {s:.1f} s" in first["error"] for s in (FLOOR_S, FLOOR_S + LINK_WRITE_S)), first


def test_a_killed_peer_is_named_a_lost_connection_and_used_again_once_it_restarts(home, swarm, reference):
    """SIGKILL mid-answer: "closed". Restarted under the same identity, the peer is used at
    once: its replica is then killed too, and the next session still goes through peers."""
    killed: list[str] = []

    def kill(peer: str) -> None:
        killed.append(swarm.name_of(peer))
        swarm.proc[killed[0]].signal(signal.SIGKILL)

    async def body(client: SwarmClient, prompt: list[int]) -> dict:
        first = await generate(client, prompt, at=2, fault=kill)
        assert client.bans.active() == {swarm.ids[killed[0]]}
        victim = killed[0]
        replica = next(n for n in SPANS if n != victim and SPANS[n] == SPANS[victim])
        await trio.to_thread.run_sync(restart, swarm, victim)
        swarm.proc[replica].signal(signal.SIGKILL)  # only the restarted (still banned) peer serves its half
        try:
            second = await generate(client, prompt)
        finally:
            await trio.to_thread.run_sync(restart, swarm, replica)
        return {"first": first, "second": second, "victim": victim}

    got = answer(home, swarm, body)
    first, second = got["first"], got["second"]
    assert first["tokens"] == reference and second["tokens"] == reference
    assert first["failovers"][0]["cause"] == "closed", first["failovers"]
    assert second["in_process"] == [] and second["computed"]["here"] == 0, second
    assert swarm.ids[got["victim"]] in [h["peer"] for h in second["route"]], second


def test_a_peer_that_died_while_idle_is_noticed_when_a_session_opens(home, swarm, reference):
    """Killed between two sessions, with its connection to the client idle: the dial names it
    unreachable and the session opens on its replica."""
    async def body(client: SwarmClient, prompt: list[int]) -> dict:
        first = await generate(client, prompt)  # connections to the route's peers, now idle
        victim = first["route"][0]["peer"]
        swarm.proc[swarm.name_of(victim)].signal(signal.SIGKILL)
        offering_first(client, victim)
        try:
            return await generate(client, prompt) | {"victim": victim}
        finally:
            await trio.to_thread.run_sync(restart, swarm, swarm.name_of(victim))

    got = answer(home, swarm, body)
    assert got["tokens"] == reference
    first = got["failovers"][0]
    assert (first["peer"], first["during"], first["cause"]) == (got["victim"], "open", "unreachable"), got["failovers"]


def test_a_peer_frozen_while_idle_is_noticed_when_a_session_opens(home, swarm, reference):
    """Frozen between two sessions: its connection to the client may still stand, but it opens no
    stream on it; the dial gives up ("timeout", or "unreachable" once that connection closed) and
    the session opens on its replica."""
    frozen: list[str] = []

    async def body(client: SwarmClient, prompt: list[int]) -> dict:
        first = await generate(client, prompt)
        victim = first["route"][0]["peer"]
        frozen.append(swarm.name_of(victim))
        swarm.proc[frozen[0]].signal(signal.SIGSTOP)
        offering_first(client, victim)
        return await generate(client, prompt) | {"victim": victim}

    try:
        got = answer(home, swarm, body)
    finally:
        for name in frozen:
            swarm.proc[name].signal(signal.SIGCONT)
    assert got["tokens"] == reference
    first = got["failovers"][0]
    # "timeout" while its connection stands; "unreachable" once a write to it past the connection's
    # write timeout has closed that connection and the redial finds nobody answering
    assert (first["peer"], first["during"]) == (got["victim"], "open"), got["failovers"]
    assert first["cause"] in ("timeout", "unreachable"), got["failovers"]


def test_blocks_with_no_live_replica_are_computed_here_or_waited_for(home, swarm, reference):
    """Both replicas of blocks 15-29 SIGKILLed, their records still valid: a new session runs
    blocks 1-14 on a peer and only 15-29 in this process, the answer unchanged; a client that may
    not compute them (--no-rescue) waits in the queue and opens on the first replica back."""
    async def body(client: SwarmClient, prompt: list[int]) -> dict:
        for name in ("B", "B2"):
            swarm.proc[name].signal(signal.SIGKILL)
        here = await generate(client, prompt)
        patient = SwarmClient(client.node, client.model_dir, SwarmOptions(rescue=False))
        got: dict = {}

        async def wait_for_a_replica() -> None:
            got["waited"] = await generate(patient, prompt)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait_for_a_replica)
            with trio.fail_after(60):
                while patient.waiting == 0:
                    await trio.sleep(0.1)
            got["queued"] = patient.waiting
            await trio.to_thread.run_sync(restart, swarm, "B")
        await trio.to_thread.run_sync(restart, swarm, "B2")
        return {"here": here, **got}

    got = answer(home, swarm, body)
    here, waited = got["here"], got["waited"]
    assert here["tokens"] == reference and waited["tokens"] == reference
    assert here["in_process"] == [[15, 30]] and [h["blocks"] for h in here["route"]] == [[1, 15]], here
    assert here["computed"]["here"] == here["computed"]["peers"] + here["computed"]["here"] > 0
    assert got["queued"] == 1
    assert waited["in_process"] == [] and swarm.ids["B"] in [h["peer"] for h in waited["route"]], waited
