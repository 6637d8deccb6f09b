"""Draft head: guesses for the tokens after the next one, from the client's last hidden state.

Copying earlier text (prompt lookup) guesses well only where the answer repeats something; on
chat and code the first guess after the root was right 8-17% of the time (SmolLM2, measured), so
a step rarely earned its extra positions. Medusa-style heads (a residual layer per future
position on the final hidden state) reached only 13% there: they must guess token t+2 without
knowing token t+1. This head works as EAGLE does (Li et al. 2024): it reads the normalised final
hidden state z_t of the position that produced the root together with the root's embedding and
predicts z_{t+1}, the state the model itself will reach; the model's own LM head turns that into
a guess, whose embedding feeds the next draft step. One small residual MLP (~3.3 M numbers for
SmolLM2), run a few times per network step on the client, where z and the LM head already are.
It is trained by self-distillation (the model's own greedy answers to generated requests plus
teacher-forced text that ships with Python), unrolled over its own predictions so that deeper
guesses see the states they will see in use. On held-out SmolLM2 answers the first guess is
right 52% of the time, the first three all 21% (the Medusa heads: first guess 13-24%).

The file (`<home>/drafts/<model>/draft-head.safetensors`) also carries the head's calibration:
how often a guess of each confidence band was right on held-out answers, which the planner uses
as its prior acceptance rate per band. No peer sees the head and the output does not depend on
it: verification accepts only what the model itself picks.
"""

from __future__ import annotations

import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from diffuse.client.pipeline import LocalModel
from diffuse.errors import ModelError
from diffuse.model.kernels import Linear, linear
from diffuse.model.llama import Head
from diffuse.model.tokenizer import Tokenizer

FILE = "draft-head.safetensors"
BANDS = (0.1, 0.3, 0.6, 0.9)  # confidence bands: a guess with probability p is in band sum(p >= b)


