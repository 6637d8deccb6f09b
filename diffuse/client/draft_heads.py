"""Draft heads: guesses for the tokens after the next one, from the client's last hidden state.

Copying earlier text (prompt lookup) guesses well only where the answer repeats something; on
chat and code the first guess after the root was right 8-17% of the time (SmolLM2, measured), so
a step rarely earned its extra positions. A Medusa-style head (Cai et al. 2024) reads the
normalised final hidden state z of the position that produced the root, which the client holds
anyway (it runs the LM head), and predicts the token k + 1 places ahead through the model's own
LM head: logits_k = lm_head(z + SiLU(W_k z + b_k)). Only W_k, b_k are learned (about 330 k
numbers per head for SmolLM2), by self-distillation: the labels are the model's own greedy
choices, so a head learns what this model will say, not what a corpus says: mostly the model's
own answers to generated requests, decoded in batches, plus text read once (teacher forcing).
No data is needed beyond what Python ships.

The heads are a client-side file (`<home>/drafts/<model>/heads.safetensors`); no peer sees them
and the output does not depend on them: verification accepts only what the model itself picks.
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from diffuse.client.pipeline import LocalModel
from diffuse.errors import ModelError
from diffuse.model.llama import Head
from diffuse.model.tokenizer import Tokenizer

FILE = "heads.safetensors"


class DraftHeads(nn.Module):
    """K residual heads on the final normalised hidden state, sharing the model's LM head.

    `vocab` lists the tokens the heads may guess (those the model chose in training): scoring
    only those rows of the LM head makes training and each step's guesses ~5x cheaper than the
    whole vocabulary, and a token the model never chose there is a poor guess anyway.
    """

    def __init__(self, hidden: int, k: int, vocab: Tensor | None = None):
        super().__init__()
        self.proj = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(k))
        for p in self.proj:  # start as the identity: each head first predicts the next token
            nn.init.zeros_(p.weight)
            nn.init.zeros_(p.bias)
        self.register_buffer("vocab", vocab if vocab is not None else torch.zeros(0, dtype=torch.long))
        self._rows: tuple[int, Tensor] | None = None  # (LM head's data_ptr, its vocab rows in fp32)

    @property
    def k(self) -> int:
        return len(self.proj)

    def states(self, z: Tensor) -> Tensor:
        """[K, ..., hidden] states whose LM-head logits guess tokens 2..K+1 ahead of z's position."""
        return torch.stack([z + F.silu(p(z)) for p in self.proj])

    def rows(self, weight: Tensor) -> Tensor:
        """The LM head's rows for `vocab` (all rows if empty), in fp32, kept while the head is."""
        if self._rows is None or self._rows[0] != weight.data_ptr():
            w = weight.detach() if not len(self.vocab) else weight.detach()[self.vocab]
            self._rows = (weight.data_ptr(), w.float())
        return self._rows[1]

    @torch.inference_mode()
    def propose(self, head: Head, h: Tensor, top: int) -> list[list[int]]:
        """For one position's final hidden state h [hidden] (before the final norm): the `top`
        likeliest tokens of each head, best first. (Their probabilities were tried as the
        planner's acceptance estimate: on chat a 0.6+ guess was right 20% of the time, no better
        a guide than the learned rate per head and rank.)"""
        z = head.norm(h).float()
        idx = (self.states(z) @ self.rows(head.lm_head.weight).t()).topk(top, dim=-1).indices
        return (self.vocab[idx] if len(self.vocab) else idx).tolist()


def path(home: Path, model: str) -> Path:
    return home / "drafts" / model / FILE


def save(heads: DraftHeads, file: Path, meta: dict) -> None:
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_suffix(".tmp")
    save_file({n: t.contiguous() for n, t in heads.state_dict().items()}, str(tmp),
              metadata={"k": str(heads.k), "hidden": str(heads.proj[0].in_features), "info": json.dumps(meta)})
    tmp.replace(file)


def load(file: Path, hidden: int) -> DraftHeads | None:
    """The heads in `file`, or None when there is none or it does not fit this model's width."""
    if not file.exists():
        return None
    from safetensors import safe_open

    try:
        with safe_open(str(file), "pt") as f:
            meta = f.metadata() or {}
        k, width = int(meta["k"]), int(meta["hidden"])
        if width != hidden:
            return None
        state = load_file(str(file))
        heads = DraftHeads(hidden, k, state["vocab"])
        heads.load_state_dict(state)
    except Exception as e:  # noqa: BLE001 - whatever is wrong with the file, say which file
        raise ModelError(f"{file}: not a usable draft-heads file ({type(e).__name__}: {e}); "
                         "delete it or run `diffuse model draft-heads` again") from None
    return heads.eval()


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


