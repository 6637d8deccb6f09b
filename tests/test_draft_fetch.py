"""Files by hash between peers, and draft heads fetched from the swarm.

The codec round-trips and refuses malformed, wrongly versioned and oversized frames; a
FileServer answers unknown hashes, bad ranges and bad frames with a RESPONSE and keeps serving
other streams; `fetch` keeps a file only when its size and SHA-256 match what was announced.
Through a real swarm (a sentinel and a `diffuse join` peer whose home holds a draft head), a
client with no head fetches, verifies and caches the peer's, and refuses one whose bytes on the
peer's disk no longer match the announced hash, caching nothing.
"""

from __future__ import annotations

import hashlib
import json
import struct

import pytest
import torch
import trio
import trio.testing

from diffuse.data import files as F
from diffuse.errors import FetchError
from test_sessions import MemStream


def frames(data: bytes, max_frame: int = F.HEADER_SIZE + F.MAX_CHUNK) -> list:
    return F.Decoder(max_frame).feed(data)


# ---- codec ----

def test_messages_round_trip_through_split_reads():
    msgs = [F.Get(bytes(range(32)), 5, 7), F.Get(b"\xff" * 32),
            F.Response(F.Status.OK, 10, 2, 8), F.Response(F.Status.NOT_FOUND, message="no file ünicode"),
            F.Data(b"x" * F.MAX_CHUNK), F.Data(b"\0")]
    wire = b"".join(F.encode(m) for m in msgs)
    dec = F.Decoder(F.HEADER_SIZE + F.MAX_CHUNK)
    got = []
    for i in range(0, len(wire), 4093):  # reads split frames anywhere
        got += dec.feed(wire[i:i + 4093])
    assert got == msgs


def test_get_layout_is_as_specified():
    sha = bytes.fromhex("ab" * 32)
    wire = F.encode(F.Get(sha, 1, 2))
    assert wire == struct.pack(">I", 54) + b"DF\x01\x02\x01\x00" + sha + (1).to_bytes(8, "big") + (2).to_bytes(8, "big")


@pytest.mark.parametrize("body, why", [
    (b"XX\x01\x00\x01\x00" + bytes(48), "bad magic"),
    (b"DF\x01\x00\x09\x00", "unknown message type 9"),
    (b"DF\x01\x00\x01\x00" + bytes(47), "truncated GET"),
    (b"DF\x01\x00\x01\x00" + bytes(48) + b"\x00\x01\x00\x00\x00\x05ab", "bad extension entry"),
    (b"DF\x01\x00\x01\x00" + bytes(48) + b"\x00\x00\x00\x00\x00\x00", "bad extension entry"),
    (b"DF\x01\x00\x02\x00" + struct.pack(">HQQQH", 0, 0, 0, 0, 2) + b"\xff\xfe", "not UTF-8"),
    (b"DF\x01\x00\x02\x00" + struct.pack(">HQQQH", 0, 0, 0, 0, 2000) + bytes(2000), "does not fit"),
    (b"DF\x01\x00\x03\x00", "DATA frame carries 1.."),
    (b"DF\x01", "bad magic"),
])
def test_malformed_frames_are_refused_by_name(body, why):
    with pytest.raises(F.FrameError, match=why) as e:
        frames(struct.pack(">I", len(body)) + body, 1 << 22)
    assert e.value.status == F.Status.BAD_REQUEST


def test_unknown_extensions_are_ignored():
    body = b"DF\x01\x00\x01\x00" + bytes(48) + b"\x80\x01\x00\x00\x00\x02hi"
    assert frames(struct.pack(">I", len(body)) + body) == [F.Get(bytes(32))]


def test_another_major_version_is_named():
    body = b"DF\x02\x05\x01\x00" + bytes(60)
    with pytest.raises(F.FrameError, match="peer speaks files protocol 2.5, this peer speaks 1.2") as e:
        frames(struct.pack(">I", len(body)) + body)
    assert e.value.status == F.Status.UNSUPPORTED_VERSION


def test_oversized_frames_are_refused_from_the_length_prefix():
    dec = F.Decoder(F.MAX_REQUEST_FRAME)
    with pytest.raises(F.FrameError, match="frame of 4097 bytes exceeds the limit of 4096"):
        dec.feed(struct.pack(">I", F.MAX_REQUEST_FRAME + 1) + b"DF")  # refused before the body arrives
    with pytest.raises(F.FrameError, match="unusable after an earlier error"):
        dec.feed(F.encode(F.Get(bytes(32))))