class DraftHead(nn.Module):
    """z_{t+1} ~ f(z_t, embedding of token t+1): a linear mix of both, then a SwiGLU MLP.

    `vocab` lists the tokens it may guess (those the model chose in training): scoring only those
    rows of the LM head keeps each draft step cheap, and a token the model never chose there is
    a poor guess anyway. `calibration` holds the held-out hit rate per confidence band.
    """

    def __init__(self, hidden: int, inter: int, vocab: Tensor | None = None, calibration: Tensor | None = None):
        super().__init__()
        self.fc = Linear(2 * hidden, hidden)  # the few-row matmul paths: a draft step has 1-3 rows
        self.norm = nn.RMSNorm(hidden, eps=1e-5)
        self.gate = Linear(hidden, inter, bias=False)
        self.up = Linear(hidden, inter, bias=False)
        self.down = Linear(inter, hidden, bias=False)
        with torch.no_grad():  # start as "the next state is this one": guesses repeat the model's next choice
            self.fc.weight.zero_()
            self.fc.weight[:, :hidden].copy_(torch.eye(hidden))
            self.fc.bias.zero_()
            self.down.weight.zero_()
        self.register_buffer("vocab", vocab if vocab is not None else torch.zeros(0, dtype=torch.long))
        self.register_buffer("calibration", calibration if calibration is not None else torch.tensor(
            [0.05, 0.2, 0.45, 0.75, 0.9]))
        self._fast: tuple[tuple, DraftHead, Tensor] | None = None  # (key, fp16 copy, its LM-head rows)

    @property
    def hidden(self) -> int:
        return self.fc.out_features

    @property
    def inter(self) -> int:
        return self.gate.out_features

    def forward(self, z: Tensor, e: Tensor) -> Tensor:
        """The next normalised final state from this one (z) and the next token's embedding (e).

        fp32 in and out; the products run in the dtype of the weights (fp16 in `propose`)."""
        dt = self.fc.weight.dtype
        u = self.fc(torch.cat([z, F.rms_norm(e, (e.shape[-1],))], -1).to(dt)).float()
        n = self.norm(u).to(dt)
        return u + self.down(F.silu(self.gate(n)) * self.up(n)).float()

    def vocab_rows(self, weight: Tensor) -> Tensor:
        """The LM head's rows for the tokens this head may guess (all rows if `vocab` is empty)."""
        return weight.detach() if not len(self.vocab) else weight.detach()[self.vocab]

    def fast(self, weight: Tensor) -> tuple["DraftHead", Tensor]:
        """An fp16 copy of this head and the LM head's rows for `vocab` (all rows if empty), for
        drafting: a level is one row, and a one-row product reads every weight once, so half the
        bytes is nearly half the time (4 levels: 16 -> 6 ms on the 2-core box, with the same
        guesses as fp32 on a sample where bf16 changed 3 of 20). Rebuilt after training steps."""
        key = (weight.data_ptr(), *(p._version for p in self.parameters()))
        if self._fast is None or self._fast[0] != key:
            copy = DraftHead(self.hidden, self.inter, self.vocab, self.calibration)
            copy.load_state_dict(self.state_dict())
            for layer in (copy.fc, copy.gate, copy.up, copy.down):
                layer.half()
            self._fast = (key, copy.eval(), self.vocab_rows(weight).half())
        return self._fast[1], self._fast[2]

    def priors(self) -> dict[str, float]:
        """P(accepted | parent accepted) per source name of `propose`, as measured in training."""
        return {f"draft{b}": float(r) for b, r in enumerate(self.calibration)}

    @torch.inference_mode()
    def propose(self, head: Head, h: Tensor, root: int, depth: int, nodes: int = 24, beam: int = 1,
                top: int = 5, floor: float = 0.0) -> list[tuple[list[int], str]]:
        """A tree of guesses after `root`, as (path after the root, source) with parents first.

        h is the final hidden state (before the final norm) of the position that produced the
        root. Each level expands the `beam` likeliest paths by their `top` next tokens (EAGLE-2's
        dynamic tree; one path by 5 accepted as much as three by 3 in a planner simulation, and
        one row per level is what makes fp16 pay); the `nodes` likeliest paths overall are
        returned. The source names the guess's confidence band, so acceptance is learned per
        band. Expansion stops early once no path's calibrated chance of acceptance reaches
        `floor`: a level costs a read of all the head's weights, wasted on guesses the planner
        would not send.
        """
        fast, w = self.fast(head.lm_head.weight)
        emb = head.embed.weight
        z = head.norm(h).float()[None]
        paths: list[list[int]] = [[]]
        cal = self.calibration.tolist()
        frontier = [(0, 1.0, 1.0)]  # (index into paths, probability of the whole path, its calibrated chance)
        found: list[tuple[float, int, list[int], float]] = []  # (path prob, depth, path, own prob)
        for level in range(depth):
            if max(c for _, _, c in frontier) < floor:
                break
            last = [paths[i][-1] if paths[i] else root for i, _, _ in frontier]
            z = fast(z, emb[torch.tensor(last)].float())
            p, idx = linear(z.half(), w).float().softmax(-1).topk(top, dim=-1)
            tokens = (self.vocab[idx] if len(self.vocab) else idx).tolist()
            grown = []
            for row, (i, prob, chance) in enumerate(frontier):
                for r in range(top):
                    q = float(p[row, r])
                    paths.append(paths[i] + [tokens[row][r]])
                    grown.append((len(paths) - 1, prob * q, chance * cal[_band(q)], row))
                    found.append((prob * q, level, paths[-1], q))
            grown.sort(key=lambda g: -g[1])
            keep = grown[:beam]
            z = z[torch.tensor([row for *_, row in keep])]
            frontier = [(i, prob, chance) for i, prob, chance, _ in keep]
        found.sort(key=lambda f: (-f[0], f[1]))  # a path is never likelier than its parent: parents first
        return [(path, f"draft{_band(q)}") for _, _, path, q in found[:nodes]]


def _band(q: float) -> int:
    return sum(q >= b for b in BANDS)


def path(home: Path, model: str) -> Path:
    return home / "drafts" / model / FILE


def save(draft: DraftHead, file: Path, meta: dict) -> None:
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_suffix(".tmp")
    save_file({n: t.contiguous() for n, t in draft.state_dict().items()}, str(tmp),
              metadata={"hidden": str(draft.hidden), "inter": str(draft.inter), "info": json.dumps(meta)})
    tmp.replace(file)


def load(file: Path, hidden: int) -> DraftHead | None:
    """The draft head in `file`, or None when there is none or it does not fit this model's width."""
    if not file.exists():
        return None
    from safetensors import safe_open

    try:
        with safe_open(str(file), "pt") as f:
            meta = f.metadata() or {}
        width, inter = int(meta["hidden"]), int(meta["inter"])
        if width != hidden:
            return None
        state = load_file(str(file))
        draft = DraftHead(hidden, inter, state["vocab"], state["calibration"])
        draft.load_state_dict(state)
    except Exception as e:  # noqa: BLE001 - whatever is wrong with the file, say which file
        raise ModelError(f"{file}: not a usable draft-head file ({type(e).__name__}: {e}); "
                         "delete it or run `diffuse model draft-head` again") from None
    return draft.eval()


# ---- training --------------------------------------------------------------------------------

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


