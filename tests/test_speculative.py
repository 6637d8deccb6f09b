"""Speculative decoding: same tokens as plain greedy, same distribution under sampling, no trace
of rejected guesses in the cache, and the pieces (tree layout, acceptance, planner) alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import trio

from diffuse.client.generate import stream_tokens
from diffuse.client.pipeline import LocalModel
from diffuse.client.sampling import Sampler, SamplingParams
from diffuse.client.speculative import (
    HELD, PLAIN, TREE, Acceptance, Cost, Draft, Lookahead, NGramPool, PromptLookup, SpecConfig, SpecState, Speculator,
    StepCost,
    best_size, copy_source,
    kv_headroom, speculative_tokens, tree_inputs, verify,
)
from diffuse.errors import Rewind
from diffuse.model.load import load_head, load_span
from support.speculation import ROUND_TRIP_80MS, FixedCost
from tiny import Sync, make_tiny


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Small matmuls on a shared 2-core box: thread hand-offs cost more than they save."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def network(**kw) -> tuple[SpecConfig, SpecState]:
    """Plan as over an 80 ms round trip to CPU peers: speculation pays, trees get sent."""
    return SpecConfig(**kw), SpecState(cost=FixedCost(ROUND_TRIP_80MS))


async def collect(source, pipe, prompt, params, eos, *config) -> list[int]:
    return [t async for t in source(pipe, prompt, Sampler(params), eos, *config)]


# ---- tree layout and acceptance --------------------------------------------------------------

def test_tree_inputs_mask_positions():
    # root -> a -> b, root -> c, a -> d
    ids, pos, mask = tree_inputs([9, 1, 2, 3, 4], [-1, 0, 1, 0, 1], base=10)
    assert ids.tolist() == [[9, 1, 2, 3, 4]]
    assert pos.tolist() == [10, 11, 12, 11, 12]
    assert mask.int().tolist() == [[1, 0, 0, 0, 0],
                                   [1, 1, 0, 0, 0],
                                   [1, 1, 1, 0, 0],
                                   [1, 0, 0, 1, 0],
                                   [1, 1, 0, 0, 1]]
    with pytest.raises(ValueError, match="parents must come first"):
        tree_inputs([9, 1, 2], [-1, 2, 0], base=0)


def one_hot_logits(targets: list[int], vocab: int = 8) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(targets), vocab).float() * 5


def test_greedy_accepts_longest_agreeing_path():
    tokens, parents = [0, 1, 2, 3, 4, 5], [-1, 0, 0, 2, 3, 2]
    # Model: after root 3? no, 2; after node 2 (token 2) -> 5; after node 5 (token 5) -> 7.
    logits = one_hot_logits([2, 6, 5, 6, 6, 7])
    greedy = Sampler(SamplingParams())
    assert verify(tokens, parents, logits, greedy, [0], max_depth=8) == ([2, 5], 7)
    assert verify(tokens, parents, logits, greedy, [0], max_depth=1) == ([2], 5)
    assert verify(tokens, parents, one_hot_logits([4] * 6), greedy, [0], max_depth=8) == ([], 4)


def test_greedy_verification_applies_repetition_penalty_along_the_branch():
    # At node 1 the model slightly prefers token 1 again, but token 1 is in that branch's context.
    logits = torch.zeros(2, 4)
    logits[0, 1] = 3.0
    logits[1, 1], logits[1, 2] = 2.0, 1.9
    sampler = Sampler(SamplingParams(repetition_penalty=1.5))
    assert verify([0, 1], [-1, 0], logits, sampler, [0], max_depth=4) == ([1], 2)


def chi2_pvalue(counts: dict, expected: dict, n: int) -> float:
    """Pearson's test; outcomes expected fewer than 5 times are pooled into one bin."""
    assert set(counts) <= set(expected), set(counts) - set(expected)
    rare = {k for k, p in expected.items() if n * p < 5}
    bins = [(counts.get(k, 0), n * p) for k, p in expected.items() if k not in rare]
    bins.append((sum(counts.get(k, 0) for k in rare), n * sum(expected[k] for k in rare)))
    stat = sum((c - e) ** 2 / e for c, e in bins if e > 0)
    df = sum(e > 0 for _, e in bins) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2), torch.tensor(stat / 2)))


def test_rejection_sampling_preserves_the_distribution():
    """Root with children 0, 2, 3 (guesses), node for 2 has child 1: the first two tokens of
    a verified step are distributed as p(x) p(y | x), however the guesses fall."""
    torch.manual_seed(0)
    vocab = 5
    tokens, parents = [4, 0, 2, 3, 1], [-1, 0, 0, 0, 2]
    logits = torch.randn(len(tokens), vocab) * 1.5
    params = SamplingParams(temperature=0.8, top_k=4, seed=1)
    sampler = Sampler(params)
    p = [sampler.probs(logits[i]).tolist() for i in range(len(tokens))]
    node_of = {0: 1, 2: 2, 3: 3}  # first-level guess token -> node
    expected = {}
    for x in range(vocab):
        if p[0][x] == 0:
            continue
        if x in node_of:  # accepted, then the node's own distribution picks the next token
            for y in range(vocab):
                if p[node_of[x]][y] > 0:
                    expected[(x, y)] = p[0][x] * p[node_of[x]][y]
        else:
            expected[(x,)] = p[0][x]
    n, counts = 8000, {}
    for _ in range(n):
        path, nxt = verify(tokens, parents, logits, sampler, [4], max_depth=1)
        key = tuple(tokens[i] for i in path) + (nxt,)
        counts[key] = counts.get(key, 0) + 1
    assert chi2_pvalue(counts, expected, n) > 1e-3


