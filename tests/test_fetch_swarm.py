"""New peers start from the swarm (`join --from-swarm`): real processes, one swarm for the module.

A sentinel, `src` holding and serving the whole model, and `bad`, a whole copy too, whose stored
block 3 is altered on disk once it serves (it computes with the blocks it loaded and checked;
its files server sends what the disk holds). In order: a peer fetching block 3 bans `bad` and
stores a block that hashes right (`--json`: the same in JSON lines); a second sentinel pinning
the manifest's hash is what a join (and `status` from an empty store) trusts, and one pinning
another hash makes it fail naming both; `--model auto` with `--blocks auto` fetches the span it
serves; beside a peer serving the int8 variant of two blocks, `--quant int8` fetches those as
the variant stores them, no source block; two peers with empty stores take complementary spans
and end with only their span on disk; `src`
and `bad` are SIGKILLed and the swarm's greedy answer, through the two new peers, equals the local
one (`bad` then comes back, its block 3 altered again), as is a client's that fetched
into an empty store what it holds (`ask --from-swarm`: with no trust plane its head and first
block, and `api --from-swarm` the same, answering through the `openai` client; with it, then the
rest); a peer whose source is SIGKILLed mid-transfer (its log shows the
cut range) finishes from another without fetching twice what it had; with no honest source left
for block 3, a join fails naming the block (an `error:` line, and `failed` in JSON).
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import signal
import subprocess
import time

import openai
import pytest

from support.procs import DIFFUSE, Procs
from support.swarm import LOCAL, QUICK_RECORDS, Swarm
from test_swarm import QUESTION, TOKENS, ask, reference_answer
from diffuse.home import DEFAULT_MODEL, models_dir
from diffuse.model import blockfiles
from diffuse.model.weights import ModelFiles, block_hash, load_manifest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]
JOIN = ["--throughput", "20", *QUICK_RECORDS]


@pytest.fixture(scope="module")
def swarm(home, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fetch")
    bad_home = tmp / "bad-home"
    shutil.copytree(models_dir(home) / DEFAULT_MODEL, models_dir(bad_home) / DEFAULT_MODEL)
    with Procs(home) as procs:
        s = Swarm(procs, tmp, {"src": "0:30"}, {"src": JOIN})
        s.spans["bad"], s.extra["bad"], s.bad_home = "0:30", JOIN, bad_home
        start_bad(s)
        s.homes = {}
        yield s


def start_bad(s: Swarm) -> None:
    """Start `bad` on its whole copy and, once it serves, alter its stored block 3."""
    s.procs.env, env = s.procs.env | {"DIFFUSE_HOME": str(s.bad_home)}, s.procs.env
    try:
        s.start("bad")
    finally:
        s.procs.env = env
    s.wait("bad")
    corrupt(models_dir(s.bad_home) / DEFAULT_MODEL, 3)


def corrupt(model_dir, block: int) -> None:
    """Flip a byte in every MiB of the block's stored tensors, in place (the size stays); again, to restore."""
    files = ModelFiles(model_dir)
    with open(model_dir / "model.safetensors", "r+b") as f:
        for part in blockfiles.segments(files, block):
            if not isinstance(part, bytes):
                _, offset, length = part
                for at in range(offset, offset + length, 1 << 20):
                    f.seek(at)
                    b = f.read(1)
                    f.seek(at)
                    f.write(bytes([b[0] ^ 0xFF]))


def join(swarm: Swarm, name: str, blocks: str, tmp, *extra: str, env_extra: dict | None = None) -> None:
    """Start `join --from-swarm --blocks BLOCKS` on an empty store of its own."""
    home = swarm.homes[name] = tmp / f"{name}-home"
    env = swarm.procs.env
    swarm.procs.env = env | {"DIFFUSE_HOME": str(home)} | (env_extra or {})
    try:
        swarm.proc[name] = swarm.procs.start("join", "--identity", str(swarm.tmp / f"{name}.key"), "--bootstrap",
                                             swarm.boot, "--listen", LOCAL, "--from-swarm", "--blocks", blocks, *JOIN,
                                             *extra)
    finally:
        swarm.procs.env = env


def on_disk(swarm: Swarm, name: str) -> dict[str, int]:
    return on_disk_of(swarm.homes[name])


def on_disk_of(home) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in (models_dir(home) / DEFAULT_MODEL).glob("*.safetensors")}


def fetched(swarm: Swarm, name: str) -> tuple[float, dict[str, float]]:
    return summary("\n".join(swarm.proc[name].stderr))


