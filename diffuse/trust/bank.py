"""A client's secret canaries and the calibration that judges replies to them, per block span.

The expensive part depends only on the model: natural text sampled from it and the fp32 hidden
state of that text at every block boundary. It is computed once per client and model and kept
under <home>/trust/ (0600: whoever reads it can answer canaries honestly and cheat elsewhere).
Each client samples its own text from the OS's randomness, so no two clients share canaries.
Per span, the bank derives what a judge needs: the canaries themselves (inputs in the wire
dtype and fp32 references), the benign drift of every calibrated compute dtype (canary.Calibration)
and the spot-check tolerance (spotcheck.Tolerance), plus the fp32 span that recomputes spot checks.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from diffuse.model.llama import BlockSpan
from diffuse.model.load import load_head, load_span
from diffuse.model.tokenizer import Tokenizer
from diffuse.model.weights import load_manifest
from diffuse.trust import canary as C
from diffuse.trust.spotcheck import Tolerance

log = logging.getLogger(__name__)
PROMPT = "<|im_start|>user\n"  # canaries open like chat traffic; shared tokens are not scored


@dataclass
class SpanMaterial:
    """Everything the trust plane needs to judge peers serving blocks [start, end)."""

    start: int
    end: int
    canaries: list[C.Canary]
    benign: dict[str, list[torch.Tensor]]  # honest outputs per compute dtype, 2 realizations each
    calibration: C.Calibration
    tolerance: Tolerance
    referee: BlockSpan  # fp32 blocks: recomputes spot-checked steps
    wire_dtype: torch.dtype

    def judge(self, dtype: str) -> None:
        """Make sure peers computing in `dtype` can be judged (calibrates it on first use)."""
        if dtype in self.benign:
            return
        try:
            torch_dtype = getattr(torch, dtype)
            assert isinstance(torch_dtype, torch.dtype) and torch_dtype.is_floating_point
        except (AttributeError, AssertionError):
            raise ValueError(f"peer declares an unknown compute dtype {dtype!r}") from None
        self.benign.update(C.benign_outputs(self.referee, self.canaries, [torch_dtype], self.wire_dtype, 2))
        self.calibration = C.Calibration.from_outputs(self.canaries, self.benign)
        self.tolerance = Tolerance.from_outputs(self.benign)


class CanaryBank:
    def __init__(self, model_dir: Path, home: Path, wire_dtype: torch.dtype, n: int = 16, length: int = 16,
                 dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)):
        if n < 2 or length <= 4:
            raise ValueError("a canary bank needs at least 2 canaries of more than 4 tokens")
        self.model_dir, self.wire_dtype, self.n, self.length, self.dtypes = model_dir, wire_dtype, n, length, dtypes
        manifest = load_manifest(model_dir)
        self.num_layers = manifest.num_layers
        self.path = home / "trust" / manifest.model_hash[:16] / f"canaries-{n}x{length}.safetensors"
        self.spans: dict[tuple[int, int], SpanMaterial] = {}
        self._tokens: torch.Tensor | None = None
        self._boundaries: torch.Tensor | None = None

    def _base(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Canary tokens [n, T] and their fp32 hidden states at every block boundary [L+1, n, T, H]."""
        if self._tokens is None:
            if self.path.exists():
                saved = load_file(self.path)
                self._tokens, self._boundaries = saved["tokens"], saved["boundaries"]
            else:
                self._tokens, self._boundaries = self._sample()
                self.path.parent.mkdir(parents=True, exist_ok=True)
                tmp = self.path.with_suffix(".tmp")
                save_file({"tokens": self._tokens, "boundaries": self._boundaries.contiguous()}, tmp)
                os.chmod(tmp, 0o600)
                os.replace(tmp, self.path)
        return self._tokens, self._boundaries

    def _sample(self) -> tuple[torch.Tensor, torch.Tensor]:
        log.info("sampling %d secret canaries of %d tokens (once per model)", self.n, self.length)
        head = load_head(self.model_dir, torch.float32)
        blocks = load_span(self.model_dir, 0, self.num_layers, torch.float32)
        try:
            prompt = Tokenizer.load(self.model_dir).encode(PROMPT)
        except Exception:  # noqa: BLE001 - a model without a tokenizer (test models): any start token
            prompt = [1]
        gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)
        tokens = C.natural_tokens(head, blocks, prompt, self.n, self.length, gen)
        h = head.embed_tokens(tokens).float()
        states = [h]
        for i in range(self.num_layers):
            h = C.forward(blocks.view(i, i + 1), h)
            states.append(h)
        return tokens, torch.stack(states)

    def material(self, start: int, end: int) -> SpanMaterial:
        """Canaries, calibration and referee for [start, end); computed on first use (seconds)."""
        key = (start, end)
        if key not in self.spans:
            tokens, boundaries = self._base()
            span = load_span(self.model_dir, start, end, torch.float32)
            canaries = C.make_canaries(tokens, boundaries[start], span, self.wire_dtype)
            benign = C.benign_outputs(span, canaries, self.dtypes, self.wire_dtype, realizations=2)
            self.spans[key] = SpanMaterial(start, end, canaries, benign, C.Calibration.from_outputs(canaries, benign),
                                           Tolerance.from_outputs(benign), span, self.wire_dtype)
        return self.spans[key]
