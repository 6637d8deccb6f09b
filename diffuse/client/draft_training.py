"""Training the draft head: self-distillation on the model's own answers, plus read text.

The head (draft_head.py) must guess what the model will choose next, so its data is what the
model itself produces: greedy answers to many requests (draft_requests.py), the model's own
prose retold or summarised, and teacher-forced text that ships with Python. It is trained
unrolled over its own predictions, as EAGLE is, so deeper guesses see the states they will see
in use; `evaluate` reports its hit rates, and scripts/eval_draft_head.py on the benchmark prompts.

It fits in minutes on a laptop's two cores: the answers are decoded in bf16, 64 at a time (twice
fp32's speed; 98% of its choices along them are fp32's), the head's products run in bf16 under
autocast (4-5x fp32's), and 60,000 answer positions drawn from all kinds of request do nearly as
well as 120,000 (the shortest requests first had left out most code).
"""

from __future__ import annotations

import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from diffuse.client import draft_requests as R
from diffuse.client.draft_head import BANDS, DraftHead, save
from diffuse.client.pipeline import LocalModel
from diffuse.model.engine import Head
from diffuse.model.tokenizer import Tokenizer


def corpus(seed: int = 0) -> list[tuple[str, str]]:
    """(question, answer-like text) pairs from what every Python ships: prose from pydoc's
    topics and code from the standard library, shuffled."""
    import pydoc_data.topics as topics
    import sysconfig

    pairs = [(f"Explain {name} in Python.", text) for name, text in topics.topics.items()]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in ("textwrap", "fractions", "heapq", "bisect", "statistics", "difflib", "shlex", "calendar",
                 "glob", "fnmatch", "colorsys", "string", "random", "json/encoder", "csv", "dataclasses"):
        src = stdlib / f"{name}.py"
        if src.exists():
            pairs.append((f"Write the Python module {name}.", "```python\n" + src.read_text() + "\n```"))
    random.Random(seed).shuffle(pairs)
    return pairs


def questions(seed: int = 0) -> list[str]:
    """Chat, code and summarising requests to self-distil on (draft_requests); the passages to
    summarise are paragraphs of pydoc's topics. Each chat subject is asked in one form, not all
    five: its answers in the others are near-copies, positions a short training cannot spare."""
    import pydoc_data.topics as topics

    qs = R.CHAT_QUESTIONS + [R.CHAT_FORMS[i % len(R.CHAT_FORMS)].format(t) for i, t in enumerate(R.CHAT_SUBJECTS)]
    qs += [f.format(t) for t in R.CODE_TASKS for f in R.CODE_FORMS] + R.CODE_REQUESTS
    paras = [p.strip() for text in topics.topics.values() for p in text.split("\n\n")]
    paras = [" ".join(p.split()) for p in paras if 60 <= len(p.split()) <= 140 and "::" not in p and ">>>" not in p]
    qs += [R.GROUND_FORMS[i % len(R.GROUND_FORMS)].format(p) for i, p in enumerate(paras[:120])]
    random.Random(seed).shuffle(qs)
    return qs


def retold(tok: Tokenizer, answers: list[Trace], limit: int, seed: int = 0) -> list[str]:
    """Requests to summarise or retell the model's own prose answers (60-140 words, no code):
    passages on as many subjects as the chat requests have, which pydoc's topics lack."""
    texts = [tok.decode(choice.tolist()).strip() for _, _, choice in answers]
    texts = [" ".join(t.split()) for t in texts if 60 <= len(t.split()) <= 140 and "```" not in t]
    random.Random(seed).shuffle(texts)
    return [R.GROUND_FORMS[i % len(R.GROUND_FORMS)].format(t) for i, t in enumerate(texts[:limit])]


# One text the head learns from: [T, hidden] normalised final states, the token after each
# position, and the model's own choice at each position.
Trace = tuple[Tensor, Tensor, Tensor]


