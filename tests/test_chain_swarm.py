"""Chain routes through real swarms: a sentinel and `diffuse join` peers as OS processes on
127.0.0.1 (one swarm for the module), an in-process client whose route is pinned to chosen peers.
A chain gives the star's greedy tokens token for token over 2 and 3 hops (and answers over 1), at the defaults
(bf16, fp16 wire, trust on), speculating, on an fp32 wire and exact; a SIGKILL of the middle or
the last peer of a 3-peer chain leaves the answer as it was and is reported as a failover; a
stranger cannot send frames into a session; a peer altering what it forwards is caught.
"""

from __future__ import annotations

import gc
import itertools
import json
from dataclasses import replace

import pytest
import torch
import trio
from libp2p.crypto.ed25519 import create_new_key_pair

from support.procs import Procs, swarm_key
from support.routes import pin_route
from support.speculation import ROUND_TRIP_80MS, FixedCost
from support.swarm import LOCAL, QUICK_RECORDS, Swarm
from diffuse.client.generate import Generation, session_length
from diffuse.client.sampling import SamplingParams
from diffuse.client.speculative import SpecConfig, SpecState
from diffuse.client.swarm import SwarmClient, SwarmOptions, remote_of, route_report
from diffuse.control.dial import open_stream
from diffuse.control.node import NodeConfig, open_node
from diffuse.data.codec import PROTOCOL_ID, Attach, ErrorCode, ErrorMsg, FrameDecoder, encode
from diffuse.home import DEFAULT_MODEL, models_dir
from diffuse.model.tokenizer import Tokenizer
from diffuse.trust import reputation

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]
QUESTION = "Name three famous rivers and the countries they flow through."
TOKENS = 12
SPANS = {"P": "1:30", "Q0": "1:15", "Q1": "15:30", "T0": "1:10", "T1": "10:20", "T2": "20:30",
         "T1b": "10:20", "T2b": "20:30", "F0": "1:10"}
ROUTES = {1: ["P"], 2: ["Q0", "Q1"], 3: ["T0", "T1", "T2"]}
SLOW = ["--throughput", "0.5"]  # announced: routes the planner picks itself never take it


