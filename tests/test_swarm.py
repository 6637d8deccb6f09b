"""Inference through real swarms: a sentinel and `diffuse join` peers as separate OS processes on
127.0.0.1, clients as processes (`diffuse --client-only ask`) or in-process (to kill a peer at a
chosen step). Every greedy answer must equal the in-process answer token for token.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess

import pytest
import torch
import trio
from libp2p.crypto.ed25519 import create_new_key_pair

from support.procs import DIFFUSE, Procs, swarm_key
from support.swarm import LOCAL, QUICK_RECORDS, Swarm
from diffuse.client.generate import Generation, session_length
from diffuse.client.local import open_local
from diffuse.client.sampling import Sampler, SamplingParams
from diffuse.client.speculative import SpecConfig
from diffuse.client.swarm import SwarmClient, SwarmOptions, remote_of
from diffuse.control.host import parse_peer_addr
from diffuse.control.node import NodeConfig, open_node
from diffuse.data.codec import PROTOCOL_ID, FrameDecoder, ErrorMsg
from diffuse.home import DEFAULT_MODEL, models_dir
from diffuse.model.tokenizer import Tokenizer
from diffuse.trust import reputation

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
QUESTION = "Name three famous rivers and the countries they flow through."
TOKENS = 24


@pytest.fixture(scope="module")
def reference(home) -> list[int]:
    return reference_answer(home)


def reference_answer(home) -> list[int]:
    """The in-process answer, in the swarm's default dtype (bf16 compute, fp16 on the wire is
    lossless for this model's activations)."""
    model, tok = open_local(home, None, "bf16")
    prompt = tok.encode_chat([{"role": "user", "content": QUESTION}])

    async def run():
        gen = Generation(model.session(len(prompt) + TOKENS), tok, prompt, SamplingParams(max_tokens=TOKENS))
        async for _ in gen:
            pass
        return gen.completion.token_ids

    return trio.run(run)


def ask(procs: Procs, boot: str, *extra: str) -> dict:
    """`ask --json`, plain: speculation on the fast kernels may flip a near-tie against the
    one-token reference (its own tests cover it)."""
    out = procs.run("--client-only", "ask", "--bootstrap", boot, "--json", "--max-tokens", str(TOKENS),
                    "--wait", "30", "--no-speculate", *extra, QUESTION, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.timeout(1200)  # two swarms, a peer of other weights, a kill
def test_two_and_three_hops_equal_local(home, tmp_path, reference):
    with Procs(home) as procs:
        two = Swarm(procs, tmp_path / "two", {"A": "1:15", "B": "15:30"})
        got = ask(procs, two.boot)
        assert got["token_ids"] == reference
        assert [h["blocks"] for h in got["route"]] == [[1, 15], [15, 30]]
        # Client-local blocks at both ends: the swarm serves a sub-range of each peer's span.
        got = ask(procs, two.boot, "--local-blocks", "3,2")
        assert got["token_ids"] == reference
        assert [h["blocks"] for h in got["route"]] == [[3, 15], [15, 28]]
    with Procs(home) as procs:
        three = Swarm(procs, tmp_path / "three", {"C": "1:10", "D": "10:20", "E": "20:30"})
        # X announces the same model with other weights for block 20, over blocks 1-29: status sets
        # it aside, the route avoids it, and once D dies it is no replica of blocks 10-19 for a
        # client without the trust plane (with its hashes unchecked, that client finishes on X).
        other = store_copy(home, tmp_path / "other", scale={20: 0.5})
        x = procs.start("--home", str(other), "join", "--identity", str(tmp_path / "X.key"), "--bootstrap",
                        three.boot, "--listen", LOCAL, "--blocks", "1:30", *QUICK_RECORDS)
        x_id = parse_peer_addr(x.read_until("serving", timeout=180)[0]).peer_id.to_base58()
        excluded: dict = {}
        for _ in range(60):  # until its record is read, and set aside
            out = procs.run("status", "--bootstrap", three.boot, "--json", "--no-reach", timeout=120)
            assert out.returncode == 0, out.stderr
            excluded = next(m for m in json.loads(out.stdout)["models"] if m["model"] == DEFAULT_MODEL)["excluded"]
            if x_id in excluded:
                break
        assert excluded.get(x_id) == "announces other weights for blocks 20", excluded
        got = ask(procs, three.boot)
        assert got["token_ids"] == reference
        assert [h["blocks"] for h in got["route"]] == [[1, 10], [10, 20], [20, 30]]
        assert x_id not in [h["peer"] for h in got["route"]]
        uncovered_then_unreachable(home, tmp_path / "partial", three, reference)


def store_copy(home, dest, scale: dict[int, float] | None = None, drop: range = range(0)):
    """A store holding the default model's files hard-linked, its weights indexed by a
    model.safetensors.index.json: blocks in `drop` left out (a client that does not hold them),
    and each block of `scale` with its MLP's down projection scaled (other weights, rehashed into
    the copy's own manifest)."""
    from safetensors.torch import save_file
    from diffuse.model.weights import BLOCK_PREFIX, ModelFiles, write_manifest

    src = models_dir(home) / DEFAULT_MODEL
    d = models_dir(dest) / DEFAULT_MODEL
    d.mkdir(parents=True)
    for f in src.iterdir():
        os.link(f, d / f.name)  # model.safetensors included: the index maps most tensors to it
    files = ModelFiles(src)
    where = {n: "model.safetensors" for n, f in files.where.items()
             if not any(n.startswith(f"{BLOCK_PREFIX}{i}.") for i in drop)}
    for i, factor in (scale or {}).items():
        name = f"{BLOCK_PREFIX}{i}.mlp.down_proj.weight"
        save_file({name: files.read([name])[name] * factor}, d / f"other-{i}.safetensors")
        where[name] = f"other-{i}.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": where}))
    if scale:
        (d / "manifest.json").unlink()  # a link to the source's: replaced, not written through
        write_manifest(d)
    return dest


