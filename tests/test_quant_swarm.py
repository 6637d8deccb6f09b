"""Quantized peers in a real swarm: a sentinel and `diffuse join` peers as OS processes, one swarm
for the module: an int4 and an int8 peer (blocks 1:15) and a bf16 one (15:30), an int4 peer that
tampers with its outputs and one announcing int8 while computing int4 (both 1:15, testing only),
every one computing in bf16, the default. The client runs in this process, each test letting it
route only through the peers it names."""

from __future__ import annotations

import json

import pytest
import torch
import trio
from libp2p.crypto.ed25519 import create_new_key_pair

from support.procs import Procs, swarm_key
from support.swarm import LOCAL, Swarm
from test_swarm import QUESTION
from diffuse.client.generate import Generation
from diffuse.client.pipeline import LocalModel
from diffuse.client.sampling import SamplingParams
from diffuse.client.swarm import SwarmClient, SwarmOptions, route_report
from diffuse.control.node import NodeConfig, open_node
from diffuse.control.routing import NoRoute
from diffuse.home import DEFAULT_MODEL, models_dir
from diffuse.model.load import load_head, load_span
from diffuse.model.tokenizer import Tokenizer
from diffuse.trust import reputation
from diffuse.trust.guard import TrustOptions

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]
TOKENS = 12
SPANS = {"q4": "1:15", "q8": "1:15", "bf": "15:30", "cheat4": "1:15", "liar": "1:15"}
EXTRA = {"q4": ["--quant", "int4"], "q8": ["--quant", "int8"], "cheat4": ["--quant", "int4", "--tamper", "noise:20"],
         "liar": ["--quant", "int8", "--tamper", "quant:4"]}
AUDIT_ALL = TrustOptions(spot_rate=1.0, vet_canaries=1, canary_rate=1.0)  # every session audited, every step


@pytest.fixture(scope="module")
def swarm(home, tmp_path_factory):
    with Procs(home) as procs:
        speed = ["--throughput", "20"]
        yield Swarm(procs, tmp_path_factory.mktemp("quant"), SPANS,
                    {n: [*EXTRA.get(n, []), *speed] for n in SPANS})


def through(client: SwarmClient, allowed: set[str]) -> None:
    """Routes only through `allowed` peers (the others are there for other tests)."""
    route = client.route

    async def only(start: int, end: int, exclude: set[str]):
        others = {r.peer_id for r in await client.records(30.0)} - allowed
        return await route(start, end, exclude | others)

    client.route = only  # type: ignore[method-assign]


def run(home, swarm: Swarm, allowed: list[str], body, **options):
    """`body(client, prompt)` with a fresh in-process client routing through `allowed` peers."""
    model_dir = models_dir(home) / DEFAULT_MODEL

    async def main():
        async with open_node(create_new_key_pair(), NodeConfig(listen=[LOCAL], bootstrap=[swarm.boot], server=False,
                                                               swarm_key=swarm_key()),
                             codecs=reputation.swarm_codecs()) as node:
            client = SwarmClient(node, model_dir, SwarmOptions(**options))
            through(client, {swarm.ids[n] for n in allowed})
            with trio.fail_after(90):
                while {r.peer_id for r in await client.node.records(client.model_id)} < set(swarm.ids.values()):
                    await trio.sleep(0.5)
            prompt = Tokenizer.load(model_dir).encode_chat([{"role": "user", "content": QUESTION}])
            return await body(client, prompt)

    return trio.run(main)


async def answer(client: SwarmClient, prompt: list[int], tokens: int = TOKENS) -> dict:
    pipe = await client.session(len(prompt) + tokens)
    gen = Generation(pipe, Tokenizer.load(client.model_dir), prompt, SamplingParams(max_tokens=tokens))
    try:
        async for _ in gen:
            pass
    finally:
        await pipe.close()
    return route_report(pipe, len(prompt) + tokens) | {"tokens": gen.completion.token_ids}


def mixed_reference(home, tokens: int = TOKENS) -> list[int]:
    """The answer of blocks 0-14 in int4 and 15-29 in bf16, computed here."""
    path = models_dir(home) / DEFAULT_MODEL
    model = LocalModel(load_head(path, torch.bfloat16), [load_span(path, 0, 15, torch.bfloat16, quant="int4"),
                                                         load_span(path, 15, 30, torch.bfloat16)])
    tok = Tokenizer.load(path)
    prompt = tok.encode_chat([{"role": "user", "content": QUESTION}])

    async def main():
        gen = Generation(model.session(len(prompt) + tokens), tok, prompt, SamplingParams(max_tokens=tokens))
        async for _ in gen:
            pass
        return gen.completion.token_ids

    return trio.run(main)


