"""Swarm keys, modes and allow-lists without a network: the swarm.key format, where a key is looked
for and what each mode sets, bad input named, and an allow-list that DHT nodes and readers apply
as the file changes."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.kad_dht.pb.kademlia_pb2 import Record

from control_helpers import fake_hashes, make_fake_model
from diffuse.control.allow import AllowList, AllowListError
from diffuse.control.dht import MergingValueStore
from diffuse.control.identity import peer_id
from diffuse.control.modes import KEY_ENV, PRIVATE, PUBLIC, resolve
from diffuse.control.records import (
    InvalidRecord,
    PeerRecord,
    RecordValidator,
    SetCodecs,
    blocks_key,
    encode_set,
    sign,
)
from diffuse.control.swarm_key import SwarmKey, SwarmKeyError, read_key, write_key

GO_STYLE = "/key/swarm/psk/1.0.0/\r\n/base16/\r\n" + "ab" * 32  # as ipfs-swarm-key-gen writes it


def test_swarm_key_file_round_trips_and_reads_other_tools_files(tmp_path):
    key = SwarmKey.generate()
    write_key(tmp_path / "k", key)
    assert stat.S_IMODE((tmp_path / "k").stat().st_mode) == 0o600
    assert (tmp_path / "k").read_text() == f"/key/swarm/psk/1.0.0/\n/base16/\n{key.secret.hex()}\n"
    assert read_key(tmp_path / "k") == key
    assert SwarmKey.parse(GO_STYLE).secret == bytes([0xAB]) * 32
    import base64

    b64 = "/key/swarm/psk/1.0.0/\n/base64/\n" + base64.b64encode(key.secret).decode()
    assert SwarmKey.parse(b64) == key
    assert key.secret.hex() not in repr(key) and key.fingerprint in repr(key)


@pytest.mark.parametrize("text, message", [
    ("", "is not a swarm key"),
    ("ab" * 32, "is not a swarm key"),
    ("/key/swarm/psk/2.0.0/\n/base16/\n" + "ab" * 32, "is not a swarm key"),
    ("/key/swarm/psk/1.0.0/\n/bin/\n" + "ab" * 32, "only /base16/ and /base64/"),
    ("/key/swarm/psk/1.0.0/\n/base16/\n" + "zz" * 32, "not valid base16"),
    ("/key/swarm/psk/1.0.0/\n/base16/\n" + "ab" * 31, "holds 31 bytes, a swarm key 32"),
])
def test_bad_swarm_key_files_are_named(tmp_path, text, message):
    path = tmp_path / "swarm.key"
    path.write_text(text)
    path.chmod(0o600)
    with pytest.raises(SwarmKeyError, match=message) as e:
        read_key(path)
    assert str(path) in str(e.value)


def test_a_key_others_can_read_missing_or_existing_is_refused(tmp_path):
    path = tmp_path / "swarm.key"
    with pytest.raises(SwarmKeyError, match="no swarm key at .*diffuse swarm new"):
        read_key(path)
    write_key(path, SwarmKey.generate())
    with pytest.raises(SwarmKeyError, match="already exists"):
        write_key(path, SwarmKey.generate())
    path.chmod(0o644)
    with pytest.raises(SwarmKeyError, match=r"accessible by other users \(mode 0644\): run `chmod 600"):
        read_key(path)


def test_where_a_key_is_looked_for_and_what_each_mode_sets(tmp_path):
    home = tmp_path / "home"
    flag, env_key, home_key = tmp_path / "flag.key", tmp_path / "env.key", home / "swarm.key"
    keys = {p: SwarmKey.generate() for p in (flag, env_key, home_key)}
    for p, k in keys.items():
        write_key(p, k)
    env = {KEY_ENV: str(env_key)}
    assert resolve(PRIVATE, home, key_file=flag, env=env).key == keys[flag]
    assert resolve(PRIVATE, home, env=env).key == keys[env_key]
    private = resolve(PRIVATE, home, env={})
    assert (private.key, private.key_path, private.trust) == (keys[home_key], home_key, "private")
    public = resolve(PUBLIC, home, env=env)  # keys lying around do not make a public node private
    assert (public.key, public.trust) == (None, "public")
    with pytest.raises(SwarmKeyError, match=rf"no swarm key at .*missing \(named by \${KEY_ENV}\)"):
        resolve(PRIVATE, home, env={KEY_ENV: str(tmp_path / "missing")})
    with pytest.raises(Exception, match="--swarm-key is for private swarms"):
        resolve(PUBLIC, home, key_file=flag)
    with pytest.raises(Exception, match="--allow-peers restricts who serves a private swarm"):
        resolve(PUBLIC, home, allow_file=flag)


def test_without_a_key_a_private_node_is_refused_and_a_sentinel_makes_one(tmp_path):
    home = tmp_path / "home"
    with pytest.raises(Exception, match="this swarm is private: give its key with --swarm-key FILE"):
        resolve(PRIVATE, home, env={})
    made = resolve(PRIVATE, home, env={}, create=True)
    assert made.created and made.key_path == home / "swarm.key"
    assert stat.S_IMODE(made.key_path.stat().st_mode) == 0o600
    again = resolve(PRIVATE, home, env={}, create=True)
    assert again.key == made.key and not again.created


def test_cli_swarm_new_and_bad_keys_exit_2(tmp_path, capsys):
    from diffuse.cli import main

    home = tmp_path / "home"
    make_fake_model(home)
    assert main(["--home", str(home), "swarm", "new"]) == 0
    out = capsys.readouterr().out
    assert f"wrote a new swarm key to {home / 'swarm.key'}" in out and "--swarm-key FILE" in out
    assert stat.S_IMODE((home / "swarm.key").stat().st_mode) == 0o600
    assert main(["--home", str(home), "swarm", "new"]) == 2
    assert "already exists" in capsys.readouterr().err
    bad = tmp_path / "bad.key"
    bad.write_text("not a key\n")
    bad.chmod(0o600)
    boot = f"/ip4/127.0.0.1/tcp/1/p2p/{peer_id(create_new_key_pair()).to_base58()}"
    for argv, message in [(["--swarm-key", str(bad)], "is not a swarm key"),
                          (["--mode", "public", "--swarm-key", str(bad)], "--swarm-key is for private swarms"),
                          (["--allow-peers", str(tmp_path / "none")], "cannot read allow-list")]:
        assert main(["--home", str(home), "status", "--bootstrap", boot, *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and "Traceback" not in err, err


def _ids(n: int) -> list[str]:
    return [peer_id(create_new_key_pair()).to_base58() for _ in range(n)]


def _bump(path: Path, text: str) -> None:
    """Rewrite `path` so that its stat changes even within one clock tick."""
    before = path.stat().st_mtime_ns
    path.write_text(text)
    os.utime(path, ns=(before + 10**9, before + 10**9))


def test_allow_list_reads_comments_refuses_garbage_and_follows_edits(tmp_path, caplog):
    a, b, c = _ids(3)
    path = tmp_path / "allow"
    path.write_text(f"# the team\n{a}  # alice\n\n{b}\n")
    allow = AllowList(path)
    assert allow.ids() == {a, b} and a in allow and c not in allow
    _bump(path, f"{a}\n{c}\n")
    assert allow.ids() == {a, c}
    _bump(path, f"{a}\nnot-a-peer\n")  # a half-done edit keeps the last good list, and says so once
    assert allow.ids() == {a, c} and allow.ids() == {a, c}
    assert [r.message.count("'not-a-peer' is not a peer id") for r in caplog.records] == [1]
    path.write_text("QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N\n")  # not an Ed25519 id
    with pytest.raises(AllowListError, match="line 1: 'QmYy.*' is not a peer id"):
        AllowList(path)


def _record(kp, ts: float | None = None) -> bytes:
    ts = time.time() if ts is None else ts
    rec = PeerRecord(peer_id=peer_id(kp).to_base58(), model="m", num_blocks=4, start=0, end=4,
                     block_hashes=tuple(fake_hashes(4)), dtype="bfloat16", throughput=1.0, cache_tokens=0,
                     addrs=(), timestamp=ts, expires=ts + 60, started=ts)
    return encode_set([sign(rec, kp)])


def test_dht_nodes_store_and_serve_only_allowed_peers(tmp_path):
    kp_a, kp_b = create_new_key_pair(), create_new_key_pair()
    a, b = peer_id(kp_a).to_base58(), peer_id(kp_b).to_base58()
    path = tmp_path / "allow"
    path.write_text(f"{a}\n{b}\n")
    allow = AllowList(path)
    codecs = SetCodecs().allowing(allow.ids)
    store, validator = MergingValueStore(None, None, codecs), RecordValidator(codecs)
    key = blocks_key("m")
    kb = key.encode()
    for kp in (kp_a, kp_b):
        validator.validate(key, _record(kp))
        store.put_record(kb, Record(key=kb, value=_record(kp)))
    assert {r.peer_id for r in store.records(kb)} == {a, b}

    _bump(path, f"{a}\n")  # b leaves the list: refused on store, dropped from what is held
    with pytest.raises(InvalidRecord, match=f"{b} is not on this swarm's allow-list"):
        validator.validate(key, _record(kp_b, time.time() + 1))
    store.put_record(kb, Record(key=kb, value=_record(kp_b, time.time() + 1)))
    assert store.get(kb) is not None and {r.peer_id for r in store.records(kb)} == {a}
    # Readers (fetch_set merges with the same codecs) drop b's record wherever it came from.
    assert [r.peer_id for r in codecs.for_key(key).decode(_record(kp_b), key, strict=False)] == []
