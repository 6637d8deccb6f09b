"""`diffuse history`: one's own conversations, encrypted on this machine, never sent (client/vault.py)."""

import argparse
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("history", help="the conversations ask (and api --history) keep, encrypted on this machine")
    p.add_argument("action", choices=("init", "list", "show", "search", "rm", "export", "wipe"), help="init, list, "
                   "show ID, search TEXT (any case), rm ID, export (JSON), wipe --yes (delete the vault for good)")
    p.add_argument("arg", nargs="?", metavar="ID|TEXT")
    p.add_argument("--yes", action="store_true", help="wipe: yes, delete it all")
    p.set_defaults(func=cmd_history)


def cmd_history(args) -> int:
    from diffuse.client.vault import command

    lines, problems = command(args.home, args.action, args.arg, args.yes)
    sys.stdout.write("".join(f"{line}\n" for line in lines))
    sys.stderr.write("".join(f"error: {p}\n" for p in problems))
    return 1 if problems else 0
