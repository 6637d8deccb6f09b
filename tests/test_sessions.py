"""Server and client sessions over in-memory streams: routing, failover replay, bad input.

The same code runs over libp2p in the multi-process tests; here the transport is a trio memory
stream so that the session logic is tested fast and deterministically.
"""

from __future__ import annotations

import pytest
import torch
import trio
import trio.testing

from diffuse.client.generate import stream_tokens
from diffuse.client.pipeline import LocalModel, LocalStage, Pipeline
from diffuse.client.rescue import Rescuable
from diffuse.client.sampling import Sampler, SamplingParams
from diffuse.control.routing import Hop, NoRoute
from diffuse.data.checks import Rejected
from diffuse.data.client import Bans, RemoteSpan
from diffuse.data.hop import Sent, rechunked
from diffuse.data.codec import Close, ErrorMsg, FrameDecoder, Open, OpenOk, Step, StepOk, encode
from diffuse.data.server import BlockServer, ServerLimits
from diffuse.errors import Rewind
from diffuse.model.load import load_head, load_span
from tiny import make_tiny

MODEL = "tiny"


class MemStream:
    """read/write/close over a trio memory stream, like a libp2p stream."""

    def __init__(self, s):
        self.s = s

    async def read(self, n: int = -1) -> bytes:
        try:
            return await self.s.receive_some(n if n > 0 else None)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            return b""

    async def write(self, data: bytes) -> None:
        await self.s.send_all(data)

    async def close(self) -> None:
        await self.s.aclose()


class Swarm:
    """Block servers by name, a router over them, and a dialer with fault injection."""

    def __init__(self, nursery, path, spans: dict[str, tuple[int, int]]):
        self.nursery, self.path = nursery, path
        self.servers = {name: BlockServer(MODEL, load_span(path, a, b)) for name, (a, b) in spans.items()}
        self.dead: set[str] = set()
        self.kill_after: dict[str, int] = {}  # name -> steps served before its streams break
        self.dials: list[str] = []
        self.steps: dict[str, list[Step]] = {}  # name -> every STEP clients sent it
        self.sent: list[bytes] = []  # every byte clients wrote, in order
        self.addrs: dict[str, tuple[str, ...]] = {}  # name -> the addresses its record announces
        self.quant: dict[str, str] = {}  # name -> the variant its record announces (else "none")

    async def route(self, start, end, exclude):
        from diffuse.control.routing import plan_route
        from types import SimpleNamespace as NS

        recs = [NS(peer_id=n, addrs=self.addrs.get(n, ()), start=s.span.start, end=s.span.end, online=True,
                   extra={"quant": self.quant.get(n, "none")},
                   fresh=lambda now: True, throughput=100.0, cache_tokens=10**6, started=0.0,
                   serves=lambda b, s=s: s.span.start <= b < s.span.end)
                for n, s in self.servers.items() if n not in self.dead]
        return plan_route(recs, start, end, exclude=exclude)

    async def dial(self, hop: Hop):
        self.dials.append(hop.peer_id)
        a, b = trio.testing.memory_stream_pair()
        server = self.servers[hop.peer_id]
        self.nursery.start_soon(self._serve, hop.peer_id, server, MemStream(b))
        return Recording(MemStream(a), self.steps.setdefault(hop.peer_id, []), self.sent)

    async def _serve(self, name, server, stream):
        if name in self.kill_after:
            stream = Dying(stream, self, name)
        await server.handle(stream)


class Recording:
    """A client-side stream that keeps what the client writes, and its STEPs decoded."""

    def __init__(self, inner, steps: list[Step], sent: list[bytes]):
        self.inner, self.steps, self.sent, self.decoder = inner, steps, sent, FrameDecoder()
        self.read, self.close = inner.read, inner.close

    async def write(self, data):
        self.sent.append(data)
        self.steps.extend(m for m in self.decoder.feed(data) if isinstance(m, Step))
        await self.inner.write(data)