# ---- guess sources and planner ---------------------------------------------------------------

def test_prompt_lookup_each_occurrence_once_with_its_reach():
    lookup = PromptLookup(max_n=2)
    lookup.extend([5, 1, 2, 3, 7, 9, 2, 3, 8, 4, 3, 6, 5, 1, 2, 3])
    found = list(lookup.continuations(depth=2))
    # "2 3" matched, newest first; the older one agrees four tokens back ("5 1 2 3"), beyond
    # max_n; then "3" alone, where it is not part of "2 3"
    assert found == [(2, [8, 4]), (4, [7, 9]), (1, [6, 5])]


def test_a_long_copy_is_priced_above_a_short_one():
    spec = Speculator(SpecConfig(levels=0), SpecState(), [5, 1, 2, 3, 7, 9, 2, 3, 8, 4, 3, 6, 5, 1, 2, 3])
    draft = spec.draft(max_depth=2)
    scores = Acceptance().scores(draft)
    node = {tuple(draft.tokens[j] for j in _path(draft, i)): i for i in range(1, len(draft.tokens))}
    assert [copy_source(m) for m in (1, 3, 4, 15, 16, 40)] == ["copy1", "copy2", "copy4", "copy8", "copy16", "copy16"]
    assert draft.kinds[node[(7,)]][0] == "copy4" and draft.kinds[node[(6,)]][0] == "copy1"
    assert scores[node[(7,)]] > scores[node[(8,)]] > scores[node[(6,)]]
    assert scores[node[(7, 9)]] > scores[node[(8,)]]  # the long copy's tail, too


def _path(draft, i):
    out = []
    while i > 0:
        out.append(i)
        i = draft.parents[i]
    return out[::-1]


def test_draft_merges_shared_prefixes_and_caps_size():
    draft = Draft(root=0, max_nodes=4, max_depth=3)
    draft.add([1, 2, 3, 4], "copy")
    draft.add([1, 2, 5], "copy")
    draft.add([6, 7], "pool")
    assert draft.tokens == [0, 1, 2, 3, 5]  # depth 3 cap, shared prefix once, then full
    assert draft.parents == [-1, 0, 1, 2, 2]
    assert draft.kinds[4] == ("copy", 3, 1)


def test_pool_keeps_recent_ngrams_per_key():
    pool = NGramPool(per_key=2)
    for gram in ([1, 2, 3], [1, 4, 5], [1, 2, 3], [1, 6, 7]):
        pool.add(gram)
    assert pool.get(1) == [(6, 7), (2, 3)]


def test_lookahead_columns_are_ngrams_at_their_depths():
    window = Lookahead(width=3, levels=2, context=[5], seed=0)
    window.rows = [[10, 11, 12], [20, 21, 22]]
    tokens, parents = window.tree(base=1)
    _, pos, mask = tree_inputs([0] + tokens, [-1] + parents, base=0)
    assert pos.tolist() == [0, 1, 2, 3, 2, 3, 4]  # row l, column j at depth 1 + l + j
    seen = [t for t, m in zip([0] + tokens, mask[5]) if m]  # row 1, column 1
    assert seen == [0, 10, 11, 21]
    window.advance([30, 31, 32])
    assert window.rows == [[20, 21, 22], [30, 31, 32]]


def test_acceptance_learns_from_what_followed():
    draft = Draft(root=0, max_nodes=8, max_depth=3)
    draft.add([1, 2], "copy")
    draft.add([3], "pool")
    model = Acceptance()
    before = model.scores(draft)
    for _ in range(20):
        model.learn(draft, [1, 2, 9])
    after = model.scores(draft)
    assert after[1] > before[1] and after[2] > before[2] and after[3] < before[3]
    assert after[2] < after[1]


@pytest.fixture
def avx2(monkeypatch):
    """The planner's tests price rows as an AVX2 CPU pads them (multiples of 8 from 7 rows)."""
    from diffuse.model import kernels

    monkeypatch.setattr(kernels, "profile", lambda: kernels.AVX2)