def generated(model: LocalModel, tok: Tokenizer, qs: list[str], k: int, tokens: int, batch: int = 32,
              new: int = 128, log: Callable[[str], None] = lambda s: None) -> tuple[Tensor, Tensor]:
    """(z, labels) as in `examples`, from the model's own greedy answers to `qs`: the contexts the
    heads will see. Prompts are decoded `batch` at a time, each padded to the longest with blank
    lines at the start of its request (a batch shares positions)."""
    import trio

    pad = tok.encode("\n")
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in qs]
    prompts.sort(key=len)
    empty = tok.encode_chat([{"role": "user", "content": ""}])
    split = next(i for i, (a, b) in enumerate(zip(empty, prompts[0] + [-1] * len(empty))) if a != b)  # request starts
    zs, labels, n, t0 = [], [], 0, time.perf_counter()
    for at in range(0, len(prompts), batch):
        group = prompts[at:at + batch]
        width = max(map(len, group))
        ids = torch.tensor([p[:split] + pad * (width - len(p)) + p[split:] for p in group])
        z, choice = trio.run(_decode, model, ids, new)
        for b in range(len(group)):
            ends = [i for i, t in enumerate(choice[b].tolist()) if t in tok.eos_ids]
            m = (ends[0] + 1 if ends else new) - k
            if m > 0:
                zs.append(z[b, :m])
                labels.append(torch.stack([choice[b, 1 + j:1 + j + m] for j in range(k)], dim=1))
                n += m
        log(f"{n} positions from {min(at + batch, len(prompts))} answers, {n / (time.perf_counter() - t0):.0f}/s")
        if n >= tokens:
            break
    return torch.cat(zs)[:tokens], torch.cat(labels)[:tokens]


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


def examples(model: LocalModel, tok: Tokenizer, pairs: list[tuple[str, str]], k: int, tokens: int,
             window: int = 384, log: Callable[[str], None] = lambda s: None) -> tuple[Tensor, Tensor]:
    """(z [N, hidden], labels [N, k]): at each position, the model's normalised final hidden
    state and its own greedy choices 2..k+1 positions ahead (teacher-forced on the text)."""
    zs, labels, n, t0 = [], [], 0, time.perf_counter()
    for question, text in pairs:
        prompt = tok.encode_chat([{"role": "user", "content": question}])
        body = tok.encode(text)
        for at in range(0, len(body), window - len(prompt)):
            ids = prompt + body[at:at + window - len(prompt)]
            z, choice = _forward(model, ids)
            z, choice = z[len(prompt) - 1:], choice[len(prompt) - 1:]
            m = len(choice) - k
            if m <= 0:
                continue
            zs.append(z[:m])
            labels.append(torch.stack([choice[1 + j:1 + j + m] for j in range(k)], dim=1))
            if (n + m) // 5000 > n // 5000:
                log(f"{n + m} positions, {(n + m) / (time.perf_counter() - t0):.0f}/s")
            n += m
            if n >= tokens:
                return torch.cat(zs)[:tokens], torch.cat(labels)[:tokens]
    return torch.cat(zs), torch.cat(labels)


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


def train(heads: DraftHeads, head: Head, z: Tensor, labels: Tensor, epochs: int = 2, batch: int = 256,
          lr: float = 1e-3, log: Callable[[str], None] = lambda s: None, seed: int = 0) -> list[float]:
    """Cross-entropy of each head's logits (through the frozen LM head) on its labels; returns
    the per-head top-1 accuracy on a held-out tenth."""
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(z), generator=g)
    held = order[:len(z) // 10]
    fit = order[len(z) // 10:]
    w = heads.rows(head.lm_head.weight)
    if len(heads.vocab):  # labels as indices into vocab (every label must be in it)
        index = torch.full((int(heads.vocab.max()) + 1,), -1, dtype=torch.long)
        index[heads.vocab] = torch.arange(len(heads.vocab))
        labels = index[labels]
        if (labels < 0).any():
            raise ValueError("a label is missing from the heads' vocab")
    opt = torch.optim.AdamW(heads.parameters(), lr=lr, weight_decay=0.0)
    steps = epochs * ((len(fit) + batch - 1) // batch)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, lr, total_steps=steps, pct_start=0.1) if steps else None
    for epoch in range(epochs):
        perm = fit[torch.randperm(len(fit), generator=g)]
        total = 0.0
        for i in range(0, len(perm), batch):
            rows = perm[i:i + batch]
            s = heads.states(z[rows])  # [K, B, H]
            loss = F.cross_entropy((s @ w.t()).flatten(0, 1), labels[rows].t().flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()  # type: ignore[union-attr]
            total += float(loss.detach()) * len(rows)
        log(f"epoch {epoch + 1}: loss {total / len(perm):.3f}")
    with torch.no_grad():
        pred = (heads.states(z[held]) @ w.t()).argmax(-1)  # [K, N], in vocab indices as the labels
        return [float((pred[j] == labels[held, j]).float().mean()) for j in range(heads.k)]


def build(model: LocalModel, tok: Tokenizer, file: Path, k: int = 3, answers: int = 16_000, text: int = 16_000,
          epochs: int = 2, log: Callable[[str], None] = lambda s: print(s, file=sys.stderr)) -> list[float]:
    """Collect (`answers` positions of the model's own answers, `text` of teacher-forced text),
    train and save draft heads for this model; returns held-out top-1 accuracies."""
    t0 = time.perf_counter()
    parts = []
    if answers:
        parts.append(generated(model, tok, questions(), k, answers, log=log))
    if text:
        parts.append(examples(model, tok, corpus(), k, text, log=log))
    z, labels = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    log(f"collected {len(z)} positions in {time.perf_counter() - t0:.0f} s")
    torch.manual_seed(0)
    heads = DraftHeads(z.shape[1], k, torch.unique(labels))
    with torch.enable_grad():
        acc = train(heads, model.head, z, labels, epochs, log=log)
    save(heads, file, {"answers": answers, "text": text, "epochs": epochs, "accuracy": acc})
    log(f"draft heads: held-out top-1 accuracy {', '.join(f'{a:.2f}' for a in acc)} "
        f"({time.perf_counter() - t0:.0f} s) -> {file}")
    return acc
