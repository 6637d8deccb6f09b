"""The multi-source fetcher (data/fetcher.py) against FileServers over in-memory streams, and
blocks as files (model/blockfiles.py).

Pieces come from every source; a source serving other bytes under the hash is found and banned
and its ranges come from the others; a source that breaks off mid-piece costs only the rest of
that piece; one that sends more than asked, or a short file, is refused; with no honest source
the fetch fails naming the file and leaves nothing. A block's canonical bytes served from a
store's safetensors hash to its manifest commitment and come back as a per-block file that
reads as the same tensors.
"""

from __future__ import annotations

import hashlib
import json
import os
import re

import pytest
import torch
import trio
import trio.testing

from diffuse.data import files as F
from diffuse.data.fetcher import Fetcher
from diffuse.errors import DiffuseError, FetchError
from test_sessions import MemStream

SIZE = 3 * 65536 + 123
PIECE = 65536


@pytest.fixture
def blob() -> bytes:
    return os.urandom(SIZE)


def servers(tmp_path, blob: bytes, names: list[str]) -> dict[str, F.FileServer]:
    out = {}
    for name in names:
        path = tmp_path / f"{name}.bin"
        path.write_bytes(blob)
        out[name] = F.FileServer(max_per_peer=4)
        out[name].add(path)
    return out


def run_fetch(tmp_path, serving: dict, sha: str, sources: list[str], size: int = SIZE, **kw):
    """Fetch with `serving` (peer -> FileServer, or an async handler of a raw stream); returns
    (path or the FetchError, fetcher)."""
    async def main():
        with trio.fail_after(60):
            return await fetching()

    async def fetching():
        async with trio.open_nursery() as nursery:
            async def open_stream(peer: str):
                a, b = trio.testing.memory_stream_pair()
                handler = serving[peer]
                nursery.start_soon(*((handler.serve, MemStream(b), "me") if isinstance(handler, F.FileServer)
                                     else (handler, MemStream(b))))
                return MemStream(a)
            fetcher = Fetcher(open_stream, piece=PIECE, stall_timeout=5, **kw)
            try:
                return await fetcher.fetch(sha, size, tmp_path / "got" / "file", sources, "block 7"), fetcher
            except FetchError as e:
                return e, fetcher
            finally:
                await fetcher.close()  # the streams it kept for later files: their servers end

    return trio.run(main)


def test_pieces_come_from_every_source(tmp_path, blob):
    sha = hashlib.sha256(blob).hexdigest()
    path, fetcher = run_fetch(tmp_path, servers(tmp_path, blob, ["a", "b", "c"]), sha, ["a", "b", "c"])
    assert path.read_bytes() == blob
    assert fetcher.stats.received == SIZE and len(fetcher.stats.by_peer) >= 2
    assert [p.name for p in path.parent.iterdir()] == ["file"]  # no temporary file left


def test_a_liar_among_sources_is_banned_and_its_ranges_fetched_elsewhere(tmp_path, blob):
    sha = hashlib.sha256(blob).hexdigest()
    serving = servers(tmp_path, blob, ["honest", "liar"])
    bad = bytearray(blob)
    for i in range(0, SIZE, PIECE):  # every piece it might serve is wrong in one byte
        bad[i] ^= 1
    (tmp_path / "liar.bin").write_bytes(bytes(bad))  # altered on disk after it was hashed: same size
    path, fetcher = run_fetch(tmp_path, serving, sha, ["liar", "honest"])
    assert path.read_bytes() == blob and list(fetcher.banned) == ["liar"]


def test_with_no_honest_source_the_fetch_fails_naming_the_file_and_keeps_nothing(tmp_path, blob):
    sha = hashlib.sha256(blob).hexdigest()
    serving = servers(tmp_path, blob, ["liar"])
    (tmp_path / "liar.bin").write_bytes(blob[:-1] + bytes([blob[-1] ^ 1]))
    err, fetcher = run_fetch(tmp_path, serving, sha, ["liar"])
    assert isinstance(err, FetchError) and "block 7" in str(err) and "liar" in str(err)
    assert list(fetcher.banned) == ["liar"] and list((tmp_path / "got").iterdir()) == []


def test_a_source_breaking_off_costs_only_the_rest_of_its_piece(tmp_path, blob):
    sha = hashlib.sha256(blob).hexdigest()
    serving: dict = servers(tmp_path, blob, ["good"])
    half = PIECE // 2

    async def dies(stream):  # answers the first GET with half its bytes, then its stream ends
        get = F.Decoder(4096).feed(await stream.read(4096))[0]
        await stream.write(F.encode(F.Response(F.Status.OK, SIZE, get.offset, get.length))
                           + F.encode(F.Data(blob[get.offset:get.offset + half])))
        await stream.close()

    serving["dies"] = dies
    path, fetcher = run_fetch(tmp_path, serving, sha, ["dies", "good"], per_source=1)
    assert path.read_bytes() == blob and not fetcher.banned
    assert fetcher.stats.by_peer["dies"] >= half
    assert fetcher.stats.received == SIZE  # the half it sent was kept: nothing fetched twice