def test_step_cost_fit_and_best_size(avx2):
    cost = StepCost()
    cost.observe(1, 0.03)
    cost.observe(300, 0.64)  # the prefill
    assert cost.fit() is None  # one wide size: slope unknown
    for t in (4, 16, 1, 4):
        cost.observe(t, 0.04 + 0.002 * t if t > 1 else 0.03)
    fit = cost.fit()
    assert abs(fit.a - 0.04) < 1e-9 and abs(fit.b - 0.002) < 1e-9 and abs(fit.plain - 0.03) < 1e-9
    likely = [0.9, 0.8, 0.7, 0.1, 0.01]
    assert best_size(likely, Cost(0.1, 0.1, 0.001)) == 4  # cheap positions: all but the hopeless one
    assert best_size([0.3, 0.1, 0.05], Cost(0.04, 0.04, 0.04)) == 0  # too dear: plain decoding
    assert best_size([0.3, 0.1, 0.05], Cost(0.03, 0.045, 0.001)) == 0  # the jump from one position
    # Priced at padded rows: 9 positions cost what 16 do, so the planner fills the granule.
    assert best_size([0.6] * 8 + [0.05] * 7, Cost(0.1, 0.1, 0.002)) == 15


def test_plan_fills_the_rows_the_kernels_pad(avx2):
    cfg = SpecConfig(lookahead_gain=10.0)  # always add the window
    spec = Speculator(cfg, SpecState(cost=FixedCost(Cost(0.1, 0.1, 0.002))), [1, 2, 3])
    spec.acceptance = Acceptance({"sure": 0.9, "long shot": 0.001})
    draft = Draft(3, cfg.max_nodes, cfg.max_depth)
    draft.add(list(range(10, 18)), "sure")
    for t in range(20, 40):
        draft.add([t], "long shot")
    spec.draft = lambda depth, fit: draft
    step = spec.plan(cfg.max_depth)
    # 1 root + 7 sure guesses + the 10-position window = 18 rows, which the kernels pad to 24:
    # the six padding rows carry the next-best guesses (the eighth sure one, five long shots).
    assert step.lookahead and len(step.tokens) == 24
    assert step.tokens[:9] == [3] + list(range(10, 18)) and step.tokens[9:14] == list(range(20, 25))


def test_positions_are_priced_for_every_session_in_the_batch():
    """Batched with 15 others, a position costs each of them what it costs this session: guesses
    worth their own slope alone stop being worth it."""
    cfg = SpecConfig(lookahead_gain=0.0)
    spec = Speculator(cfg, SpecState(cost=FixedCost(Cost(0.1, 0.1, 0.004))), [1, 2, 3])
    spec.acceptance = Acceptance({"fair": 0.5})
    draft = Draft(3, cfg.max_nodes, cfg.max_depth)
    for t in range(20, 26):
        draft.add([t], "fair")
    spec.draft = lambda depth, fit: draft
    alone, crowded = spec.plan(cfg.max_depth), spec.plan(cfg.max_depth, company=16)
    assert len(alone.tokens) == 7 and alone.mode == TREE  # 0.5 a guess for 4 ms: all six
    assert crowded.tokens == [3] and crowded.mode == PLAIN  # 0.5 a guess for 64 ms: none


def test_exact_sessions_never_pay_for_fewer_than_sixteen_rows(avx2):
    # There one position costs what sixteen do: plain decoding never pays, and every step is
    # filled to sixteen positions with the best guesses, however unlikely.
    dear_jump = Cost(0.03, 0.045, 0.001)
    assert best_size([0.3, 0.1, 0.05], dear_jump) == 0
    assert best_size([0.3, 0.1, 0.05], dear_jump, exact=True) == 3
    cfg = SpecConfig()
    for exact, rows in ((False, 1), (True, 16)):
        spec = Speculator(cfg, SpecState(cost=FixedCost(dear_jump)), [1, 2, 3], exact=exact)
        spec.acceptance = Acceptance({"long shot": 0.001})
        draft = Draft(3, cfg.max_nodes, cfg.max_depth)
        for t in range(20, 60):
            draft.add([t], "long shot")
        spec.draft = lambda depth, fit, draft=draft: draft
        step = spec.plan(cfg.max_depth)
        assert len(step.tokens) == rows and not step.lookahead
        assert step.tokens == [3] + list(range(20, 20 + rows - 1))


# ---- whole generations on a fake model -------------------------------------------------------

