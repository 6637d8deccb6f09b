"""The history vault: a member's own conversations, kept encrypted on this machine and never sent.

`ask` asks the swarm under a new identity per question, so nothing there ties a member's questions
together; what a member wants to keep is kept here, in `<home>/history/`, under a key derived from
a passphrase by Argon2id (distinct from any node identity). Each record is sealed with
XChaCha20-Poly1305 under its own random nonce, its id as associated data, so a record renamed to
another id does not open. The header (`vault.json`) carries the format version, the KDF's
parameters and salt, and a sealed check value, so that a wrong passphrase is told apart from a
damaged record and changes nothing. Every write is atomic (a temporary file, synced, renamed);
files are 0600, the directory 0700. Without the header's salt no passphrase opens the records, so
`wipe` deletes it first. docs/client.md ("History vault") has the format and why.
"""

from __future__ import annotations

import getpass
import json
import os
import re
import secrets
import shutil
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta
from nacl import pwhash
from nacl.bindings import crypto_aead_xchacha20poly1305_ietf_decrypt as aead_open
from nacl.bindings import crypto_aead_xchacha20poly1305_ietf_encrypt as aead_seal
from nacl.exceptions import CryptoError
from nacl.utils import random

from diffuse.errors import DiffuseError
from diffuse.home import data_home

FORMAT, VERSION = "diffuse-history", 1
PASSPHRASE_ENV = "DIFFUSE_VAULT_PASSPHRASE"
STORE_HEADER = "x-diffuse-store"  # "false": an API request's conversation is not kept
KEYRING_SERVICE = "diffuse-history"
HEADER = "vault.json"
NONCE = 24  # XChaCha20's: long enough to draw at random for every record
PAD = 256  # plaintexts are padded to a multiple of this: a record's size tells little of its length
CHECK = b"diffuse history vault: the key is right"
# Argon2id at libsodium's "moderate" cost: a guess costs an attacker as much as an unlock costs us.
OPSLIMIT, MEMLIMIT = pwhash.argon2id.OPSLIMIT_MODERATE, pwhash.argon2id.MEMLIMIT_MODERATE
_ID = re.compile(r"[0-9a-f]{12}")


class VaultError(DiffuseError):
    """The vault cannot do what was asked (none there, locked, a wrong passphrase, no such record)."""


class Damaged(VaultError):
    """A record that does not open under the vault's key: altered, truncated or renamed."""

    def __init__(self, ident: str):
        super().__init__(f"record {ident} is damaged: it fails authentication, so it cannot be read")
        self.ident = ident


class Kdf(msgspec.Struct):
    name: Literal["argon2id"]
    opslimit: Annotated[int, Meta(ge=pwhash.argon2id.OPSLIMIT_MIN, le=16)]  # bounded: a header must not
    memlimit: Annotated[int, Meta(ge=pwhash.argon2id.MEMLIMIT_MIN, le=4 << 30)]  # make unlocking hang
    salt: Annotated[bytes, Meta(min_length=pwhash.argon2id.SALTBYTES, max_length=pwhash.argon2id.SALTBYTES)]


class Header(msgspec.Struct):
    format: Literal["diffuse-history"]
    version: int
    kdf: Kdf
    aead: Literal["xchacha20poly1305-ietf"]
    check: bytes  # nonce + CHECK sealed under the key

    def key(self, passphrase: str) -> bytes:
        """The key `passphrase` derives; VaultError where it is not this vault's."""
        key = pwhash.argon2id.kdf(32, passphrase.encode(), self.kdf.salt, opslimit=self.kdf.opslimit,
                                  memlimit=self.kdf.memlimit)
        if not self.opens(key):
            raise VaultError("wrong passphrase for the history vault: nothing was read or changed")
        return key

    def opens(self, key: bytes) -> bool:
        try:
            return aead_open(self.check[NONCE:], b"check", self.check[:NONCE], key) == CHECK
        except CryptoError:
            return False


class Record(msgspec.Struct):
    id: str
    time: float  # Unix time the answer finished
    model: str  # the model that answered
    messages: list[dict[str, Any]]  # the conversation as the chat template took it
    answers: list[str]  # one per choice

    def mentions(self, text: str) -> bool:
        wanted = text.casefold()
        return any(wanted in str(m.get("content", "")).casefold() for m in self.messages) or \
            any(wanted in a.casefold() for a in self.answers)


