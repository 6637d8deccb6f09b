"""`diffuse credits`: what this member earned and spent, per peer (the books: trust/credits.py)."""

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("credits", help="receipts earned, work spent, per-peer tabs and standing, the allowance")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_credits)


def cmd_credits(args) -> None:
    from diffuse.trust.credits import show

    print(show(args.home, args.json))
