"""What speculation has won or lost against plain decoding in one answer, as measured.

The planner's forecast (acceptance x the step-cost fit) and the gate's windows of eight steps
both judge speculation after the fact; neither bounds what an answer loses before they act, and
an answer whose guesses are rarely right (chat without a draft head, where a copied word is a
weak guess) could lose much of its speed to trees that each cost more than the token they
add. The ledger bounds it: each tree step is charged what it took beyond what its tokens would
have cost as plain steps (negative where it won), and a tree is sent only while, even if every
guess in it is rejected, the answer's losses stay within a small share of the time plain
decoding would have taken so far (`SHARE`, plus `FLOOR` plain steps for the opening probe). A
plain step costs the ledger nothing, so holding back is always within budget, and the budget
grows with every token: speculation is probed again, later, where the forecast says it pays.

Times are whole steps as the loop sees them (drafting, the forward, verification), not the
forward alone: at a short round trip the client's work around a tree is a part of its price.
"""

from __future__ import annotations

import statistics
from collections import deque


class Ledger:
    """Seconds speculation saved (positive) or cost (negative) this answer, and whether the next
    tree may be sent. A plain step's price is the median of recent ones (one-position steps);
    until one is measured it is the caller's guess, and a ledger in the red on a guess asks for
    a plain step first (`wants_plain`), which is free: it is what plain decoding would do."""

    SHARE = 0.02  # of plain decoding's time so far that speculation may lose
    FLOOR = 1.0  # plain steps' worth it may lose before any is won (the opening probe tree)
    MEASURE = 3  # plain steps that price one, at least, while trees are losing

    def __init__(self) -> None:
        self.plain: deque[float] = deque(maxlen=8)
        self.tokens = 0  # tokens the answer's steps produced so far
        self.tree_tokens = 0
        self.tree_seconds = 0.0
        self.recent: deque[float] = deque(maxlen=4)  # seconds of the latest trees

    def price(self, guess: float | None) -> float | None:
        """Seconds of one plain step: measured, else the guess."""
        return statistics.median(self.plain) if self.plain else guess

    def observe(self, tokens: int, positions: int, seconds: float) -> None:
        self.tokens += tokens
        if positions == 1:
            self.plain.append(seconds)
        else:
            self.tree_tokens += tokens
            self.tree_seconds += seconds
            self.recent.append(seconds)

    def saved(self, plain: float) -> float:
        """What the trees so far saved: their tokens as plain steps, less what they took."""
        return self.tree_tokens * plain - self.tree_seconds

    def budget(self, plain: float) -> float:
        return plain * (self.FLOOR + self.SHARE * self.tokens)

    def wants_plain(self, guess: float | None) -> bool:
        """Whether plain's price needs measuring before the ledger is trusted: never measured
        while the trees have not clearly won (by more than the budget), or measured fewer than
        `MEASURE` times while the ledger is in the red (one slow plain step would flatter trees)."""
        if not self.tree_seconds:
            return False
        plain = self.price(guess)
        if plain is None:
            return True
        if not self.plain:
            return self.saved(plain) < self.budget(plain)
        return len(self.plain) < self.MEASURE and self.saved(plain) < 0

    def allows(self, extra: float, plain_guess: float | None) -> bool:
        """Whether a tree forecast to take `extra` seconds more than a plain step may be sent:
        its worst case (every guess rejected: one token, as a plain step gives, for `extra` more,
        or for what the latest trees took more, at their median, if that is more: a fit skewed
        by the prompt's forward can price a tree well below what it costs) must leave the
        losses within the budget."""
        plain = self.price(plain_guess)
        if plain is None:
            return True
        measured = statistics.median(self.recent) - plain if self.recent else 0.0
        return self.saved(plain) - max(0.0, extra, measured) >= -self.budget(plain)
