"""Peer metrics and the operator's switches of `diffuse join`.

The metered stream is checked on real encoded frames; `join --client-only` and
`--contribution pause` run as real processes against a real sentinel and stop on SIGTERM. A real
peer's /metrics after a generation is checked in test_api_swarm.py (it reuses that swarm).
"""

from __future__ import annotations

import json
import signal

import httpx
import pytest
import torch
import trio

from control_helpers import make_fake_model
from support.procs import Procs
from diffuse.data.codec import ErrorCode, ErrorMsg, StepOk, encode
from diffuse.data.serve import Contribution, contribution
from diffuse.metrics import REGISTRY, MeteredStream, serve_metrics, watch_peer

SID = bytes(range(16))


def value(name: str, labels: dict[str, str] | None = None) -> float:
    return REGISTRY.get_sample_value(name, labels or {}) or 0.0


class Pipe:
    """A stream whose reads return queued bytes and whose writes are kept."""

    def __init__(self, *reads: bytes):
        self.reads, self.written = list(reads), []

    async def read(self, n: int = -1) -> bytes:
        return self.reads.pop(0)

    async def write(self, data: bytes) -> None:
        self.written.append(data)

    async def close(self) -> None:
        pass


def test_metered_stream_times_steps_and_counts_bytes_and_refusals():
    step_ok = encode(StepOk(SID, 0, torch.zeros(1, 1, 576, dtype=torch.float16)))
    refusal = encode(ErrorMsg(int(ErrorCode.BAD_FRAME), "bad magic", SID))
    idle = encode(ErrorMsg(int(ErrorCode.TIMEOUT), "idle", SID))
    steps = value("diffuse_step_seconds_count", {"role": "server"})
    sent, received = value("diffuse_wire_bytes_total", {"direction": "sent"}), value(
        "diffuse_wire_bytes_total", {"direction": "received"})
    bad = value("diffuse_failed_checks_total", {"check": "request:bad_frame"})

    async def main() -> Pipe:
        pipe = Pipe(b"x" * 100)
        stream = MeteredStream(pipe, server=True)
        await stream.read(65536)
        for frame in (step_ok, refusal, idle):
            await stream.write(frame)
        return pipe

    pipe = trio.run(main)
    assert pipe.written == [step_ok, refusal, idle]
    assert value("diffuse_step_seconds_count", {"role": "server"}) == steps + 1
    assert value("diffuse_wire_bytes_total", {"direction": "received"}) == received + 100
    assert value("diffuse_wire_bytes_total", {"direction": "sent"}) == sent + len(step_ok) + len(refusal) + len(idle)
    assert value("diffuse_failed_checks_total", {"check": "request:bad_frame"}) == bad + 1
    assert value("diffuse_failed_checks_total", {"check": "request:timeout"}) == 0  # its own limit, not a check


def test_peer_metrics_endpoint_exports_the_servers_counters():
    status = {"steps_served": 7, "tokens_served": 40, "sessions": 2}
    handle = watch_peer(lambda: "m", lambda: status, lambda stream, remote: trio.sleep(0))

    async def main():
        async with trio.open_nursery() as nursery:
            url = (await nursery.start(serve_metrics, "127.0.0.1:0"))[0]
            await handle(Pipe(), "peer")
            ok = await trio.to_thread.run_sync(httpx.get, url + "/metrics")
            missing = await trio.to_thread.run_sync(httpx.get, url + "/")
            nursery.cancel_scope.cancel()
        return ok, missing

    ok, missing = trio.run(main)
    assert ok.status_code == 200 and ok.headers["content-type"].startswith("text/plain")
    assert 'diffuse_tokens_served_total{model="m"} 40.0' in ok.text
    assert 'diffuse_steps_served_total{model="m"} 7.0' in ok.text
    assert 'diffuse_sessions_open{role="server"} 2.0' in ok.text
    for name in ("diffuse_step_seconds", "diffuse_failovers", "diffuse_failed_checks", "diffuse_wire_bytes"):
        assert f"# TYPE {name}" in ok.text
    assert missing.status_code == 404


def test_contribution_levels_bound_threads_sessions_and_cache():
    assert contribution("min", 65536, cores=4) == Contribution(threads=1, max_sessions=8, cache_tokens=8192)
    assert contribution("moderate", 65536, cores=4) == Contribution(2, 32, 32768)
    assert contribution("max", 65536, cores=4) == Contribution(4, 64, 65536)
    assert contribution("pause", 65536, cores=4) is None
    with pytest.raises(ValueError, match="unknown contribution level 'most'"):
        contribution("most", 1, 1)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("flags", [["--client-only"], ["--contribution", "pause"]])
def test_join_without_serving_stays_in_the_dht_and_stops_on_sigterm(tmp_path, flags):
    make_fake_model(tmp_path)
    with Procs(tmp_path) as procs:
        sentinel = procs.start("sentinel", "--identity", str(tmp_path / "s.key"), "--listen", "/ip4/127.0.0.1/tcp/0")
        boot = sentinel.readline(timeout=120)
        peer = procs.start("join", "--identity", str(tmp_path / "p.key"), "--bootstrap", boot,
                           "--listen", "/ip4/127.0.0.1/tcp/0", *flags)
        assert peer.read_until("joined without serving", timeout=120)
        status = procs.run("status", "--bootstrap", boot, "--json", timeout=120)
        assert status.returncode == 0 and json.loads(status.stdout)["models"][0]["peers"] == []
        peer.signal(signal.SIGTERM)
        assert peer.wait(30) == 0
