"""Turning logits into the next token: greedy, temperature, top-k, top-p, repetition penalty."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Sampler:
    """Stateful only in its random generator, so a seed reproduces a whole answer."""

    def __init__(self, params: SamplingParams):
        self.p = params
        self.gen = torch.Generator()
        self.gen.manual_seed(params.seed if params.seed is not None else torch.seed())

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
        """Repetition penalty as in CTRL / transformers: shrink the logits of seen tokens."""
        if self.p.repetition_penalty == 1.0 or context is None or not len(context):
            return logits
        seen = logits.gather(-1, context.expand(*logits.shape[:-1], -1))
        seen = torch.where(seen > 0, seen / self.p.repetition_penalty, seen * self.p.repetition_penalty)
        return logits.scatter(-1, context.expand(*logits.shape[:-1], -1), seen)

    def sample(self, logits: Tensor, context: Tensor | None = None) -> int:
        """One token id from logits [V]."""
        if self.p.greedy:
            return int(self.adjust(logits, context).argmax(-1))
        return int(torch.multinomial(self.probs(logits, context), 1, generator=self.gen))