def test_a_trickling_source_is_dropped_for_the_file_and_its_piece_comes_from_another(tmp_path, blob):
    sha = hashlib.sha256(blob).hexdigest()
    serving: dict = servers(tmp_path, blob, ["good"])

    async def trickles(stream):  # a byte every 20 ms: never stalls, never finishes a piece in time
        get = F.Decoder(4096).feed(await stream.read(4096))[0]
        try:
            await stream.write(F.encode(F.Response(F.Status.OK, SIZE, get.offset, get.length)))
            for at in range(get.offset, get.offset + get.length):
                await stream.write(F.encode(F.Data(blob[at:at + 1])))
                await trio.sleep(0.02)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    serving["slow"] = trickles
    path, fetcher = run_fetch(tmp_path, serving, sha, ["slow", "good"], per_source=1, min_piece_s=0.5)
    assert path.read_bytes() == blob and not fetcher.banned  # too slow is no lie
    assert 0 < fetcher.stats.by_peer["slow"] < PIECE and fetcher.stats.received == SIZE  # what it sent was kept


def test_a_server_closes_a_transfer_slower_than_its_least_rate(blob):
    sha = hashlib.sha256(blob).hexdigest()
    server = F.FileServer(max_per_peer=1, min_transfer_s=0.3, stall_timeout=5)
    server.add_composite(sha, [blob])

    async def main():  # a reader taking 100 bytes every 20 ms: never a stall, far below the least rate
        ours, theirs = trio.testing.lockstep_stream_pair()
        got, served = 0, trio.Event()

        async def serve():
            await server.serve(MemStream(theirs), "slowpoke")
            served.set()

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(serve)
                await MemStream(ours).write(F.encode(F.Get(bytes.fromhex(sha), 0, SIZE)))
                while not served.is_set():
                    with trio.move_on_after(0.5):  # the server may close while this waits
                        got += len(await MemStream(ours).read(100))
                    await trio.sleep(0.02)
        return got

    got = trio.run(main)
    assert 0 < got < SIZE and not server.active  # closed part-way, its slot free for others


def test_manifests_fetched_to_compare_are_capped_in_number_and_time(tmp_path, monkeypatch):
    from diffuse.client import manifests as from_swarm

    groups = {(f"{i:064x}", 100): [f"P{i}"] * (1 + i) for i in range(20)}
    asked: list[str] = []

    async def refuses(peer: str):
        asked.append(peer)
        raise FetchError(f"peer {peer} is gone")

    async def hangs(peer: str):
        await trio.sleep_forever()

    async def main(open_stream):
        with trio.fail_after(20):
            return await from_swarm.fetch_manifests(Fetcher(open_stream), groups, tmp_path, "m")

    assert trio.run(main, refuses) == {}
    assert len(set(asked)) == from_swarm.MAX_MANIFESTS and "P19" in asked  # the most announced first
    monkeypatch.setattr(from_swarm, "MANIFESTS_TIMEOUT_S", 0.5)
    assert trio.run(main, hangs) == {}  # one that never answers holds it up no longer than the timeout


def test_a_busy_source_is_asked_again_not_dropped(tmp_path, blob, monkeypatch):
    from diffuse.data import fetcher

    monkeypatch.setattr(fetcher, "BUSY_WAIT_S", 0.01)
    sha = hashlib.sha256(blob).hexdigest()
    server = servers(tmp_path, blob, ["busy"])["busy"]
    answers = []

    async def sometimes_busy(stream):  # BUSY to its first five requests, more than a source's strikes
        if len(answers) < 5:
            answers.append("busy")
            await stream.read(4096)
            await stream.write(F.encode(F.Response(F.Status.BUSY, message="4 transfers in progress")))
            await stream.close()
        else:
            await server.serve(stream, "me")

    path, fetcher_ = run_fetch(tmp_path, {"busy": sometimes_busy}, sha, ["busy"])
    assert path.read_bytes() == blob and len(answers) == 5 and not fetcher_.banned


