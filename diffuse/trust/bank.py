"""A client's secret canaries and the calibration that judges replies to them, per block span.

The expensive part depends only on the model: natural text sampled from it and the fp32 hidden
state of that text at every block boundary. It is computed once per client and model and kept
under <home>/trust/ (0600: whoever reads it can answer canaries honestly and cheat elsewhere).
Each client samples its own text from the OS's randomness, so no two clients share canaries.
Per span, the bank derives what a judge needs: the canaries themselves (inputs in the wire
dtype and fp32 references), the benign drift of every calibrated compute dtype (canary.Calibration)
and the spot-check tolerance (spotcheck.Tolerance), plus the fp32 span that recomputes spot checks.
A quantized variant a peer announces gets its own canary references (the variant in fp32), so
that what is judged is whether the peer computes that variant, not how far it sits from the
full weights.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from diffuse.model import variants
from diffuse.model.config import ModelConfig
from diffuse.model.engine import BlockSpan
from diffuse.model.layers import widen_
from diffuse.model.load import load_head, load_span
from diffuse.model.quant import compute_name, split_name
from diffuse.model.tokenizer import Tokenizer
from diffuse.model.weights import MANIFEST, load_manifest
from diffuse.trust import canary as C
from diffuse.trust.spotcheck import Tolerance

log = logging.getLogger(__name__)
PROMPT = "<|im_start|>user\n"  # canaries open like chat traffic; shared tokens are not scored
# Spot-check thresholds are fitted on 16-token canaries from position 0, but real steps sit deeper
# in longer contexts, where bf16 drift grows: an honest bf16 peer measured 0.022 against a fitted
# 0.02 at position ~50. Until calibration covers long contexts, thresholds are widened 4x; gross
# tampering (10% noise and up) still fails them, and canaries judge the subtle kinds.
SPOT_MARGIN = 4.0


@dataclass
class SpanMaterial:
    """Everything the trust plane needs to judge peers serving blocks [start, end)."""

    start: int
    end: int
    canaries: list[C.Canary]
    benign: dict[str, list[torch.Tensor]]  # honest outputs [n, T, H] per compute dtype, 2 realizations
    wire_dtype: torch.dtype
    load_referee: Callable[[], BlockSpan]
    save: Callable[["SpanMaterial"], None]
    _referee: BlockSpan | None = None
    load_variant: Callable[[str, torch.dtype], BlockSpan] | None = None  # (scheme, dtype) -> its blocks here
    _variants: dict[str, BlockSpan] = field(default_factory=dict)  # fp32 referees of quantized variants
    references: dict[str, torch.Tensor] = field(default_factory=dict)  # per variant: its fp32 output [n, T, H]
    hashes: dict[str, str] = field(default_factory=dict)  # per variant: the model hash its reference is of
    variant_hash: Callable[[str], str | None] = lambda scheme: None  # the store's variant's hash now
    exact: bool = False  # judges exact sessions: honest outputs on the batch-invariant kernels

    def __post_init__(self) -> None:
        self._calibrate(self.benign)

    def _calibrate(self, benign: dict[str, list[torch.Tensor]]) -> None:
        """Calibration and tolerance for `benign`, built aside and then assigned whole: the trust
        plane's tasks read them while a worker thread calibrates a new dtype."""
        by_scheme: dict[str, dict[str, list[torch.Tensor]]] = {}
        for name, outs in benign.items():
            by_scheme.setdefault(split_name(name)[1], {})[name] = outs
        calibration = C.Calibration({})
        for outputs in by_scheme.values():  # each variant's outputs scored against its own references
            canaries = self.canaries_for(next(iter(outputs)))
            calibration.benign |= C.Calibration.from_outputs(canaries, outputs).benign
        fitted = Tolerance.from_outputs(benign)
        self.calibration = calibration
        self.tolerance = Tolerance({k: v * SPOT_MARGIN for k, v in fitted.thresholds.items()}, fitted.alpha)

    @property
    def referee(self) -> BlockSpan:
        """The span in fp32: recomputes spot-checked steps (loaded on first use)."""
        if self._referee is None:
            self._referee = self.load_referee()
        return self._referee

    def referee_for(self, name: str) -> BlockSpan:
        """What recomputes a peer computing in `name` (compute_name): the fp32 span, or for a
        quantized variant that variant's blocks computing in fp32, so that a check's tolerance
        is the kernels' noise, not the quantization's error."""
        scheme = split_name(name)[1]
        if scheme == "none":
            return self.referee
        if scheme not in self._variants:
            self._variants[scheme] = self.load_variant(scheme, torch.float32)
        return self._variants[scheme]

    def canaries_for(self, name: str) -> list[C.Canary]:
        """The canaries as a peer computing in `name` is judged on them: for a quantized variant,
        each one's reference is the variant's own fp32 output, so that its benign drift is the
        kernels' noise alone. Against the full weights' reference the quantization's error would
        dominate, and a peer holding fewer bits than it announces could even drift less (on
        SmolLM2, int4 in groups of 32 sits nearer the full weights than int8 per row)."""
        scheme = split_name(name)[1]
        if scheme == "none":
            return self.canaries
        return [replace(c, reference=r) for c, r in zip(self.canaries, self.references[scheme])]

    @staticmethod
    def referee_name(name: str) -> str:
        return compute_name(torch.float32, split_name(name)[1])

    def judge(self, dtype: str) -> None:
        """Make sure peers computing in `dtype` can be judged (calibrates it on first use)."""
        if dtype in self.benign:
            return
        name, scheme = split_name(dtype)
        torch_dtype = getattr(torch, name, None)
        if not isinstance(torch_dtype, torch.dtype) or not torch_dtype.is_floating_point:
            raise ValueError(f"peer declares an unknown compute dtype {dtype!r}")
        benign = dict(self.benign)  # published once calibrated: readers test `dtype in benign` unlocked
        if scheme == "none":
            benign.update(_benign(self.referee, self.canaries, [torch_dtype], self.wire_dtype, self.exact))
        else:  # the variant's reference, and its honest outputs in fp32 (the referee's) and in `dtype`
            self._judge_variant(scheme, torch_dtype, benign)
        self._calibrate(benign)
        self.benign = benign
        self.save(self)

    def _judge_variant(self, scheme: str, dtype: torch.dtype, benign: dict[str, list[torch.Tensor]]) -> None:
        """Two honest realizations, as for the full weights (canary.honest_output: this machine's
        kernels alone, and the dimensions permuted and batched), of the variant in fp32 and in
        `dtype`, into `benign`, and the variant's reference (its fp32 output, computed at once)."""
        hidden = torch.stack([c.hidden for c in self.canaries]).float()
        name = compute_name(torch.float32, scheme)
        if scheme not in self.references or name not in benign:
            referee = self.referee_for(name)  # makes the variant where the store lacks it
            ref = C.forward(referee, hidden)
            self.references[scheme], self.hashes[scheme] = ref, self.variant_hash(scheme) or ""
            first = C.honest_output(referee, hidden, torch.float32, None, self.wire_dtype, True) if self.exact \
                else ref.to(self.wire_dtype).float()
            benign[name] = [first, C.honest_output(referee, hidden, torch.float32, 1, self.wire_dtype, self.exact)]
        if dtype != torch.float32:
            peer = self.load_variant(scheme, dtype)
            benign[compute_name(dtype, scheme)] = [
                C.honest_output(peer, hidden, dtype, seed, self.wire_dtype, self.exact) for seed in (None, 1)]


