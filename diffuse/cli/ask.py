"""`diffuse ask`: one question in, the answer streamed on stdout (logs go to stderr)."""

from __future__ import annotations

import argparse
import json

from diffuse.cli.common import add_bootstrap_options, add_compute_options, bootstrap_addrs, from_args, trio_run
from diffuse.cli.reach import add_discovery_options, add_hole_punch_option
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
    p.add_argument("--from-swarm", action="store_true", help="first fetch the head, tokenizer, local blocks by hash")
    p.add_argument("--model-hash", metavar="SHA256", help="with --from-swarm: the manifest (or model) hash to trust")
    p.add_argument("--wait", type=float, default=10.0, metavar="SECONDS", help="time for the swarm to cover all blocks")
    p.add_argument("--step-timeout", type=float, default=30.0, help="the most seconds a step waits for a peer "
                   "before it is replaced (sized by rows and the peer's throughput, at least 3 s, at most this)")
    p.add_argument("--rescue", action=argparse.BooleanOptionalAction, default=True, help="compute here, from the "
                   "store, blocks no live peer can take, memory allowing (default: on; off: wait for a replica)")
    p.add_argument("--route", choices=["auto", "chain", "star"], default="auto", help="hops forward outputs peer to "
                   "peer (chain), return each through here (star), or chain where a link comes up (auto)")
    p.add_argument("--accept-quant", help="peers' variants to route through: LIST (none,int8,int4) or any; "
                   "default: --quant's and more bits")
    p.add_argument("--route-wait", type=float, default=60.0, metavar="SECONDS",
                   help="how long a session waits for a replica of blocks it cannot compute here")
    p.add_argument("--trust", choices=["public", "private", "off"], help="public: canaries, 10%% spot checks, "
                   "evidence published; private: fewer, unpublished; off: none (only your own peers). Default: --mode")
    p.add_argument("--no-trust", dest="trust", action="store_const", const="off", help="same as --trust off")
    p.add_argument("--audit-rate", type=float, metavar="P", help="share of hop sessions audited (default: --trust's)")
    p.add_argument("--credit", action="store_true", help="ask as your `join` identity, paying peers with receipts "
                   "(standing with them; links your questions to it, docs/credits.md)")
    add_swarm_options(p)
    add_discovery_options(p)


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
    p.add_argument("--no-daemon", action="store_true", help="answer in this process even while a daemon runs")
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
        raise DiffuseError("give --local, or --bootstrap ADDR to use a swarm (or drop --no-mdns to find one on a LAN)")
    boot, access, mdns = ([], None, False) if args.local else swarm_of(args)
    from diffuse.client.options import service_config as config
    return config(vars(args), data_home(args.home), models, boot, access, mdns,
                  fallback_from_store=fallback_from_store, speculate=speculate, warm_up=warm_up)


def swarm_of(args):
    """The swarm's bootstrap addresses, access and mDNS, from the options (before torch is imported)."""
    from diffuse.control.bootstrap import mdns_wanted
    boot = bootstrap_addrs(args, required=False)
    return boot, swarm_access(args), mdns_wanted(getattr(args, "mdns", None), boot)


def cmd_ask(args) -> int:
    from diffuse.daemon.client import ask, ask_request, fetched_first, notice  # --from-swarm: fetched first

    args.model = fetched_first(vars(args), data_home(args.home), (args.model,), lambda: swarm_of(args))[0]
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": args.question}]
    on_text = None if args.json else (lambda s: print(s, end="", flush=True))
    answer = None if args.no_daemon else ask(data_home(args.home), ask_request(vars(args), messages), on_text, notice)
    if answer is None:  # no daemon, or not one for these options: in this process
        config = service_config(args, (args.model,), fallback_from_store=True, speculate=args.speculate)
        from diffuse.client.sampling import SamplingParams  # imports torch: only when a command runs
        from diffuse.client.service import open_service

        try:
            params = from_args(SamplingParams, args)
        except ValueError as e:
            raise DiffuseError(str(e)) from None

        async def run():
            async with open_service(config) as service:
                return service.answer_dict(await service.answer(messages, params, on_text))

        answer = trio_run(run)
    print(json.dumps(answer) if args.json else "")
    if answer["finish_reason"].startswith("uncovered"):
        notice(f"the swarm lost {answer['finish_reason'].removeprefix('uncovered ')} mid-answer and this process "
               "does not hold them: the answer stops here")
    return 0