class MarkovPipe:
    """A 'model' whose next-token logits depend on the last two tokens of each node's own
    branch, read through the tree mask: it checks the loop's masks, positions and commits."""

    head, exact, hidden = None, False, None  # no LM head or final states for a draft head to read
    company = 1  # no other sessions batched with it

    def __init__(self, vocab: int = 5, seed: int = 0, max_len: int = 1 << 20):
        self.table = torch.randn(vocab, vocab, vocab, generator=torch.Generator().manual_seed(seed)) * 2
        self.tokens: list[int] = []
        self.pending: list[int] = []
        self.max_len, self.widest = max_len, 0

    @property
    def length(self) -> int:
        return len(self.tokens)

    async def forward(self, ids, positions=None, tree_mask=None, commit=True, rows=None):
        assert not self.pending
        new = ids[0].tolist()
        assert self.length + len(new) <= self.max_len, "KV cache overflow"
        if not commit:
            self.widest = max(self.widest, len(new))  # positions of the widest step
        if tree_mask is None:  # causal
            seen = [list(range(i + 1)) for i in range(len(new))]
        else:
            seen = [row.nonzero().flatten().tolist() for row in tree_mask]
            assert positions.tolist() == [self.length + len(s) - 1 for s in seen]
        out = []
        for sees in seen:
            branch = self.tokens + [new[j] for j in sees]
            out.append(self.table[branch[-2] if len(branch) > 1 else 0, branch[-1]])
        if commit:
            self.tokens += new
        else:
            self.pending = new
        logits = torch.stack(out)[None]
        return logits if rows is None else logits[:, rows]

    async def commit(self, keep):
        self.tokens += [self.pending[i] for i in keep]
        self.pending = []

    def defer_checks(self) -> None:  # no trust plane here: nothing is verified behind the loop
        pass

    def unverified_from(self) -> None:
        return None

    async def settle(self) -> None:
        pass


def test_sampling_distribution_over_whole_generations():
    """Three tokens from speculative_tokens vs the exact law of the fake model."""
    table = MarkovPipe(vocab=4).table
    for a in range(4):  # favour the prompt's pattern: guesses are often accepted, often not
        for b, c in ((1, 2), (2, 3), (3, 1)):
            table[a, b, c] += 0.5
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]  # prompt lookup keeps proposing 3 1 2 ...
    sampler = Sampler(SamplingParams(temperature=1.0, max_tokens=3, seed=3))

    def law(prev2: int, prev1: int) -> list[float]:
        return sampler.probs(table[prev2, prev1]).tolist()

    expected = {}
    for a, pa in enumerate(law(1, 2)):
        for b, pb in enumerate(law(2, a)):
            for c, pc in enumerate(law(a, b)):
                expected[(a, b, c)] = pa * pb * pc

    async def many(n):
        counts, accepted = {}, 0
        for _ in range(n):
            pipe, (cfg, state) = MarkovPipe(vocab=4), network()
            pipe.table = table
            out = tuple([t async for t in speculative_tokens(pipe, prompt, sampler, set(), cfg, state)])
            counts[out] = counts.get(out, 0) + 1
            accepted += 3 - 1 - state.stats.steps  # tokens beyond the first, minus one per step
        return counts, accepted

    n = 3000
    counts, accepted = trio.run(many, n)
    assert accepted > n / 4  # guesses were really accepted, not just rejected
    assert chi2_pvalue(counts, expected, n) > 1e-3


def test_a_seed_gives_plain_samplings_answer_when_speculating():
    """Sampled with a seed, speculation's answer is plain decoding's token for token, however
    many guesses each step kept: the draw at each index is fixed by the seed."""
    table = MarkovPipe(vocab=4).table
    for a in range(4):
        for b, c in ((1, 2), (2, 3), (3, 1)):
            table[a, b, c] += 0.5
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]

    def pipe() -> MarkovPipe:
        made = MarkovPipe(vocab=4)
        made.table = table
        return made

    answers, kept = set(), 0
    for seed in range(6):
        params = SamplingParams(temperature=1.0, max_tokens=12, seed=seed)
        plain = trio.run(collect, stream_tokens, pipe(), prompt, params, set())
        cfg, state = network()
        spec = trio.run(collect, speculative_tokens, pipe(), prompt, params, set(), cfg, state)
        assert spec == plain, seed
        answers.add(tuple(plain))
        kept += len(spec) - state.stats.steps - 1
    assert kept > 0 and len(answers) > 3  # guesses were kept; seeds differ


def cyclic_pipe(eos: int, max_len: int = 1 << 20) -> MarkovPipe:
    """A deterministic fake model that writes 1 2 3 4 <eos> over and over."""
    pipe = MarkovPipe(vocab=eos + 1, max_len=max_len)
    pipe.table.fill_(0)
    cycle = [1, 2, 3, 4, eos]
    for b, nxt in zip(cycle, cycle[1:] + cycle[:1]):
        pipe.table[:, b, nxt] = 9
    return pipe


def test_exact_max_tokens_and_eos_as_an_accepted_guess():
    eos = 5
    prompt = [1, 2, 3, 4, eos] * 3 + [1]  # prompt lookup proposes "3 4 <eos> 1 2" after "1 2"
    for max_tokens in (1, 2, 3, 4, 9):
        params, (cfg, state), pipe = SamplingParams(max_tokens=max_tokens), network(), cyclic_pipe(eos)
        ours = trio.run(collect, speculative_tokens, pipe, prompt, params, {eos}, cfg, state)
        assert ours == trio.run(collect, stream_tokens, cyclic_pipe(eos), prompt, params, {eos})
        assert ours == [2, 3, 4][:max_tokens]
        if max_tokens > 3:  # eos came as an accepted guess: neither yielded nor committed
            assert state.stats.tokens == [3] and pipe.tokens == prompt + [2, 3, 4]
    for max_tokens in (7, 13, 30):  # without an eos: exactly max_tokens, however steps fall
        params = SamplingParams(max_tokens=max_tokens)
        ours = trio.run(collect, speculative_tokens, cyclic_pipe(eos), prompt, params, set(), *network())
        assert ours == ([2, 3, 4, eos, 1] * 6)[:max_tokens]


