"""Sentinels' pins (control/pins.py): signed, fresh, under their signer's own key, the latest
winning; read over a real DHT by the node that bootstraps from the sentinel; and what a fetch
from the swarm trusts with them (client/from_swarm.py)."""

from __future__ import annotations

import time

import cbor2
import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair

from diffuse.control import pins
from diffuse.control.identity import peer_id
from diffuse.errors import DiffuseError

SHA, OTHER = "a" * 64, "b" * 64


def test_pins_are_signed_by_the_sentinel_and_live_only_under_its_key():
    kp, other = create_new_key_pair(), create_new_key_pair()
    me = peer_id(kp).to_base58()
    item = pins.sign({"m": SHA}, kp)
    value = pins.encode_set([item])
    assert pins.decode_set(value, pins.pins_key(me)) == [item] and item.pins == {"m": SHA}
    with pytest.raises(pins.InvalidPins, match="another peer's key"):
        pins.decode_set(value, pins.pins_key(peer_id(other).to_base58()))
    fields = cbor2.loads(item.payload)
    forged = cbor2.dumps(fields | {"pins": {"m": OTHER}}, canonical=True)
    with pytest.raises(pins.InvalidPins, match="bad signature"):
        pins.verify(forged, item.signature)
    with pytest.raises(pins.InvalidPins, match="bad signature"):  # signed by another key than the signer named
        pins.verify(item.payload, other.private_key.sign(pins.SIG_DOMAIN + item.payload))
    assert pins.decode_set(value, pins.pins_key(peer_id(other).to_base58()), strict=False) == []


def test_stale_future_or_malformed_pins_are_refused_and_the_latest_wins():
    kp = create_new_key_pair()
    now = time.time()
    with pytest.raises(pins.InvalidPins, match="stale"):
        pins.verify(*_raw(pins.sign({"m": SHA}, kp, now - pins.PIN_TTL_S - 1)))
    with pytest.raises(pins.InvalidPins, match="future"):
        pins.verify(*_raw(pins.sign({"m": SHA}, kp, now + 600)))
    bad = {"v": 1, "signer": peer_id(kp).to_bytes(), "ts": int(now * 1000), "exp": int(now * 1000) + 1000,
           "pins": {"m": "../" + "a" * 61}}
    payload = cbor2.dumps(bad, canonical=True)
    with pytest.raises(pins.InvalidPins, match="malformed pins"):
        pins.verify(payload, kp.private_key.sign(pins.SIG_DOMAIN + payload))
    old, new = pins.sign({"m": SHA}, kp, now - 10), pins.sign({"m": OTHER}, kp, now)
    assert pins.merge_set([new, old]) == [new] == pins.merge_set([old, new])
    assert pins.contributes([new], [old]) and not pins.contributes([old], [new])


@pytest.mark.parametrize("given,why", [(["m"], "MODEL=SHA256"), (["m=" + "a" * 63], "MODEL=SHA256"),
                                       (["=" + SHA], "MODEL=SHA256"), (["m=" + SHA, "m=" + OTHER], "once per model")])
def test_a_bad_model_hash_option_is_refused_naming_it(given, why):
    with pytest.raises(DiffuseError, match=why):
        pins.parse(given)
    assert pins.parse(["SmolLM2=" + SHA.upper(), "other=" + OTHER]) == {"SmolLM2": SHA, "other": OTHER}


def test_a_public_sentinel_refuses_to_pin():
    from diffuse.control.modes import SwarmAccess
    from diffuse.peer.sentinel import SentinelConfig

    with pytest.raises(DiffuseError, match="private swarm"):
        SentinelConfig(SwarmAccess(mode="public"), ["/ip4/127.0.0.1/tcp/0"], model_hash=["m=" + SHA])