class Vault:
    """An unlocked vault: its directory and key (kept in memory only, never shown)."""

    def __init__(self, directory: Path, key: bytes):
        self.directory, self._key = directory, key

    def __repr__(self) -> str:
        return f"Vault({str(self.directory)!r})"

    def keep(self, messages: list[dict[str, Any]], answers: list[str], model: str) -> str:
        """Seal one finished conversation as a new record; its id."""
        ident = secrets.token_hex(6)
        while self._path(ident).exists():
            ident = secrets.token_hex(6)
        data = msgspec.json.encode(Record(ident, time.time(), model, messages, answers))
        data += b" " * (-len(data) % PAD)  # JSON ignores trailing blanks
        nonce = random(NONCE)
        _write(self._path(ident), nonce + aead_seal(data, ident.encode(), nonce, self._key))
        return ident

    def ids(self) -> list[str]:
        return sorted(p.stem for p in self.directory.glob("*.rec") if _ID.fullmatch(p.stem))

    def read(self, ident: str) -> Record:
        blob = self._existing(ident).read_bytes()
        try:
            record = msgspec.json.decode(aead_open(blob[NONCE:], ident.encode(), blob[:NONCE], self._key),
                                         type=Record)
        except (CryptoError, msgspec.DecodeError) as e:  # DecodeError: sealed by a writer of another format
            raise Damaged(ident) from e
        return record

    def records(self) -> tuple[list[Record], list[str]]:
        """Every record that opens, oldest first, and the ids of those that do not."""
        good, damaged = [], []
        for ident in self.ids():
            try:
                good.append(self.read(ident))
            except Damaged:
                damaged.append(ident)
        return sorted(good, key=lambda r: r.time), damaged

    def remove(self, ident: str) -> None:
        self._existing(ident).unlink()
        _sync(self.directory)

    def _path(self, ident: str) -> Path:
        return self.directory / f"{ident}.rec"

    def _existing(self, ident: str) -> Path:
        path = self._path(ident)
        if not _ID.fullmatch(ident) or not path.exists():
            raise VaultError(f"no record {ident!r} in the history vault (`diffuse history list` shows them)")
        return path


def directory_of(home: Path) -> Path:
    return home / "history"


def create(directory: Path, passphrase: str, opslimit: int = OPSLIMIT, memlimit: int = MEMLIMIT) -> Vault:
    """A new, empty vault in `directory`, its key derived from `passphrase`."""
    if (directory / HEADER).exists():
        raise VaultError(f"a history vault already exists in {directory} (`diffuse history wipe --yes` deletes it)")
    if not passphrase:
        raise VaultError("an empty passphrase would protect nothing")
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    directory.chmod(0o700)
    salt = random(pwhash.argon2id.SALTBYTES)
    key = pwhash.argon2id.kdf(32, passphrase.encode(), salt, opslimit=opslimit, memlimit=memlimit)
    nonce = random(NONCE)
    header = Header(FORMAT, VERSION, Kdf("argon2id", opslimit, memlimit, salt), "xchacha20poly1305-ietf",
                    nonce + aead_seal(CHECK, b"check", nonce, key))
    _write(directory / HEADER, msgspec.json.format(msgspec.json.encode(header), indent=1) + b"\n")
    return Vault(directory, key)


def header(directory: Path) -> Header:
    path = directory / HEADER
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise VaultError(f"no history vault in {directory}: `diffuse history init` creates one") from None
    damaged = f"the history vault's header {path} is damaged: no record can be opened"
    try:
        version = json.loads(raw).get("version")
    except (ValueError, AttributeError):  # not JSON, or not an object
        raise VaultError(damaged) from None
    if version != VERSION:
        raise VaultError(f"{path} is of format version {version}; this diffuse reads version {VERSION}")
    try:
        return msgspec.json.decode(raw, type=Header)
    except msgspec.DecodeError as e:  # its ValidationError names the field
        raise VaultError(f"{damaged} ({e})") from None


def unlock(directory: Path) -> Vault:
    """The vault opened with the passphrase in $DIFFUSE_VAULT_PASSPHRASE, else the key in the OS
    keyring, else a passphrase asked on the terminal; a wrong passphrase is an error."""
    head = header(directory)
    passphrase = os.environ.get(PASSPHRASE_ENV)
    if passphrase is None:
        ring = _keyring()
        kept = ring.get_password(KEYRING_SERVICE, str(directory)) if ring is not None else None
        if kept is not None and head.opens(key := bytes.fromhex(kept)):
            return Vault(directory, key)
        passphrase = _ask("passphrase of the history vault: ")
    return Vault(directory, head.key(passphrase))


def for_answers(home: Path, wanted: bool | None) -> Vault | None:
    """The vault answers are kept in: `wanted` True (`--history`), the vault at `home`, which must
    exist; None (`ask`'s default), that vault where it exists; False, none."""
    directory = directory_of(home)
    if wanted is False or (wanted is None and not (directory / HEADER).exists()):
        return None
    return unlock(directory)


