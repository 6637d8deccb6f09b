"""`diffuse ask`: one question in, the answer streamed on stdout (logs go to stderr)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import trio

from diffuse.cli.common import bootstrap_addrs, first_leaf, trio_run
from diffuse.cli.reach import add_discovery_options, add_hole_punch_option, client_listen, use_mdns
from diffuse.cli.swarm import add_swarm_options, swarm_access
from diffuse.client import fallback
from diffuse.client.swarm import SwarmClient
from diffuse.control.dht import BootstrapError
from diffuse.control.identity import ephemeral
from diffuse.control.modes import SwarmAccess
from diffuse.control.node import NodeConfig, open_node
from diffuse.control.routing import NoRoute
from diffuse.errors import DiffuseError
from diffuse.home import data_home
from diffuse.model import store
from diffuse.model.weights import load_manifest
from diffuse.trust import reputation


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
    p.add_argument("--trust", choices=list(TRUST_MODES),
                   help="public: canaries, 10%% spot checks, evidence published; private: fewer checks, nothing "
                        "published; off: no checks (only for peers you run yourself). Default: the --mode's")
    p.add_argument("--no-trust", dest="trust", action="store_const", const="off", help="same as --trust off")
    add_swarm_options(p)
    add_discovery_options(p)


# Trust-plane settings per mode (see DESIGN.md, "Trust plane"); None turns the checks off.
TRUST_MODES = {"public": {}, "private": {"spot_rate": 0.02, "canary_rate": 0.05, "publish": False}, "off": None}


def trust_mode(args: argparse.Namespace, access: SwarmAccess) -> str:
    """--trust, or the swarm mode's own form of the trust plane."""
    return args.trust or access.trust


def swarm_options(args: argparse.Namespace, access: SwarmAccess, exact: bool = False):
    """SwarmOptions from the options add_swarm_client_options registered (and --dtype, --device)
    for a swarm joined with `access`; exact: batch-invariant kernels on every hop."""
    from diffuse.client.swarm import SwarmOptions
    from diffuse.model.load import parse_dtype
    from diffuse.trust.guard import TrustOptions

    mode = TRUST_MODES[trust_mode(args, access)]
    if args.step_timeout <= 0 or args.route_wait < 0:
        raise DiffuseError("--step-timeout must be positive and --route-wait not negative")
    return SwarmOptions(parse_local_blocks(args.local_blocks), parse_dtype(args.dtype), parse_dtype(args.wire_dtype),
                        args.step_timeout, args.device, exact,
                        None if mode is None else TrustOptions(**mode), rescue=args.rescue,
                        route_wait=args.route_wait)


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


def cmd_ask(args) -> int:
    params = sampling_params(args)
    if args.local and args.client_only:
        raise DiffuseError("--client-only and --local contradict each other")
    if not args.local and not (args.bootstrap or args.bootstrap_file) and args.mdns is False:
        raise DiffuseError("give --local, or --bootstrap ADDR to use a swarm (or drop --no-mdns to find one "
                           "on the LAN)")
    speculating = args.speculate if args.speculate is not None else not args.local
    exact = args.exact
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": args.question}]
    on_text = None if args.json else (lambda s: print(s, end="", flush=True))
    info: dict = {}
    if args.local:
        info["mode"] = "local"
        result = _answer_here(args, args.model, messages, params, on_text, speculating, exact)
    else:
        result = _ask_swarm(args, messages, params, on_text, info, speculating, exact)
    speculated = speculating if info.get("mode") == "swarm" else bool(args.speculate)  # in process: only if asked
    if args.json:
        print(json.dumps({"text": result.text, "token_ids": result.token_ids,
                          "finish_reason": result.finish_reason, "prompt_tokens": result.prompt_tokens,
                          "completion_tokens": len(result.token_ids), "timings": result.timings,
                          "tokens_per_s": result.timings["tokens_per_s"], "speculate": speculated,
                          "exact": exact,
                          "tokens_per_step": round(result.tokens_per_step, 3),
                          "positions_per_step": round(result.positions_per_step, 3), "steps": result.steps,
                          "positions": result.positions, "step_modes": result.modes,
                          "modes": result.mode_counts()} | info))
    else:
        print()
    if result.finish_reason.startswith("uncovered"):
        print(f"notice: the swarm lost {result.finish_reason.removeprefix('uncovered ')} mid-answer and this "
              "process does not hold them: the answer stops here", file=sys.stderr, flush=True)
    return 0


