"""Credits through a real swarm: a sentinel and one `diffuse join` peer as OS processes on
127.0.0.1, a member asking with `diffuse ask --credit` from a home of its own. The peer's books
(`diffuse credits --json` on its home) must hold the member's receipt, and the member's the spend;
a plain `ask` signs nothing. A second swarm, of homes that pay each other, shows a full peer admitting
a member holding receipts from two peers it has paid before a pure consumer who asked first, and
the consumer still admitted within the peer's bounded wait.
"""

from __future__ import annotations

import contextlib
import json
import signal
import time
from pathlib import Path

import pytest
import torch
import trio

from support.procs import Procs, swarm_key
from support.swarm import LOCAL, QUICK_RECORDS, Swarm
from diffuse.control.dial import open_stream
from diffuse.control.host import parse_peer_addr
from diffuse.control.identity import ephemeral, node_key
from diffuse.control.node import NodeConfig, open_node
from diffuse.control.routing import Hop
from diffuse.data.codec import PROTOCOL_ID
from diffuse.data.hop import HopSession
from diffuse.home import DEFAULT_MODEL, models_dir
from diffuse.model.weights import load_manifest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def member_home(home: Path, path: Path) -> Path:
    """A home of its own (identity, credits) sharing the session's model store."""
    path.mkdir(parents=True)
    models_dir(path).symlink_to(models_dir(home), target_is_directory=True)
    return path