def test_resolve_ranges():
    get = F.Get(bytes(32))
    assert F.resolve(get, None).status == F.Status.NOT_FOUND
    assert F.resolve(get, 100) == F.Response(F.Status.OK, 100, 0, 100)
    assert F.resolve(F.Get(bytes(32), 90), 100) == F.Response(F.Status.OK, 100, 90, 10)
    assert F.resolve(F.Get(bytes(32), 100), 100) == F.Response(F.Status.OK, 100, 100, 0)
    assert F.resolve(F.Get(bytes(32), 101), 100).status == F.Status.BAD_REQUEST
    assert F.resolve(F.Get(bytes(32), 50, 51), 100).status == F.Status.BAD_REQUEST
    too = F.resolve(F.Get(bytes(32), 0, 60), 100, max_range=50)
    assert (too.status, too.total, too.length) == (F.Status.TOO_LARGE, 100, 50)


# ---- serving and fetching over in-memory streams ----

@pytest.fixture
def served(tmp_path):
    blob = bytes(range(256)) * 5000 + b"tail"  # 1.28 MB: several DATA frames
    path = tmp_path / "blob.bin"
    path.write_bytes(blob)
    server = F.FileServer(max_range=300_000, chunk=100_000, request_timeout=1.0)  # an answered stream waits for more
    sha, size = server.add(path)
    assert (sha, size) == (hashlib.sha256(blob).hexdigest(), len(blob))
    return server, path, blob, sha


async def ask(server: F.FileServer, raw: bytes, remote: str = "peer") -> list:
    """Send `raw` on a stream to `server`; every frame it answered before closing."""
    a, b = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.serve, MemStream(b), remote)
        client = MemStream(a)
        await client.write(raw)
        got = b""
        with trio.fail_after(10):
            while data := await client.read(1 << 16):
                got += data
    return frames(got)


def opener(server: F.FileServer, nursery, remote: str = "peer"):
    async def open_stream():
        a, b = trio.testing.memory_stream_pair()
        nursery.start_soon(server.serve, MemStream(b), remote)
        return MemStream(a)
    return open_stream


def test_server_answers_ranges_and_refusals(served):
    server, _, blob, sha = served
    h = bytes.fromhex(sha)

    async def main():
        head, *data = await ask(server, F.encode(F.Get(h, 1000, 290_000)))
        assert head == F.Response(F.Status.OK, len(blob), 1000, 290_000)
        assert b"".join(d.data for d in data) == blob[1000:291_000]
        assert all(len(d.data) <= F.MAX_CHUNK for d in data) and len(data) > 1
        (missing,) = await ask(server, F.encode(F.Get(b"\x01" * 32)))
        assert missing.status == F.Status.NOT_FOUND and "01" * 32 in missing.message
        (big,) = await ask(server, F.encode(F.Get(h)))
        assert (big.status, big.length) == (F.Status.TOO_LARGE, 300_000)
        (past,) = await ask(server, F.encode(F.Get(h, len(blob) + 1)))
        assert past.status == F.Status.BAD_REQUEST and "past the end" in past.message
        (garbage,) = await ask(server, b"\x00\x00\x00\x08DF\x01\x00\x05\x00xy")
        assert garbage.status == F.Status.BAD_REQUEST and "unknown message type 5" in garbage.message
        (huge,) = await ask(server, struct.pack(">I", 1 << 30))
        assert huge.status == F.Status.BAD_REQUEST and "exceeds the limit" in huge.message
        (version,) = await ask(server, b"\x00\x00\x00\x36DF\x07\x00\x01\x00" + bytes(48))
        assert version.status == F.Status.UNSUPPORTED_VERSION and "7.0" in version.message
        (wrong,) = await ask(server, F.encode(F.Data(b"hello")))
        assert wrong.status == F.Status.BAD_REQUEST and "expected a GET" in wrong.message
        a, b = trio.testing.memory_stream_pair()
        await a.aclose()  # a stream that ends before asking: nothing to answer, nothing raised
        with trio.fail_after(10):
            await server.serve(MemStream(b), "gone")

    trio.run(main)


