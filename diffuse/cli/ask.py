"""`diffuse ask`: one question in, the answer streamed on stdout (logs go to stderr)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from diffuse.cli.common import bootstrap_addrs, trio_run
from diffuse.cli.reach import add_discovery_options, add_hole_punch_option, use_mdns
from diffuse.cli.swarm import add_swarm_options, swarm_access
from diffuse.control.modes import SwarmAccess
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


def sampling_params(args):
    from diffuse.client.sampling import SamplingParams  # imports torch: only when a command runs

    try:
        return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                              repetition_penalty=args.repetition_penalty, seed=args.seed,
                              max_tokens=args.max_tokens, stop=args.stop)
    except ValueError as e:
        raise DiffuseError(str(e)) from None


def add_swarm_client_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bootstrap", action="append", default=[], metavar="ADDR",
                   help="a sentinel or peer multiaddr with /p2p/ (repeatable)")
    p.add_argument("--bootstrap-file", type=Path, help="file with one bootstrap multiaddr per line")
    p.add_argument("--local-blocks", default="1,0", metavar="N,M",
                   help="run the first N and last M blocks here (default 1,0: embeddings never leave)")
    p.add_argument("--wire-dtype", default="fp16", choices=["fp16", "bf16", "fp32"], help="activations on the wire")
    p.add_argument("--wait", type=float, default=10.0, metavar="SECONDS",
                   help="how long to wait for the swarm to cover every block")
    p.add_argument("--step-timeout", type=float, default=30.0,
                   help="the most seconds a step may wait for a peer before it is replaced (each step's deadline "
                        "is sized by its rows and the peer's announced throughput, at least 3 s, at most this)")
    p.add_argument("--rescue", action=argparse.BooleanOptionalAction, default=True,
                   help="compute here, from the store, blocks no live peer can take (mid-answer or when a session "
                        "opens), memory allowing (default: on; off: wait for a replica, as for a model too big "
                        "for this machine)")
    p.add_argument("--route-wait", type=float, default=60.0, metavar="SECONDS",
                   help="how long a session waits for a replica of blocks no live peer serves when it cannot "
                        "compute them here")
    p.add_argument("--trust", choices=["public", "private", "off"],
                   help="public: canaries, 10%% spot checks, evidence published; private: fewer checks, nothing "
                        "published; off: no checks (only for peers you run yourself). Default: the --mode's")
    p.add_argument("--no-trust", dest="trust", action="store_const", const="off", help="same as --trust off")
    add_swarm_options(p)
    add_discovery_options(p)


def trust_mode(args: argparse.Namespace, access: SwarmAccess) -> str:
    """--trust, or the swarm mode's own form of the trust plane."""
    return args.trust or access.trust


def swarm_options(args: argparse.Namespace, access: SwarmAccess, exact: bool = False):
    """SwarmOptions from the options add_swarm_client_options registered (and --dtype, --device)
    for a swarm joined with `access`; exact: batch-invariant kernels on every hop."""
    from diffuse.client.swarm import SwarmOptions
    from diffuse.client.swarm_backend import trust_options
    from diffuse.model.load import parse_dtype

    if args.step_timeout <= 0 or args.route_wait < 0:
        raise DiffuseError("--step-timeout must be positive and --route-wait not negative")
    return SwarmOptions(parse_local_blocks(args.local_blocks), parse_dtype(args.dtype), parse_dtype(args.wire_dtype),
                        args.step_timeout, args.device, exact, trust_options(trust_mode(args, access)),
                        rescue=args.rescue, route_wait=args.route_wait)


def parse_local_blocks(text: str) -> tuple[int, int]:
    try:
        front, back = (int(x) for x in text.split(","))
        if front < 0 or back < 0:
            raise ValueError
        return front, back
    except ValueError:
        raise DiffuseError(f"--local-blocks wants N,M with N, M >= 0, got {text!r}") from None


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("ask", help="answer one question (locally with --local, else through the swarm)")
    p.add_argument("question")
    p.add_argument("--local", action="store_true", help="run the whole model in this process")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (text, token ids, timings, tokens per step, route, failovers)")
    p.add_argument("--speculate", action=argparse.BooleanOptionalAction, default=None,
                   help="send guessed continuations with each step, several tokens per round trip, where "
                        "they pay: a planner falls back to plain steps when they do not (default: on through "
                        "the swarm in every dtype; off with --local, where a step is no round trip)")
    p.add_argument("--exact", action=argparse.BooleanOptionalAction, default=False,
                   help="batch-invariant kernels here and on every peer (peers that cannot are routed "
                        "around): a token's logits have the same bits whether it is decoded alone, "
                        "verified in a tree of guesses or replayed after a failover, so speculation "
                        "returns exactly the greedy answer of --exact without it, ties included (default: "
                        "off; the fast kernels give plain greedy's answer up to near-ties; costs up to 2x "
                        "per plain step)")
    add_model_options(p)
    add_sampling_options(p)
    add_swarm_client_options(p)
    add_hole_punch_option(p)
    add_fallback_option(p, "every other model in the store, largest first; with no swarm reachable, "
                           "answer in this process")
    p.set_defaults(func=cmd_ask)


