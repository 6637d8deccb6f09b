"""Draft head: it starts as "the next state is this one", round-trips through its file, learns the
model's own continuations, proposes a tree whose parents come first, and never changes what
speculation outputs (that is in test_speculative)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from diffuse.client import draft_head as D
from diffuse.client import draft_training as T
from diffuse.client.pipeline import LocalModel
from diffuse.client.speculative import Draft
from diffuse.errors import ModelError
from diffuse.model.load import load_head, load_span
from tiny import make_tiny


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> LocalModel:
    path = make_tiny(tmp_path_factory.mktemp("draft") / "t")
    return LocalModel(load_head(path), [load_span(path, 0, 4)])


def test_fresh_head_guesses_the_models_next_choice(tiny_model):
    """Untrained, the predicted state equals the input one, so every level guesses the tokens
    the model's LM head ranks first at the root's position."""
    draft = D.DraftHead(64, 96)
    h = torch.randn(64)
    guesses = draft.propose(tiny_model.head, h, root=7, depth=2, nodes=100, beam=2, top=3)
    first = tiny_model.head.logits(h).topk(3).indices.tolist()
    assert [g[0] for g, _ in guesses if len(g) == 1] == first
    assert {g[1] for g, _ in guesses if len(g) == 2} == set(first)
    assert len(guesses) == 3 + 2 * 3  # level 1: top 3; level 2: the 2 likeliest, 3 children each


def test_propose_is_parent_first_ranked_and_fits_a_draft(tiny_model):
    torch.manual_seed(1)
    draft = D.DraftHead(64, 96)
    for p in draft.parameters():
        torch.nn.init.normal_(p, std=0.2)
    guesses = draft.propose(tiny_model.head, torch.randn(64), root=3, depth=4, nodes=10)
    assert len(guesses) == 10
    seen = {()}
    for path, source in guesses:
        assert tuple(path[:-1]) in seen, "a guess came before its parent"
        seen.add(tuple(path))
        assert source in draft.priors()
    tree = Draft(root=3, max_nodes=64, max_depth=4)
    for path, source in guesses:
        tree.add(path, source)
    assert len(tree.tokens) == 11 and {k[0] for k in tree.kinds[1:]} <= set(draft.priors())


def test_expansion_stops_below_the_floor(tiny_model):
    """Every guess keeps a tenth of its parent's calibrated chance: with a floor of 0.05 the
    paths of chance 0.1 are still expanded, those of 0.01 are not."""
    draft = D.DraftHead(64, 96, calibration=torch.full((5,), 0.1))
    h = torch.randn(64)

    def deepest(floor: float) -> int:
        return max((len(g) for g, _ in draft.propose(tiny_model.head, h, 3, 4, floor=floor)), default=0)

    assert (deepest(0.0), deepest(0.05), deepest(0.2), deepest(2.0)) == (4, 2, 1, 0)


def test_file_round_trip_width_check_and_foreign_file(tmp_path):
    draft = D.DraftHead(64, 96, torch.tensor([1, 5, 9]), torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5]))
    torch.nn.init.normal_(draft.gate.weight)
    file = tmp_path / "m" / D.FILE
    D.save(draft, file, {"note": "test"})
    back = D.load(file, 64)
    assert back is not None and back.inter == 96
    assert torch.equal(back.gate.weight, draft.gate.weight) and back.vocab.tolist() == [1, 5, 9]
    assert back.priors()["draft4"] == pytest.approx(0.5)
    assert D.load(file, 128) is None  # another model's width: not used
    assert D.load(tmp_path / "absent" / D.FILE, 64) is None
    save_file({"x": torch.zeros(2)}, str(tmp_path / "foreign.safetensors"))
    with pytest.raises(ModelError, match="foreign.safetensors: not a usable draft-head file"):
        D.load(tmp_path / "foreign.safetensors", 64)
    (tmp_path / "torn.safetensors").write_bytes(file.read_bytes()[:100])
    with pytest.raises(ModelError, match="torn.safetensors: not a usable draft-head file"):
        D.load(tmp_path / "torn.safetensors", 64)


def test_training_learns_the_models_own_continuations(tiny_model):
    """Teacher-forced on random text, a trained head's held-out hit rates (the model's choice 1
    and 2 steps after the root) beat an untrained one's, and it keeps the calibration it measured."""
    g = torch.Generator().manual_seed(0)
    traces = []
    for _ in range(28):
        ids = torch.randint(0, 300, (96,), generator=g).tolist()
        z, choice = T._forward(tiny_model, ids)
        traces.append((z, torch.tensor(ids[1:] + [int(choice[-1])]), choice))
    fit, held = traces[4:], traces[:4]
    vocab = torch.unique(torch.cat([t[2] for t in traces]))
    torch.manual_seed(0)
    before = T.train(D.DraftHead(64, 96, vocab), tiny_model.head, fit, held, unroll=2, epochs=0)
    trained = D.DraftHead(64, 96, vocab)
    with torch.enable_grad():
        after = T.train(trained, tiny_model.head, fit, held, unroll=2, epochs=8, batch=64, lr=3e-3)
    assert after.hits[0] > before.hits[0] + 0.1 and after.hits[1] > before.hits[1] + 0.05, (before, after)
    assert after.chain[1] <= after.chain[0] == after.hits[0]
    assert trained.calibration.tolist() == pytest.approx(after.calibration)
    guesses = trained.propose(tiny_model.head, torch.randn(64), root=1, depth=3)
    assert all(set(path) <= set(vocab.tolist()) for path, _ in guesses)  # guesses come from the vocab


