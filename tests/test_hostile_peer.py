"""A real peer (`diffuse join`, blocks 0:4 of SmolLM2) against a client that sends what it likes:
frames built by hand on its own libp2p stream, answered as protocols/inference.md says."""

from __future__ import annotations

import math
import os

import pytest
import torch
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.custom_types import TProtocol

from support.procs import Procs, swarm_key
from support.swarm import LOCAL, Swarm
from diffuse.control.host import parse_peer_addr
from diffuse.control.node import NodeConfig, open_node
from diffuse.data.codec import PROTOCOL_ID, ErrorCode, ErrorMsg, FrameDecoder, Open, OpenOk, Step, StepOk, encode
from diffuse.home import DEFAULT_MODEL

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
H = 576


@pytest.fixture(scope="module")
def peer(home, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hostile")
    with Procs(home) as procs:
        s = Swarm(procs, tmp, {"p": "0:4"}, join=["--dtype", "fp32"], timeout=240)
        yield s.boot, parse_peer_addr(s.addrs["p"])


async def talk(peer, frames: list[bytes], replies: int) -> list:
    """Send `frames` in ONE write on a fresh inference stream; read `replies` messages (or to EOF)."""
    boot, info = peer
    async with open_node(create_new_key_pair(), NodeConfig(listen=[LOCAL], bootstrap=[boot], server=False,
                                                           swarm_key=swarm_key())) as node:
        await node.host.connect(info)
        stream = await node.host.new_stream(info.peer_id, [TProtocol(PROTOCOL_ID)])
        await stream.write(b"".join(frames))
        got, dec = [], FrameDecoder()
        with trio.fail_after(60):
            while len(got) < replies:
                try:
                    data = await stream.read(1 << 16)
                except Exception:  # noqa: BLE001 - the peer closed the stream after its ERROR
                    break
                if not data:
                    break
                got += dec.feed(data)
        await stream.close()
    return got


def opening(sid: bytes, max_length: int = 64) -> bytes:
    return encode(Open(sid, DEFAULT_MODEL, 0, 4, max_length, 1, torch.float32))


def step(sid: bytes, n: int, cache_len: int, h: torch.Tensor) -> bytes:
    t = h.shape[1]
    return encode(Step(sid, n, cache_len, list(range(cache_len, cache_len + t)), h))


def test_a_step_of_zero_tokens_commits_or_rolls_back_and_is_answered(peer):
    sid, other = os.urandom(16), os.urandom(16)
    x = torch.randn(1, 5, H, generator=torch.Generator().manual_seed(0))
    nxt = torch.randn(1, 1, H, generator=torch.Generator().manual_seed(1))
    got = trio.run(talk, peer, [opening(sid), step(sid, 0, 0, x[:, :0]), step(sid, 1, 0, x),
                                step(sid, 2, 3, x[:, :0]), step(sid, 3, 3, nxt)], 5)
    assert isinstance(got[0], OpenOk) and all(isinstance(m, StepOk) for m in got[1:]), got
    assert tuple(got[1].hidden.shape) == (1, 0, H) and tuple(got[3].hidden.shape) == (1, 0, H)
    # The empty step at cache_len 3 rolled the session back: its next token saw only 3 tokens.
    want = trio.run(talk, peer, [opening(other), step(other, 0, 0, x[:, :3]), step(other, 1, 3, nxt)], 3)
    torch.testing.assert_close(got[4].hidden, want[2].hidden, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("width", [H - 1, 2 * H, 1])
def test_a_hidden_state_of_the_wrong_width_is_refused_with_bad_step(peer, width):
    sid = os.urandom(16)
    got = trio.run(talk, peer, [opening(sid), step(sid, 0, 0, torch.randn(1, 2, width))], 2)
    assert isinstance(got[0], OpenOk) and isinstance(got[1], ErrorMsg), got
    assert got[1].code == ErrorCode.BAD_STEP and f"hidden size {width}" in got[1].message and str(H) in got[1].message


def test_frames_of_one_read_are_answered_in_order_before_a_bad_one(peer):
    sid = os.urandom(16)
    bad = step(sid, 0, 0, torch.zeros(1, 2, H))
    nan = torch.tensor([math.nan], dtype=torch.float32).view(torch.uint8).numpy().tobytes()
    bad = bad[:-4] + nan  # the last value of the hidden state: NaN
    got = trio.run(talk, peer, [opening(sid), bad], 2)
    assert isinstance(got[0], OpenOk), got
    assert isinstance(got[1], ErrorMsg) and got[1].code == ErrorCode.NUMERIC and got[1].session_id == sid