CHAT_SUBJECTS = [
    "the water cycle", "how bridges stay up", "the history of the printing press", "why cats purr",
    "how a refrigerator works", "the rules of chess", "how to start running", "the Roman Empire",
    "how bees make honey", "what inflation is", "how to care for a houseplant", "the life of a star",
    "how the internet works", "why we dream", "how to write a good resume", "the causes of earthquakes",
    "how to save money each month", "what a budget is", "the benefits of reading", "how tides work",
    "how to plan a birthday party", "the invention of the telephone", "how muscles grow",
    "what makes a good friend", "how electric cars work", "the Great Wall of China", "how to learn guitar",
    "why the moon has phases", "how coffee is made", "the importance of sleep for children",
    "how recycling works", "what democracy means", "how to prepare for a job interview",
    "the migration of birds", "how a camera works", "what causes rainbows", "how to cook rice",
    "the history of the bicycle", "how antibiotics work", "how to stay focused while studying",
    "what a volcano is", "how to train a puppy", "the solar system", "how credit cards work",
    "why oceans are salty", "how to make friends in a new city", "the first moon landing",
    "how plants drink water", "what a healthy breakfast looks like", "how airplanes fly",
]
CHAT_FORMS = ["Tell me about {}.", "Explain {} in simple words.", "What should everyone know about {}?",
              "Write a short paragraph about {}.", "Give me three facts about {}."]
CODE_TASKS = [
    "sorts a list of dictionaries by a key", "finds the largest number in a list", "checks if a number is prime",
    "converts Celsius to Fahrenheit", "removes duplicates from a list", "merges two sorted lists",
    "counts the vowels in a string", "computes the factorial of a number", "flattens a nested list",
    "reads a CSV file and prints each row", "returns the second largest element of a list",
    "checks whether two strings are anagrams", "generates the first n prime numbers",
    "converts a binary string to an integer", "computes the average of a list of numbers",
    "capitalises every word in a sentence", "finds the most common element in a list",
    "validates an email address with a regular expression", "computes the greatest common divisor",
    "transposes a matrix", "implements binary search", "parses a date string", "rotates a list by k places",
    "returns the intersection of two lists", "writes a dictionary to a JSON file",
]
CODE_FORMS = ["Write a Python function that {}.", "Show me Python code that {}.",
              "Write a JavaScript function that {}.", "Write a Python function that {}, with a docstring."]
GROUND_FORMS = ["Summarise the following text in two or three sentences.\n\n{}",
                "List the key facts in the following text as bullet points.\n\n{}",
                "Rewrite the following text for a ten-year-old.\n\n{}"]


def questions(seed: int = 0) -> list[str]:
    """Chat, code and summarising requests to self-distil on: none of them is a benchmark prompt
    (scripts/eval_speculative_identity.py); passages are paragraphs of pydoc's topics."""
    import pydoc_data.topics as topics

    qs = [f.format(t) for t in CHAT_SUBJECTS for f in CHAT_FORMS]
    qs += [f.format(t) for t in CODE_TASKS for f in CODE_FORMS]
    paras = [p.strip() for text in topics.topics.values() for p in text.split("\n\n")]
    paras = [" ".join(p.split()) for p in paras if 60 <= len(p.split()) <= 140 and "::" not in p and ">>>" not in p]
    qs += [GROUND_FORMS[i % len(GROUND_FORMS)].format(p) for i, p in enumerate(paras[:120])]
    random.Random(seed).shuffle(qs)
    return qs


# One text the head learns from: [T, hidden] normalised final states, the token after each
# position, and the model's own choice at each position.
Trace = tuple[Tensor, Tensor, Tensor]


def generated(model: LocalModel, tok: Tokenizer, qs: list[str], tokens: int, batch: int = 32, new: int = 128,
              log: Callable[[str], None] = lambda s: None) -> list[Trace]:
    """The model's own greedy answers to `qs` (the contexts the head will see), until `tokens`
    positions. Prompts are decoded `batch` at a time, each padded to the longest with blank lines
    at the start of its request (a batch shares positions)."""
    import trio

    pad = tok.encode("\n")
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in qs]
    prompts.sort(key=len)
    empty = tok.encode_chat([{"role": "user", "content": ""}])
    split = next(i for i, (a, b) in enumerate(zip(empty, prompts[0] + [-1] * len(empty))) if a != b)  # request starts
    seqs: list[Trace] = []
    n, t0 = 0, time.perf_counter()
    for at in range(0, len(prompts), batch):
        group = prompts[at:at + batch]
        width = max(map(len, group))
        ids = torch.tensor([p[:split] + pad * (width - len(p)) + p[split:] for p in group])
        z, choice = trio.run(_decode, model, ids, new)
        for b in range(len(group)):
            ends = [i for i, t in enumerate(choice[b].tolist()) if t in tok.eos_ids]
            m = ends[0] + 1 if ends else new
            seqs.append((z[b, :m].clone(), choice[b, :m].clone(), choice[b, :m].clone()))  # greedy: next = choice
            n += m
        log(f"{n} positions from {min(at + batch, len(prompts))} answers, {n / (time.perf_counter() - t0):.0f}/s")
        if n >= tokens:
            break
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
        starts.append(torch.arange(off, off + len(z) - unroll))
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