class CaughtPipe(MarkovPipe):
    """A Markov 'model' whose candidates from committed length `lie_at` on come back spoilt (the
    next token's logits reversed) until a check behind the loop catches it: its outputs count as
    unverified from there, and the next forward (or settle) rewinds to before them, as the trust
    plane does. `catch=False`: the lie is never caught."""

    def __init__(self, lie_at: int, catch: bool = True, **kw):
        super().__init__(**kw)
        self.lie_at, self.catch = lie_at, catch
        self.caught: int | None = None  # where the rewind went
        self.suspect: int | None = None  # the length a pending check would rewind to

    async def forward(self, ids, positions=None, tree_mask=None, commit=True, rows=None):
        self._judge()
        logits = await super().forward(ids, positions, tree_mask, commit, rows)
        if self.caught is None and self.length >= self.lie_at and not commit:
            self.suspect = self.length if self.suspect is None else self.suspect
            return -logits
        return logits

    def _judge(self) -> None:
        if self.suspect is not None and self.catch:
            self.tokens, self.pending, self.caught, self.suspect = self.tokens[:self.suspect], [], self.suspect, None
            raise Rewind(self.caught)

    def unverified_from(self) -> int | None:
        return self.suspect

    async def settle(self) -> None:
        self._judge()


def test_a_step_caught_behind_the_loop_is_rewound_and_never_shown():
    """Speculating with checks behind the loop: tokens from a spoilt step stay unshown while its
    check is pending, and the rewind recomputes them, so the answer is the honest one (which a
    lie left uncaught would change)."""
    prompt, params = [1, 2, 3, 1, 2], SamplingParams(max_tokens=24)
    honest = trio.run(collect, stream_tokens, MarkovPipe(), prompt, params, set())
    for lie_at in (len(prompt), len(prompt) + 3, len(prompt) + 11):
        pipe = CaughtPipe(lie_at)
        assert trio.run(collect, speculative_tokens, pipe, prompt, params, set(), *network()) == honest
        assert pipe.caught is not None and pipe.caught >= lie_at
        uncaught = trio.run(collect, speculative_tokens, CaughtPipe(lie_at, catch=False), prompt, params, set(),
                            *network())
        assert uncaught != honest


class Misjudged(FixedCost):
    """Forecasts speculation over an 80 ms round trip but charges each wide step `wide` seconds
    (plain steps 0.1 s): the forecast is wrong while `wide` is high."""

    def __init__(self, wide: float):
        super().__init__(ROUND_TRIP_80MS)
        self.wide = wide

    def charged(self, positions: int, seconds: float) -> float:
        return 0.1 if positions == 1 else self.wide


def test_gate_holds_speculation_that_does_not_pay_and_lets_it_back():
    from diffuse.client.speculative import HELD, PLAIN, TREE, Gate

    gate = Gate(window=8, every=4, hold=4, most=16)
    for _ in range(7):
        gate.observe(1, 8, 0.2, 0.1)  # 5 tokens/s against plain's 10 (its fitted cost)
    assert gate.open  # not judged on fewer than eight steps
    gate.observe(1, 8, 0.2, 0.1)
    assert not gate.open and gate.held == 4
    for _ in range(4):
        gate.observe(1, 1, 0.1, None)
    assert gate.open
    for _ in range(8):
        gate.observe(1, 8, 0.2, None)  # a new window after the hold
    assert gate.held == 8  # failed again: a longer hold
    for _ in range(8):
        gate.observe(1, 1, 0.1, None)
    for _ in range(8):
        gate.observe(3, 8, 0.2, None)  # 15 tokens/s: it pays, the hold resets
    assert gate.open and gate.hold == 4
    for _ in range(4):
        gate.observe(1, 8, 0.15, None)  # four losing steps (6.7 tokens/s), but with the four paying
    assert gate.open                   # ones before them 16 tokens in 1.4 s: it pays
    for _ in range(4):
        gate.observe(1, 8, 0.15, None)  # eight losing steps in the sliding window: held
    assert not gate.open

    # In the loop: the text repeats (guesses are right: 9 tokens a step), but wide steps cost 10x
    # a plain one until the round trip grows; then trees come back. The answer is plain greedy's.
    eos, prompt = 5, [1, 2, 3, 4, 5] * 3 + [1]
    cost = Misjudged(wide=1.0)
    state, params = SpecState(cost=cost), SamplingParams(max_tokens=1000)
    modes = state.stats.modes

    async def run():
        out = []
        async for tok in speculative_tokens(cyclic_pipe(eos), prompt, Sampler(params), set(), SpecConfig(), state):
            out.append(tok)
            if len(modes) == 40:
                cost.wide = 0.12  # now a tree of ~5 accepted tokens beats a 0.1 s plain step
        return out

    out = trio.run(run)
    assert out == trio.run(collect, stream_tokens, cyclic_pipe(eos), prompt, params, set())
    # The opening tree lost time (the ledger), so the next is held, and so is every step until the
    # budget affords another tree at what the last one took (nine plain steps' worth more).
    assert modes[0] == TREE and modes[1:400] == [HELD] * 399
    # Back once it pays (the very last step may be plain: with one token left a tree has nothing to win).
    assert set(modes) <= {TREE, PLAIN, HELD} and modes[-9:-1] == [TREE] * 8


