"""Speculative decoding without a draft model: several tokens per network round trip.

Over the network a step costs a round trip however many positions it carries, so each step
sends, with the token just sampled (the root), a tree of guesses for the tokens after it, and
keeps the longest path the model agrees with. The guesses need no draft model: they are copied
from earlier text (prompt lookup: what followed earlier occurrences of the last few tokens) or
taken from an n-gram pool of the model's own outputs, fed by every verification pass and by a
Jacobi lookahead branch (Fu et al. 2024) riding along when positions are cheap; a client that
trained a draft head (draft_head.py, a few million numbers on its last hidden state) adds its
guesses too. Acceptance keeps the output exactly that of plain decoding: under greedy the path
of argmaxes, under sampling the speculative rejection rule (Leviathan et al. / Chen et al.). A
planner sizes each step's tree from the measured step cost and the observed acceptance, down to
one token when guessing does not pay (as on a local CPU, where a wider step costs more than its
extra tokens gain); a ledger (spec_ledger.py) sends a tree only while the answer can afford its
worst case, and a gate holds speculation off for a while whenever its steps, as measured, yield
fewer tokens per second than plain ones: a generation is never much slower than plain decoding,
and speculates again where the text starts to repeat.
"""

from __future__ import annotations

import functools
import itertools
import random
import statistics
import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Iterator, Sequence

import torch
from torch import Tensor

from diffuse.client.draft_head import DraftHead
from diffuse.client.pipeline import Pipeline, showable
from diffuse.client.sampling import Sampler
from diffuse.client.spec_ledger import Ledger
from diffuse.errors import Rewind
from diffuse.model.kernels import padded_rows
from diffuse.model.engine import Head


TREE, PLAIN, HELD = "tree", "plain", "held"  # a step's mode: guesses sent; plain by forecast; plain by the gate


@dataclass
class SpecStats:
    """Per verification step: tokens it produced (accepted guesses + the model's own next
    token), positions it sent, the seconds its forward took and its mode (TREE, PLAIN, HELD)."""

    tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    modes: list[str] = field(default_factory=list)

    def add(self, tokens: int, positions: int, seconds: float, mode: str) -> None:
        self.tokens.append(tokens)
        self.positions.append(positions)
        self.seconds.append(seconds)
        self.modes.append(mode)

    @property
    def steps(self) -> int:
        return len(self.tokens)

    @property
    def tokens_per_step(self) -> float:
        return sum(self.tokens) / max(1, len(self.tokens))


@dataclass(frozen=True)
class SpecConfig:
    """How to speculate; what changes while speculating is in SpecState.

    max_nodes caps the guesses per step; the planner usually sends far fewer. The lookahead
    branch is `width` columns x `levels` Jacobi iterations (n-grams of levels + 1 tokens): on
    SmolLM2, chat and code, (5, 2) lifted tokens per step from 1.13 to 1.35 with 10 positions,
    (7, 4) to 1.33 with 28 and (15, 4) to 1.42 with 60.
    """

    max_nodes: int = 64
    max_depth: int = 8
    ngram: int = 3  # longest suffix prompt lookup matches
    matches: int = 8  # prompt-lookup continuations merged per step
    pool_per_key: int = 8  # n-grams the pool keeps per first token
    width: int = 5
    levels: int = 2
    lookahead_gain: float = 0.2  # tokens per step such a window added on chat and code (measured)
    probe_nodes: int = 7  # guesses per step while the step-cost slope is still unknown
    draft: DraftHead | None = None  # a trained draft head (draft_head.py), if the client has one
    draft_nodes: int = 24  # its likeliest guesses offered to the planner per step
    draft_depth: int = 5  # its levels per step (each a read of all its weights; copies reach deeper)
    seed: int = 0

    @property
    def lookahead_positions(self) -> int:
        return self.width * self.levels


@dataclass
class SpecState:
    """What speculation learns and counts as it runs: the step-cost fit, which the answers of one
    route may share (reusing it keeps the fit warm), per-step stats (appended to), and how the
    draft head's first guesses fared (to drop a fetched head that guesses poorly)."""

    cost: "StepCost" = field(default_factory=lambda: StepCost())
    stats: SpecStats = field(default_factory=SpecStats)
    draft_hits: int = 0
    draft_trials: int = 0

    def draft_is_poor(self, trials: int = 64, rate: float = 0.1) -> bool:
        """Whether, over at least `trials` scored first guesses, the draft head was right less
        often than `rate` (prompt lookup alone does better on chat)."""
        return self.draft_trials >= trials and self.draft_hits < rate * self.draft_trials