def uncovered_then_unreachable(home, tmp, swarm: Swarm, reference: list[int]) -> None:
    """D, the only peer of blocks 10-19 whose hashes match (X's do not), is SIGKILLed mid-answer.
    A client whose store lacks those blocks cannot finish the answer itself: it stops, keeping
    the tokens it showed, with finish_reason "uncovered blocks 10-19". `status`, started as D
    dies (its record lives on for the record TTL), dials each peer and says D is UNREACHABLE
    from here, with the reason."""
    model_dir = models_dir(store_copy(home, tmp, drop=range(10, 20))) / DEFAULT_MODEL

    async def run():
        config = NodeConfig(listen=[LOCAL], bootstrap=[swarm.boot], server=False, swarm_key=swarm_key())
        async with open_node(create_new_key_pair(), config, codecs=reputation.swarm_codecs()) as node:
            # Rescue on, as by default; the trust plane off, as it must be for such a client: it
            # judges peers by recomputing their blocks (client/from_swarm.py fetches them all).
            client = SwarmClient(node, model_dir, SwarmOptions(trust=None))
            tok = Tokenizer.load(model_dir)
            prompt = tok.encode_chat([{"role": "user", "content": QUESTION}])
            pipe = await client.session(len(prompt) + TOKENS)
            gen = Generation(pipe, tok, prompt, SamplingParams(max_tokens=TOKENS))
            async for _ in gen:
                if not status:  # once the first token is shown
                    swarm.kill("D")
                    status.append(subprocess.Popen([*DIFFUSE, "status", "--bootstrap", swarm.boot], text=True,
                                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=swarm.procs.env))
            await pipe.close()
            return gen.completion

    status: list[subprocess.Popen] = []
    try:
        done = trio.run(run)
        out, err = status[0].communicate(timeout=180)
    finally:
        for proc in status:
            proc.kill()
            proc.wait()
    assert done.finish_reason == "uncovered blocks 10-19", done
    assert 1 <= len(done.token_ids) < TOKENS and done.token_ids == reference[:len(done.token_ids)], done
    assert status[0].returncode == 0, err
    lines = {name: next((line for line in out.splitlines() if line.strip().startswith(f"{pid[:6]}..{pid[-4:]} ")), "")
             for name, pid in swarm.ids.items()}
    assert re.search(r"UNREACHABLE from here \(.+\)", lines["D"]), out
    assert "direct" in lines["C"] and "direct" in lines["E"], out


