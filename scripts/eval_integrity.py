"""Offline evaluation of the trust plane's detectors on the real SmolLM2, in one process.

Simulated peers serve blocks [1, 10), [10, 20) or [20, 29) (the client keeps block 0, block 29
and the head). Every peer answers the same pool of secret canaries (text the model sampled
itself, run through the client's fp32 blocks, sent in fp16 as on the wire):

- honest peers: bf16 and fp32 (fp16 with --fp16), each computing with its own summation order
  (dimensions permuted, seeds the client never used for calibration), plus transformers'
  LlamaDecoderLayer - another implementation - as an outsider to the noise model;
- tamperers (diffuse.trust.tamper) of every kind and strength, computing in bf16 (the widest
  honest tolerance, so the hardest case) and, for activation kinds, also in fp32.

The client calibrates on its own recomputations (3 realizations per dtype), then each peer
answers 16 random canaries from the pool; a tamperer tampers each with probability `rate`.
Columns, per kind and strength (worst span, or slowest for requests):
  AUROC, TPR@1%  the canary test's p-value, tamperers (rate 1) against every honest peer
  z              median z of a tamperer's mean residual (the test needs ~4.3 at alpha 1e-4)
  excl@r=...     fraction of tamperers the test excludes at the false-positive budget, for
                 tamper rates 1, 0.5, 0.1
  spot           chance that one spot check of a tampered step fails (vs fp32 recomputation)
  req r=...      median requests until exclusion, 10% canaries and 10% spot checks mixed
                 into traffic ('>N': not within the N requests the canary pool lasts)
  harm%          next-token argmax changed at the end of the model (8 canaries, bf16 peer);
                 compare with the honest peers' own harm% below
Then the honest peers' false accusations and the commitment cost per step.

    python scripts/eval_integrity.py            # 5 min of CPU (~11 min wall on a busy box)
    python scripts/eval_integrity.py --quick    # 1.5 min of CPU: fewer canaries and strengths
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from diffuse.model.load import load_head, load_span
from diffuse.model.tokenizer import Tokenizer
from diffuse.trust import canary as C
from diffuse.data.commitments import output_commitment
from diffuse.trust.spotcheck import Tolerance, compare
from diffuse.trust.tamper import WEIGHT_KINDS, Tamper

SPANS = ((1, 10), (10, 20), (20, 29))
WIRE = torch.float16
M = 16  # canaries per peer for the AUROC
RATES = (1.0, 0.5, 0.1)
CANARY_FRACTION = SPOT_RATE = 0.1
HARM_CANARIES = 8
GRID = {
    "noise": (50, 40, 30, 20), "scale": (1.1, 1.5, 3.0), "signflip": (1, 4, 16), "zero": (0.01, 0.1, 1.0),
    "replay": (1,), "skip": (1,), "quant": (8, 6, 4), "minifloat": (3, 2), "lowrank": (0.01, 0.03, 0.1),
}
QUICK_GRID = {k: (v[len(v) // 2],) for k, v in GRID.items()}
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


def model_dir() -> Path:
    home = Path(os.environ.get("DIFFUSE_HOME", "/tmp/dhome"))
    return home / "models" / "SmolLM2-135M-Instruct"


@dataclass
class Peer:
    """One simulated honest peer: its replies [n, T, H] to every canary of the pool."""

    name: str
    dtype: torch.dtype
    outputs: torch.Tensor


def hf_outputs(a: int, b: int, hidden: torch.Tensor, dtype: torch.dtype, cache: dict) -> torch.Tensor:
    """Blocks [a, b) by transformers' own Llama layers: an honest peer outside the noise model."""
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    if dtype not in cache:
        cache[dtype] = transformers.AutoModelForCausalLM.from_pretrained(model_dir(), dtype=dtype).eval()
    model = cache[dtype].model
    x = hidden.to(dtype)
    pos = torch.arange(x.shape[1])[None]
    with torch.inference_mode():
        emb = model.rotary_emb(x, pos)
        for layer in model.layers[a:b]:
            x = layer(x, attention_mask=None, position_ids=pos, position_embeddings=emb)
    return x.to(WIRE).float()


