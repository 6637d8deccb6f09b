"""The engine on the real embedded model, against transformers on the same converted weights."""

from __future__ import annotations

import pytest
import torch
import trio

from diffuse.client.generate import complete
from diffuse.client.local import open_local
from diffuse.client.sampling import SamplingParams
from diffuse.model.load import load_span
from diffuse.model.weights import ModelFiles
from tiny import Sync

pytestmark = pytest.mark.slow

PROMPTS = ["What is the capital of France?", "Write a Python function that reverses a string.",
           "Give me three tips for sleeping better."]


@pytest.fixture(scope="module")
def ours(home):
    return open_local(home, None, "fp32")


@pytest.fixture(scope="module")
def reference(smollm2):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()


def test_logits_match_transformers(ours, reference):
    model, tok = ours
    ids = torch.tensor([tok.encode_chat([{"role": "user", "content": PROMPTS[0]}])])
    with torch.no_grad():
        ref = reference(ids).logits
    got = Sync(model.session(ids.shape[1])).forward(ids)
    assert (got - ref).abs().max() < 1e-3


def test_greedy_answers_equal_transformers(ours, reference):
    model, tok = ours
    for prompt in PROMPTS:
        ids = tok.encode_chat([{"role": "user", "content": prompt}])
        with torch.no_grad():
            ref = reference.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False,
                                     eos_token_id=sorted(tok.eos_ids), pad_token_id=0)[0, len(ids):].tolist()
        ref = [t for t in ref if t not in tok.eos_ids]
        got = trio.run(complete, model.session(len(ids) + 64), tok, ids, SamplingParams(max_tokens=64))
        assert got.token_ids == ref, prompt


def test_paris(ours):
    model, tok = ours
    ids = tok.encode_chat([{"role": "user", "content": PROMPTS[0]}])
    got = trio.run(complete, model.session(len(ids) + 16), tok, ids, SamplingParams(max_tokens=16))
    assert got.text == "The capital of France is Paris." and got.finish_reason == "stop"


def test_partial_load_reads_only_its_blocks(smollm2, monkeypatch):
    read: list[str] = []
    original = ModelFiles.read

    def spy(self, names):
        read.extend(names)
        return original(self, names)

    monkeypatch.setattr(ModelFiles, "read", spy)
    span = load_span(smollm2, 10, 20)
    assert len(span.blocks) == 10
    blocks = {int(n.split(".")[2]) for n in read}
    assert blocks == set(range(10, 20))
    assert not any("embed" in n or "norm.weight" == n.split("model.")[-1] for n in read)
