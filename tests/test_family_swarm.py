"""Every family through a real 2-hop loopback swarm: a sentinel and `diffuse join` processes
serving blocks 1:3 and 3:4 of each tiny model in fp32, the client holding block 0 and the head,
fp32 on the wire. Prefill, decode, a speculative tree, its commit and a rollback give
transformers' logits (sequences past the sliding window)."""

from __future__ import annotations

import pytest
import torch
import trio
from libp2p.crypto.ed25519 import create_new_key_pair

from support.procs import Procs, swarm_key
from support.swarm import LOCAL, Swarm
from diffuse.client.swarm import SwarmClient, SwarmOptions, remote_of
from diffuse.control.node import NodeConfig, open_node
from diffuse.home import models_dir
from tiny import BRANCHES, FAMILIES, LEGACY, PREFIX, load_reference, make_tiny, tree

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
# One model per family (llama-linear is llama3 with another RoPE variant; the legacy shapes have
# their swarm tests in test_swarm and test_sessions).
NAMES = [n for n in FAMILIES if n not in LEGACY and n != "llama-linear"]


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    """One sentinel, two peers per family, all started at once (their start-up overlaps)."""
    home = tmp_path_factory.mktemp("families")
    for name in NAMES:
        make_tiny(models_dir(home) / name, name)
    with Procs(home) as procs:
        peers = {f"{name}-{blocks}": (name, blocks) for name in NAMES for blocks in ("1:3", "3:4")}
        s = Swarm(procs, home, {p: blocks for p, (_, blocks) in peers.items()},
                  {p: ["--model", name] for p, (name, _) in peers.items()},
                  join=["--dtype", "fp32", "--heartbeat", "30", "--ttl", "120"],  # 18 peers: little chatter
                  timeout=300)
        yield home, s.boot


@pytest.mark.parametrize("name", NAMES)
def test_family_through_a_two_hop_swarm(swarm, name):
    home, boot = swarm
    path = models_dir(home) / name
    ref = load_reference(path)
    g = torch.Generator().manual_seed(7)
    prefix, cand, nxt = (torch.randint(0, 300, (1, n), generator=g) for n in (PREFIX + 9, 5, 2))
    mask, depth = tree()
    p = prefix.shape[1]

    def want(*parts: torch.Tensor, last: int) -> torch.Tensor:
        with torch.no_grad():
            return ref(torch.cat(parts, 1)).logits[:, -last:]

    async def run() -> dict:
        async with open_node(create_new_key_pair(), NodeConfig(listen=[LOCAL], bootstrap=[boot], server=False,
                                                               swarm_key=swarm_key())) as node:
            client = SwarmClient(node, path, SwarmOptions(dtype=torch.float32, wire_dtype=torch.float32, trust=None))
            pipe = await client.session(48)
            out = {"prefill": await pipe.forward(prefix)}
            out["route"] = [h["blocks"] for h in remote_of(pipe).route_taken]
            out["tree"] = await pipe.forward(cand, positions=p + depth, tree_mask=mask, commit=False)
            await pipe.commit([0, 3])
            out["after"] = await pipe.forward(nxt)
            await pipe.rollback(p)
            out["again"] = await pipe.forward(nxt)
            await pipe.close()
            return out

    out = trio.run(run)
    assert out["route"] == [[1, 3], [3, 4]]
    assert (out["prefill"] - want(prefix, last=p)).abs().max() < 1e-4
    for branch in BRANCHES:
        assert (out["tree"][:, branch] - want(prefix, cand[:, branch], last=len(branch))).abs().max() < 1e-4, branch
    assert (out["after"] - want(prefix, cand[:, [0, 3]], nxt, last=2)).abs().max() < 1e-4
    assert (out["again"] - want(prefix, nxt, last=2)).abs().max() < 1e-4