class CanaryBank:
    """exact: the bank of a client whose sessions are exact, so are its canary sessions, and peers
    compute them on the batch-invariant kernels (attention in fp64), whose drift differs canary by
    canary from the fast kernels' (some canaries drift far more): calibrated on those kernels, in
    span files of their own. The sampled canaries are shared."""

    def __init__(self, model_dir: Path, home: Path, wire_dtype: torch.dtype, n: int = 16, length: int = 16,
                 dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16), exact: bool = False):
        if n < 2 or length <= 4:
            raise ValueError("a canary bank needs at least 2 canaries of more than 4 tokens")
        self.model_dir, self.wire_dtype, self.n, self.length, self.dtypes = model_dir, wire_dtype, n, length, dtypes
        self.exact = exact
        manifest = load_manifest(model_dir)
        self.num_layers = manifest.num_layers
        self.dir = home / "trust" / manifest.model_hash[:16]
        self.path = self.dir / f"canaries-{n}x{length}.safetensors"
        self.spans: dict[tuple[int, int], SpanMaterial] = {}
        self._tokens: torch.Tensor | None = None
        self._boundaries: torch.Tensor | None = None
        self._lock = threading.Lock()  # sessions of one client ask for the same span at once

    def _write(self, path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, str] | None = None) -> None:
        """Atomically, readable by this user only: whoever reads canaries can game them."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata=meta)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)

    def _base(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Canary tokens [n, T] and their fp32 hidden states at every block boundary [L+1, n, T, H]."""
        if self._tokens is None:
            saved = self._read_base() if self.path.exists() else None
            if saved is not None:
                self._tokens, self._boundaries = saved
            else:
                self._tokens, self._boundaries = self._sample()
                self._write(self.path, {"tokens": self._tokens, "boundaries": self._boundaries})
        return self._tokens, self._boundaries

    def _read_base(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The stored canaries, checked: integer tokens [n, T], float boundaries [L+1, n, T, H].
        None (said) where they are not, after removing the span files computed from them."""
        hidden = ModelConfig.load(self.model_dir).hidden_size
        try:
            saved = load_file(self.path)
            tokens, boundaries = saved["tokens"], saved["boundaries"]
        except Exception as e:  # noqa: BLE001 - a damaged file: sample again
            tokens = boundaries = None
            log.warning("canaries %s unreadable (%s)", self.path, e)
        if tokens is not None and tuple(tokens.shape) == (self.n, self.length) and not tokens.dtype.is_floating_point \
                and tuple(boundaries.shape) == (self.num_layers + 1, self.n, self.length, hidden) \
                and boundaries.dtype.is_floating_point:
            return tokens, boundaries
        log.warning("canaries %s are not [n, T] tokens with [L+1, n, T, H] = %s states: sampling them again",
                    self.path, [self.num_layers + 1, self.n, self.length, hidden])
        for old in self.dir.glob("span-*.safetensors"):  # calibrated for the canaries dropped
            old.unlink(missing_ok=True)
        return None

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
        """Canaries, calibration and referee for [start, end): computed once (seconds), then read
        from disk; the referee's weights load only when a spot check needs them."""
        with self._lock:
            return self._material(start, end)

    def judging(self, start: int, end: int, dtype: str) -> SpanMaterial:
        """material(start, end), calibrated for peers computing in `dtype`."""
        with self._lock:
            m = self._material(start, end)
            m.judge(dtype)
            return m

    def _material(self, start: int, end: int) -> SpanMaterial:
        key = (start, end)
        if key in self.spans:
            return self.spans[key]
        tokens, boundaries = self._base()
        path = self.dir / (f"span-{start}-{end}-{C.dtype_name(self.wire_dtype)}-{self.n}x{self.length}"
                           f"-tail{C.DECODE_TAIL}{'-exact' if self.exact else ''}.safetensors")  # canaries sent so
        load = lambda: load_span(self.model_dir, start, end, torch.float32)  # noqa: E731
        variant = lambda scheme, dtype: _variant(self.model_dir, start, end, scheme, dtype)  # noqa: E731
        saved = self._read_span(path, (self.n, self.length, boundaries.shape[-1])) if path.exists() else None
        if saved is not None:
            reference, references, hashes, benign = saved
            canaries = C.make_canaries(tokens, boundaries[start], None, self.wire_dtype, reference)
            m = SpanMaterial(start, end, canaries, benign, self.wire_dtype, load, self._saver(path), None, variant,
                             references=references, hashes=hashes, variant_hash=self._variant_hash, exact=self.exact)
        else:
            span = load()
            canaries = C.make_canaries(tokens, boundaries[start], span, self.wire_dtype)
            benign = _benign(span, canaries, self.dtypes, self.wire_dtype, self.exact)
            m = SpanMaterial(start, end, canaries, benign, self.wire_dtype, load, self._saver(path), span, variant,
                             variant_hash=self._variant_hash, exact=self.exact)
            m.save(m)
        self.spans[key] = m
        return m

    def _variant_hash(self, scheme: str) -> str | None:
        """The model hash of the store's `scheme` variant of this model, None where it has none."""
        own = load_manifest(self.model_dir)
        source = self.model_dir if own.quant == "none" else variants.source_dir(self.model_dir, own)
        path = variants.variant_dir(source, scheme)
        return load_manifest(path).model_hash if (path / MANIFEST).is_file() else None

    def _read_span(self, path: Path, shape: tuple[int, int, int]) -> tuple | None:
        """A span file's reference, variant references and their hashes, and benign outputs, each
        tensor checked to be float [n, T, H]; None (said) where one is not, so it is recomputed. A
        variant whose store copy is not the one its reference was computed of (a re-import) loses
        its reference and benign outputs, computed again when a peer computing it is met."""
        try:
            saved = load_file(path)
            with safe_open(path, "pt") as f:
                meta = f.metadata() or {}
        except Exception as e:  # noqa: BLE001 - a damaged file: recompute it
            log.warning("canary calibration %s unreadable (%s): recomputing it", path, e)
            return None
        bad = [k for k, v in saved.items() if tuple(v.shape) != shape or not v.dtype.is_floating_point]
        names = {k.split("/")[1] for k in saved if k.startswith("benign/")}
        bad += [f"benign/{k}/{i}" for k in names for i in range(2) if f"benign/{k}/{i}" not in saved]
        if bad or "reference" not in saved:
            log.warning("canary calibration %s does not hold float [n, T, H] = %s tensors (%s): recomputing it",
                        path, list(shape), ", ".join(bad[:4]) or "no reference")
            return None
        references = {k.split("/")[1]: v for k, v in saved.items() if k.startswith("variant/")}
        hashes = {s: meta.get(f"variant/{s}", "") for s in references}
        for scheme in [s for s in references if hashes[s] != self._variant_hash(s)]:
            log.info("the %s variant in the store is not the one %s was calibrated for: recalibrating it", scheme, path)
            del references[scheme], hashes[scheme]
        benign = {k: [saved[f"benign/{k}/{i}"] for i in range(2)] for k in names
                  if split_name(k)[1] in ("none", *references)}
        return saved["reference"], references, hashes, benign

    def _saver(self, path: Path) -> Callable[[SpanMaterial], None]:
        def save(m: SpanMaterial) -> None:
            tensors = {"reference": torch.stack([c.reference for c in m.canaries])}
            tensors |= {f"variant/{scheme}": ref for scheme, ref in m.references.items()}
            tensors |= {f"benign/{name}/{k}": out for name, outs in m.benign.items() for k, out in enumerate(outs)}
            self._write(path, tensors, {f"variant/{s}": h for s, h in m.hashes.items()})
        return save


def _variant(model_dir: Path, start: int, end: int, scheme: str, dtype: torch.dtype) -> BlockSpan:
    """The variant's blocks computing in `dtype`; in fp32 (a referee) on float kernels (widen_)."""
    span = load_span(model_dir, start, end, dtype, quant=scheme)
    return widen_(span) if dtype == torch.float32 else span


def _benign(span: BlockSpan, canaries: list[C.Canary], dtypes,
            wire_dtype: torch.dtype, exact: bool = False) -> dict[str, list[torch.Tensor]]:
    """Two honest realizations per dtype; fp32's first on the fast kernels is the references
    themselves (the same computation), which saves one of the five passes."""
    if exact:
        return C.benign_outputs(span, canaries, dtypes, wire_dtype, realizations=2, exact=True)
    out = {}
    for d in dtypes:
        if d == torch.float32:
            hidden = torch.stack([c.hidden for c in canaries]).float()
            ref = torch.stack([c.reference for c in canaries]).to(wire_dtype).float()
            out[C.dtype_name(d)] = [ref, C.honest_output(span, hidden, d, 1, wire_dtype)]
        else:
            out |= C.benign_outputs(span, canaries, [d], wire_dtype, realizations=2)
    return out
