"""Chain routes over in-memory streams (protocol 1.2): peers forward outputs to each other.

The same server and client code as over libp2p (tests/test_chain_swarm.py runs it through real
processes); here each peer dials the next over a trio memory stream, so the rules are tested
fast: the client sends only the first hop's STEPs, the answer is the star's, a stranger cannot
attach to a session, an altered forward is caught, a dead hop is replaced.
"""

from __future__ import annotations

import struct
from dataclasses import replace
from types import SimpleNamespace as NS

import pytest
import torch
import trio
import trio.testing

from diffuse.client.pipeline import LocalStage, Pipeline
from diffuse.data.chain import BadChainTarget
from diffuse.data.client import Bans, RemoteSpan
from diffuse.data.codec import Attach, ErrorCode, ErrorMsg, FrameDecoder, encode
from diffuse.data.server import BlockServer
from diffuse.model.load import load_head, load_span
from test_sessions import MODEL, PROMPT, MemStream, Recording, Swarm, greedy, local_answer
from tiny import make_tiny

SPANS = {"a": (1, 2), "b": (2, 3), "c": (3, 4)}
STUCK_S = 6.0  # a hanging link write's life: past the link's wait (link_write_s), short of the test's


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("tiny") / "t", layers=4)


class ChainSwarm(Swarm):
    """Swarm whose servers dial each other (as `name`), so hops can forward."""

    def __init__(self, nursery, path, spans, alter: dict | None = None):
        super().__init__(nursery, path, spans)
        self.cut: set[tuple[str, str]] = set()  # links (from, to) that fail while both peers live
        self.silent: set[tuple[str, str]] = set()  # links whose bytes vanish: writes succeed, nothing arrives
        self.stuck: set[tuple[str, str]] = set()  # links whose writes hang, past any cancellation
        self.padding: dict[str, bytes] = {}  # name -> bytes that make its record that much larger
        for name, server in self.servers.items():
            server.dial = self._peer_dial(name)
            server.alter_forward = (alter or {}).get(name)
            server.addrs_of = self._addrs_of  # these peers have names, not keys: tests/test_chain_records.py signs

    async def route(self, start, end, exclude):
        return [replace(h, signed=NS(payload=f"record of {h.peer_id}".encode() + self.padding.get(h.peer_id, b""),
                                     signature=b"s" * 64)) for h in await super().route(start, end, exclude)]

    def _addrs_of(self, down):
        """The stand-in for signed_addrs: the record the route gave for that peer, or refused."""
        if not down.record.startswith(f"record of {down.peer_id}".encode()):
            raise BadChainTarget(f"not the record of {down.peer_id}")
        return self.addrs.get(down.peer_id, ())

    def _peer_dial(self, me: str):
        async def dial(peer_id: str, addrs):
            if peer_id in self.dead:
                raise ConnectionError(f"{peer_id} is down")
            a, b = trio.testing.memory_stream_pair()
            server = self.servers[peer_id]
            self.nursery.start_soon(self._serve_as, me, peer_id, server, MemStream(b))
            return Killable(MemStream(a), self, peer_id, count=False, sender=me)
        return dial

    async def _serve_as(self, remote, name, server, stream):
        await server.handle(stream, remote)

    async def dial(self, hop):
        self.dials.append(hop.peer_id)
        a, b = trio.testing.memory_stream_pair()
        self.nursery.start_soon(self._serve, hop.peer_id, self.servers[hop.peer_id], MemStream(b))
        return Recording(MemStream(a), self.steps.setdefault(hop.peer_id, []), self.sent)

    async def _serve(self, name, server, stream):
        await server.handle(Killable(stream, self, name), "client")


