"""Layout 2 on loopback with real processes: 40 libp2p nodes in 8 processes.

A sentinel and two `diffuse join` peers serving SmolLM2-135M (blocks 0-14 and 15-29) as OS
processes; four processes of nine announcing nodes each (scripts/support/announcers.py: real
hosts that announce spans with the manifest's hashes and serve nothing); and, in this process,
a client node. The client reads the model's window keys, sees every one of the 38 serving peers
with the true replica count of every block, and finds a route: through the two peers that answer
its pings, never through a record alone.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair

from support.procs import Procs, swarm_key
from diffuse.client.swarm import SwarmClient
from diffuse.control.host import parse_peer_addr
from diffuse.control.node import NodeConfig, open_node
from diffuse.control.records import WINDOW_BLOCKS
from diffuse.home import DEFAULT_MODEL, models_dir
from diffuse.model.weights import load_manifest
from diffuse.trust import reputation

pytestmark = [pytest.mark.slow, pytest.mark.alone, pytest.mark.timeout(1200)]

LOCAL = "/ip4/127.0.0.1/tcp/0"
ANNOUNCERS = [sys.executable, str(Path(__file__).resolve().parents[1] / "scripts" / "support" / "announcers.py")]
JOINS = {"A": (0, 15), "B": (15, 30)}


def _spans(rng: random.Random, blocks: int, count: int) -> list[tuple[int, int]]:
    out = []
    for _ in range(count):
        length = rng.randint(2, 10)
        start = rng.randint(0, blocks - length)
        out.append((start, start + length))
    return out


def test_forty_nodes_find_the_true_coverage_and_a_route_through_window_keys(tmp_path, home):
    model_dir = models_dir(home) / DEFAULT_MODEL
    manifest = load_manifest(model_dir)
    n = manifest.num_layers
    spans = _spans(random.Random(7), n, 36)
    with Procs(home) as procs:
        boot = procs.start("sentinel", "--identity", str(tmp_path / "s.key"), "--listen", LOCAL).readline(timeout=120)
        joins = {name: procs.start("join", "--identity", str(tmp_path / f"{name}.key"), "--bootstrap", boot,
                                   "--listen", LOCAL, "--blocks", f"{s}:{e}", "--heartbeat", "20", "--ttl", "60")
                 for name, (s, e) in JOINS.items()}
        # Records renewed every 20 s (three times a ttl): at 5 s this test took 88 s, at 20 s 62 s.
        groups = [procs.start("--bootstrap", boot, "--model-dir", str(model_dir), "--heartbeat", "20", "--spans",
                              ",".join(f"{s}:{e}" for s, e in spans[i::4]), program=ANNOUNCERS) for i in range(4)]
        for g in groups:
            assert g.read_until("ready", timeout=300)[-1] == "ready", g.stderr[-20:]
        serving = {parse_peer_addr(j.read_until("serving", timeout=300)[0]).peer_id.to_base58()
                   for j in joins.values()}
        truth = [sum(s <= b < e for s, e in [*spans, *JOINS.values()]) for b in range(n)]
        trio.run(_client, boot, model_dir, manifest, truth, serving)


async def _client(boot: str, model_dir: Path, manifest, truth: list[int], serving: set[str]) -> None:
    config = NodeConfig(listen=[LOCAL], bootstrap=[boot], server=False, swarm_key=swarm_key())
    async with open_node(create_new_key_pair(), config, codecs=reputation.swarm_codecs()) as node:
        # Until every peer is found, and under each window's own key: a read stops waiting for the
        # last DHT nodes once most answered, so on a loaded machine one read may miss some.
        seen: dict[int, set[str]] = {w: set() for w in range(4)}
        with trio.move_on_after(240):
            while True:
                cov = await node.coverage(manifest.model_id, manifest.num_layers, manifest.block_hashes)
                samples = node.samples[manifest.model_id]
                assert set(samples) == {0, 1, 2, 3} and not any(s.sampled for s in samples.values())
                for w, s in samples.items():
                    seen[w] |= s.seen
                touching = {w: {p for p, r in cov.peers.items() if r.start < (w + 1) * WINDOW_BLOCKS
                                and r.end > w * WINDOW_BLOCKS} for w in range(4)}
                if len(cov.peers) == 38 and all(seen[w] == touching[w] for w in range(4)):
                    break
                await trio.sleep(1.0)
        assert len(cov.peers) == 38 and cov.replicas == truth and not cov.excluded
        for w in range(4):  # each window's own key holds exactly the peers touching it
            assert seen[w] == touching[w], w
        client = SwarmClient(node, model_dir)
        with trio.fail_after(120):
            hops = await client.route(*client.remote_range, set())
        assert {h.peer_id for h in hops} <= serving  # announcers answer no ping: never routed through
        assert hops[0].start == client.remote_range[0] and hops[-1].end == client.remote_range[1]