def test_an_int4_and_a_bf16_peer_answer_a_client_accepting_both(home, swarm):
    got = run(home, swarm, ["q4", "bf"], answer, quant="int4", trust=None)
    assert [h["peer"] for h in got["route"]] == [swarm.ids["q4"], swarm.ids["bf"]], got
    assert not got["failovers"] and not got["in_process"]
    assert got["tokens"] == mixed_reference(home)


def test_a_client_accepting_only_unquantized_peers_is_not_routed_through_int4(home, swarm):
    async def body(client: SwarmClient, prompt: list[int]) -> dict:
        records = await client.records()
        try:
            got = await answer(client, prompt, 4)
        except NoRoute as e:  # nothing it accepts serves blocks 1-14
            got = {"route": [], "error": str(e)}
        return {"rejected": dict(client.rejected), "serving": {r.peer_id for r in records},
                "uncovered": await client.uncovered(), "answer": got}

    got = run(home, swarm, ["q4", "bf"], body, accept_quant="none", trust=None)
    q4 = swarm.ids["q4"]
    assert "int4 variant, which this client does not accept" in got["rejected"][q4]
    assert got["serving"] == {swarm.ids["bf"]}
    assert "no live peer serves blocks 1-14" in got["uncovered"]
    assert q4 not in [h["peer"] for h in got["answer"]["route"]]
    assert "no live peer serves blocks 1-14" in got["answer"].get("error", "no live peer serves blocks 1-14")


@pytest.mark.parametrize("honest", ["q4", "q8"])
def test_an_honest_quantized_peer_is_never_accused_in_20_audited_sessions(home, swarm, honest):
    async def body(client: SwarmClient, prompt: list[int]) -> dict:
        routes = [await answer(client, prompt, 6) for _ in range(20)]
        return {"routes": routes, "counts": dict(client.guard.counts), "banned": client.guard.bans.active()}

    got = run(home, swarm, [honest, "bf"], body, quant="int4", trust=AUDIT_ALL)
    assert got["counts"]["caught"] == 0 and not got["banned"], got["counts"]
    assert got["counts"]["spot_checks"] >= 20 * 6 and got["counts"]["canaries"] >= 20
    assert all(not r["failovers"] and r["route"][0]["peer"] == swarm.ids[honest] for r in got["routes"])


@pytest.mark.parametrize("cheat", ["cheat4", "liar"])
def test_a_tampering_int4_peer_and_one_announcing_int8_are_caught(home, swarm, cheat):
    """Canaries catch both as they open, at bf16: a variant's canaries are scored against its own
    fp32 output, where int4 weights drift far from the int8 ones announced (spot checks' per-token
    thresholds are too wide for 10% noise or for int4 against int8: docs/quantization.md)."""
    async def body(client: SwarmClient, prompt: list[int]) -> dict:
        got = await answer(client, prompt, 6)
        kinds = {e.evidence.kind: e.evidence.dtype for e in client.guard.bans.evidence.get(swarm.ids[cheat], [])}
        return got | {"counts": dict(client.guard.counts), "banned": client.guard.bans.active(), "kinds": kinds}

    got = run(home, swarm, [cheat, "bf"], body, quant="int4", trust=AUDIT_ALL)
    assert got["counts"]["caught"] >= 1 and swarm.ids[cheat] in got["banned"], (got["counts"], got["banned"])
    assert got["kinds"].get("canary") == ("bfloat16+int8" if cheat == "liar" else "bfloat16+int4"), got["kinds"]
    assert swarm.ids[cheat] not in [h["peer"] for h in got["route"]][-1:] or got["in_process"], got


def test_status_counts_the_quantized_peers_whose_variant_it_accepts(swarm):
    """`diffuse status` checks each quantized peer's hashes against the variant this store makes,
    as a client does, and counts it (`any`: made here if the store lacks it); `--accept-quant none`
    excludes them."""
    def status(*options: str) -> dict:
        out = swarm.procs.run("status", "--bootstrap", swarm.boot, "--json", "--no-reach", "--no-daemon", *options,
                              timeout=180)
        assert out.returncode == 0, out.stderr
        (model,) = json.loads(out.stdout)["models"]
        return model

    every = status("--accept-quant", "any")
    counted = {p["peer_id"]: p["quant"] for p in every["peers"]}
    assert counted == {swarm.ids[n]: q for n, q in
                       [("q4", "int4"), ("q8", "int8"), ("bf", "none"), ("cheat4", "int4"), ("liar", "int8")]}, every
    assert not every["excluded"] and [b["replicas"] for b in every["blocks"][1:15]] == [4] * 14
    plain = status("--accept-quant", "none")
    assert {p["peer_id"] for p in plain["peers"]} == {swarm.ids["bf"]}
    assert all("variant, which is not accepted here" in why for why in plain["excluded"].values()), plain["excluded"]
    assert len(plain["excluded"]) == 4 and plain["missing"] == list(range(15))
