"""Gemma 2 and Gemma 3 blocks.

Against the Llama block: RMSNorm scales by (1 + w), in fp32 before the cast; every sub-block is
wrapped in two norms (pre and post); the MLP is GeGLU (tanh GELU); attention scores are scaled by
query_pre_attn_scalar^-1/2 and (Gemma 2) soft-capped; layers alternate between a local sliding
window and global attention, and in Gemma 3 the local layers have their own RoPE base and queries
and keys are RMS-normed per head. Embeddings are multiplied by sqrt(hidden_size) (rounded to the
weights' dtype, as the reference does) and Gemma 2 soft-caps the final logits; both live in the
client's Head. All of these are read from the config by the shared code, except the norm and
the wiring, which are here.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from diffuse.model.config import ModelConfig
from diffuse.model.layers import DecoderBlock, Family, RMSNorm, Rows, Weights, copy_


class GemmaRMSNorm(RMSNorm):
    def __init__(self, dim: int, eps: float):
        super().__init__(dim, eps)
        nn.init.zeros_(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


class Block(DecoderBlock):
    Norm = GemmaRMSNorm

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(cfg, layer)
        self.post_attn_norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_mlp_norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: Tensor, rows: Rows, exact: bool = False) -> Tensor:
        h = x + self.post_attn_norm(self.attend(x, rows, exact))
        return h + self.post_mlp_norm(self.mlp(self.mlp_norm(h), exact))

    def norms(self) -> list[nn.Module]:
        return [self.attn_norm, self.post_attn_norm, self.mlp_norm, self.post_mlp_norm]

    def load_hf(self, tensors: dict[str, Tensor]) -> None:
        w = Weights(tensors, f"block {self.layer}")
        with torch.no_grad():
            for norm, name in ((self.attn_norm, "input_layernorm"), (self.post_attn_norm, "post_attention_layernorm"),
                               (self.mlp_norm, "pre_feedforward_layernorm"),
                               (self.post_mlp_norm, "post_feedforward_layernorm")):
                copy_(norm.weight, w.take(name + ".weight"), name + ".weight")
            self.load_attention_hf(w)
            self.load_mlp_hf(w)
        w.done()


FAMILY = Family(Block, GemmaRMSNorm, embed_scale=lambda cfg: cfg.hidden_size ** 0.5)