def summary(err: str) -> tuple[float, dict[str, float]]:
    """MiB fetched in all, and per source, as the summary line says."""
    line = next(x for x in err.splitlines() if "in the store" in x)
    total = float(re.search(r"\(([\d.]+) MiB fetched", line).group(1))
    return total, {p: float(n) for p, n in re.findall(r"(\w+): ([\d.]+) MiB", line.split(" from ", 1)[-1])}


def failed_with(swarm: Swarm, name: str) -> str:
    """The error a join that fails says (`error: ...`, not a traceback), once it has exited."""
    assert swarm.proc[name].wait(timeout=300) != 0
    deadline = time.monotonic() + 10  # its stderr, read to the end
    while not any(x.startswith("error: ") for x in swarm.proc[name].stderr) and time.monotonic() < deadline:
        time.sleep(0.05)
    err = "\n".join(swarm.proc[name].stderr)
    return next(x for x in err.splitlines() if x.startswith("error: ")).removeprefix("error: ")


def until_said(swarm: Swarm, name: str, text: str, timeout: float = 120) -> None:
    """Wait until the peer's stderr has a line starting with `text`."""
    deadline = time.monotonic() + timeout
    while not any(x.startswith(text) for x in swarm.proc[name].stderr):
        assert time.monotonic() < deadline and swarm.proc[name].p.poll() is None, swarm.proc[name].stderr
        time.sleep(0.05)


def json_lines(err: str) -> list[dict]:
    return [json.loads(x) for x in err.splitlines() if x.startswith('{"event"')]


def test_a_source_of_wrong_bytes_is_banned_and_the_block_comes_from_another(swarm, home, tmp_path):
    join(swarm, "c", "3:4", tmp_path, "--json")
    swarm.wait("c")
    err = "\n".join(swarm.proc["c"].stderr)
    assert f"banned {swarm.ids['bad']}" in err, err
    events = json_lines(err)  # --json: the same story in JSON lines
    assert [e["event"] for e in events][0] == "manifest" and events[-1]["event"] == "done", err
    assert events[0]["manifest_sha256"] == hashlib.sha256((models_dir(home) / DEFAULT_MODEL / "manifest.json")
                                                          .read_bytes()).hexdigest()
    assert swarm.ids["bad"] in events[-1]["banned"] and events[-1]["blocks"] == [3], events[-1]
    progress = [e for e in events if e["event"] == "progress"]
    assert progress and progress[-1]["fetched_bytes"] >= progress[-1]["of_bytes"], progress  # bytes fetched again too
    model_dir = models_dir(swarm.homes["c"]) / DEFAULT_MODEL
    assert list(on_disk(swarm, "c")) == ["block-00003.safetensors"]
    assert block_hash(ModelFiles(model_dir).read_block(3)) == load_manifest(model_dir).block_hashes[3]


def pinning_sentinel(swarm: Swarm, name: str, model: str, sha: str):
    """A second sentinel of the swarm that pins `sha` for `model`: its process and address."""
    proc = swarm.procs.start("sentinel", "--identity", str(swarm.tmp / f"{name}.key"), "--listen", LOCAL,
                             "--bootstrap", swarm.boot, "--model-hash", f"{model}={sha}")
    return proc, proc.readline(timeout=120)


def test_a_private_swarm_trusts_the_manifest_its_sentinel_pins_and_refuses_announcers_that_disagree(swarm, home,
                                                                                                     tmp_path):
    """The join bootstraps from both sentinels; the pinning one's hash is what it trusts: the right
    one, and the join says so; a wrong one, and the join fails naming both hashes."""
    model_dir = models_dir(home) / DEFAULT_MODEL
    right, wrong = hashlib.sha256((model_dir / "manifest.json").read_bytes()).hexdigest(), "e" * 64
    model = load_manifest(model_dir).model_id
    for name, sha in {"p": right, "q": wrong}.items():
        sentinel, addr = pinning_sentinel(swarm, f"pin-{name}", model, sha)
        try:
            join(swarm, name, "4:5", tmp_path / name, "--bootstrap", addr, "--json")
            status = subprocess.run([*DIFFUSE, "status", "--bootstrap", swarm.boot, "--bootstrap", addr, "--json",
                                     "--no-reach"], capture_output=True, text=True, timeout=300,
                                    env=swarm.procs.env | {"DIFFUSE_HOME": str(tmp_path / name / "status-home")})
            shown = json.loads(status.stdout)  # no weights here: the manifest the pin names, as a join trusts
            if sha == right:
                assert [m["model"] for m in shown["models"]] == [model] and not shown.get("refused"), shown
            else:
                assert shown["models"] == [] and all(x in shown["refused"][model] for x in (wrong, right)), shown
            if sha == right:
                swarm.wait(name)
                manifest = json_lines("\n".join(swarm.proc[name].stderr))[0]
                assert manifest["manifest_sha256"] == right and addr.rsplit("/", 1)[-1] in manifest["trusted_by"]
                assert list(on_disk(swarm, name)) == ["block-00004.safetensors"]
                swarm.kill(name)
            else:
                error = failed_with(swarm, name)
                assert wrong in error and right in error and "sentinel pin" in error, error
                assert not on_disk(swarm, name)
        finally:
            sentinel.signal(signal.SIGKILL)
            sentinel.wait(timeout=10)


