"""The CPU matmul paths of diffuse.model.kernels compute what F.linear computes."""

import pytest
import torch
import torch.nn.functional as F

from diffuse.model import kernels
from diffuse.model.kernels import Linear, linear


@pytest.fixture(params=[kernels.AVX2, kernels.AVX512], ids=lambda p: p.name)
def profile(request, monkeypatch):
    """Both CPUs' paths run on this one (they differ in speed, not in what they compute)."""
    monkeypatch.setattr(kernels, "profile", lambda: request.param)
    return request.param


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 6, 7, 8, 13, 16, 57, 64, 65, 130])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_fp32_paths_match_f_linear(rows, bias, threads, profile, monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)  # one row: GEMV or a doubled row
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(1, rows, 96, generator=g)
    w, b = torch.randn(200, 96, generator=g), torch.randn(200, generator=g) if bias else None
    out = linear(x, w, b)
    assert out.shape == (1, rows, 200) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 4, 8, 13, 33])
def test_bf16_widening_matches_fp32_accumulation(rows, monkeypatch):
    """Widened bf16 (blockwise, the block made small here) rounds the fp32 product once, as a
    bf16 kernel accumulating in fp32 does: every value within half a bf16 step of the exact one."""
    monkeypatch.setattr(kernels, "WIDEN_BLOCK", 16)
    monkeypatch.setattr(kernels, "native_bf16", lambda: False)
    g = torch.Generator().manual_seed(rows)
    x, w = torch.randn(2, rows, 64, generator=g).bfloat16(), torch.randn(100, 64, generator=g).bfloat16()
    exact = F.linear(x.float(), w.float())
    out = linear(x, w)
    assert out.dtype == torch.bfloat16 and out.shape == (2, rows, 100)
    assert ((out.float() - exact).abs() <= exact.abs() * 2 ** -8 + 1e-4).all()


def test_linear_module_keeps_nn_linear_state_dict():
    lin = torch.nn.Linear(8, 4)
    ours = Linear(8, 4)
    ours.load_state_dict(lin.state_dict())
    x = torch.randn(5, 8)
    torch.testing.assert_close(ours(x), lin(x))


def test_padded_rows_follow_the_cpu(monkeypatch):
    monkeypatch.setattr(kernels, "profile", lambda: kernels.AVX2)  # multiples of eight from seven rows
    assert [kernels.padded_rows(r) for r in (1, 2, 6, 7, 8, 9, 16, 17, 63)] == [1, 2, 6, 8, 8, 16, 16, 24, 64]
    monkeypatch.setattr(kernels, "profile", lambda: kernels.AVX512)  # reordered weights: buckets of sixteen
    monkeypatch.setattr(kernels, "reorders", lambda dtype=None: True)
    assert [kernels.padded_rows(r) for r in (1, 3, 4, 15, 16, 17, 33)] == [1, 3, 4, 15, 16, 32, 48]
    monkeypatch.setattr(kernels, "reorders", lambda dtype=None: False)  # without oneDNN: multiples of sixteen from four
    assert [kernels.padded_rows(r) for r in (1, 3, 4, 15, 16, 17, 33)] == [1, 3, 16, 16, 16, 32, 48]
    # An exact session's products run in blocks of sixteen rows.
    assert [kernels.padded_rows(r, exact=True) for r in (1, 8, 16, 17, 25, 33)] == [16, 16, 16, 32, 32, 48]


def test_onednn_products_meet_a_bounded_set_of_row_counts(monkeypatch):
    """oneDNN keeps a compiled kernel per row count: decoding's few rows as they are, more rows in
    buckets of sixteen, and more than CHUNK_ROWS in chunks, each row's result where it belongs."""
    seen, real = set(), torch.ops.mkldnn._linear_pointwise

    def counting(x, *args):
        seen.add(x.shape[0])
        return real(x, *args)
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", counting)
    monkeypatch.setattr(kernels, "_takes_reordered", lambda weight, rows: True)
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(40, 64, generator=g), torch.randn(40, generator=g)
    for rows in [*range(1, 40), 255, 256, 257, 300, 600]:
        x = torch.randn(rows, 64, generator=g)
        out = linear(x, w, b)
        assert out.shape == (rows, 40)
        torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-4, atol=1e-4)
    assert seen == {*range(1, 17), 32, 48, 256, 96}  # 257 and 600 end in chunks of 1 and 88 rows


