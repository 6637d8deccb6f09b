"""Node identity: a persistent Ed25519 key (0600) whose peer id survives restarts."""

from __future__ import annotations

import os
import stat
import threading

import pytest

from support.procs import Procs
from diffuse.control.identity import IdentityError, default_identity_path, load_or_create, lock, peer_id


def test_key_is_created_private_and_stable(tmp_path):
    path = tmp_path / "keys" / "node.key"
    first = peer_id(load_or_create(path)).to_base58()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert peer_id(load_or_create(path)).to_base58() == first
    assert peer_id(load_or_create(tmp_path / "other.key")).to_base58() != first


def test_concurrent_creation_yields_one_key(tmp_path):
    path = tmp_path / "race.key"
    ids: list[str] = []
    barrier = threading.Barrier(4)

    def create() -> None:
        barrier.wait()
        ids.append(peer_id(load_or_create(path)).to_base58())

    threads = [threading.Thread(target=create) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(ids)) == 1


def test_unsafe_or_corrupt_keys_are_refused(tmp_path):
    path = tmp_path / "k"
    load_or_create(path)
    os.chmod(path, 0o644)
    with pytest.raises(IdentityError, match="chmod 600"):
        load_or_create(path)
    bad = tmp_path / "bad"
    bad.write_bytes(b"not a key")
    os.chmod(bad, 0o600)
    with pytest.raises(IdentityError, match="corrupt"):
        load_or_create(bad)


def test_one_running_node_per_identity(tmp_path):
    path = tmp_path / "k"
    load_or_create(path)
    held = lock(path)
    try:
        with pytest.raises(IdentityError, match="--identity"):
            lock(path)
    finally:
        held.close()
    lock(path).close()  # released with its holder


@pytest.mark.timeout(60)
def test_diffuse_id_prints_the_stable_peer_id(tmp_path):
    home = tmp_path / "home"
    with Procs(home) as procs:
        out = procs.run("--home", str(home), "id")
        assert out.returncode == 0, out.stderr
        key = default_identity_path(home)
        assert key == home / "identity.key" and stat.S_IMODE(key.stat().st_mode) == 0o600
        assert out.stdout.strip() == peer_id(load_or_create(key)).to_base58()
        # (--identity KEYFILE is exercised by the swarm test, where each peer has its own.)
