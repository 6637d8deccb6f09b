"""Judging quantized peers: a variant's canaries are scored against the variant's own fp32
output, its honest realizations permute whole int4 groups, and at bf16 (the default) the canaries
tell a peer computing int4 from one computing the int8 it announces."""

from __future__ import annotations

import pytest
import torch

from diffuse.errors import ModelError
from diffuse.model.layers import widen_
from diffuse.model.load import load_span
from diffuse.model.quant import GROUP, group_permutation, pack, quantize
from diffuse.trust import canary as C
from diffuse.trust.bank import CanaryBank
from tiny import make_tiny


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("models") / "tiny", layers=2)


def test_an_int4_weight_reads_back_exactly_and_moves_in_whole_groups():
    w = torch.randn(64, 4 * GROUP) * 0.01 + 100  # groups far from zero: bf16 could not hold w exactly
    q = quantize(w, "int4")
    for dtype in (torch.float32, torch.bfloat16):
        p = pack(q, dtype, "cpu")
        assert torch.equal(p.canonical().values, q.values)
    g = torch.Generator().manual_seed(3)
    rows, cols = torch.randperm(64, generator=g), group_permutation(4 * GROUP, g)
    assert sorted(cols.tolist()) == list(range(4 * GROUP)) and not torch.equal(cols, torch.arange(4 * GROUP))
    moved = pack(q, torch.float32, "cpu").reindexed(rows, cols)
    assert torch.equal(moved.canonical().dequantize(), q.dequantize()[rows][:, cols])
    with pytest.raises(ModelError, match="within whole groups"):
        pack(q, torch.float32, "cpu").reindexed(None, torch.randperm(4 * GROUP, generator=g))
    with pytest.raises(ModelError, match="whole groups"):
        group_permutation(4 * GROUP + 3, g)  # not a shorter permutation, silently


def test_a_quantized_span_permuted_or_widened_computes_the_same_function(tiny):
    span = load_span(tiny, 0, 2, torch.float32, quant="int4")
    h = torch.randn(2, 6, span.cfg.hidden_size)
    want = C.forward(span, h)
    p = C._permute(span, 5)  # an int4 span's permutation keeps every group whole
    assert torch.allclose(C.forward(span, h[..., p])[..., torch.argsort(p)], want, rtol=1e-4, atol=1e-4)
    plain = widen_(load_span(tiny, 0, 2, torch.float32, quant="int4"))
    assert plain.blocks[0].wqkv.packed is None and plain.blocks[0].wqkv.weight.numel() > 0
    assert torch.allclose(C.forward(plain, h), want, rtol=1e-4, atol=1e-4)


def test_canaries_tell_int4_weights_from_the_int8_a_bf16_peer_announces(smollm2, tmp_path):
    """Scored against the full weights' reference, int4 in groups of 32 drifts no more than int8
    per row does on SmolLM2, so a one-sided test could not catch a peer holding fewer bits.
    Against the announced variant's own reference, an honest peer drifts by kernel noise alone."""
    bank = CanaryBank(smollm2, tmp_path, torch.float16, n=8, length=12)
    start, end = 1, 8
    for name in ("bfloat16+int8", "bfloat16+int4"):
        material = bank.judging(start, end, name)
    hidden = torch.stack([c.hidden for c in material.canaries]).float()
    computed = {scheme: C.forward_as_sent(load_span(smollm2, start, end, torch.bfloat16, quant=scheme), hidden,
                                          False).to(torch.float16).float() for scheme in ("int8", "int4")}
    for announced in ("int8", "int4"):
        name = f"bfloat16+{announced}"
        canaries = material.canaries_for(name)
        for scheme, outs in computed.items():
            monitor = C.CanaryMonitor(material.calibration.for_dtype(name))
            verdicts = [monitor.observe(i, c, outs[i]) for i, c in enumerate(canaries)]
            assert any(v.tampered for v in verdicts) == (scheme != announced), (name, scheme, verdicts[-1])
    # the full weights' canaries are untouched; a bank read back from disk judges alike
    assert material.canaries_for("bfloat16") is material.canaries
    again = CanaryBank(smollm2, tmp_path, torch.float16, n=8, length=12).material(start, end)
    assert "bfloat16+int4" in again.benign and torch.equal(again.references["int4"], material.references["int4"])



@pytest.fixture
def own_tiny(tmp_path):
    """A model of this test's own (its int4 variant may be replaced) and a home for its bank."""
    return make_tiny(tmp_path / "models" / "tiny", layers=2), tmp_path / "home"


