"""The block engine against transformers, and the KV-cache operations speculation relies on."""

from __future__ import annotations

import pytest
import torch

from diffuse.client.pipeline import LocalModel
from diffuse.errors import ModelError
from diffuse.model.load import load_head, load_span
from tiny import Sync, load_reference, make_tiny


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request, tmp_path_factory):
    path = make_tiny(tmp_path_factory.mktemp(request.param) / request.param, request.param)
    return path, load_reference(path)


def ref_logits(ref, ids):
    with torch.no_grad():
        return ref(ids).logits


def whole(path, dtype=torch.float32):
    return LocalModel(load_head(path, dtype), [load_span(path, 0, 4, dtype)])


def test_prefill_logits_match_transformers(tiny):
    path, ref = tiny
    ids = torch.randint(0, 300, (2, 11))
    pipe = Sync(whole(path).session(32, batch=2))
    assert (pipe.forward(ids) - ref_logits(ref, ids)).abs().max() < 1e-4


def test_chained_slices_equal_whole_model(tiny):
    path, _ = tiny
    ids = torch.randint(0, 300, (1, 7))
    head = load_head(path)
    split = LocalModel(head, [load_span(path, 0, 1), load_span(path, 1, 3), load_span(path, 3, 4)])
    a = Sync(whole(path).session(16)).forward(ids)
    b = Sync(split.session(16)).forward(ids)
    assert torch.equal(a, b)


def test_cached_decode_equals_full_recompute(tiny):
    path, ref = tiny
    ids = torch.randint(0, 300, (1, 12))
    pipe = Sync(whole(path).session(32))
    steps = [pipe.forward(ids[:, :5])[:, -1]]
    for i in range(5, 12):
        steps.append(pipe.forward(ids[:, i:i + 1])[:, -1])
    full = ref_logits(ref, ids)[:, 4:]
    assert (torch.stack(steps, 1) - full).abs().max() < 1e-4
    assert pipe.length == 12


def tree():
    """Three candidate branches after a root token: r -> a -> b, r -> c, r -> a -> d.

    Layout [r, a, b, c, d]; depths 0,1,2,1,2; parents -, r, a, r, a.
    """
    parents = [-1, 0, 1, 0, 1]
    t = len(parents)
    mask = torch.zeros(t, t, dtype=torch.bool)
    for i in range(t):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    depth = mask.sum(1) - 1
    return mask, depth


def test_tree_verification_equals_separate_branches(tiny):
    path, _ = tiny
    model = whole(path)
    prefix = torch.randint(0, 300, (1, 6))
    cand = torch.randint(0, 300, (1, 5))  # r, a, b, c, d
    mask, depth = tree()
    pipe = Sync(model.session(32))
    pipe.forward(prefix)
    tree_logits = pipe.forward(cand, positions=6 + depth, tree_mask=mask, commit=False)
    for branch in ([0, 1, 2], [0, 3], [0, 1, 4]):
        ref = Sync(model.session(32))
        ref.forward(prefix)
        branch_logits = ref.forward(cand[:, branch])
        assert (tree_logits[:, branch] - branch_logits).abs().max() < 1e-5, branch


def test_rollback_leaves_no_trace(tiny):
    path, _ = tiny
    model = whole(path)
    prefix = torch.randint(0, 300, (1, 6))
    cand = torch.randint(0, 300, (1, 5))
    nxt = torch.randint(0, 300, (1, 3))
    mask, depth = tree()
    # Accept branch r -> c (tree indices 0, 3), then decode more tokens.
    pipe = Sync(model.session(32))
    pipe.forward(prefix)
    pipe.forward(cand, positions=6 + depth, tree_mask=mask, commit=False)
    pipe.commit([0, 3])
    after = pipe.forward(nxt)
    clean = Sync(model.session(32))
    clean.forward(prefix)
    clean.forward(cand[:, [0, 3]])
    assert (after - clean.forward(nxt)).abs().max() < 1e-5
    # Rolling back committed tokens equals never having seen them.
    pipe.rollback(6)
    again = pipe.forward(nxt)
    fresh = Sync(model.session(32))
    fresh.forward(prefix)
    assert (again - fresh.forward(nxt)).abs().max() < 1e-5


def test_pending_candidates_must_be_resolved(tiny):
    path, _ = tiny
    pipe = Sync(whole(path).session(16))
    pipe.forward(torch.tensor([[1, 2, 3]]), commit=False)
    with pytest.raises(ValueError, match="commit or roll back"):
        pipe.forward(torch.tensor([[4]]))
    with pytest.raises(ValueError, match="increasing"):
        pipe.stages[0].cache.commit([2, 0])


def test_cache_capacity_is_enforced(tiny):
    path, _ = tiny
    pipe = Sync(whole(path).session(4))
    with pytest.raises(ValueError, match="exceed"):
        pipe.forward(torch.tensor([[1, 2, 3, 4, 5]]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_tracks_fp32(tiny, dtype):
    path, ref = tiny
    ids = torch.randint(0, 300, (1, 9))
    low = Sync(whole(path, dtype).session(16)).forward(ids)
    assert low.dtype == torch.float32
    assert (low - ref_logits(ref, ids)).abs().max() < 0.1


def test_wipe_zeroes_cache(tiny):
    path, _ = tiny
    pipe = Sync(whole(path).session(8))
    pipe.forward(torch.tensor([[5, 6, 7]]))
    cache = pipe.stages[0].cache
    assert cache.k.abs().sum() > 0
    pipe.close()
    assert cache.k.abs().sum() == 0 and cache.v.abs().sum() == 0 and cache.length == 0


def test_altered_weights_fail_manifest_check(tmp_path):
    path = make_tiny(tmp_path / "m")
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.2.mlp.up_proj.weight"][0, 0] += 1.0
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    load_span(path, 0, 2)  # untouched blocks still load
    with pytest.raises(ModelError, match="block 2 .* does not match its manifest"):
        load_span(path, 2, 4)


def test_corrupt_and_missing_files_give_clear_errors(tmp_path):
    path = make_tiny(tmp_path / "m")
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelError, match="model.safetensors"):
        load_span(path, 0, 4, verify=False)
    (path / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(ModelError, match="not a valid safetensors"):
        load_span(path, 0, 4, verify=False)
    (path / "model.safetensors").unlink()
    with pytest.raises(ModelError, match="no \\*.safetensors"):
        load_span(path, 0, 4)
    with pytest.raises(ModelError, match="no config.json"):
        load_span(tmp_path / "nowhere", 0, 1)


def test_unsupported_architecture(tmp_path):
    import json

    path = make_tiny(tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(cfg | {"model_type": "gpt2"}))
    with pytest.raises(ModelError, match="unsupported architecture 'gpt2'"):
        load_span(path, 0, 1)
