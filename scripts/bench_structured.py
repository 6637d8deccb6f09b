#!/usr/bin/env python
"""What an output constraint costs: decode tokens/s with a JSON-schema constraint against
without, on the same prompts in the same run, and the constraint's own costs.

    .venv/bin/python scripts/bench_structured.py [--home DIR] [--dtype bf16] [--tokens 96]
        [--rounds 2] [--threads 2]

The model runs in this process as `diffuse api --local` runs it (greedy, plain decoding). Each
prompt is answered without a constraint and with PERSON's schema, in alternating order per
round; decode tokens/s counts the tokens after the first over the time after the first. Then,
apart from the model: the constraint's work per token (the mask before it is drawn and the step
after it, replaying the constrained answers through a fresh guide), and compile times: the
llguidance tokenizer's set-up (once per tokenizer), a schema's first compile, the same schema
again (cached: a copy), and another schema once the tokenizer is warm.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import trio

from diffuse.client.constrain import Compiler, Guide, OutputConstraint, compiler
from diffuse.client.generate import Completion, complete, session_length
from diffuse.client.local import open_local
from diffuse.client.sampling import SamplingParams
from diffuse.home import data_home

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 32},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "maxLength": 40},
        "city": {"type": "string", "enum": ["Paris", "London", "Berlin", "Madrid", "Rome"]},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
        "employed": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "city", "skills", "employed"],
    "additionalProperties": False,
}
ORDER = {  # another typical schema, compiled once the tokenizer is warm
    "type": "object",
    "properties": {"id": {"type": "integer"}, "items": {"type": "array", "items": {
        "type": "object", "properties": {"sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}},
        "required": ["sku", "qty"], "additionalProperties": False}}, "paid": {"type": "boolean"}},
    "required": ["id", "items", "paid"], "additionalProperties": False,
}
PROMPTS = [
    "Describe a software engineer who lives in Berlin.",
    "Invent a chef from Paris and describe them.",
    "Tell me about a retired teacher in Rome.",
    "Describe a young student living in Madrid.",
    "Who might run a small bookshop in London? Describe them.",
    "Describe a nurse who works nights in Paris.",
]


def answer(model, tok, text: str, params: SamplingParams) -> Completion:
    prompt = tok.encode_chat([{"role": "user", "content": text + " Answer as JSON."}])

    async def run() -> Completion:
        pipe = model.session(session_length(len(prompt), params.max_tokens))
        try:
            return await complete(pipe, tok, prompt, params)
        finally:
            await pipe.close()

    return trio.run(run)


def decode_rates(model, tok, tokens: int, rounds: int) -> tuple[dict[str, list[Completion]], dict[str, float]]:
    """Every prompt answered both ways per round, order alternating; tokens/s over all answers."""
    modes = {"plain": None, "json_schema": OutputConstraint("json_schema", PERSON)}
    done: dict[str, list[Completion]] = {m: [] for m in modes}
    seconds = {m: 0.0 for m in modes}
    for r in range(rounds):
        for i, text in enumerate(PROMPTS):
            order = list(modes) if (r + i) % 2 == 0 else list(reversed(modes))
            for mode in order:
                c = answer(model, tok, text, SamplingParams(max_tokens=tokens, constraint=modes[mode]))
                done[mode].append(c)
                seconds[mode] += c.timings["decode_s"]
    rates = {m: sum(len(c.token_ids) - 1 for c in done[m]) / seconds[m] for m in modes}
    return done, rates


def per_token_us(tok, answers: list[Completion]) -> tuple[float, float]:
    """Median microseconds per token of the constraint's mask and of its step, over the answers."""
    masks, steps = [], []
    logits = torch.zeros(tok.vocab_size)
    for c in answers:
        guide = Guide.start(OutputConstraint("json_schema", PERSON), tok)
        for token in c.token_ids:
            t0 = time.perf_counter()
            guide.mask(logits)
            t1 = time.perf_counter()
            guide.accept(token)
            masks.append(t1 - t0)
            steps.append(time.perf_counter() - t1)
    return statistics.median(masks) * 1e6, statistics.median(steps) * 1e6


def compile_ms(tok, repeats: int = 5) -> dict[str, float]:
    """Median milliseconds of each kind of compile, each from a fresh llguidance tokenizer."""
    out: dict[str, list[float]] = {"tokenizer set-up": [], "schema, first compile": [],
                                   "same schema again (cached)": [], "another schema, tokenizer warm": []}
    for _ in range(repeats):
        t0 = time.perf_counter()
        fresh = Compiler(tok)
        t1 = time.perf_counter()
        fresh.compile(OutputConstraint("json_schema", PERSON)).deep_copy()
        t2 = time.perf_counter()
        fresh.compile(OutputConstraint("json_schema", PERSON)).deep_copy()
        t3 = time.perf_counter()
        fresh.compile(OutputConstraint("json_schema", ORDER)).deep_copy()
        t4 = time.perf_counter()
        for name, s in zip(out, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            out[name].append(s * 1e3)
    return {k: statistics.median(v) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--home", type=Path, default=None)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = open_local(data_home(args.home), None, args.dtype)
    compiler(tok)  # the tokenizer set-up is measured apart, below
    answer(model, tok, PROMPTS[0], SamplingParams(max_tokens=8))  # warm-up
    done, rates = decode_rates(model, tok, args.tokens, args.rounds)
    print(f"{args.dtype}, {args.threads} threads, {len(PROMPTS)} prompts x {args.rounds} rounds, greedy\n")
    print("| mode | answers | tokens | ended by the grammar or eos | decode tok/s | vs plain |")
    print("|---|---|---|---|---|---|")
    for mode, answers in done.items():
        stopped = sum(c.finish_reason == "stop" for c in answers)
        print(f"| {mode} | {len(answers)} | {sum(len(c.token_ids) for c in answers)} | {stopped} | "
              f"{rates[mode]:.1f} | {rates[mode] / rates['plain']:.2f}x |")
    mask, step = per_token_us(tok, done["json_schema"])
    share = (mask + step) * 1e-6 * rates["plain"]
    print(f"\nconstraint per token (median): mask {mask:.0f} us, step {step:.0f} us = "
          f"{share:.1%} of a plain decode step")
    print("\n| compile | ms (median of 5) |\n|---|---|")
    for name, ms in compile_ms(tok).items():
        print(f"| {name} | {ms:.2f} |")


if __name__ == "__main__":
    main()
