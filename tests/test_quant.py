"""Quantized variants: canonical bytes and hashes, GGUF quantizations kept, the weight-only kernels,
what an exact session computes on quantized blocks, and the errors for devices that cannot run them."""

from __future__ import annotations

import filecmp
import json

import numpy as np
import pytest
import torch

from diffuse.control.placement import block_bytes
from diffuse.errors import ModelError
from diffuse.model import quant, store, variants
from diffuse.model.engine import BlockSpan, block_parameters
from diffuse.model.gguf_import import embedded_gguf_path
from diffuse.model.load import load_span
from diffuse.model.quant import GROUP, QWeight, pack, parse_accept, quantize
from diffuse.model.weights import MANIFEST, load_manifest
from tiny import make_tiny


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("models") / "tiny", layers=2)


def within_scale_rounding(kept: QWeight, reference: np.ndarray) -> None:
    """kept's numbers equal the reference's up to the bf16 rounding of each group's scale and zero
    (relative 2^-8 each) times how far the value sits from the zero point (at most 8 steps)."""
    n, k = kept.shape
    s, z = kept.scale.float().abs()[..., None], kept.zero.float().abs()[..., None]
    bound = ((8 * s + z) * 2.0 ** -8 * 1.01 + 1e-6).expand(n, k // GROUP, GROUP).reshape(n, k)
    err = (kept.dequantize() - torch.from_numpy(np.asarray(reference, dtype=np.float32).reshape(n, k))).abs()
    assert bool((err <= bound).all()), float((err / bound).max())
    assert float(err.max()) > 0 or float(bound.max()) > 0


def test_kept_q4_1_and_q4_k_equal_the_gguf_packages_dequantization():
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(embedded_gguf_path())
    t = next(t for t in reader.tensors if t.tensor_type.name == "Q4_1")
    n, k = int(t.shape[1]), int(t.shape[0])
    kept = variants.kept(t.data, "Q4_1", n, k)
    within_scale_rounding(kept, dequantize(t.data, t.tensor_type))

    # Q4_K: the gguf package cannot quantize to it, so random super-blocks (any bits are valid
    # once d and dmin are finite): 8 groups of 32 each, 6-bit scales and mins, 4-bit values.
    rng = np.random.default_rng(0)
    rows, cols = 16, 512
    blocks = rng.integers(0, 256, size=(rows * cols // 256, 144), dtype=np.uint8)
    blocks[:, 0:2] = np.frombuffer(rng.uniform(1e-3, 2e-2, len(blocks)).astype(np.float16).tobytes(),
                                   np.uint8).reshape(-1, 2)
    blocks[:, 2:4] = np.frombuffer(rng.uniform(1e-3, 2e-2, len(blocks)).astype(np.float16).tobytes(),
                                   np.uint8).reshape(-1, 2)
    from gguf import GGMLQuantizationType

    data = blocks.reshape(rows, -1)
    kept = variants.kept(data, "Q4_K", rows, cols)
    within_scale_rounding(kept, dequantize(data, GGMLQuantizationType.Q4_K))


def test_quantizing_one_source_gives_the_same_bytes_and_hashes(tiny, tmp_path):
    for scheme in ("int8", "int4"):
        first = variants.resolve(tiny, scheme)
        again = tmp_path / scheme / "tiny"
        again.parent.mkdir()
        (again.parent / "tiny").symlink_to(tiny)
        second = variants.make_variant(again, scheme)
        one, two = load_manifest(first), load_manifest(second)
        assert one.block_hashes == two.block_hashes and one.model_hash == two.model_hash
        names = sorted(p.name for p in first.glob("*.safetensors"))
        assert names and all(filecmp.cmp(first / f, second / f, shallow=False) for f in names)
        source = load_manifest(tiny)
        assert (one.quant, one.source, one.source_id) == (scheme, source.model_hash, "tiny")
        assert one.group_size == (GROUP if scheme == "int4" else 0)
        assert one.head_hash == source.head_hash and one.block_hashes != source.block_hashes
        assert json.loads((first / MANIFEST).read_text())["model_hash"] == one.model_hash


def test_packed_kernels_compute_the_canonical_weights():
    w = torch.randn(192, 256)
    x = torch.randn(5, 256)
    for scheme in ("int8", "int4"):
        q = quantize(w, scheme)
        assert torch.equal(QWeight.from_tensors(q.tensors("w"), "w").values, q.values)
        p = pack(q, torch.float32, "cpu")
        ref = x @ q.dequantize().t()
        assert torch.allclose(p.matmul(x), ref, rtol=1e-4, atol=1e-4)
        assert torch.equal(p.canonical().values, q.values)  # the packed form gives its integers back
        bf = pack(q, torch.bfloat16, "cpu").matmul(x.bfloat16()).float()
        assert (bf - ref).norm() / ref.norm() < 1e-2
        err = (q.dequantize() - w).norm() / w.norm()
        assert err < (0.01 if scheme == "int8" else 0.1), err


def quantized_pair(path, scheme: str, dtype: torch.dtype) -> tuple[BlockSpan, BlockSpan]:
    """The variant's blocks, and plain blocks holding the very numbers they compute with."""
    q = load_span(path, 0, 2, dtype, quant=scheme)
    plain = load_span(path, 0, 2, dtype)
    with torch.no_grad():
        for a, b in zip(q.modules(), plain.modules()):
            if getattr(a, "packed", None) is not None:
                b.weight.copy_(a.packed.canonical().dequantize())
    return q, plain


def test_quantized_blocks_compute_what_their_dequantized_weights_do(tiny):
    h = torch.randn(1, 9, load_span(tiny, 0, 1).cfg.hidden_size)
    for scheme in ("int8", "int4"):
        q, plain = quantized_pair(tiny, scheme, torch.float32)
        assert q.quant == scheme and q.blocks[0].wqkv.weight.numel() == 0
        a, b = q(h, torch.arange(9), q.new_cache(16)), plain(h, torch.arange(9), plain.new_cache(16))
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-4)


def test_exact_sessions_on_quantized_blocks(tiny):
    """--exact on a quantized peer: the variant's canonical numbers, widened to fp32, through the
    exact kernels. So a row's bits do not depend on the rows beside it, and equal those of plain
    fp32 blocks holding the dequantized weights."""
    cfg = load_span(tiny, 0, 1).cfg
    h = torch.randn(3, 5, cfg.hidden_size)
    q, plain = quantized_pair(tiny, "int4", torch.float32)
    together = q(h, torch.arange(5), q.new_cache(8, 3, exact=True))
    alone = torch.cat([q(h[i:i + 1], torch.arange(5), q.new_cache(8, 1, exact=True)) for i in range(3)])
    assert torch.equal(together, alone)
    assert torch.equal(together, plain(h, torch.arange(5), plain.new_cache(8, 3, exact=True)))


def test_devices_that_cannot_run_quantized_blocks_are_named(tiny):
    q = quantize(torch.randn(60, 96), "int4")
    with pytest.raises(ModelError, match="CUDA int4 needs bf16 activations and N a multiple of 8"):
        pack(q, torch.bfloat16, "cuda")
    with pytest.raises(ModelError, match="CUDA int4 needs bf16"):
        pack(quantize(torch.randn(64, 128), "int4"), torch.float16, "cuda")
    with pytest.raises(ModelError, match="run on a CPU or a CUDA GPU, not on meta"):
        pack(quantize(torch.randn(64, 96), "int4"), torch.float32, "meta")
    if not torch.cuda.is_available():
        with pytest.raises(ModelError, match="has no usable CUDA"):
            load_span(tiny, 0, 1, torch.bfloat16, "cuda", quant="int4")
    with pytest.raises(ModelError, match="unknown quantization 'int3'"):
        load_span(tiny, 0, 1, quant="int3")
    with pytest.raises(ModelError, match="int4 needs rows of a multiple of 32"):
        quantize(torch.randn(4, 40), "int4")


def test_accepted_variants():
    assert parse_accept(None, "int4") == ("int4", "int8", "none")
    assert parse_accept(None, "none") == ("none",)
    assert parse_accept("any", "none") == quant.SCHEMES
    assert parse_accept("int4, none", "none") == ("int4", "none")
    with pytest.raises(ModelError, match="unknown quantization 'fp8'"):
        parse_accept("fp8", "none")


def test_model_info_says_what_each_tensor_became(home, smollm2):
    """The embedded Q4_1 file's import keeps its quantization as the int4 variant."""
    v = store.info(variants.variant_dir(smollm2, "int4"))
    text = store.describe(v)
    assert "quant        int4" in text and "group_size   32" in text
    assert "tensor       self_attn.q_proj.weight: int4 g32 (gguf Q4_1, kept) (blocks 0-29)" in text
    assert "head         not quantized" in text
    assert "int4" in store.describe(store.info(smollm2)).split("variants")[1].splitlines()[0]
    cfg = v.config
    bf16 = 2 * block_parameters(cfg, 0)  # the bf16 weights themselves (no reordered copy)
    assert block_bytes(cfg, "bfloat16", "int4") <= 0.35 * bf16
    assert block_bytes(cfg, "bfloat16", "int8") <= 0.55 * bf16
    assert max(v.manifest.block_bytes) <= 0.35 * bf16


def test_coverage_counts_the_variants_a_client_accepts():
    """A record names its variant (ext quant) and carries that variant's hashes; coverage checks
    each against the variant's own hashes, and excludes variants the client does not accept."""
    from dataclasses import replace

    from diffuse.control.coverage import coverage
    from test_placement import MODEL, fake_hashes, rec

    plain, four = fake_hashes(30), fake_hashes(30, "int4")
    recs = [rec(0, 15), replace(rec(15, 30, hashes=four), extra={"quant": "int4"}),
            replace(rec(0, 30, hashes=plain), extra={"quant": "int4"})]  # int4 claimed, plain weights
    both = coverage(recs, MODEL, 30, expected_hashes=plain, variants={"none": plain, "int4": four})
    assert both.servable and len(both.peers) == 2
    assert "other weights" in both.excluded[recs[2].peer_id]
    only = coverage(recs, MODEL, 30, expected_hashes=plain, variants={"none": plain})
    assert only.missing == list(range(15, 30))
    assert "int4 variant, which is not accepted here" in only.excluded[recs[1].peer_id]


def test_status_counts_the_peers_of_variants_it_accepts(home, smollm2, monkeypatch):
    """`diffuse status` checks a quantized peer's hashes against the variant this store makes from
    its own weights, as a client does, and counts it where --accept-quant (default any) accepts it."""
    import time
    from types import SimpleNamespace as NS

    import trio

    from diffuse.client.survey import Variants, stored
    from diffuse.control.coverage import format_text
    from diffuse.control.records import PeerRecord

    manifest = load_manifest(smollm2)
    int4 = load_manifest(variants.variant_dir(smollm2, "int4")).block_hashes  # kept by the import

    def rec(peer: str, start: int, end: int, hashes, scheme: str) -> PeerRecord:
        now = time.time()
        return PeerRecord(peer, manifest.model_id, 30, start, end, tuple(hashes[start:end]), "bfloat16", 10.0, 100,
                          ("/ip4/127.0.0.1/tcp/1",), now, now + 60, now - 5, extra={"quant": scheme})

    recs = [rec("QmPlain", 0, 15, manifest.block_hashes, "none"), rec("QmFour", 15, 30, int4, "int4"),
            rec("QmLiar", 15, 30, manifest.block_hashes, "int4")]  # int4 announced, the full weights' hashes
    node = NS(records=lambda model: _value(recs), num_blocks={})

    def survey(accept, sources=None):
        return trio.run(Variants(stored(home, []) if sources is None else sources, accept).coverage,
                        node, manifest)

    cov = survey(quant.SCHEMES)
    assert cov.servable and set(cov.peers) == {"QmPlain", "QmFour"}, cov.excluded
    assert "other weights" in cov.excluded["QmLiar"] and "[15,30) int4" in format_text(cov)
    assert cov.to_dict()["peers"][1]["quant"] == "int4"
    plain = survey(("none",))
    assert plain.missing == list(range(15, 30)) and "not accepted here" in plain.excluded["QmFour"]
    unchecked = survey(quant.SCHEMES, {})  # a manifest from the swarm: no weights to make a variant from
    assert "whose hashes are not checked here" in unchecked.excluded["QmFour"]

    def cannot(source, scheme):
        raise ModelError("no int4 for this family")

    monkeypatch.setattr(variants, "resolve", cannot)
    assert "cannot be made here: no int4 for this family" in survey(quant.SCHEMES).excluded["QmFour"]


async def _value(x):
    return x