def test_model_auto_and_blocks_auto_fetch_the_span_they_then_serve(swarm, tmp_path):
    join(swarm, "g", "auto", tmp_path, "--model", "auto", "--num-blocks", "2")
    serving = swarm.proc["g"].read_until("serving", timeout=180)[-1]
    start, end = map(int, re.search(r"serving \S+ blocks (\d+):(\d+)", serving).groups())
    assert end - start == 2 and set(on_disk(swarm, "g")) == {f"block-{i:05d}.safetensors" for i in range(start, end)}
    swarm.kill("g")


def test_a_variant_is_fetched_as_its_peers_store_it_and_no_source_block(swarm, home, tmp_path):
    """Beside a peer serving the int8 variant of blocks 3-4, `join --from-swarm --quant int8`
    ends with those two blocks of the variant (its manifest naming the source's model hash), no
    block of the source, and serves them."""
    swarm.spans["q8"], swarm.extra["q8"] = "3:5", [*JOIN, "--quant", "int8"]
    swarm.start("q8")
    swarm.wait("q8")
    try:
        join(swarm, "v", "3:5", tmp_path, "--quant", "int8")
        swarm.wait("v")
        fetched_dir = models_dir(swarm.homes["v"]) / f"{DEFAULT_MODEL}@int8"
        assert not on_disk(swarm, "v")  # the source's directory: manifest and files, no block
        assert sorted(p.name for p in fetched_dir.glob("*.safetensors")) == ["block-00003.safetensors",
                                                                             "block-00004.safetensors"]
        manifest = load_manifest(fetched_dir)
        source, variant = (load_manifest(models_dir(home) / f"{DEFAULT_MODEL}{x}") for x in ("", "@int8"))
        assert manifest.quant == "int8" and manifest.source == source.model_hash
        assert manifest.block_hashes == variant.block_hashes
        total, by_peer = fetched(swarm, "v")
        assert total * 2**20 <= sum(manifest.block_sizes[3:5]) + sum(n for n, _ in manifest.files.values()) + 2**20
        assert by_peer.get(swarm.ids["q8"], 0) > 0, by_peer
    finally:
        for name in ("v", "q8"):
            if name in swarm.proc:
                swarm.kill(name)


def test_complementary_spans_fetch_only_their_blocks_and_answer_as_local(swarm, home, tmp_path):
    slow = {"DIFFUSE_FILES_SEND_RATE": str(4 << 20)}  # b sends at 4 MiB/s: killed later, mid-range
    for name, span in {"a": "0:15", "b": "15:30"}.items():
        join(swarm, name, span, tmp_path, env_extra=slow if name == "b" else None)
    for name in ("a", "b"):
        swarm.wait(name)
    manifest = load_manifest(models_dir(home) / DEFAULT_MODEL)
    for name, (lo, hi) in {"a": (0, 15), "b": (15, 30)}.items():
        disk = on_disk(swarm, name)
        assert sorted(disk) == [f"block-{i:05d}.safetensors" for i in range(lo, hi)]
        for i in range(lo, hi):  # the canonical bytes less each tensor's 3 header fields, plus safetensors' header
            assert manifest.block_sizes[i] - 4096 < disk[f"block-{i:05d}.safetensors"] < manifest.block_sizes[i] + 4096
    swarm.kill("src")
    swarm.kill("bad")  # else the whole answer might come from it
    answer = ask(swarm.procs, swarm.boot)
    assert answer["token_ids"] == reference_answer(home)
    assert {h["peer"] for h in answer["route"]} == {swarm.ids["a"], swarm.ids["b"]}, answer["route"]
    corrupt(models_dir(swarm.bad_home) / DEFAULT_MODEL, 3)  # restored, so that it loads: a source again
    start_bad(swarm)