@pytest.fixture(scope="module")
def swarm(home, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("credits")
    peer_home, member = member_home(home, tmp / "peer"), member_home(home, tmp / "member")
    with Procs(peer_home) as peer_procs, Procs(member) as member_procs:
        yield Swarm(peer_procs, tmp / "keys", {"P": "1:30"}), peer_procs, member_procs


def credits(procs: Procs) -> dict:
    out = procs.run("credits", "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def ask(procs: Procs, boot: str, *extra: str) -> dict:
    out = procs.run("--client-only", "ask", "--bootstrap", boot, "--json", "--max-tokens", "12", "--wait", "30",
                    "--no-speculate", *extra, "Count to five.", timeout=300)  # a later --max-tokens wins
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def peer_books(procs: Procs, ready) -> dict:
    """The peer's books once `ready(report)` (the peer writes them within a few seconds)."""
    deadline = time.monotonic() + 60
    while not ready(r := credits(procs)) and time.monotonic() < deadline:
        time.sleep(1)
    return r


def test_a_credit_ask_leaves_a_receipt_with_the_peer_and_a_spend_with_the_member(swarm):
    peers, peer_procs, member_procs = swarm
    got = ask(member_procs, peers.boot, "--credit")
    assert [h["peer"] for h in got["route"]] == [peers.ids["P"]]
    mine = credits(member_procs)
    me, p = mine["identity"], peers.ids["P"]
    assert mine["spent"]["peers"] == 1 and mine["tabs"][p]["they_served"] == mine["spent"]["work"] > 0
    books = peer_books(peer_procs, lambda r: r["earned"]["receipts"] >= 1)
    assert books["earned"]["from"] == {me: mine["spent"]["work"]}  # signed by the member, the work it paid
    assert books["tabs"][me]["served_them"] >= mine["spent"]["work"]  # the peer booked the session as the member's


def test_a_plain_ask_signs_nothing(swarm):
    peers, peer_procs, member_procs = swarm
    before_peer, before_member = credits(peer_procs), credits(member_procs)
    ask(member_procs, peers.boot)
    books = peer_books(peer_procs, lambda r: len(r["tabs"]) > len(before_peer["tabs"]))  # an ephemeral client
    assert len(books["tabs"]) == len(before_peer["tabs"]) + 1
    assert books["earned"] == before_peer["earned"]
    assert credits(member_procs)["spent"] == before_member["spent"]


# A full peer's queue, through real processes. Standing there counts receipts a member presents only
# from signers the judging peer's own member has paid, so every step below is one a deployment
# takes: W1's and W2's homes ask (--credit) through M, so M holds receipts they signed; the judge's
# home asks through W1 and W2, so it has seen them work; M's home asks through the judge, which
# presents those receipts. Each home's `join` is stopped while its `ask --credit` runs (one identity,
# one node). The judge then lends 2 sessions' worth of KV cache; two strangers hold it full; the
# consumer's OPEN is sent, then the member's, then room for one session frees, then for another.
SPANS = {"M": "1:30", "W1": "1:15", "W2": "15:30", "J": "1:30"}
HOLD = 1024  # KV entries each raw session asks; the judge lends 2 x HOLD (--contribution min: 1/8)
JUDGE = ["--contribution", "min", "--cache-tokens", str(16 * HOLD)]


@pytest.fixture(scope="module")
def queue_swarm(home, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("credit-queue")
    homes = {n: member_home(home, tmp / n) for n in ("sentinel", *SPANS)}
    with contextlib.ExitStack() as stack:
        procs = {n: stack.enter_context(Procs(h)) for n, h in homes.items()}
        yield Swarm(procs["sentinel"], tmp / "keys", {}), procs, homes


def join(procs: Procs, boot: str, name: str, *extra: str):
    """`diffuse join` as the home's own identity (the one its `ask --credit` signs with)."""
    proc = procs.start("join", "--bootstrap", boot, "--listen", LOCAL, "--blocks", SPANS[name], *QUICK_RECORDS, *extra)
    addr = proc.read_until("serving", timeout=180)[0]
    return proc, addr, parse_peer_addr(addr).peer_id.to_base58()


def leave(proc) -> None:
    """SIGTERM: the peer withdraws its record, drains and writes its books."""
    proc.signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0


@pytest.mark.alone  # its OPENs follow each other within the judge's 2 s wait: nothing beside it
def test_a_full_peer_admits_a_member_with_standing_before_a_pure_consumer(queue_swarm, home):
    sw, procs, homes = queue_swarm
    m, m_addr, m_id = join(procs["M"], sw.boot, "M")
    for w in ("W1", "W2"):  # their members pay M: M earns receipts signed by W1 and W2
        assert [h["peer"] for h in ask(procs[w], sw.boot, "--credit", "--max-tokens", "48")["route"]] == [m_id]
    ids = {w: credits(procs[w])["identity"] for w in ("W1", "W2")}
    held = peer_books(procs["M"], lambda r: r["earned"]["signers"] >= 2)["earned"]["from"]
    assert set(held) == set(ids.values())
    leave(m)

    w1, _, w1_id = join(procs["W1"], sw.boot, "W1")
    w2, _, w2_id = join(procs["W2"], sw.boot, "W2")
    assert [w1_id, w2_id] == [ids["W1"], ids["W2"]]
    route = ask(procs["J"], sw.boot, "--credit")["route"]  # the judge's member has seen W1 and W2 work
    assert [h["peer"] for h in route] == [w1_id, w2_id]
    paid = credits(procs["J"])["tabs"]
    assert paid[w1_id]["they_served"] > 0 and paid[w2_id]["they_served"] > 0
    leave(w1)
    leave(w2)

    judge, j_addr, j_id = join(procs["J"], sw.boot, "J", *JUDGE)
    got = ask(procs["M"], sw.boot, "--credit", "--max-tokens", "4")  # presents M's held receipts
    assert [h["peer"] for h in got["route"]] == [j_id]
    books = peer_books(procs["J"], lambda r: r["tabs"].get(m_id, {}).get("credit", 0) >= sum(held.values()))
    assert books["tabs"][m_id]["credit"] == sum(held.values())  # both signers counted, the judge paid both
    assert books["tabs"][m_id]["standing"] > books["allowance"]["work"]  # above a stranger's

    order = trio.run(_queue, homes["M"], j_id, j_addr, load_manifest(models_dir(home) / DEFAULT_MODEL).model_id)
    assert order == ["member", "consumer"]
    assert judge.p.poll() is None


async def _queue(member: Path, judge: str, addr: str, model: str) -> list[str]:
    """Two strangers fill the judge; the consumer's OPEN, then the member's; one stranger leaves,
    then the other. Returns who got OPEN_OK, in order. The judge waits up to 2 s for room
    (ServerLimits.queue_wait), so the steps follow each other at once."""
    hop = Hop(judge, (addr,), 1, 30)
    order: list[str] = []
    async with contextlib.AsyncExitStack() as stack:
        nodes = [await stack.enter_async_context(open_node(key, NodeConfig(
            listen=[LOCAL], bootstrap=[], server=False, swarm_key=swarm_key())))
            for key in (ephemeral(), ephemeral(), ephemeral(), node_key(None, member))]
        first, second, consumer, me = [  # the judge wants an OPEN within 10 s of a stream's start
            HopSession(hop, await open_stream(n.host, judge, PROTOCOL_ID, [addr], timeout=30), model, HOLD, 1,
                       torch.float16, 30.0) for n in nodes]
        await first.open()
        await second.open()  # the judge is full: its whole cache is held

        async def admitted(name: str, s: HopSession) -> None:
            await s.open()
            order.append(name)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(admitted, "consumer", consumer)
            await trio.sleep(0.3)  # the consumer's OPEN reaches the judge's queue first
            nursery.start_soon(admitted, "member", me)
            await trio.sleep(0.3)
            await first.close()  # room for one
            with trio.fail_after(10):
                while not order:
                    await trio.sleep(0.01)
            await second.close()  # room for the other
        for s in (consumer, me):
            await s.close()
    return order
