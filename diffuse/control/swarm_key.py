"""Swarm keys: the pre-shared key of a private swarm, in the libp2p ecosystem's `swarm.key` format.

    /key/swarm/psk/1.0.0/
    /base16/
    <64 hex digits>

the file IPFS and go-libp2p read (go-libp2p's `pnet.DecodeV1PSK` also takes `/base64/`, read
here too). Whoever holds it is a member of the swarm, so it is a secret: written mode 0600, and
refused when other users may read it, as identity keys are.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

from diffuse.errors import DiffuseError

HEADER = "/key/swarm/psk/1.0.0/"
KEY_BYTES = 32


class SwarmKeyError(DiffuseError):
    """A swarm key file that is missing, unreadable, readable by others, or not a swarm key."""


@dataclass(frozen=True)
class SwarmKey:
    secret: bytes

    def __post_init__(self) -> None:
        if len(self.secret) != KEY_BYTES:
            raise SwarmKeyError(f"a swarm key has {KEY_BYTES} bytes, not {len(self.secret)}")

    def __repr__(self) -> str:  # never print the secret by accident
        return f"SwarmKey({self.fingerprint})"

    @classmethod
    def generate(cls) -> "SwarmKey":
        return cls(os.urandom(KEY_BYTES))

    @property
    def psk(self) -> str:
        """The form py-libp2p's `new_host(psk=...)` takes: 64 hex digits."""
        return self.secret.hex()

    @property
    def fingerprint(self) -> str:
        """A short name for the key that does not reveal it, so two operators can compare keys."""
        return hashlib.sha256(b"diffuse/swarm-key\x00" + self.secret).hexdigest()[:16]

    def encode(self) -> str:
        return f"{HEADER}\n/base16/\n{self.psk}\n"

    @classmethod
    def parse(cls, text: str, source: str = "the swarm key") -> "SwarmKey":
        lines = [ln.strip() for ln in text.strip().splitlines()]
        if len(lines) != 3 or lines[0] != HEADER:
            raise SwarmKeyError(f"{source} is not a swarm key: expected three lines, {HEADER}, /base16/ "
                                f"and 64 hex digits (`diffuse swarm new` writes one)")
        encoding, body = lines[1], lines[2]
        try:
            if encoding == "/base16/":
                secret = bytes.fromhex(body)
            elif encoding == "/base64/":
                secret = base64.b64decode(body, validate=True)
            else:
                raise SwarmKeyError(f"{source} has encoding {encoding!r}: only /base16/ and /base64/ are read")
        except (ValueError, binascii.Error):
            raise SwarmKeyError(f"{source}: its key is not valid {encoding[1:-1]}") from None
        if len(secret) != KEY_BYTES:
            raise SwarmKeyError(f"{source} holds {len(secret)} bytes, a swarm key {KEY_BYTES}")
        return cls(secret)


def read_key(path: Path, via: str = "") -> SwarmKey:
    """The key in `path` (named by `via`, for messages); refused if other users may use it."""
    path = Path(path).expanduser()
    named = f" (named by {via})" if via else ""
    try:
        mode = path.stat().st_mode
        text = path.read_text()
    except FileNotFoundError:
        raise SwarmKeyError(f"no swarm key at {path}{named}: copy the swarm's key there, or "
                            f"`diffuse swarm new --out {path}` makes one for a new swarm") from None
    except (OSError, UnicodeDecodeError) as e:
        raise SwarmKeyError(f"cannot read swarm key {path}: {getattr(e, 'strerror', None) or e}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SwarmKeyError(f"swarm key {path} is accessible by other users (mode {stat.S_IMODE(mode):04o}): "
                            f"run `chmod 600 {path}`")
    return SwarmKey.parse(text, f"swarm key {path}")


def write_key(path: Path, key: SwarmKey) -> None:
    """Write `key` to a new file (mode 0600, atomically); an existing file is never replaced:
    a node given another key would be cut off its swarm."""
    path = Path(path).expanduser()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".swarm-key-", dir=path.parent)  # created mode 0600
        try:
            with os.fdopen(fd, "w") as f:
                f.write(key.encode())
            os.link(tmp, path)
        finally:
            os.unlink(tmp)
    except FileExistsError:
        raise SwarmKeyError(f"{path} already exists: remove it first if you mean to replace that swarm's "
                            "key, or give another file") from None
    except OSError as e:
        raise SwarmKeyError(f"cannot write swarm key {path}: {e.strerror or e}") from None