def test_a_silent_stream_times_out_and_busy_peers_are_told(served):
    server, _, _, sha = served
    server.request_timeout = 0.2

    async def main():
        a, b = trio.testing.memory_stream_pair()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.serve, MemStream(b), "slow")
            with trio.fail_after(10):
                (answer,) = frames(await MemStream(a).read(1 << 16))
        assert answer.status == F.Status.TIMEOUT
        # A receiver that asks and then reads nothing: the write stalls and the server gives up on it.
        server.stall_timeout = 0.2
        a, b = trio.testing.lockstep_stream_pair()
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(server.serve, MemStream(b), "stuck")
                await a.send_all(F.encode(F.Get(bytes.fromhex(sha))))
        assert not server.active  # its slot is free again
        server.active["other"] = server.max_transfers  # every slot taken
        (busy,) = await ask(server, F.encode(F.Get(bytes.fromhex(sha), 0, 10)))
        assert busy.status == F.Status.BUSY

    trio.run(main)


def test_a_bad_stream_does_not_disturb_a_transfer_beside_it(served, tmp_path):
    server, _, blob, sha = served

    answers: list = []

    async def bad(i: int) -> None:
        answers.extend(await ask(server, b"\x00\x00\x00\x03abc", f"bad{i}"))

    async def main():
        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(bad, i)
            dest = await F.fetch_with(opener(server, nursery), "good", sha, len(blob), tmp_path / "got", 1 << 24)
        return dest

    assert trio.run(main).read_bytes() == blob
    assert [a.status for a in answers] == [F.Status.BAD_REQUEST] * 3 and "bad magic" in answers[0].message

    trio.run(main)


def test_fetch_asks_in_ranges_the_server_accepts(served, tmp_path):
    server, _, blob, sha = served

    async def main():
        async with trio.open_nursery() as nursery:
            # the client asks for MAX_RANGE at once; the server sends 300 kB: the client follows it
            return await F.fetch_with(opener(server, nursery), "p", sha, len(blob), tmp_path / "d" / "f", 1 << 24)

    dest = trio.run(main)
    assert dest.read_bytes() == blob and [p.name for p in dest.parent.iterdir()] == ["f"]


@pytest.mark.parametrize("case, why", [
    ("corrupt", "hash to SHA-256 .*not the announced"),
    ("size", "serves a file of .* bytes under that hash; it announced"),
    ("limit", "at most|are accepted"),
    ("unknown", "NOT_FOUND"),
    ("hash", "not a SHA-256 in hex"),
])
def test_fetch_refuses_what_does_not_match_and_keeps_nothing(served, tmp_path, case, why):
    server, path, blob, sha = served
    size, limit = len(blob), 1 << 24
    if case == "corrupt":  # same size, other bytes: only the hash tells
        path.write_bytes(blob[:-1] + b"X")
    elif case == "size":
        size -= 1
    elif case == "limit":
        limit = size - 1
    elif case == "unknown":
        sha = "cd" * 32
    elif case == "hash":
        sha = "not hex"

    async def main():
        async with trio.open_nursery() as nursery:
            with pytest.raises(FetchError, match=why) as e:
                await F.fetch_with(opener(server, nursery), "PEERX", sha, size, tmp_path / "out" / "f", limit)
        return e.value

    assert "PEERX" in str(trio.run(main))
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").iterdir()) == []


def test_fetch_refuses_a_peer_that_sends_too_much(tmp_path):
    blob = b"abc" * 10
    sha = hashlib.sha256(blob).hexdigest()

    async def liar(stream):
        await stream.read(1 << 16)
        await stream.write(F.encode(F.Response(F.Status.OK, len(blob), 0, len(blob))) + F.encode(F.Data(blob + b"!")))
        await stream.close()

    async def main():
        async with trio.open_nursery() as nursery:
            async def open_stream():
                a, b = trio.testing.memory_stream_pair()
                nursery.start_soon(liar, MemStream(b))
                return MemStream(a)
            with pytest.raises(FetchError, match="LIAR sent more than the 30 bytes"):
                await F.fetch_with(open_stream, "LIAR", sha, len(blob), tmp_path / "f", 1000)

    trio.run(main)
    assert list(tmp_path.iterdir()) == []



# ---- through a real swarm ----

