"""Private swarms end to end, every node a separate `diffuse` process on 127.0.0.1 (clients too,
unless a test needs one that outlives an edit of the allow-list).

- A private swarm (a sentinel, four peers, a client) answers as the in-process model does; its
  records and `status` say private.
- A public swarm (a public sentinel, a peer, a client in public mode) answers as well, its
  client's trust plane vetting the peer with two canaries.
- A node with no key, a wrong key, or in public mode cannot join it: its `status` and `ask` exit 2
  with an error that says why, within the test's own timeouts (never a hang, never a traceback);
  a private node meeting a public sentinel is told so too.
- The allow-list: a peer not on it gets no session although routes would prefer it, and a member
  taken off the list stops getting sessions, while everything keeps running.
- `diffuse demo` (the README's `make run`) runs a private swarm with a key it makes and removes.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair

from support.procs import DIFFUSE, Procs, swarm_key
from diffuse.client.swarm import SwarmClient, SwarmOptions, remote_of
from diffuse.control.allow import AllowList
from diffuse.control.host import parse_peer_addr
from diffuse.control.identity import load_or_create, peer_id
from diffuse.control.modes import KEY_ENV
from diffuse.control.node import NodeConfig, open_node
from diffuse.control.records import blocks_key, decode_set
from diffuse.control.swarm_key import SwarmKey, write_key
from diffuse.home import DEFAULT_MODEL, models_dir
from support.swarm import QUICK_RECORDS, Swarm
from test_swarm import QUESTION, ask, reference_answer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
LOCAL = "/ip4/127.0.0.1/tcp/0"
STRANGER_S = 120  # what a refused client may take at most, python start-up on a busy machine included


@pytest.fixture(scope="module")
def reference(home) -> list[int]:
    return reference_answer(home)


def stranger_env(env: dict[str, str], tmp: Path, home: Path) -> dict[str, str]:
    """`env` on a machine that has the model but no swarm key: no $DIFFUSE_SWARM_KEY, and a home
    of its own (sharing the store's models) without a swarm.key."""
    own = tmp / "stranger-home"
    own.mkdir(exist_ok=True)
    if not (own / "models").exists():
        (own / "models").symlink_to(models_dir(home))
    return {k: v for k, v in env.items() if k != KEY_ENV} | {"DIFFUSE_HOME": str(own)}


def refused(env: dict[str, str], boot: str, *extra: str) -> list[str]:
    """stderr of `status` and of `ask` run against `boot` by a node that must not get in."""
    errors = []
    for argv in (["status", "--bootstrap", boot, *extra],
                 ["--client-only", "ask", "--bootstrap", boot, "--max-tokens", "4", "--no-trust", *extra, QUESTION]):
        out = subprocess.run(DIFFUSE + argv, capture_output=True, text=True, env=env, timeout=STRANGER_S)
        assert out.returncode == 2, (argv, out.returncode, out.stdout, out.stderr)
        assert out.stderr.startswith("error: ") and "Traceback" not in out.stderr, out.stderr
        errors.append(out.stderr)
    return errors


def test_private_swarm_answers_and_strangers_fail_fast(home, tmp_path, reference):
    with Procs(home) as procs:
        swarm = Swarm(procs, tmp_path / "swarm", {"A": "1:15", "A2": "1:15", "B": "15:30", "B2": "15:30"})
        got = ask(procs, swarm.boot)
        assert got["token_ids"] == reference and got["swarm_mode"] == "private" and got["trust"] == "private"
        out = procs.run("status", "--bootstrap", swarm.boot, "--json", timeout=120)
        assert out.returncode == 0, out.stderr
        status = json.loads(out.stdout)
        (model,) = status["models"]
        assert status["mode"] == "private" and model["missing"] == [0]  # block 0 stays on clients
        assert {p["peer_id"]: p["mode"] for p in model["peers"]} == {pid: "private" for pid in swarm.ids.values()}

        stranger = stranger_env(procs.env, tmp_path, home)
        for err in refused(stranger, swarm.boot):
            assert "this swarm is private: give its key with --swarm-key" in err, err
        other = tmp_path / "other.key"
        write_key(other, SwarmKey.generate())
        for err in refused(stranger, swarm.boot, "--swarm-key", str(other)):
            assert f"{swarm.boot}: the key does not match this swarm" in err, err
        for err in refused(stranger, swarm.boot, "--mode", "public"):
            assert f"no libp2p handshake with {swarm.boot}: if this swarm is private, give its key with " \
                   "--swarm-key FILE" in err, err

        # The other way round: a member of the private swarm dialing a public sentinel.
        public = procs.start("sentinel", "--identity", str(tmp_path / "public.key"), "--listen", LOCAL,
                             "--mode", "public").readline(timeout=120)
        for err in refused(procs.env, public):
            assert "this node speaks plain libp2p: it is in public mode, not part of this private swarm" in err, err
        # and the swarm still answers its members.
        assert ask(procs, swarm.boot)["token_ids"] == reference

        # A public swarm answers end to end: a peer joins the public sentinel, and `ask --mode
        # public` gets the answer with the trust plane in its public form (each peer vetted by two
        # canaries before it serves).
        procs.start("join", "--mode", "public", "--identity", str(tmp_path / "public-peer.key"), "--bootstrap", public,
                    "--listen", LOCAL, "--blocks", "1:30", *QUICK_RECORDS).read_until("serving", timeout=240)
        got = ask(procs, public, "--mode", "public")
        assert got["token_ids"] == reference and got["swarm_mode"] == "public" and got["trust"] == "public", got
        assert got["checks"]["canaries"] >= 2 and got["checks"]["caught"] == 0, got["checks"]


def test_only_peers_on_the_allow_list_get_sessions(home, tmp_path):
    """A and B are on the list, X is not; declared speeds make routes prefer X, then B, then A.
    A client without the list routes through X (X would get traffic); a client with it through B;
    once B leaves the list, through A: the same running client, sentinel and peers."""
    keys = {name: tmp_path / f"{name}.key" for name in ("A", "B", "X")}
    ids = {name: peer_id(load_or_create(path)).to_base58() for name, path in keys.items()}
    allow = tmp_path / "allow-peers"
    allow.write_text(f"# who serves\n{ids['A']}\n{ids['B']}  # bob\n")
    model_dir = models_dir(home) / DEFAULT_MODEL
    with Procs(home) as procs:
        boot = procs.start("sentinel", "--identity", str(tmp_path / "s.key"), "--listen", LOCAL,
                           "--allow-peers", str(allow)).readline(timeout=120)
        speed = {"A": "2", "B": "4", "X": "400"}
        peers = {name: procs.start("join", "--identity", str(keys[name]), "--bootstrap", boot, "--listen", LOCAL,
                                   "--blocks", "1:30", "--heartbeat", "2", "--ttl", "30", "--throughput", speed[name],
                                   *(["--allow-peers", str(allow)] if name != "X" else []))
                 for name in keys}
        for proc in peers.values():
            proc.read_until("serving", timeout=240)
        sentinel = parse_peer_addr(boot).peer_id

        async def first_hop(client: SwarmClient) -> str:
            pipe = await client.session(64)
            try:
                return next(n for n, p in ids.items() if p == remote_of(pipe).route_taken[0]["peer"])
            finally:
                await pipe.close()

        async def run() -> list[str]:
            hops = []
            async with open_node(create_new_key_pair(), NodeConfig(listen=[LOCAL], bootstrap=[boot], server=False,
                                                                   swarm_key=swarm_key())) as everyone, \
                    open_node(create_new_key_pair(),
                              NodeConfig(listen=[LOCAL], bootstrap=[boot], server=False, swarm_key=swarm_key(),
                                         allow=AllowList(allow))) as members:
                plain = SwarmClient(everyone, model_dir, SwarmOptions(trust=None))
                listed = SwarmClient(members, model_dir, SwarmOptions(trust=None))

                async def held_by_sentinel() -> set[str]:
                    """The peers whose records the sentinel process serves under the model's key."""
                    key = blocks_key(DEFAULT_MODEL)
                    got = await everyone.dht.value_store._get_from_peer(sentinel, key.encode(), return_record=True)
                    return {r.peer_id for r in decode_set(got.value, key, strict=False)} if got else set()

                with trio.fail_after(60):  # X's own DHT node holds its record: readers without the list see it
                    while {r.peer_id for r in await plain.records()} != set(ids.values()):
                        await trio.sleep(0.5)
                hops.append(await first_hop(plain))
                assert ids["X"] not in {r.peer_id for r in await listed.records()}
                assert await held_by_sentinel() == {ids["A"], ids["B"]}  # it refused X's record
                hops += [await first_hop(listed) for _ in range(3)]
                before = allow.stat().st_mtime_ns
                allow.write_text(f"{ids['A']}\n")  # B leaves: no restart, no new key
                os.utime(allow, ns=(before + 10**9, before + 10**9))
                hops += [await first_hop(listed) for _ in range(3)]
                with trio.fail_after(30):  # the running sentinel re-reads the list and drops B's record
                    while await held_by_sentinel() != {ids["A"]}:
                        await trio.sleep(0.5)
            return hops

        assert trio.run(run) == ["X", "B", "B", "B", "A", "A", "A"]

        # The command line: `ask --allow-peers` and `status --allow-peers` see the list as it is now.
        out = procs.run("--client-only", "ask", "--bootstrap", boot, "--json", "--max-tokens", "4", "--no-trust",
                        "--allow-peers", str(allow), QUESTION, timeout=300)
        assert out.returncode == 0, out.stderr
        assert [h["peer"] for h in json.loads(out.stdout)["route"]] == [ids["A"]]
        out = procs.run("status", "--bootstrap", boot, "--json", "--allow-peers", str(allow), timeout=120)
        assert out.returncode == 0, out.stderr
        assert [p["peer_id"] for p in json.loads(out.stdout)["models"][0]["peers"]] == [ids["A"]]


def test_demo_runs_a_private_swarm_with_a_key_of_its_own(home, tmp_path):
    env = stranger_env(dict(os.environ), tmp_path, home)
    started = time.monotonic()
    out = subprocess.run(DIFFUSE + ["demo", "--max-tokens", "8", "--timeout", "300"], capture_output=True,
                         text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "a private swarm, trust plane private" in out.stdout, out.stdout
    assert "Paris" in out.stdout, out.stdout
    assert not (Path(env["DIFFUSE_HOME"]) / "swarm.key").exists()  # the demo's key went with its temp dir
    print(f"demo took {time.monotonic() - started:.0f} s")