# What `ask` runs by default (speculating), greedy without speculation, and a seeded sampled answer.
KILL_MODES = {"plain": (SamplingParams(max_tokens=TOKENS), None),
              "ask's defaults": (SamplingParams(max_tokens=TOKENS), SpecConfig()),
              "sampled": (SamplingParams(max_tokens=TOKENS, temperature=0.8, top_p=0.95, seed=7), SpecConfig())}


NEAR_TIE = 0.35  # a step of bf16 at these logits' magnitude (up to 64: 0.25), over 0.8's temperature


async def near_tie_margin(home, prompt: list[int], got: list[int], want: list[int], sampling: SamplingParams) -> float:
    """Where two answers first differ, how far apart the local model puts the two tokens (in the
    score the sampler takes the argmax of: the logit, or log-probability plus the index's noise),
    checking that no other token comes between them; 0.0 where they do not differ."""
    i = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if i is None:
        return 0.0
    model, _ = open_local(home, None, "bf16")
    context = prompt + want[:i]
    pipe = model.session(len(context) + 1)
    last, sampler = (await pipe.forward(torch.tensor([context])))[0, -1].float(), Sampler(sampling)
    await pipe.close()
    sampler.index = i
    scores = last if sampling.greedy else sampler.probs(last).log() + sampler.noise(last.shape[-1])
    assert set(scores.topk(2).indices.tolist()) == {got[i], want[i]}, (i, got[i], want[i], scores.topk(3))
    return float(abs(scores[got[i]] - scores[want[i]]))


@pytest.mark.timeout(1500)  # six kills and restarts; ~1 min on a quiet 2-core machine
def test_sigkill_mid_generation_keeps_the_answer(home, tmp_path, reference):
    """Six generations; in each, the peer on the route for one half is SIGKILLed after k tokens
    (each mode loses each half once), in turn plain greedy, as `ask` runs by default
    (speculating, bf16, trust on) and sampled with a seed. Each answer equals the one without a
    kill: the local answer for plain greedy, the swarm's fault-free answer in the same mode for
    the others, up to a near-tie where a speculating step's width rounded a pass the other way
    (the margin checked). The trust plane shows a token only once its checks have passed, up to
    max_lag (16) tokens behind the generation, and a speculating step makes several, so k stays
    low enough that steps remain after the kill."""
    model_dir = models_dir(home) / DEFAULT_MODEL
    with Procs(home) as procs:
        swarm = Swarm(procs, tmp_path, {"A": "1:15", "A2": "1:15", "B": "15:30", "B2": "15:30"})

        async def run() -> list[dict]:
            results = []
            async with open_node(create_new_key_pair(),
                                 NodeConfig(listen=[LOCAL], bootstrap=[swarm.boot], server=False,
                                            swarm_key=swarm_key()), codecs=reputation.swarm_codecs()) as node:
                client = SwarmClient(node, model_dir, SwarmOptions())
                tok = Tokenizer.load(model_dir)
                prompt = tok.encode_chat([{"role": "user", "content": QUESTION}])

                async def answer(mode: str, kill_at: int | None = None, half: int = 0) -> dict:
                    sampling, spec = KILL_MODES[mode]
                    pipe = await client.session(session_length(len(prompt), TOKENS, spec))
                    remote = remote_of(pipe)
                    victim = swarm.name_of(remote.route_taken[half]["peer"])
                    gen = Generation(pipe, tok, prompt, sampling, speculate=spec)
                    n = 0
                    async for _ in gen:
                        n += 1
                        if n == kill_at:
                            swarm.proc[victim].signal(signal.SIGKILL)
                    await pipe.close()
                    trees = sum(m == "tree" for m in gen.state.stats.modes) if gen.state else 0
                    return {"tokens": gen.completion.token_ids, "mode": mode, "kill_at": kill_at, "victim": victim,
                            "failovers": remote.stats.failovers, "trees": trees}

                expected = {"plain": reference} | {m: (await answer(m))["tokens"] for m in KILL_MODES if m != "plain"}
                assert expected["sampled"] != reference  # sampling, not greedy
                starting: set[str] = set()  # killed, started again, maybe not serving yet
                for run_no in range(6):
                    mode, half = list(KILL_MODES)[run_no % 3], run_no % 2
                    for name in [n for n in starting if n.startswith("AB"[half])]:  # a replica to fail over to
                        swarm.wait(name)
                        starting.discard(name)
                    kill_at = 1 + run_no * 5 // 3 if mode == "plain" else 1 + run_no % 2  # 1 or 6 of 24; 1..2
                    r = await answer(mode, kill_at, half)
                    if mode == "plain":
                        assert r["tokens"] == expected[mode], r
                    else:
                        sampling = KILL_MODES[mode][0]
                        r["margin"] = await near_tie_margin(home, prompt, r["tokens"], expected[mode], sampling)
                        assert r["margin"] < NEAR_TIE and len(r["tokens"]) == len(expected[mode]), r
                    assert r["failovers"] and r["failovers"][0]["peer"] == swarm.ids[r["victim"]], r
                    results.append(r)
                    swarm.proc[r["victim"]].wait(10)
                    swarm.start(r["victim"])  # back while the next run kills the other half (same identity)
                    starting.add(r["victim"])
            return results

        results = trio.run(run)
        assert len(results) == 6
        assert all(r["trees"] for r in results if r["mode"] != "plain"), results  # speculation did speculate


