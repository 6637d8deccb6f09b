"""`diffuse api --bootstrap` against a real loopback swarm, through the official `openai` client.

One swarm for the whole module (2 cores): a sentinel, three peers holding every block twice
(0:30, 0:15, 15:30; each with --metrics), a fourth peer serving only blocks 1:15 of a second
model id (a hard-linked copy of the same weights) so that model is known but not servable, and
one `diffuse api` process offering both models. Its status page is rendered in Chromium. A second
API, at the defaults (trust plane and speculation on), answers once on the same swarm.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest
import trio
import trio.testing

from support.procs import Procs
from support.swarm import LOCAL, QUICK_RECORDS
from diffuse.control.host import parse_peer_addr
from diffuse.home import DEFAULT_MODEL, models_dir
from browser import ARTIFACTS, render
from test_status_page import REFRESHED, Elements

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
KEY = "sk-diffuse-swarm-test"
PARTIAL = "smollm2-partial"
ASK = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8,"
SPANS = {"A": "0:30", "B": "0:15", "C": "15:30"}


def _store(home: Path, dst: Path) -> Path:
    """A store with the default model and PARTIAL: the same files under another model id."""
    src = models_dir(home) / DEFAULT_MODEL
    for name, model_id in ((DEFAULT_MODEL, DEFAULT_MODEL), (PARTIAL, PARTIAL)):
        d = models_dir(dst) / name
        d.mkdir(parents=True)
        for f in src.iterdir():
            if f.name != "manifest.json":
                os.link(f, d / f.name)
        manifest = json.loads((src / "manifest.json").read_text()) | {"model_id": model_id}
        (d / "manifest.json").write_text(json.dumps(manifest))
    return dst


def _metrics_url(proc, timeout: float = 30.0) -> str:
    """The /metrics URL a peer logged on stderr (read by a thread: poll briefly)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in list(proc.stderr):
            if line.startswith("metrics at "):
                return line.split()[-1]
        time.sleep(0.1)
    raise TimeoutError("the peer never logged its metrics address:\n" + "\n".join(proc.stderr))


class Swarm:
    def __init__(self, procs: Procs, tmp: Path):
        self.procs = procs
        sentinel = procs.start("sentinel", "--identity", str(tmp / "sentinel.key"), "--listen", LOCAL)
        self.boot = sentinel.readline(timeout=120)
        common = ["--bootstrap", self.boot, "--listen", LOCAL, *QUICK_RECORDS]
        self.peers = {name: procs.start("join", "--identity", str(tmp / f"{name}.key"), "--blocks", span,
                                        "--metrics", "127.0.0.1:0", *common)
                      for name, span in SPANS.items()}
        self.partial = procs.start("join", "--identity", str(tmp / "D.key"), "--model", PARTIAL, "--blocks", "1:15",
                                   *common)
        self.ids, self.metrics = {}, {}
        for name, proc in self.peers.items():
            lines = proc.read_until("serving", timeout=300)
            self.ids[name] = parse_peer_addr(lines[0]).peer_id.to_base58()
            self.metrics[name] = _metrics_url(proc)
        self.partial.read_until("serving", timeout=300)
        self.api_proc = procs.start("api", "--bootstrap", self.boot, "--listen", "127.0.0.1:0",
                                    "--model", DEFAULT_MODEL,
                                    "--model", PARTIAL, "--api-key", KEY, "--max-sessions", "3", "--max-tokens", "32",
                                    "--wait", "5",  # PARTIAL is never covered: it would wait all of it
                                    "--no-trust",  # the trust plane has its own swarm tests
                                    "--no-speculate")  # answers compared with each other: no near-tie may flip
        self.api = self.api_proc.read_until("listening on", timeout=300)[-1].split()[-1]
        deadline = time.monotonic() + 120  # the default model's coverage, seen by the API
        while not self.servable(DEFAULT_MODEL):
            assert time.monotonic() < deadline, "the API never found the default model covered"
            time.sleep(0.5)

    def servable(self, model: str) -> bool:
        listed = httpx.get(f"{self.api}/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).json()
        return any(m["id"] == model and m["servable"] for m in listed["data"])


@pytest.fixture(scope="module")
def swarm(home, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("api_swarm")
    with Procs(_store(home, tmp / "home")) as procs:
        yield Swarm(procs, tmp)


@pytest.fixture
def client(swarm):
    return openai.OpenAI(base_url=swarm.api + "/v1", api_key=KEY, max_retries=0, timeout=300)


def scrape(url: str) -> dict[str, float]:
    """A /metrics page as {'name{labels}': value}."""
    text = httpx.get(url, timeout=30).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(\S+) (\S+)$", text, re.M)}


def test_models_lists_every_model_and_whether_it_is_servable_now(client, swarm):
    models = client.models.list().data
    assert {m.id: m.model_extra["servable"] for m in models} == {DEFAULT_MODEL: True, PARTIAL: False}
    cov = next(m for m in models if m.id == DEFAULT_MODEL).model_extra["coverage"]
    assert cov["servable"] and cov["missing"] == [] and cov["num_blocks"] == 30
    assert {p["peer_id"] for p in cov["peers"]} == set(swarm.ids.values()) | {"local"}
    assert [b["replicas"] for b in cov["blocks"]] == [3] + [2] * 29  # block 0 also runs in the API


def test_chat_streamed_equals_whole_under_greedy(client):
    whole = client.chat.completions.create(model=DEFAULT_MODEL, messages=ASK, temperature=0, max_tokens=16)
    chunks = list(client.chat.completions.create(model=DEFAULT_MODEL, messages=ASK, temperature=0, max_tokens=16,
                                                 stream=True, stream_options={"include_usage": True}))
    answer = whole.choices[0].message.content
    assert "Paris" in answer
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens > 0


def test_completions(client):
    whole = client.completions.create(model=DEFAULT_MODEL, prompt=COUNTING, temperature=0, max_tokens=8)
    assert whole.choices[0].text.startswith(" 9, 10") and whole.usage.completion_tokens == 8
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=DEFAULT_MODEL, prompt=COUNTING, temperature=0, max_tokens=8, stream=True))
    assert streamed == whole.choices[0].text