def generated(model: LocalModel, tok: Tokenizer, qs: list[str], tokens: int, batch: int = 64, new: int = 128,
              log: Callable[[str], None] = lambda s: None) -> list[Trace]:
    """The model's own greedy answers to `qs` (the contexts the head will see), until `tokens`
    positions. Requests are taken in order, four batches at a time, and decoded `batch` at a
    time, shortest first, each padded to the longest of its batch with blank lines at the start
    of its request (a batch shares positions): stopping early keeps a draw of all kinds of
    request, not the shortest (which left out most code requests)."""
    import trio

    pad = tok.encode("\n")
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in qs]
    empty = tok.encode_chat([{"role": "user", "content": ""}])
    split = next((i for i, (a, b) in enumerate(zip(empty, prompts[0] + [-1] * len(empty))) if a != b),
                 len(empty))  # where the request starts (0 for a model without a chat template)
    seqs: list[Trace] = []
    n, t0 = 0, time.perf_counter()
    for start in range(0, len(prompts), 4 * batch):
        pool = sorted(prompts[start:start + 4 * batch], key=len)
        for at in range(0, len(pool), batch):
            group = pool[at:at + batch]
            width = max(map(len, group))
            ids = torch.tensor([p[:split] + pad * (width - len(p)) + p[split:] for p in group])
            z, choice = trio.run(_decode, model, ids, new)
            for b in range(len(group)):
                ends = [i for i, t in enumerate(choice[b].tolist()) if t in tok.eos_ids]
                m = ends[0] + 1 if ends else new
                seqs.append((z[b, :m].clone(), choice[b, :m].clone(), choice[b, :m].clone()))  # greedy: next = choice
                n += m
            log(f"{n} positions from {len(seqs)} answers, {n / (time.perf_counter() - t0):.0f}/s")
            if n >= tokens:
                return seqs
    return seqs


async def _decode(model: LocalModel, ids: Tensor, new: int) -> tuple[Tensor, Tensor]:
    """Greedy decoding of a batch: ([B, new, hidden] normalised final states, [B, new] choices)."""
    pipe = model.session(ids.shape[1] + new, batch=ids.shape[0])
    zs, choices = [], []
    logits = await pipe.forward(ids, rows=slice(-1, None))
    try:
        for step in range(new):
            zs.append(model.head.norm(pipe.hidden[:, -1]).detach().float())
            choices.append(logits[:, -1].argmax(-1))
            if step + 1 < new:
                logits = await pipe.forward(choices[-1][:, None])
    finally:
        await pipe.close()
    return torch.stack(zs, 1), torch.stack(choices, 1)


def examples(model: LocalModel, tok: Tokenizer, pairs: list[tuple[str, str]], tokens: int, window: int = 384,
             log: Callable[[str], None] = lambda s: None) -> list[Trace]:
    """Teacher-forced text, read in windows after its question, until `tokens` positions."""
    seqs: list[Trace] = []
    n, t0 = 0, time.perf_counter()
    for question, text in pairs:
        prompt = tok.encode_chat([{"role": "user", "content": question}])
        body = tok.encode(text)
        for at in range(0, len(body), window - len(prompt)):
            ids = prompt + body[at:at + window - len(prompt)]
            z, choice = _forward(model, ids)
            s = len(prompt) - 1  # from the position that produces the answer's first token
            seqs.append((z[s:], torch.tensor(ids[s + 1:] + [int(choice[-1])]), choice[s:]))
            if (n + len(choice) - s) // 5000 > n // 5000:
                log(f"{n + len(choice) - s} positions, {(n + len(choice) - s) / (time.perf_counter() - t0):.0f}/s")
            n += len(choice) - s
            if n >= tokens:
                return seqs
    return seqs


@torch.inference_mode()
def _forward(model: LocalModel, ids: list[int]) -> tuple[Tensor, Tensor]:
    """One teacher-forced pass: ([T, hidden] normalised final states, [T] greedy choices)."""
    import trio

    pipe = model.session(len(ids))
    try:
        logits = trio.run(pipe.forward, torch.tensor([ids]))
    finally:
        trio.run(pipe.close)
    return model.head.norm(pipe.hidden[0]).float(), logits[0].argmax(-1)


@dataclass
class Report:
    """Held-out results: top-1 hit rate of the draft's first `unroll` guesses along the model's
    own path, the share of positions where the first 1, 2, ... guesses all hit (what a chain
    of guesses would get accepted), and the hit rate per confidence band."""

    hits: list[float]
    chain: list[float]
    calibration: list[float]


