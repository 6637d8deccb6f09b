"""Private and public swarms: what a node's mode sets, and where its swarm key comes from.

- private (the default): a team or a family. Every connection is encrypted with the swarm key
  before Noise (control/pnet.py), so only members can reach the DHT; the trust plane runs in its
  light form and publishes nothing; an optional allow-list says which members may serve.
- public: anyone may join; no key, the full trust plane, evidence published.

The library takes a key and an allow-list (`Node(swarm_key=..., allow=...)`); this module is
what commands resolve their options with: --swarm-key, then $DIFFUSE_SWARM_KEY, then
<home>/swarm.key.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from diffuse.control.allow import AllowList
from diffuse.control.mode_names import KEY_ENV, KEY_FILE, MODES, PRIVATE, PUBLIC
from diffuse.control.swarm_key import SwarmKey, read_key, write_key
from diffuse.errors import DiffuseError


@dataclass(frozen=True)
class SwarmAccess:
    """How a node joins its swarm: its mode, the key (private), who may serve (optional)."""

    mode: str
    key: SwarmKey | None = None
    key_path: Path | None = None
    created: bool = False  # the key was made just now, for a new private swarm
    allow: AllowList | None = None

    @property
    def trust(self) -> str:
        """The trust plane's form in this mode (`--trust` overrides): light and unpublished in a
        private swarm, whose members are known; full and published in a public one."""
        return self.mode

    def describe(self) -> str:
        """One line on how a node joined: "private swarm, key FILE (fingerprint F)" or "public swarm"."""
        if self.key is None:
            return "public swarm"
        allow = f", serving allowed to the peers in {self.allow.path}" if self.allow else ""
        return f"private swarm, key {self.key_path} (fingerprint {self.key.fingerprint}){allow}"


def resolve(mode: str, home: Path, *, key_file: Path | None = None, allow_file: Path | None = None,
            env: Mapping[str, str] = os.environ, create: bool = False) -> SwarmAccess:
    """The access a command's options describe. create: a private node finding no key makes
    one at <home>/swarm.key (a sentinel starting a new swarm); anything else without a key is
    refused before it dials, saying where a key is looked for."""
    if mode not in MODES:
        raise DiffuseError(f"unknown mode {mode!r}: private or public")
    if mode == PUBLIC:
        if key_file is not None:
            raise DiffuseError("--swarm-key is for private swarms, and a public one has no key: "
                               "drop --mode public to join the private swarm of this key")
        if allow_file is not None:
            raise DiffuseError("--allow-peers restricts who serves a private swarm: in a public one anyone may")
        return SwarmAccess(PUBLIC)
    allow = AllowList(allow_file) if allow_file is not None else None
    if key_file is not None:
        return SwarmAccess(PRIVATE, read_key(key_file), Path(key_file), allow=allow)
    if env.get(KEY_ENV):
        path = Path(env[KEY_ENV])
        return SwarmAccess(PRIVATE, read_key(path, via=f"${KEY_ENV}"), path, allow=allow)
    path = Path(home) / KEY_FILE
    if path.exists():
        return SwarmAccess(PRIVATE, read_key(path), path, allow=allow)
    if create:
        key = SwarmKey.generate()
        write_key(path, key)
        return SwarmAccess(PRIVATE, key, path, created=True, allow=allow)
    raise DiffuseError(f"this swarm is private: give its key with --swarm-key FILE (or ${KEY_ENV}, or copy it "
                       f"to {path}); `diffuse swarm new` makes a key for a new swarm, --mode public joins a "
                       "public one")
