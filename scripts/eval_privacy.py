#!/usr/bin/env python
"""Privacy, measured: what an honest-but-curious peer recovers of a session it serves.

    nice -n 10 .venv/bin/python scripts/eval_privacy.py [--home DIR] [--tokens 24] [--per-kind 4]
        [--fronts 0,1,2,4,8] [--backs 0,1,2] [--train-tokens 30000] [--epochs 3] [--k 48] [--k1 16]
        [--wide 256] [--noise 0.05,0.2 --noise-split 1,0] [--out FILE.json]

A private loopback swarm runs in this process: two peers over real libp2p streams (Noise, the
swarm key's private-network layer), serving blocks [0, L/2) and [L/2, L) in bf16, and a client
with the defaults (bf16 compute, fp16 wire, greedy, no trust checks) asking prompts of three
kinds (chat, code, text with names and numbers) for every `--local-blocks N,M`. Each peer's
server reads through a tap that decodes every frame with the codec (data/codec.py), so the
attacks below see exactly the tensors the peer decoded: the first peer's received states
(blocks 0..N-1 done by the client) and the last peer's returned states (blocks up to L-M).

Attackers know the public weights and are trained only on other text (pydoc, stdlib code, the
draft head's training requests, never the prompts here):
- A1: nearest neighbour (cosine) among the states of single vocabulary tokens (each token at
  position 1, after the chat's public first token);
- A2: probes from a state to its token, linear and MLP, scoring the public embedding matrix;
- A3: exact search: the attacker runs the public first N blocks itself, left to right, and at
  each position keeps the candidate whose recomputed state matches the observed one. Candidates
  are pruned to A2's (MLP) top-k and A1's top-k; a run of A2's first choices is verified in one
  pass and searched only where it fails. The table says how often the truth was not a candidate;
- A4: the last peer's view: the public last M blocks (recomputed from the states it returned),
  final norm and LM head applied to each position, read as the next token;
- a frequency baseline: always the training text's most frequent token.
Scored tokens are the user's own (template tokens are public) and the generated ones.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
import trio
from torch import Tensor, nn

from diffuse.client.generate import session_length, stream_tokens
from diffuse.client.sampling import Sampler, SamplingParams
from diffuse.client.swarm import SwarmClient, SwarmOptions
from diffuse.control.announce import Serving
from diffuse.control.node import Node, NodeConfig, open_node
from diffuse.control.swarm_key import SwarmKey
from diffuse.data.codec import PROTOCOL_ID, FrameDecoder, Open, Step, StepOk, WireError
from diffuse.data.serve import PeerService
from diffuse.model.config import ModelConfig
from diffuse.model.engine import BlockSpan, Head
from diffuse.model.load import load_head, load_span
from diffuse.model.weights import load_manifest
from diffuse.trust import reputation

LOCAL = ["/ip4/127.0.0.1/tcp/0"]

# ---------------------------------------------------------------- what a peer sees


@dataclass
class Recorded:
    """One session as a peer's server decoded it: what came in, what went out."""

    open: Open | None = None
    steps: list[Step] = field(default_factory=list)
    replies: list[StepOk] = field(default_factory=list)


class Tap:
    """A server-side stream that decodes, with the codec, every frame the peer reads and writes."""

    def __init__(self, stream, record: Recorded):
        self.stream, self.record = stream, record
        self.inbound, self.outbound = FrameDecoder(), FrameDecoder()

    async def read(self, n: int = -1) -> bytes:
        data = await self.stream.read(n)
        self._note(self.inbound, data)
        return data

    async def write(self, data: bytes) -> None:
        self._note(self.outbound, data)
        await self.stream.write(data)

    async def close(self) -> None:
        await self.stream.close()

    def _note(self, decoder: FrameDecoder, data: bytes) -> None:
        try:
            messages = decoder.feed(data) if data else []
        except WireError:  # the server answers a bad frame itself; the tap has nothing to learn
            return
        for m in messages:
            if isinstance(m, Open):
                self.record.open = m
            elif isinstance(m, Step):
                self.record.steps.append(m)
            elif isinstance(m, StepOk):
                self.record.replies.append(m)


@dataclass
class Seen:
    """A session's committed rows, in position order: [batch, T, hidden] in fp32."""

    inputs: Tensor
    outputs: Tensor