def test_calibrating_a_variant_publishes_the_calibration_whole(own_tiny):
    """Readers (the trust plane's tasks) test `dtype in benign` without the bank's lock: the
    calibration they meet meanwhile is the previous one, whole, and the new dtype appears in
    `benign` only once calibrated."""
    model, home = own_tiny
    m = CanaryBank(model, home, torch.float16, n=4, length=12).judging(0, 2, "float32+int4")
    seen = []
    calibrate = C.Calibration.from_outputs

    def watched(canaries, outputs, *a, **k):  # what a reader would meet mid-calibration
        seen.append(("bfloat16+int4" in m.benign, sorted(m.calibration.benign)))
        return calibrate(canaries, outputs, *a, **k)

    C.Calibration.from_outputs = watched
    try:
        m.judge("bfloat16+int4")
    finally:
        C.Calibration.from_outputs = calibrate
    assert seen and all(not published and "float32+int4" in names for published, names in seen), seen
    assert "bfloat16+int4" in m.calibration.benign and "bfloat16+int4" in m.benign


def test_a_stored_variant_reference_loads_no_fp32_referee(own_tiny):
    model, home = own_tiny
    m = CanaryBank(model, home, torch.float16, n=4, length=12).judging(0, 2, "float32+int4")
    again = CanaryBank(model, home, torch.float16, n=4, length=12).material(0, 2)
    loads = []
    load_variant = again.load_variant
    again.load_variant = lambda scheme, dtype: loads.append(dtype) or load_variant(scheme, dtype)
    again.judge("float16+int4")
    assert torch.equal(again.references["int4"], m.references["int4"]) and loads == [torch.float16]


def test_a_variant_replaced_in_the_store_is_calibrated_again(own_tiny):
    """A stored reference is of one variant's bytes: a re-import (another int4 variant of the
    same source) drops it and the variant's benign outputs, so no honest peer is judged by it."""
    import shutil

    from diffuse.model import variants
    from diffuse.model.weights import ModelFiles, load_manifest

    model, home = own_tiny
    m = CanaryBank(model, home, torch.float16, n=4, length=12).judging(0, 2, "bfloat16+int4")
    kept = CanaryBank(model, home, torch.float16, n=4, length=12).material(0, 2)
    assert "bfloat16+int4" in kept.benign and torch.equal(kept.references["int4"], m.references["int4"])
    source = ModelFiles(model)
    shutil.rmtree(variants.variant_dir(model, "int4"))
    variants.write_variant(model, "int4", ({n: quantize(t * 1.5, "int4") if n in variants.QUANTIZED else t
                                            for n, t in source.read_block(i).items()} for i in range(2)))
    fresh = CanaryBank(model, home, torch.float16, n=4, length=12).material(0, 2)
    assert "int4" not in fresh.references and not [k for k in fresh.benign if k.endswith("+int4")]
    fresh.judge("float32+int4")
    assert not torch.equal(fresh.references["int4"], m.references["int4"])
    assert fresh.hashes["int4"] == load_manifest(variants.variant_dir(model, "int4")).model_hash


def test_a_calibration_file_of_other_shapes_is_recomputed_and_said(own_tiny, caplog):
    from safetensors.torch import load_file, save_file

    model, home = own_tiny
    bank = CanaryBank(model, home, torch.float16, n=4, length=12)
    bank.material(0, 2)
    path = next(bank.dir.glob("span-0-2-*.safetensors"))
    saved = load_file(path)
    for name, tensor in [("benign/float32/1", saved["benign/float32/1"][:, :3].contiguous()),
                         ("benign/float32/0", saved["benign/float32/0"].to(torch.int32))]:
        save_file(saved | {name: tensor}, path)
        caplog.clear()
        with caplog.at_level("WARNING"):
            redone = CanaryBank(model, home, torch.float16, n=4, length=12).material(0, 2)
        assert str(path) in caplog.text and redone._referee is not None  # recomputed from the weights
        assert redone.benign["float32"][1].shape == saved["benign/float32/1"].shape
    save_file({k: v for k, v in saved.items() if k != "benign/bfloat16/1"}, path)
    assert CanaryBank(model, home, torch.float16, n=4, length=12).material(0, 2)._referee is not None


def test_stored_canaries_of_other_shapes_are_sampled_again_with_their_span_files(own_tiny, caplog):
    from safetensors.torch import load_file, save_file

    model, home = own_tiny
    bank = CanaryBank(model, home, torch.float16, n=4, length=12)
    bank.material(0, 2)
    saved = load_file(bank.path)
    save_file(saved | {"boundaries": saved["boundaries"][:, :, :5].contiguous()}, bank.path)
    with caplog.at_level("WARNING"):
        again = CanaryBank(model, home, torch.float16, n=4, length=12)
        tokens, boundaries = again._base()
    assert str(bank.path) in caplog.text and not list(again.dir.glob("span-*"))
    assert tuple(boundaries.shape) == tuple(saved["boundaries"].shape) and not torch.equal(tokens, saved["tokens"])