def tampered_outputs(t: Tamper, span, canaries, base: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Every canary's reply from a peer that tampers with all of them (rate 1)."""
    if t.on_weights:
        hidden = torch.stack([c.hidden for c in canaries]).float()
        return C.honest_output(t.apply_weights(copy.deepcopy(span)), hidden, dtype, 201, WIRE)
    # One request at a time, in order: a replayer replays the previous canary's output.
    return torch.cat([t.apply_output(base[i:i + 1].to(dtype)).to(WIRE).float() for i in range(len(base))])


def auroc(pos: list[float], neg: list[float]) -> float:
    wins = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def tpr_at(pos: list[float], neg: list[float], fpr: float = 0.01) -> float:
    k = math.floor(fpr * len(neg))  # this many honest peers may score above the cut
    cut = sorted(neg, reverse=True)[k] if k < len(neg) else -math.inf
    return sum(p > cut for p in pos) / len(pos)


class Judge:
    """The client's view of one span: canaries, calibration and spot-check tolerance."""

    def __init__(self, canaries, benign: dict, tolerance: Tolerance):
        self.canaries, self.cal, self.tol = canaries, C.Calibration.from_outputs(canaries, benign), tolerance

    def scores(self, out: torch.Tensor) -> list[float]:
        return [C.score(out[i], c) for i, c in enumerate(self.canaries)]

    def spot_fail(self, out: torch.Tensor, dtype) -> list[bool]:
        pos = range(out.shape[1])
        return [not compare(out[i:i + 1], c.reference[None].to(WIRE).float(), self.tol, dtype, F32, pos).ok
                for i, c in enumerate(self.canaries)]

    def simulate(self, dtype, base_s, tam_s, base_f, tam_f, rate: float, rng: random.Random,
                 peers: int) -> tuple[list[float], list[bool], list[int | None], float]:
        """Peers that tamper with a fraction `rate` of requests, given every canary's score and
        spot-check outcome untampered (base_) and tampered (tam_). Per peer: -log10 p after M
        canaries (uncapped, to rank), the verdict, requests until exclusion; and the median z."""
        benign, n = self.cal.for_dtype(dtype), len(base_s)
        stats, verdicts, excluded, z = [], [], [], []
        for _ in range(peers):
            obs = [(i, tam_s[i] if rng.random() < rate else base_s[i]) for i in rng.sample(range(n), min(M, n))]
            v = C.decide(benign, obs)
            stats.append(-C.combined_log10_p(v.z_mean, v.z_max, v.m))
            verdicts.append(v.tampered)
            z.append(v.z_mean)
            excluded.append(_sequential(benign, base_s, tam_s, base_f, tam_f, rate, rng))
        return stats, verdicts, excluded, statistics.median(z)


def _sequential(benign, base_s, tam_s, base_f, tam_f, rate, rng) -> int | None:
    """Requests until exclusion (canaries and spot checks mixed in); None: the pool ran out first."""
    pool = rng.sample(range(len(base_s)), len(base_s))
    mon = C.CanaryMonitor(benign)
    request = 0
    while pool:
        request += 1
        hit = rng.random() < rate
        if rng.random() < CANARY_FRACTION:
            i = pool.pop()
            if mon.add(i, tam_s[i] if hit else base_s[i]).tampered:
                return request
        elif rng.random() < SPOT_RATE:
            j = rng.randrange(len(base_f))  # a real request like canary j: its spot-check outcome
            if (tam_f if hit else base_f)[j]:
                return request
    return None


def harm(rest, head, tampered: torch.Tensor, clean_top: torch.Tensor) -> float:
    """% of next-token argmax changed when the span's output is `tampered`: what the attack buys."""
    top = head.logits(C.forward(rest, tampered[:HARM_CANARIES])).argmax(-1)
    return 100.0 * float((top != clean_top).float().mean())


def fmt_requests(runs: list[int | None], pool: int) -> str:
    """Median requests to exclusion; runs that outlast the canary pool count as never."""
    median = statistics.median(math.inf if r is None else r for r in runs)
    return f">{round(pool / CANARY_FRACTION)}" if median == math.inf else str(int(median))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--canaries", type=int, help="pool size per span (default 32, quick 16)")
    ap.add_argument("--tokens", type=int, help="tokens per canary (default 16)")
    ap.add_argument("--fp16", action="store_true", help="also honest fp16 peers (slow on CPUs)")
    ap.add_argument("--no-outsider", action="store_true", help="skip the transformers honest peer")
    ap.add_argument("--peers", type=int, default=40, help="simulated peers per configuration")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: on a shared box, more threads ran ~10x slower)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    n = args.canaries or (16 if args.quick else 32)
    length = args.tokens or 16
    args.honest_dtypes = (F32, BF16, F16) if args.fp16 else (F32, BF16)
    t_start = time.time()
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    path = model_dir()
    head = load_head(path, F32)
    full = load_span(path, 0, 30, F32)
    tok = Tokenizer.load(path)
    prompt = tok.encode("<|im_start|>user\n")
    tokens = C.natural_tokens(head, full, prompt, n, length, torch.Generator().manual_seed(args.seed))
    print(f"{n} canaries x {length} tokens sampled in {time.time() - t_start:.0f} s; e.g. "
          f"{tok.decode(tokens[0].tolist())!r}")
    x, x_at = head.embed_tokens(tokens), 0
    rows, honest_rows, hf_cache = [], [], {}
    for a, b in SPANS:
        t0 = time.time()
        x = C.forward(full.view(x_at, a), x) if a > x_at else x  # the clean fp32 chain up to block a
        x_at = a
        span_rows, span_honest = evaluate_span(args, full.view(a, b), full.view(b, 30), head, tokens, x,
                                               rng, hf_cache)
        rows += span_rows
        honest_rows += span_honest
        print(f"span [{a}, {b}): {time.time() - t0:.0f} s", flush=True)
    report(rows, honest_rows, QUICK_GRID if args.quick else GRID, n)
    commit_bench()
    print(f"total {time.time() - t_start:.0f} s")


