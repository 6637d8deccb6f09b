"""Sampling and stop strings: the parts of generation that do not need a model."""

from __future__ import annotations

import pytest
import torch

from diffuse.client.generate import StopText
from diffuse.client.sampling import Sampler, SamplingParams


def test_greedy_takes_argmax():
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    assert Sampler(SamplingParams()).sample(logits) == 1


def drawn(sampler: Sampler, logits, n: int) -> list[int]:
    out = []
    for _ in range(n):
        out.append(sampler.sample(logits))
        sampler.take(logits, out[-1])
    return out


def test_seed_reproduces_and_top_k_restricts():
    logits = torch.randn(50)
    p = SamplingParams(temperature=1.0, top_k=3, seed=7)
    a = Sampler(p).sample(logits)
    s1, s2 = Sampler(p), Sampler(p)
    seq1, seq2 = drawn(s1, logits, 40), drawn(s2, logits, 40)
    assert seq1 == seq2 and a == seq1[0]
    assert set(seq1) <= set(logits.topk(3).indices.tolist())
    assert len(set(seq1)) > 1
    assert drawn(Sampler(SamplingParams(temperature=1.0, top_k=3, seed=8)), logits, 40) != seq1


def test_a_rewound_sampler_draws_the_same_tokens_again():
    """A generation rewound after a failed check redraws what it had drawn: the draw at each
    index depends on the seed and the index, not on how many draws came before."""
    logits = torch.randn(50)
    s = Sampler(SamplingParams(temperature=1.0, seed=3))
    first = drawn(s, logits, 10)
    s.rewind(4)
    assert drawn(s, logits, 6) == first[4:]


def test_seeded_draws_follow_the_distribution():
    logits = torch.tensor([1.0, 0.0, -1.0, 2.0])
    s = Sampler(SamplingParams(temperature=1.0, seed=11))
    n = 20000
    counts = torch.bincount(torch.tensor(drawn(s, logits, n)), minlength=4).double() / n
    assert (counts - logits.softmax(-1).double()).abs().max() < 0.015


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    probs = Sampler(SamplingParams(temperature=1.0, top_p=0.7)).probs(logits)
    assert probs[2] == 0 and probs[3] == 0
    assert torch.allclose(probs[:2], torch.tensor([0.625, 0.375]))


def test_repetition_penalty_demotes_seen_tokens():
    logits = torch.tensor([2.0, 1.9, -1.0])
    s = Sampler(SamplingParams(repetition_penalty=1.5))
    assert s.sample(logits, torch.tensor([0])) == 1
    assert s.adjust(logits, torch.tensor([2]))[2] == -1.5


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(top_k=-2),
                                 dict(max_tokens=0), dict(repetition_penalty=0)])
def test_bad_params_are_named(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)


def test_stop_text_cuts_at_stop_across_pieces():
    s = StopText(["\n\nUser:"])
    out = s.push("Hello") + s.push(" world\n") + s.push("\nUs")
    assert out == "Hello world" and not s.hit
    out += s.push("er: more")
    assert out == "Hello world" and s.hit


def test_stop_text_releases_false_alarm():
    s = StopText(["END"])
    assert s.push("the EN") == "the "
    assert s.push("D") == "" and s.hit
    t = StopText(["END"])
    assert t.push("EN") + t.push("gland") == "ENgland"