def test_gate_measures_a_plain_step_only_when_its_guess_decides():
    from diffuse.client.speculative import Gate

    gate = Gate(window=8, every=4, hold=4)
    for _ in range(8):
        gate.observe(2, 8, 0.12, 0.1)  # 16.7 tokens/s against plain guessed at 10 (the fit's a + b)
    assert gate.open and not gate.plain  # clearly pays: no plain step is spent on pricing one
    gate = Gate(window=8, every=4, hold=4)
    for _ in range(8):
        gate.observe(1, 8, 0.09, 0.1)  # 11.1 tokens/s against a guessed 10: too close to call
    assert gate.held == 1 and gate.hold == 4  # one plain step to measure it, not a hold
    gate.observe(1, 1, 0.08, None)  # plain measured: 12.5 tokens/s
    assert gate.open
    for _ in range(4):
        gate.observe(1, 8, 0.09, 0.1)
    assert gate.held == 4  # judged against the measured plain step: held
    gate = Gate(window=8, every=4, hold=4)
    for _ in range(8):
        gate.observe(1, 8, 0.11, 0.1)  # 9.1 tokens/s against a guessed 10: too close to hold on a guess
    assert gate.held == 1 and gate.hold == 4
    gate.observe(1, 1, 0.125, None)  # plain measured: 8 tokens/s, slower than guessed
    for _ in range(4):
        gate.observe(1, 8, 0.11, 0.1)
    assert gate.open  # trees beat the measured plain step
    for _ in range(8):
        gate.observe(1, 8, 0.2, 0.1)
    assert gate.held == 4  # 5 tokens/s: held (a plain step is known now)


def test_ledger_backs_off_when_trees_lose_and_probes_again_later():
    from diffuse.client.spec_ledger import Ledger

    ledger = Ledger()
    assert ledger.allows(0.05, 0.1)  # the opening probe: within the floor of one plain step
    ledger.observe(1, 8, 0.15)  # a tree step: every guess rejected, 0.05 s lost
    assert ledger.wants_plain(0.1)  # lost on a guessed plain price: measure one first
    for _ in range(Ledger.MEASURE):  # and, while losing, priced on more than one plain step
        ledger.observe(1, 1, 0.1)
    assert not ledger.wants_plain(0.1)
    sent = 0
    while ledger.allows(0.05, None):
        ledger.observe(1, 8, 0.15)
        sent += 1
    # Backed off once one more losing tree would lose more than a plain step plus 2% of the
    # time plain decoding would have taken: the answer can only fall to ~0.95x plain's speed.
    assert sent == 1 and -ledger.saved(0.1) <= ledger.budget(0.1)
    held = 0
    while not ledger.allows(0.05, None):
        ledger.observe(1, 1, 0.1)  # held plain: costs the ledger nothing, the budget grows
        held += 1
    assert 10 <= held <= 30  # probed again later, not never
    for _ in range(20):
        assert ledger.allows(0.05, None)
        ledger.observe(3, 8, 0.15)  # trees that pay (3 tokens for 1.5 plain steps' time)
    assert ledger.saved(0.1) > 1.0

    ledger = Ledger()
    for _ in range(Ledger.MEASURE):
        ledger.observe(1, 1, 0.1)
    ledger.observe(2, 8, 0.3)  # a tree that took 0.2 s more than a plain step
    assert ledger.allows(0.005, None) is False  # priced at what trees took, not at the fit's 5 ms


def test_ledger_bounds_a_whole_answer_whose_trees_never_pay():
    # The text repeats, so every step's forecast says trees pay, but each wide step takes three
    # plain steps' time and yields at most two tokens more than plain: the answer stays at
    # >= 0.95x of plain decoding's time, probing now and then, and is plain greedy's.
    eos, prompt = 5, [1, 2, 3, 4, 5] * 3 + [1]
    cost = Misjudged(wide=0.4)
    state, params = SpecState(cost=cost), SamplingParams(max_tokens=400)
    cfg = SpecConfig(max_nodes=2, probe_nodes=2, levels=0)  # two guesses at most: 3 tokens for 0.4 s
    out = trio.run(collect, speculative_tokens, cyclic_pipe(eos), prompt, params, set(), cfg, state)
    assert out == trio.run(collect, stream_tokens, cyclic_pipe(eos), prompt, params, set())
    stats = state.stats
    seconds = sum(0.1 if p == 1 else 0.4 for p in stats.positions)
    assert sum(stats.tokens) * 0.1 / seconds >= 0.95
    assert stats.modes.count(TREE) >= 3 and stats.modes.count(HELD) > stats.modes.count(TREE)