class Killable:
    """A stream to or of peer `name` that dies with it: after kill_after[name] STEP_OKs the peer's
    client stream closes mid-step, as a SIGKILLed peer's would, and links to it fail."""

    def __init__(self, inner, swarm, name, count=True, sender=None):
        self.inner, self.swarm, self.name, self.count, self.sender = inner, swarm, name, count, sender
        self.read, self.close = inner.read, inner.close

    async def write(self, data):
        if self.count and data[8] == 4 and self.name in self.swarm.kill_after:
            self.swarm.kill_after[self.name] -= 1
            if self.swarm.kill_after[self.name] < 0:
                self.swarm.dead.add(self.name)
        if self.name in self.swarm.dead or (self.sender, self.name) in self.swarm.cut:
            await self.inner.close()
            raise trio.BrokenResourceError(f"{self.name} is dead")
        if (self.sender, self.name) in self.swarm.silent:
            return
        if (self.sender, self.name) in self.swarm.stuck:  # a whole-message write into a full socket
            with trio.CancelScope(shield=True):
                await trio.sleep(STUCK_S)
            raise trio.BrokenResourceError("the write timed out")
        await self.inner.write(data)


async def chain_answer(path, spans, n, shape="auto", kill=None, alter=None, during=None, addrs=None, padding=None,
                       open_first=True):
    async with trio.open_nursery() as nursery:
        swarm = ChainSwarm(nursery, path, spans, alter)
        swarm.padding.update(padding or {})
        swarm.kill_after.update(kill or {})
        swarm.addrs.update(addrs or {})
        remote = RemoteSpan(MODEL, 1, 4, swarm.dial, swarm.route, Bans(), max_len=64, dtype=torch.float32,
                            timeout=10, route_wait=0, shape=shape)
        if open_first:
            await remote.open()
        if during is not None:
            await during(swarm, remote)
        pipe = Pipeline(load_head(path), [LocalStage(load_span(path, 0, 1), 64), remote])
        out = await greedy(pipe, PROMPT, n)
        route = remote.route_taken
        await pipe.close()
        nursery.cancel_scope.cancel()
    return out, remote, swarm, route


def test_chain_equals_star_and_the_client_sends_only_the_first_hop(tiny):
    expected = local_answer(tiny, PROMPT, 10)
    star, _, star_swarm, star_route = trio.run(lambda: chain_answer(tiny, SPANS, 10, "star"))
    chain, remote, swarm, route = trio.run(lambda: chain_answer(tiny, SPANS, 10, "chain"))
    assert chain == star == expected
    assert [h["output"] for h in route] == ["peer", "peer", "client"]
    assert [h["output"] for h in star_route] == ["client"] * 3
    assert [h["forwarded_steps"] for h in route] == [11, 11, 0]  # the prompt, then one step per token
    assert len(swarm.steps["a"]) == 11 and not swarm.steps["b"] and not swarm.steps["c"]
    assert all(len(star_swarm.steps[n]) == 11 for n in "abc")
    assert not remote.stats.failovers and not remote.stats.links


@pytest.mark.parametrize("shape", ["chain", "star"])
def test_a_span_never_opened_opens_at_its_first_step(tiny, shape):
    """A pipeline's first forward through a span nobody opened computes its blocks, not skips them."""
    out, remote, swarm, route = trio.run(lambda: chain_answer(tiny, SPANS, 6, shape, open_first=False))
    assert out == local_answer(tiny, PROMPT, 6)
    assert len(route) == 3 and len(swarm.steps["a"]) == 7


def test_a_next_peer_whose_record_is_too_large_for_an_open_is_returned_through_the_client(tiny):
    """c's record is larger than an OPEN may carry before OPEN_OK (4096 bytes): b's OPEN does not name
    it, so b is neither refused nor banned and returns through the client; a names b's record whole."""
    from diffuse.data.client import CHAIN_RECORD_BYTES

    async def pad(swarm, remote):
        pass

    out, remote, _, route = trio.run(lambda: chain_answer(tiny, SPANS, 4, padding={"c": b"x" * CHAIN_RECORD_BYTES}))
    assert out == local_answer(tiny, PROMPT, 4)
    assert [h["output"] for h in route] == ["peer", "client", "client"]
    assert remote.hops[1].downstream is None and "small enough" in route[1]["link_error"]
    assert remote.hops[0].downstream.record == b"record of b" and not remote.stats.failovers