def test_peer_answering_errors_mid_generation_keeps_the_answer(home, tmp_path, reference):
    """Both replicas of blocks 15:30 end a session idle for 8 s with an ERROR reply: the client
    pauses 12 s after token k, so the peer on its route answers the next STEP with that error (a
    real peer's error frame mid-generation); the client bans it and fails over to the other. The
    trust plane is off: its canaries idle sessions on purpose (pacing), and it has its own tests."""
    model_dir = models_dir(home) / DEFAULT_MODEL
    short = ["--session-timeout", "8"]
    with Procs(home) as procs:
        swarm = Swarm(procs, tmp_path, {"A": "1:15", "B": "15:30", "B2": "15:30"}, {"B": short, "B2": short})

        async def run() -> list[dict]:
            results = []
            async with open_node(create_new_key_pair(), NodeConfig(listen=[LOCAL], bootstrap=[swarm.boot], server=False,
                                                                   swarm_key=swarm_key())) as node:
                client = SwarmClient(node, model_dir, SwarmOptions(trust=None))
                tok = Tokenizer.load(model_dir)
                prompt = tok.encode_chat([{"role": "user", "content": QUESTION}])
                for pause_at in (2, 11):
                    pipe = await client.session(len(prompt) + TOKENS)
                    remote = remote_of(pipe)
                    gen = Generation(pipe, tok, prompt, SamplingParams(max_tokens=TOKENS))
                    n, erring = 0, None
                    async for _ in gen:
                        n += 1
                        if n == pause_at:
                            erring = remote.route_taken[1]["peer"]
                            await trio.sleep(12)
                    await pipe.close()
                    other = next(p for name, p in swarm.ids.items() if name.startswith("B") and p != erring)
                    r = {"tokens": gen.completion.token_ids, "failovers": remote.stats.failovers}
                    assert r["tokens"] == reference, r
                    assert [(f["peer"], f["replaced_by"]) for f in r["failovers"]] == [(erring, [other])], r
                    assert "session idle" in r["failovers"][0]["error"], r
                    results.append(r)
                    client.bans.lift(erring)
            return results

        assert len(trio.run(run)) == 2


