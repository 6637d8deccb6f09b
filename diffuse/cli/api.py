"""`diffuse api`: an OpenAI-compatible endpoint backed by the swarm (or by a local model). Prints
`listening on http://HOST:PORT` (the real port) once it accepts connections; SIGINT or SIGTERM stops it.
--from-swarm: fetched by this process first, then served by the daemon or here (daemon/client.py fetched_first)."""

from __future__ import annotations

import argparse
from pathlib import Path

from diffuse.cli.ask import add_fallback_option, add_swarm_client_options, service_config, swarm_of
from diffuse.cli.common import add_compute_options, add_train_draft_option, trio_run
from diffuse.cli.reach import add_hole_punch_option
from diffuse.errors import DiffuseError
from diffuse.home import data_home


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("api", help="serve the OpenAI API (chat/completions, completions, models), /metrics, status")
    p.add_argument("--listen", default="127.0.0.1:8000", metavar="HOST:PORT",
                   help="address to serve on (default 127.0.0.1:8000; port 0 picks a free one)")
    p.add_argument("--local", action="store_true", help="run the whole model in this process instead of the swarm")
    add_swarm_client_options(p)
    p.add_argument("--model", action="append", default=[],
                   help="store name or HF-layout directory (repeatable; default: the embedded model)")
    add_compute_options(p)
    p.add_argument("--api-key", action="append", default=[], metavar="KEY", help="accept this Bearer token "
                   "(repeatable; prefer --api-key-file: argv is visible to other users). Without keys the API is open.")
    p.add_argument("--api-key-file", type=Path, help="file with one accepted key per line (# comments)")
    p.add_argument("--max-sessions", type=int, default=16, help="concurrent sessions; more requests queue (default 16)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests that may queue; beyond, HTTP 429 with Retry-After (default 64)")
    p.add_argument("--max-tokens", type=int, default=256, help="answer length if a request gives none (default 256)")
    p.add_argument("--history", action="store_true", help="keep answers in `diffuse history` unless asked not to")
    add_fallback_option(p, "the other --model models, largest first")
    p.add_argument("--speculate", action=argparse.BooleanOptionalAction, default=True, help="through the swarm, send "
                   "guessed continuations with each step where they pay (default: on; never with --local)")
    add_hole_punch_option(p)
    add_train_draft_option(p)
    p.add_argument("--no-daemon", action="store_true", help="serve from this process even while a daemon runs")
    p.set_defaults(func=cmd_api)


def cmd_api(args) -> int:
    from diffuse.api.keys import api_keys
    from diffuse.daemon.client import api_request, fetched_first, notice, serve_api  # --from-swarm: fetched first
    from diffuse.http import parse_listen

    parse_listen(args.listen)
    if args.max_sessions < 1 or args.max_tokens < 1 or args.max_queue < 0:
        raise DiffuseError("--max-sessions and --max-tokens must be at least 1, --max-queue at least 0")
    keys = api_keys(args.api_key, args.api_key_file)
    if args.from_swarm:  # else the models stay as given (none: the default)
        args.model = list(fetched_first(vars(args), data_home(args.home), args.model or [None], lambda: swarm_of(args)))
    if not args.no_daemon and serve_api(data_home(args.home), api_request(vars(args), keys),
                                        lambda url: print(f"listening on {url}", flush=True), notice):
        return 0  # the daemon served it while this process held the connection, until a signal
    # Through the swarm answers speculate unless --no-speculate; in this process never (no round trips).
    config = service_config(args, tuple(args.model or [None]), fallback_from_store=False,
                            speculate=None if args.speculate else False, warm_up=True)
    from diffuse.api.serve import serving  # the heavy imports once the options are checked (a bad --bootstrap first)

    options = vars(args) | {"api_keys": keys, "default_max_tokens": args.max_tokens}
    with serving(config, options, args.listen, args.train_draft, lambda text: print(text, flush=True)) as main:
        trio_run(main)
    return 0
