"""The control plane end to end: a sentinel and four `diffuse join` peers as separate OS processes
on 127.0.0.1 (OS-chosen ports), every block of SmolLM2-135M covered twice (the real model from
the shared store: `join` loads and measures its span before announcing it).

One scenario, in order: a new client sees full coverage within seconds; foreign-security dialers
are refused by the real processes; a SIGKILLed peer vanishes after its record expires; a
SIGTERMed peer vanishes at once (its ttl is long, so only the withdrawal explains it); the hole
it leaves is exactly what `join --blocks auto` then picks.
"""

from __future__ import annotations

import json
import signal
import time

import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair

from control_helpers import make_fake_model
from support.procs import Procs, swarm_key, swarm_key_file
from diffuse.control.host import parse_peer_addr
from diffuse.control.identity import peer_id
from diffuse.control.node import NodeConfig, open_node
from diffuse.home import DEFAULT_MODEL, models_dir
from diffuse.model.weights import load_manifest


LOCAL = "/ip4/127.0.0.1/tcp/0"
# A[0,10) B[10,30) C[0,20) D[20,30): blocks 0-9 by A,C; 10-19 by B,C; 20-29 by B,D.
SPANS = {"A": "0:10", "B": "10:30", "C": "0:20", "D": "20:30"}
# C gets SIGKILLed (short ttl), B SIGTERMed (long ttl). Heartbeat 1 s, ttl 8 s: slack for
# peers starved while others load their blocks on 2 shared cores (a real swarm: 15 s / 45 s).
TTL = {"A": 8, "B": 60, "C": 8, "D": 8}


@pytest.mark.slow
@pytest.mark.timeout(600)  # ~1 min on a quiet 2-core box; processes are killed on any exit
def test_swarm_coverage_expiry_withdrawal_and_auto_placement(tmp_path, home, capsys):
    from diffuse.cli import main

    with Procs(home) as procs:
        sentinel = procs.start("sentinel", "--identity", str(tmp_path / "s.key"), "--listen", LOCAL)
        t0 = time.monotonic()
        boot = sentinel.readline(timeout=120)
        print(f"[{time.monotonic() - t0:5.1f} s] sentinel up")
        assert boot.startswith("/ip4/127.0.0.1/tcp/") and "/p2p/" in boot

        began = time.monotonic()
        # A is also given a sentinel that is down: it must use the one that answers.
        dead = f"/ip4/127.0.0.1/tcp/1/p2p/{peer_id(create_new_key_pair()).to_base58()}"
        peers = {name: procs.start("join", "--identity", str(tmp_path / f"{name}.key"),
                                   *(["--bootstrap", dead] if name == "A" else []), "--bootstrap", boot,
                                   "--listen", LOCAL, "--blocks", span, "--heartbeat", "1", "--ttl", str(TTL[name]))
                 for name, span in SPANS.items()}
        ids, addrs = {}, {}
        for name, proc in peers.items():
            lines = proc.read_until("serving", timeout=120)
            assert lines[-1] == f"serving {DEFAULT_MODEL} blocks {SPANS[name]} " \
                                f"({_len(SPANS[name])} of 30)", lines
            addrs[name] = lines[0]
            ids[name] = parse_peer_addr(lines[0]).peer_id.to_base58()
        print(f"[{time.monotonic() - t0:5.1f} s] four peers serving")

        # `diffuse status --json` (in this process: a second interpreter would spend most of its
        # time importing torch) sees every block twice, with each peer's age and heartbeat.
        capsys.readouterr()
        assert main(["--home", str(home), "status", "--bootstrap", boot, "--json", "--wait", "30",
                     "--swarm-key", str(swarm_key_file())]) == 0
        cov = json.loads(capsys.readouterr().out)["models"][0]
        assert cov["servable"] and [b["replicas"] for b in cov["blocks"]] == [2] * 30, cov
        assert {p["peer_id"] for p in cov["peers"]} == set(ids.values())
        for p in cov["peers"]:  # ages count from when each peer began serving, during this test
            assert 0 <= p["last_heartbeat_s"] <= p["age_s"] <= time.monotonic() - began + 1, p
            assert p["expires_in_s"] > 0 and p["throughput"] > 0 and p["addrs"], p
        print(f"[{time.monotonic() - t0:5.1f} s] diffuse status done")

        trio.run(_scenario, procs, boot, peers, ids, addrs, tmp_path, load_manifest(models_dir(home) / DEFAULT_MODEL))
        print(f"[{time.monotonic() - t0:5.1f} s] done")