def _flatten(seqs: list[Trace], unroll: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Concatenated (z, next, choice) and the positions with `unroll` successors in their sequence."""
    starts, off = [], 0
    for z, _, _ in seqs:
        starts.append(torch.arange(off, off + max(0, len(z) - unroll)))  # a short answer has none
        off += len(z)
    return (torch.cat([s[0] for s in seqs]).float(), torch.cat([s[1] for s in seqs]), torch.cat([s[2] for s in seqs]),
            torch.cat(starts))


def _unroll(draft: DraftHead, emb: Tensor, z: Tensor, nxt: Tensor, at: Tensor,
            unroll: int) -> list[tuple[Tensor, Tensor]]:
    """(predicted state, target index) per draft step from positions `at`, each step fed the
    previous prediction and the true next token, as in use after an accepted guess."""
    state, out = z[at], []
    for j in range(unroll):
        state = draft(state, emb[nxt[at + j]])
        out.append((state, at + j + 1))
    return out


def _rows(draft: DraftHead, head: Head) -> tuple[Tensor, Tensor]:
    """The LM head's rows the draft scores (fp32), and each token's row among them (-1: none)."""
    w = draft.vocab_rows(head.lm_head.weight).float()
    index = torch.full((head.lm_head.weight.shape[0],), -1, dtype=torch.long)
    index[draft.vocab if len(draft.vocab) else torch.arange(len(index))] = torch.arange(len(w))
    return w, index


def train(draft: DraftHead, head: Head, fit: list[Trace], held: list[Trace], unroll: int = 3, epochs: int = 6,
          batch: int = 256, lr: float = 2e-3, log: Callable[[str], None] = lambda s: None, seed: int = 0) -> Report:
    """Minimise, over `unroll` steps fed the head's own predictions, the cross-entropy of each
    step's guesses against the model's own distribution there (its LM head on the model's
    state, over the head's vocab) plus the smooth-L1 distance to that state (EAGLE's two losses;
    each later step weighs 0.8 times the one before). The whole distribution teaches the ranking
    below the first guess, which the tree's other branches use, and it trains a better first
    guess and more tokens per step than the model's choice alone as the target
    (scripts/eval_draft_head.py --sent 10; figures: docs/measurements.md, 'Figures once quoted in
    module comments').
    `held` should be answers: there the next token is the model's choice, so a chain of hits
    is what verification accepts."""
    g = torch.Generator().manual_seed(seed)
    emb = head.embed.weight.detach().float()
    w16 = _rows(draft, head)[0].bfloat16()  # cast once, not at every product
    z, nxt, _, starts = _flatten(fit, unroll)
    opt = torch.optim.AdamW(draft.parameters(), lr=lr, weight_decay=0.0)
    steps = epochs * ((len(starts) + batch - 1) // batch)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, lr, total_steps=steps, pct_start=0.1) if steps else None
    for epoch in range(epochs):
        perm = starts[torch.randperm(len(starts), generator=g)]
        total = 0.0
        for i in range(0, len(perm), batch):
            at = perm[i:i + batch]
            with torch.autocast("cpu", torch.bfloat16):  # bf16 products (AMX): 4-5x the speed of fp32
                loss = sum((F.cross_entropy(s @ w16.t(), _target(z[t], w16)) + F.smooth_l1_loss(s, z[t])) * 0.8 ** j
                           for j, (s, t) in enumerate(_unroll(draft, emb, z, nxt, at, unroll)))
            opt.zero_grad()
            loss.backward()  # type: ignore[union-attr]
            opt.step()
            sched.step()  # type: ignore[union-attr]
            total += float(loss.detach()) * len(at)  # type: ignore[union-attr]
        log(f"epoch {epoch + 1}: loss {total / len(perm):.3f}")
    report = evaluate(draft, head, held, unroll)
    draft.calibration.copy_(torch.tensor(report.calibration))
    return report


@torch.no_grad()
def _target(z: Tensor, w: Tensor) -> Tensor:
    """The model's next-token distribution over the head's vocab, from its normalised state."""
    return (z @ w.t()).float().softmax(-1)


@torch.no_grad()
def evaluate(draft: DraftHead, head: Head, held: list[Trace], unroll: int = 3) -> Report:
    """How the head's first `unroll` guesses fare along the model's own path in `held` (bands
    with no guess keep the head's current calibration)."""
    emb = head.embed.weight.detach().float()
    w, index = _rows(draft, head)
    hz, hnxt, hchoice, hstarts = _flatten(held, unroll)
    ok = torch.ones(len(hstarts), dtype=torch.bool)
    hits, chain, conf, right = [], [], [], []
    for s, t in _unroll(draft, emb, hz, hnxt, hstarts, unroll):
        p, guess = (s @ w.t()).softmax(-1).max(-1)
        hit = guess == index[hchoice[t]]
        conf.append(p[ok])
        right.append(hit[ok])
        hits.append(float(hit.float().mean()))
        ok &= hit
        chain.append(float(ok.float().mean()))
    conf_t, right_t = torch.cat(conf), torch.cat(right)
    band = sum((conf_t >= b).long() for b in BANDS)
    calibration = [float(right_t[band == b].float().mean()) if (band == b).any() else float(draft.calibration[b])
                   for b in range(len(BANDS) + 1)]
    return Report(hits, chain, calibration)


def collect(model: LocalModel, tok: Tokenizer, answers: int = 60_000, text: int = 12_000,
            log: Callable[[str], None] = lambda s: None) -> tuple[list[Trace], list[Trace]]:
    """`answers` positions of the model's own answers (four fifths to the requests, the rest to
    retelling its prose answers) and `text` of teacher-forced text. `model` may be a bf16 copy:
    it decodes at twice fp32's speed, and 98% of its choices are fp32's along its answers."""
    answered = generated(model, tok, questions(), answers * 4 // 5, log=log) if answers else []
    left = answers - sum(len(s[0]) for s in answered)
    if left > 0:
        answered += generated(model, tok, retold(tok, answered, limit=left // 64), left, log=log)
    read = examples(model, tok, corpus(), text, log=log) if text else []
    return answered, read


def build(model: LocalModel, tok: Tokenizer, file: Path, answers: int = 60_000, text: int = 12_000,
          epochs: int = 4, unroll: int = 3, log: Callable[[str], None] = lambda s: print(s, file=sys.stderr),
          data: tuple[list[Trace], list[Trace]] | None = None, head: Head | None = None) -> Report:
    """Train a draft head on all text and nine tenths of the answers `collect` gathers (or
    `data`, gathered before), report on the other tenth, and save it. `head` is the LM head it
    learns to feed (default: the model's; pass the fp32 one when `model` is a bf16 copy)."""
    head = head or model.head
    t0 = time.perf_counter()
    answered, read = data or collect(model, tok, answers, text, log)
    order = torch.randperm(len(answered), generator=torch.Generator().manual_seed(0)).tolist()
    held = [answered[i] for i in order[:max(1, len(answered) // 10)]] if answered else read[:max(1, len(read) // 10)]
    fit = [answered[i] for i in order[len(held):]] + (read if answered else read[len(held):])
    log(f"collected {sum(len(s[0]) for s in answered + read)} positions in {time.perf_counter() - t0:.0f} s")
    torch.manual_seed(0)
    vocab = torch.unique(torch.cat([s[2] for s in answered + read]))
    hidden = head.norm.weight.shape[0]
    draft = DraftHead(hidden, hidden * 8 // 3, vocab)
    with torch.enable_grad():
        report = train(draft, head, fit, held, unroll, epochs, log=log)
    save(draft, file, {"answers": answers, "text": text, "epochs": epochs, "unroll": unroll, **vars(report)})
    log(f"draft head: held-out hits {', '.join(f'{a:.2f}' for a in report.hits)}, chains "
        f"{', '.join(f'{a:.2f}' for a in report.chain)} ({time.perf_counter() - t0:.0f} s) -> {file}")
    return report


def build_for(home: Path, name: str | None, answers: int, text: int, epochs: int, unroll: int,
              log: Callable[[str], None]) -> Path:
    """The draft head of the store's model `name`, written where speculation looks for it: its
    answers decoded in bf16 (fast), trained against the fp32 head it will feed."""
    from diffuse.client import draft_head
    from diffuse.client.local import open_local
    from diffuse.model import store
    from diffuse.model.load import load_head

    path = store.resolve(home, name)
    model, tok = open_local(home, path.name, "bf16")
    file = draft_head.path(home, path.name)
    build(model, tok, file, answers, text, epochs, unroll, log, head=load_head(path))
    return file
