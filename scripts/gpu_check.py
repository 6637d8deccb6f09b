#!/usr/bin/env python
"""The engine on a GPU, from the source tree: run it where a CUDA GPU is at hand (at most ~8 min).

    python scripts/gpu_check.py [--out FILE.md] [--cpu-only]

Needs only torch (any recent CUDA build; nothing is installed): the engine's modules are imported
from this checkout and the weights are made here, seeded, in SmolLM2-135M's shape (30 llama
blocks, hidden 576, 9 query and 3 key/value heads, vocabulary 49152). For bf16, int8 and int4
blocks on this machine's CPU and GPU it checks and measures:

- logits of a 64-token prompt on the GPU against the CPU (same scheme, fp32 activations there):
  relative L2 error, and greedy tokens equal wherever the CPU's top-2 margin exceeds the error;
- a batch of 4 sessions' decode steps and a speculation tree step (8 candidates, tree mask)
  against the same positions computed alone;
- decode tokens/s (64 greedy tokens, one session) and prefill tokens/s (a 512-token prompt).

Prints a markdown table (and writes it to --out): the figures belong in docs/measurements.md.
--cpu-only runs the same on the CPU alone (to check the script where there is no GPU).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from diffuse.model.config import ModelConfig  # noqa: E402
from diffuse.model.engine import BlockSpan, Head  # noqa: E402
from diffuse.model.meta import on_meta  # noqa: E402
from diffuse.model.quant import quantize  # noqa: E402

SMOLLM2 = {"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
           "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152, "rope_theta": 100000.0,
           "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "max_position_embeddings": 8192,
           "hidden_act": "silu"}
PROJ = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
        "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")


def weights(cfg: ModelConfig, seed: int = 0) -> tuple[list[dict], dict]:
    """Seeded HF-named tensors per block, and the head's (fp32, CPU)."""
    g = torch.Generator().manual_seed(seed)
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    shapes = {"self_attn.q_proj.weight": (cfg.num_heads * d, h), "self_attn.k_proj.weight": (cfg.num_kv_heads * d, h),
              "self_attn.v_proj.weight": (cfg.num_kv_heads * d, h), "self_attn.o_proj.weight": (h, cfg.num_heads * d),
              "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i)}
    blocks = []
    for _ in range(cfg.num_layers):
        t = {n: torch.randn(s, generator=g) * s[1] ** -0.5 for n, s in shapes.items()}
        t |= {n: 1 + 0.1 * torch.randn(h, generator=g) for n in ("input_layernorm.weight",
                                                                   "post_attention_layernorm.weight")}
        blocks.append(t)
    head = {"model.embed_tokens.weight": torch.randn(cfg.vocab_size, h, generator=g),
            "model.norm.weight": 1 + 0.1 * torch.randn(h, generator=g)}
    return blocks, head


def build(cfg: ModelConfig, blocks: list[dict], head: dict, scheme: str, dtype: torch.dtype,
          device: str) -> tuple[Head, BlockSpan]:
    """Head and all blocks on `device` in `dtype`, the projections as `scheme` (packed for the device)."""
    with on_meta():
        span, hd = BlockSpan(cfg, 0, cfg.num_layers), Head(cfg)
    for m in (span, hd):
        m.to(dtype)._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    for block, t in zip(span.blocks, blocks):
        block.load_hf({n: quantize(w, scheme) if scheme != "none" and n in PROJ else w for n, w in t.items()})
    span.quant = scheme
    hd.load_hf(head)
    return hd.eval(), span.eval()


@torch.inference_mode()
def run(hd: Head, span: BlockSpan, ids: torch.Tensor, new: int) -> tuple[torch.Tensor, list[int], float, float]:
    """Prompt logits [T, V] (fp32, CPU), `new` greedy tokens, prefill and decode tokens/s."""
    dev = hd.embed.weight.device
    cache = span.new_cache(ids.numel() + new)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    h = span(hd.embed_tokens(ids[None].to(dev)), torch.arange(ids.numel(), device=dev), cache)
    logits = hd.logits(h)[0]
    sync()
    t1 = time.perf_counter()
    out = [int(logits[-1].argmax())]
    for _ in range(new - 1):
        h = span(hd.embed_tokens(torch.tensor([[out[-1]]], device=dev)), torch.tensor([cache.length], device=dev),
                 cache)
        out.append(int(hd.logits(h)[0, -1].argmax()))
    sync()
    t2 = time.perf_counter()
    return logits.float().cpu(), out, ids.numel() / (t1 - t0), (new - 1) / (t2 - t1)


@torch.inference_mode()
def batched_error(hd: Head, span: BlockSpan, ids: torch.Tensor) -> float:
    """Largest relative error of 4 sessions' decode steps batched, and of a tree step of 8
    candidates, against the same positions computed alone."""
    from diffuse.model.engine import SpanStep

    dev = hd.embed.weight.device
    caches = [span.new_cache(64) for _ in range(4)]
    for k, c in enumerate(caches):
        span(hd.embed_tokens(ids[None, :16 + k].to(dev)), torch.arange(16 + k, device=dev), c)
    x = [hd.embed_tokens(ids[None, 20 + k:21 + k].to(dev)) for k in range(4)]
    together = span.forward_batch([SpanStep(x[k], torch.tensor([c.length], device=dev), c, None, False)
                                   for k, c in enumerate(caches)])
    errs = []
    for k, c in enumerate(caches):
        c.rollback(c.length)
        alone = span(x[k], torch.tensor([c.length], device=dev), c, None, False)
        errs.append(float((together[k] - alone).float().norm() / alone.float().norm()))
        c.rollback(c.length)
    tree = torch.tensor([[j <= i and (j == 0 or j == i) for j in range(8)] for i in range(8)], device=dev)
    cand = hd.embed_tokens(ids[None, 30:38].to(dev))
    pos = torch.tensor([caches[0].length] + [caches[0].length + 1] * 7, device=dev)
    t = span(cand, pos, caches[0], tree, False)
    caches[0].rollback(caches[0].length)
    for j in (0, 3):  # candidate j computed as the only token after its ancestors
        keep = [0, j] if j else [0]
        alone = span(cand[:, keep], pos[keep], caches[0], tree[keep][:, keep], False)
        caches[0].rollback(caches[0].length)
        errs.append(float((t[:, j] - alone[:, -1]).float().norm() / alone[:, -1].float().norm()))
    return max(errs)


def check(cfg, blocks, head, scheme: str, devices: list[str], ids: torch.Tensor, new: int) -> list[str]:
    """One row per device for `scheme`: agreement with the CPU reference, batching, speeds."""
    ref_hd, ref_span = build(cfg, blocks, head, scheme, torch.float32, "cpu")
    ref_logits, ref_tokens, _, _ = run(ref_hd, ref_span, ids[:64], new)
    del ref_hd, ref_span
    rows = []
    for device in devices:
        hd, span = build(cfg, blocks, head, scheme, torch.bfloat16, device)
        logits, tokens, _, _ = run(hd, span, ids[:64], new)
        err = float((logits - ref_logits).norm() / ref_logits.norm())
        top = ref_logits.topk(2, -1).values
        confident = ((top[:, 0] - top[:, 1]) > 2 * err * float(ref_logits.abs().max())).nonzero().flatten().tolist()
        same = all(int(logits[p].argmax()) == int(ref_logits[p].argmax()) for p in confident)
        greedy = sum(a == b for a, b in zip(tokens, ref_tokens)) / new
        batch = batched_error(hd, span, ids)
        _, _, prefill, decode = run(hd, span, ids[:512], 64)
        rows.append(f"| {scheme} | {device} | {err:.2e} | {'yes' if same else 'NO'} ({len(confident)} positions) "
                    f"| {greedy:.2f} | {batch:.2e} | {prefill:.0f} | {decode:.1f} |")
        print(rows[-1], flush=True)
        del hd, span
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--cpu-only", action="store_true")
    ap.add_argument("--new", type=int, default=32, help="greedy tokens compared with the CPU's")
    args = ap.parse_args()
    if not args.cpu_only and not torch.cuda.is_available():
        sys.exit("no CUDA device here: run it on a machine with a GPU (or --cpu-only to check the script)")
    devices = ["cpu"] + ([] if args.cpu_only else ["cuda"])
    cfg = ModelConfig.from_hf(SMOLLM2)
    blocks, head = weights(cfg)
    ids = torch.randint(0, cfg.vocab_size, (512,), generator=torch.Generator().manual_seed(1))
    where = torch.cuda.get_device_name() if torch.cuda.is_available() and not args.cpu_only else "no GPU"
    lines = [f"gpu_check: torch {torch.__version__}, {where}, CPU threads {torch.get_num_threads()}; SmolLM2-135M's "
             "shape, seeded weights; bf16 activations (the reference: the CPU in fp32, same scheme)", "",
             "| blocks | device | logits rel. error vs CPU fp32 | greedy where margin > error | greedy tokens equal "
             "| batch/tree vs alone | prefill tok/s (512) | decode tok/s |", "|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    t0 = time.perf_counter()
    for scheme in ("none", "int8", "int4"):
        lines += check(cfg, blocks, head, scheme, devices, ids, args.new)
    lines.append(f"\n({time.perf_counter() - t0:.0f} s)")
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