async def _scenario(procs: Procs, boot: str, peers: dict, ids: dict, addrs: dict, tmp_path, manifest) -> None:
    t = trio.current_time()
    async with open_node(create_new_key_pair(), NodeConfig(listen=[LOCAL], bootstrap=[boot], server=False,
                                                           swarm_key=swarm_key())) as client:
        with trio.fail_after(30):
            while (await client.coverage(DEFAULT_MODEL, 30, manifest.block_hashes)).replicas != [2] * 30:
                await trio.sleep(0.2)
        learned = trio.current_time() - t  # scripts/bench_dht.py measures it
        print(f"in-process client: bootstrap + full coverage in {learned * 1000:.0f} ms")

        await _foreign_dialers_are_refused([boot, addrs["A"]])

        # SIGKILL: no goodbye. C stays listed while any record of it we have seen is valid,
        # and vanishes once the last one expires (ttl 8 s).
        before = (await client.coverage(DEFAULT_MODEL, 30, manifest.block_hashes)).peers[ids["C"]]
        peers["C"].signal(signal.SIGKILL)
        killed = time.time()
        gone, last = await _wait_gone(client, manifest, ids["C"], before, timeout=TTL["C"] + 10)
        assert gone >= last.expires - 0.05, "a SIGKILLed peer vanished while its record was still valid"
        print(f"SIGKILLed peer gone {gone - killed:.1f} s after the kill (ttl {TTL['C']} s)")

        # SIGTERM: B withdraws; it vanishes while its last record (ttl 60 s) is still valid,
        # which only the withdrawal can explain.
        before = (await client.coverage(DEFAULT_MODEL, 30, manifest.block_hashes)).peers[ids["B"]]
        peers["B"].signal(signal.SIGTERM)
        termed = time.time()
        gone, last = await _wait_gone(client, manifest, ids["B"], before, timeout=25)
        assert gone < last.expires - 30  # withdrawn: gone while its record had 30 s left
        print(f"SIGTERMed peer gone {gone - termed:.2f} s after the signal (ttl {TTL['B']} s)")
        assert await trio.to_thread.run_sync(peers["B"].wait, 15) == 0
        noise = [ln for ln in peers["B"].stderr if "WARNING" in ln or "Traceback" in ln or "ERROR" in ln]
        assert not noise, noise[:5]

        cov = await client.coverage(DEFAULT_MODEL, 30, manifest.block_hashes)
        assert not cov.servable and cov.missing == list(range(10, 20)), cov.replicas

        # --blocks auto fills the hole.
        e = procs.start("join", "--identity", str(tmp_path / "E.key"), "--bootstrap", boot, "--listen", LOCAL,
                        "--blocks", "auto", "--num-blocks", "10", "--heartbeat", "1", "--ttl", "8")
        t = time.monotonic()
        lines = await trio.to_thread.run_sync(e.read_until, "serving", 120)
        print(f"auto-placed peer serving after {time.monotonic() - t:.1f} s")
        assert lines[-1].startswith(f"serving {DEFAULT_MODEL} blocks 10:20 "), lines
        with trio.fail_after(10):
            while not (await client.coverage(DEFAULT_MODEL, 30, manifest.block_hashes)).servable:
                await trio.sleep(0.3)


async def _wait_gone(client, manifest, peer: str, last, timeout: float):
    """Poll coverage until `peer` is gone; returns (coverage time it was first missing, the
    latest record of it seen before that)."""
    with trio.fail_after(timeout):
        while True:
            cov = await client.coverage(DEFAULT_MODEL, 30, manifest.block_hashes)
            rec = cov.peers.get(peer)
            if rec is None:
                return cov.now, last
            last = max(last, rec, key=lambda r: r.expires)
            await trio.sleep(0.2)