def test_structured_output_and_logprobs_through_the_swarm(client):
    """The constraint and the log-probabilities run where the LM head is, in the API: through
    peers as in process, with nothing new on the wire."""
    schema = {"type": "object", "properties": {"country": {"type": "string", "maxLength": 20},
                                               "capital": {"type": "string", "maxLength": 20}},
              "required": ["country", "capital"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "capital", "schema": schema, "strict": True}}
    r = client.chat.completions.create(model=DEFAULT_MODEL, messages=ASK, temperature=0, max_tokens=32,
                                       response_format=fmt, logprobs=True, top_logprobs=3)
    choice = r.choices[0]
    value = json.loads(choice.message.content)
    assert choice.finish_reason == "stop" and set(value) == {"country", "capital"}
    assert all(isinstance(v, str) and len(v) <= 20 for v in value.values())
    content = choice.logprobs.content
    assert "".join(e.token for e in content) == choice.message.content
    assert all(e.logprob <= 0 and len(e.top_logprobs) == 3 for e in content)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=DEFAULT_MODEL, messages=ASK, response_format={
            "type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "strin"}}})
    assert e.value.body["param"] == "response_format"


def test_bad_request_and_wrong_key(client, swarm):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=DEFAULT_MODEL, messages=ASK, temperature=5)
    assert e.value.status_code == 400 and e.value.body["param"] == "temperature"
    bad = openai.OpenAI(base_url=swarm.api + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.chat.completions.create(model=DEFAULT_MODEL, messages=ASK)
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"


def test_an_unservable_model_is_answered_by_the_fallback_which_says_so(client, swarm):
    """PARTIAL lacks blocks 15-29: the default model answers (the API's default fallback), named
    in `model`, in the headers and in /metrics. (Refusing with a 503 that names the blocks, as
    `--fallback none` does: test_api.py.)"""
    fallbacks = f'diffuse_fallbacks_total{{answered="{DEFAULT_MODEL}",asked="{PARTIAL}"}}'
    before = scrape(swarm.api + "/metrics").get(fallbacks, 0.0)
    raw = client.chat.completions.with_raw_response.create(model=PARTIAL, messages=ASK, max_tokens=8, temperature=0)
    answer = raw.parse()
    assert answer.model == DEFAULT_MODEL and answer.choices[0].message.content
    assert raw.headers["x-diffuse-model"] == DEFAULT_MODEL and raw.headers["x-diffuse-asked-model"] == PARTIAL
    assert scrape(swarm.api + "/metrics")[fallbacks] == before + 1
    streamed = list(client.completions.create(model=PARTIAL, prompt=COUNTING, max_tokens=4, temperature=0,
                                              stream=True))
    assert {c.model for c in streamed} == {DEFAULT_MODEL}
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=ASK)


def test_more_sessions_than_allowed_is_429(client):
    with pytest.raises(openai.RateLimitError) as e:  # n=4 choices need 4 sessions; the API allows 3
        client.completions.create(model=DEFAULT_MODEL, prompt=COUNTING, max_tokens=4, n=4, temperature=1)
    assert e.value.status_code == 429


