"""What a peer with `join --model auto` hosts: the design's ladder, and moving when the swarm changes.

The design ranks what a swarm can offer: first the smallest model servable at all, then a larger
model servable with one replica (fragile: one death stops it), then that model's second replica
(reliable: a death is a failover), and so on up the models the operator allows. The rungs are
[(smallest, 1)] + [(m, 1), (m, 2) for each larger m]. A joining peer fills the first rung not met
by the others: it takes the least-served window of that model that fits its memory budget
(placement.choose_span). Once every rung is met it strengthens the model with the fewest
replicas (the largest on ties).

Re-planning: every `replan_s` the peer asks which rung it would fill if it joined now, counting
the swarm without itself, and compares with the rung its current span fills (the replica it adds
there). It moves only to a strictly earlier rung, so two peers never swap back and forth. When a
peer leaves, every auto peer (records say `ext["placement"] = "auto"`) that could replace it sees
the gap; they take turns by peer id: the k-th looks again after (k + 0.5) x `replan_s` and moves
only if the gap is still there, so the first to move (it withdraws its record at once) is seen by
the rest. A move withdraws the record, drains open sessions, then serves the new span.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

import trio

from diffuse.control.coverage import coverage
from diffuse.control.windows import with_estimates
from diffuse.control.placement import PlacementError, choose_span

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Offer:
    """A model this peer may host: its block count, one block's weight bytes in the serving
    dtype, its whole size (the ladder's order) and its manifest's block hashes."""

    model: str
    num_blocks: int
    block_bytes: int
    total_bytes: int
    block_hashes: tuple[str, ...]


@dataclass(frozen=True)
class Choice:
    model: str
    start: int
    end: int
    rung: int  # index of the need it fills: a rung of the ladder, or len(ladder) + replicas beyond it
    why: str

    @property
    def span(self) -> tuple[str, int, int]:
        return self.model, self.start, self.end


def ladder(offers: Sequence[Offer]) -> list[tuple[str, int]]:
    """(model, replicas wanted) in the order a swarm should get them."""
    by_size = sorted(offers, key=lambda o: (o.total_bytes, o.model))
    return [(by_size[0].model, 1)] + [(o.model, k) for o in by_size[1:] for k in (1, 2)]


def rank(model: str, replicas: int, rungs: Sequence[tuple[str, int]]) -> int:
    """The rung that bringing `model`'s weakest block to `replicas` replicas fills."""
    try:
        return rungs.index((model, replicas))
    except ValueError:
        return len(rungs) + replicas


def choose(offers: Sequence[Offer], replicas: Mapping[str, Sequence[float]], budget: int) -> Choice:
    """Where a peer with `budget` bytes for weights helps most, given every offered model's
    replicas per block (not counting this peer)."""
    fitting = {o.model: o for o in offers if o.block_bytes <= budget}
    if not fitting:
        smallest = min(offers, key=lambda o: o.block_bytes)
        raise PlacementError(f"a memory budget of {budget / 2**20:.0f} MiB cannot hold one block of any allowed "
                             f"model ({smallest.model}'s take {smallest.block_bytes / 2**20:.1f} MiB)")
    rungs = ladder(list(fitting.values()))

    def take(o: Offer, why: str, rung: int) -> Choice:
        start, end = choose_span(replicas[o.model], min(o.num_blocks, budget // o.block_bytes))
        return Choice(o.model, start, end, rung, why)

    for i, (model, wanted) in enumerate(rungs):
        have = min(replicas[model])
        if have < wanted:
            what = "servable" if wanted == 1 else f"{wanted} replicas"
            return take(fitting[model], f"{model} has {have:g} replica(s) of its weakest block: rung {i + 1} of "
                                        f"the ladder makes it {what}", i)
    o = min(fitting.values(), key=lambda o: (min(replicas[o.model]), -o.total_bytes, o.model))
    have = int(min(replicas[o.model]))
    return take(o, f"every rung is met: {o.model} has the fewest replicas ({have})", rank(o.model, have + 1, rungs))


def filled(offers: Sequence[Offer], replicas: Mapping[str, Sequence[float]], budget: int, model: str,
           start: int, end: int) -> int:
    """The rung a peer serving [start, end) of `model` fills, the swarm without it being `replicas`."""
    rungs = ladder([o for o in offers if o.block_bytes <= budget])
    return rank(model, int(min(replicas[model][start:end])) + 1, rungs)


Serve = Callable[[Offer, int, int], Awaitable[None]]


AUTO = "auto"  # a record's ext["placement"] when its peer runs --model auto (it may move)


class Hosting:
    """Runs `join --model auto`: serves the first choice, then re-plans every `replan_s` seconds.
    `serve(offer, start, end)` loads and announces a span; `leave()` withdraws and drains."""

    def __init__(self, node, offers: Sequence[Offer], budget: int, serve: Serve, leave: Callable[[], Awaitable[None]],
                 replan_s: float, say: Callable[[str], None]):
        self.node, self.offers, self.budget = node, list(offers), budget
        self.by_model = {o.model: o for o in self.offers}
        self.serve, self.leave, self.replan_s, self.say = serve, leave, replan_s, say
        self.me = node.peer_id
        self.current: Choice | None = None

    async def _records(self) -> dict[str, list]:
        for o in self.offers:
            self.node.num_blocks[o.model] = o.num_blocks  # which window keys hold each model
        return {o.model: await self.node.records(o.model) for o in self.offers}

    def _replicas(self, records: Mapping[str, list], without: str) -> dict[str, list[float]]:
        return {o.model: [float(round(c)) for c in with_estimates(
                    coverage([r for r in records[o.model] if r.peer_id != without], o.model, o.num_blocks,
                             expected_hashes=o.block_hashes), self.node.samples.get(o.model, {})).counts]
                for o in self.offers}

    async def better(self) -> tuple[Choice, int] | None:
        """A choice that fills an earlier rung than the current span does, if there is one, and
        how many other auto peers that could fill it as well come before this one (by peer id)."""
        records = await self._records()
        reps = self._replicas(records, self.me)
        new = choose(self.offers, reps, self.budget)
        if self.current is None:
            return new, 0
        if new.rung >= filled(self.offers, reps, self.budget, *self.current.span) or new.span == self.current.span:
            return None
        ahead = sum(1 for model, found in records.items() for r in found
                    if r.peer_id < self.me and r.extra.get("placement") == AUTO and r.online
                    and filled(self.offers, self._replicas(records, r.peer_id), 1 << 62, model, r.start, r.end)
                    > new.rung)
        return new, ahead

    async def run(self, task_status: trio.TaskStatus[Choice] = trio.TASK_STATUS_IGNORED) -> None:
        first, _ = await self.better()
        await self._take(first)
        task_status.started(first)
        while True:
            await trio.sleep(self.replan_s)
            found = await self.better()
            if found is None:
                continue
            # Every auto peer that could fill the gap sees it; the one with the lowest id moves
            # first, each next one looks again a period later and sees those that moved.
            await trio.sleep(self.replan_s * (0.5 + found[1]))
            found = await self.better()
            if found is None:
                continue
            new, old = found[0], self.current
            self.say(f"re-planning: {new.why}; leaving {old.model} blocks {old.start}:{old.end} "
                     "once its sessions have drained")
            await self.leave()
            await self._take(new)

    async def _take(self, choice: Choice) -> None:
        await self.serve(self.by_model[choice.model], choice.start, choice.end)
        self.current = choice
        self.say(f"chose {choice.model} blocks {choice.start}:{choice.end}: {choice.why}")