def committed(record: Recorded) -> Seen:
    """The rows a session committed, as the protocol tells any peer: steps with COMMIT, candidate
    rows a later `keep` chose, truncated wherever a step's cache_len rolls back."""
    rows: list[tuple[Tensor, Tensor]] = []
    pending: tuple[Tensor, Tensor] | None = None
    for step, reply in zip(record.steps, record.replies):
        if step.keep and pending is not None:
            rows += [(pending[0][:, j], pending[1][:, j]) for j in step.keep]
        del rows[step.cache_len:]
        new = [(step.hidden[:, j].float(), reply.hidden[:, j].float()) for j in range(step.hidden.shape[1])]
        if step.commit:
            rows += new
            pending = None
        else:
            pending = (step.hidden.float(), reply.hidden.float())
    return Seen(torch.stack([r[0] for r in rows], 1), torch.stack([r[1] for r in rows], 1))


# ---------------------------------------------------------------- a real session, tapped


@dataclass
class Peer:
    node: Node
    service: PeerService
    sessions: list[Recorded]


@asynccontextmanager
async def loopback_swarm(model_dir: Path, dtype: torch.dtype = torch.bfloat16
                         ) -> AsyncIterator[tuple[Node, list[Peer]]]:
    """Two tapped peers (blocks [0, L/2) and [L/2, L)) of a new private swarm, and a client node."""
    manifest = load_manifest(model_dir)
    n = manifest.num_layers
    key = SwarmKey.generate()
    peers: list[Peer] = []

    def handler(sessions: list[Recorded], service: PeerService):
        async def handle(stream, remote: str) -> None:
            sessions.append(Recorded())
            await service.server.handle(Tap(stream, sessions[-1]), remote)
        return handle

    async def peer(start: int, end: int, bootstrap: list[str]) -> None:
        service, sessions = PeerService(model_dir, manifest.model_id, dtype, throughput=100.0), []
        config = NodeConfig(listen=LOCAL, bootstrap=bootstrap, swarm_key=key)
        node = await stack.enter_async_context(open_node(_key(), config, codecs=reputation.swarm_codecs(),
                                                         handlers={PROTOCOL_ID: handler(sessions, service)}))
        await service.prepare(start, end)
        await node.serve(Serving(manifest.model_id, n, start, end, manifest.block_hashes[start:end], "bf16",
                                 service.throughput, 1 << 16, (PROTOCOL_ID,)))
        peers.append(Peer(node, service, sessions))

    from contextlib import AsyncExitStack

    async with AsyncExitStack() as stack:
        await peer(0, n // 2, [])
        await peer(n // 2, n, peers[0].node.full_addrs())
        config = NodeConfig(listen=LOCAL, bootstrap=peers[0].node.full_addrs(), server=False, swarm_key=key)
        client = await stack.enter_async_context(open_node(_key(), config, codecs=reputation.swarm_codecs()))
        yield client, peers


def _key():
    from libp2p.crypto.ed25519 import create_new_key_pair

    return create_new_key_pair()


@dataclass
class Capture:
    """One prompt's session through a route of two peers, as each of them saw it."""

    prompt: list[int]
    generated: list[int]
    first: Seen  # the first peer's view: its inputs are the client's block N-1 outputs
    last: Seen  # the last peer's view: its outputs go into the client's block L-M
    seconds: float


async def capture(client_node: Node, peers: list[Peer], model_dir: Path, split: tuple[int, int],
                  prompts: Sequence[list[int]], max_tokens: int, eos: set[int], noise: float = 0.0) -> list[Capture]:
    """Greedy answers to `prompts` with `--local-blocks N,M` = split (and `noise` on what the client
    sends, client/privacy.py), each session as the peers saw it."""
    client = SwarmClient(client_node, model_dir, SwarmOptions(local_blocks=split, trust=None, noise=noise))
    with trio.fail_after(60):
        while not await client.covered():
            await trio.sleep(0.2)
    out = []
    for prompt in prompts:
        before = [len(p.sessions) for p in peers]
        t0 = time.perf_counter()
        pipe = await client.session(session_length(len(prompt), max_tokens))
        try:
            sampler = Sampler(SamplingParams(max_tokens=max_tokens))
            generated = [t async for t in stream_tokens(pipe, prompt, sampler, eos)]
        finally:
            await pipe.close()
        seconds = time.perf_counter() - t0
        new = [[r for r in p.sessions[b:] if r.open is not None] for p, b in zip(peers, before)]  # not pings
        if any(len(s) != 1 for s in new):
            raise RuntimeError(f"expected one session on each peer, got {[len(s) for s in new]}")
        out.append(Capture(prompt, generated, committed(new[0][0]), committed(new[1][0]), seconds))
    return out


# ---------------------------------------------------------------- prompts and other text

# Evaluation prompts: written for this script, in no training text below (nor in draft_requests).
PROMPTS: dict[str, list[str]] = {
    "chat": [
        "My sister is getting married next month and I have to give a short speech. I am nervous about "
        "speaking in front of people. Can you help me write something warm and a little funny?",
        "I keep waking up at three in the morning and cannot fall asleep again. What could be causing it "
        "and what can I try tonight?",
        "My manager criticised my report in front of the whole team today and I felt humiliated. Should "
        "I talk to her about it, and how?",
        "We are thinking about adopting a rescue greyhound, but we live in a flat with a small balcony. "
        "Is that a bad idea?",
        "I failed my driving test for the second time because of a roundabout. Any tips before I try "
        "again in two weeks?",
        "What would be a thoughtful present for my grandfather, who turns ninety and has everything?",
    ],
    "code": [
        "Why does this crash?\n\ndef mean(xs):\n    total = 0\n    for x in xs:\n        total += x\n"
        "    return total / len(xs)\n\nprint(mean([]))",
        "Make this faster:\n\nresult = []\nfor user in users:\n    if user.id in banned_ids_list:\n"
        "        continue\n    result.append(user.email.lower())",
        "Explain what this SQL does: SELECT customer_id, SUM(amount) FROM payments WHERE paid_at >= "
        "'2024-01-01' GROUP BY customer_id HAVING SUM(amount) > 500 ORDER BY 2 DESC;",
        "Write a bash one-liner that finds every .log file under /var/app larger than 10 MB and "
        "deletes those older than 7 days.",
        "My React component re-renders forever:\n\nfunction Clock() {\n  const [t, setT] = useState(0);\n"
        "  setT(Date.now());\n  return <span>{t}</span>;\n}",
        "Convert this loop to a list comprehension: squares = {}\nfor k, v in prices.items():\n"
        "    if v > 0:\n        squares[k] = v ** 2",
    ],
    "names": [
        "Write a polite reminder to Mrs Ingrid Halvorsen, 14 Birch Lane, Tromsø: her invoice 58213 for "
        "1,240 NOK was due on 3 March.",
        "Summarise: Dr. Amara Okafor saw patient Tomasz Zielinski (born 22/07/1961) on 9 May; blood "
        "pressure 150/95, prescribed 5 mg amlodipine daily.",
        "Draft a reference letter for Kenji Watanabe, who worked at Larkspur Analytics from 2017 to 2023 "
        "and led a team of 6 engineers.",
        "Rafael Moreno's flight IB3166 from Madrid lands at 17:45 on Friday; his phone is +34 612 448 "
        "903. Write a text asking him to meet at gate B12.",
        "Please check my budget: rent 1,850 dollars, car loan 412, groceries 640, and my salary from "
        "Northwind Ltd is 5,300 a month after tax.",
        "Write a birthday card for Siobhan Gallagher, who turns 34 on 18 October and lives at 7 Harbour "
        "Road, Galway.",
    ],
}


def user_span(tok, text: str) -> tuple[list[int], range]:
    """A chat prompt's ids and the positions of the user's own tokens in it (the template's are public)."""
    ids = tok.encode_chat([{"role": "user", "content": text}])
    empty = tok.encode_chat([{"role": "user", "content": ""}])
    a = 0
    while a < len(empty) and ids[a] == empty[a]:
        a += 1
    b = 0
    while b < len(empty) - a and ids[-1 - b] == empty[-1 - b]:
        b += 1
    return ids, range(a, len(ids) - b)


def training_sequences(tok, tokens: int, seed: int = 0, window: int = 256) -> list[list[int]]:
    """Attackers' text, none of it evaluation text: chat requests the draft head trains on, pydoc's
    prose and standard-library code, each sent as a user message of the chat template (the format
    every session uses), up to `window` tokens; about `tokens` in all."""
    import pydoc_data.topics as topics
    import sysconfig

    from diffuse.client import draft_requests as R

    texts: list[str] = list(R.CHAT_QUESTIONS) + [f.format(t) for t in R.CHAT_SUBJECTS for f in R.CHAT_FORMS[:2]]
    texts += [f.format(t) for t in R.CODE_TASKS for f in R.CODE_FORMS[:1]] + list(R.CODE_REQUESTS)
    paras = [" ".join(p.split()) for t in topics.topics.values() for p in t.split("\n\n") if len(p.split()) > 20]
    texts += paras
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in ("textwrap", "fractions", "heapq", "bisect", "statistics", "difflib", "shlex", "calendar",
                 "glob", "fnmatch", "colorsys", "string", "csv", "dataclasses", "pprint", "argparse"):
        src = stdlib / f"{name}.py"
        if src.exists():
            lines = src.read_text().splitlines()
            texts += ["\n".join(lines[i:i + 25]) for i in range(0, len(lines), 25)]
    rng = random.Random(seed)
    rng.shuffle(texts)
    seqs, total = [], 0
    for text in texts:
        ids = tok.encode_chat([{"role": "user", "content": text}])[:window]
        seqs.append(ids)
        total += len(ids)
        if total >= tokens:
            break
    return seqs


# ---------------------------------------------------------------- the attackers' tools


def normalise(h: Tensor) -> Tensor:
    """Each state scaled to unit RMS (massive activations of a few positions would swamp the rest)."""
    h = h.float()
    return h / h.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()


@torch.inference_mode()
def layer_states(model_dir: Path, cfg: ModelConfig, head: Head, seqs: Sequence[list[int]], fronts: Sequence[int],
                 dtype: torch.dtype) -> tuple[dict[int, Tensor], Tensor]:
    """The attacker's own run of the public first blocks over `seqs`: states after block N-1 of every
    position but the first ({N: [rows, hidden]}, N = 0: embeddings) and the token at each row."""
    cuts = sorted(set(fronts) | {0})
    spans = {(a, b): load_span(model_dir, a, b, dtype) for a, b in zip(cuts, cuts[1:])}
    out: dict[int, list[Tensor]] = {n: [] for n in cuts}
    toks = []
    for ids in seqs:
        x = head.embed_tokens(torch.tensor([ids]))
        pos = torch.arange(len(ids))
        out[0].append(x[0, 1:].float())
        for (_, b), span in spans.items():
            x = span(x, pos, span.new_cache(len(ids)))
            out[b].append(x[0, 1:].float())
        toks.append(torch.tensor(ids[1:]))
    return {n: torch.cat(v) for n, v in out.items() if n in fronts}, torch.cat(toks)


@torch.inference_mode()
def single_token_states(model_dir: Path, head: Head, fronts: Sequence[int], first: int, dtype: torch.dtype,
                        vocab: int, batch: int = 512) -> dict[int, Tensor]:
    """A1's dictionary: the state of each vocabulary token at position 1, after the public token
    `first` (every chat session's first token), after block N-1, for each N ({N: [vocab, hidden]})."""
    cuts = sorted(set(fronts) | {0})
    spans = {(a, b): load_span(model_dir, a, b, dtype) for a, b in zip(cuts, cuts[1:])}
    out: dict[int, list[Tensor]] = {n: [] for n in cuts}
    pos = torch.arange(2)
    for lo in range(0, vocab, batch):
        ids = torch.arange(lo, min(vocab, lo + batch))
        x = head.embed_tokens(torch.stack([torch.full_like(ids, first), ids], 1))
        out[0].append(x[:, 1].float())
        for (_, b), span in spans.items():
            x = span(x, pos, span.new_cache(2, len(ids)))
            out[b].append(x[:, 1].float())
    return {n: torch.cat(v) for n, v in out.items() if n in fronts}


class Probe(nn.Module):
    """A2: a state -> a query in embedding space, scored against the public (unit) embedding rows,
    so that tokens absent from the training text can still be named."""

    def __init__(self, hidden: int, mlp: bool, width: int = 1536):
        super().__init__()
        self.f = (nn.Sequential(nn.Linear(hidden, width), nn.GELU(), nn.Linear(width, hidden)) if mlp
                  else nn.Linear(hidden, hidden))
        self.scale = nn.Parameter(torch.tensor(16.0))
        self.mu = nn.Parameter(torch.zeros(hidden), requires_grad=False)
        self.sd = nn.Parameter(torch.ones(hidden), requires_grad=False)

    def query(self, h: Tensor) -> Tensor:
        q = self.f((normalise(h) - self.mu) / self.sd)
        return self.scale * q / q.norm(dim=-1, keepdim=True)

    @torch.inference_mode()
    def topk(self, h: Tensor, emb: Tensor, k: int) -> Tensor:
        return torch.cat([(self.query(c) @ emb.T).topk(k, -1).indices for c in h.split(4096)])


def train_probe(x: Tensor, y: Tensor, emb: Tensor, mlp: bool, epochs: int, seed: int = 0, negatives: int = 2048,
                batch: int = 512) -> Probe:
    """Cross-entropy over the batch's tokens plus random negatives from the training vocabulary."""
    torch.manual_seed(seed)
    x, y, emb = x.clone(), y.clone(), emb.clone()  # not inference tensors: autograd saves them
    probe = Probe(x.shape[1], mlp)
    z = normalise(x)
    probe.mu.copy_(z.mean(0))
    probe.sd.copy_(z.std(0).clamp_min(1e-3))
    seen = y.unique()
    opt = torch.optim.Adam(probe.parameters(), lr=1e-3)
    steps = epochs * math.ceil(len(y) / batch)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, 2e-3, total_steps=steps)
    for _ in range(epochs):
        order = torch.randperm(len(y))
        for i in range(0, len(y), batch):
            idx = order[i:i + batch]
            cands = torch.cat([y[idx], seen[torch.randint(len(seen), (negatives,))]]).unique()
            target = torch.searchsorted(cands, y[idx])
            logits = probe.query(x[idx]) @ emb[cands].T
            loss = nn.functional.cross_entropy(logits, target)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    return probe.eval()


@torch.inference_mode()
def nearest(h: Tensor, table: Tensor, mu: Tensor, sd: Tensor, k: int) -> Tensor:
    """A1: the k tokens whose single-token states are nearest (cosine, standardised) to each state."""
    def z(t: Tensor) -> Tensor:
        t = (normalise(t) - mu) / sd
        return t / t.norm(dim=-1, keepdim=True)
    zt = torch.cat([z(c) for c in table.split(8192)])
    return torch.cat([(z(c) @ zt.T).topk(k, -1).indices for c in h.split(1024)])


@torch.inference_mode()
def exact_search(front: BlockSpan | None, head: Head, observed: Tensor, candidates: Sequence[Sequence[Tensor]],
                 tol: float = 0.05) -> tuple[Tensor, Tensor]:
    """A3: left to right, the candidate whose state after the public first N blocks (given the
    tokens recovered so far) is nearest the observed one. Each position's candidates come in tiers,
    likeliest first (say A2's and A1's top 2, then their top k, then a wider top): a tier is tried
    only when no candidate of the one before is within `tol` (relative) of the observed state (the
    truth is within ~1e-2: fp16 on the wire, bf16 sums in another order). With
    N = 0 the whole vocabulary is searched (an embedding row is a table look-up). Returns the tokens
    and each position's relative error of the best candidate."""
    if front is None:
        emb = head.embed.weight.float()
        d = torch.cdist(observed.float(), emb)
        best = d.argmin(-1)
        return best, d.gather(1, best[:, None])[:, 0] / observed.float().norm(dim=-1)
    cache = front.new_cache(len(observed) + max(len(c) for tiers in candidates for c in tiers))
    got, err = [], []
    for t in range(len(observed)):
        target = observed[t].float()
        for i, c in enumerate(candidates[t]):
            x = head.embed_tokens(c[None]).to(cache.k.dtype)
            y = front(x, torch.full((len(c),), t), cache, torch.eye(len(c), dtype=torch.bool), commit=False)[0]
            d = (y.float() - target).norm(dim=-1) / target.norm()
            j = int(d.argmin())
            if d[j] < tol or i == len(candidates[t]) - 1:
                break
            cache.rollback(t)
        cache.commit([j])
        got.append(int(c[j]))
        err.append(float(d[j]))
    return torch.tensor(got), torch.tensor(err)


def merge(*ranked: Tensor) -> list[Tensor]:
    """Per row, the candidates of several rankings interleaved best first, each token once."""
    out = []
    for rows in zip(*ranked):
        seen: dict[int, None] = {}
        for j in range(max(len(r) for r in rows)):
            for r in rows:
                if j < len(r):
                    seen.setdefault(int(r[j]), None)
        out.append(torch.tensor(list(seen)))
    return out


@torch.inference_mode()
def read_tokens(back: BlockSpan | None, head: Head, returned: Tensor) -> Tensor:
    """A4: the public last M blocks (over every position's returned state), final norm and LM head:
    at each position, the token the client will read there (greedy) or be offered likeliest."""
    x = returned[None].to(head.embed.weight.dtype)
    if back is not None:
        x = back(x, torch.arange(x.shape[1]), back.new_cache(x.shape[1]))
    return head.logits(x)[0].argmax(-1)


# ---------------------------------------------------------------- the evaluation


@dataclass
class Case:
    kind: str
    prompt: list[int]
    user: range  # the user's own positions in the prompt


def hits(guess: Tensor, truth: Sequence[int], rows: Sequence[int]) -> tuple[int, int]:
    rows = list(rows)
    return sum(int(guess[r]) == truth[r] for r in rows), len(rows)


@dataclass
class Tally:
    """Hits / scored tokens per (attacker, split, prompt kind, 'prompt' | 'generated')."""

    counts: dict[tuple, list[int]] = field(default_factory=dict)

    def add(self, key: tuple, got: tuple[int, int]) -> None:
        c = self.counts.setdefault(key, [0, 0])
        c[0] += got[0]
        c[1] += got[1]

    def rate(self, attacker: str, split: str, part: str, kind: str | None = None) -> float | None:
        cs = [v for (a, s, k, p), v in self.counts.items() if a == attacker and s == split and p == part
              and (kind is None or k == kind)]
        n = sum(c[1] for c in cs)
        return sum(c[0] for c in cs) / n if n else None


def time_local(model_dir: Path, head: Head, dtype: torch.dtype, context: int = 96, reps: int = 40
               ) -> tuple[float, float]:
    """Client compute per decoded token: ms for one block and for the LM head, one token at a time."""
    span = load_span(model_dir, 0, 1, dtype)
    cache = span.new_cache(context + reps + 8)
    with torch.inference_mode():
        span(torch.randn(1, context, head.embed.weight.shape[1], dtype=dtype), torch.arange(context), cache)
        x = torch.randn(1, 1, head.embed.weight.shape[1], dtype=dtype)
        for i in range(5):
            span(x, torch.tensor([context + i]), cache, commit=False)
            cache.rollback(context)
        blocks, lms = [], []
        for _ in range(reps):  # medians: the cores are shared
            t0 = time.perf_counter()
            span(x, torch.tensor([context]), cache, commit=False)
            cache.rollback(context)
            t1 = time.perf_counter()
            head.logits(x)
            blocks.append(t1 - t0)
            lms.append(time.perf_counter() - t1)
    return sorted(blocks)[reps // 2] * 1e3, sorted(lms)[reps // 2] * 1e3


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--home", default=None, help="the model store (default ~/.diffuse or $DIFFUSE_HOME)")
    ap.add_argument("--model", default=None, help="a store name or an HF directory (default: the embedded model)")
    ap.add_argument("--tokens", type=int, default=24, help="generated tokens per prompt")
    ap.add_argument("--per-kind", type=int, default=4, help="prompts of each kind (chat, code, names)")
    ap.add_argument("--fronts", default="0,1,2,4,8", help="N of --local-blocks N,M")
    ap.add_argument("--backs", default="0,1,2", help="M of --local-blocks N,M")
    ap.add_argument("--train-tokens", type=int, default=30000, help="attackers' training text, in tokens")
    ap.add_argument("--epochs", type=int, default=3, help="A2 probes' epochs")
    ap.add_argument("--k", type=int, default=48, help="A3 candidates from A2 (MLP) per position")
    ap.add_argument("--k1", type=int, default=16, help="A3 candidates from A1 per position")
    ap.add_argument("--wide", type=int, default=256, help="A3's wider tier from each of A2 and A1, tried where "
                    "none of the first candidates matched")
    ap.add_argument("--noise", default="", help="also sessions with these noise levels on what the client sends "
                    "(SwarmOptions.noise, client/privacy.py), e.g. 0.05,0.2")
    ap.add_argument("--noise-split", default="", metavar="N,M", help="the split --noise is tried on (default: all)")
    ap.add_argument("--out", default=None, help="write the numbers as JSON here")
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    report = evaluate(args)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


def evaluate(args) -> dict:
    from diffuse.home import data_home
    from diffuse.model import store
    from diffuse.model.tokenizer import Tokenizer

    t_start = time.perf_counter()
    model_dir = store.resolve(data_home(args.home), args.model)
    cfg = ModelConfig.load(model_dir)
    tok = Tokenizer.load(model_dir)
    dtype = torch.bfloat16  # the client's default compute dtype
    fronts = [int(v) for v in str(args.fronts).split(",")]
    backs = [int(v) for v in str(args.backs).split(",")]
    cases = [Case(kind, *user_span(tok, text)) for kind, texts in PROMPTS.items() for text in texts[:args.per_kind]]
    head = load_head(model_dir, dtype)
    log = lambda *a: print(f"[{time.perf_counter() - t_start:6.0f}s]", *a, file=sys.stderr, flush=True)  # noqa: E731

    noises = sorted({float(v) for v in str(args.noise).split(",") if v and float(v)})
    noisy = [tuple(int(v) for v in args.noise_split.split(","))] if args.noise_split else [(n, m) for n in fronts
                                                                                         for m in backs]
    settings = [(n, m, 0.0) for n in fronts for m in backs] + [(n, m, z) for n, m in noisy for z in noises
                                                              if n in fronts and m in backs]

    # 1. Real sessions, tapped at the peers.
    captures: dict[tuple[int, int, float], list[Capture]] = {}

    async def run_sessions() -> None:
        async with loopback_swarm(model_dir) as (client_node, peers):
            for n, m, z in settings:
                captures[n, m, z] = await capture(client_node, peers, model_dir, (n, m), [c.prompt for c in cases],
                                                  args.tokens, tok.eos_ids, z)
                log(f"captured --local-blocks {n},{m}" + (f" noise {z}" if z else ""))
    trio.run(run_sessions)

    # 2. The attackers' preparation, on other text and the public weights.
    seqs = training_sequences(tok, args.train_tokens)
    train_x, train_y = layer_states(model_dir, cfg, head, seqs, fronts, dtype)
    log(f"attackers' text: {len(train_y)} tokens")
    freq = Counter(train_y.tolist())
    common = freq.most_common(1)[0][0]
    emb = head.embed.weight.detach().float()
    unit = emb / emb.norm(dim=-1, keepdim=True)
    first = cases[0].prompt[0]
    singles = single_token_states(model_dir, head, fronts, first, dtype, cfg.vocab_size)
    log("A1's single-token states computed")

    tally = Tally()
    outside: dict[tuple, list[int]] = {}
    a3_err: dict[tuple, list[float]] = {}
    for n in fronts:
        front = load_span(model_dir, 0, n, dtype) if n else None
        # At N = 0 a peer receives embedding rows: a table look-up (A1, A3) names them, no probe is trained.
        probes = {name: train_probe(train_x[n], train_y, unit, mlp, args.epochs) for name, mlp in
                  (("A2 linear", False), ("A2 MLP", True))} if n else {}
        z_train = normalise(train_x[n])
        mu, sd = z_train.mean(0), z_train.std(0).clamp_min(1e-3)
        log(f"N={n}: probes trained")
        a3_cache: dict[tuple, tuple[Tensor, Tensor]] = {}
        for m in backs:
            back = load_span(model_dir, cfg.num_layers - m, cfg.num_layers, dtype) if m else None
            for z in [z for n2, m2, z in settings if (n2, m2) == (n, m)]:
                split = label(n, m, z)
                for case, cap in zip(cases, captures[n, m, z]):
                    attack(case, cap, tally, split, common, front, back, head, probes, singles.get(n), mu, sd, unit,
                           args, a3_cache, outside.setdefault((n, z), []), a3_err.setdefault((n, z), []), z)
                    if z:  # the answer with noise against the answer without
                        clean = next(c for c in captures[n, m, 0.0] if c.prompt == cap.prompt).generated
                        same = next((i for i, (a, b) in enumerate(zip(clean, cap.generated)) if a != b),
                                    min(len(clean), len(cap.generated)))
                        tally.add(("kept", split, case.kind, "generated"), (same, len(clean)))
                log(f"--local-blocks {split}: attacked")

    block_ms, head_ms = time_local(model_dir, head, dtype)
    return summarise(args, tally, settings, cases, captures, outside, a3_err, block_ms, head_ms, cfg,
                     len(train_y), time.perf_counter() - t_start)


def label(n: int, m: int, noise: float) -> str:
    return f"{n},{m}" + (f" noise {noise:g}" if noise else "")


def attack(case: Case, cap: Capture, tally: Tally, split: str, common: int, front, back, head: Head, probes: dict,
           singles: Tensor | None, mu: Tensor, sd: Tensor, unit: Tensor, args, a3_cache: dict, outside: list,
           a3_err: list, noise: float) -> None:
    """Every attacker on one session; hits tallied under `split`."""
    n = 0 if front is None else front.end
    seq = cap.prompt + cap.generated
    obs = cap.first.inputs[0]  # [T, hidden]: positions 0..T-1 (the last token is never sent)
    prompt_rows, gen_rows = case.user, range(len(cap.prompt), obs.shape[0])
    for rows, part in ((prompt_rows, "prompt"), (gen_rows, "generated")):
        tally.add(("frequency", split, case.kind, part), (sum(seq[r] == common for r in rows), len(rows)))
    a1 = nearest(obs, singles, mu, sd, max(1, args.k1))
    guesses = {"A1 nearest": a1[:, 0]}
    for name, probe in probes.items():
        guesses[name] = probe.topk(obs, unit, 1)[:, 0]
    key = (tuple(seq[:obs.shape[0]]), obs.shape[0])
    if key in a3_cache and torch.equal(a3_cache[key][0], obs):  # another M, the same first peer's view
        got = a3_cache[key][1]
    else:
        cands = None
        if n:
            a2 = probes["A2 MLP"].topk(obs, unit, max(args.k, args.wide))
            a1w = nearest(obs, singles, mu, sd, args.wide)
            tiers = [merge(a2[:, :2], a1[:, :2]), merge(a2[:, :args.k], a1[:, :args.k1]), merge(a2[:, :args.wide], a1w)]
            cands = [list(ts) for ts in zip(*tiers)]
            if noise:  # the nearest of all candidates: with noise, a near match no longer means the truth
                cands = [ts[-1:] for ts in cands]
        # The attacker knows the noise level (the flag is public): a match is anything within its reach.
        got, err = exact_search(front, head, obs, cands, tol=max(0.05, 1.5 * noise))
        a3_cache[key] = (obs, got)
        scored = [*prompt_rows, *gen_rows]
        outside.extend(0 if not n else int(seq[t] not in cands[t][-1]) for t in scored)
        a3_err.extend(err[scored].tolist())
    guesses["A3 exact"] = got
    for name, g in guesses.items():
        tally.add((name, split, case.kind, "prompt"), hits(g, seq, prompt_rows))
        tally.add((name, split, case.kind, "generated"), hits(g, seq, gen_rows))
    # A4: the last peer's returned states, row i read as the token at position i + 1.
    read = read_tokens(back, head, cap.last.outputs[0])
    nxt = torch.cat([read[:1] * 0 - 1, read])  # position p is read from row p - 1
    tally.add(("A4 last peer", split, case.kind, "prompt"), hits(nxt, seq, [r for r in prompt_rows if r > 0]))
    tally.add(("A4 last peer", split, case.kind, "generated"), hits(nxt, seq, range(len(cap.prompt), len(seq))))


ATTACKERS = ["frequency", "A1 nearest", "A2 linear", "A2 MLP", "A3 exact", "A4 last peer"]
KINDS = ["chat", "code", "names"]


def summarise(args, tally: Tally, settings, cases, captures, outside, a3_err, block_ms, head_ms, cfg, trained,
              seconds) -> dict:
    n_prompt = sum(len(c.user) for c in cases)
    n_gen = sum(len(c.generated) for c in captures[settings[0]])
    noisy = any(z for _, _, z in settings)
    print(f"# Privacy: top-1 token recovery by an honest-but-curious peer ({cfg.num_layers} blocks; {len(cases)} "
          f"prompts: {n_prompt} user tokens, {n_gen} generated per split; attackers trained on "
          f"{trained} other tokens)\n")
    print("Prompt tokens (the user's own; A1-A3 at the first peer, A4 at the last peer as next-token reads):\n")
    extra = " | answer kept" if noisy else ""
    header = ("| --local-blocks | " + " | ".join(ATTACKERS) + " | A3: truth not a candidate | client ms/token"
              + extra + " |")
    rows = {}
    for part in ("prompt", "generated"):
        if part == "generated":
            print("\nGenerated tokens (A1-A3 from the first peer's inputs of the fed-back tokens, A4 from the last "
                  "peer's outputs):\n")
        print(header)
        print("|" + "---|" * (len(ATTACKERS) + 3 + noisy))
        for n, m, z in settings:
            split = label(n, m, z)
            rates = {a: tally.rate(a, split, part) for a in ATTACKERS}
            miss = outside.get((n, z), [])
            out = f"{100 * sum(miss) / len(miss):.1f}%" if miss and n else "0% (full search)"
            ms = (n + m) * block_ms + head_ms
            kept = (f" | {pct(tally.rate('kept', split, 'generated'))}" if z else " | 100%") if noisy else ""
            print(f"| {split} | " + " | ".join(pct(rates[a]) for a in ATTACKERS) + f" | {out} | {ms:.1f}{kept} |")
            rows[f"{part} {split}"] = rates | {"client_ms_per_token": ms, "a3_outside": out,
                                               "kept": tally.rate("kept", split, "generated")}
    print("\nBy prompt kind, prompt tokens (chat / code / names):\n")
    print("| --local-blocks | " + " | ".join(ATTACKERS) + " |")
    print("|" + "---|" * (len(ATTACKERS) + 1))
    by_kind = {}
    first_m = settings[0][1]
    for n, m, z in settings:
        if m != first_m:
            continue
        split = label(n, m, z)
        cells = [" / ".join(pct(tally.rate(a, split, "prompt", k)) for k in KINDS) for a in ATTACKERS]
        by_kind[split] = {a: {k: tally.rate(a, split, "prompt", k) for k in KINDS} for a in ATTACKERS}
        print(f"| {split} | " + " | ".join(cells) + " |")
    errs = {k: torch.tensor(v) for k, v in a3_err.items() if k[0] and v}
    if errs:
        print("\nA3's best match, relative error ||state(candidate) - observed|| / ||observed||: " + "; ".join(
            f"{label(n, 0, z).replace(',0', '')}: median {e.median():.1e}, 99th pct {e.quantile(0.99):.1e}, "
            f"above 0.05 {int((e > 0.05).sum())} of {len(e)}" for (n, z), e in errs.items()))
    print(f"\nClient compute: one block {block_ms:.1f} ms per decoded token, LM head {head_ms:.1f} ms "
          f"(the whole model: {cfg.num_layers * block_ms + head_ms:.0f} ms). Run: {seconds / 60:.1f} min.")
    return {"rows": rows, "by_kind": by_kind, "block_ms": block_ms, "head_ms": head_ms, "seconds": seconds,
            "args": vars(args)}


if __name__ == "__main__":
    sys.exit(main())
