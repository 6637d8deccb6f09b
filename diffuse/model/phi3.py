"""Phi-3 blocks: the Llama block, stored fused (qkv_proj, gate_up_proj) in the checkpoint.

Phi-3's long-context variants use `longrope` and Phi-4-mini a partial rotary factor; both are
configuration the shared rotary code reads (see rope.py for how far longrope runs).
"""

from __future__ import annotations

import torch
from torch import Tensor

from diffuse.model.layers import DecoderBlock, Family, RMSNorm, Weights, copy_


class Block(DecoderBlock):
    def load_hf(self, tensors: dict[str, Tensor]) -> None:
        w = Weights(tensors, f"block {self.layer}")
        with torch.no_grad():
            for param, name in ((self.attn_norm.weight, "input_layernorm.weight"),
                                (self.wqkv.weight, "self_attn.qkv_proj.weight"),
                                (self.wo.weight, "self_attn.o_proj.weight"),
                                (self.mlp_norm.weight, "post_attention_layernorm.weight"),
                                (self.w_gate_up.weight, "mlp.gate_up_proj.weight"),  # gate rows, then up rows
                                (self.w_down.weight, "mlp.down_proj.weight")):
                copy_(param, w.take(name), name)
        w.done()


FAMILY = Family(Block, RMSNorm)