def kv_headroom(config: SpecConfig | None = None) -> int:
    """KV-cache slots a session needs beyond len(prompt) + max_tokens: the widest step."""
    cfg = config or SpecConfig()
    return cfg.max_nodes + cfg.lookahead_positions


# ---- the tree a step sends -------------------------------------------------------------------

def tree_inputs(tokens: Sequence[int], parents: Sequence[int], base: int) -> tuple[Tensor, Tensor, Tensor]:
    """ids [1, T], positions [T] and tree mask [T, T] for a tree in parent-first order.

    Node 0 is the root (parent -1) at position `base`; a node sits one position past its parent
    and sees exactly its ancestors and itself, so its logits equal those of its own branch.
    """
    t = len(tokens)
    mask = torch.zeros(t, t, dtype=torch.bool)
    depth = [0] * t
    for i, p in enumerate(parents):
        if i and not 0 <= p < i:
            raise ValueError(f"node {i} has parent {p}: parents must come first")
        if i:
            mask[i] = mask[p]
            depth[i] = depth[p] + 1
        mask[i, i] = True
    return torch.tensor([list(tokens)]), base + torch.tensor(depth), mask


def children_of(parents: Sequence[int]) -> list[list[int]]:
    kids: list[list[int]] = [[] for _ in parents]
    for i, p in enumerate(parents[1:], 1):
        kids[p].append(i)
    return kids


def verify(tokens: Sequence[int], parents: Sequence[int], logits: Tensor, sampler: Sampler,
           context: Sequence[int], max_depth: int) -> tuple[list[int], int]:
    """Walk the verified tree from its root: (accepted node indices, the next token after them).

    A child is accepted when its token is the one the sampler draws at its parent: under greedy
    the model's choice; sampling, the seeded draw for that index (client/sampling.py), which
    equals a guess x with probability p(x), so every token is distributed exactly as plain
    sampling would draw it and, for a seed, is the token plain sampling would draw. `context`
    ends with the root; logits are [T, V]. Every token chosen is `take`n in order, so a
    constraint rejects the guesses it forbids and moves on with those accepted.
    """
    kids = children_of(parents)
    ctx = list(context)
    path: list[int] = []
    node = 0
    while True:
        options = kids[node] if len(path) < max_depth else []
        target = sampler.sample(logits[node], torch.tensor(ctx))
        chosen = next((c for c in options if tokens[c] == target), None)
        sampler.take(logits[node], target)
        if chosen is None:
            return path, target
        path.append(chosen)
        ctx.append(target)
        node = chosen


# ---- where guesses come from -----------------------------------------------------------------

class Draft:
    """Guessed continuations of the root merged into a prefix tree (node 0 is the root).

    Each node remembers its kind (source, depth, rank among its siblings): acceptance is
    learned per kind, since a 3-token prompt match deep in a copied passage is a far safer bet
    than the third-best pool n-gram. `allowed` (how many leading tokens of a guess an output
    constraint allows after the root) cuts guesses short, so no position is spent on a token
    verification would reject.
    """

    def __init__(self, root: int, max_nodes: int, max_depth: int,
                 allowed: Callable[[Sequence[int]], int] | None = None):
        self.max_nodes, self.max_depth, self.allowed = max_nodes, max_depth, allowed
        self.tokens, self.parents = [root], [-1]
        self.kinds: list[tuple[str, int, int]] = [("root", 0, 0)]
        self.children: list[dict[int, int]] = [{}]

    @property
    def full(self) -> bool:
        return len(self.tokens) > self.max_nodes

    def add(self, guess: Sequence[int], source: str) -> None:
        node, depth = 0, 0
        guess = guess[:self.max_depth]
        for tok in guess[:self.allowed(guess)] if self.allowed else guess:
            depth += 1
            child = self.children[node].get(tok)
            if child is None:
                if self.full:
                    return
                child = len(self.tokens)
                kind = (source, min(depth, 4), min(len(self.children[node]), 1))
                self.children[node][tok] = child
                self.tokens.append(tok)
                self.parents.append(node)
                self.kinds.append(kind)
                self.children.append({})
            node = child


