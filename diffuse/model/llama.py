"""Llama-shaped blocks: Llama 2 and 3.x, Mistral, Qwen2/2.5 and Qwen3.

They share one checkpoint layout and one block; what differs is configuration the shared pieces
read: RoPE scaling (Llama 3.1+: `llama3`), a sliding window (Mistral, Qwen2 when enabled), q/k/v
biases (Qwen2), q/k RMSNorm and a head_dim decoupled from hidden_size / heads (Qwen3).
"""

from __future__ import annotations

import torch
from torch import Tensor

from diffuse.model.layers import DecoderBlock, Family, RMSNorm, Weights, copy_


class Block(DecoderBlock):
    def load_hf(self, tensors: dict[str, Tensor]) -> None:
        w = Weights(tensors, f"block {self.layer}")
        with torch.no_grad():
            copy_(self.attn_norm.weight, w.take("input_layernorm.weight"), "input_layernorm.weight")
            self.load_attention_hf(w)
            copy_(self.mlp_norm.weight, w.take("post_attention_layernorm.weight"), "post_attention_layernorm.weight")
            self.load_mlp_hf(w)
        w.done()


FAMILY = Family(Block, RMSNorm)