def test_a_stranger_cannot_send_frames_into_a_session(tiny):
    """A peer the client did not name (here "x") attaching to hop b's session is refused with
    FORBIDDEN; the session and the chain carry on."""
    refused = []

    async def stranger(swarm, remote):
        for sid in (remote.hops[1].session_id, b"\x07" * 16):
            stream = await swarm._peer_dial("x")("b", ())
            await stream.write(encode(Attach(sid)))
            dec, got = FrameDecoder(), []
            with trio.fail_after(5):
                while not got:
                    got = dec.feed(await stream.read(65536))
            refused.append(got[0])

    out, remote, _, route = trio.run(lambda: chain_answer(tiny, SPANS, 8, during=stranger))
    assert out == local_answer(tiny, PROMPT, 8)
    assert all(isinstance(m, ErrorMsg) and m.code == ErrorCode.FORBIDDEN for m in refused), refused
    assert [h["output"] for h in route] == ["peer", "peer", "client"]


def test_an_altered_forward_is_caught_and_the_answer_kept(tiny):
    """Hop a forwards altered outputs while its copy to the client is honest: b's received-input
    commitment differs from a's committed output at once; b is replaced (both banned: either may
    lie), and the steps after it go through the client."""
    from diffuse.data.checks import NoChecks
    from diffuse.trust.tamper import altered_forward

    class Committed(NoChecks):
        commitments = True

    async def run():
        async with trio.open_nursery() as nursery:
            swarm = ChainSwarm(nursery, tiny, {**SPANS, "b2": (2, 3)}, {"a": altered_forward(10.0)})
            remote = RemoteSpan(MODEL, 1, 4, swarm.dial, swarm.route, Bans(), max_len=64, dtype=torch.float32,
                                timeout=10, route_wait=0, checks=Committed())
            await remote.open()
            first = remote.hops[1].hop.peer_id
            pipe = Pipeline(load_head(tiny), [LocalStage(load_span(tiny, 0, 1), 64), remote])
            out = await greedy(pipe, PROMPT, 8)
            await pipe.close()
            nursery.cancel_scope.cancel()
        return out, remote, first

    out, remote, first = trio.run(run)
    assert out == local_answer(tiny, PROMPT, 8)
    failover, *rest = remote.stats.failovers
    assert failover["cause"] == "link" and failover["link"] == ["a", first], failover
    assert failover["during"] == "step"
    # The hop after it computed what the replaced hop had forwarded: rebuilt, not blamed.
    assert [f["cause"] for f in rest] in ([], ["stale"]), rest


@pytest.mark.parametrize("victim", ["b", "c"])
def test_a_dead_hop_of_a_chain_is_replaced_with_the_same_answer(tiny, victim):
    spans = {**SPANS, "b2": (2, 3), "c2": (3, 4)}
    expected = local_answer(tiny, PROMPT, 10)

    async def pin(swarm, remote):  # the chain a-b-c is what opened: replicas only for the failover
        assert [h.hop.peer_id for h in remote.hops] in (["a", "b", "c"], ["a", "b2", "c"], ["a", "b", "c2"],
                                                         ["a", "b2", "c2"])
        name = remote.hops[1 if victim == "b" else 2].hop.peer_id
        swarm.kill_after[name] = 4
        killed.append(name)

    killed: list[str] = []
    out, remote, swarm, route = trio.run(lambda: chain_answer(tiny, spans, 10, during=pin))
    assert out == expected
    (failover,) = remote.stats.failovers
    assert failover["peer"] == killed[0] and failover["cause"] == "closed"
    assert route[-1]["output"] == "client"


@pytest.mark.parametrize("fault, error", [("cut", "closed the link|forwarding failed"),
                                          ("stuck", "did not take a frame"), ("silent", "no input forwarded by b")])
