"""Credits through a real swarm: a sentinel and one `diffuse join` peer as OS processes on
127.0.0.1, a member asking with `diffuse ask --credit` from a home of its own. The peer's books
(`diffuse credits --json` on its home) must hold the member's receipt, and the member's the spend;
a plain `ask` signs nothing.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from support.procs import Procs
from support.swarm import Swarm
from diffuse.home import models_dir

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
                    "--no-speculate", *extra, "Count to five.", timeout=300)
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
