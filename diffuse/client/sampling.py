"""Turning logits into the next token: greedy, temperature, top-k, top-p, repetition penalty, an
output constraint; and the log-probabilities of the tokens chosen."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import Tensor

from diffuse.client.constrain import Guide, OutputConstraint, compiler

MAX_LOGPROBS = 20  # alternatives reported per token at most (OpenAI's top_logprobs bound)


@dataclass
class SamplingParams:
    """temperature 0 means greedy; the rest follow the usual OpenAI / transformers meanings."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    constraint: OutputConstraint | None = None  # what the answer must match (client/constrain.py)
    logprobs: int | None = None  # likeliest alternatives to report with each token's log-probability

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class Logprob:
    """A token's log-probability under the model (the raw log-softmax of its logits, before
    penalties, temperature and constraint), its bytes (a token may hold part of a UTF-8
    character) and, for a chosen token, the likeliest tokens there, likeliest first."""

    token: int
    bytes: bytes
    logprob: float
    top: tuple[Logprob, ...] = ()


def logprob_of(logits: Tensor, token: int, top: int, spell: Callable[[list[int]], list[bytes]]) -> Logprob:
    """`token`'s entry from logits [V]; the chosen token comes first among equally likely ones.
    `spell` gives tokens' bytes."""
    logp = logits.float().log_softmax(-1)
    chosen = float(logp[token])
    values, ids = logp.topk(top)
    ranked = list(zip(ids.tolist(), values.tolist()))
    if ranked and token not in ids and chosen >= ranked[-1][1]:  # a tie topk cut the other way
        ranked[-1] = (token, chosen)
    ranked.sort(key=lambda t: (-t[1], t[0] != token))
    spelt = spell([token] + [i for i, _ in ranked])
    return Logprob(token, spelt[0], chosen, tuple(Logprob(i, b, v) for (i, v), b in zip(ranked, spelt[1:])))


class Sampler:
    """Stateful in what it was told was chosen (`take`): how many tokens the answer holds, the
    constraint's place in its grammar and the log-probabilities. A constraint needs the tokenizer
    (its grammar is compiled against the vocabulary), and so do log-probabilities (they spell
    their tokens).

    A sampled token is the Gumbel-max draw from its distribution, with noise fixed by the seed
    and the token's index in the answer: the same logits at the same index give the same token
    however the answer got there. So a seed reproduces a whole answer whether it was decoded
    plainly or speculating (a guess is kept exactly when it is the draw, which happens with its
    probability), replayed after a peer died, or rewound after a failed check."""

    def __init__(self, params: SamplingParams, tokenizer=None):
        self.p = params
        self.seed = (params.seed if params.seed is not None else torch.seed()) % 2**64
        self.index = 0  # tokens taken: the index in the answer of the next one
        if tokenizer is None and (params.constraint is not None or params.logprobs is not None):
            raise ValueError("a sampler with a constraint or log-probabilities needs the tokenizer")
        self.tokenizer = tokenizer
        self.guide = Guide.start(params.constraint, tokenizer) if params.constraint is not None else None
        self.logprobs: list[Logprob] = []  # one per token taken, when params.logprobs is set

    @property
    def stopped(self) -> bool:
        """Whether the constraint is complete, so the answer ends here."""
        return self.guide is not None and self.guide.stopped

    def allowed(self, tokens: Sequence[int]) -> int:
        """How many of `tokens`, in order after the last one taken, the constraint allows."""
        return len(tokens) if self.guide is None else self.guide.allowed(tokens)

    def take(self, logits: Tensor, token: int) -> None:
        """`token` was chosen from `logits` [V] (the model's, unadjusted): advance the constraint
        and note its log-probability."""
        self.index += 1
        if self.p.logprobs is not None:
            self.logprobs.append(logprob_of(logits, token, self.p.logprobs, compiler(self.tokenizer).token_bytes))
        if self.guide is not None and not self.guide.stopped:
            self.guide.accept(token)

    def rewind(self, length: int) -> None:
        """Forget every token taken after the first `length` (a rewound generation redoes them)."""
        self.index = length
        del self.logprobs[length:]
        if self.guide is not None:
            self.guide.rewind(length)

    def probs(self, logits: Tensor, context: Tensor | None = None) -> Tensor:
        """The distribution [.., V] the next token is drawn from (one-hot under greedy)."""
        logits = self.adjust(logits, context)
        if self.p.greedy:
            return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
        logits = logits / self.p.temperature
        if self.p.top_k:
            kth = logits.topk(min(self.p.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.p.top_p < 1:
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            cum = sorted_logits.softmax(-1).cumsum(-1)
            drop = cum - sorted_logits.softmax(-1) >= self.p.top_p  # keep the token crossing top_p
            logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
        return logits.softmax(-1)

    def adjust(self, logits: Tensor, context: Tensor | None) -> Tensor:
        """The constraint (what it forbids after the tokens taken goes to -inf), then the
        repetition penalty as in CTRL / transformers (shrink the logits of seen tokens)."""
        if self.guide is not None:
            logits = self.guide.mask(logits)
        if self.p.repetition_penalty == 1.0 or context is None or not len(context):
            return logits
        seen = logits.gather(-1, context.expand(*logits.shape[:-1], -1))
        seen = torch.where(seen > 0, seen / self.p.repetition_penalty, seen * self.p.repetition_penalty)
        return logits.scatter(-1, context.expand(*logits.shape[:-1], -1), seen)

    def sample(self, logits: Tensor, context: Tensor | None = None) -> int:
        """One token id from logits [V]."""
        if self.p.greedy:
            return int(self.adjust(logits, context).argmax(-1))
        return int((self.probs(logits, context).log() + self.noise(logits.shape[-1])).argmax(-1))

    def noise(self, vocab: int) -> Tensor:
        """Gumbel noise [vocab] for the token at `index`, from the seed and that index alone."""
        gen = torch.Generator().manual_seed((self.seed * 0x9E3779B97F4A7C15 + self.index) % 2**64)
        u = torch.rand(vocab, generator=gen, dtype=torch.float64).clamp_(1e-300, 1.0 - 1e-16)
        return -(-u.log()).log()
