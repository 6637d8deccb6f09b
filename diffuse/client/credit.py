"""Paying peers (`ask --credit`, `api --credit`): a receipt per hop that computed for a session.

The client runs as the member's serving identity, so the peers it uses book what they served it
against the member, and its receipts build the standing of those peers (protocols/credits.md).
A session's close only computes what is owed; signing the receipts, recording them in the
member's `spent.cbor` and delivering them run in the background, each delivery bounded, so an
answer never waits for them. A peer's first delivery also presents the member's best held
receipts: the peer keeps them in its books, so the member's standing there holds until they
expire (the inference protocol's OPEN carries none).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import trio

from diffuse.client.pipeline import Pipeline
from diffuse.client.swarm import remotes_of
from diffuse.control import receipts
from diffuse.control.identity import KeyPair, peer_id
from diffuse.trust.credits import Ledger, Spent

log = logging.getLogger(__name__)
DELIVER_S = 15.0  # the most a delivery may take, the dial included: a peer that is gone is not waited for


def owed(pipeline: Pipeline) -> list[tuple[str, tuple[str, ...], int, int, int, float, bytes]]:
    """(peer, its addresses, blocks start, end, tokens, compute seconds, session id) for each
    hop of the session's route that computed committed tokens."""
    return [(h.hop.peer_id, tuple(h.hop.addrs), h.hop.start, h.hop.end, h.committed, h.compute_s, h.session_id)
            for r in remotes_of(pipeline) for h in r.hops if h.committed > 0]


class Payer:
    """Signs with the member's key and delivers from the client node's host, in `nursery`."""

    def __init__(self, key_pair: KeyPair, host: Any, home: Path, nursery: trio.Nursery):
        self.key_pair, self.host, self.home, self.nursery = key_pair, host, home, nursery
        self.me = peer_id(key_pair).to_base58()
        self.spent = Spent(home)
        self.lock = trio.Lock()  # one writer of spent.cbor in this process
        self.presented: set[str] = set()  # peers this process has shown the member's held receipts
        self.held: list[receipts.Signed] | None = None

    def pay(self, pipeline: Pipeline, model: str) -> None:
        """After a session's close: what it owes, paid in the background."""
        hops = owed(pipeline)
        if hops:
            self.nursery.start_soon(self._pay, model, hops)

    async def _pay(self, model: str, hops: Sequence[tuple]) -> None:
        signed = [(addrs, receipts.issue(self.key_pair, peer, model, a, b, tokens, seconds, sid))
                  for peer, addrs, a, b, tokens, seconds, sid in hops]
        async with self.lock:
            await trio.to_thread.run_sync(self.spent.record, [s for _, s in signed])
            if self.held is None:
                self.held = await trio.to_thread.run_sync(lambda: Ledger(self.home, self.me).best(receipts.MAX_BATCH))
        for peer in dict.fromkeys(s.receipt.peer for _, s in signed):
            mine = [s for _, s in signed if s.receipt.peer == peer]
            addrs = next(a for a, s in signed if s.receipt.peer == peer)
            if peer not in self.presented:
                self.presented.add(peer)
                mine += [s for s in self.held if s.receipt.client != peer][:receipts.MAX_BATCH - len(mine)]
            self.nursery.start_soon(self._deliver, peer, mine, list(addrs))

    async def _deliver(self, peer: str, items: list[receipts.Signed], addrs: list[str]) -> None:
        with trio.move_on_after(DELIVER_S) as scope:
            try:
                answer = await receipts.deliver(self.host, peer, items, addrs)
            except Exception as e:  # noqa: BLE001 - a peer gone or refusing: the receipt stays unpaid
                log.info("credits: receipts to %s not delivered: %s", peer, e)
                return
            refused = [r for r in answer.get("refused", []) if "replayed" not in str(r)]
            if refused:
                log.info("credits: %s refused %d receipts: %s", peer, len(refused), refused[0])
        if scope.cancelled_caught:
            log.info("credits: receipts to %s not delivered in %g s", peer, DELIVER_S)
