"""`diffuse ask`: one question in, the answer streamed on stdout (logs go to stderr)."""

from __future__ import annotations

import argparse
import json
import sys

from diffuse.cli.common import add_bootstrap_options, add_compute_options, bootstrap_addrs, from_args, trio_run
from diffuse.cli.reach import add_discovery_options, add_hole_punch_option, use_mdns
from diffuse.cli.swarm import add_swarm_options, swarm_access
from diffuse.errors import DiffuseError
from diffuse.home import data_home


def add_sampling_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--system", help="system prompt (default: the model's own)")


def add_swarm_client_options(p: argparse.ArgumentParser) -> None:
    add_bootstrap_options(p)
    p.add_argument("--local-blocks", default="1,0", metavar="N,M", help="run the first N and last M blocks here "
                   "(default 1,0: embeddings never leave)")
    p.add_argument("--wire-dtype", default="fp16", choices=["fp16", "bf16", "fp32"], help="activations on the wire")
    p.add_argument("--wait", type=float, default=10.0, metavar="SECONDS", help="time for the swarm to cover all blocks")
    p.add_argument("--step-timeout", type=float, default=30.0, help="the most seconds a step waits for a peer "
                   "before it is replaced (sized by rows and the peer's throughput, at least 3 s, at most this)")
    p.add_argument("--rescue", action=argparse.BooleanOptionalAction, default=True, help="compute here, from the "
                   "store, blocks no live peer can take, memory allowing (default: on; off: wait for a replica)")
    p.add_argument("--route", choices=["auto", "chain", "star"], default="auto", help="hops forward outputs peer to "
                   "peer (chain), return each through here (star), or chain where a link comes up (auto)")
    p.add_argument("--route-wait", type=float, default=60.0, metavar="SECONDS",
                   help="how long a session waits for a replica of blocks it cannot compute here")
    p.add_argument("--trust", choices=["public", "private", "off"], help="public: canaries, 10%% spot checks, "
                   "evidence published; private: fewer, unpublished; off: none (only your own peers). Default: --mode")
    p.add_argument("--no-trust", dest="trust", action="store_const", const="off", help="same as --trust off")
    p.add_argument("--credit", action="store_true", help="ask as your `join` identity, paying peers with receipts "
                   "(standing with them; links your questions to it, docs/credits.md)")
    add_swarm_options(p)
    add_discovery_options(p)


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
    p.add_argument("--json", action="store_true", help="print one JSON object (text, token ids, timings, steps, route)")
    p.add_argument("--speculate", action=argparse.BooleanOptionalAction, default=None,
                   help="send guessed continuations with each step where they pay (default: on; off with --local)")
    p.add_argument("--exact", action=argparse.BooleanOptionalAction, default=False,
                   help="batch-invariant kernels here and on every peer (others are routed around), so speculation "
                        "and failover give greedy's answer bit for bit, ties included (default: off: the fast kernels "
                        "agree up to near-ties; on costs up to 2x per plain step)")
    p.add_argument("--model", help="store name or HF-layout directory (default: the embedded model)")
    p.add_argument("--history", action="store_const", const=True, help="keep it in `diffuse history` (default: if any)")
    p.add_argument("--ephemeral", dest="history", action="store_const", const=False, help="keep nothing")
    add_compute_options(p)
    add_sampling_options(p)
    add_swarm_client_options(p)
    add_hole_punch_option(p)
    add_fallback_option(p, "every other model in the store, largest first; with no swarm, this process")
    p.set_defaults(func=cmd_ask)


def add_fallback_option(p: argparse.ArgumentParser, auto: str) -> None:
    p.add_argument("--fallback", default="auto", type=_fallback_arg, metavar="auto|none|MODEL[,MODEL]",
                   help=f"when the model is not servable, answer with the first of these the swarm serves, and "
                        f"say so (auto, the default: {auto}; none: fail, naming the uncovered blocks)")


def _fallback_arg(text: str):
    from diffuse.client.fallback import parse_fallback

    try:
        return parse_fallback(text)
    except DiffuseError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def service_config(args, models: tuple[str | None, ...], *, fallback_from_store: bool, speculate: bool | None,
                   warm_up: bool = False):
    """The client service's config from the options registered above (`ask` and `api` share them).
    A client needs --local, or a swarm to find (bootstrap peers, or the LAN by mDNS)."""
    if args.local and (args.bootstrap or args.bootstrap_file or args.client_only):
        raise DiffuseError("--local runs the model here: give it without --bootstrap / --client-only")
    if not args.local and not (args.bootstrap or args.bootstrap_file) and args.mdns is False:
        raise DiffuseError("give --local, or --bootstrap ADDR to use a swarm (or drop --no-mdns to find one "
                           "on the LAN)")
    boot = [] if args.local else bootstrap_addrs(args, required=False)  # said before torch is imported
    from diffuse.client.service import ServiceConfig
    from diffuse.client.swarm import SwarmOptions
    from diffuse.client.swarm_backend import SwarmConfig, trust_options
    from diffuse.client.vault import for_answers
    from diffuse.model.load import parse_dtype

    swarm, exact = None, getattr(args, "exact", False)
    if not args.local:
        access = swarm_access(args)
        trust = args.trust or access.trust  # --trust, or the swarm mode's own form of the trust plane
        if args.step_timeout <= 0 or args.route_wait < 0:
            raise DiffuseError("--step-timeout must be positive and --route-wait not negative")
        options = from_args(SwarmOptions, args, local_blocks=parse_local_blocks(args.local_blocks), exact=exact,
                            dtype=parse_dtype(args.dtype), wire_dtype=parse_dtype(args.wire_dtype),
                            trust=trust_options(trust))
        swarm = SwarmConfig(tuple(boot), access, options, mdns=use_mdns(args, boot), hole_punch=args.hole_punch,
                            wait=args.wait, trust=trust, credit=args.credit)
    return ServiceConfig(data_home(args.home), models, swarm, args.fallback, fallback_from_store, speculate, exact,
                         args.dtype, args.device, warm_up, vault=for_answers(data_home(args.home), args.history))


def cmd_ask(args) -> int:
    config = service_config(args, (args.model,), fallback_from_store=True, speculate=args.speculate)
    from diffuse.client.sampling import SamplingParams  # imports torch: only when a command runs
    from diffuse.client.service import open_service

    try:
        params = from_args(SamplingParams, args)
    except ValueError as e:
        raise DiffuseError(str(e)) from None
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": args.question}]
    on_text = None if args.json else (lambda s: print(s, end="", flush=True))

    async def run():
        async with open_service(config) as service:
            return service.answer_dict(await service.answer(messages, params, on_text))

    answer = trio_run(run)
    print(json.dumps(answer) if args.json else "")
    if answer["finish_reason"].startswith("uncovered"):
        print(f"notice: the swarm lost {answer['finish_reason'].removeprefix('uncovered ')} mid-answer and this "
              "process does not hold them: the answer stops here", file=sys.stderr, flush=True)
    return 0