class Dying:
    """A server-side stream that breaks (as a killed peer's would) after N replies."""

    def __init__(self, inner, swarm, name):
        self.inner, self.swarm, self.name = inner, swarm, name

    async def read(self, n=-1):
        if self.swarm.kill_after[self.name] <= 0:
            self.swarm.dead.add(self.name)
            await self.inner.close()
            return b""
        return await self.inner.read(n)

    async def write(self, data):
        if data[8] == 4:  # message type STEP_OK (after length, magic, version)
            self.swarm.kill_after[self.name] -= 1
        await self.inner.write(data)

    async def close(self):
        await self.inner.close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("tiny") / "t", layers=4)


async def greedy(pipe: Pipeline, prompt: list[int], n: int) -> list[int]:
    out = []
    logits = await pipe.forward(torch.tensor([prompt]))
    for _ in range(n):
        tok = int(logits[0, -1].argmax())
        out.append(tok)
        logits = await pipe.forward(torch.tensor([[tok]]))
    return out


def local_answer(path, prompt, n):
    model = LocalModel(load_head(path), [load_span(path, 0, 4)])
    return trio.run(greedy, model.session(64), prompt, n)


PROMPT = [5, 17, 42, 99, 3, 250, 7]


async def swarm_answer(path, spans, n, *, local_front=1, kill=None, dtype=torch.float32):
    async with trio.open_nursery() as nursery:
        swarm = Swarm(nursery, path, spans)
        if kill:
            swarm.kill_after.update(kill)
        head = load_head(path)
        remote = RemoteSpan(MODEL, local_front, 4, swarm.dial, swarm.route, Bans(), max_len=64, dtype=dtype,
                            timeout=10, route_wait=0)
        await remote.open()
        pipe = Pipeline(head, [LocalStage(load_span(path, 0, local_front), 64), remote])
        out = await greedy(pipe, PROMPT, n)
        await pipe.close()
        nursery.cancel_scope.cancel()
    return out, remote, swarm


def test_swarm_answer_equals_local(tiny):
    expected = local_answer(tiny, PROMPT, 12)
    out, remote, _ = trio.run(swarm_answer, tiny, {"a": (1, 3), "b": (3, 4)}, 12)
    assert out == expected
    assert [h["blocks"] for h in remote.route_taken] == [[1, 3], [3, 4]]


def test_failover_replays_into_replica(tiny):
    expected = local_answer(tiny, PROMPT, 12)
    # "a" is the one-hop route; when it dies its blocks are rebuilt on two hops (a2 then b).
    for kill_at in (0, 1, 5, 11):
        spans = {"a": (1, 4), "a2": (1, 3), "b": (3, 4)}
        out, remote, swarm = trio.run(lambda spans=spans, k=kill_at: swarm_answer(tiny, spans, 12, kill={"a": k}))
        assert out == expected, kill_at
        (failover,) = remote.stats.failovers
        assert failover["peer"] == "a"
        if kill_at == 0:  # died before its first step: the session is opened elsewhere
            assert failover["during"] == "open"
            continue
        assert failover["replaced_by"] == ["a2", "b"]
        assert failover["replayed_tokens"] == len(PROMPT) + kill_at - 1
        # Replayed as first sent, one STEP per committed step, flagged REPLAY; then the retried step.
        replayed = [len(m.positions) for m in swarm.steps["a2"] if m.replay]
        assert replayed == [len(PROMPT)] + [1] * (kill_at - 1)
        assert not swarm.steps["a2"][len(replayed)].replay


def test_replica_failing_during_replay_is_routed_around(tiny):
    expected = local_answer(tiny, PROMPT, 10)
    spans = {"x": (1, 4), "y": (1, 4), "z": (1, 4)}
    # x dies after 4 steps; the next replica dies on its first step (the replay); the third holds.
    out, remote, swarm = trio.run(lambda: swarm_answer(tiny, spans, 10, kill={"x": 4, "y": 0}))
    assert out == expected
    assert [f["during"] for f in remote.stats.failovers] == ["step", "replay"]


def test_no_replica_names_uncovered_blocks(tiny):
    with pytest.raises(ExceptionGroup) as info:
        trio.run(lambda: swarm_answer(tiny, {"b": (3, 4)}, 3))
    assert info.group_contains(NoRoute, match="blocks 1-2")


