"""Who may serve a private swarm: a file of peer ids that clients route through and DHT nodes
store records of.

The swarm key says who is a member; the allow-list says which members serve. It is re-read
whenever the file changes (checked on each use: one `stat`), so an operator removing a line
stops that peer's traffic without restarting anything or re-keying the swarm: DHT nodes refuse
its new records and drop the ones they hold, and clients ignore what they already read.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from libp2p.crypto.ed25519 import Ed25519PublicKey
from libp2p.peer.id import ID

from diffuse.errors import DiffuseError

log = logging.getLogger(__name__)


class AllowListError(DiffuseError):
    """The allow-list file is missing, unreadable, or has a line that is not a peer id."""


class AllowList:
    """Peer ids read from a file (one base58 id per line, `#` comments), kept current."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path).expanduser()
        self._stamp, self._ids = self._read()
        self._problem = ""  # what is wrong with the file now, once warned about

    def __contains__(self, peer_id: object) -> bool:
        return peer_id in self.ids()

    def ids(self) -> frozenset[str]:
        """The ids in the file as it is now. A file that cannot be read or parsed just now (an
        editor replacing it, a typo) keeps the last good list, with one warning per problem."""
        try:
            if self._stat() != self._stamp:
                self._stamp, self._ids = self._read()
                self._problem = ""
                log.info("allow-list %s reloaded: %d peers", self.path, len(self._ids))
        except AllowListError as e:
            if str(e) != self._problem:
                self._problem = str(e)
                log.warning("%s; keeping the %d peers read before", e, len(self._ids))
        return self._ids

    def _stat(self) -> tuple[int, int, int]:
        try:
            st = os.stat(self.path)
        except OSError as e:
            raise AllowListError(f"cannot read allow-list {self.path}: {e.strerror or e}") from None
        return st.st_mtime_ns, st.st_size, st.st_ino

    def _read(self) -> tuple[tuple[int, int, int], frozenset[str]]:
        stamp = self._stat()
        try:
            text = self.path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise AllowListError(f"cannot read allow-list {self.path}: {getattr(e, 'strerror', None) or e}") from None
        ids = set()
        for n, line in enumerate(text.splitlines(), 1):
            word = line.split("#", 1)[0].strip()
            if not word:
                continue
            if not _is_peer_id(word):
                raise AllowListError(f"allow-list {self.path} line {n}: {word!r} is not a peer id "
                                     "(`diffuse id` prints a node's)")
            ids.add(word)
        return stamp, frozenset(ids)


def _is_peer_id(word: str) -> bool:
    """Whether `word` is what records are signed by: the base58 id of an Ed25519 key."""
    try:
        pid = ID.from_base58(word)
        return pid.to_base58() == word and isinstance(pid.extract_public_key(), Ed25519PublicKey)
    except Exception:  # noqa: BLE001 - base58, multihash and key decoding raise several unrelated types
        return False