def opted_out(headers: Mapping[str, str]) -> bool:
    """Whether an API request asks that its conversation not be kept (`x-diffuse-store: false`;
    OpenAI's requests can also say `store: false`)."""
    return headers.get(STORE_HEADER, "").strip().lower() == "false"


def init(directory: Path) -> str:
    """`history init`: the vault created, the key kept in the OS keyring where there is one; what to say."""
    passphrase = os.environ.get(PASSPHRASE_ENV)
    if passphrase is None:
        passphrase = _ask("new passphrase for the history vault: ")
        if _ask("the same passphrase again: ") != passphrase:
            raise VaultError("the two passphrases differ: no vault was created")
    vault = create(directory, passphrase)
    ring = _keyring()
    if ring is not None:
        ring.set_password(KEYRING_SERVICE, str(directory), vault._key.hex())
    return f"history vault created in {directory}" + (f"; its key is in the OS keyring ({ring.name})" if ring else "")


def wipe(directory: Path) -> None:
    """Delete the vault: the header first (without its salt no passphrase opens a record), then the rest."""
    header(directory)
    (directory / HEADER).unlink()
    _sync(directory)
    shutil.rmtree(directory)
    ring = _keyring()
    if ring is not None and ring.get_password(KEYRING_SERVICE, str(directory)) is not None:
        ring.delete_password(KEYRING_SERVICE, str(directory))


def command(home: str | None, action: str, arg: str | None = None, confirmed: bool = False
            ) -> tuple[list[str], list[str]]:
    """`diffuse history ACTION [ARG]` (`home`: --home): the lines to print, and why records did not open."""
    directory = directory_of(data_home(home))
    takes = {"show": "an ID", "rm": "an ID", "search": "a TEXT"}.get(action)
    if (arg is None) == bool(takes):
        raise VaultError(f"`history {action}` takes {takes}" if takes else f"`history {action}` takes no {arg!r}")
    if action == "init":
        return [init(directory)], []
    if action == "wipe":
        if not confirmed:
            raise VaultError("`history wipe` deletes every kept conversation for good: give --yes")
        wipe(directory)
        return [f"history vault in {directory} deleted"], []
    vault = unlock(directory)
    if action == "show":
        return [shown(vault.read(str(arg)))], []
    if action == "rm":
        vault.remove(str(arg))
        return [f"removed {arg}"], []
    records, damaged = vault.records()
    problems = [str(Damaged(ident)) for ident in damaged]
    if action == "export":
        return [json.dumps([msgspec.to_builtins(r) for r in records], indent=1, ensure_ascii=False)], problems
    return [_line(r) for r in records if action == "list" or r.mentions(str(arg))], problems


def shown(record: Record) -> str:
    """A record as `history show` prints it: when, which model, then every turn."""
    lines = [_line(record, gist=False)] + [f"{m.get('role', '?')}: {m.get('content', '')}" for m in record.messages]
    many = len(record.answers) > 1
    return "\n".join(lines + [f"assistant{f' (choice {i + 1})' if many else ''}: {a}"
                              for i, a in enumerate(record.answers)])


def _line(record: Record, gist: bool = True) -> str:
    """A record in one line: id, local time, model and the start of its last question."""
    asked = [str(m.get("content", "")) for m in record.messages if m.get("role") in ("user", "prompt")]
    start = " ".join((asked[-1] if asked else "").split())
    start = start if len(start) <= 60 else start[:59] + "…"
    return f"{record.id}  {time.strftime('%Y-%m-%d %H:%M', time.localtime(record.time))}  {record.model}" + \
        (f"  {start}" if gist else "")


def _keyring() -> Any:
    """The OS keyring where the optional `keyring` package is installed and finds a real backend."""
    try:
        import keyring
    except ImportError:
        return None
    backend = keyring.get_keyring()
    return backend if backend.priority > 0 else None  # the fail and null backends rank at or below 0


def _ask(prompt: str) -> str:
    if not sys.stdin.isatty():
        raise VaultError(f"the history vault is locked: set ${PASSPHRASE_ENV} (there is no terminal to ask on), "
                         "or give `ask --ephemeral`, which keeps nothing")
    return getpass.getpass(prompt)


def _write(path: Path, data: bytes) -> None:
    """`data` in `path` whole or not at all: a 0600 temporary file, synced, renamed over it."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _sync(path.parent)


def _sync(directory: Path) -> None:
    """Make a rename or unlink in `directory` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