def test_a_generation_opens_with_a_tree():
    # The step cost is learned (nothing fixed): the prompt's forward is its only timing, so the
    # first decode step is a probe tree, not a plain step that would only price one.
    eos, prompt = 5, [1, 2, 3, 4, 5] * 3 + [1]
    state, params = SpecState(), SamplingParams(max_tokens=12)
    out = trio.run(collect, speculative_tokens, cyclic_pipe(eos), prompt, params, set(), SpecConfig(), state)
    assert out == trio.run(collect, stream_tokens, cyclic_pipe(eos), prompt, params, set())
    assert state.stats.modes[0] == TREE and state.stats.tokens[0] > 1


def test_widest_steps_fit_the_kv_headroom():
    eos, max_tokens = 5, 30
    prompt = [1, 2, 3, 4, eos] * 3 + [1]
    cfg, state = SpecConfig(max_nodes=6, width=3, levels=2), SpecState(cost=FixedCost(Cost(1.0, 1.0, 0.0)))
    pipe = cyclic_pipe(eos, max_len=len(prompt) + max_tokens + kv_headroom(cfg))
    out = trio.run(collect, speculative_tokens, pipe, prompt, SamplingParams(max_tokens=max_tokens), set(), cfg, state)
    assert len(out) == max_tokens and pipe.widest == 1 + kv_headroom(cfg)  # full trees were sent


# ---- real engines ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> LocalModel:
    path = make_tiny(tmp_path_factory.mktemp("spec") / "t")
    return LocalModel(load_head(path), [load_span(path, 0, 4)])


def _random_draft():
    from diffuse.client.draft_head import DraftHead

    torch.manual_seed(3)
    draft = DraftHead(64, 96)
    for p in draft.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return draft


@pytest.mark.parametrize("config", [network, lambda: network(lookahead_gain=10.0, width=4, levels=3),
                                    lambda: network(draft=_random_draft())])
def test_tiny_greedy_identity_and_clean_cache(tiny_model, config):
    prompt = [5, 17, 42, 99, 3, 250, 7, 17, 42, 99, 3, 11]
    params = SamplingParams(max_tokens=60)
    plain_pipe = tiny_model.session(len(prompt) + 64)
    plain = trio.run(collect, stream_tokens, plain_pipe, prompt, params, set())
    cfg, state = config()
    spec_pipe = tiny_model.session(len(prompt) + 60 + kv_headroom(cfg))
    ours = trio.run(collect, speculative_tokens, spec_pipe, prompt, params, set(), cfg, state)
    assert ours == plain
    assert max(state.stats.tokens) > 1 and 1 + sum(state.stats.tokens) == len(plain)  # +1: from the prefill
    # Rejected guesses left nothing behind: after feeding what each cache lacks, the next
    # tokens see identical logits.
    text, nxt = prompt + plain, [[8, 9, 10]]
    spec, ref = Sync(spec_pipe), Sync(plain_pipe)
    n = spec.length
    assert n <= len(text)
    for a, b in ((spec.stages[0].cache.k, ref.stages[0].cache.k), (spec.stages[0].cache.v, ref.stages[0].cache.v)):
        assert (a[:, :, :, :n] - b[:, :, :, :n]).abs().max() < 1e-5
    spec.forward(torch.tensor([text[spec.length:]]))
    ref.forward(torch.tensor([text[ref.length:]]))
    assert (spec.forward(torch.tensor(nxt)) - ref.forward(torch.tensor(nxt))).abs().max() < 1e-4


PROMPTS = {
    "chat": "What is the capital of France? Tell me about it.",
    "code": "Write a Python function that returns the n-th Fibonacci number.",
    "summary": "Summarise in two sentences: The Amazon rainforest covers much of the Amazon basin of "
               "South America. The basin spans seven million square kilometres, five and a half "
               "million of them rainforest, across nine nations. Brazil holds 60% of the forest, "
               "Peru 13% and Colombia 10%.",
}


@pytest.mark.slow
def test_smollm2_greedy_identity(home: Path):
    from diffuse.client.local import open_local

    model, tok = open_local(home, None, "fp32")
    params = SamplingParams(max_tokens=32)
    gained = 0
    for kind, text in PROMPTS.items():
        prompt = tok.encode_chat([{"role": "user", "content": text}])
        plain = trio.run(collect, stream_tokens, model.session(len(prompt) + 33), prompt, params, tok.eos_ids)
        cfg, state = network(lookahead_gain=10.0) if kind == "chat" else network()
        pipe = model.session(len(prompt) + 32 + kv_headroom(cfg))
        ours = trio.run(collect, speculative_tokens, pipe, prompt, params, tok.eos_ids, cfg, state)
        assert ours == plain, (kind, tok.decode(plain), tok.decode(ours))
        gained += sum(state.stats.tokens) - state.stats.steps
    assert gained > 0