@pytest.mark.timeout(90)
def test_a_node_reads_the_pins_of_the_sentinel_it_bootstraps_from_and_a_restart_without_them_withdraws_them(
        monkeypatch):
    """Over a real DHT: a sentinel's pins reach the node that bootstraps from it; restarted with
    no pins (same key), the sentinel stores an empty map over those a fellow DHT node still holds."""
    monkeypatch.setattr(pins, "REPUBLISH_S", 0.5)  # stored again soon at the fellow that joined after
    from diffuse.control.node import NodeConfig, open_node
    from diffuse.control.sentinel import run_sentinel
    from diffuse.trust.reputation import swarm_codecs

    listen = ["/ip4/127.0.0.1/tcp/0"]
    kp = create_new_key_pair()
    me = peer_id(kp).to_base58()

    async def sentinel(nursery: trio.Nursery, boot: list[str], given: dict) -> tuple[trio.CancelScope, list[str]]:
        ready: list[str] = []
        scope = trio.CancelScope()

        async def run() -> None:
            with scope:
                await run_sentinel(kp, listen, boot, ready.extend, codecs=swarm_codecs(), pins=given)
        nursery.start_soon(run)
        while not ready:
            await trio.sleep(0.05)
        return scope, ready

    async def until(node, want: dict) -> None:
        with trio.fail_after(30):
            while await pins.read(node, [me], "m") != want:
                await trio.sleep(0.2)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            first, boot = await sentinel(nursery, [], {"m": SHA})
            keeper = NodeConfig(listen=listen, bootstrap=boot, server=True)  # a fellow DHT server
            async with open_node(create_new_key_pair(), keeper, codecs=swarm_codecs()) as fellow:
                config = NodeConfig(listen=listen, bootstrap=boot, server=False)
                async with open_node(create_new_key_pair(), config, codecs=swarm_codecs()) as node:
                    assert pins.bootstrap_ids(config.bootstrap) == [me]
                    await until(node, {me: SHA})
                    assert await pins.read(node, [me], "other") == {}
                with trio.fail_after(30):  # the fellow holds them too
                    while not fellow.dht.value_store.records(pins.pins_key(me).encode()):
                        await trio.sleep(0.2)
                first.cancel()
                _, again = await sentinel(nursery, fellow.full_addrs(), {})
                async with open_node(create_new_key_pair(), NodeConfig(listen=listen, bootstrap=again),
                                     codecs=swarm_codecs()) as node:
                    await until(node, {})
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_the_sentinels_pin_chooses_among_disagreeing_announcers_and_names_both_hashes_when_none_serves_it():
    from diffuse.client.manifests import choose as _choose
    from diffuse.model.weights import Manifest

    one = Manifest("m", "llama", 1, "float32", ["a" * 64], "b" * 64)
    found = {"1" * 64: (one, None)}
    groups = {("1" * 64, 10): ["PEER_A"]}
    by = "the sentinel pin of SENTINEL"
    with pytest.raises(DiffuseError, match="no peer serves a manifest with hash") as e:
        _choose(found, groups, "2" * 64, by)
    assert all(x in str(e.value) for x in ["1" * 64, "2" * 64, "PEER_A", by])
    assert _choose(found, groups, one.model_hash, by) == "1" * 64


def _raw(item: pins.SignedPins) -> tuple[bytes, bytes]:
    return item.payload, item.signature


def test_status_without_weights_trusts_what_a_fetch_trusts_not_the_first_announcer(tmp_path, monkeypatch):
    """`diffuse status` from an empty store: two peers announce different manifests of `m`, the
    first one met the wrong one; the sentinel's pin (a private swarm) or --model-hash chooses,
    and with neither the model is refused with both hashes named, never shown from the first."""
    import json
    from dataclasses import asdict

    import trio.testing

    from diffuse.client import manifests, survey
    from diffuse.control.node_config import NodeConfig
    from diffuse.control.records import PeerRecord
    from diffuse.data.files import FileServer
    from diffuse.model.weights import Manifest
    from test_sessions import MemStream

    server, shas, records = FileServer(), {}, {}
    for name, head in {"P1": "c" * 64, "P2": "d" * 64}.items():
        path = tmp_path / f"{name}.json"
        m = Manifest("m", "llama", 1, "float32", ["e" * 64], head)
        path.write_text(json.dumps(asdict(m) | {"model_hash": m.model_hash}))
        shas[name], size = server.add(path)
        records[name] = PeerRecord(name, "m", 1, 0, 1, ("e" * 64,), "float32", 1.0, 100, (), 0.0, 1e12, 0.0,
                                   extra={manifests.MANIFEST_SHA: shas[name], manifests.MANIFEST_BYTES: size})

    class Node:
        def known_peers(self):
            return ["P1", "P2"]  # the wrong manifest's announcer first

        async def peer_record(self, pid):
            return records[pid]

    sentinel = peer_id(create_new_key_pair()).to_base58()
    pinned: dict[str, str] = {}

    async def read(node, sentinels, model):
        assert list(sentinels) == [sentinel] and model == "m"
        return {sentinel: pinned[model]} if model in pinned else {}

    monkeypatch.setattr(pins, "read", read)
    private = NodeConfig(bootstrap=[f"/ip4/127.0.0.1/tcp/1/p2p/{sentinel}"], swarm_key=object())

    def heads(config, model_hashes):
        async def main():
            async with trio.open_nursery() as nursery:
                def opener(node, found):
                    async def open_stream(peer):
                        a, b = trio.testing.memory_stream_pair()
                        nursery.start_soon(server.serve, MemStream(b), "me")
                        return MemStream(a)
                    return open_stream
                monkeypatch.setattr(manifests, "opener", opener)
                refused: dict[str, str] = {}
                found = await survey.swarm_manifests(Node(), config, model_hashes, refused)
                nursery.cancel_scope.cancel()
                return [m.head_hash for m in found], refused
        return trio.run(main)

    pinned["m"] = shas["P2"]
    assert heads(private, {}) == (["d" * 64], {})  # the sentinel's pin, not the first announcer
    assert heads(private, {"m": shas["P1"]}) == (["c" * 64], {})  # --model-hash before the pin
    assert heads(NodeConfig(), {"m": shas["P2"]}) == (["d" * 64], {})
    del pinned["m"]
    found, refused = heads(NodeConfig(), {})  # public, no --model-hash: the announcers disagree
    assert found == [] and all(x in refused["m"] for x in [shas["P1"], shas["P2"], "P1", "P2", "--model-hash"])
    pinned["m"] = "f" * 64  # a pin nobody serves: refused naming it
    found, refused = heads(private, {})
    assert found == [] and "f" * 64 in refused["m"] and "sentinel pin" in refused["m"]
