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

`--sent N ...` also reports the tokens per step when every step sends the N guesses that the
client's planner scores likeliest (the real `Speculator`: the head's tree and prompt lookup, its
acceptance learned along each answer; `0` sends the whole draft), stepping along each answer as
verification would ("mixed" pools the classes' steps, as the benchmark does). `--cost A B` adds a
row where each step sends what the planner would if a step of T positions cost A + B * T seconds
(`best_size`; bench_speculative.py's relay at 80 ms fits about 0.14 + 0.0025 T here, its 0 ms
about 0.06 + 0.003 T), with the positions it sent and the tokens per second that cost implies.
`--rates` adds how often each kind of guess was accepted; `--requests` asks the last of the
head's own training requests instead of the benchmark's prompts (where the planner's priors come
from). The pool of the model's own n-grams is left out: its entries come from the model's
predictions at guesses off the answer's path, which these answers do not hold. Tokens per step
count steps, not positions: averaging over every position would weigh the easy stretches that a
step crosses at once as often as the hard ones.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from types import SimpleNamespace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from diffuse.client import draft_head, draft_training  # noqa: E402
from diffuse.client.speculative import Cost, SpecConfig, SpecState, Speculator, best_size  # noqa: E402
from diffuse.client.local import open_local  # noqa: E402
from diffuse.home import data_home  # noqa: E402
from diffuse.model import store  # noqa: E402
from diffuse.model.config import ModelConfig  # noqa: E402
from diffuse.model.engine import Head  # noqa: E402


def main() -> None:
    from support.prompts import CLASSES

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--home")
    ap.add_argument("--model", help="store name (default: the default model)")
    ap.add_argument("--heads", type=Path, nargs="+", help="draft-head files (default: the installed one)")
    ap.add_argument("--per-class", type=int, default=17)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--cache", type=Path, help="file keeping the decoded answers between runs")
    ap.add_argument("--sent", nargs="+", type=int, default=[], metavar="N",
                    help="guesses sent per step (0: all) whose tokens per step to report")
    ap.add_argument("--cost", nargs=2, type=float, metavar=("A", "B"),
                    help="also size each step as the planner would at A + B * positions seconds")
    ap.add_argument("--requests", action="store_true",
                    help="answer the last of the draft head's own training requests instead of the benchmark's")
    ap.add_argument("--rates", action="store_true", help="with --sent: how often each kind of guess was accepted")
    args = ap.parse_args()
    classes = {"requests": draft_training.questions()[-3 * args.per_class:]} if args.requests else CLASSES
    home = data_home(args.home)
    path = store.resolve(home, args.model)
    name = path.name
    model, tok = open_local(home, name, "fp32")
    hidden = ModelConfig.load(path).hidden_size
    heads = args.heads or [draft_head.path(home, name)]
    key = {"per_class": args.per_class, "tokens": args.tokens, "model": name, "requests": args.requests}
    traces = None
    if args.cache and args.cache.exists():
        saved = torch.load(args.cache, weights_only=True)
        traces = saved["traces"] if saved["key"] == key else None
    if traces is None:
        traces = {kind: draft_training.generated(model, tok, texts[:args.per_class], 10**9, batch=args.per_class,
                                             new=args.tokens) for kind, texts in classes.items()}
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
        if args.sent or args.cost:
            chats = {kind: [tok.encode_chat([{"role": "user", "content": q}]) for q in texts[:len(traces[kind])]]
                     for kind, texts in classes.items()}
            prompts = {kind: sorted(p, key=len) for kind, p in chats.items()}  # the order `generated` answers in
            planned(draft, model.head, traces, prompts, args.sent, args.rates, Cost(sum(args.cost), *args.cost)
                    if args.cost else None)


def planned(draft: draft_head.DraftHead, head: Head, traces: dict, prompts: dict, sizes: list[int],
            rates: bool = False, cost: Cost | None = None) -> None:
    # The traces hold normalised final states; `propose` normalises the state it is given.
    normed = SimpleNamespace(norm=torch.nn.Identity(), lm_head=head.lm_head, embed=head.embed)
    print("\n| guesses sent | " + " | ".join(traces) + " | mixed |")
    print("|---|" + "---|" * (len(traces) + 1))
    for size in sizes + ([-1] if cost else []):
        per_class, pooled, hits, trials = [], [], Counter(), Counter()
        positions: list[int] = []
        for kind, seqs in traces.items():
            steps: list[int] = []
            for (z, choice, _), prompt in zip(seqs, prompts[kind]):
                answer = choice.tolist()
                spec = Speculator(SpecConfig(draft=draft), SpecState(), prompt, normed)  # type: ignore[arg-type]
                spec.push(answer[:1])
                at = 0
                while at < len(answer) - 1:
                    spec.z = z[at]
                    tree = spec.draft(spec.cfg.max_depth)
                    scores = spec.acceptance.scores(tree)
                    ranked = sorted(range(1, len(scores)), key=lambda i: (-scores[i], tree.kinds[i][1], i))
                    n = best_size([scores[i] for i in ranked], cost) if size < 0 and cost else size or None
                    sent = set(ranked[:n])
                    positions.append(1 + len(sent))
                    node, accepted = 0, 0
                    for token in answer[at + 1:-1]:  # the last token is always the model's own
                        node = tree.children[node].get(token, -1)
                        if node not in sent:
                            break
                        accepted += 1
                    steps.append(1 + accepted)
                    spec.push(answer[at + 1:at + 2 + accepted])
                    at += 1 + accepted
                hits.update(spec.acceptance.hits)
                trials.update(spec.acceptance.trials)
            per_class.append(sum(steps) / len(steps))
            pooled += steps
        print(f"| {'planner' if size < 0 else size or 'all'} | " + " | ".join(f"{t:.2f}" for t in per_class)
              + f" | {sum(pooled) / len(pooled):.2f} |")
        if size < 0 and cost:
            print(f"  planner at {cost.a:g} + {cost.b:g} s per position: {sum(positions) / len(positions):.1f} "
                  f"positions per step, {sum(pooled) / sum(map(cost, positions)):.2f} tokens/s")
        if rates:
            print("  accepted / drafted (given the parent was), by source, depth, rank among siblings: " + ", ".join(
                f"{src} {d} {r}: {hits[k] / trials[k]:.2f} of {trials[k]}"
                for k in sorted(trials) if trials[k] >= 20 for src, d, r in [k]))


if __name__ == "__main__":
    main()