class PromptLookup:
    """Every n-gram (n <= max_n) of the text so far, mapped to where its occurrences end."""

    def __init__(self, max_n: int):
        self.max_n, self.text = max_n, []
        self.ends: dict[tuple[int, ...], list[int]] = {}

    def extend(self, tokens: Sequence[int]) -> None:
        for tok in tokens:
            self.text.append(tok)
            end = len(self.text)
            for n in range(1, min(self.max_n, end) + 1):
                self.ends.setdefault(tuple(self.text[end - n:]), []).append(end)

    def continuations(self, depth: int, reach: int = 16) -> Iterator[tuple[int, list[int]]]:
        """(match, what followed) for each earlier occurrence of the text's suffix, once: those of
        the longest suffix first, most recent first. `match` counts the tokens before the
        occurrence that agree with the text's end, up to `reach`: a copy twelve tokens into a
        quoted passage is a far safer bet than one that matched a common word."""
        end, seen = len(self.text), set()
        for n in range(min(self.max_n, end), 0, -1):
            for e in reversed(self.ends.get(tuple(self.text[end - n:]), [])):
                if e < end and e not in seen:
                    seen.add(e)
                    k = n
                    while k < min(reach, e) and self.text[e - 1 - k] == self.text[end - 1 - k]:
                        k += 1
                    yield k, self.text[e:e + depth]


class NGramPool:
    """n-grams the model produced, by first token, most recent kept (lookahead decoding's pool)."""

    def __init__(self, per_key: int):
        self.per_key = per_key
        self.table: dict[int, OrderedDict[tuple[int, ...], None]] = {}

    def add(self, gram: Sequence[int]) -> None:
        conts = self.table.setdefault(gram[0], OrderedDict())
        conts[tuple(gram[1:])] = None
        conts.move_to_end(tuple(gram[1:]))
        if len(conts) > self.per_key:
            conts.popitem(last=False)

    def get(self, key: int) -> list[tuple[int, ...]]:
        return list(reversed(self.table.get(key, {})))


class Lookahead:
    """A Jacobi window: `levels` rows of `width` guesses for the positions after the root.

    Row l, column j sits at depth 1 + l + j; it sees row 0 up to column j and rows 1..l of
    column j, so each column is an n-gram whose last token the model predicts afresh. After a
    step the rows shift down and the predictions become the top row: one Jacobi iteration.
    The window stays relative to the root, as in lookahead decoding, although the root moves.
    """

    def __init__(self, width: int, levels: int, context: Sequence[int], seed: int):
        rng = random.Random(seed)
        self.width = width
        self.rows = [[rng.choice(context) for _ in range(width)] for _ in range(levels)]

    def tree(self, base: int) -> tuple[list[int], list[int]]:
        """Tokens and parents of the window as a branch of the root, its nodes from index base."""
        tokens, parents = [], []
        for level, row in enumerate(self.rows):
            for j, tok in enumerate(row):
                tokens.append(tok)
                parents.append(base + (level - 1) * self.width + j if level else (base + j - 1 if j else 0))
        return tokens, parents

    def advance(self, predictions: list[int]) -> None:
        self.rows = self.rows[1:] + [predictions]


# ---- choosing the tree size ------------------------------------------------------------------

@dataclass
class Cost:
    """Seconds per step: `plain` for one position, a + b * T for T >= 2. One position is its
    own case because a single-row matmul takes a faster kernel path: one position costs well
    below the line through wider steps, which rises only slowly from two positions on
    (figures: docs/measurements.md, 'Figures once quoted in module comments')."""

    plain: float
    a: float
    b: float

    def __call__(self, positions: int) -> float:
        return self.plain if positions == 1 else self.a + self.b * positions