def test_last_replica_dying_reports_uncovered_blocks(tiny):
    with pytest.raises(ExceptionGroup) as info:
        trio.run(lambda: swarm_answer(tiny, {"x": (1, 4)}, 10, kill={"x": 3}))
    assert info.group_contains(NoRoute, match="blocks 1-3 .*banned")


async def raw_session(server: BlockServer, frames: list[bytes]) -> list:
    a, b = trio.testing.memory_stream_pair()
    replies = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.handle, MemStream(b))
        client = MemStream(a)
        dec = FrameDecoder()
        for f in frames:
            await client.write(f)
        with trio.move_on_after(5):
            while True:
                data = await client.read(65536)
                if not data:
                    break
                replies += dec.feed(data)
    return replies


def test_bad_input_is_answered_and_server_keeps_serving(tiny):
    server = BlockServer(MODEL, load_span(tiny, 0, 4), ServerLimits(max_session_tokens=100))
    sid = b"s" * 16
    ok_open = encode(Open(sid, MODEL, 0, 4, 32, 1, torch.float32))
    cases = {
        "garbage": [b"\x00\x00\x00\x05hello"],
        "oversized": [b"\xff\xff\xff\xff"],
        "wrong version": [ok_open[:6] + bytes([9]) + ok_open[7:]],
        "unknown model": [encode(Open(sid, "other", 0, 4, 32, 1, torch.float32))],
        "blocks not served": [encode(Open(sid, MODEL, 0, 9, 32, 1, torch.float32))],
        "too long": [encode(Open(sid, MODEL, 0, 4, 1000, 1, torch.float32))],
        "step before open": [encode(Step(sid, 0, 0, [0], torch.zeros(1, 1, 64)))],
    }

    async def run():
        got = {}
        for name, frames in cases.items():
            got[name] = await raw_session(server, frames)
        # A well-behaved session afterwards still works.
        step = encode(Step(sid, 0, 0, [0, 1], torch.randn(1, 2, 64)))
        good = await raw_session(server, [ok_open, step, encode(Close(sid))])
        return got, good

    got, good = trio.run(run)
    for name, replies in got.items():
        assert len(replies) == 1 and isinstance(replies[0], ErrorMsg), (name, replies)
        assert replies[0].message
    assert "not 'other'" in got["unknown model"][0].message
    assert "[0, 9)" in got["blocks not served"][0].message
    assert isinstance(good[0], OpenOk) and isinstance(good[1], StepOk)
    assert server.sessions == 0 and server.tokens_reserved == 0


def test_idle_session_is_freed(tiny):
    server = BlockServer(MODEL, load_span(tiny, 0, 4), ServerLimits(idle_timeout=0.3))
    sid = b"i" * 16

    async def run():
        a, b = trio.testing.memory_stream_pair()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.handle, MemStream(b))
            client = MemStream(a)
            await client.write(encode(Open(sid, MODEL, 0, 4, 32, 1, torch.float32)))
            dec = FrameDecoder()
            msgs = []
            with trio.fail_after(5):
                while len(msgs) < 2:
                    msgs += dec.feed(await client.read(65536))
            assert server.sessions == 0
            return msgs

    msgs = trio.run(run)
    assert isinstance(msgs[0], OpenOk)
    assert isinstance(msgs[1], ErrorMsg) and "idle" in msgs[1].message


class Failing(BlockServer):
    """A peer that starts answering ERROR to every step after serving `good` of them."""

    def __init__(self, *a, good: int, **k):
        super().__init__(*a, **k)
        self.good = good

    async def handle(self, stream):
        server = self

        class Wrapped:
            async def read(self, n=-1):
                return await stream.read(n)

            async def write(self, data):
                if data[8] == 4:  # STEP_OK
                    if server.good <= 0:
                        data = encode(ErrorMsg(9, "internal error: simulated fault"))
                    server.good -= 1
                await stream.write(data)

            async def close(self):
                await stream.close()

        await super().handle(Wrapped())