def test_server_cache_keeps_no_trace_of_rejected_guesses(tiny_model, tmp_path, monkeypatch):
    """Speculation through a real BlockServer (over an in-memory stream): the server's cache holds
    exactly what plain decoding of the same tokens leaves, and the next step sees the same thing."""
    from test_sessions import MODEL, Swarm
    from diffuse.client.pipeline import LocalStage, Pipeline
    from diffuse.data.client import Bans, RemoteSpan
    from diffuse.model.engine import BlockSpan

    path = make_tiny(tmp_path / "t")
    prompt = [5, 17, 42, 99, 3, 250, 7, 17, 42, 99, 3, 11]
    params, (cfg, state) = SamplingParams(max_tokens=40), network()
    caches = []  # the server's session cache is the first one made
    new_cache = BlockSpan.new_cache
    monkeypatch.setattr(BlockSpan, "new_cache", lambda self, *a: caches.append(new_cache(self, *a)) or caches[-1])

    async def run():
        async with trio.open_nursery() as nursery:
            swarm = Swarm(nursery, path, {"p": (1, 4)})
            max_len = len(prompt) + 40 + kv_headroom(cfg)
            remote = RemoteSpan(MODEL, 1, 4, swarm.dial, swarm.route, Bans(), max_len=max_len,
                                dtype=torch.float32, timeout=10, route_wait=0)
            await remote.open()
            pipe = Pipeline(load_head(path), [LocalStage(load_span(path, 0, 1), remote.max_len), remote])
            out = await collect(speculative_tokens, pipe, prompt, params, set(), cfg, state)
            await pipe.forward(torch.tensor([(prompt + out)[pipe.length:]]))  # what the cache lacks, plain
            server = caches[0]
            n = server.length
            snapshot = server.k[:, :, :, :n].clone(), server.v[:, :, :, :n].clone()
            nxt = await pipe.forward(torch.tensor([[8, 9, 10]]))
            await pipe.close()
            nursery.cancel_scope.cancel()
        return out, n, snapshot, nxt

    out, n, (k, v), nxt = trio.run(run)
    ref_pipe = tiny_model.session(len(prompt) + 64)
    plain = trio.run(collect, stream_tokens, ref_pipe, prompt, params, set())
    assert out == plain and max(state.stats.tokens) > 1 and state.stats.steps < len(plain) - 1
    assert n == len(prompt) + len(plain)
    ref = Sync(ref_pipe)
    ref.forward(torch.tensor([(prompt + plain)[ref.length:]]))  # plain decoding never feeds its last token
    assert ref.length == n
    ref_cache = ref.stages[0].cache  # the whole model: the server's blocks 1-3 are its layers 1-3
    assert (k - ref_cache.k[1:, :, :, :n]).abs().max() < 1e-5
    assert (v - ref_cache.v[1:, :, :, :n]).abs().max() < 1e-5
    assert (nxt - ref.forward(torch.tensor([[8, 9, 10]]))).abs().max() < 1e-4


def test_latency_relay_keeps_bytes_and_order_under_jitter():
    """Jitter must delay chunks, never reorder them; the link is changeable; bad commands are refused."""
    from latency_relay import Link, apply_command, parse_mapping, relay

    link = Link(rtt=0.004, jitter=0.01, bandwidth=2e6, seed=1)
    chunks = [bytes([i % 251]) * (1 + 97 * i % 3000) for i in range(120)]

    async def echo(stream):
        async for data in stream:
            await stream.send_all(data)

    async def run() -> bytes:
        with trio.fail_after(60):
            return await relayed()

    async def relayed() -> bytes:
        async with trio.open_nursery() as nursery:
            listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
            nursery.start_soon(trio.serve_listeners, echo, listeners)
            port = await nursery.start(relay, ("127.0.0.1", listeners[0].socket.getsockname()[1]), link)
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            got = bytearray()

            async def reader():
                while len(got) < sum(map(len, chunks)):
                    got.extend(await stream.receive_some(65536))

            async with trio.open_nursery() as inner:
                inner.start_soon(reader)
                for i, c in enumerate(chunks):
                    if i == 60:
                        apply_command(link, "rtt 0")
                    await stream.send_all(c)
            nursery.cancel_scope.cancel()
        return bytes(got)

    assert trio.run(run) == b"".join(chunks)
    assert link.rtt == 0 and link.jitter == 0.01
    assert parse_mapping("7000:127.0.0.1:8000") == (7000, ("127.0.0.1", 8000))
    with pytest.raises(ValueError, match="mapping"):
        parse_mapping("nonsense")
    with pytest.raises(ValueError, match="unknown command"):
        apply_command(link, "delay 5")
    with pytest.raises(ValueError, match=">= 0"):
        apply_command(link, "rtt -1")