def add_fallback_option(p: argparse.ArgumentParser, auto: str) -> None:
    p.add_argument("--fallback", default="auto", type=_fallback_arg, metavar="auto|none|MODEL[,MODEL]",
                   help="when the asked model is not servable, answer with the first of these models the swarm "
                        f"serves, and say so (auto, the default: {auto}; none: fail, naming the uncovered blocks)")


def _fallback_arg(text: str):
    from diffuse.client.fallback import parse_fallback

    try:
        return parse_fallback(text)
    except DiffuseError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def service_config(args, models: tuple[str | None, ...], *, fallback_from_store: bool, speculate: bool | None,
                   warm_up: bool = False):
    """The client service's config from the options registered above (`ask` and `api` share them)."""
    from diffuse.client.service import ServiceConfig
    from diffuse.client.swarm_backend import SwarmConfig

    swarm, exact = None, getattr(args, "exact", False)
    if not args.local:
        boot = bootstrap_addrs(args, required=False)
        access = swarm_access(args)
        swarm = SwarmConfig(tuple(boot), access, swarm_options(args, access, exact), mdns=use_mdns(args, boot),
                            hole_punch=args.hole_punch, wait=args.wait, trust=trust_mode(args, access))
    return ServiceConfig(data_home(args.home), models, swarm, args.fallback, fallback_from_store, speculate, exact,
                         args.dtype, args.device, warm_up)


def check_reach(args) -> None:
    """A client needs --local, or a swarm to find (bootstrap peers, or the LAN by mDNS)."""
    if args.local and (args.bootstrap or args.bootstrap_file or args.client_only):
        raise DiffuseError("--local runs the model here: give it without --bootstrap / --client-only")
    if not args.local and not (args.bootstrap or args.bootstrap_file) and args.mdns is False:
        raise DiffuseError("give --local, or --bootstrap ADDR to use a swarm (or drop --no-mdns to find one "
                           "on the LAN)")


def cmd_ask(args) -> int:
    from diffuse.client.service import open_service

    params = sampling_params(args)
    check_reach(args)
    config = service_config(args, (args.model,), fallback_from_store=True, speculate=args.speculate)
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": args.question}]
    on_text = None if args.json else (lambda s: print(s, end="", flush=True))

    async def run():
        async with open_service(config) as service:
            answer = await service.answer(messages, params, on_text)
            return answer, service.mode, service.reason

    answer, mode, reason = trio_run(run)
    result = answer.completion
    if args.json:
        swarm = {"swarm_mode": config.swarm.access.mode, "trust": config.swarm.trust} if mode == "swarm" else {}
        print(json.dumps({"text": result.text, "token_ids": result.token_ids,
                          "finish_reason": result.finish_reason, "prompt_tokens": result.prompt_tokens,
                          "completion_tokens": len(result.token_ids), "timings": result.timings,
                          "tokens_per_s": result.timings["tokens_per_s"], "speculate": answer.speculated,
                          "exact": args.exact, "tokens_per_step": round(result.tokens_per_step, 3),
                          "positions_per_step": round(result.positions_per_step, 3), "steps": result.steps,
                          "positions": result.positions, "step_modes": result.modes,
                          "modes": result.mode_counts(), "mode": mode, "model": answer.model}
                         | ({"reason": reason} if reason else {}) | swarm | answer.report))
    else:
        print()
    if result.finish_reason.startswith("uncovered"):
        print(f"notice: the swarm lost {result.finish_reason.removeprefix('uncovered ')} mid-answer and this "
              "process does not hold them: the answer stops here", file=sys.stderr, flush=True)
    return 0
