"""Qwen3-MoE blocks: Qwen3 attention, and a sparse MLP of many experts in most layers.

A router picks the top k of E experts per token (softmax in fp32, optionally renormalised over
the k), each chosen expert is a gated MLP, and their outputs are summed with the router's
weights. A peer holds whole blocks with all their experts, so its memory grows with E (see
`engine.block_parameters`), while a token computes only k of them. In an exact session each expert's
rows go through the batch-invariant product, so a token's result does not depend on which other
tokens were routed to the same expert.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from diffuse.model.config import ModelConfig
from diffuse.model.kernels import Linear, exact_linear, linear
from diffuse.model.layers import DecoderBlock, Family, RMSNorm, Weights, copy_


class Block(DecoderBlock):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(cfg, layer)
        self.sparse = cfg.is_moe(layer)
        if self.sparse:
            e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
            self.top_k, self.renormalise = cfg.num_experts_per_tok, cfg.norm_topk_prob
            self.router = Linear(h, e, bias=False)
            self.w_gate_up_experts = nn.Parameter(torch.empty(e, 2 * i, h))  # per expert: gate rows, then up
            self.w_down_experts = nn.Parameter(torch.empty(e, h, i))

    def mlp(self, x: Tensor, exact: bool) -> Tensor:
        if not self.sparse:
            return super().mlp(x, exact)
        product = exact_linear if exact else linear
        flat = x.reshape(-1, x.shape[-1])
        logits = self.router(flat, exact)
        weights, experts = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), self.top_k, dim=-1)
        if self.renormalise:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(logits.dtype)
        out = torch.zeros_like(flat)
        for e in experts.unique().tolist():  # increasing: each token sums its experts in one order
            rows, slot = (experts == e).nonzero(as_tuple=True)
            gate, up = product(flat[rows], self.w_gate_up_experts[e]).chunk(2, dim=-1)
            y = product(self.act(gate) * up, self.w_down_experts[e]) * weights[rows, slot, None]
            out.index_add_(0, rows, y.to(out.dtype))
        return out.view_as(x)

    def permute_mlp_(self, hidden: Tensor, inner: Tensor) -> None:
        if not self.sparse:
            return super().permute_mlp_(hidden, inner)
        self.router.weight.copy_(self.router.weight[:, hidden])
        self.w_gate_up_experts.copy_(self.w_gate_up_experts[:, :, hidden])
        self.w_down_experts.copy_(self.w_down_experts[:, hidden])

    def load_hf(self, tensors: dict[str, Tensor]) -> None:
        w = Weights(tensors, f"block {self.layer}")
        with torch.no_grad():
            copy_(self.attn_norm.weight, w.take("input_layernorm.weight"), "input_layernorm.weight")
            self.load_attention_hf(w)
            copy_(self.mlp_norm.weight, w.take("post_attention_layernorm.weight"), "post_attention_layernorm.weight")
            if not self.sparse:
                self.load_mlp_hf(w)
            else:
                copy_(self.router.weight, w.take("mlp.gate.weight"), "mlp.gate.weight")
                for e in range(self.w_down_experts.shape[0]):
                    p = f"mlp.experts.{e}."
                    gate_up = torch.cat([w.take(p + "gate_proj.weight"), w.take(p + "up_proj.weight")])
                    copy_(self.w_gate_up_experts[e], gate_up, p + "gate/up_proj.weight")
                    copy_(self.w_down_experts[e], w.take(p + "down_proj.weight"), p + "down_proj.weight")
        w.done()


FAMILY = Family(Block, RMSNorm)