def test_a_dead_link_between_live_peers_is_reported_and_stepped_around(tiny, fault, error):
    """The link b -> c fails mid-answer while both peers live: broken (b's next STEP_OK says so at
    once), hanging (b stops waiting after link_write_s and says so, its write still pending), or
    silent (b's writes succeed and nothing arrives: c's step runs out its deadline and the client
    sends that step itself). The client steps c itself from then on, nobody is replaced, and it
    knows which link failed."""
    async def run():
        async with trio.open_nursery() as nursery:
            swarm = ChainSwarm(nursery, tiny, SPANS)
            remote = RemoteSpan(MODEL, 1, 4, swarm.dial, swarm.route, Bans(), max_len=64, dtype=torch.float32,
                                timeout=10, route_wait=0)
            await remote.open()
            pipe = Pipeline(load_head(tiny), [LocalStage(load_span(tiny, 0, 1), 64), remote])
            out = []
            logits = await pipe.forward(torch.tensor([PROMPT]))
            for i in range(10):
                if i == 4:
                    getattr(swarm, fault).add(("b", "c"))
                tok = int(logits[0, -1].argmax())
                out.append(tok)
                logits = await pipe.forward(torch.tensor([[tok]]))
            route = remote.route_taken
            await pipe.close()
            nursery.cancel_scope.cancel()
        return out, remote, route

    out, remote, route = trio.run(run)
    assert out == local_answer(tiny, PROMPT, 10)
    assert not remote.stats.failovers
    links = remote.stats.links  # silent: then b's link ends too, as c takes the step from the client
    assert links and all(k["link"] == ["b", "c"] and k["when"] == "step" for k in links), links
    assert any(e in links[0]["error"] for e in error.split("|")) and len(links) == 1 + (fault == "silent"), links
    assert [h["output"] for h in route] == ["peer", "client", "client"]
    assert "link_error" in route[1]


async def answer_with_old_peer(tiny, name: str, stream_as, dials: bool):
    """Six greedy tokens through a-b-c where peer `name` talks through `stream_as` (a Killable
    rewriting versions as an older peer would) and, unless `dials`, has no dialer; (tokens, the
    RemoteSpan, its route)."""
    async with trio.open_nursery() as nursery:
        swarm = ChainSwarm(nursery, tiny, SPANS)
        if not dials:
            swarm.servers[name].dial = None
        serve = swarm._serve

        async def old_serve(peer, server, stream):
            if peer == name:
                await server.handle(stream_as(stream, swarm, peer), "client")
            else:
                await serve(peer, server, stream)

        swarm._serve = old_serve
        remote = RemoteSpan(MODEL, 1, 4, swarm.dial, swarm.route, Bans(), max_len=64, dtype=torch.float32,
                            timeout=10, route_wait=0)
        await remote.open()
        pipe = Pipeline(load_head(tiny), [LocalStage(load_span(tiny, 0, 1), 64), remote])
        out = await greedy(pipe, PROMPT, 6)
        route = remote.route_taken
        await pipe.close()
        nursery.cancel_scope.cancel()
    return out, remote, route


def test_an_old_peer_is_never_asked_to_forward_nor_named_downstream(tiny):
    """c speaks 1.1 (its OPEN_OK says minor 1 and it ignores chain extensions): b is not told to
    forward to it, so b's outputs return through the client; a -> b stays chained."""

    class Old(Killable):
        async def write(self, data):
            if data[8] == 2:  # OPEN_OK: as a 1.1 peer writes it
                data = data[:7] + bytes([1]) + data[8:]
            await super().write(data)

    out, remote, route = trio.run(answer_with_old_peer, tiny, "c", Old, False)
    assert out == local_answer(tiny, PROMPT, 6)
    assert [h["output"] for h in route] == ["peer", "client", "client"]
    assert remote.hops[1].downstream is None
    assert remote.stats.links and remote.stats.links[0]["link"] == ["b", "c"]


def test_a_peer_speaking_1_2_is_not_asked_to_dial_bare_addresses_but_still_takes_a_link(tiny):
    """b speaks 1.2 (its OPEN_OK says minor 2; it reads the OPEN as 1.2 and ignores CHAIN_TO_RECORD):
    b returns through the client, the client names why, and a -> b stays chained (ATTACH is 1.2's)."""

    class Speaks12(Killable):
        def __init__(self, *args):
            super().__init__(*args)
            self.read = self.read_as_12

        async def read_as_12(self, n=-1):
            data = await self.inner.read(n)
            if len(data) > 8 and data[8] == 1:  # OPEN, read as a 1.2 server would use it
                data = data[:7] + bytes([2]) + data[8:]
            return data

        async def write(self, data):
            if data[8] == 2:
                data = data[:7] + bytes([2]) + data[8:]
            await super().write(data)

    out, remote, route = trio.run(answer_with_old_peer, tiny, "b", Speaks12, True)
    assert out == local_answer(tiny, PROMPT, 6)
    assert [h["output"] for h in route] == ["peer", "client", "client"]
    assert remote.hops[1].downstream is not None and not remote.hops[1].chained
    assert remote.stats.links == [{"link": ["b", "c"], "when": "open", "error": "the peer does not speak protocol 1.3"}]


