"""Usage credits without consensus: each member keeps its own books and ranks others by them.

Two files in the home, each written whole (a temp file, synced, then renamed) by one process: the peer
(`join`) writes `credits/earned.cbor` (receipts clients signed for it, receipts others presented,
what it served whom), the member's own client (`ask --credit`, `api --credit`) writes
`credits/spent.cbor` (what it paid whom: the peers it has seen do real work). A peer's standing
for an identity = what that identity served this member + receipts it presents from others,
counted once per distinct signer, capped per signer, and only from signers this member has seen
do real work (so Sybils that serve nothing add nothing) + a small allowance, less what this peer
served it lately (the allowance regenerates as that decays). Spec: protocols/credits.md.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import cbor2
import trio

from diffuse.control.identity import node_key, peer_id
from diffuse.control.receipts import InvalidReceipt, Signed, verify
from diffuse.home import data_home

log = logging.getLogger(__name__)
ALLOWANCE = 32768  # block-tokens a stranger may take from a peer before it is over its exposure
REGEN_PER_S = ALLOWANCE / 3600  # what a peer served someone decays at this rate: the allowance refills in an hour
SIGNER_CAP = 1 << 20  # block-tokens one signer's receipts can add to anyone's standing
MAX_HELD = 4096  # receipts a ledger keeps per list, the newest
EARNED, SPENT = "earned.cbor", "spent.cbor"
FLUSH_S = 5.0  # the peer's books reach the disk this often at most: a crash loses at most this much


def credits_dir(home: str | os.PathLike | None) -> Path:
    return data_home(home) / "credits"


def load(path: Path) -> dict:
    """A book as written by `save`; an empty one where there is none yet."""
    try:
        value = cbor2.loads(path.read_bytes())
    except FileNotFoundError:
        return {}
    except Exception as e:  # noqa: BLE001 - a damaged book is reported, not half-read
        raise InvalidReceipt(f"credits file {path} is unreadable: {e}") from None
    return value if isinstance(value, dict) else {}


def save(path: Path, value: dict) -> None:
    """Whole or not at all: readers in other processes never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".credits-", dir=path.parent)
    with os.fdopen(fd, "wb") as f:
        f.write(cbor2.dumps(value))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class Spent:
    """The client's side: what this member's questions paid each peer (the peers seen working)."""

    def __init__(self, home: str | os.PathLike | None):
        self.path = credits_dir(home) / SPENT

    def record(self, receipts: Iterable[Signed]) -> None:
        book = load(self.path)
        paid: dict[str, int] = book.setdefault("paid", {})
        for s in receipts:
            paid[s.receipt.peer] = paid.get(s.receipt.peer, 0) + s.receipt.work
        save(self.path, book)

    def paid(self) -> dict[str, int]:
        return dict(load(self.path).get("paid", {}))


