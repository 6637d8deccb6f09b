"""`diffuse daemon`: this home's node in the background (diffuse/daemon/); `ask`, `status` and
`api` go through it while it runs. start, run and install take `join`'s options and a client's."""

import argparse

from diffuse.cli import ask, net
from diffuse.daemon import ACTIONS
from diffuse.home import data_home


def register(sub: argparse._SubParsersAction) -> None:
    cmds = sub.add_parser("daemon", help="this home's node in the background: ask, status and api then use it") \
        .add_subparsers(dest="action", required=True, metavar="ACTION")
    for action, text in ACTIONS.items():
        p = cmds.add_parser(action, help=text, conflict_handler="resolve")
        if action in ("start", "run", "install"):
            net.register_join(p)
            ask.add_swarm_client_options(p)
            ask.add_fallback_option(p, "every other model in the store, largest first")
            p.add_argument("--local", action="store_true", help="answer from a whole model here, in no swarm")
            p.add_argument("--speculate", action=argparse.BooleanOptionalAction, help="guessed continuations "
                           "with each step through the swarm (default: on)")
        elif action in ("status", "logs"):
            p.add_argument(*(["--json"] if action == "status" else ["-n"]), **(
                {"action": "store_true", "help": "one JSON object"} if action == "status" else {"type": int}))
        p.set_defaults(func=cmd_daemon, json=False, n=40, exact=False, history=None)


def cmd_daemon(args) -> int:
    if args.action != "run":
        from diffuse.daemon.client import command

        text, code = command(data_home(args.home), args.action, args.argv, args.json, args.n)
        return print(text) or code
    from diffuse.daemon.process import Daemon, DaemonConfig

    role = "local" if args.local else "client-only" if args.client_only else "peer"
    peer = net.make_peer(args) if role == "peer" else None
    model = None if (args.model or "").lower() == "auto" else args.model
    service = ask.service_config(args, (model,), fallback_from_store=True, speculate=args.speculate, warm_up=True)
    net.run_node(args, peer, Daemon(DaemonConfig(data_home(args.home), service, role), peer).run)
    return 0