async def _foreign_dialers_are_refused(targets: list[str]) -> None:
    """A plaintext dialer cannot connect to the sentinel or a peer process (TLS and SECIO
    dialers are covered in test_host_security)."""
    import multiaddr
    from libp2p import new_host
    from libp2p.network.config import RetryConfig
    from libp2p.security.insecure.transport import PLAINTEXT_PROTOCOL_ID, InsecureTransport

    kp = create_new_key_pair()
    dialer = new_host(key_pair=kp, sec_opt={PLAINTEXT_PROTOCOL_ID: InsecureTransport(kp)})
    dialer.get_network().retry_config = RetryConfig(max_retries=0)
    async with dialer.run([multiaddr.Multiaddr(LOCAL)]):
        for target in targets:
            info = parse_peer_addr(target)
            with trio.move_on_after(10):
                try:
                    await dialer.connect(info)
                except Exception:  # noqa: BLE001 - any dial failure is the refusal this test wants
                    pass
            assert info.peer_id not in dialer.get_connected_peers(), f"plaintext dialer reached {target}"


@pytest.mark.parametrize("value", ["-5", "0", "inf", "fast"])
def test_join_rejects_a_throughput_that_is_not_a_positive_number(tmp_path, capsys, value):
    from diffuse.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["--home", str(tmp_path), "join", "--bootstrap", "/ip4/127.0.0.1/tcp/1/p2p/x", "--throughput", value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "argument --throughput: expected a" in err and repr(value) in err and "Traceback" not in err, err


def _len(span: str) -> int:
    a, b = span.split(":")
    return int(b) - int(a)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("argv, message", [
    (["join", "--bootstrap", "/ip4/127.0.0.1/tcp/notaport/p2p/x"], "bad multiaddr"),
    (["join", "--bootstrap", "/ip4/127.0.0.1/tcp/1"], "lacks the /p2p/PEERID part"),
    (["join", "--bootstrap", "/ip4/127.0.0.1/tcp/1/p2p/{pid}", "--blocks", "20:40"], "bad --blocks"),
    (["join", "--bootstrap", "/ip4/127.0.0.1/tcp/1/p2p/{pid}", "--blocks", "auto", "--max-memory", "1MiB"],
     "cannot hold one block"),
    (["join", "--bootstrap", "/ip4/127.0.0.1/tcp/1/p2p/{pid}", "--blocks", "0:10",
      "--listen", "/ip4/127.0.0.1/tcp/0"], "could not reach any bootstrap peer"),
    (["join", "--model", "auto", "--models", "nope"], "--models names nope, not in the store"),
    (["join", "--model", "auto", "--blocks", "0:10"], "--model auto chooses the blocks too"),
    (["join", "--model", "auto", "--max-memory", "1MiB"], "cannot hold one block of any allowed model"),
    (["join", "--models", "x"], "--models and --replan only apply with --model auto"),
    (["status", "--no-mdns"], "no bootstrap peer"),
    (["sentinel", "--listen", "/ip4/127.0.0.1/udp/5/quic"], "not TCP"),
])
def test_user_errors_exit_2_without_traceback(tmp_path, capsys, monkeypatch, argv, message):
    from diffuse.cli import main
    from diffuse.control.identity import load_or_create
    from diffuse.control.modes import KEY_ENV

    monkeypatch.setenv(KEY_ENV, str(swarm_key_file()))  # private, as Procs' swarms: the key is not the error

    home = tmp_path / "home"
    make_fake_model(home)
    pid = peer_id(load_or_create(tmp_path / "other.key")).to_base58()
    argv = [a.replace("{pid}", pid) for a in argv]
    assert main(["--home", str(home), *argv, "--identity", str(tmp_path / "k")]
                if argv[0] != "status" else ["--home", str(home), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err, err