@pytest.fixture(scope="module")
def swarm(home, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("chainswarm")
    with Procs(home) as procs:
        s = Swarm(procs, tmp, SPANS, {"F0": ["--tamper", "forward", *SLOW]}, join=QUICK_RECORDS, timeout=300)
        yield procs, s


async def answers(boot: str, home, ids: dict[str, str], runs: list[dict]) -> list[dict]:
    """Each run: names (the pinned route), shape, options (SwarmOptions fields), spec (speculate),
    during(n, remote, node) (after the route's n-th step, the prefill the first: not after a token
    shown, since an audited hop's checks may hold every token back to the answer's end); returns
    tokens, the route report and the spec stats.
    Runs in a row with the same options share a client (a fresh one surveys the swarm again)."""
    model_dir = models_dir(home) / DEFAULT_MODEL
    tok = Tokenizer.load(model_dir)
    prompt = tok.encode_chat([{"role": "user", "content": QUESTION}])
    out: list[dict] = []
    client, made_for = None, None
    async with open_node(create_new_key_pair(), NodeConfig(listen=[LOCAL], bootstrap=[boot], server=False,
                                                           swarm_key=swarm_key()),
                         codecs=reputation.swarm_codecs()) as node:
        for run in runs:
            if client is None or run.get("options", {}) != made_for:
                client = None
                gc.collect()  # a client's weights sit in reference cycles: free them before the next one's
                made_for = run.get("options", {})
                client = SwarmClient(node, model_dir, SwarmOptions(**made_for))
                with trio.fail_after(60):
                    while not await client.covered():
                        await trio.sleep(0.25)
            client.opts = replace(client.opts, route=run["shape"])
            pin_route(client, set(ids.values()), {ids[n] for n in run["names"]})
            config = SpecConfig() if run.get("spec") else None
            state = SpecState(cost=FixedCost(ROUND_TRIP_80MS)) if config else None
            pipe = await client.session(session_length(len(prompt), TOKENS, config))
            remote = remote_of(pipe)
            if during := run.get("during"):
                remote.forward = stepping(remote.forward, during, remote, node)
            gen = Generation(pipe, tok, prompt, SamplingParams(max_tokens=TOKENS), speculate=config, state=state)
            n = 0
            async for _ in gen:
                n += 1
            report = route_report(pipe, n)
            await pipe.close()
            out.append({"tokens": gen.completion.token_ids, "report": report,
                        "trees": max(state.stats.positions) if state else 0})
    return out


def stepping(forward, during, remote, node):
    """`forward`, calling `during(n, remote, node)` once the route's n-th step is through."""
    steps = itertools.count(1)

    async def step(*args, **kwargs):
        out = await forward(*args, **kwargs)
        await during(next(steps), remote, node)
        return out

    return step


MODES = {"defaults": {}, "speculating": {"spec": True}, "fp32 wire": {"options": {"wire_dtype": torch.float32}},
         "exact": {"spec": True, "options": {"exact": True}}}


@pytest.mark.parametrize("mode", list(MODES))
def test_chain_and_star_give_the_same_tokens(swarm, home, mode):
    """Over 2 and 3 hops the chain gives the star's tokens; over 1 hop either shape is the same
    single hop, so it runs once."""
    procs, s = swarm
    runs = [{"names": ROUTES[1], "shape": "chain", **MODES[mode]}] + [
        {"names": ROUTES[hops], "shape": shape, **MODES[mode]} for hops in (2, 3) for shape in ("star", "chain")]
    single, *got = trio.run(answers, s.boot, home, s.ids, runs)
    assert len(single["tokens"]) >= TOKENS - 2 and not single["report"]["failovers"], single
    assert single["report"]["shape"] == "single" and [h["output"] for h in single["report"]["route"]] == ["client"]
    assert [h["peer"] for h in single["report"]["route"]] == [s.ids["P"]]
    for hops, (star, chain) in zip((2, 3), zip(got[::2], got[1::2])):
        assert chain["tokens"] == star["tokens"], (mode, hops, star, chain)
        assert len(chain["tokens"]) >= TOKENS - 2
        assert not chain["report"]["failovers"] and not star["report"]["failovers"], (chain, star)
        assert [h["peer"] for h in chain["report"]["route"]] == [s.ids[n] for n in ROUTES[hops]]
        assert [h["output"] for h in chain["report"]["route"]] == ["peer"] * (hops - 1) + ["client"]
        assert [h["output"] for h in star["report"]["route"]] == ["client"] * hops
        assert all(h["forwarded_steps"] > TOKENS // 2 for h in chain["report"]["route"][:-1])
        assert chain["report"]["shape"] == "chain" and star["report"]["shape"] == "star"
    if MODES[mode].get("spec"):
        assert all(chain["trees"] > 1 for chain in got[1::2])  # candidate trees went down the chains


@pytest.mark.parametrize("victim", [1, 2])
def test_sigkill_in_a_three_peer_chain_keeps_the_answer(swarm, home, victim):
    """The middle (1) or the last (2) peer of a 3-peer chain (T0-T1-T2, or a replica the planner
    took when a record was late on a loaded machine) is SIGKILLed after 5 tokens; its replica takes
    over from the committed inputs the client holds (every hop's output came back as a copy), and
    the answer equals the one without a kill."""
    procs, s = swarm
    killed_names: list[str] = []

    async def kill(n, remote, node):
        if n == 5:
            hops = [h.hop.peer_id for h in remote.hops]
            assert len(hops) == 3, hops  # a 3-peer chain
            killed_names.append(s.name_of(hops[victim]))
            s.kill(killed_names[0])

    try:
        base, killed = trio.run(answers, s.boot, home, s.ids, [
            {"names": ROUTES[3], "shape": "chain"}, {"names": ROUTES[3], "shape": "chain", "during": kill}])
    finally:
        for name in killed_names:
            s.start(name)
            s.wait(name)
    assert killed["tokens"] == base["tokens"], killed
    assert base["report"]["shape"] == "chain", base["report"]
    failovers = killed["report"]["failovers"]
    assert failovers and failovers[0]["peer"] == s.ids[killed_names[0]] and failovers[0]["during"] == "step", \
        failovers
    assert failovers[0]["cause"] in ("closed", "timeout"), failovers


def test_a_stranger_cannot_send_frames_into_a_session(swarm, home):
    """Mid-answer, a node the client did not name sends ATTACH for the middle hop's session (and
    for a session that does not exist): both refused with FORBIDDEN, the answer unchanged."""
    procs, s = swarm
    replies: list = []

    async def intrude(n, remote, node):
        if n != 3:
            return
        async with open_node(create_new_key_pair(), NodeConfig(listen=[LOCAL], bootstrap=[s.boot], server=False,
                                                               swarm_key=swarm_key())) as stranger:
            hop = remote.hops[1].hop
            for sid in (remote.hops[1].session_id, b"\x05" * 16):
                stream = await open_stream(stranger.host, hop.peer_id, PROTOCOL_ID, hop.addrs, timeout=10)
                await stream.write(encode(Attach(sid)))
                dec, got = FrameDecoder(), []
                with trio.fail_after(10):
                    while not got:
                        got = dec.feed(await stream.read(65536))
                replies.append(got[0])
                await stream.close()

    base, intruded = trio.run(answers, s.boot, home, s.ids, [{"names": ROUTES[3], "shape": "chain"},
                                                             {"names": ROUTES[3], "shape": "chain", "during": intrude}])
    assert len(replies) == 2 and all(isinstance(m, ErrorMsg) and m.code == ErrorCode.FORBIDDEN for m in replies)
    assert intruded["tokens"] == base["tokens"]
    assert not intruded["report"]["failovers"]
    assert [h["output"] for h in intruded["report"]["route"]] == ["peer", "peer", "client"]


def test_a_peer_altering_what_it_forwards_is_caught(swarm, home):
    """F0 forwards noisy outputs to T1 while its copies to the client are honest: T1's received-
    input commitment differs from F0's committed output at the first step; T1 is replaced (both
    banned, either may lie), F0's outputs go through the client, and the answer is the honest one."""
    procs, s = swarm
    honest, tampered = trio.run(answers, s.boot, home, s.ids, [{"names": ROUTES[3], "shape": "chain"},
                                                               {"names": ["F0", "T1", "T2"], "shape": "chain"}])
    assert tampered["tokens"] == honest["tokens"]
    first = tampered["report"]["failovers"][0]
    assert first["cause"] == "link" and first["link"] == [s.ids["F0"], s.ids["T1"]], first
    assert any(link["link"][0] == s.ids["F0"] for link in tampered["report"]["links"])
    assert tampered["report"]["route"][0]["output"] == "client"


def test_ask_reports_the_route_shape(swarm, home):
    procs, s = swarm
    for shape in ("chain", "star"):
        out = procs.run("--client-only", "ask", "--bootstrap", s.boot, "--json", "--max-tokens", "6", "--wait", "30",
                        "--route", shape, QUESTION, timeout=300)
        assert out.returncode == 0, out.stderr
        got = json.loads(out.stdout)
        route = got["route"]
        assert got["shape"] in ("single", shape), got
        assert [h["output"] for h in route] == (["peer"] * (len(route) - 1) if shape == "chain" else
                                                ["client"] * (len(route) - 1)) + ["client"]