def test_a_later_fetch_resumes_from_what_an_earlier_one_left(tmp_path, blob):
    sha = hashlib.sha256(blob).hexdigest()
    serving: dict = servers(tmp_path, blob, ["good"])
    sent = []

    async def dies_midway(stream):  # sends half of what it is first asked, then ends; then refuses all
        get = F.Decoder(4096).feed(await stream.read(4096))[0]
        if not sent:
            sent.append(get.length // 2)
            await stream.write(F.encode(F.Response(F.Status.OK, SIZE, get.offset, get.length))
                               + F.encode(F.Data(blob[get.offset:get.offset + sent[0]])))
        else:
            await stream.write(F.encode(F.Response(F.Status.NOT_FOUND, message="gone")))
        await stream.close()

    serving["flaky"] = dies_midway
    err, first = run_fetch(tmp_path, serving, sha, ["flaky"], per_source=1)
    assert isinstance(err, FetchError) and first.stats.received == sent[0] > 0
    left = {p.name for p in (tmp_path / "got").iterdir()}
    assert left == {f".file.{sha[:16]}.part", f".file.{sha[:16]}.part.json"}  # kept, for the next run
    path, second = run_fetch(tmp_path, serving, sha, ["good"])
    assert path.read_bytes() == blob and second.stats.received == SIZE - sent[0]
    assert [p.name for p in path.parent.iterdir()] == ["file"]


def test_wrong_bytes_left_by_an_earlier_run_are_fetched_again_and_nobody_is_banned(tmp_path, blob):
    sha = hashlib.sha256(blob).hexdigest()
    got = tmp_path / "got"
    got.mkdir()
    part = got / f".file.{sha[:16]}.part"
    part.write_bytes(b"\0" * SIZE)  # noted as received, but not the file's bytes (a crash before they hit the disk)
    (got / f"{part.name}.json").write_text(json.dumps({"sha256": sha, "size": SIZE, "received": [[0, PIECE]]}))
    path, fetcher = run_fetch(tmp_path, servers(tmp_path, blob, ["good"]), sha, ["good"])
    assert path.read_bytes() == blob and not fetcher.banned
    assert fetcher.stats.received == SIZE  # the rest, then the earlier piece again


@pytest.mark.parametrize("case", ["oversized", "short"])
def test_oversized_answers_and_short_files_are_refused(tmp_path, blob, case):
    sha = hashlib.sha256(blob).hexdigest()
    serving: dict = servers(tmp_path, blob, ["good"])

    async def oversized(stream):
        get = F.Decoder(4096).feed(await stream.read(4096))[0]
        await stream.write(F.encode(F.Response(F.Status.OK, SIZE, get.offset, get.length))
                           + F.encode(F.Data(blob[get.offset:get.offset + get.length] + b"!")))
        await stream.close()

    if case == "oversized":
        serving["bad"] = oversized
    else:  # its file is shorter than the hash's: it says so (NOT_FOUND), and must not be believed anyway
        serving |= servers(tmp_path, blob, ["bad"])
        (tmp_path / "bad.bin").write_bytes(blob[:-10])
    path, fetcher = run_fetch(tmp_path, serving, sha, ["bad", "good"])
    assert path.read_bytes() == blob and "good" in fetcher.stats.by_peer
    alone, _ = run_fetch(tmp_path, serving, sha, ["bad"])
    assert isinstance(alone, FetchError) and "block 7" in str(alone)
    assert ("more than" if case == "oversized" else "NOT_FOUND") in str(alone)


def test_a_block_travels_under_its_commitment(tmp_path, smollm2):
    from diffuse.model import blockfiles
    from diffuse.model.weights import ModelFiles, load_manifest

    files, manifest = ModelFiles(smollm2), load_manifest(smollm2)
    server = F.FileServer()
    (tmp_path / "config.json").write_bytes((smollm2 / "config.json").read_bytes())
    for block in (4, None):
        sha = manifest.block_hashes[4] if block == 4 else manifest.head_hash
        size = server.add_composite(sha, blockfiles.segments(files, block))
        canonical, _ = run_fetch(tmp_path, {"src": server}, sha, ["src"], size=size)
        dest = tmp_path / ("head.safetensors" if block is None else "block-00004.safetensors")
        blockfiles.to_safetensors(canonical, dest, block)
        back = ModelFiles(tmp_path).read_block(4) if block == 4 else ModelFiles(tmp_path).read_head()
        want = files.read_block(4) if block == 4 else files.read_head()
        assert back.keys() == want.keys() and all(torch.equal(back[k], want[k]) for k in want)
        canonical.unlink()


def write_canonical(files, block: int | None, path) -> None:
    """The canonical bytes of block `block` (None: the head) of `files`, as a peer serves them."""
    from diffuse.model import blockfiles

    with open(path, "wb") as out:
        for piece in blockfiles.segments(files, block):
            if isinstance(piece, bytes):
                out.write(piece)
            else:
                with open(piece[0], "rb") as f:
                    f.seek(piece[1])
                    out.write(f.read(piece[2]))


def fetched_block(files, block: int | None, part, canonical) -> None:
    """Write block `block` (None: the head) of `files` into store `part` as a fetch leaves it."""
    from diffuse.model import blockfiles

    write_canonical(files, block, canonical)
    dest = part / "head.safetensors" if block is None else blockfiles.block_file(part, block)
    blockfiles.to_safetensors(canonical, dest, block)


def test_a_fetched_manifest_is_never_rewritten_and_only_a_whole_store_upgrades_its_own(tmp_path):
    from tiny import make_tiny

    from diffuse.model import blockfiles
    from diffuse.model.weights import MANIFEST, ModelFiles, load_manifest

    src = make_tiny(tmp_path / "src")
    part = tmp_path / "part"
    part.mkdir()
    for f in src.iterdir():  # the format-1 manifest and config, no weights
        if f.is_file() and f.suffix != ".safetensors":
            (part / f.name).write_bytes(f.read_bytes())
    files = ModelFiles(src)
    for block in range(4):  # every block, no head
        fetched_block(files, block, part, tmp_path / "canonical")
    own = (part / MANIFEST).read_bytes()
    assert blockfiles.complete(part).format == 1 and (part / MANIFEST).read_bytes() == own  # no head: kept
    whole = blockfiles.complete(src)  # its own manifest, head and every block: upgraded once
    assert whole.format == 2 and whole.head_size > 0 and load_manifest(src) == whole
    fetched = (src / MANIFEST).read_bytes()
    (part / MANIFEST).write_bytes(fetched)  # as `join --from-swarm --blocks 0:4` leaves it
    (part / "notes.txt").write_text("a file the manifest does not list")
    assert blockfiles.complete(part) == whole and (part / MANIFEST).read_bytes() == fetched
    assert blockfiles.complete(src) == whole and (src / MANIFEST).read_bytes() == fetched


def test_a_partial_store_is_listed_as_such_and_verify_names_a_bad_block(tmp_path, smollm2):
    from diffuse.client import fallback
    from diffuse.model import blockfiles, store
    from diffuse.model.weights import ModelFiles

    part = tmp_path / "models" / smollm2.name
    part.mkdir(parents=True)
    for f in smollm2.iterdir():  # all but the weights (the manifest may list them: format 2)
        if f.is_file() and f.suffix != ".safetensors":
            (part / f.name).write_bytes(f.read_bytes())
    files = ModelFiles(smollm2)
    for block in (4, 5, None):  # as a fetch leaves them: canonical bytes rewritten per block
        fetched_block(files, block, part, tmp_path / "canonical")
    (m,) = store.list_models(tmp_path)
    assert m.held == "4-5, head" and "partial: holds blocks 4-5, head of 30" in store.table([m])
    assert fallback.held_models(tmp_path) == {}  # it cannot answer alone: never a fallback
    said: list[str] = []
    assert blockfiles.verify(part, said.append) == 0
    assert re.search(r"2 block\(s\), the head and \d+ file\(s\) checked, 0 bad$", said[-1]), said
    path = blockfiles.block_file(part, 5)
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    said.clear()
    assert blockfiles.verify(part, said.append) == 1
    assert said[0].startswith("bad: block 5 (block-00005.safetensors): hashes to") and said[-1].endswith("1 bad")


def test_disagreeing_manifests_are_listed_with_their_announcers_and_never_chosen_silently():
    from dataclasses import replace

    from diffuse.client.manifests import choose as _choose
    from diffuse.errors import DiffuseError
    from diffuse.model.weights import Manifest

    one = Manifest("m", "llama", 1, "float32", ["a" * 64], "b" * 64)
    other = replace(one, head_hash="c" * 64)
    found = {"1" * 64: (one, None), "2" * 64: (other, None)}
    groups = {("1" * 64, 10): ["PEER_A", "PEER_B"], ("2" * 64, 10): ["PEER_C"]}
    with pytest.raises(DiffuseError, match="different manifests") as e:
        _choose(found, groups, None)
    assert all(x in str(e.value) for x in ["1" * 64, "2" * 64, "PEER_A, PEER_B", "PEER_C", "--model-hash",
                                           other.model_hash])
    assert _choose(found, groups, other.model_hash) == "2" * 64  # the operator's, by model hash
    assert _choose(found, groups, "1" * 64) == "1" * 64  # or by manifest hash
    with pytest.raises(DiffuseError, match="no peer serves a manifest with hash"):
        _choose(found, groups, "f" * 64)
    assert _choose({"1" * 64: (one, None)}, {("1" * 64, 10): ["PEER_A"]}, None) == "1" * 64


def test_a_model_hash_shared_by_several_manifests_chooses_none_of_them():
    from dataclasses import replace

    from diffuse.client.manifests import choose as _choose
    from diffuse.errors import DiffuseError
    from diffuse.model.weights import Manifest

    one = Manifest("m", "llama", 1, "float32", ["a" * 64], "b" * 64, files={"config.json": [2, "c" * 64]})
    other = replace(one, files={"config.json": [3, "d" * 64]})  # same blocks and head, another config
    found = {"1" * 64: (one, None), "2" * 64: (other, None)}
    groups = {("1" * 64, 10): ["PEER_A"], ("2" * 64, 11): ["PEER_B"]}
    with pytest.raises(DiffuseError, match="2 different manifests have model hash") as e:
        _choose(found, groups, one.model_hash)
    assert all(x in str(e.value) for x in ["1" * 64, "2" * 64, "PEER_A", "PEER_B", "manifest's SHA-256"])
    assert _choose(found, groups, "2" * 64) == "2" * 64


def a_variant_peer(tmp_path):
    """The tiny model's int8 variant served by a peer "SRC" over blocks 1-2, and a store holding
    only the source's manifest and files; `fetch(records, trusted, liars)` runs the variant's
    fetch (liars: peer -> a directory whose manifest.json that peer serves instead)."""
    import shutil

    from tiny import make_tiny

    from diffuse.client import from_swarm
    from diffuse.client.manifests import BLOCK_FILES, VARIANT_SHA
    from diffuse.control.records import PeerRecord
    from diffuse.model import blockfiles, variants
    from diffuse.model.weights import load_manifest
    from diffuse.peer.offer import offer

    src = make_tiny(tmp_path / "src" / "tiny")
    source = blockfiles.complete(src)
    made = variants.make_variant(src, "int8")
    server = F.FileServer()
    extra = offer(server, src, (1, 3), made) | {"quant": "int8"}
    variant = load_manifest(made)
    assert extra[BLOCK_FILES] is True and VARIANT_SHA in extra and variant.format == 2
    record = PeerRecord("SRC", "tiny", 4, 1, 3, tuple(variant.block_hashes[1:3]), "float32", 1.0, 100, (), 0.0,
                        1e12, 0.0, extra=extra)
    part = tmp_path / "home" / "models" / "tiny"  # as the source's manifest and files leave it
    part.mkdir(parents=True)
    for name in ["manifest.json", *source.files]:
        shutil.copyfile(src / name, part / name)

    async def fetch(records, trusted=None, liars=None):
        servers = {"SRC": server}
        for peer, where in (liars or {}).items():
            servers[peer] = F.FileServer()
            servers[peer].add(where / "manifest.json")
        async with trio.open_nursery() as nursery:
            async def open_stream(peer: str):
                a, b = trio.testing.memory_stream_pair()
                nursery.start_soon(servers[peer].serve, MemStream(b), "me")
                return MemStream(a)
            fetcher = Fetcher(open_stream, piece=PIECE, stall_timeout=5)
            progress = from_swarm.Progress(lambda text: None)
            try:
                where, manifest, serving = await from_swarm._variant(fetcher, part, source, records, "int8",
                                                                     progress, trusted)
                await from_swarm._blocks(fetcher, where, manifest, serving, [1, 2], False, progress)
                return where, fetcher.stats.received
            finally:
                await fetcher.close()
                nursery.cancel_scope.cancel()

    return src, made, record, part, fetch


def test_a_variant_travels_as_its_peers_store_it_and_lands_beside_its_source(tmp_path):
    """A peer serving the int8 variant of blocks 1-2 offers the variant's manifest and its stored
    blocks; `join --from-swarm --quant int8` on a store holding only the source's manifest and
    files takes that manifest (naming the trusted source), fetches the blocks into the variant's
    directory, and they load, checked, as the variant's blocks."""
    from diffuse.control.records import PeerRecord
    from diffuse.errors import DiffuseError
    from diffuse.model import variants
    from diffuse.model.load import load_span
    from diffuse.model.weights import ModelFiles, load_manifest

    src, made, record, part, fetch = a_variant_peer(tmp_path)
    variant = load_manifest(made)
    extra = record.extra
    unquantized = PeerRecord(**{**record.__dict__, "extra": {k: v for k, v in extra.items() if k != "quant"}})
    with pytest.raises(BaseExceptionGroup) as e:  # an unquantized peer's record: no variant to take
        trio.run(fetch, [unquantized])
    assert e.group_contains(DiffuseError, match="no peer serves the int8 variant")
    where, received = trio.run(fetch, [record])
    assert where == variants.variant_dir(part, "int8") and load_manifest(where) == variant
    assert {p.name for p in where.glob("*.safetensors")} == {"block-00001.safetensors", "block-00002.safetensors"}
    assert received < sum(variant.block_sizes[1:3]) + 2 * 4096 + 65536  # the blocks, the manifest: not the source's
    load_span(part, 1, 3, quant="int8")  # the variant's blocks, checked against its manifest
    got, want = ModelFiles(where).read_block(1), ModelFiles(made).read_block(1)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_model_hash_names_the_variant_to_trust_where_its_announcers_disagree(tmp_path):
    """Two variant manifests announced (one peer's lies about a block hash): the fetch lists both
    and asks for --model-hash; given the honest one's SHA-256, it takes that, and the source to
    trust becomes the model hash the variant names."""
    import hashlib
    import json
    import shutil

    from diffuse.client import from_swarm
    from diffuse.client.manifests import VARIANT_BYTES, VARIANT_SHA
    from diffuse.control.records import PeerRecord
    from diffuse.errors import DiffuseError
    from diffuse.model import blockfiles
    from diffuse.model.weights import load_manifest

    src, made, record, part, fetch = a_variant_peer(tmp_path)
    lie = json.loads((made / "manifest.json").read_text())
    lie["block_hashes"][2] = "0" * 64
    lied = json.dumps(lie).encode()
    honest = hashlib.sha256((made / "manifest.json").read_bytes()).hexdigest()
    liar = PeerRecord(**{**record.__dict__, "peer_id": "LIAR", "extra": {
        **record.extra, VARIANT_SHA: hashlib.sha256(lied).hexdigest(), VARIANT_BYTES: len(lied)}})
    (tmp_path / "lie").mkdir()
    (tmp_path / "lie" / "manifest.json").write_bytes(lied)
    with pytest.raises(BaseExceptionGroup) as e:
        trio.run(fetch, [record, liar], None, {"LIAR": tmp_path / "lie"})
    assert e.group_contains(DiffuseError, match="different manifests.*--model-hash")
    where, _ = trio.run(fetch, [record, liar], honest, {"LIAR": tmp_path / "lie"})
    assert load_manifest(where).block_hashes == load_manifest(made).block_hashes
    shutil.rmtree(where)

    async def named(model_hash):
        async with trio.open_nursery() as nursery:
            server = F.FileServer()
            server.add(made / "manifest.json")

            async def open_stream(peer: str):
                a, b = trio.testing.memory_stream_pair()
                nursery.start_soon(server.serve, MemStream(b), "me")
                return MemStream(a)
            fetcher = Fetcher(open_stream, piece=PIECE, stall_timeout=5)
            try:
                return await from_swarm._variant_named(fetcher, tmp_path / "home", [record, liar], from_swarm.Wanted(
                    quant="int8", model_hash=model_hash))
            finally:
                await fetcher.close()
                nursery.cancel_scope.cancel()

    want, sha = trio.run(named, honest.upper())
    assert sha == honest and want.model_hash == blockfiles.complete(src).model_hash
    want, sha = trio.run(named, want.model_hash)  # the source's model hash: no variant named
    assert sha is None and want.model_hash == blockfiles.complete(src).model_hash


def good_manifest() -> dict:
    return {"model_id": "m", "arch": "llama", "num_layers": 2, "dtype": "float32", "block_hashes": ["a" * 64] * 2,
            "head_hash": "b" * 64, "format": 2, "block_sizes": [100, 100], "head_size": 50,
            "files": {"config.json": [2, "c" * 64]}}


@pytest.mark.parametrize("field,value,format_2", [
    ("block_hashes", ["a" * 64, "../../../../tmp/x" + "0" * 47], False), ("head_hash", "B" * 64, False),
    ("head_hash", 7, False), ("block_sizes", [100, 10 ** 30], True), ("block_sizes", [100, "100"], True),
    ("head_size", -1, True), ("head_size", 1.5, True), ("num_layers", "2", False), ("block_hashes", "a" * 128, False),
    ("files", ["config.json"], True), ("files", {"../config.json": [2, "c" * 64]}, True)])
def test_a_manifest_with_a_bad_hash_or_size_is_refused_naming_the_field(tmp_path, field, value, format_2):
    """One check for every manifest from the swarm: `--from-swarm` fetches by all of it; `status`
    reads coverage alone (hashes and count), so a format-1 manifest or a bad size does not hide a model."""
    from diffuse.client.manifests import checked
    from diffuse.errors import ModelError

    (tmp_path / "manifest.json").write_text(json.dumps(good_manifest()))
    assert checked(tmp_path, "m").block_sizes == [100, 100]
    (tmp_path / "manifest.json").write_text(json.dumps(good_manifest() | {field: value}))
    with pytest.raises(ModelError, match=re.escape(field)):
        checked(tmp_path, "m")
    if format_2:
        assert checked(tmp_path, "m", to_fetch=False).num_layers == 2
    else:
        with pytest.raises(ModelError, match=re.escape(field)):
            checked(tmp_path, "m", to_fetch=False)


@pytest.mark.parametrize("text", ["[1, 2]", "not json", '{"model_id": "m"}',
                                  json.dumps(good_manifest() | {"quant": "int4"})])
def test_what_is_no_manifest_of_the_model_is_refused_as_such(tmp_path, text):
    from diffuse.client.manifests import checked
    from diffuse.errors import ModelError

    (tmp_path / "manifest.json").write_text(text)
    for to_fetch in (True, False):
        with pytest.raises(ModelError, match="malformed|not a manifest"):
            checked(tmp_path, "m", to_fetch)
    with pytest.raises(ModelError, match="not a manifest of other"):
        (tmp_path / "manifest.json").write_text(json.dumps(good_manifest()))
        checked(tmp_path, "other", to_fetch=False)


@pytest.mark.parametrize("sha,size,ok", [("a" * 64, 10, True), ("A" * 64, 10, False), ("a" * 63, 10, False),
                                         ("a" * 64, 0, False), ("a" * 64, True, False), ("a" * 64, 2 << 20, False),
                                         (None, 10, False), ("a" * 64, "10", False)])
def test_a_record_announces_a_manifest_only_by_a_sha256_and_a_size_in_bounds(sha, size, ok):
    from types import SimpleNamespace

    from diffuse.client.manifests import MANIFEST_BYTES, MANIFEST_SHA, announced

    record = SimpleNamespace(extra={MANIFEST_SHA: sha, MANIFEST_BYTES: size})
    assert announced(record) == ((sha, size) if ok else None)


@pytest.mark.parametrize("sha,size,why", [("../" + "a" * 61, 10, "not 64 lowercase hex"),
                                          ("a" * 64, 10 ** 20, "is not a file's"),
                                          ("a" * 64, "10", "is not a file's")])
def test_a_fetch_refuses_a_hash_that_is_no_sha256_or_a_size_out_of_bounds(tmp_path, sha, size, why):
    async def never(peer: str):
        raise AssertionError("asked a peer")

    async def main():
        return await Fetcher(never).fetch(sha, size, tmp_path / "x", ["p"], "block 1")

    with pytest.raises(FetchError, match=why):
        trio.run(main)
    assert list(tmp_path.iterdir()) == []


def test_the_manifest_is_served_as_announced_even_once_rewritten_on_disk(tmp_path):
    from tiny import make_tiny

    from diffuse.client.manifests import MANIFEST_SHA
    from diffuse.peer.offer import offer

    store = make_tiny(tmp_path / "tiny")
    server = F.FileServer()
    extra = offer(server, store, (0, 4))
    announced = (store / "manifest.json").read_bytes()
    assert hashlib.sha256(announced).hexdigest() == extra[MANIFEST_SHA]
    (store / "manifest.json").write_bytes(announced.replace(b'"llama"', b'"LLAMA"'))  # same size, other bytes
    path, fetcher = run_fetch(tmp_path, {"peer": server}, extra[MANIFEST_SHA], ["peer"], size=len(announced))
    assert not isinstance(path, Exception) and path.read_bytes() == announced and not fetcher.banned


def test_bytes_of_a_source_gone_before_a_liar_is_replaced_stay_for_the_next_run(tmp_path, blob):
    sha = hashlib.sha256(blob).hexdigest()
    serving: dict = servers(tmp_path, blob, ["liar"])
    bad = bytearray(blob)
    for i in range(0, SIZE, PIECE):
        bad[i] ^= 1
    (tmp_path / "liar.bin").write_bytes(bytes(bad))
    honest, asked = servers(tmp_path, blob, ["honest"])["honest"], []

    async def then_gone(stream):  # serves its first request, then has the file no more
        read = stream.read

        async def counting(n: int = -1) -> bytes:
            if data := await read(n):
                asked.append(1)
                if len(asked) > 1:
                    honest.files.clear()
            return data

        stream.read = counting
        await honest.serve(stream, "me")

    serving["honest"] = then_gone  # 1 piece of 4 from it, the rest from the liar: the liar's replaced first
    err, first = run_fetch(tmp_path, serving, sha, ["honest", "liar"], per_source=2)
    assert isinstance(err, FetchError) and "no other source could send them" in str(err), (err, first.stats)
    notes = json.loads((tmp_path / "got" / f".file.{sha[:16]}.part.json").read_text())
    assert sum(n for _, n in notes["received"]) == first.stats.by_peer["honest"] > 0  # the honest bytes, kept
    path, second = run_fetch(tmp_path, servers(tmp_path, blob, ["good"]), sha, ["good"])
    assert path.read_bytes() == blob and second.stats.received == SIZE - first.stats.by_peer["honest"]


def test_with_two_liars_the_error_names_as_banned_only_those_banned(tmp_path, blob):
    sha = hashlib.sha256(blob).hexdigest()
    serving = servers(tmp_path, blob, ["one", "two"])
    for name, flip in (("one", 1), ("two", 2)):
        bad = bytearray(blob)
        for i in range(0, SIZE, PIECE):
            bad[i] ^= flip
        (tmp_path / f"{name}.bin").write_bytes(bytes(bad))
    err, fetcher = run_fetch(tmp_path, serving, sha, ["one", "two"], per_source=1)
    assert isinstance(err, FetchError), err
    said = re.search(r"banned: ([^)]*)\)", str(err)).group(1)
    assert sorted(said.split(", ")) == sorted(fetcher.banned) or (said == "none" and not fetcher.banned), str(err)


@pytest.mark.parametrize("same", [True, False])
def test_two_liars_cannot_defeat_blame_the_file_comes_right_and_only_they_are_banned(tmp_path, blob, same):
    """Two liars (serving the same wrong bytes, or each its own) among the first sources at work:
    replacing one's ranges with the other's cannot find either out, so each source is then asked
    for the whole file alone; the honest one's hashes right, and both liars, whose ranges differ
    from it, are banned."""
    sha = hashlib.sha256(blob).hexdigest()
    serving = servers(tmp_path, blob, ["one", "two", "good"])
    for name, flip in (("one", 1), ("two", 1 if same else 2)):
        bad = bytearray(blob)
        for i in range(0, SIZE, PIECE):
            bad[i] ^= flip
        (tmp_path / f"{name}.bin").write_bytes(bytes(bad))
    path, fetcher = run_fetch(tmp_path, serving, sha, ["one", "two", "good"], per_source=1)
    assert not isinstance(path, Exception), path
    assert path.read_bytes() == blob and sorted(fetcher.banned) == ["one", "two"], fetcher.banned


@pytest.mark.parametrize("value", ["abc", "-1", "inf", "nan"])
def test_a_bad_upload_cap_is_refused_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv("DIFFUSE_FILES_SEND_RATE", value)
    with pytest.raises(DiffuseError, match="DIFFUSE_FILES_SEND_RATE"):
        F.send_rate_cap()


def test_the_upload_cap_defaults_to_none_and_takes_bytes_per_second(monkeypatch):
    monkeypatch.delenv("DIFFUSE_FILES_SEND_RATE", raising=False)
    assert F.send_rate_cap() == 0
    monkeypatch.setenv("DIFFUSE_FILES_SEND_RATE", str(4 << 20))
    assert F.FileServer().send_rate == 4 << 20


def test_json_progress_is_one_object_a_line_with_its_event_and_a_failure_is_told_too(capsys, monkeypatch, tmp_path):
    """`join / ask --from-swarm --json`: progress at most once a second and once at the end, then
    `done`; a fetch that fails says why in a `failed` line before the error goes up."""
    from diffuse.client import from_swarm
    from diffuse.control.node import NodeConfig

    clock = iter(float(t) for t in range(100, 200))
    monkeypatch.setattr(from_swarm.time, "monotonic", lambda: next(clock))
    said: list[str] = []
    progress = from_swarm.Progress(said.append, as_json=True)
    progress.event("manifest", model="m", manifest_sha256="a" * 64)
    progress.expect(300)
    for _ in range(3):
        progress.add(100)
    progress.finish()
    lines = [json.loads(x) for x in capsys.readouterr().err.splitlines()]
    assert [x["event"] for x in lines] == ["manifest", "progress", "progress", "progress", "progress"]
    assert lines[-1] == {"event": "progress", "fetched_bytes": 300, "of_bytes": 300, "bytes_per_s": 75, "eta_s": 0}
    assert not said  # no text progress beside the JSON lines

    monkeypatch.undo()
    want = from_swarm.Wanted(model="nothing-here", wait=0.1, json_progress=True)
    with pytest.raises(DiffuseError, match="no peer announces nothing-here"):
        trio.run(from_swarm.from_swarm, tmp_path, NodeConfig(listen=["/ip4/127.0.0.1/tcp/0"]), want, said.append)
    failed = [json.loads(x) for x in capsys.readouterr().err.splitlines() if x.startswith("{")]
    assert failed == [{"event": "failed", "error": failed[0]["error"]}] and "no peer announces" in failed[0]["error"]


def test_a_variant_of_a_format_2_source_lists_its_own_sizes_not_the_sources(tmp_path):
    from tiny import make_tiny

    from diffuse.model import blockfiles, variants
    from diffuse.model.weights import ModelFiles

    src = make_tiny(tmp_path / "tiny")
    source = blockfiles.complete(src)  # format 2, as a peer serving it (or a fetch) leaves it
    made = blockfiles.complete(variants.make_variant(src, "int8"))
    files = ModelFiles(variants.variant_dir(src, "int8"))
    assert made.format == 2 and made.quant == "int8" and made.head_size == 0  # its head is its source's
    assert made.block_sizes == [blockfiles.size(blockfiles.segments(files, i)) for i in range(4)]
    assert made.block_sizes != source.block_sizes and made.files == source.files  # config, tokenizer: copied