def test_peer_answering_errors_is_replaced(tiny):
    expected = local_answer(tiny, PROMPT, 10)

    async def run():
        async with trio.open_nursery() as nursery:
            swarm = Swarm(nursery, tiny, {"bad": (1, 4), "good": (1, 4)})
            swarm.servers["bad"] = Failing(MODEL, load_span(tiny, 1, 4), good=3)
            remote = RemoteSpan(MODEL, 1, 4, swarm.dial, swarm.route, Bans(), max_len=64, timeout=10)
            await remote.open()
            pipe = Pipeline(load_head(tiny), [LocalStage(load_span(tiny, 0, 1), 64), remote])
            out = await greedy(pipe, PROMPT, 10)
            nursery.cancel_scope.cancel()
        return out, remote

    out, remote = trio.run(run)
    assert out == expected
    (failover,) = remote.stats.failovers
    assert failover["peer"] == "bad" and "simulated fault" in failover["error"]
    assert failover["replaced_by"] == ["good"]


class Judge:
    """A layer above (data/checks.py's HopChecks) that wraps every hop session and judges the
    first one wrong at one position: before use (Rejected at once) or behind the generation
    (Rewind to `length`, then Rejected at its next step), as the trust plane's checks do."""

    commitments = False

    def __init__(self, at: int, length: int, behind: bool):
        self.at, self.length, self.behind = at, length, behind
        self.condemned: Judged | None = None
        self.wrapped: list[Judged] = []

    async def vet(self, hop, probe):
        return None

    def wrap(self, session):
        self.wrapped.append(Judged(session, self))
        return self.wrapped[-1]

    async def closed(self, hops, probe):
        return None


class Judged:
    def __init__(self, inner, judge: Judge):
        self.inner, self.judge, self.hop = inner, judge, inner.hop

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def step(self, h, positions, mask, commit):
        judge = self.judge
        if judge.condemned is self:
            raise Rejected("judged wrong behind the generation", judge.length, behind=True)
        if judge.condemned is None and self is judge.wrapped[0] and int(positions.min()) == judge.at:
            judge.condemned = self
            if judge.behind:
                raise Rewind(judge.length)
            await self.inner.step(h, positions, mask, commit)
            raise Rejected("judged wrong before use", judge.length)
        return await self.inner.step(h, positions, mask, commit)


@pytest.mark.parametrize("behind", [False, True], ids=["before-use", "behind"])
def test_a_hop_its_wrapper_rejects_is_replaced_with_the_same_answer(tiny, behind):
    """The data plane alone, with a layer above's wrapper: a hop judged wrong before use is replaced
    and the step redone; one judged wrong behind the generation first rewinds it (stream_tokens
    recomputes from there), then is replaced when that step comes again."""
    expected = local_answer(tiny, PROMPT, 10)
    at = len(PROMPT) + 4
    judge = Judge(at, len(PROMPT) + 2 if behind else at, behind)

    async def run():
        async with trio.open_nursery() as nursery:
            swarm = Swarm(nursery, tiny, {"x": (1, 4), "y": (1, 4)})
            remote = RemoteSpan(MODEL, 1, 4, swarm.dial, swarm.route, Bans(), max_len=64, timeout=10, checks=judge)
            await remote.open()
            pipe = Pipeline(load_head(tiny), [LocalStage(load_span(tiny, 0, 1), 64), remote])
            out = [t async for t in stream_tokens(pipe, PROMPT, Sampler(SamplingParams(max_tokens=10)), set())]
            await pipe.close()
            nursery.cancel_scope.cancel()
        return out, remote

    out, remote = trio.run(run)
    assert out == expected
    (failover,) = remote.stats.failovers
    assert failover["peer"] == judge.wrapped[0].hop.peer_id and failover["cause"] == "rejected"
    assert failover["during"] == ("check" if behind else "step")
    assert failover["replayed_tokens"] == judge.length  # its inputs before the output judged wrong
    assert remote.route_taken[0]["peer"] != failover["peer"]


