"""Draft heads: they start as the identity, round-trip through their file, learn the model's own
continuations, and never change what speculation outputs."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from diffuse.client import draft_heads as D
from diffuse.client.pipeline import LocalModel
from diffuse.errors import ModelError
from diffuse.model.load import load_head, load_span
from tiny import make_tiny


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> LocalModel:
    path = make_tiny(tmp_path_factory.mktemp("heads") / "t")
    return LocalModel(load_head(path), [load_span(path, 0, 4)])


def test_fresh_heads_predict_the_next_token(tiny_model):
    heads = D.DraftHeads(64, 3)
    h = torch.randn(64)
    proposals = heads.propose(tiny_model.head, h, top=2)
    assert len(proposals) == 3 and all(len(p) == 2 for p in proposals)
    assert {tuple(p) for p in proposals} == {tuple(tiny_model.head.logits(h).topk(2).indices.tolist())}


def test_file_round_trip_width_check_and_foreign_file(tmp_path):
    heads = D.DraftHeads(64, 2)
    torch.nn.init.normal_(heads.proj[1].weight)
    file = tmp_path / "m" / D.FILE
    D.save(heads, file, {"note": "test"})
    back = D.load(file, 64)
    assert back is not None and back.k == 2
    assert torch.equal(back.proj[1].weight, heads.proj[1].weight)
    assert D.load(file, 128) is None  # another model's width: not used
    assert D.load(tmp_path / "absent" / D.FILE, 64) is None
    save_file({"x": torch.zeros(2)}, str(tmp_path / "foreign.safetensors"))
    with pytest.raises(ModelError, match="foreign.safetensors: not a usable draft-heads file"):
        D.load(tmp_path / "foreign.safetensors", 64)
    (tmp_path / "torn.safetensors").write_bytes(file.read_bytes()[:100])
    with pytest.raises(ModelError, match="torn.safetensors: not a usable draft-heads file"):
        D.load(tmp_path / "torn.safetensors", 64)


def test_training_learns_the_models_own_continuations(tiny_model):
    """Held-out top-1 accuracy of trained heads beats the untrained ones (which guess the next
    token again) on the tiny model's own greedy choices 2 and 3 positions ahead."""
    g = torch.Generator().manual_seed(0)
    zs, labels = [], []
    for _ in range(24):
        ids = torch.randint(0, 300, (96,), generator=g).tolist()
        z, choice = D._forward(tiny_model, ids)
        m = len(choice) - 2
        zs.append(z[:m])
        labels.append(torch.stack([choice[1:1 + m], choice[2:2 + m]], dim=1))
    z, labels = torch.cat(zs), torch.cat(labels)
    torch.manual_seed(0)
    untrained = D.DraftHeads(64, 2)
    before = D.train(untrained, tiny_model.head, z, labels, epochs=0)
    trained = D.DraftHeads(64, 2, torch.unique(labels))  # scoring only tokens the model chose
    with torch.enable_grad():
        after = D.train(trained, tiny_model.head, z, labels, epochs=8, batch=64, lr=3e-3)
    assert after[0] > before[0] + 0.05 and after[1] > before[1] + 0.05, (before, after)
    top = trained.propose(tiny_model.head, torch.randn(64), top=3)
    assert all(set(p) <= set(trained.vocab.tolist()) for p in top)  # guesses come from the vocab


def test_batched_self_distillation_decodes_each_row_as_alone(tiny_model):
    """Training answers are decoded 32 at a time: each row must be the greedy answer it would be
    alone, and the states must carry no autograd graph into training."""
    import trio

    ids = torch.tensor([[5, 17, 42, 99, 3, 250], [7, 8, 9, 10, 11, 12]])
    z, choice = trio.run(D._decode, tiny_model, ids, 8)
    assert z.shape == (2, 8, 64) and choice.shape == (2, 8)
    assert z.grad_fn is None and not z.requires_grad
    for b in range(2):
        zb, cb = trio.run(D._decode, tiny_model, ids[b:b + 1], 8)
        assert torch.equal(cb[0], choice[b])
        torch.testing.assert_close(zb[0], z[b], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("argv", [["--heads", "0"], ["--answers", "-1"], ["--answers", "0", "--text", "50"]])
def test_draft_heads_cli_rejects_bad_arguments(tmp_path, capsys, argv):
    from diffuse.cli import main

    assert main(["--home", str(tmp_path), "model", "draft-heads", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --heads and --epochs must be >= 1") and "Traceback" not in err, err