def train(draft: DraftHead, head: Head, fit: list[Trace], held: list[Trace], unroll: int = 3, epochs: int = 6,
          batch: int = 256, lr: float = 2e-3, log: Callable[[str], None] = lambda s: None, seed: int = 0) -> Report:
    """Minimise, over `unroll` steps fed the head's own predictions, the cross-entropy of each
    step's guess against the model's choice plus the smooth-L1 distance to the model's state
    (EAGLE's two losses; later steps weigh 0.8x the one before). `held` should be answers: there
    the next token is the model's choice, so a chain of hits is what verification accepts."""
    g = torch.Generator().manual_seed(seed)
    emb = head.embed.weight.detach().float()
    w = draft.vocab_rows(head.lm_head.weight).float()
    index = torch.full((head.lm_head.weight.shape[0],), -1, dtype=torch.long)
    index[draft.vocab if len(draft.vocab) else torch.arange(len(index))] = torch.arange(len(w))
    z, nxt, choice, starts = _flatten(fit, unroll)
    label = index[choice]
    if (label[starts[:, None] + torch.arange(1, unroll + 1)] < 0).any():
        raise ValueError("a label is missing from the draft head's vocab")
    opt = torch.optim.AdamW(draft.parameters(), lr=lr, weight_decay=0.0)
    steps = epochs * ((len(starts) + batch - 1) // batch)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, lr, total_steps=steps, pct_start=0.1) if steps else None
    for epoch in range(epochs):
        perm = starts[torch.randperm(len(starts), generator=g)]
        total = 0.0
        for i in range(0, len(perm), batch):
            at = perm[i:i + batch]
            loss = sum((F.cross_entropy(s @ w.t(), label[t]) + F.smooth_l1_loss(s, z[t])) * 0.8 ** j
                       for j, (s, t) in enumerate(_unroll(draft, emb, z, nxt, at, unroll)))
            opt.zero_grad()
            loss.backward()  # type: ignore[union-attr]
            opt.step()
            sched.step()  # type: ignore[union-attr]
            total += float(loss.detach()) * len(at)  # type: ignore[union-attr]
        log(f"epoch {epoch + 1}: loss {total / len(perm):.3f}")
    with torch.no_grad():
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
    draft.calibration.copy_(torch.tensor(calibration))
    return Report(hits, chain, calibration)


def build(model: LocalModel, tok: Tokenizer, file: Path, answers: int = 40_000, text: int = 24_000, epochs: int = 4,
          unroll: int = 3, log: Callable[[str], None] = lambda s: print(s, file=sys.stderr)) -> Report:
    """Collect `answers` positions of the model's own answers and `text` of teacher-forced text,
    train a draft head on all text and nine tenths of the answers, report on the other tenth,
    and save it."""
    t0 = time.perf_counter()
    answered = generated(model, tok, questions(), answers, log=log) if answers else []
    read = examples(model, tok, corpus(), text, log=log) if text else []
    order = torch.randperm(len(answered), generator=torch.Generator().manual_seed(0)).tolist()
    held = [answered[i] for i in order[:max(1, len(answered) // 10)]] if answered else read[:max(1, len(read) // 10)]
    fit = [answered[i] for i in order[len(held):]] + (read if answered else read[len(held):])
    log(f"collected {sum(len(s[0]) for s in answered + read)} positions in {time.perf_counter() - t0:.0f} s")
    torch.manual_seed(0)
    vocab = torch.unique(torch.cat([s[2] for s in answered + read]))
    hidden = model.head.norm.weight.shape[0]
    draft = DraftHead(hidden, hidden * 8 // 3, vocab)
    with torch.enable_grad():
        report = train(draft, model.head, fit, held, unroll, epochs, log=log)
    save(draft, file, {"answers": answers, "text": text, "epochs": epochs, "unroll": unroll, **vars(report)})
    log(f"draft head: held-out hits {', '.join(f'{a:.2f}' for a in report.hits)}, chains "
        f"{', '.join(f'{a:.2f}' for a in report.chain)} ({time.perf_counter() - t0:.0f} s) -> {file}")
    return report