@pytest.mark.parametrize("rows", [1, 2, 9])
def test_bf16_paths_match_f_linear(rows, profile):
    """One bf16 row by GEMV where the CPU has native bf16: the bf16 rounding of the fp32 product."""
    g = torch.Generator().manual_seed(rows)
    x, w, b = (torch.randn(1, rows, 64, generator=g).bfloat16(), torch.randn(300, 64, generator=g).bfloat16(),
               torch.randn(300, generator=g).bfloat16())
    out = linear(x, w, b)
    assert out.dtype == torch.bfloat16 and out.shape == (1, rows, 300) and out.is_contiguous()
    want = F.linear(x.float(), w.float(), b.float())
    assert ((out.float() - want).abs() <= want.abs() * 2 ** -7 + 2 ** -7).all()


@pytest.mark.skipif(not kernels.reorders(torch.bfloat16), reason="no native bf16 with oneDNN here")
def test_bf16_products_through_reordered_weights_keep_torch_s_bits():
    """bf16 products take oneDNN with the weight reordered once at every row count: the same
    kernel torch's own bf16 product runs after reordering the weight on each call, so the bits
    (and every answer) are those of F.linear, and of torch.mv for one row."""
    g = torch.Generator().manual_seed(0)
    for n, k in ((960, 576), (576, 1536), (4100, 64)):
        w = torch.randn(n, k, generator=g).bfloat16()
        for rows in (*range(1, 20), 33, 64, 130):
            x = torch.randn(rows, k, generator=g).bfloat16()
            want = torch.mv(w, x[0])[None] if rows == 1 else F.linear(x, w)
            assert torch.equal(linear(x, w), want), (n, k, rows)
        assert hasattr(w, "_diffuse_reordered")  # the reordered copy is kept on the weight


def test_profile_is_chosen_by_the_cpu():
    cap = torch.backends.cpu.get_cpu_capability()
    avx512 = kernels.AVX512_AMD if kernels.cpu_vendor() == "AuthenticAMD" else kernels.AVX512
    assert kernels.profile() is (avx512 if cap.startswith("AVX512") else kernels.AVX2)
    assert kernels.describe().startswith(kernels.profile().name)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
def test_a_reordered_weight_follows_changes_to_its_weight(monkeypatch):
    """The oneDNN copy of a weight is made once and redone after the weight changes in place (a
    canary's permutation, a test's tampering): a product never uses stale weights."""
    monkeypatch.setattr(kernels, "profile", lambda: kernels.AVX512)
    lin = Linear(64, 96)
    x = torch.randn(8, 64)
    torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-4)
    first = kernels.reordered(lin.weight)
    assert kernels.reordered(lin.weight) is first  # kept, not redone
    with torch.no_grad():
        lin.weight.mul_(-2.0)
    torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-4)
    assert kernels.reordered(lin.weight) is not first


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weights_made_in_inference_mode_take_torch_s_path(dtype):
    """A tensor made in inference mode has no version counter, so no reordered copy could tell
    that it went stale: its products take torch's path, and still compute."""
    with torch.inference_mode():
        lin = Linear(64, 96).to(dtype)
        x = torch.randn(5, 64).to(dtype)
        assert lin.weight.is_inference()
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias))
    assert not hasattr(lin.weight, "_diffuse_reordered")


def test_products_that_need_gradients_keep_torch_s_path(monkeypatch):
    """oneDNN's product with a reordered weight has no autograd: a training step (the draft head's)
    must get gradients for its weights."""
    monkeypatch.setattr(kernels, "profile", lambda: kernels.AVX512)
    lin = Linear(64, 96)
    with torch.enable_grad():
        lin(torch.randn(8, 64)).sum().backward()
    assert lin.weight.grad is not None and lin.weight.grad.abs().sum() > 0