class Ledger:
    """The peer's side: receipts it earned, receipts others presented, what it served whom."""

    def __init__(self, home: str | os.PathLike | None, me: str, clock: Callable[[], float] = time.time):
        self.me, self.clock = me, clock
        self.path = credits_dir(home) / EARNED
        self.spent = Spent(home)
        book = load(self.path)
        now = clock()
        self.held = _valid(book.get("held", []), now)
        self.presented = {k: _valid(v, now) for k, v in book.get("presented", {}).items()}
        self.served: dict[str, int] = dict(book.get("served", {}))
        self.used: dict[str, list[float]] = dict(book.get("used", {}))  # identity -> [level, at]
        self.seen = {(s.receipt.session, s.receipt.peer) for s in self.held} | \
            {(s.receipt.session, s.receipt.peer) for v in self.presented.values() for s in v}
        self._paid: tuple[float, dict[str, int]] = (-1.0, {})
        self.dirty = False  # changed since last written: `keep` writes it, off the event loop

    def accept(self, items: list[Any], sender: str) -> tuple[int, list[str]]:
        """Take a delivery from `sender`: receipts paying this peer, signed by the sender, and
        receipts others signed for the sender, which it presents. Returns (accepted, why each
        other one was refused); the book is written by `keep`."""
        accepted, refused = 0, []
        for item in items:
            try:
                self._take(verify(item[0], item[1], self.clock()), sender)
                accepted += 1
            except InvalidReceipt as e:
                refused.append(str(e))
        self.dirty = self.dirty or accepted > 0
        return accepted, refused

    def _take(self, s: Signed, sender: str) -> None:
        r = s.receipt
        if (r.session, r.peer) in self.seen:
            raise InvalidReceipt(f"replayed receipt (session {r.session.hex()}, peer {r.peer})")
        if r.peer == self.me and r.client == sender:
            self.held = _newest(self.held + [s])
        elif r.peer == sender and r.client != self.me:
            self.presented[sender] = _newest(self.presented.get(sender, []) + [s])
        else:
            raise InvalidReceipt("a receipt must pay this peer and be signed by its sender, or pay its sender")
        self.seen.add((r.session, r.peer))

    def took(self, identity: str, work: int) -> None:
        """This peer served `identity` `work` block-tokens (a session ended)."""
        self.served[identity] = self.served.get(identity, 0) + work
        self.used[identity] = [self._used(identity) + work, self.clock()]
        self.dirty = True

    def _used(self, identity: str) -> float:
        level, at = self.used.get(identity, (0.0, 0.0))
        return max(0.0, level - REGEN_PER_S * (self.clock() - at))

    def paid(self) -> dict[str, int]:
        """What this member's client paid each peer, reread at most once a second."""
        now = self.clock()
        if now - self._paid[0] > 1.0:
            self._paid = (now, self.spent.paid())
        return self._paid[1]

    def credit(self, identity: str) -> int:
        """What `identity` gave: work it did for this member, and its presented receipts, per
        distinct signer this member has seen work, each signer capped."""
        paid = self.paid()
        per_signer: dict[str, int] = {}
        for s in self.presented.get(identity, []):
            if s.receipt.client in paid and s.receipt.expires > self.clock():
                per_signer[s.receipt.client] = per_signer.get(s.receipt.client, 0) + s.receipt.work
        return paid.get(identity, 0) + sum(min(SIGNER_CAP, w) for w in per_signer.values())

    def standing(self, identity: str) -> float:
        """Credit plus the allowance, less what this peer served it lately: the admission order."""
        return self.credit(identity) + ALLOWANCE - self._used(identity)

    def exposed(self, identity: str) -> bool:
        """It took from this peer more than it gave anyone plus its allowance."""
        return self.standing(identity) < 0

    def _snapshot(self) -> dict:
        """The book as it is now, sharing nothing the event loop mutates later."""
        self.dirty = False
        return {"v": 1, "held": [s.wire() for s in self.held], "served": dict(self.served), "used": dict(self.used),
                "presented": {k: [s.wire() for s in v] for k, v in self.presented.items()}}

    def flush(self) -> None:
        """Write the book now if it changed (at shutdown, and in tests)."""
        if self.dirty:
            save(self.path, self._snapshot())

    async def keep(self, every: float = FLUSH_S) -> None:
        """Write the book at most every `every` s while it changes, encoding and writing in a
        worker thread: a session's close costs the event loop nothing but a mark; once more on
        the way out. Runs in the peer's nursery until cancelled."""
        try:
            while True:
                await trio.sleep(every)
                if self.dirty:
                    book = self._snapshot()
                    try:
                        await trio.to_thread.run_sync(save, self.path, book)
                    except OSError as e:  # a full disk: keep serving, try again later
                        log.warning("credits: cannot write %s: %s", self.path, e)
                        self.dirty = True
        finally:
            self.flush()

    def best(self, n: int) -> list[Signed]:
        """Receipts to present to another peer: the largest from distinct signers first."""
        ranked = sorted(self.held, key=lambda s: -s.receipt.work)
        first = {s.receipt.client: s for s in reversed(ranked)}
        rest = [s for s in ranked if first.get(s.receipt.client) is not s]
        return (sorted(first.values(), key=lambda s: -s.receipt.work) + rest)[:n]


def _valid(items: Any, now: float) -> list[Signed]:
    """Receipts from a book, rechecked; expired ones dropped."""
    out = []
    for item in items if isinstance(items, list) else []:
        try:
            out.append(verify(item[0], item[1], now))
        except (InvalidReceipt, IndexError, TypeError):
            continue
    return out


def _newest(items: list[Signed]) -> list[Signed]:
    return sorted(items, key=lambda s: s.receipt.issued)[-MAX_HELD:]


def report(home: str | os.PathLike | None, me: str) -> dict:
    """What `diffuse credits` shows: earned, spent, per-peer tabs, the allowance."""
    ledger = Ledger(home, me)
    signers: dict[str, int] = {}  # who signed what this peer holds: its clients, the work each paid
    for s in ledger.held:
        signers[s.receipt.client] = signers.get(s.receipt.client, 0) + s.receipt.work
    paid = ledger.paid()
    tabs = {i: {"served_them": ledger.served.get(i, 0), "they_served": paid.get(i, 0),
                "credit": ledger.credit(i), "standing": round(ledger.standing(i))}
            for i in sorted(set(ledger.served) | set(paid) | set(ledger.presented))}
    return {"identity": me, "earned": {"receipts": len(ledger.held), "signers": len(signers),
                                       "work": sum(s.receipt.work for s in ledger.held), "from": signers},
            "spent": {"peers": len(paid), "work": sum(paid.values())}, "tabs": tabs,
            "allowance": {"work": ALLOWANCE, "regenerates_per_hour": round(REGEN_PER_S * 3600)}}


def show(home: str | os.PathLike | None, as_json: bool) -> str:
    """`diffuse credits`: the report of this member (the identity `join` serves with) as text or JSON."""
    r = report(home, peer_id(node_key(None, home)).to_base58())
    return json.dumps(r, indent=1) if as_json else format_report(r)


def format_report(r: dict) -> str:
    e, s = r["earned"], r["spent"]
    lines = [f"identity {r['identity']}",
             f"earned: {e['receipts']} receipts from {e['signers']} distinct signers, {e['work']} block-tokens",
             f"spent:  {s['work']} block-tokens with {s['peers']} peers",
             f"allowance for strangers: {r['allowance']['work']} block-tokens, refilled hourly"]
    if r["tabs"]:
        lines.append(f"{'peer':<54} {'served them':>12} {'they served':>12} {'standing':>10}")
        lines += [f"{p:<54} {t['served_them']:>12} {t['they_served']:>12} {t['standing']:>10}"
                  for p, t in r["tabs"].items()]
    return "\n".join(lines)