def evaluate_span(args, span, rest, head, tokens, x, rng, hf_cache) -> tuple[list, list]:
    """Calibrate the client on blocks [a, b) (`x`: the canaries' hidden states entering block a),
    then judge every honest peer and every tamperer."""
    a, b = span.start, span.end
    canaries = C.make_canaries(tokens, x, span, WIRE)
    hidden = torch.stack([c.hidden for c in canaries]).float()
    benign = C.benign_outputs(span, canaries, args.honest_dtypes, WIRE, realizations=2 if args.quick else 3)
    judge = Judge(canaries, benign, Tolerance.from_outputs(benign))
    honest = [Peer(f"engine-{C.dtype_name(d)}-{s}", d, C.honest_output(span, hidden, d, s, WIRE))
              for d in args.honest_dtypes for s in ((101,) if args.quick else (101, 102))]
    if not (args.quick or args.no_outsider):
        honest += [Peer(f"transformers-{C.dtype_name(d)}", d, hf_outputs(a, b, hidden, d, hf_cache))
                   for d in (F32, BF16)]
    clean = torch.stack([c.reference for c in canaries[:HARM_CANARIES]])
    clean_top = head.logits(C.forward(rest, clean)).argmax(-1)
    neg, honest_rows = [], []
    for p in honest:
        s, f = judge.scores(p.outputs), judge.spot_fail(p.outputs, p.dtype)
        stats, verdicts, excl, _ = judge.simulate(p.dtype, s, s, f, f, 1.0, rng, args.peers)
        neg += stats
        whole = C.decide(judge.cal.for_dtype(p.dtype), list(enumerate(s)))
        honest_rows.append((a, b, p.name, sum(verdicts), sum(e is not None for e in excl), len(verdicts),
                            sum(f), len(f), whole.z_mean, whole.z_max, harm(rest, head, p.outputs, clean_top)))
    base = {d: next(p for p in honest if p.dtype == d) for d in (F32, BF16)}  # the tamperers' own compute
    rows = []
    for kind, strengths in (QUICK_GRID if args.quick else GRID).items():
        for strength in strengths:
            for d in ((BF16,) if kind in WEIGHT_KINDS else (BF16, F32)):
                bp = base[d].outputs
                tam = tampered_outputs(Tamper(kind, strength, 1.0, args.seed), span, canaries, bp, d)
                bs, ts = judge.scores(bp), judge.scores(tam)
                bf, tf = judge.spot_fail(bp, d), judge.spot_fail(tam, d)
                res = {}
                for rate in RATES:
                    stats, verdicts, excl, z = judge.simulate(d, bs, ts, bf, tf, rate, rng, args.peers)
                    res[rate] = (auroc(stats, neg), tpr_at(stats, neg), sum(verdicts) / len(verdicts), excl, z)
                h = harm(rest, head, tam, clean_top) if d == BF16 else math.nan
                rows.append((kind, strength, C.dtype_name(d), (a, b), res, sum(tf) / len(tf), h))
    return rows, honest_rows


