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
It is trained by self-distillation (draft_training.py). On the model's answers to the
benchmark prompts, which it was not trained on, the first guess is right 39% of the time on chat,
51% on code and 30% on summaries (scripts/eval_draft_head.py; the Medusa heads: 13-24%).

The file (`<home>/drafts/<model>/draft-head.safetensors`) also carries the head's calibration:
how often a guess of each confidence band was right on held-out answers, which the planner uses
as its prior acceptance rate per band. No peer sees the head and the output does not depend on
it: verification accepts only what the model itself picks.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from diffuse.data.scheduler import Threads
from diffuse.errors import ModelError
from diffuse.model.kernels import Linear, linear
from diffuse.model.engine import Head

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
        self.threads = Threads()  # how many threads drafting takes, measured (see `propose`)

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
        bytes is nearly half the time. fp16, not bf16: its longer mantissa keeps fp32's guesses,
        which bf16's can change. Rebuilt after training steps.
        (figures: docs/measurements.md, 'Figures once quoted in module comments')"""
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

        Its ~30 small products run on the thread count measured cheaper (`Threads`): between
        network steps the cores idle, and waking a second thread for every product can cost
        more than it saves, while back to back two threads are faster: neither count wins
        everywhere (figures: docs/measurements.md, 'Figures once quoted in module comments').
        """
        threads, before = self.threads.choose(1), torch.get_num_threads()
        if threads != before:
            torch.set_num_threads(threads)
        t0 = time.perf_counter()
        try:
            return self._propose(head, h, root, depth, nodes, beam, top, floor)
        finally:
            self.threads.record(1, threads, time.perf_counter() - t0)
            if threads != before:
                torch.set_num_threads(before)

    def _propose(self, head: Head, h: Tensor, root: int, depth: int, nodes: int, beam: int, top: int,
                 floor: float) -> list[tuple[list[int], str]]:
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


def max_bytes(hidden: int, vocab: int) -> int:
    """The largest file a head for this width and vocabulary can be: its weights (~11 h^2 fp32
    numbers at the default 8/3 MLP width; 16 h^2 allows twice that) and a vocab list, plus room
    for the header. A fetched file beyond it is refused before it is read."""
    return 4 * 16 * hidden * hidden + 8 * vocab + (1 << 20)


def load(file: Path, hidden: int, vocab_size: int | None = None) -> DraftHead | None:
    """The draft head in `file`, or None when there is none or it does not fit this model's width.

    The file may come from a peer (draft_fetch.py), so it is checked before anything is built
    from it: every tensor's shape from the header (the MLP width declared in the metadata must
    match the tensors, so a header cannot make us allocate more than the file holds), finite
    weights, calibration rates in [0, 1], and (given `vocab_size`) token ids inside the vocabulary."""
    if not file.exists():
        return None
    from safetensors import safe_open

    try:
        with safe_open(str(file), "pt") as f:
            meta = f.metadata() or {}
            width, inter = int(meta["hidden"]), int(meta["inter"])
            if width != hidden:
                return None
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        want = {"fc.weight": (hidden, 2 * hidden), "fc.bias": (hidden,), "norm.weight": (hidden,),
                "gate.weight": (inter, hidden), "up.weight": (inter, hidden), "down.weight": (hidden, inter),
                "calibration": (len(BANDS) + 1,)}
        wrong = {k: shapes.get(k) for k, v in want.items() if shapes.get(k) != v}
        if wrong or len(shapes.get("vocab", ())) != 1 or set(shapes) != set(want) | {"vocab"}:
            raise ValueError(f"tensors {sorted(shapes)} do not make a head of width {hidden}, MLP {inter}: "
                             f"{wrong or 'unexpected or missing tensors'}")
        state = load_file(str(file))
        bad = [k for k, t in state.items() if t.is_floating_point() and not torch.isfinite(t).all()]
        if bad:
            raise ValueError(f"non-finite numbers in {bad}")
        cal, vocab = state["calibration"], state["vocab"]
        if not ((cal >= 0) & (cal <= 1)).all():
            raise ValueError(f"calibration rates outside [0, 1]: {cal.tolist()}")
        outside = len(vocab) and (vocab.min() < 0 or (vocab_size and vocab.max() >= vocab_size))
        if vocab.is_floating_point() or outside:
            raise ValueError(f"vocab holds ids outside the model's {vocab_size} tokens")
        draft = DraftHead(hidden, inter, vocab.long(), cal.float())
        draft.load_state_dict(state)
    except Exception as e:  # noqa: BLE001 - whatever is wrong with the file, say which file
        raise ModelError(f"{file}: not a usable draft-head file ({type(e).__name__}: {e}); "
                         "delete it or run `diffuse model draft-head` again") from None
    return draft.eval()