def _ask_swarm(args, messages, params, on_text, info: dict, speculating: bool, exact: bool):
    """Through the swarm, with the asked model or the best fallback that is servable; in this
    process when no bootstrap peer answers at all and the store holds a model small enough."""
    boot = bootstrap_addrs(args, required=False)
    mdns = use_mdns(args, boot)
    access = swarm_access(args)
    home = data_home(args.home)
    asked_dir = store.resolve(home, args.model)
    asked = load_manifest(asked_dir).model_id
    order = fallback.fallback_order(args.fallback, asked, fallback.held_models(home))
    opts = swarm_options(args, access, exact)
    unreachable: list[BootstrapError] = []

    async def run():
        # An ephemeral identity per question: nothing links two of a user's sessions.
        try:
            config = NodeConfig(listen=client_listen(args), bootstrap=boot, server=False, swarm_key=access.key,
                                allow=access.allow, mdns=mdns, hole_punch=args.hole_punch)
            async with open_node(ephemeral(), config, codecs=reputation.swarm_codecs()) as node:
                client = await _covered_client(node, asked_dir, opts, args.wait, order, home)
                try:
                    return await _answer_swarm(client, node, args, messages, params, on_text, info, speculating,
                                               access)
                except NoRoute as e:  # announced, but no replica opened a session (dead peers' records linger)
                    other = await _fallback_client(node, client, order, home, opts, str(e))
                    if other is None:
                        raise
                    return await _answer_swarm(other, node, args, messages, params, on_text, info, speculating,
                                               access)
        except* BootstrapError as eg:
            error = first_leaf(eg)
            if error.refused or args.fallback == fallback.NONE:
                raise error from None
            unreachable.append(error)

    result = trio_run(run)
    if not unreachable:
        return result
    return _answer_in_process(args, home, asked, order, unreachable[0], messages, params, on_text, info,
                              speculating, exact)


async def _covered_client(node, asked_dir: Path, opts, wait: float, order: list[str], home: Path):
    """A client of the asked model once the swarm covers it (waiting up to `wait` s), else of the
    first fallback it covers, else of the asked model still (the route will say what is missing)."""
    client = SwarmClient(node, asked_dir, opts)
    deadline = trio.current_time() + wait
    while not await client.covered() and trio.current_time() < deadline:
        await trio.sleep(0.25)
    if not await client.covered():
        client = await _fallback_client(node, client, order, home, opts, await client.uncovered()) or client
    return client


async def _fallback_client(node, client, order: list[str], home: Path, opts, why: str):
    """The first model of `order` the swarm covers now, with a notice on stderr; None if none."""
    for model_id in order:
        if model_id == client.model_id:
            continue
        other = SwarmClient(node, store.resolve(home, fallback.store_name(home, model_id)), opts)
        if await other.covered():
            print(fallback.notice(client.model_id, other.model_id, why), file=sys.stderr, flush=True)
            return other
    return None


