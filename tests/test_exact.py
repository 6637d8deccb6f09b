"""Exact sessions: a position's output bits do not depend on what else shares its step.

Speculation computes a position inside a tree of guesses that plain decoding computes alone, and
a failover replays history in one chunk. Only if every kernel is batch-invariant do the three
give the same bits, so that greedy speculation provably returns the plain greedy answer.
These tests check the property on this machine's BLAS, where it is an empirical fact.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from diffuse.client.pipeline import LocalModel
from diffuse.model import kernels
from diffuse.model.kernels import exact_attention, exact_linear
from diffuse.model.load import load_head, load_span
from diffuse.trust.canary import forward_as_sent
from tiny import FAMILIES, Sync, make_tiny


@pytest.fixture
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("shape", [(200, 96), (960, 576)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_linear_rows_ignore_their_neighbours(threads, shape, dtype):
    g = torch.Generator().manual_seed(shape[0])
    w = torch.randn(*shape, generator=g).to(dtype)
    x = torch.randn(70, shape[1], generator=g).to(dtype)
    alone = torch.cat([exact_linear(x[i:i + 1], w) for i in range(12)])
    for rows in range(1, 70):
        k = min(rows, 12)
        assert torch.equal(exact_linear(x[:rows], w)[:k], alone[:k]), rows
    # a row's place in the batch does not matter either
    assert torch.equal(exact_linear(torch.cat([x[20:25], x[:3]]), w)[5:], alone[:3])


def test_exact_linear_computes_f_linear():
    g = torch.Generator().manual_seed(1)
    x, w, b = torch.randn(2, 3, 64, generator=g), torch.randn(50, 64, generator=g), torch.randn(50, generator=g)
    out = exact_linear(x, w, b)
    assert out.shape == (2, 3, 50)
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    xb, wb = x.bfloat16(), w.bfloat16()
    assert exact_linear(xb, wb).dtype == torch.bfloat16
    torch.testing.assert_close(exact_linear(xb, wb).float(), F.linear(xb.float(), wb.float()), rtol=1e-2, atol=1e-2)


def test_exact_attention_sees_only_a_rows_keys_and_computes_sdpa(monkeypatch):
    """Each query row, computed among others with a tree mask, has the bits it has computed alone
    against exactly the keys it may see, in order (what plain decoding does)."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 4, 6, 16, generator=g)
    k, v = torch.randn(1, 2, 10, 16, generator=g), torch.randn(1, 2, 10, 16, generator=g)
    mask = torch.rand(6, 10, generator=g) < 0.6
    mask[:, 0] = True
    out = exact_attention(q, k, v, mask)
    for i in range(6):
        keys = mask[i].nonzero().flatten()
        alone = exact_attention(q[:, :, i:i + 1], k[:, :, keys], v[:, :, keys], None)
        assert torch.equal(out[:, :, i:i + 1], alone), i
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(kernels, "EXACT_QUERY_BLOCK", 4)  # a long prefill goes in blocks of rows
    assert torch.equal(exact_attention(q, k, v, mask), out)


@pytest.fixture(scope="module", params=list(FAMILIES))
def tiny(request, tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("exact") / request.param, request.param, layers=3)


def _chain_with_decoys(ids: list[int], decoy: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A verification tree: the chain `ids`, each node followed by a wrong sibling leaf."""
    n = len(ids)
    tree = torch.tensor([t for i in ids for t in (i, decoy)])
    mask = torch.zeros(2 * n, 2 * n, dtype=torch.bool)
    for r in range(2 * n):
        mask[r, r] = True
        mask[r, [2 * j for j in range(r // 2)]] = True
    return tree, mask


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plain_tree_and_replay_give_the_same_bits(tiny, threads, dtype):
    """One token per step, trees of guesses with wrong siblings, and a one-chunk replay: the same
    logits and the same KV cache, bit for bit, in an exact session, for every family (40 tokens:
    past the sliding window; experts routed among other rows)."""
    model = LocalModel(load_head(tiny, dtype), [load_span(tiny, 0, 1, dtype), load_span(tiny, 1, 3, dtype)])
    ids = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(3))
    prompt = 9

    plain = Sync(model.session(64, exact=True))
    plain.forward(ids[None, :prompt])
    want = torch.cat([plain.forward(ids[None, p:p + 1])[0] for p in range(prompt, 40)])

    tree = Sync(model.session(64, exact=True))
    tree.forward(ids[None, :prompt])
    got, p = [], prompt
    for n in (1, 5, 2, 8, 3, 6, 4, 2):  # 31 tokens in trees of 2-16 rows
        nodes, mask = _chain_with_decoys(ids[p:p + n].tolist(), decoy=int(ids[0]))
        positions = torch.arange(p, p + n).repeat_interleave(2)
        logits = tree.forward(nodes[None], positions, mask, commit=False)
        tree.commit(list(range(0, 2 * n, 2)))
        got.append(logits[0, 0::2])
        p += n
    assert p == 40
    assert torch.equal(torch.cat(got), want)

    replay = Sync(model.session(64, exact=True))
    assert torch.equal(replay.forward(ids[None])[0, prompt:], want)
    for a, b, c in zip(plain.stages, tree.stages, replay.stages):
        assert a.cache.length == b.cache.length == c.cache.length == 40
        for kv in ("k", "v"):
            ref = getattr(a.cache, kv)[..., :40, :]
            assert torch.equal(getattr(b.cache, kv)[..., :40, :], ref)
            assert torch.equal(getattr(c.cache, kv)[..., :40, :], ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_canaries_stepped_together_have_the_bits_of_each_alone(tiny, dtype):
    """An exact client's calibration computes its canaries' honest outputs together where a peer
    steps each alone: the same bits, every family (what lets it skip a pass per canary)."""
    span = load_span(tiny, 1, 3, dtype)
    hidden = torch.randn(6, 10, span.cfg.hidden_size, generator=torch.Generator().manual_seed(5))
    alone = torch.cat([forward_as_sent(span, hidden[i:i + 1], False, exact=True) for i in range(6)])
    assert torch.equal(forward_as_sent(span, hidden, True, exact=True), alone)
    assert torch.equal(forward_as_sent(span, hidden, False, exact=True), alone)