class StepCost:
    """Step cost learned from the steps of this route, least squares over recent ones.

    The intercept holds the round trip and fixed per-step work, the slope the price of one more
    position; both come from timing real steps, so the same planner suits a CPU next door and a
    GPU across an ocean. One-position and wider steps are kept apart, so a long run of plain
    steps does not forget the slope (and force a probe to relearn it).
    """

    def __init__(self, window: int = 32):
        self.obs: deque[tuple[int, float]] = deque(maxlen=window)  # wider steps
        self.plain: deque[float] = deque(maxlen=window // 2)  # one-position steps

    def observe(self, positions: int, seconds: float) -> None:
        if positions == 1:
            self.plain.append(seconds)
        else:
            self.obs.append((positions, seconds))

    def charged(self, positions: int, seconds: float) -> float:
        """What a step of `positions` rows is taken to have cost: what it measured (a cost model
        fixed to another network's curve says what that network would have charged)."""
        return seconds

    def fit(self) -> Cost | None:
        """None while recent wide steps all had one size, so that the slope is unknown."""
        wide = list(self.obs)
        if len({t for t, _ in wide}) < 2:
            return None
        mt = sum(t for t, _ in wide) / len(wide)
        ms = sum(s for _, s in wide) / len(wide)
        var = sum((t - mt) ** 2 for t, _ in wide)
        b = max(0.0, sum((t - mt) * (s - ms) for t, s in wide) / var)
        a = max(ms - b * mt, 1e-6)
        return Cost(sum(self.plain) / len(self.plain) if self.plain else a + b, a, b)


class Gate:
    """Speculation must beat plain decoding as measured, not only as forecast.

    The forecast (acceptance x cost fit) can be wrong: a fit skewed by a noisy step, acceptance
    priors that flatter a topic. So every `every` speculative steps the tokens per second of the
    last `window` of them, as measured, are compared with plain steps' (the median of recent
    ones, else the fit's one-position cost): if lower, speculation is held off for `hold` steps, a
    hold that doubles up to `most` each time it fails again and resets once it pays; after a hold
    a new window is measured. Held steps are plain, and acceptance is still learned in hindsight
    from every draft, so speculation resumes, after the hold, where the text starts to repeat.

    Eight steps, not four: windows of four held speculation off too often where trees paid
    (figures: docs/measurements.md, 'Figures once quoted in module comments'). With a first
    guess right ~40% of the time, four steps with every guess rejected come once in ~8 windows
    (0.6^4), eight once in ~60 (0.6^8).

    A generation does not open with a plain step to price one: that step would add one token
    where a tree adds two or more, and where speculation pays clearly no plain step is ever
    needed. Until one is measured, plain is taken to cost the fit's a + b, which a one-position
    step may beat or miss (its own kernel path; a slope skewed by the prompt's forward): holding
    on that guess alone holds steps that a measured plain step would not. So a window within a
    factor UNSURE of the guess, either way, buys one plain step to measure it, and is judged
    again at the next comparison.
    """

    UNSURE = 1.25  # a window's rate / the guessed plain rate that a guess's error cannot flip

    def __init__(self, window: int = 8, every: int = 4, hold: int = 4, most: int = 64):
        self.trees: deque[tuple[int, float]] = deque(maxlen=window)
        self.every, self.since = every, 0  # speculative steps since the last comparison
        self.plain: deque[float] = deque(maxlen=8)
        self.base = self.hold = hold
        self.most = most
        self.held = 0  # plain steps left before speculation may be tried again

    @property
    def open(self) -> bool:
        return self.held == 0

    def observe(self, tokens: int, positions: int, seconds: float, plain_guess: float | None) -> None:
        if positions == 1:
            self.plain.append(seconds)
            self.held = max(0, self.held - 1)
            return
        self.trees.append((tokens, seconds))
        self.since += 1
        plain = statistics.median(self.plain) if self.plain else plain_guess
        if len(self.trees) < (self.trees.maxlen or 1) or self.since < self.every or not plain:
            return
        self.since = 0
        rate = sum(t for t, _ in self.trees) / sum(s for _, s in self.trees)
        if not self.plain and 1 / self.UNSURE < rate * plain < self.UNSURE:
            self.held = 1  # one plain step: a guessed plain cost is too close to call either way
        elif rate < 1.0 / plain:
            self.held, self.hold = self.hold, min(2 * self.hold, self.most)
            self.trees.clear()
        else:
            self.hold = self.base


class Acceptance:
    """P(a guess is accepted | its parent was), per kind of guess, learned in hindsight.

    Every drafted node is scored against the tokens that really followed, whether or not the
    planner sent it, so the estimates keep improving while speculation is switched off.
    """

    PRIOR_WEIGHT = 2.0

    def __init__(self, priors: dict[str, float] | None = None) -> None:
        self.hits: Counter = Counter()
        self.trials: Counter = Counter()
        self.priors = priors or {}  # per source, e.g. a draft head's measured hit rate per confidence band

    def rate(self, kind: tuple[str, int, int]) -> float:
        source, depth, rank = kind
        prior = self.priors[source] if source in self.priors else _prior(source, depth, rank)
        return (self.hits[kind] + self.PRIOR_WEIGHT * prior) / (self.trials[kind] + self.PRIOR_WEIGHT)

    def scores(self, draft: Draft) -> list[float]:
        """P(node accepted) for every node (root: 1); a child scores below its parent."""
        s = [1.0]
        for kind, p in zip(draft.kinds[1:], draft.parents[1:]):
            s.append(s[p] * self.rate(kind))
        return s

    def learn(self, draft: Draft, realised: Sequence[int]) -> None:
        node = 0
        for tok in realised:
            for t, child in draft.children[node].items():
                self.trials[draft.kinds[child]] += 1
                self.hits[draft.kinds[child]] += t == tok
            if tok not in draft.children[node]:
                return
            node = draft.children[node][tok]


# Prompt lookup's P(accepted | parent accepted) by how far back its match reaches (at least 1, 2,
# 4, 8, 16 tokens): (the first guess after the root, a deeper first child, a sibling of another
# guess), measured along the model's answers to the draft head's last training requests
# (scripts/eval_draft_head.py --requests --per-class 80 --sent 10 --cost 0.14 0.0025 --rates).
COPY_PRIORS = {1: (0.1, 0.7, 0.1), 2: (0.68, 0.82, 0.15), 4: (0.77, 0.88, 0.3), 8: (0.9, 0.92, 0.5),
               16: (0.97, 0.97, 0.7)}


_COPY_SOURCES = {f"copy{b}": priors for b, priors in COPY_PRIORS.items()}


def copy_source(match: int) -> str:
    """The source name of a copy whose match reaches `match` tokens back: copy1 ... copy16."""
    return f"copy{max(b for b in COPY_PRIORS if match >= b)}"


def _prior(source: str, depth: int, rank: int) -> float:
    """P(accepted | parent accepted) before a generation has seen any, by kind of guess. A copy
    whose first token was accepted goes on being accepted, the more surely the further back its
    match reached (COPY_PRIORS; a generic 0.5 had priced a grounded answer's copies at half, so
    it sent short ones until it had relearnt that), a copy beside another guess far less often;
    the first token of a copy that matched one common token is rarely right (0.05 measured), of
    one sixteen tokens into a quoted passage nearly always (0.99)."""
    if source in _COPY_SOURCES:
        first, deeper, sibling = _COPY_SOURCES[source]
        return sibling if rank else first if depth == 1 else deeper
    return (0.25 if depth == 1 else 0.5) * (0.5 if rank else 1.0)


def best_size(scores: Sequence[float], cost: Cost, exact: bool = False) -> int:
    """How many of the best guesses (sorted by P(accepted)) maximise expected tokens per second:
    a step yields 1 + the sum of its guesses' P(accepted) tokens; 0 means plain decoding. A
    step is priced at the rows its products really compute (kernels.padded_rows; in an exact
    session a plain step computes sixteen)."""
    best, best_rate, gain = 0, 1.0 / cost(padded_rows(1, exact)), 1.0
    for n, s in enumerate(scores, 1):
        gain += s
        rate = gain / cost(padded_rows(1 + n, exact))
        if rate > best_rate:
            best, best_rate = n, rate
    return best


# ---- the loop --------------------------------------------------------------------------------

@dataclass
class StepTree:
    """The tree of tokens one verification step sends, in parent-first order."""

    tokens: list[int]
    parents: list[int]
    lookahead: bool  # whether the Jacobi window rides at the end
    mode: str = TREE  # TREE, or PLAIN / HELD for the root alone


class Speculator:
    """Guessing, planning and learning state of one generation; the loop only does I/O."""

    def __init__(self, cfg: SpecConfig, state: SpecState, prompt: Sequence[int], head: Head | None = None,
                 exact: bool = False, allowed: Callable[[Sequence[int]], int] | None = None):
        self.cfg, self.head, self.state = cfg, head, state
        self.allowed = allowed  # what an output constraint allows of a guess (Draft)
        self.exact = exact  # the session's kernels pad every product to EXACT_FORMS' rows
        self.z: Tensor | None = None  # final hidden state (pre-norm) of the position that produced the root
        self.lookup = PromptLookup(cfg.ngram)
        self.lookup.extend(prompt)
        self.pool = NGramPool(cfg.pool_per_key)
        self.window = Lookahead(cfg.width, cfg.levels, prompt, cfg.seed) if cfg.levels and cfg.width else None
        self.acceptance = Acceptance(cfg.draft.priors() if cfg.draft is not None else None)
        self.cost = state.cost
        self.gate = Gate()
        self.ledger = Ledger()
        self.held = 0  # steps held plain so far (the draft head drafts on every fourth)
        self.waiting: deque[tuple[Draft, int]] = deque()  # drafts to score once their future is known

    @property
    def text(self) -> list[int]:
        return self.lookup.text

    def push(self, tokens: Sequence[int]) -> None:
        """Append generated tokens; score drafts whose continuation is now known."""
        self.lookup.extend(tokens)
        while self.waiting and len(self.text) - self.waiting[0][1] > self.cfg.max_depth:
            draft, root_at = self.waiting.popleft()
            realised = self.text[root_at + 1:]
            first = next(iter(draft.children[0].items()), None)
            if first is not None and draft.kinds[first[1]][0].startswith("draft"):
                self.state.draft_trials += 1
                self.state.draft_hits += first[0] == realised[0]
            self.acceptance.learn(draft, realised)

    def rewind(self, text: Sequence[int]) -> None:
        """Back to `text` (a check behind the generation failed): the lookup forgets what came
        after it and drafts waiting to be scored go; the draft head waits for the next step's
        hidden state. The pool and the window keep what they learnt: guesses, never answers."""
        self.lookup = PromptLookup(self.cfg.ngram)
        self.lookup.extend(text)
        self.waiting.clear()
        self.z = None

    def draft(self, max_depth: int, fit: Cost | None = None, head: bool = True) -> Draft:
        cfg = self.cfg
        draft = Draft(self.text[-1], cfg.max_nodes, max_depth, self.allowed)
        copies = sorted(itertools.islice(self.lookup.continuations(max_depth), cfg.matches), key=lambda c: -c[0])
        for match, cont in copies:  # the longest match first; one of two tokens or more outranks the head
            if match > 1:
                draft.add(cont, copy_source(match))
        if head and cfg.draft is not None and self.head is not None and self.z is not None and max_depth:
            # A guess is worth a position only if its chance beats one position's share of a
            # plain step (tokens per second can only fall otherwise): deeper levels stop there.
            floor = fit.b / fit(padded_rows(1, self.exact)) if fit is not None else 0.0
            depth = min(max_depth, cfg.draft_depth)
            for guess, source in cfg.draft.propose(self.head, self.z, self.text[-1], depth, cfg.draft_nodes,
                                                   floor=floor):
                draft.add(guess, source)
        for match, cont in copies:
            if match == 1:
                draft.add(cont, copy_source(match))
        for cont in self.pool.get(self.text[-1]):
            draft.add(cont, "pool")
        self.waiting.append((draft, len(self.text) - 1))
        return draft

    def plan(self, max_depth: int, company: int = 1) -> StepTree:
        """This step's tree: the guesses worth their positions, plus the lookahead window when
        the tokens it is expected to add (through the pool, later) are worth its positions, and
        then the next-best guesses in the rows the kernels would pad with zeros anyway. The root
        alone while the gate holds speculation off, or the ledger (spec_ledger.py) cannot afford
        the tree's worst case. Until the cost's slope is known (the prompt's forward is one
        size), a step sends `probe_nodes`.

        `company`: sessions batched with this one. A position then costs each of them what it
        costs this session, so it is priced `company` times its fitted slope: a session's own
        timing sees only its own rows' share, and sessions that each judged positions cheap
        filled the batches until all of them together were slower with a draft head than
        without one (figures: docs/measurements.md, 'Figures once quoted in module comments')."""
        fit = self.cost.fit()
        if fit is not None and company > 1:
            fit = Cost(fit.plain, fit.a, fit.b * company)
        pad = functools.partial(padded_rows, exact=self.exact)
        guess = fit.plain if fit is not None else None
        smallest = fit is not None and self.ledger.tree_seconds and not self.ledger.allows(fit(pad(2)) - fit(pad(1)),
                                                                                            guess)
        if not self.gate.open or self.ledger.wants_plain(guess) or smallest:  # no tree is affordable
            return self._hold(max_depth, fit, drafted=False)
        draft = self.draft(max_depth, fit)
        scores = self.acceptance.scores(draft)
        ranked = sorted(range(1, len(scores)), key=lambda i: (-scores[i], draft.kinds[i][1], i))
        sized = self._size([scores[i] for i in ranked], fit, max_depth)
        if sized is None:  # the ledger cannot afford the tree's worst case
            return self._hold(max_depth, fit, drafted=True)
        n, lookahead = sized
        sent = [0] + ranked[:n]  # parents rank above children, so they come first
        index = {node: i for i, node in enumerate(sent)}
        tokens = [draft.tokens[i] for i in sent]
        parents = [-1] + [index[draft.parents[i]] for i in sent[1:]]
        if lookahead:
            more, more_parents = self.window.tree(len(tokens))
            tokens, parents = tokens + more, parents + more_parents
        return StepTree(tokens, parents, lookahead, TREE if len(tokens) > 1 else PLAIN)

    def _size(self, scores: list[float], fit: Cost | None, max_depth: int) -> tuple[int, bool] | None:
        """(guesses to send, whether the lookahead window rides along) for guesses whose
        P(accepted) are `scores`, best first; None when the ledger cannot afford the tree."""
        if fit is None:
            return min(len(scores), self.cfg.probe_nodes), False
        pad = functools.partial(padded_rows, exact=self.exact)
        n = best_size(scores, fit, self.exact)
        gain = 1 + sum(scores[:n])
        wide = fit(pad(1 + n + self.cfg.lookahead_positions))
        lookahead = (self.window is not None and max_depth > 0
                     and (gain + self.cfg.lookahead_gain) / wide > gain / fit(pad(1 + n)))
        total = 1 + n + (self.cfg.lookahead_positions if lookahead else 0)
        if lookahead and not self.ledger.allows(fit(pad(total)) - fit(pad(1)), fit.plain):
            lookahead, total = False, 1 + n  # the ledger affords the guesses alone, maybe
        if n and not self.ledger.allows(fit(pad(total)) - fit(pad(1)), fit.plain):
            return None
        return min(len(scores), n + pad(total) - total), lookahead

    def _hold(self, max_depth: int, fit: Cost | None, drafted: bool) -> StepTree:
        """The root alone, held plain by the gate or the ledger. Drafting still runs, to keep
        learning, but the draft head only every fourth held step: its levels cost client time,
        which a held step is meant not to spend."""
        self.held += 1
        if not drafted:
            self.draft(max_depth, fit, head=self.held % 4 == 1)
        return StepTree([self.text[-1]], [-1], False, HELD)

    def learn(self, step: StepTree, predictions: list[int], tokens: int, seconds: float,
              wall: float | None = None) -> None:
        """Time the step (cost fit by its forward's `seconds`; gate and ledger by its `wall`
        time, the client's drafting and verification included), feed the pool with the model's
        prediction at every node (after the last levels tokens of that node's branch) and
        advance the Jacobi window."""
        positions = len(step.tokens)
        self.cost.observe(padded_rows(positions, self.exact), seconds)
        fit = self.cost.fit()
        charged = self.cost.charged(padded_rows(positions, self.exact), seconds) + max(0.0, (wall or 0.0) - seconds)
        self.gate.observe(tokens, positions, charged, fit.plain if fit is not None else None)
        self.ledger.observe(tokens, positions, charged)
        n = self.cfg.levels
        for i in range(len(step.tokens)):
            gram, j = [predictions[i]], i
            while j >= 0 and len(gram) <= n:
                gram.append(step.tokens[j])
                j = step.parents[j]
            if len(gram) <= n:
                gram += reversed(self.text[-1 - (n + 1 - len(gram)):-1])
            self.pool.add(gram[::-1])
        if step.lookahead:
            self.window.advance(predictions[-self.cfg.width:])


async def speculative_tokens(pipeline: Pipeline, prompt: list[int], sampler: Sampler, eos_ids: set[int],
                             config: SpecConfig | None = None, state: SpecState | None = None) -> AsyncIterator[int]:
    """stream_tokens with several tokens per forward: same contract, same output under greedy,
    same distribution under sampling. Per-step numbers go to state.stats.

    Checks run behind the generation here too (the trust plane audits the kept path of each
    tree): a token is shown once no pending check can take back the step that produced it, and
    a Rewind recomputes everything after a caught step.

    At the end pipeline.length <= len(prompt) + tokens yielded: the cache holds a prefix of
    prompt + output (the last token may not have been fed). Needs kv_headroom(config) slots
    beyond len(prompt) + max_tokens.
    """
    cfg, state = config or SpecConfig(), state or SpecState()
    spec = Speculator(cfg, state, prompt, pipeline.head, pipeline.exact,
                      sampler.allowed if sampler.p.constraint is not None else None)
    pipeline.defer_checks()
    tokens = list(prompt)  # then each token taken; the last one (the next step's root) is not in the cache yet
    shown, done = len(prompt), sampler.p.max_tokens <= 0
    while True:
        try:
            if not done:
                left = sampler.p.max_tokens - (len(tokens) - len(prompt))  # tokens the answer may still take
                new = await (_prefill(pipeline, tokens, sampler, spec) if len(tokens) == len(prompt)
                             else _step(pipeline, sampler, spec, eos_ids, left))
                ended = len(new) and new[-1] in eos_ids  # an end of turn ends the answer, unshown
                new = new[:next((k for k, tok in enumerate(new) if tok in eos_ids), len(new))]
                tokens += new
                spec.push(new)
                done = bool(ended) or len(tokens) - len(prompt) >= sampler.p.max_tokens or sampler.stopped
            if done:
                await pipeline.settle()
        except Rewind as r:  # a peer was caught: what followed its bad step is recomputed
            del tokens[max(r.length + 1, len(prompt)):]
            sampler.rewind(len(tokens) - len(prompt))
            spec.rewind(tokens)
            done = False
            continue
        for token in tokens[shown:showable(pipeline, len(tokens), done)]:
            yield token
            shown += 1
        if done:
            return


async def _prefill(pipeline: Pipeline, tokens: list[int], sampler: Sampler, spec: Speculator) -> list[int]:
    """The prompt (or what a rewind left of it uncached) in one forward: [the first token]."""
    t0 = time.perf_counter()
    fed = len(tokens) - pipeline.length
    logits = (await pipeline.forward(torch.tensor([tokens[pipeline.length:]]), rows=slice(-1, None)))[0, -1]
    spec.z = _hidden(pipeline, -1)
    spec.cost.observe(padded_rows(fed, spec.exact), time.perf_counter() - t0)
    root = sampler.sample(logits, torch.tensor(tokens))
    sampler.take(logits, root)
    return [root]


async def _step(pipeline: Pipeline, sampler: Sampler, spec: Speculator, eos_ids: set[int], left: int) -> list[int]:
    """One round trip from the root (the last token, not cached yet), with `left` tokens to go:
    the tree the planner chose, verified, its kept path committed. The tokens it adds: the
    accepted guesses and the next root, up to the first end of turn."""
    started = time.perf_counter()
    depth = min(spec.cfg.max_depth, left - 1)
    step = spec.plan(depth, pipeline.company)
    ids, positions, mask = tree_inputs(step.tokens, step.parents, pipeline.length)
    if len(step.tokens) == 1:  # a plain step: the causal path plain decoding takes, the same bits
        mask = None
    t0 = time.perf_counter()
    logits = (await pipeline.forward(ids, positions, mask, commit=False))[0]
    seconds = time.perf_counter() - t0
    path, root = verify(step.tokens, step.parents, logits, sampler, spec.text, depth)
    spec.z = _hidden(pipeline, path[-1] if path else 0)
    guesses = [step.tokens[i] for i in path]
    cut = next((k for k, tok in enumerate(guesses) if tok in eos_ids), len(guesses))
    await pipeline.commit([0] + path[:cut])
    produced = min(len(path), cut + 1) + (cut == len(guesses))  # an eos ends the step
    spec.learn(step, logits.argmax(-1).tolist(), produced, seconds, time.perf_counter() - started)
    spec.state.stats.add(produced, len(step.tokens), seconds, step.mode)
    return guesses[:cut + 1] if cut < len(guesses) else guesses + [root]


def _hidden(pipeline: Pipeline, row: int) -> Tensor | None:
    """The final hidden state of one row of the last forward (None when a pipeline keeps none)."""
    return None if pipeline.hidden is None else pipeline.hidden[0, row]