def _server_sessions(swarm) -> float:
    return sum(scrape(url)['diffuse_sessions_open{role="server"}'] for url in swarm.metrics.values())


def _hang_up_after(swarm, chunks: int, at_once: bool) -> None:
    """Stream a long answer, hang up after `chunks` events (at once, or after checking that the
    peers hold sessions), and wait (bounded) for the peers to drop every session."""
    body = {"model": DEFAULT_MODEL, "prompt": COUNTING, "max_tokens": 2000, "temperature": 0, "stream": True}
    with httpx.Client(timeout=300) as http:
        with http.stream("POST", swarm.api + "/v1/completions", json=body,
                         headers={"Authorization": f"Bearer {KEY}"}) as r:
            assert r.status_code == 200
            lines, seen = r.iter_lines(), 0  # held: dropping the iterator would hang up at once
            for line in lines:
                seen += line.startswith("data: {")
                if seen == chunks:
                    break
            assert at_once or _server_sessions(swarm) >= 1
    deadline = time.monotonic() + 60  # bounded wait; the outcome is asserted, not the time
    while _server_sessions(swarm) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _server_sessions(swarm) == 0, f"peers kept the sessions of a client that hung up after {chunks} tokens"


def test_hanging_up_closes_swarm_sessions_and_counters_move(swarm):
    """A stream the client drops mid-answer frees its sessions on the peers at once, wherever in
    a step the hang-up lands (a write it cancels must not desync the connection: whole_writes);
    the peers' and the API's counters show the traffic."""
    before = {name: scrape(url) for name, url in swarm.metrics.items()}
    api_before = scrape(swarm.api + "/metrics")
    for chunks in (1, 2, 3, 4):
        _hang_up_after(swarm, chunks, at_once=True)  # while the API computes the next step
    _hang_up_after(swarm, 5, at_once=False)
    assert httpx.get(swarm.api + "/status.json", timeout=30).json()["api"]["sessions_open"] == 0

    after = {name: scrape(url) for name, url in swarm.metrics.items()}
    model = f'{{model="{DEFAULT_MODEL}"}}'
    served = [n for n in after if after[n][f"diffuse_tokens_served_total{model}"]
              > before[n].get(f"diffuse_tokens_served_total{model}", 0)]
    assert served, "no peer counted the tokens it served"
    for n in served:
        a, b = after[n], before[n]  # a series a fresh peer never observed is not on its page yet
        assert a[f"diffuse_steps_served_total{model}"] >= b.get(f"diffuse_steps_served_total{model}", 0) + 5
        assert a['diffuse_step_seconds_count{role="server"}'] >= b.get('diffuse_step_seconds_count{role="server"}',
                                                                       0) + 5
        for direction in ("sent", "received"):
            key = f'diffuse_wire_bytes_total{{direction="{direction}"}}'
            assert a[key] > b.get(key, 0) + 5 * 1152  # at least five fp16 hidden states of 576 values
    api = scrape(swarm.api + "/metrics")
    assert api[f"diffuse_tokens_generated_total{model}"] >= api_before.get(f"diffuse_tokens_generated_total{model}",
                                                                           0) + 5
    assert api['diffuse_wire_bytes_total{direction="sent"}'] > api_before.get(
        'diffuse_wire_bytes_total{direction="sent"}', 0)
    # Every decode round trip is counted by its mode (this API does not speculate: all plain).
    def per_mode(page: dict, name: str) -> dict[str, float]:
        key = re.compile(f'diffuse_decode_{name}_total{{mode="(\\w+)",model="{re.escape(DEFAULT_MODEL)}"}}')
        return {m.group(1): v for k, v in page.items() if (m := key.fullmatch(k))}

    steps, tokens = per_mode(api, "steps"), per_mode(api, "step_tokens")
    grown = {m: steps[m] - per_mode(api_before, "steps").get(m, 0) for m in steps}
    assert set(steps) == {"plain"} and grown["plain"] >= 4 and tokens["plain"] == steps["plain"]


