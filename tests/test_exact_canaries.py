"""Canaries in exact sessions: an exact client's canary sessions are exact, so peers compute them
on the batch-invariant kernels (attention in fp64), whose drift differs canary by canary from the
fast kernels'. An exact client's bank calibrates on those kernels: honest exact peers pass (this
machine's kernels, and the dimensions permuted as other hardware sums), a noisy one is caught.
And a swarm client with a trust plane is freed when its last reference goes, without the
garbage collector (its weights are a gigabyte)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import trio
from libp2p.crypto.ed25519 import create_new_key_pair

from diffuse.client.swarm import SwarmClient, SwarmOptions
from diffuse.control.node import NodeConfig, open_node
from diffuse.trust import canary as C
from diffuse.trust import reputation
from diffuse.trust.bank import CanaryBank
from diffuse.trust.guard import TrustOptions
from diffuse.trust.tamper import Tamper

pytestmark = pytest.mark.slow
START, END = 1, 15  # 14 of SmolLM2's blocks, the span of a 2-peer route's first hop


def verdict(material, outputs):
    benign = material.calibration.for_dtype("bfloat16")
    return C.decide(benign, [(i, C.score(outputs[i], c)) for i, c in enumerate(material.canaries)])


def test_an_exact_clients_canaries_judge_exact_peers_on_their_own_kernels(smollm2, tmp_path):
    exact = CanaryBank(smollm2, tmp_path, torch.float16, exact=True).material(START, END)
    hidden = torch.stack([c.hidden for c in exact.canaries]).float()
    native = C.honest_output(exact.referee, hidden, torch.bfloat16, None, torch.float16, exact=True)
    assert torch.equal(exact.benign["bfloat16"][0], native)  # calibrated on the exact kernels
    honest = {seed: C.honest_output(exact.referee, hidden, torch.bfloat16, seed, torch.float16, exact=True)
              for seed in (2, 3)}  # sums in other orders, as other machines' kernels do
    for seed, out in honest.items():
        v = verdict(exact, out)
        assert not v.tampered, (seed, v)
    noisy = Tamper("noise", 30).apply_output(honest[2].to(torch.float16)).float()
    assert verdict(exact, noisy).tampered


def test_a_trusting_swarm_client_is_freed_without_the_garbage_collector(smollm2):
    async def main() -> None:
        config = NodeConfig(listen=["/ip4/127.0.0.1/tcp/0"], bootstrap=[], server=False)
        async with open_node(create_new_key_pair(), config, codecs=reputation.swarm_codecs()) as node:
            gc.disable()
            try:
                client = SwarmClient(node, smollm2, SwarmOptions(trust=TrustOptions()))
                assert client.guard is not None
                gone = weakref.ref(client)
                del client
                assert gone() is None
            finally:
                gc.enable()

    trio.run(main)