async def _answer_swarm(client, node, args, messages, params, on_text, info: dict, speculating: bool, access):
    from diffuse.client.draft_fetch import drop_fetched
    from diffuse.client.generate import complete, session_length
    from diffuse.client.speculative import SpecState
    from diffuse.client.swarm import remotes_of, route_report
    from diffuse.model.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(client.model_dir)
    prompt = tokenizer.encode_chat(messages)
    home = data_home(args.home)
    speculate = await _swarm_spec_config(client, home) if speculating else None
    state = SpecState() if speculate is not None else None
    t0 = trio.current_time()
    pipeline = await client.session(session_length(len(prompt), params.max_tokens, speculate))
    info["route_s"] = round(trio.current_time() - t0, 4)
    result = None
    try:
        result = await complete(pipeline, tokenizer, prompt, params, on_text, speculate=speculate, state=state)
        if speculate is not None and speculate.draft is not None:
            info["draft_head"] = {"first_guesses": state.draft_trials, "right": state.draft_hits}
            if state.draft_is_poor() and drop_fetched(home, client.model_dir.name):
                _notice(f"the draft head fetched from the swarm guessed {state.draft_hits} of "
                        f"{state.draft_trials} first tokens right: dropped, and not fetched again")
        return result
    finally:
        tokens = len(prompt) + (len(result.token_ids) if result is not None else 0)
        report = route_report(pipeline, tokens)
        route = [dict(h) | {"reached": node.relaying.reached(h["peer"])} for h in report["route"]]
        info.update(mode="swarm", model=client.model_id, route=route, in_process=report["in_process"],
                    computed=report["tokens"], failovers=report["failovers"],
                    finished_here_from=remote_rescue(pipeline), local_blocks=list(client.opts.local_blocks),
                    swarm_mode=access.mode, trust=trust_mode(args, access),
                    checks=client.guard.status() if client.guard else None)
        await pipeline.close()
        info["bytes_sent"] = sum(r.stats.bytes_sent for r in remotes_of(pipeline))


def remote_rescue(pipeline) -> int | None:
    """Committed tokens when this process took over blocks of the swarm's (None: it never did)."""
    return min((s.rescued_at for s in pipeline.stages if getattr(s, "rescued_at", None) is not None), default=None)


def _answer_in_process(args, home: Path, asked: str, order: list[str], error, messages, params, on_text,
                       info: dict, speculating: bool, exact: bool):
    """No swarm answered: the asked model here if it fits in memory, else the first fallback that does."""
    from diffuse.client.rescue import MEMORY_SHARE
    from diffuse.control.placement import available_memory

    held = fallback.held_models(home)
    room = MEMORY_SHARE * available_memory()
    model_id = next((m for m in [asked, *order] if m in held and held[m] <= room), None)
    if model_id is None:
        raise error
    what = model_id if model_id == asked else f"{model_id} instead of {asked}"
    print(f"notice: no swarm answered ({str(error).splitlines()[0]}); answering in this process with {what}",
          file=sys.stderr, flush=True)
    info.update(mode="local", model=model_id, reason="no swarm reachable")
    # Here a step is no round trip: speculate only if asked to.
    return _answer_here(args, fallback.store_name(home, model_id), messages, params, on_text, bool(args.speculate),
                        exact)


def _answer_here(args, name: str | None, messages, params, on_text, speculating: bool, exact: bool):
    """The whole model `name` of the store in this process."""
    from diffuse.client.generate import complete, session_length
    from diffuse.client.local import open_local

    home = data_home(args.home)
    model, tokenizer = open_local(home, name, args.dtype, args.device)
    prompt = tokenizer.encode_chat(messages)
    speculate = _spec_config(home, store.resolve(home, name)) if speculating else None

    async def run():
        pipeline = model.session(session_length(len(prompt), params.max_tokens, speculate), exact=exact)
        try:
            return await complete(pipeline, tokenizer, prompt, params, on_text, speculate=speculate)
        finally:
            await pipeline.close()

    return trio.run(run)


async def _swarm_spec_config(client, home: Path):
    """Speculation settings through the swarm: with this client's draft head, else one fetched
    from a peer that offers it (verified against its announced hash; refusals said on stderr)."""
    from diffuse.client.draft_fetch import obtain_draft_head
    from diffuse.client.speculative import SpecConfig

    return SpecConfig(draft=await obtain_draft_head(client.node, await client.records(), home, client.model_dir,
                                                    say=_notice))


def _notice(text: str) -> None:
    print(f"notice: {text}", file=sys.stderr, flush=True)


def _spec_config(home: Path, path: Path):
    """Speculation settings for the model at `path`, with the draft head `diffuse model draft-head`
    trained for it, if any (each model its own: a fallback never uses the asked model's)."""
    from diffuse.client import draft_head
    from diffuse.client.speculative import SpecConfig
    from diffuse.model.config import ModelConfig

    return SpecConfig(draft=draft_head.load(draft_head.path(home, path.name), ModelConfig.load(path).hidden_size))
