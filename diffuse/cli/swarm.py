"""`diffuse swarm new`, and the options every command that joins a swarm takes: --mode,
--swarm-key, --allow-peers (resolved by control/modes.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

from diffuse.control.mode_names import KEY_ENV, KEY_FILE, MODES, PRIVATE
from diffuse.home import data_home


def add_swarm_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", default=PRIVATE, choices=MODES, help="private (default): only holders of the swarm key "
                   "connect; light checks, nothing published. public: anyone joins; full checks, evidence published")
    p.add_argument("--swarm-key", type=Path, metavar="FILE",
                   help=f"the private swarm's key (default: ${KEY_ENV}, then <home>/{KEY_FILE})")
    p.add_argument("--allow-peers", type=Path, metavar="FILE", help="private swarms: only the peer ids in FILE (one "
                   "per line, # comments) serve; re-read on change, so removing a line stops that peer's traffic")


def swarm_access(args: argparse.Namespace, create: bool = False):  # -> control.modes.SwarmAccess (imports libp2p)
    """What --mode, --swarm-key and --allow-peers say; create: a private node without any key
    makes one under the home (a sentinel starting a new swarm)."""
    from diffuse.control.modes import resolve  # libp2p: only once a command runs
    return resolve(args.mode, data_home(args.home), key_file=args.swarm_key, allow_file=args.allow_peers, create=create)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("swarm", help="private swarms: make a swarm key")
    cmds = p.add_subparsers(dest="swarm_command", required=True, metavar="SUBCOMMAND")
    new = cmds.add_parser("new", help="write a fresh swarm key (mode 0600) for a new private swarm")
    new.add_argument("--out", type=Path, metavar="FILE", help=f"where to write it (default: <home>/{KEY_FILE})")
    new.set_defaults(func=cmd_swarm_new)


def cmd_swarm_new(args: argparse.Namespace) -> int:
    from diffuse.control.swarm_key import SwarmKey, write_key

    path = (args.out or data_home(args.home) / KEY_FILE).expanduser()
    key = SwarmKey.generate()
    write_key(path, key)
    print(f"wrote a new swarm key to {path} (fingerprint {key.fingerprint})\n"
          "Whoever holds this file can join the swarm: give it only to its members, over a channel you trust\n"
          "(scp, a password manager), never by chat or in a repository. On each member's machine, either\n"
          f"  copy it to ~/.diffuse/{KEY_FILE} (mode 600; or <home>/{KEY_FILE} for --home), or\n"
          f"  give it with --swarm-key FILE or {KEY_ENV}=FILE.\n"
          f"Then: diffuse sentinel --swarm-key {path}, and diffuse join / ask / status --bootstrap ADDR there.")
    return 0
