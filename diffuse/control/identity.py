"""Node identity: one persistent Ed25519 key per node, so its peer id survives restarts.

The peer id is what other peers, records and routes refer to; a node that got a new id on each
start would look like a stranger and lose the history others keep about it. The key lives in the
data directory by default (`<home>/identity.key`); `--identity KEYFILE` picks another file, so
several peers on one machine can share one model store and still be different peers.
"""

from __future__ import annotations

import fcntl
import os
import stat
import tempfile
from pathlib import Path
from typing import IO

from libp2p.crypto.ed25519 import Ed25519PrivateKey, create_new_key_pair
from libp2p.crypto.keys import KeyPair
from libp2p.identity_utils import load_identity, save_identity
from libp2p.peer.id import ID

from diffuse.errors import DiffuseError
from diffuse.home import data_home

IDENTITY_FILE = "identity.key"


class IdentityError(DiffuseError):
    """The key file is unreadable, corrupt, not Ed25519, or readable by other users."""


def default_identity_path(home: str | os.PathLike | None = None) -> Path:
    return data_home(home) / IDENTITY_FILE


def load_or_create(path: str | os.PathLike) -> KeyPair:
    """The key pair stored at `path`, created (mode 0600) on first use.

    Creation is atomic (write a private temp file, then hard-link it into place), so two peers
    started at once with the same --identity end up with the same key instead of one overwriting
    the other's.
    """
    path = Path(path).expanduser()
    if not path.exists():
        _create(path)
    return _load(path)


def ephemeral() -> KeyPair:
    """A fresh identity kept nowhere: one per question or API process, so nothing links them."""
    return create_new_key_pair()


def peer_id(key_pair: KeyPair) -> ID:
    return ID.from_pubkey(key_pair.public_key)


def peer_id_bytes(peer: str) -> bytes:
    """A base58 peer id's binary form (a multihash of its public key), as signed payloads carry it."""
    return ID.from_base58(peer).to_bytes()


def peer_id_from_bytes(raw: bytes) -> str:
    """The base58 form of a binary peer id; ValueError where the bytes are not one."""
    try:
        return ID(raw).to_base58()
    except Exception:  # noqa: BLE001 - py-libp2p's ID raises several types on bad bytes
        raise ValueError("bad peer id") from None


def _create(path: Path) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".identity-", dir=path.parent)
        os.close(fd)
        try:
            save_identity(create_new_key_pair(), tmp)  # writes with mode 0600
            try:
                os.link(tmp, path)
            except FileExistsError:
                pass  # another process won the race: use its key
        finally:
            os.unlink(tmp)
    except OSError as e:
        raise IdentityError(f"cannot create identity key {path}: {e.strerror or e}") from None


def _load(path: Path) -> KeyPair:
    try:
        mode = path.stat().st_mode
    except OSError as e:
        raise IdentityError(f"cannot read identity key {path}: {e.strerror or e}") from None
    if os.name != "nt" and mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise IdentityError(
            f"identity key {path} is accessible by other users (mode {stat.S_IMODE(mode):04o}): "
            f"run `chmod 600 {path}`"
        )
    try:
        kp = load_identity(path)
    except (OSError, ValueError) as e:
        raise IdentityError(f"identity key {path} is unreadable or corrupt: {e}") from None
    if not isinstance(kp.private_key, Ed25519PrivateKey):
        raise IdentityError(f"identity key {path} is not an Ed25519 key")
    return kp


def lock(path: str | os.PathLike) -> IO[bytes]:
    """Hold an exclusive lock on the key file while a node runs with it.

    Two running nodes with one identity would be one peer id at two addresses, which corrupts
    everyone's routing tables; with a shared data directory that is one forgotten --identity
    away. The lock dies with the process (even on SIGKILL). Keep the returned file open.
    """
    path = Path(path).expanduser()
    f = open(path, "rb")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise IdentityError(
            f"identity {path} is in use by another running node: give this one its own "
            f"--identity KEYFILE (a new file is created on first use)"
        ) from None
    return f


_held: list[IO[bytes]] = []  # locks of the identities this process runs with, held until it exits


def node_key(path: str | os.PathLike | None, home: str | os.PathLike | None, hold: bool = False) -> KeyPair:
    """A node's key from `path` (default: <home>/identity.key); hold: lock its file for the life of
    the process, so a second node cannot run with the same identity."""
    path = path or default_identity_path(home)
    key_pair = load_or_create(path)
    if hold:
        _held.append(lock(path))
    return key_pair