def client_ask(swarm: Swarm, home, *extra: str) -> tuple[dict, str]:
    """`ask --from-swarm` in `home`: its answer and stderr."""
    out = subprocess.run([*DIFFUSE, "--client-only", "ask", "--bootstrap", swarm.boot, "--json", "--max-tokens",
                          str(TOKENS), "--wait", "30", "--no-speculate", "--from-swarm", *extra, QUESTION],
                         capture_output=True, text=True, timeout=300, env=swarm.procs.env | {"DIFFUSE_HOME": str(home)})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout), out.stderr


def test_a_client_with_an_empty_store_fetches_what_it_holds_and_answers_as_local(swarm, home, tmp_path):
    """Without a trust plane a client holds the head and its local blocks; with one (the default)
    it judges peers by recomputing their blocks, so it then fetches the rest, and only the rest."""
    empty, reference = tmp_path / "client-home", reference_answer(home)
    answer, err = client_ask(swarm, empty, "--trust", "off")
    assert answer["token_ids"] == reference
    progress = [e for e in json_lines(err) if e["event"] == "progress"]  # --json: as JSON
    assert progress and all(p.keys() == {"event", "fetched_bytes", "of_bytes", "bytes_per_s", "eta_s"}
                            for p in progress), err
    assert set(on_disk_of(empty)) == {"head.safetensors", "block-00000.safetensors"}  # --local-blocks 1,0
    api_home = tmp_path / "api-home"  # `api --from-swarm`: the same fetch, then one answer through `openai`
    api = swarm.procs.start("--client-only", "api", "--bootstrap", swarm.boot, "--listen", "127.0.0.1:0",
                            "--from-swarm", "--trust", "off", "--wait", "30", "--no-speculate",
                            env={"DIFFUSE_HOME": str(api_home)})
    try:
        url = api.read_until("listening on", timeout=300)[-1].split()[-1]
        chat = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300).chat.completions.create(
            model=DEFAULT_MODEL, messages=[{"role": "user", "content": QUESTION}], temperature=0, max_tokens=TOKENS)
        assert chat.choices[0].message.content == answer["text"] and chat.usage.completion_tokens == TOKENS
        assert set(on_disk_of(api_home)) == {"head.safetensors", "block-00000.safetensors"}
    finally:
        api.signal(signal.SIGKILL)
        api.wait(timeout=30)
    answer, err = client_ask(swarm, empty)
    assert answer["token_ids"] == reference and len(on_disk_of(empty)) == 31
    manifest = load_manifest(models_dir(home) / DEFAULT_MODEL)
    total, _ = summary(err)
    # Blocks 1-29, not the head again (larger than what finding `bad` out can cost: a block or two).
    rest = sum(manifest.block_sizes[1:])
    assert rest - 2**20 < total * 2**20 < rest + manifest.head_size, err


def test_a_source_killed_mid_transfer_is_resumed_from_another(swarm, home, tmp_path):
    join(swarm, "e", "15:30", tmp_path)  # from b and bad (src is gone)
    until_said(swarm, "e", "fetched ")
    swarm.kill("b")
    swarm.wait("e")
    manifest = load_manifest(models_dir(home) / DEFAULT_MODEL)
    want = sum(manifest.block_sizes[15:30]) + sum(n for n, _ in manifest.files.values()) + 4096
    total, by_peer = fetched(swarm, "e")
    assert total * 2**20 <= want + 2**20, (total, want)  # nothing fetched twice
    err = "\n".join(swarm.proc["e"].stderr)
    cut = [(int(x), int(y)) for x, y in re.findall(rf"peer {swarm.ids['b']} (?:ended the transfer after |sent nothing "
                                                   r"for \S+ s \()(\d+) of (\d+) bytes", err)]
    assert cut and any(0 < x < y for x, y in cut), err  # killed mid-range: the rest came from bad
    assert by_peer.get(swarm.ids["b"], 0) > 0 and by_peer.get(swarm.ids["bad"], 0) > 0, by_peer


def test_with_no_honest_source_the_join_fails_naming_the_block(swarm, tmp_path):
    for name in ("a", "c"):
        swarm.kill(name)
    join(swarm, "d", "3:4", tmp_path, "--json")
    error = failed_with(swarm, "d")
    assert "block 3 of" in error and swarm.ids["bad"] in error, error
    err = "\n".join(swarm.proc["d"].stderr)
    assert json_lines(err)[-1] == {"event": "failed", "error": error}, err
    assert not on_disk(swarm, "d")