def report(rows, honest_rows, grid, pool: int) -> None:
    print("\nPer tamper kind (worst span for AUROC/TPR/excluded; slowest span for requests-to-exclusion):")
    print(f"{'kind':10s} {'strength':>8s} {'peer':8s} {'AUROC':>6s} {'TPR@1%':>6s} "
          f"{'z':>6s} {'excl@r=1':>8s} {'r=.5':>5s} {'r=.1':>5s} {'spot':>5s} {'req r=1':>7s} {'req r=.1':>8s} "
          f"{'harm%':>6s}")
    for kind, strengths in grid.items():
        for strength in strengths:
            for d in ("bfloat16", "float32"):
                sel = [r for r in rows if r[0] == kind and r[1] == strength and r[2] == d]
                if not sel:
                    continue
                res = [r[4] for r in sel]
                worst = lambda rate, j, res=res: min(x[rate][j] for x in res)  # noqa: E731
                slowest = lambda rate, res=res: max((x[rate][3] for x in res), key=_sort_key)  # noqa: E731
                h = [r[6] for r in sel if not math.isnan(r[6])]
                harm_txt = f"{statistics.mean(h):6.1f}" if h else f"{'-':>6s}"
                print(f"{kind:10s} {strength:>8g} {d[:8]:8s} {worst(1.0, 0):6.3f} {worst(1.0, 1):6.2f} "
                      f"{worst(1.0, 4):6.1f} {worst(1.0, 2):8.2f} {worst(0.5, 2):5.2f} {worst(0.1, 2):5.2f} "
                      f"{min(r[5] for r in sel):5.2f} {fmt_requests(slowest(1.0), pool):>7s} "
                      f"{fmt_requests(slowest(0.1), pool):>8s} {harm_txt}")
    print("\nHonest peers (each judged against its declared dtype's calibration):")
    print(f"{'span':8s} {'peer':24s} {'accused@16':>10s} {'excluded':>8s} {'spot fails':>10s} "
          f"{'z mean':>6s} {'z max':>6s} {'harm%':>6s}  (z over the whole pool)")
    tot = [0, 0, 0, 0, 0]
    for a, b, name, acc, exc, npeers, sf, nf, zmean, zmax, h in honest_rows:
        print(f"{f'[{a},{b})':8s} {name:24s} {acc:>4d}/{npeers:<5d} {exc:>4d}/{npeers:<3d} {sf:>4d}/{nf:<5d} "
              f"{zmean:6.2f} {zmax:6.2f} {h:6.1f}")
        tot = [tot[0] + acc, tot[1] + exc, tot[2] + npeers, tot[3] + sf, tot[4] + nf]
    print(f"false accusations: canary test {tot[0]}/{tot[2]} peers, sequential exclusion {tot[1]}/{tot[2]}, "
          f"spot checks {tot[3]}/{tot[4]} steps")


def _sort_key(runs):
    return statistics.median(math.inf if r is None else r for r in runs)


def commit_bench() -> None:
    print("\nOutput commitment per step (SHA-256 Merkle, 4 KiB chunks), on wire-dtype tensors:")
    sid = os.urandom(16)
    for hidden in (576, 8192):
        for t in (1, 8, 128):
            out = torch.randn(1, t, hidden).to(WIRE)
            reps = 50
            t0 = time.perf_counter()
            for i in range(reps):
                output_commitment(sid, i, None, out)
            us = (time.perf_counter() - t0) / reps * 1e6
            print(f"  hidden {hidden:5d} x {t:3d} tokens = {out.numel() * 2 / 1024:7.1f} KiB: {us:8.0f} us")


if __name__ == "__main__":
    main()
