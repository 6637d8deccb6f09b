"""A link between two chained peers that falls silent as the answer starts: packets from the first
peer to the second are dropped (iptables in the first peer's namespace, once it has linked to
the second for the client's session), while the client still reaches both. Nothing errors: the
first peer's write of the prefill's output hangs in a full socket (it stops waiting after
link_write_s and tells the client), or a smaller write succeeds and the second hop never gets
its input (the client sends that step itself). Either way the answer completes as the local one
with no failover, and the report blames the link, naming both peers (tests/test_chain.py pins
each way in memory). Sentinel, peers and client are processes in namespaces of their own on one
bridge (tests/test_netns.py). Needs root, iproute2 and iptables."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from diffuse.control.host import parse_peer_addr
from diffuse.peer.loopback import CLI, Child
from test_netns import Net, missing
from test_swarm import QUESTION, TOKENS, reference_answer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
SPANS = {"peerA": "1:15", "peerB": "15:30"}


@pytest.fixture
def net():
    why = missing() or (None if shutil.which("iptables") else "iptables is not installed (apt-get install iptables)")
    if why:
        pytest.skip(why)
    net = Net(os.urandom(3).hex())
    try:
        net.build()
        yield net
    finally:
        net.destroy()


def wait_in_log(log: Path, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while text not in log.read_text(errors="replace"):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{log.name} never logged {text!r}; it ends:\n{log.read_text()[-3000:]}")
        time.sleep(0.02)


def test_a_silent_link_mid_answer_is_blamed_on_the_link_and_the_answer_goes_on(home, tmp_path, net):
    reference = reference_answer(home)
    base = ["--home", str(home)]
    children: list[Child] = []

    def start(name: str, *args: str) -> Child:
        children.append(Child(name, base + list(args), tmp_path / f"{name}.log", prefix=net.prefix(name)))
        return children[-1]

    try:
        boot = start("sentinel", "sentinel", "--identity", str(tmp_path / "s.key"),
                     "--listen", net.listen("sentinel")).wait_for("/ip4/", 120)
        ids = {}
        for name, span in SPANS.items():
            start(name, "-v", "join", "--bootstrap", boot, "--blocks", span, "--heartbeat", "5",
                  "--identity", str(tmp_path / f"{name}.key"), "--listen", net.listen(name))
        for child in children[1:]:
            ids[child.name] = parse_peer_addr(child.wait_for("/ip4/", 180)).peer_id.to_base58()
            child.wait_for("serving ", 180)
        ask = subprocess.Popen(net.prefix("client") + CLI + base + [
            "--client-only", "ask", "--bootstrap", boot, "--json", "--max-tokens", str(TOKENS), "--wait", "60",
            "--no-speculate", QUESTION], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            wait_in_log(tmp_path / "peerA.log", f"linked to {ids['peerB']}", 180)
            drop = ["iptables", "-A", "OUTPUT", "-d", net.addr["peerB"], "-j", "DROP"]
            done = subprocess.run(net.prefix("peerA") + drop, capture_output=True, text=True, timeout=20)
            assert done.returncode == 0, done.stderr
            out, err = ask.communicate(timeout=300)
        finally:
            if ask.poll() is None:
                ask.kill()
                ask.communicate()
        assert ask.returncode == 0, err[-3000:]
        got = json.loads(out)
        assert got["token_ids"] == reference
        assert not got["failovers"], got["failovers"]
        blamed = [link for link in got["links"] if link["link"] == [ids["peerA"], ids["peerB"]]]
        assert blamed and blamed[0]["when"] == "step", got["links"]
        assert any(why in blamed[0]["error"] for why in ("did not take a frame", "no input forwarded")), blamed
        assert [h["peer"] for h in got["route"]] == [ids["peerA"], ids["peerB"]]
    finally:
        for child in reversed(children):
            child.stop()