def test_status_page_shows_the_swarm(swarm, tmp_path):
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "status_page_swarm.png"
    shot.unlink(missing_ok=True)
    dom = render(swarm.api + "/", tmp_path / "profile", REFRESHED, shot)
    page = Elements()
    page.feed(dom)
    assert page.ready, "the page never rendered /status.json"
    assert set(page.found) == {DEFAULT_MODEL, PARTIAL}
    found = page.found[DEFAULT_MODEL]
    blocks = {int(a["data-block"]): int(a["data-replicas"]) for a in found if "data-block" in a}
    assert blocks == {i: 3 if i == 0 else 2 for i in range(30)}
    peers = set(swarm.ids.values()) | {"local"}
    assert {a["data-peer"] for a in found if "data-peer" in a} == peers
    assert {a["data-peer-row"] for a in found if "data-peer-row" in a} == peers
    partial = {int(a["data-block"]): int(a["data-replicas"]) for a in page.found[PARTIAL] if "data-block" in a}
    assert [partial[i] for i in range(30)] == [1] * 15 + [0] * 15  # block 0: the API's own
    assert "NOT servable: blocks 15-29 uncovered" in dom
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_an_api_at_the_defaults_warms_its_trust_material_then_answers(swarm):
    """A second `diffuse api` on the same swarm at the defaults (the trust plane on, as the
    private swarm says; speculation on; bf16 here, fp16 on the wire): it computes the canary
    material of its route's spans before any request (an API without the trust plane has no
    warm-up to report), then answers through the openai client."""
    proc = swarm.procs.start("api", "--bootstrap", swarm.boot, "--listen", "127.0.0.1:0", "--model", DEFAULT_MODEL,
                             "--api-key", KEY, "--max-tokens", "32", "--wait", "60")
    try:
        url = proc.read_until("listening on", timeout=300)[-1].split()[-1]
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=300)
        warm: dict = {}
        deadline = time.monotonic() + 300
        while not warm.get("state", "").startswith(("ready", "failed")) and time.monotonic() < deadline:
            time.sleep(1)
            model = next(m for m in client.models.list().data if m.id == DEFAULT_MODEL)
            warm = model.model_extra["coverage"].get("trust_warm_up", {})
        assert warm.get("state") == "ready", warm
        assert warm["spans"] and warm["spans"][0][0] == 1 and warm["spans"][-1][1] == 30, warm  # the route's, 1-29
        assert all(a[1] == b[0] for a, b in zip(warm["spans"], warm["spans"][1:])), warm
        whole = client.chat.completions.create(model=DEFAULT_MODEL, messages=ASK, temperature=0, max_tokens=16)
        assert "Paris" in whole.choices[0].message.content
        report = whole.model_extra["diffuse"]
        assert {h["peer"] for h in report["route"]} <= set(swarm.ids.values()) and not report["failovers"], report
    finally:
        proc.signal(signal.SIGTERM)
        proc.wait(60)


# ---- the API's trust warm-up, without processes ----

def _record(peer: str, *, ago: float = 0.0, ttl: float = 30.0, state: str = "online"):
    from diffuse.control.records import PeerRecord

    now = time.time() - ago
    return PeerRecord(peer_id=peer, model="m", num_blocks=30, start=1, end=30, block_hashes=("h",) * 29,
                      dtype="bf16", throughput=10.0, cache_tokens=1000, addrs=("/ip4/127.0.0.1/tcp/1",),
                      timestamp=now, expires=now + ttl, started=now - 60, state=state)


def test_trust_material_is_warmed_for_the_route_at_start_up():
    """Once a route exists, the API computes the canary material of its spans (calibrated for the
    dtype each peer declares) and the referee, so the first request does not wait for it."""
    from diffuse.client.swarm_backend import SwarmBackend
    from diffuse.control.routing import Hop, NoRoute
    from diffuse.data.client import Bans

    calls: list[tuple] = []

    class Material:
        @property
        def referee(self):
            calls.append(("referee",))
            return object()

    class Bank:
        def judging(self, start, end, dtype):
            calls.append(("judging", start, end, dtype))
            return Material()

        def material(self, start, end):
            calls.append(("material", start, end))
            return Material()

    class Guard:
        bank = Bank()

        def excluded(self):
            return set()

    class Client:
        model_id, guard, remote_range, bans = "m", Guard(), (1, 30), Bans()
        tries = 0

        async def route(self, start, end, exclude):
            self.tries += 1
            if self.tries == 1:
                raise NoRoute("no live peer serves blocks 1-29")  # the swarm is not up yet
            return [Hop("A", (), 1, 15), Hop("B", (), 15, 30)]

        async def records(self, max_age=0.0):  # B's record is gone: its span is warmed, not calibrated
            return [_record("A")]

    backend = SwarmBackend.__new__(SwarmBackend)
    backend.trust = {}
    trio.run(backend.warm_trust, Client(), 5.0, clock=trio.testing.MockClock(autojump_threshold=0))
    assert calls == [("judging", 1, 15, "bfloat16"), ("referee",), ("material", 15, 30), ("referee",)]
    assert backend.trust["m"] == {"state": "ready", "spans": [[1, 15], [15, 30]]}
