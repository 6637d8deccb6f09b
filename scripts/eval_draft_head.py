#!/usr/bin/env python
"""How often draft heads guess the model's own greedy answers to the benchmark prompts, per class.

    .venv/bin/python scripts/eval_draft_head.py [--heads FILE ...] [--per-class 17] [--tokens 128]

The speculation benchmarks (bench_speculative.py, eval_speculative_identity.py) ask the prompts
of eval_speculative_identity.CLASSES; no draft-head training request is among them. This decodes
the model's greedy answers to them once (fp32, in process, each class as one batch padded with
blank lines at the start of the request, as training does; `--cache` keeps them for the next
run) and reports, for each head file, the share of positions whose first guess is the model's
choice and the share whose first 1, 2, 3 guesses all are (what a chain of guesses gets
accepted). Minutes, not the benchmark's quarter hour: a way to compare heads before benching one.

`--trees BEAM,TOP,DEPTH,NODES ...` also reports, per tree shape of `DraftHead.propose` (the
default is 1,5,5,24), the tokens a step would yield if it sent the head's whole tree and nothing
else (1 + the longest accepted path, at every other position of every answer): what a head can
give at most, before the planner weighs positions against their cost.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from diffuse.client import draft_head, draft_training  # noqa: E402
from diffuse.client.local import open_local  # noqa: E402
from diffuse.home import data_home  # noqa: E402
from diffuse.model import store  # noqa: E402
from diffuse.model.config import ModelConfig  # noqa: E402
from diffuse.model.engine import Head  # noqa: E402


def main() -> None:
    from eval_speculative_identity import CLASSES

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--home")
    ap.add_argument("--model", help="store name (default: the default model)")
    ap.add_argument("--heads", type=Path, nargs="+", help="draft-head files (default: the installed one)")
    ap.add_argument("--per-class", type=int, default=17)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--cache", type=Path, help="file keeping the decoded answers between runs")
    ap.add_argument("--trees", nargs="+", default=[], metavar="BEAM,TOP,DEPTH,NODES",
                    help="tree shapes whose tokens per step (whole tree sent) to report")
    args = ap.parse_args()
    home = data_home(args.home)
    path = store.resolve(home, args.model)
    name = path.name
    model, tok = open_local(home, name, "fp32")
    hidden = ModelConfig.load(path).hidden_size
    heads = args.heads or [draft_head.path(home, name)]
    key = {"per_class": args.per_class, "tokens": args.tokens, "model": name}
    traces = None
    if args.cache and args.cache.exists():
        saved = torch.load(args.cache, weights_only=True)
        traces = saved["traces"] if saved["key"] == key else None
    if traces is None:
        traces = {kind: draft_training.generated(model, tok, texts[:args.per_class], 10**9, batch=args.per_class,
                                             new=args.tokens) for kind, texts in CLASSES.items()}
        if args.cache:
            torch.save({"key": key, "traces": traces}, args.cache)
    print(f"{name}: greedy answers to {args.per_class} prompts per class, up to {args.tokens} tokens; "
          f"positions {', '.join(f'{k} {sum(len(t[0]) for t in v)}' for k, v in traces.items())}")
    print("| head | class | first guess | chain 1 / 2 / 3 |")
    print("|---|---|---|---|")
    for file in heads:
        draft = draft_head.load(file, hidden)
        if draft is None:
            sys.exit(f"{file}: no draft head for this model")
        for kind, held in [*traces.items(), ("all", [t for v in traces.values() for t in v])]:
            r = draft_training.evaluate(draft, model.head, held)
            print(f"| {file.parent.name}/{file.name} | {kind} | {r.hits[0]:.2f} | "
                  f"{' / '.join(f'{c:.2f}' for c in r.chain)} |")
        if args.trees:
            whole_trees(draft, model.head, traces, [tuple(map(int, t.split(","))) for t in args.trees])


def whole_trees(draft: draft_head.DraftHead, head: Head, traces: dict, shapes: list[tuple[int, ...]]) -> None:
    print("\n| beam, top, depth, nodes | " + " | ".join(traces) + " | mixed | ms per tree |")
    print("|---|" + "---|" * (len(traces) + 2))
    for beam, top, depth, nodes in shapes:
        per_class, seconds, trees = [], 0.0, 0
        for seqs in traces.values():
            steps = []
            for z, choice, _ in seqs:
                for j in range(0, len(choice) - depth - 1, 2):
                    t0 = time.perf_counter()
                    tree = {tuple(p) for p, _ in draft.propose(head, z[j], int(choice[j]), depth, nodes, beam, top)}
                    seconds, trees = seconds + time.perf_counter() - t0, trees + 1
                    real = choice[j + 1:j + 1 + depth].tolist()
                    steps.append(1 + next((k for k in range(len(real)) if tuple(real[:k + 1]) not in tree), len(real)))
            per_class.append(sum(steps) / len(steps))
        print(f"| {beam}, {top}, {depth}, {nodes} | " + " | ".join(f"{t:.2f}" for t in per_class)
              + f" | {sum(per_class) / len(per_class):.2f} | {1000 * seconds / trees:.1f} |")


if __name__ == "__main__":
    main()