def test_text_traces_pair_each_position_with_the_token_after_it(tiny_model):
    class Tok:
        def encode_chat(self, messages):
            return [1, 2, 3]

        def encode(self, text):
            return [int(w) for w in text.split()]

    traces = T.examples(tiny_model, Tok(), [("q", " ".join(str(10 + i) for i in range(20)))], tokens=1000)
    z, nxt, choice = traces[0]
    assert len(z) == len(nxt) == len(choice) == 21  # from the prompt's last position on
    assert nxt[:-1].tolist() == list(range(10, 30))


def test_batched_self_distillation_decodes_each_row_as_alone(tiny_model):
    """Training answers are decoded 32 at a time: each row must be the greedy answer it would be
    alone, and the states must carry no autograd graph into training."""
    import trio

    ids = torch.tensor([[5, 17, 42, 99, 3, 250], [7, 8, 9, 10, 11, 12]])
    z, choice = trio.run(T._decode, tiny_model, ids, 8)
    assert z.shape == (2, 8, 64) and choice.shape == (2, 8)
    assert z.grad_fn is None and not z.requires_grad
    for b in range(2):
        zb, cb = trio.run(T._decode, tiny_model, ids[b:b + 1], 8)
        assert torch.equal(cb[0], choice[b])
        torch.testing.assert_close(zb[0], z[b], rtol=1e-4, atol=1e-4)


def test_answers_shorter_than_the_unroll_add_no_starting_point():
    """An answer of one or two tokens (a request the model declines at once) cannot start an
    unrolled run of three guesses; it is skipped, not an error (it once ended a 20-min build)."""
    trace = lambda n: (torch.zeros(n, 4), torch.arange(n), torch.arange(n))  # noqa: E731
    z, nxt, choice, starts = T._flatten([trace(2), trace(6), trace(1)], unroll=3)
    assert len(z) == len(nxt) == len(choice) == 9
    assert starts.tolist() == [2, 3, 4]


def test_retold_asks_to_retell_prose_answers_only():
    """Passages come from the model's prose answers of 60-140 words; code and short or long
    answers are skipped, and every request carries its whole passage."""
    class Tok:
        def decode(self, ids):
            return " ".join(f"w{i}" for i in ids)

    def answer(words, code=False):
        ids = torch.arange(words)
        return (torch.zeros(words, 4), ids, ids if not code else torch.full((words,), 7))

    class CodeTok(Tok):
        def decode(self, ids):
            return "```" if ids[0] == 7 else super().decode(ids)

    answers = [answer(30), answer(80), answer(200), answer(100), answer(90, code=True)]
    requests = T.retold(CodeTok(), answers, limit=10)
    assert len(requests) == 2
    assert {r.split("\n\n")[1] for r in requests} == {Tok().decode(range(80)), Tok().decode(range(100))}
    assert all(r.split("\n\n")[0] + "\n\n{}" in T.R.GROUND_FORMS for r in requests)
    assert len(T.retold(CodeTok(), answers, limit=1)) == 1


def test_training_requests_are_not_benchmark_prompts():
    """The head is judged on the benchmark's prompts: none of them, nor a rewording of one (most
    words shared, as "checks if a number is prime" with "checks whether a number is prime"), may
    be trained on."""
    from eval_speculative_identity import CLASSES

    def words(text):
        return set(text.lower().replace(".", " ").replace(",", " ").split())

    bench = [words(p) for prompts in CLASSES.values() for p in prompts]
    assert len(bench) >= 50
    for q in T.questions():
        w = words(q)
        assert all(len(w & b) / len(w | b) < 0.7 for b in bench), q


@pytest.mark.parametrize("argv", [["--unroll", "0"], ["--answers", "-1"], ["--answers", "0", "--text", "50"]])
def test_draft_head_cli_rejects_bad_arguments(tmp_path, capsys, argv):
    from diffuse.cli import main

    assert main(["--home", str(tmp_path), "model", "draft-head", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --unroll and --epochs must be >= 1") and "Traceback" not in err, err


def test_drafting_takes_the_thread_count_measured_cheaper_and_restores_the_callers(tiny_model, monkeypatch):
    """The configured count first, then one thread; afterwards the cheaper, timed on the calls
    themselves; whatever it took, the calling thread (the event loop's) keeps its own count."""
    from diffuse.data.scheduler import THREADS_ENV, Threads

    monkeypatch.delenv(THREADS_ENV, raising=False)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        draft = D.DraftHead(64, 96)
        draft.threads = Threads(most=2)
        used: list[int] = []
        inner = draft._propose

        def spy(*args):
            used.append(torch.get_num_threads())
            return inner(*args)

        monkeypatch.setattr(draft, "_propose", spy)
        for _ in range(3):
            draft.propose(tiny_model.head, torch.randn(64), root=3, depth=2)
            assert torch.get_num_threads() == 2
        assert used[:2] == [2, 1]
        cheaper = min((2, 1), key=lambda t: draft.threads.cost[(1, t)])
        assert used[2] == cheaper
    finally:
        torch.set_num_threads(before)