def test_exact_session_tree_steps_match_plain_steps_bit_for_bit(tiny):
    """Peers grant EXACT; a tree of guesses with wrong siblings, through two hops and an fp16
    wire, yields the very logits of one-token steps. A peer that cannot grant it (here: one
    computing on a GPU) is routed around like a failed one."""

    async def run():
        async with trio.open_nursery() as nursery:
            swarm = Swarm(nursery, tiny, {"gpu": (1, 4), "a": (1, 3), "b": (3, 4)})
            swarm.servers["gpu"].device = torch.device("cuda")  # declines EXACT, computes nothing

            async def session():
                remote = RemoteSpan(MODEL, 1, 4, swarm.dial, swarm.route, Bans(), max_len=64, timeout=10,
                                    exact=True)
                await remote.open()
                return remote, Pipeline(load_head(tiny), [LocalStage(load_span(tiny, 0, 1), 64, exact=True),
                                                          remote], exact=True)

            remote, plain = await session()
            await plain.forward(torch.tensor([PROMPT]))
            want = torch.cat([(await plain.forward(torch.tensor([[t]])))[0] for t in range(20, 32)])
            _, tree = await session()
            await tree.forward(torch.tensor([PROMPT]))
            got, p = [], len(PROMPT)
            for chunk in (range(20, 25), range(25, 27), range(27, 32)):
                nodes = torch.tensor([[x for t in chunk for x in (t, 7)]])  # each guess and a wrong sibling
                mask = torch.eye(nodes.shape[1], dtype=torch.bool)
                for r in range(nodes.shape[1]):
                    mask[r, [2 * j for j in range(r // 2)]] = True
                positions = torch.arange(p, p + len(chunk)).repeat_interleave(2)
                got.append((await tree.forward(nodes, positions, mask, commit=False))[0, 0::2])
                await tree.commit(list(range(0, nodes.shape[1], 2)))
                p += len(chunk)
            nursery.cancel_scope.cancel()
        return remote, want, torch.cat(got)

    remote, want, got = trio.run(run)
    assert torch.equal(got, want)
    (failover,) = remote.stats.failovers
    assert failover["peer"] == "gpu" and "does not grant exact" in failover["error"]
    assert [h["blocks"] for h in remote.route_taken] == [[1, 3], [3, 4]]


def _needles(prompt: list[int], embed: torch.Tensor) -> list[bytes]:
    """Byte patterns that would betray the prompt: runs of 3 ids as u16/i32/i64 in either byte
    order, and the first 16 values of each prompt token's embedding row in every float dtype."""
    out = []
    ids = torch.tensor(prompt)
    # Runs like (n, n+1, n+2) are skipped: positions travel in the clear by design and would match.
    starts = [i for i in range(len(prompt) - 2) if not prompt[i + 2] == prompt[i + 1] + 1 == prompt[i] + 2]
    for dtype in (torch.int16, torch.int32, torch.int64):
        raw = ids.to(dtype).numpy()
        for arr in (raw, raw.byteswap()):
            out += [arr[i:i + 3].tobytes() for i in starts]
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        rows = embed[ids, :16].to(dtype).contiguous()
        out += [r.view(torch.uint8).numpy().tobytes() for r in rows]
    return out


async def _wire_bytes(path, prompt, front: int) -> bytes:
    async with trio.open_nursery() as nursery:
        swarm = Swarm(nursery, path, {"p": (front, 30)})
        n = len(prompt) + 8
        remote = RemoteSpan(MODEL, front, 30, swarm.dial, swarm.route, Bans(), max_len=n)
        await remote.open()
        stages = ([LocalStage(load_span(path, 0, front), n)] if front else []) + [remote]
        await greedy(Pipeline(load_head(path), stages), prompt, 4)
        nursery.cancel_scope.cancel()
    return b"".join(swarm.sent)


def test_client_sends_no_token_ids_or_embedding_rows(smollm2):
    from diffuse.model.tokenizer import Tokenizer

    tok = Tokenizer.load(smollm2)
    prompt = tok.encode_chat([{"role": "user", "content": "My account number is 4417 9153 8062 7391."}])
    needles = _needles(prompt, load_head(smollm2).embed.weight)
    wire = trio.run(_wire_bytes, smollm2, prompt, 1)
    assert len(wire) > 10_000
    assert not [n for n in needles if n in wire]
    # The same search finds the embedding rows when the client keeps no block: it can fail.
    exposed = trio.run(_wire_bytes, smollm2, prompt, 0)
    assert [n for n in needles if n in exposed]


async def exact_run(path, spans: dict[str, tuple[int, int]], kill: dict[str, int] | None = None):
    """Logits of an exact session over blocks 1-4 of `spans` (client-local block 0), fed fixed
    tokens: the prompt, three one-token steps, a tree of two guesses with wrong siblings (its
    kept path committed), four one-token steps."""
    async with trio.open_nursery() as nursery:
        swarm = Swarm(nursery, path, spans)
        swarm.kill_after.update(kill or {})
        remote = RemoteSpan(MODEL, 1, 4, swarm.dial, swarm.route, Bans(), max_len=64, timeout=10, route_wait=0,
                            exact=True)
        await remote.open()
        pipe = Pipeline(load_head(path), [LocalStage(load_span(path, 0, 1), 64, exact=True), remote], exact=True)
        logits = [await pipe.forward(torch.tensor([PROMPT]))]
        p = len(PROMPT)
        for tok in (11, 12, 13):
            logits.append(await pipe.forward(torch.tensor([[tok]])))
            p += 1
        nodes = torch.tensor([[14, 7, 15, 7]])  # guesses 14 then 15, each with a wrong sibling
        mask = torch.tensor([[1, 0, 0, 0], [0, 1, 0, 0], [1, 0, 1, 0], [1, 0, 0, 1]], dtype=torch.bool)
        logits.append((await pipe.forward(nodes, torch.tensor([p, p, p + 1, p + 1]), mask, commit=False))[:, [0, 2]])
        await pipe.commit([0, 2])
        for tok in (16, 17, 18, 19):
            logits.append(await pipe.forward(torch.tensor([[tok]])))
        await pipe.close()
        nursery.cancel_scope.cancel()
    return logits, remote, swarm


def test_exact_session_replays_history_in_one_chunk_bit_for_bit(tiny):
    """When a (1-4) dies, an exact session's replacements (a2: 1-3, b: 3-4) get its committed rows
    (the tree's kept path, not its siblings) as one REPLAY step each, and from the retried step on
    every logit has the bits of a session served by a2 and b from the start: failover costs a
    prefill, not a decode step per token."""
    want, _, _ = trio.run(exact_run, tiny, {"a2": (1, 3), "b": (3, 4)})
    for kill_at in (3, 5, 7):
        got, remote, swarm = trio.run(exact_run, tiny, {"a": (1, 4), "a2": (1, 3), "b": (3, 4)}, {"a": kill_at})
        assert all(torch.equal(g, w) for g, w in zip(got[kill_at:], want[kill_at:], strict=True)), kill_at
        (failover,) = remote.stats.failovers
        assert failover["peer"] == "a" and failover["replaced_by"] == ["a2", "b"]
        committed = len(PROMPT) + kill_at - 1 + (kill_at > 4)  # the tree step commits two tokens
        assert failover["replayed_tokens"] == committed
        for peer in ("a2", "b"):
            replayed = [m for m in swarm.steps[peer] if m.replay]
            assert [list(m.positions) for m in replayed] == [list(range(committed))], peer
            assert replayed[0].commit and replayed[0].mask is None and not replayed[0].keep


def test_rechunked_keeps_committed_rows_in_order_within_the_row_bound():
    h = torch.arange(2 * 10 * 3, dtype=torch.float32).view(2, 10, 3)  # batch 2, rows numbered
    history = [Sent(h[:, :4], torch.arange(4)),
               Sent(h[:, 4:8], torch.tensor([4, 4, 5, 5]), torch.ones(4, 4, dtype=torch.bool), keep=[0, 3]),
               Sent(h[:, 8:10], torch.tensor([6, 7]))]
    chunks = rechunked(history, rows=3)
    assert [c.tokens for c in chunks] == [3, 3, 2] and all(c.keep is None and c.mask is None for c in chunks)
    assert torch.equal(torch.cat([c.positions for c in chunks]), torch.arange(8))
    assert torch.equal(torch.cat([c.h for c in chunks], 1), h[:, [0, 1, 2, 3, 4, 7, 8, 9]])
    assert rechunked([]) == []


class Wire(MemStream):
    """A MemStream whose writes and close wait on the event loop first, as a network stream's
    do (yamux sends a frame to close): a cancelled caller gets nothing out unless it shields."""

    async def write(self, data: bytes) -> None:
        await trio.lowlevel.checkpoint()
        await super().write(data)

    async def close(self) -> None:
        await trio.lowlevel.checkpoint()
        await super().close()


async def _opened_then_cancelled(path, stall_second_dial: bool) -> list[int]:
    """Open a two-hop span over Wire streams and cancel its user (a client hanging up) once the
    first hop is open: either mid-build (the second dial never answers) or after open, closing
    inside the cancelled scope. Returns the servers' open sessions a moment later."""
    async with trio.open_nursery() as nursery:
        swarm = Swarm(nursery, path, {"a": (1, 2), "b": (2, 4)})
        opened = trio.Event()

        async def dial(hop):
            if hop.peer_id == "b" and stall_second_dial:
                opened.set()
                await trio.sleep_forever()
            a, b = trio.testing.memory_stream_pair()
            nursery.start_soon(swarm._serve, hop.peer_id, swarm.servers[hop.peer_id], Wire(b))
            return Wire(a)

        remote = RemoteSpan(MODEL, 1, 4, dial, swarm.route, Bans(), max_len=32, timeout=10, route_wait=0)
        scope = trio.CancelScope()

        async def hang_up() -> None:
            await opened.wait()
            scope.cancel()

        nursery.start_soon(hang_up)
        with scope:
            await remote.open()
            assert [s.sessions for s in swarm.servers.values()] == [1, 1]
            opened.set()
            await trio.sleep_forever()
        assert scope.cancelled_caught
        if not stall_second_dial:
            with trio.CancelScope() as closing:
                closing.cancel()
                await remote.close()  # in a cancelled scope, as a hung-up request's finally
        with trio.move_on_after(5):
            while any(s.sessions for s in swarm.servers.values()):
                await trio.sleep(0.01)
        left = [s.sessions for s in swarm.servers.values()]
        nursery.cancel_scope.cancel()
    return left


@pytest.mark.parametrize("stall_second_dial", [True, False], ids=["mid-build", "closing"])
def test_a_cancelled_client_frees_its_sessions_on_the_peers(tiny, stall_second_dial):
    assert trio.run(_opened_then_cancelled, tiny, stall_second_dial) == [0, 0]


async def _rescued_answer(path, n: int, kill_at: int, weights: bool) -> tuple[list[int], Rescuable]:
    """Greedy through two replicas of blocks 1-3 that both die after `kill_at` steps, the span
    wrapped to finish here (from the store, or from nowhere: `weights` False)."""
    async with trio.open_nursery() as nursery:
        swarm = Swarm(nursery, path, {"x": (1, 4), "y": (1, 4)})
        swarm.kill_after.update(x=kill_at, y=kill_at)
        remote = RemoteSpan(MODEL, 1, 4, swarm.dial, swarm.route, Bans(), max_len=64, dtype=torch.float32,
                            timeout=10, route_wait=0)
        await remote.open()

        def load(a, b):
            if not weights:
                raise FileNotFoundError("no weights for blocks 1-3 in this store")
            return load_span(path, a, b)

        middle = Rescuable(remote, load, 1 << 20, 64)
        pipe = Pipeline(load_head(path), [LocalStage(load_span(path, 0, 1), 64), middle])
        out: list[int] = []
        try:
            logits = await pipe.forward(torch.tensor([PROMPT]))
            for _ in range(n):
                out.append(int(logits[0, -1].argmax()))
                logits = await pipe.forward(torch.tensor([[out[-1]]]))
        except NoRoute:
            pass
        await pipe.close()
        nursery.cancel_scope.cancel()
    return out, middle


def test_a_span_the_swarm_lost_is_finished_here_with_the_same_answer(tiny):
    expected = local_answer(tiny, PROMPT, 12)
    for kill_at in (1, 6):
        out, middle = trio.run(_rescued_answer, tiny, 12, kill_at, True)
        assert out == expected, kill_at
        assert middle.rescued_at == len(PROMPT) + kill_at - 1  # every committed token replayed here
        assert {f["peer"] for f in middle.remote.stats.failovers} == {"x", "y"}


def test_without_the_weights_the_answer_stops_where_the_swarm_did(tiny):
    expected = local_answer(tiny, PROMPT, 12)
    out, middle = trio.run(_rescued_answer, tiny, 12, 6, False)
    assert middle.local is None
    assert out == expected[:6]