def test_bad_frames_to_a_real_peer_leave_it_serving(home, tmp_path, reference):
    with Procs(home) as procs:
        swarm = Swarm(procs, tmp_path, {"P": "1:30"})

        async def abuse() -> list:
            replies = []
            async with open_node(create_new_key_pair(), NodeConfig(listen=[LOCAL], bootstrap=[swarm.boot], server=False,
                                                                   swarm_key=swarm_key())) as node:
                info = parse_peer_addr(swarm.addrs["P"])
                await node.host.connect(info)
                for frame in (b"\x00\x00\x00\x05hello", b"\xff\xff\xff\xff",
                              b"\x00\x00\x00\x18DF\x09\x00\x01\x00\x00\x00" + bytes(16)):
                    stream = await node.host.new_stream(info.peer_id, [PROTOCOL_ID])
                    await stream.write(frame)
                    dec, got = FrameDecoder(), []
                    with trio.fail_after(30):
                        while not got:
                            got = dec.feed(await stream.read(65536))
                    replies.append(got[0])
                    await stream.close()
                # An abrupt disconnect in the middle of a frame.
                stream = await node.host.new_stream(info.peer_id, [PROTOCOL_ID])
                await stream.write(b"\x00\x00\x01\x00DF")
                await stream.reset()
            return replies

        replies = trio.run(abuse)
        assert all(isinstance(r, ErrorMsg) for r in replies), replies
        assert "version" in replies[2].message
        assert ask(procs, swarm.boot)["token_ids"] == reference


def test_sigterm_drains_then_hands_off(home, tmp_path, reference):
    """A peer told to stop withdraws at once, lets its open session finish (no failover), then
    exits; with a short --drain-timeout it instead ends the session with an ERROR and the client
    replays it into the replica. Both answers equal the local one."""
    model_dir = models_dir(home) / DEFAULT_MODEL
    with Procs(home) as procs:
        swarm = Swarm(procs, tmp_path, {"A": "1:30", "A2": "1:30"})

        async def generate(client, tok, prompt, victim: str, on_token) -> dict:
            other = next(p for n, p in swarm.ids.items() if n != victim)
            run = next(r.started for r in await client.records() if r.peer_id == other)
            client.bans.ban(other, run)  # the session must start on the victim (a ban of its current run)
            pipe = await client.session(len(prompt) + TOKENS)
            client.bans.lift(other)
            remote = remote_of(pipe)
            assert remote.route_taken[0]["peer"] == swarm.ids[victim]
            gen = Generation(pipe, tok, prompt, SamplingParams(max_tokens=TOKENS))
            n = 0
            async for _ in gen:
                n += 1
                await on_token(n)
            await pipe.close()
            return {"tokens": gen.completion.token_ids, "failovers": remote.stats.failovers}

        async def run() -> tuple[dict, dict, list]:
            async with open_node(create_new_key_pair(), NodeConfig(listen=[LOCAL], bootstrap=[swarm.boot], server=False,
                                                                   swarm_key=swarm_key())) as node:
                client = SwarmClient(node, model_dir, SwarmOptions(trust=None))
                tok = Tokenizer.load(model_dir)
                prompt = tok.encode_chat([{"role": "user", "content": QUESTION}])
                online: list = []

                async def drain_at_3(n: int) -> None:
                    if n == 3:
                        swarm.proc["A"].signal(signal.SIGTERM)
                        await trio.sleep(2.0)  # the tombstone is out while the session still runs
                        online.extend(r.peer_id for r in await node.records(DEFAULT_MODEL))

                finished = await generate(client, tok, prompt, "A", drain_at_3)
                assert swarm.proc["A"].wait(30) == 0
                swarm.extra["A"] = ["--drain-timeout", "1"]
                swarm.start("A")
                swarm.wait("A")

                async def hand_off_at_3(n: int) -> None:
                    if n == 3:
                        swarm.proc["A"].signal(signal.SIGTERM)
                        await trio.sleep(4.0)  # past the 1 s drain: the peer hands the session off

                handed = await generate(client, tok, prompt, "A", hand_off_at_3)
                return finished, handed, online

        finished, handed, online = trio.run(run)
        assert finished["tokens"] == reference and finished["failovers"] == [], finished
        assert swarm.ids["A"] not in online and swarm.ids["A2"] in online, online
        assert handed["tokens"] == reference, handed
        assert [(f["peer"], f["replaced_by"]) for f in handed["failovers"]] == [(swarm.ids["A"], [swarm.ids["A2"]])]
        assert swarm.proc["A"].wait(30) == 0
        assert any("handed 1 sessions to replicas" in line for line in swarm.proc["A"].stderr), swarm.proc["A"].stderr
