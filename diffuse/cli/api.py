"""`diffuse api`: an OpenAI-compatible endpoint backed by the swarm (or by a local model).

Prints `listening on http://HOST:PORT` on stdout once it accepts connections (the real port
when --listen asked for port 0); logs go to stderr. SIGINT and SIGTERM stop it cleanly.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import trio

from diffuse.cli.ask import add_fallback_option, add_swarm_client_options, swarm_options
from diffuse.cli.common import add_train_draft_option, bootstrap_addrs, first_leaf, trio_run
from diffuse.cli.reach import add_hole_punch_option
from diffuse.client import draft_trainer
from diffuse.errors import DiffuseError
from diffuse.home import data_home


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("api", help="serve the OpenAI API (chat/completions, completions, models), "
                                   "/metrics and a status page")
    p.add_argument("--listen", default="127.0.0.1:8000", metavar="HOST:PORT",
                   help="address to serve on (default 127.0.0.1:8000; port 0 picks a free one)")
    p.add_argument("--local", action="store_true", help="run the whole model in this process instead of the swarm")
    add_swarm_client_options(p)
    p.add_argument("--model", action="append", default=[],
                   help="store name or HF-layout directory (repeatable; default: the embedded model)")
    p.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "fp16"],
                   help="compute dtype of the blocks this process runs")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda:0")
    p.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="accept this Bearer token (repeatable; prefer --api-key-file: argv is visible to "
                        "other users). Without keys the API is open.")
    p.add_argument("--api-key-file", type=Path, help="file with one accepted key per line (# comments)")
    p.add_argument("--max-sessions", type=int, default=16,
                   help="concurrent inference sessions; requests beyond them wait in a queue (default 16)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="sessions requests may wait for when all are in use; beyond, HTTP 429 with Retry-After "
                        "(default 64)")
    p.add_argument("--max-tokens", type=int, default=256,
                   help="answer length when a request gives no max_tokens (default 256)")
    add_fallback_option(p, "the other --model models, largest first")
    p.add_argument("--speculate", action=argparse.BooleanOptionalAction, default=True,
                   help="answers through the swarm send guessed continuations with each step where they pay "
                        "(default: on; with --local never: a step there is no round trip)")
    add_hole_punch_option(p)
    add_train_draft_option(p)
    p.set_defaults(func=cmd_api)


def fallbacks(args) -> dict[str, tuple[str, ...]]:
    """Each served model's fallback order, among the models this API serves."""
    from diffuse.client.fallback import fallback_order
    from diffuse.model import store

    home = data_home(args.home)
    served = [store.info(store.resolve(home, name)) for name in args.model or [None]]
    held = {m.manifest.model_id: m.size_bytes for m in served}
    return {m: tuple(fallback_order(args.fallback, m, held)) for m in held}


def api_keys(args) -> frozenset[str]:
    keys = [k.strip() for k in args.api_key]
    if args.api_key_file:
        try:
            lines = args.api_key_file.read_text().splitlines()
        except OSError as e:
            raise DiffuseError(f"cannot read --api-key-file {args.api_key_file}: {e.strerror}") from None
        keys += [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
    if any(not k for k in keys):
        raise DiffuseError("an empty --api-key would accept anyone")
    return frozenset(keys)


@asynccontextmanager
async def local_backend(args) -> AsyncIterator:
    from diffuse.api.backend import LocalBackend

    backend = LocalBackend.open(data_home(args.home), args.model or [None], args.dtype, args.device)
    await backend.warm_up()
    yield backend


def swarm_backend(args):
    from diffuse.api.swarm import open_swarm_backend
    from diffuse.cli.reach import use_mdns
    from diffuse.cli.swarm import swarm_access

    access = swarm_access(args)
    boot = bootstrap_addrs(args, required=False)
    return open_swarm_backend(data_home(args.home), args.model or [None], boot, swarm_options(args, access),
                              args.wait, swarm_key=access.key, allow=access.allow, mdns=use_mdns(args, boot),
                              hole_punch=args.hole_punch, speculate=args.speculate)


def open_backend(args):
    """The backend as an async context manager: the swarm's runs a libp2p node for its lifetime."""
    if args.local:
        if args.bootstrap or args.bootstrap_file or args.client_only:
            raise DiffuseError("--local runs the model here: give it without --bootstrap / --client-only")
        return local_backend(args)
    if not (args.bootstrap or args.bootstrap_file) and args.mdns is False:
        raise DiffuseError("give --bootstrap ADDR (a sentinel of the swarm to serve), or --local, or drop "
                           "--no-mdns to find the swarm on the LAN")
    return swarm_or_local(args)


@asynccontextmanager
async def swarm_or_local(args) -> AsyncIterator:
    """The swarm's backend; when no bootstrap peer answers at all (none refused us: another key or
    mode is an error), the served models that fit half the memory available, run here, said on
    stderr (`--fallback none` refuses instead)."""
    from diffuse.client.fallback import NONE
    from diffuse.control.dht import BootstrapError

    unreachable: list[BootstrapError] = []
    opened = False
    try:
        async with swarm_backend(args) as backend:
            opened = True
            yield backend
    except* BootstrapError as eg:
        error = first_leaf(eg)
        if opened or error.refused or args.fallback == NONE:
            raise error from None
        unreachable.append(error)
    if unreachable:
        async with _local_instead(args, unreachable[0]) as backend:
            yield backend


@asynccontextmanager
async def _local_instead(args, error) -> AsyncIterator:
    from diffuse.api.backend import LocalBackend
    from diffuse.client.rescue import MEMORY_SHARE
    from diffuse.control.placement import available_memory
    from diffuse.model import store

    home = data_home(args.home)
    room = MEMORY_SHARE * available_memory()
    names = [name for name in args.model or [None] if store.info(store.resolve(home, name)).size_bytes <= room]
    if not names:
        raise error
    served = ", ".join(n or "the default model" for n in names)
    print(f"notice: no swarm answered ({str(error).splitlines()[0]}); serving {served} from this process",
          file=sys.stderr, flush=True)
    backend = LocalBackend.open(home, names, args.dtype, args.device)
    await backend.warm_up()
    yield backend


def cmd_api(args) -> int:
    from diffuse.api.app import Settings, create_app
    from diffuse.http import parse_listen, serve_http

    parse_listen(args.listen)
    if args.max_sessions < 1 or args.max_tokens < 1 or args.max_queue < 0:
        raise DiffuseError("--max-sessions and --max-tokens must be at least 1, --max-queue at least 0")
    settings = Settings(api_keys=api_keys(args), max_sessions=args.max_sessions, max_queue=args.max_queue,
                        default_max_tokens=args.max_tokens, fallback=fallbacks(args))

    backend_cm = open_backend(args)
    activity: dict[str, float] = {}  # /v1 requests being answered: the draft head trains only while none are

    async def main() -> None:
        async with backend_cm as backend, trio.open_nursery() as nursery:
            app = draft_trainer.counting(create_app(backend, settings), activity)
            binds = await nursery.start(serve_http, app, args.listen)
            print(f"listening on {binds[0]}", flush=True)
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for _ in signals:
                    nursery.cancel_scope.cancel()
                    break

    with draft_trainer.background(data_home(args.home), (args.model or [None])[0],
                                  lambda: activity.get("requests", 0) > 0, args.train_draft):
        trio_run(main)
    return 0
