"""Draft heads: guesses for the tokens after the next one, from the client's last hidden state.

Copying earlier text (prompt lookup) guesses well only where the answer repeats something; on
chat and code the first guess after the root was right 8-17% of the time (SmolLM2, measured), so
a step rarely earned its extra positions. A Medusa-style head (Cai et al. 2024) reads the
normalised final hidden state z of the position that produced the root, which the client holds
anyway (it runs the LM head), and predicts the token k + 1 places ahead through the model's own
LM head: logits_k = lm_head(z + SiLU(W_k z + b_k)). Only W_k, b_k are learned (about 330 k
numbers per head for SmolLM2), by self-distillation: the labels are the model's own greedy
choices, so a head learns what this model will say, not what a corpus says. Training reads text
through the local model once (teacher forcing) and needs no data beyond what Python ships.

The heads are a client-side file (`<home>/drafts/<model>/heads.safetensors`); no peer sees them
and the output does not depend on them: verification accepts only what the model itself picks.
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from diffuse.client.pipeline import LocalModel
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
        likeliest tokens of each head, best first."""
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

    with safe_open(str(file), "pt") as f:
        meta = f.metadata() or {}
    try:
        k, width = int(meta["k"]), int(meta["hidden"])
    except (KeyError, ValueError):
        raise ValueError(f"{file}: not a draft-heads file (metadata {meta})") from None
    if width != hidden:
        return None
    state = load_file(str(file))
    state.setdefault("vocab", torch.zeros(0, dtype=torch.long))  # none: the whole vocabulary
    heads = DraftHeads(hidden, k, state["vocab"])
    heads.load_state_dict(state)
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
    x = torch.tensor([ids])
    h = model.head.embed_tokens(x)
    positions = torch.arange(len(ids))
    for span in model.spans:
        h = span(h.to(span.blocks[0].wo.weight.dtype), positions, span.new_cache(len(ids)))
    z = model.head.norm(h.to(model.head.norm.weight.dtype))[0]
    return z.float(), model.head.lm_head(z).argmax(-1)


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


def build(model: LocalModel, tok: Tokenizer, file: Path, k: int = 2, tokens: int = 40_000,
          epochs: int = 2, log: Callable[[str], None] = lambda s: print(s, file=sys.stderr)) -> list[float]:
    """Collect, train and save draft heads for this model; returns held-out top-1 accuracies."""
    t0 = time.perf_counter()
    z, labels = examples(model, tok, corpus(), k, tokens, log=log)
    log(f"collected {len(z)} positions in {time.perf_counter() - t0:.0f} s")
    torch.manual_seed(0)
    heads = DraftHeads(z.shape[1], k, torch.unique(labels))
    with torch.enable_grad():
        acc = train(heads, model.head, z, labels, epochs, log=log)
    save(heads, file, {"positions": len(z), "epochs": epochs, "accuracy": acc})
    log(f"draft heads: held-out top-1 accuracy {', '.join(f'{a:.2f}' for a in acc)} "
        f"({time.perf_counter() - t0:.0f} s) -> {file}")
    return acc


def iter_top(proposals: list[list[int]], width: int) -> Iterator[list[int]]:
    """Guessed continuations from per-head top lists: head 1's top `width`, each extended by the
    best of the deeper heads (a chain, as Medusa's sparse tree's heaviest branch)."""
    deeper = [p[0] for p in proposals[1:]]
    for tok in proposals[0][:width]:
        yield [tok, *deeper]