LOCAL = "/ip4/127.0.0.1/tcp/0"


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    """A sentinel and one `diffuse join` peer of a tiny model whose home holds a draft head."""
    from support.procs import Procs
    from diffuse.client import draft_head
    from diffuse.home import models_dir
    from tiny import make_tiny

    home = tmp_path_factory.mktemp("peerhome")
    model_dir = make_tiny(models_dir(home) / "tiny")
    torch.manual_seed(3)
    head = draft_head.DraftHead(64, 170, torch.arange(0, 300, 3))
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.1)
    file = draft_head.path(home, "tiny")
    draft_head.save(head, file, {"made": "for this test"})
    with Procs(home) as procs:
        boot = procs.start("sentinel", "--identity", str(home / "s.key"), "--listen", LOCAL).readline(timeout=60)
        peer = procs.start("join", "--model", "tiny", "--blocks", "1:4", "--dtype", "fp32", "--listen", LOCAL,
                           "--identity", str(home / "p.key"), "--bootstrap", boot, "--heartbeat", "2", "--ttl", "30")
        peer.read_until("serving", timeout=60)
        yield boot, model_dir, file, head


def client_home(tmp_path, model_dir):
    """A store holding the model, and no draft head."""
    import shutil

    from diffuse.home import models_dir

    home = tmp_path / "client"
    shutil.copytree(model_dir, models_dir(home) / model_dir.name)
    return home, models_dir(home) / model_dir.name


async def obtain_through(boot: str, home, model_dir, said: list[str], wait: float = 30.0):
    """What a client of the swarm gets: its SwarmClient's records, then obtain_draft_head."""
    from libp2p.crypto.ed25519 import create_new_key_pair

    from support.procs import swarm_key
    from diffuse.client.draft_fetch import announced, obtain_draft_head
    from diffuse.client.swarm import SwarmClient, SwarmOptions
    from diffuse.control.node import NodeConfig, open_node

    async with open_node(create_new_key_pair(), NodeConfig(listen=[LOCAL], bootstrap=[boot], server=False,
                                                           swarm_key=swarm_key())) as node:
        client = SwarmClient(node, model_dir, SwarmOptions(dtype=torch.float32, trust=None))
        with trio.fail_after(wait):
            records = await client.records()
            while not any(announced(r) for r in records):
                await trio.sleep(0.25)
                records = await client.records()
            return await obtain_draft_head(client.node, records, home, client.model_dir, say=said.append)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_client_fetches_verifies_and_caches_a_peers_draft_head(swarm, tmp_path):
    from diffuse.client import draft_fetch, draft_head

    boot, model_dir, peer_file, peer_head = swarm
    home, mine = client_home(tmp_path, model_dir)
    said: list[str] = []
    got = trio.run(obtain_through, boot, home, mine, said)
    assert got is not None, said
    assert said == []
    assert set(got.state_dict()) == set(peer_head.state_dict())
    assert all(torch.equal(t, peer_head.state_dict()[n]) for n, t in got.state_dict().items())
    cached = draft_head.path(home, "tiny")
    assert cached.read_bytes() == peer_file.read_bytes()
    sha = hashlib.sha256(peer_file.read_bytes()).hexdigest()
    assert json.loads((cached.parent / draft_fetch.FETCHED).read_text())["sha256"] == sha
    assert sorted(p.name for p in cached.parent.iterdir()) == sorted([draft_fetch.FETCHED, draft_head.FILE])
    # The local head is used as it is, with no swarm at all.
    assert trio.run(draft_fetch.obtain_draft_head, None, [], home, mine) is not None
    # Dropped for poor acceptance: deleted, and that hash is not fetched again.
    assert draft_fetch.drop_fetched(home, "tiny") and not cached.exists()
    assert trio.run(obtain_through, boot, home, mine, said) is None and said == []
    assert not draft_fetch.drop_fetched(home, "tiny")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_head_that_no_longer_matches_its_announced_hash_is_refused(swarm, tmp_path):
    """The peer hashed its file at start; its bytes on disk change afterwards (same size)."""
    from diffuse.client import draft_head

    boot, model_dir, peer_file, _ = swarm
    data = bytearray(peer_file.read_bytes())
    announced_sha = hashlib.sha256(data).hexdigest()
    data[-7] ^= 0xFF
    peer_file.write_bytes(bytes(data))
    home, mine = client_home(tmp_path, model_dir)
    said: list[str] = []
    assert trio.run(obtain_through, boot, home, mine, said) is None
    assert len(said) == 1 and f"not the announced {announced_sha}" in said[0], said
    assert hashlib.sha256(data).hexdigest() in said[0]
    folder = draft_head.path(home, "tiny").parent
    assert not folder.exists() or list(folder.iterdir()) == []


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_head_trained_after_the_peer_started_is_offered_without_a_restart(tmp_path):
    """join checks for a head that appeared since it started (a background training finished)
    and amends its announcement: no tombstone, no restart."""
    from support.procs import Procs
    from diffuse.client import draft_head
    from diffuse.home import models_dir
    from tiny import make_tiny

    home = tmp_path / "peer"
    model_dir = make_tiny(models_dir(home) / "tiny")
    with Procs(home) as procs:
        boot = procs.start("sentinel", "--identity", str(home / "s.key"), "--listen", LOCAL).readline(timeout=60)
        peer = procs.start("join", "--model", "tiny", "--blocks", "1:4", "--dtype", "fp32", "--listen", LOCAL,
                           "--identity", str(home / "p.key"), "--bootstrap", boot, "--heartbeat", "2", "--ttl", "30")
        peer.read_until("serving", timeout=60)
        head = draft_head.DraftHead(64, 170, torch.arange(0, 300, 3))
        draft_head.save(head, draft_head.path(home, "tiny"), {"made": "after the peer started"})
        client, mine = client_home(tmp_path, model_dir)
        said: list[str] = []
        got = trio.run(obtain_through, boot, client, mine, said, 90.0)
        assert got is not None and said == []
        assert all(torch.equal(t, head.state_dict()[n]) for n, t in got.state_dict().items())
        assert any("offering the draft head of" in line for line in peer.stderr)


