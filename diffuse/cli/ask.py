"""`diffuse ask`: one question in, the answer streamed on stdout (logs go to stderr)."""

from __future__ import annotations

import argparse
import json

import trio

from diffuse.client.sampling import SamplingParams
from diffuse.errors import DiffuseError
from diffuse.home import data_home


def add_model_options(p: argparse.ArgumentParser) -> None:
    """Options every command that runs blocks shares (ask, join, api)."""
    p.add_argument("--model", help="store name or HF-layout directory (default: the embedded model)")
    p.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "fp16"],
                   help="compute dtype (bf16 is about 2x faster than fp32 on CPUs)")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda:0")


def add_sampling_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--system", help="system prompt (default: the model's own)")


def sampling_params(args) -> SamplingParams:
    try:
        return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                              repetition_penalty=args.repetition_penalty, seed=args.seed,
                              max_tokens=args.max_tokens, stop=args.stop)
    except ValueError as e:
        raise DiffuseError(str(e)) from None


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("ask", help="answer one question")
    p.add_argument("question")
    p.add_argument("--local", action="store_true", help="run the whole model in this process")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    add_model_options(p)
    add_sampling_options(p)
    p.set_defaults(func=cmd_ask)


def cmd_ask(args) -> int:
    params = sampling_params(args)
    if not args.local:
        raise DiffuseError("give --local (the swarm client arrives with the data plane)")
    from diffuse.client.local import open_local
    from diffuse.client.generate import complete

    model, tokenizer = open_local(data_home(args.home), args.model, args.dtype, args.device)
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": args.question}]
    prompt = tokenizer.encode_chat(messages)
    on_text = None if args.json else (lambda s: print(s, end="", flush=True))

    async def run():
        pipeline = model.session(len(prompt) + params.max_tokens)
        try:
            return await complete(pipeline, tokenizer, prompt, params, on_text)
        finally:
            await pipeline.close()

    result = trio.run(run)
    if args.json:
        print(json.dumps({"text": result.text, "token_ids": result.token_ids,
                          "finish_reason": result.finish_reason, "prompt_tokens": result.prompt_tokens,
                          "completion_tokens": len(result.token_ids), "timings": result.timings,
                          "tokens_per_s": result.timings["tokens_per_s"], "mode": "local"}))
    else:
        print()
    return 0
