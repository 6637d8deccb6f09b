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
    from diffuse.client.from_swarm import _choose
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
