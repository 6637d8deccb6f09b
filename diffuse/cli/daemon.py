"""`diffuse daemon`: this home's node in the background (diffuse/daemon/); `ask`, `status` and
`api` go through it while it runs. start, run and install take `join`'s options and a client's."""

import argparse
import json
import sys

from diffuse.cli import ask, net
from diffuse.home import data_home

ACTIONS = {"start": "start it in the background and wait until it answers", "run": "run it in the foreground "
           "(what start and the units run)", "install": "write a systemd user unit (Linux) or launchd agent (macOS) "
           "that runs it with these options", "stop": "stop it (a peer drains first)", "status": "its state, "
           "contribution and what it serves", "logs": "the end of its log", "uninstall": "remove the unit or agent"}


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
            p.set_defaults(exact=False, history=None)
        p.add_argument("--json", action="store_true", help="status: one JSON object") if action == "status" else \
            p.add_argument("-n", type=int, default=40, help="lines (default 40)") if action == "logs" else None
        p.set_defaults(func=cmd_daemon)


def cmd_daemon(args) -> int:
    from diffuse.daemon import client, units

    home, action, say = data_home(args.home), args.action, lambda text: print(f"notice: {text}", file=sys.stderr)
    if action == "run":
        return _run(args)
    if action in ("start", "install"):
        argv = client.run_argv(args.argv)
        print(client.describe(client.start(home, argv, 600.0, say)) if action == "start" else units.install(home, argv))
    elif action == "stop":
        print(f"stopped the daemon of {home} (pid {pid})" if (pid := client.stop(home, 120.0)) else f"no daemon runs "
              f"for {home}")
    elif action == "status":
        status = client.call(home, {"op": "status"}, say=say)
        print(f"no daemon runs for {home}" if status is None else json.dumps(status) if args.json else
              client.describe(status))
        return 0 if status else 3
    else:
        print(client.tail(home, args.n) if action == "logs" else units.uninstall(home))
    return 0


def _run(args) -> int:
    from diffuse.daemon.process import Daemon, DaemonConfig

    role = "local" if args.local else "client-only" if args.client_only else "peer"
    peer = net.make_peer(args) if role == "peer" else None
    model = None if (args.model or "").lower() == "auto" else args.model
    service = ask.service_config(args, (model,), fallback_from_store=True, speculate=args.speculate,
                                 warm_up=True)
    daemon = Daemon(DaemonConfig(data_home(args.home), service, role), peer)
    net.run_node(args, peer, daemon.run)
    return 0
