"""Output constraints: any JSON object, a JSON schema or a grammar, enforced token by token.

A constraint runs where the LM head is (the client): before each token is drawn, the tokens the
grammar forbids get -inf, so every way of choosing (greedy, sampling, speculative verification)
picks only allowed tokens, and nothing on the wire changes. llguidance (a Rust Earley parser over
the tokenizer's token trie) computes a mask far faster than a decode step; its tokenizer is the
costly part to build, so it is built once per tokenizer, and each compiled grammar is kept (a
bounded LRU) and copied per answer (figures: docs/api.md, "Structured output").
"""

from __future__ import annotations

import json
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

import llguidance
import torch
from torch import Tensor

KINDS = ("json_object", "json_schema", "lark")
GRAMMARS_KEPT = 64  # compiled grammars kept per tokenizer
# JSON is written {"a": 1, "b": [2, 3]}: given free whitespace, a small model spends its tokens on
# newlines and indents (one answer in four of SmolLM2's ran out of tokens so).
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class ConstraintError(ValueError):
    """A constraint that does not compile (a bad schema or grammar), or a guide driven off it."""


@dataclass(frozen=True)
class OutputConstraint:
    """What the answer must be: `json_object` (any JSON object), `json_schema` (`spec`: the schema
    as a dict) or `lark` (`spec`: a grammar in llguidance's Lark syntax, `%json {...}` allowed)."""

    kind: str  # "json_object" | "json_schema" | "lark"
    spec: Any = None  # the JSON schema (dict) for json_schema; the grammar text for lark

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConstraintError(f"constraint kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.kind == "json_schema" and not isinstance(self.spec, dict):
            raise ConstraintError("a json_schema constraint's spec must be a JSON schema object")
        if self.kind == "lark" and not isinstance(self.spec, str):
            raise ConstraintError("a lark constraint's spec must be the grammar's text")

    def key(self) -> str:
        """The same text for the same constraint, whatever the order of a schema's keys."""
        spec = json.dumps(self.spec, sort_keys=True) if isinstance(self.spec, dict) else self.spec
        return f"{self.kind}\0{spec}"

    def grammar(self) -> str:
        """The constraint as an llguidance grammar."""
        try:
            if self.kind == "lark":
                return llguidance.LLMatcher.grammar_from_lark(self.spec)
            schema = self.spec if self.kind == "json_schema" else {"type": "object"}
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_LAYOUT)
        except ValueError as e:
            raise ConstraintError(str(e)) from None

    def check(self) -> None:
        """Raise ConstraintError, saying why, if the constraint does not compile (no tokenizer needed)."""
        error = llguidance.LLMatcher.validate_grammar(self.grammar())
        if error:
            raise ConstraintError(error)


class Compiler:
    """One tokenizer's llguidance tokenizer and its compiled grammars (built by `compiler`)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = llguidance.LLTokenizer(tokenizer.backend.to_str(), eos_token=sorted(tokenizer.eos_ids))
        self.grammars: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()

    def compile(self, constraint: OutputConstraint) -> llguidance.LLMatcher:
        """A compiled matcher at the grammar's start (kept: copy it before use)."""
        key = constraint.key()
        matcher = self.grammars.get(key)
        if matcher is None:
            matcher = llguidance.LLMatcher(self.tokenizer, constraint.grammar(), log_level=0)
            if matcher.is_error():
                raise ConstraintError(matcher.get_error())
            self.grammars[key] = matcher
            if len(self.grammars) > GRAMMARS_KEPT:
                self.grammars.popitem(last=False)
        self.grammars.move_to_end(key)
        return matcher

    def token_bytes(self, ids: Sequence[int]) -> list[bytes]:
        """Each token's own bytes (a token may hold part of a UTF-8 character)."""
        return [self.tokenizer.decode_bytes([i]) for i in ids]


_COMPILERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def compiler(tokenizer) -> Compiler:
    """The Compiler of a diffuse Tokenizer, built on first use."""
    found = _COMPILERS.get(tokenizer)
    if found is None:
        found = _COMPILERS[tokenizer] = Compiler(tokenizer)
    return found


class Guide:
    """One answer's place in its grammar: which tokens may come next, advanced token by token."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher
        self.consumed = 0  # tokens accepted so far

    @classmethod
    def start(cls, constraint: OutputConstraint, tokenizer) -> Guide:
        return cls(compiler(tokenizer).compile(constraint).deep_copy())

    @property
    def stopped(self) -> bool:
        """Whether the grammar is complete: nothing but an end of turn may follow."""
        return self.matcher.is_stopped()

    def mask(self, logits: Tensor) -> Tensor:
        """`logits` [..., V] with every token the grammar forbids next at -inf."""
        if self.matcher.is_error():
            raise ConstraintError(self.matcher.get_error())
        allowed = torch.frombuffer(bytearray(self.matcher.compute_logit_bias()), dtype=torch.uint8).bool()
        vocab = logits.shape[-1]
        if len(allowed) < vocab:  # rows of the LM head past the tokenizer's vocabulary: never allowed
            allowed = torch.cat([allowed, allowed.new_zeros(vocab - len(allowed))])
        return logits.masked_fill(~allowed[:vocab], float("-inf"))

    def allowed(self, tokens: Sequence[int]) -> int:
        """How many of `tokens`, in order from here, the grammar allows."""
        return self.matcher.validate_tokens(list(tokens))

    def accept(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise ConstraintError(f"token {token} is not allowed here: {self.matcher.get_error()}")
        self.consumed += 1

    def rewind(self, length: int) -> None:
        """Back to where the first `length` accepted tokens had left it."""
        if length < self.consumed:
            self.matcher.rollback(self.consumed - length)
            self.consumed = length