# ---- what a fetched file may not do ----

def _head_file(tmp_path, **change):
    """A valid head file for width 64, then with `change` applied to its tensors or metadata."""
    from safetensors.torch import save_file

    from diffuse.client import draft_head

    head = draft_head.DraftHead(64, 170, torch.arange(0, 300, 3))
    state = {n: t.contiguous() for n, t in head.state_dict().items()}
    meta = {"hidden": "64", "inter": "170", "info": "{}"}
    for k, v in change.items():
        (meta if isinstance(v, str) else state)[k] = v
    file = tmp_path / "head.safetensors"
    save_file(state, str(file), metadata=meta)
    return file


@pytest.mark.parametrize("change, why", [
    ({"inter": "100000000"}, "do not make a head of width 64, MLP 100000000"),  # would allocate ~25 GB
    ({"calibration": torch.tensor([0.5, 0.5])}, "calibration"),
    ({"calibration": torch.tensor([0.1, 0.2, 0.3, 0.4, 7.0])}, "calibration rates outside [0, 1]"),
    ({"vocab": torch.tensor([1, 2, 999])}, "vocab holds ids outside the model's 300 tokens"),
    ({"up.weight": torch.full((170, 64), float("nan"))}, "non-finite numbers in ['up.weight']"),
    ({"extra": torch.zeros(3)}, "unexpected or missing tensors"),
])
def test_a_head_file_is_checked_before_anything_is_built_from_it(tmp_path, change, why):
    from diffuse.client import draft_head
    from diffuse.errors import ModelError

    assert draft_head.load(_head_file(tmp_path), 64, 300) is not None  # the unchanged file loads
    with pytest.raises(ModelError) as e:
        draft_head.load(_head_file(tmp_path, **change), 64, 300)
    assert why in str(e.value) and "not a usable draft-head file" in str(e.value)


def test_an_announced_head_larger_than_this_model_allows_is_not_fetched(tmp_path):
    from types import SimpleNamespace

    from diffuse.client import draft_fetch, draft_head
    from diffuse.control.records import PeerRecord
    from diffuse.model.config import ModelConfig
    from diffuse.model.weights import load_manifest
    from tiny import make_tiny

    model_dir = make_tiny(tmp_path / "models" / "tiny")
    cfg = ModelConfig.load(model_dir)
    huge = draft_head.max_bytes(cfg.hidden_size, cfg.vocab_size) + 1
    record = PeerRecord(peer_id="QmPeer", model=load_manifest(model_dir).model_id, num_blocks=cfg.num_layers,
                        start=1, end=2, block_hashes=("0" * 64,), dtype="fp32", throughput=1.0, cache_tokens=1,
                        addrs=(), timestamp=1.0, expires=2.0, started=1.0, protocols=(F.PROTOCOL_ID,),
                        extra={draft_fetch.HASH_KEY: "ab" * 32, draft_fetch.BYTES_KEY: huge})
    said: list[str] = []
    node = SimpleNamespace(peer_id="QmMe", support={})  # never dialled: the offer is refused first
    assert trio.run(lambda: draft_fetch.obtain_draft_head(node, [record], tmp_path, model_dir, say=said.append)) is None
    assert len(said) == 1 and f"{huge} bytes is more than a head of this model can be" in said[0]