def refusing_server(tiny) -> tuple[BlockServer, list]:
    """A server of blocks 1-3 whose every dial fails, with the (peer, addresses) it tried."""
    server, dialled = BlockServer(MODEL, load_span(tiny, 1, 4)), []

    async def dial(peer, addrs):
        dialled.append((peer, addrs))
        raise ConnectionError("no")

    server.dial = dial
    return server, dialled


def test_an_old_client_gets_a_plain_session(tiny):
    """An OPEN of minor 1 carrying chain extensions (unknown to 1.1) is served as before: no link is
    dialled, no CHAINED flag, STEP_OKs without FORWARDED."""
    from diffuse.data.codec import Close, Downstream, Open, OpenOk, Step, StepOk
    from test_sessions import raw_session

    server, dialled = refusing_server(tiny)
    sid = b"o" * 16
    frames = [encode(Open(sid, MODEL, 1, 4, 32, 1, torch.float32, minor=1, upstream="x",
                          downstream=Downstream("y", b"\x01" * 16, b"record", b"sig"))),
              encode(Step(sid, 0, 0, [0], torch.zeros(1, 1, 64))), encode(Close(sid))]
    replies = trio.run(raw_session, server, frames)
    assert isinstance(replies[0], OpenOk) and not replies[0].chained and replies[0].link_error is None
    assert isinstance(replies[1], StepOk) and not replies[1].forwarded and replies[1].input_commitment is None
    assert not dialled and not server.linkable


def test_chain_fields_travel_and_a_bad_chain_to_record_is_a_bad_frame():
    from diffuse.data.codec import (
        AttachOk, Downstream, Ext, Open, OpenOk, StepOk, WireError, decode,
    )

    sid, down = b"\x01" * 16, Downstream("12D3KooWNext", b"\x02" * 16, b"\xa1" * 3000, b"s" * 64)
    got = decode(encode(Open(sid, MODEL, 1, 3, 64, upstream="12D3KooWPrev", downstream=down)))
    assert (got.upstream, got.downstream, got.minor) == ("12D3KooWPrev", down, 3)
    ok = decode(encode(OpenOk(sid, 64, "bfloat16", chained=False, link_error="cannot reach the next peer")))
    assert not ok.chained and ok.link_error == "cannot reach the next peer"
    assert decode(encode(OpenOk(sid, 64, chained=True))).chained
    reply = decode(encode(StepOk(sid, 3, torch.zeros(1, 2, 8, dtype=torch.float16), forwarded=True,
                                 input_commitment=b"c" * 32)))
    assert reply.forwarded and reply.input_commitment == b"c" * 32 and reply.link_error is None
    assert isinstance(decode(encode(AttachOk(sid))), AttachOk)
    for bad in (b"\x02" * 16 + b"\x00\x00", b"\x02" * 16 + b"\x01x\x00\x09rec", bytes(16) + b"\x01x\x00\x01r\x01s",
                b"\x02" * 16 + b"\x01x\x00\x00\x01s", b"\x02" * 16 + b"\x01x\x00\x01r\x00",
                b"\x02" * 16 + b"\x01x\x00\x01r\x01s!"):
        frame = encode(Open(sid, MODEL, 1, 3, 64)) + struct.pack(">HI", Ext.CHAIN_TO_RECORD, len(bad)) + bad
        with pytest.raises(WireError, match="CHAIN_TO_RECORD"):
            decode(struct.pack(">I", len(frame) - 4) + frame[4:])
    with pytest.raises(WireError):
        encode(Attach(bytes(16)))
