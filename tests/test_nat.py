"""Swarms across Linux network namespaces the way people's machines sit: on one LAN with no
bootstrap address (mDNS), and behind home routers (NAT) that drop unsolicited inbound traffic,
reached through a sentinel's circuit relay. Needs root and iproute2 (and iptables for NAT);
skipped with the reason otherwise."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from diffuse.peer.loopback import CLI, Child
from diffuse.control.host import parse_peer_addr
from diffuse.control.modes import KEY_ENV
from diffuse.control.swarm_key import SwarmKey, write_key
from test_netns import Net, ip, missing
from test_swarm import QUESTION, TOKENS, reference_answer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


class Lan(Net):
    """Namespaces `names` on one bridge at 10.98.0.x, each with a default route onto it (a LAN
    whose router is absent: what wildcard listeners expand to needs a route)."""

    def __init__(self, tag: str, names: tuple[str, ...]):
        super().__init__(tag)
        self.ns = {name: f"df{tag}n{i}" for i, name in enumerate(names)}
        self.addr = {name: f"10.98.0.{i + 1}" for i, name in enumerate(names)}

    def build(self) -> None:
        super().build()
        for i, ns in enumerate(self.ns.values()):
            self.run("-n", ns, "route", "add", "default", "dev", f"df{self.tag}i{i}")


@pytest.fixture(scope="module")
def reference(home) -> list[int]:
    return reference_answer(home)


@pytest.fixture
def key_env(tmp_path, monkeypatch):
    """A private swarm's key in $DIFFUSE_SWARM_KEY (children inherit the environment)."""
    path = tmp_path / "swarm.key"
    write_key(path, SwarmKey.generate())
    monkeypatch.setenv(KEY_ENV, str(path))
    return path


def build(net: Net):
    why = missing()
    if why:
        pytest.skip(why)
    try:
        net.build()
    except Exception:
        net.destroy()
        raise
    return net


def test_lan_discovery_without_bootstrap(home, tmp_path, key_env, reference):
    """A peer and a client on one LAN bridge, neither given --bootstrap: mDNS finds the peer
    (listening on the wildcard address, join's default) and the answer is the in-process one."""
    net = build(Lan(os.urandom(3).hex(), ("peer", "client")))
    base = ["--home", str(home)]
    children: list[Child] = []
    try:
        peer = Child("peer", base + ["join", "--blocks", "1:30", "--heartbeat", "5",
                                     "--identity", str(tmp_path / "peer.key")],
                     tmp_path / "peer.log", prefix=net.prefix("peer"))
        children.append(peer)
        addr = peer.wait_for("/ip4/", 180)
        assert addr.startswith(f"/ip4/{net.addr['peer']}/"), addr  # the wildcard, expanded
        peer.wait_for("serving ", 180)
        out = subprocess.run(net.prefix("client") + CLI + base + [
            "--client-only", "ask", "--json", "--max-tokens", str(TOKENS), "--wait", "60", "--no-speculate",
            QUESTION], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        got = json.loads(out.stdout)
        assert got["token_ids"] == reference
        assert [(h["peer"], h["blocks"]) for h in got["route"]] == [
            (parse_peer_addr(addr).peer_id.to_base58(), [1, 30])]
        assert [h["reached"] for h in got["route"]] == [{"state": "direct", "via": None}]
        out = subprocess.run(net.prefix("client") + CLI + base + ["status", "--json"],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        status = json.loads(out.stdout)
        assert [p["peer_id"] for p in status["models"][0]["peers"]] == [got["route"][0]["peer"]]
        assert status["lan_peers"] == [got["route"][0]["peer"]]
        # A node of another swarm on the same LAN finds the peer too, and cannot connect.
        other = tmp_path / "other.key"
        write_key(other, SwarmKey.generate())
        out = subprocess.run(net.prefix("client") + CLI + base + [
            "status", "--swarm-key", str(other), "--json"], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["models"][0]["peers"] == []
        assert json.loads(out.stdout)["lan_peers"] == []
    finally:
        for child in reversed(children):
            child.stop()
        net.destroy()
        assert net.tag not in ip("netns", "list").stdout


def iptables_missing() -> str | None:
    return None if shutil.which("iptables") else "iptables is not installed (apt-get install iptables)"


MINIUPNPD = shutil.which("miniupnpd") or "/usr/sbin/miniupnpd"


def upnp_missing() -> str | None:
    if not Path(MINIUPNPD).is_file() or not shutil.which("nft"):
        return "miniupnpd or nft is not installed (apt-get install miniupnpd-nftables nftables)"
    return None


class Internet:
    """An "internet": a bridge (10.97.0.0/24) in a switch namespace. `public` puts a host on it;
    `home` puts a home router on it (WAN 10.97.0.x) with one host on its LAN (192.168.N.2) that
    it masquerades, dropping inbound traffic unless it belongs to a connection opened from inside.
    Names are short: an interface name holds at most 15 characters."""

    def __init__(self, tag: str, tmp: Path):
        self.tag, self.made, self.links, self.tmp = tag, [], 0, tmp
        self.daemons: list[subprocess.Popen] = []  # miniupnpd of routers that offer UPnP
        self.routers: dict[str, str] = {}  # host name -> its router's namespace, where it has UPnP
        self.ns: dict[str, str] = {}
        self.addr: dict[str, str] = {}
        self.switch = self._netns("sw")
        self.run("-n", self.switch, "link", "add", "br0", "type", "bridge")
        self.run("-n", self.switch, "link", "set", "br0", "up")

    def run(self, *args: str) -> None:
        done = ip(*args)
        if done.returncode != 0:
            raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")

    def _netns(self, name: str) -> str:
        ns = f"df{self.tag}{name}"
        self.run("netns", "add", ns)
        self.made.append(ns)
        self.run("-n", ns, "link", "set", "lo", "up")
        return ns

    def _veth(self, a: str, b: str) -> tuple[str, str]:
        self.links += 1
        ia, ib = f"df{self.tag}v{self.links}a", f"df{self.tag}v{self.links}b"
        self.run("link", "add", ia, "netns", a, "type", "veth", "peer", "name", ib, "netns", b)
        self.run("-n", a, "link", "set", ia, "up")
        self.run("-n", b, "link", "set", ib, "up")
        return ia, ib

    def _wan(self, ns: str, addr: str) -> str:
        inner, outer = self._veth(ns, self.switch)
        self.run("-n", self.switch, "link", "set", outer, "master", "br0")
        self.run("-n", ns, "addr", "add", f"{addr}/24", "dev", inner)
        return inner

    def public(self, name: str, addr: str) -> None:
        self.ns[name] = self._netns(name)
        self.addr[name] = addr
        self._wan(self.ns[name], addr)

    def home(self, name: str, wan: str, lan: int, random_fully: bool = False, upnp: bool = False) -> None:
        """`upnp`: the router also runs miniupnpd on its LAN side and forwards what it maps."""
        router = self._netns(f"r{lan}")
        host = self.ns[name] = self._netns(name)
        self.addr[name] = f"192.168.{lan}.2"
        wan_if = self._wan(router, wan)
        lan_router, lan_host = self._veth(router, host)
        self.run("-n", router, "addr", "add", f"192.168.{lan}.1/24", "dev", lan_router)
        self.run("-n", host, "addr", "add", f"192.168.{lan}.2/24", "dev", lan_host)
        self.run("-n", host, "route", "add", "default", "via", f"192.168.{lan}.1")
        rules = [["-t", "nat", "-A", "POSTROUTING", "-o", wan_if, "-j", "MASQUERADE",
                  *(["--random-fully"] if random_fully else [])]]
        for chain in ("FORWARD", "INPUT"):
            accepted = "ESTABLISHED,RELATED" + (",DNAT" if upnp and chain == "FORWARD" else "")
            rules += [["-A", chain, "-i", wan_if, "-m", "conntrack", "--ctstate", accepted, "-j", "ACCEPT"],
                      ["-A", chain, "-i", wan_if, "-j", "DROP"]]
        for rule in [["sysctl", "-qw", "net.ipv4.ip_forward=1"], *(["iptables", *r] for r in rules)]:
            done = subprocess.run(["ip", "netns", "exec", router, *rule], capture_output=True, text=True,
                                  timeout=20)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(rule)} in {router}: {done.stderr.strip()}")
        if upnp:
            self.routers[name] = router
            self._miniupnpd(router, wan_if, lan_router, lan)

    def _miniupnpd(self, router: str, wan_if: str, lan_if: str, lan: int) -> None:
        """miniupnpd (nftables backend) in `router`: its chains, then the daemon, answering the LAN."""
        tables = ("table inet filter {\n"
                  "  chain forward { type filter hook forward priority 0; policy accept; jump miniupnpd; }\n"
                  "  chain miniupnpd { }\n"
                  "  chain prerouting { type nat hook prerouting priority -100; policy accept; "
                  "jump prerouting_miniupnpd; }\n"
                  "  chain postrouting { type nat hook postrouting priority 100; policy accept; "
                  "jump postrouting_miniupnpd; }\n"
                  "  chain prerouting_miniupnpd { }\n  chain postrouting_miniupnpd { }\n}\n")
        done = subprocess.run(["ip", "netns", "exec", router, "nft", "-f", "-"], input=tables, capture_output=True,
                              text=True, timeout=20)
        if done.returncode != 0:
            raise RuntimeError(f"nft in {router}: {done.stderr.strip()}")
        conf = self.tmp / f"miniupnpd-{lan}.conf"
        conf.write_text(f"ext_ifname={wan_if}\nlistening_ip={lan_if}\nport=0\nenable_natpmp=no\nenable_upnp=yes\n"
                        f"secure_mode=yes\nuuid=8f1c2c0e-1111-4c3a-9a5e-{lan:012d}\n"
                        f"allow 1024-65535 192.168.{lan}.0/24 1024-65535\ndeny 0-65535 0.0.0.0/0 0-65535\n")
        log = open(self.tmp / f"miniupnpd-{lan}.log", "w")
        self.daemons.append(subprocess.Popen(
            ["ip", "netns", "exec", router, MINIUPNPD, "-d", "-f", str(conf), "-P", str(self.tmp / f"upnp{lan}.pid")],
            stdout=log, stderr=subprocess.STDOUT))

    def ruleset(self, name: str) -> str:
        """The nftables rules of `name`'s router (where miniupnpd writes its mappings)."""
        return subprocess.run(["ip", "netns", "exec", self.routers[name], "nft", "list", "ruleset"],
                              capture_output=True, text=True, timeout=20).stdout

    def prefix(self, name: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns[name]]

    def destroy(self) -> None:
        for daemon in self.daemons:
            daemon.kill()
            daemon.wait(10)
        for ns in reversed(self.made):
            ip("netns", "del", ns)


@pytest.fixture
def internet(tmp_path):
    why = missing() or iptables_missing()
    if why:
        pytest.skip(why)
    net = Internet(os.urandom(3).hex(), tmp_path)
    try:
        yield net
    finally:
        net.destroy()
    assert net.tag not in ip("netns", "list").stdout


def sentinel_and_peer(net: Internet, base: list[str], tmp_path, children: list[Child],
                      *peer_args: str) -> tuple[Child, Child, str, str]:
    """The sentinel on the internet and a peer serving blocks 1:30 behind router 1, both in
    `children`; with the bootstrap address and the relay's (the sentinel's) peer id."""
    sentinel = Child("sentinel", base + ["sentinel", "--identity", str(tmp_path / "s.key"),
                                         "--listen", f"/ip4/{net.addr['sentinel']}/tcp/0"],
                     tmp_path / "sentinel.log", prefix=net.prefix("sentinel"))
    children.append(sentinel)
    boot = sentinel.wait_for("/ip4/", 120)
    peer = Child("peer", base + ["join", "--bootstrap", boot, "--blocks", "1:30", "--heartbeat", "5", *peer_args,
                                 "--identity", str(tmp_path / "peer.key")],
                 tmp_path / "peer.log", prefix=net.prefix("peer"))
    children.append(peer)
    return sentinel, peer, boot, parse_peer_addr(boot).peer_id.to_base58()


def test_peer_behind_nat_is_reached_through_the_sentinels_relay(home, tmp_path, key_env, internet, reference):
    """Relay only (hole punching off on both ends): a sentinel on the internet; a peer serving
    every remote block behind one home router, a client behind another (MASQUERADE, unsolicited
    inbound dropped; the client's router with --random-fully, a new source port per flow, as
    symmetric NATs do). The peer finds itself unreachable, reserves a slot on the sentinel's
    relay and announces only its /p2p-circuit address; the client's greedy answer through the
    relay is the in-process one, and `status` reaches the peer through the relay too."""
    net = internet
    net.public("sentinel", "10.97.0.1")
    net.home("peer", "10.97.0.11", 1)
    net.home("client", "10.97.0.12", 2, random_fully=True)  # symmetric-like: a new port per flow
    # The NAT holds: a listener behind it cannot be reached from the internet.
    probe = subprocess.run(net.prefix("sentinel") + ["python3", "-c", (
        "import socket; s = socket.socket(); s.settimeout(2)\n"
        "try: s.connect(('192.168.1.2', 9)); print('reached')\n"
        "except OSError as e: print('unreachable', e)")], capture_output=True, text=True, timeout=30)
    assert probe.stdout.startswith("unreachable"), probe.stdout + probe.stderr
    base = ["--home", str(home)]
    children: list[Child] = []
    try:
        sentinel, peer, boot, relay_id = sentinel_and_peer(net, base, tmp_path, children, "--no-hole-punch")
        addr = peer.wait_for("/ip4/", 180)
        assert addr.startswith(f"{boot}/p2p-circuit/p2p/"), addr  # only the relayed address
        peer_id = addr.rsplit("/", 1)[1]
        peer.wait_for("serving ", 180)
        assert "behind NAT, reachable through relay" in (tmp_path / "peer.log").read_text()
        got = ask_json(net, "client", base, boot, "--no-hole-punch")
        assert got["token_ids"] == reference
        assert [(h["peer"], h["blocks"]) for h in got["route"]] == [(peer_id, [1, 30])]
        assert [h["reached"] for h in got["route"]] == [{"state": "relayed", "via": relay_id}]
        assert not got["failovers"]
        [shown] = status_json(net, "client", base, boot, "--no-hole-punch")["models"][0]["peers"]
        assert shown["reach"] == {"state": "relayed", "via": [relay_id]}, shown  # what its record says
        assert shown["reached"] == {"state": "relayed", "via": relay_id}, shown  # what a dial from here found
        # The relay restarts (SIGKILL, then the same identity and address): the peer loses its
        # slot, reserves again, re-announces, and answers through the relay as before.
        sentinel.p.kill()
        sentinel.p.wait()
        sentinel.stop()
        children.remove(sentinel)
        port = boot.split("/tcp/")[1].split("/")[0]
        sentinel = Child("sentinel", base + ["sentinel", "--identity", str(tmp_path / "s.key"),
                                             "--listen", f"/ip4/10.97.0.1/tcp/{port}"],
                         tmp_path / "sentinel2.log", prefix=net.prefix("sentinel"))
        children.append(sentinel)
        assert sentinel.wait_for("/ip4/", 120) == boot
        log = tmp_path / "peer.log"
        deadline = time.monotonic() + 120
        while not re.search(r"holds a slot for us again|reserved again on relay", log.read_text()):
            assert time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.5)
        again = ask_json(net, "client", base, boot, "--no-hole-punch")
        assert again["token_ids"] == reference
        assert [h["reached"] for h in again["route"]] == [{"state": "relayed", "via": relay_id}]
    finally:
        for child in reversed(children):
            child.stop()


def test_peer_behind_a_upnp_router_maps_its_port_and_is_reached_directly(home, tmp_path, key_env, internet,
                                                                          reference):
    """A home router that offers UPnP (miniupnpd) on a public-looking internet (11.97.0.0/24: UPnP
    refuses to map behind a private external address): the peer maps its port there, the
    sentinel's dial-back reaches it, it announces the router's address and no relay; a client
    behind another router gets the in-process answer over a direct connection. Stopped, the peer
    removes its mapping."""
    why = upnp_missing()
    if why:
        pytest.skip(why)
    net = internet
    net.public("sentinel", "11.97.0.1")
    net.home("peer", "11.97.0.11", 1, upnp=True)
    net.home("client", "11.97.0.12", 2)
    base = ["--home", str(home)]
    children: list[Child] = []
    try:
        _, peer, boot, _ = sentinel_and_peer(net, base, tmp_path, children)
        addr = peer.wait_for("/ip4/", 180)
        assert addr.startswith("/ip4/11.97.0.11/tcp/"), addr  # the router's external address, mapped
        peer_id = addr.rsplit("/", 1)[1]
        peer.wait_for("serving ", 180)
        assert "reachable through the router's UPnP port mapping" in (tmp_path / "peer.log").read_text()
        assert "dnat ip to 192.168.1.2" in net.ruleset("peer")
        got = ask_json(net, "client", base, boot)
        assert got["token_ids"] == reference
        assert [(h["peer"], h["reached"]["state"]) for h in got["route"]] == [(peer_id, "direct")]
        peer.stop()
        assert "dnat ip to 192.168.1.2" not in net.ruleset("peer")  # the mapping is gone
    finally:
        for child in reversed(children):
            child.stop()


def ask_json(net: Internet, name: str, base: list[str], boot: str, *args: str) -> dict:
    """`ask --json` from `name`'s namespace through the swarm at `boot`, greedy and plain."""
    try:
        out = subprocess.run(net.prefix(name) + CLI + base + [
            "-v", "--client-only", "ask", "--bootstrap", boot, "--json", "--max-tokens", str(TOKENS), "--wait", "60",
            "--no-speculate", *args, QUESTION], capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired as e:  # what it logged, to say where it hung
        log = e.stderr.decode() if isinstance(e.stderr, bytes) else e.stderr or ""
        raise AssertionError(f"ask did not end in 300 s; its log:\n{log[-6000:]}") from None
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def status_json(net: Internet, name: str, base: list[str], boot: str, *args: str) -> dict:
    """`status --json` from `name`'s namespace (it dials every peer: `reached` says how)."""
    out = subprocess.run(net.prefix(name) + CLI + base + ["status", "--bootstrap", boot, "--json", *args],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def sessions_open(net: Internet, name: str) -> float:
    """The peer's diffuse_sessions_open gauge, read from its own namespace (its --metrics port)."""
    out = subprocess.run(net.prefix(name) + ["python3", "-c", (
        "import urllib.request\n"
        "text = urllib.request.urlopen('http://127.0.0.1:9464/metrics', timeout=2).read().decode()\n"
        "print(sum(float(l.split()[-1]) for l in text.splitlines() if l.startswith('diffuse_sessions_open')))")],
        capture_output=True, text=True, timeout=30)
    return float(out.stdout.strip() or 0)


ROUTERS = {"peerA": "10.97.0.11", "peerB": "10.97.0.13"}  # each peer's home router, as the internet sees it


@pytest.mark.parametrize("fault", ["kill", "cut"])
def test_a_relayed_session_broken_mid_answer_fails_over_to_the_replica(home, tmp_path, key_env, internet, reference,
                                                                       fault):
    """Two peers serving the same blocks, each behind its own home router, both reached through
    the sentinel's relay (hole punching off); mid-generation, the one serving the client's
    session is SIGKILLed (kill), or lives on while the relay loses its connection to it (cut: its
    TCP connections reset at the relay by `ss -K`, every circuit to it ends there): the client
    replays into the other, through the relay too, and the answer is unchanged."""
    net = internet
    net.public("sentinel", "10.97.0.1")
    net.home("peerA", ROUTERS["peerA"], 1)
    net.home("peerB", ROUTERS["peerB"], 3)
    net.home("client", "10.97.0.12", 2)
    base = ["--home", str(home)]
    children: dict[str, Child] = {}
    try:
        children["sentinel"] = Child("sentinel", base + ["sentinel", "--identity", str(tmp_path / "s.key"),
                                                         "--listen", "/ip4/10.97.0.1/tcp/0"],
                                     tmp_path / "sentinel.log", prefix=net.prefix("sentinel"))
        boot = children["sentinel"].wait_for("/ip4/", 120)
        ids = {}
        for name in ("peerA", "peerB"):
            children[name] = Child(name, base + [
                "join", "--bootstrap", boot, "--blocks", "1:30", "--heartbeat", "5", "--metrics", "127.0.0.1:9464",
                "--no-hole-punch", "--identity", str(tmp_path / f"{name}.key")], tmp_path / f"{name}.log",
                prefix=net.prefix(name))
        for name in ("peerA", "peerB"):
            addr = children[name].wait_for("/ip4/", 180)
            assert "/p2p-circuit/" in addr, addr
            ids[name] = addr.rsplit("/", 1)[1]
            children[name].wait_for("serving ", 180)
        client = subprocess.Popen(net.prefix("client") + CLI + base + [
            "--client-only", "ask", "--bootstrap", boot, "--json", "--max-tokens", str(TOKENS), "--wait", "60",
            "--no-speculate", "--no-hole-punch", "--trust", "off", "--step-timeout", "10", QUESTION],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            victim = None
            deadline = time.monotonic() + 240
            while victim is None and client.poll() is None and time.monotonic() < deadline:
                victim = next((n for n in ("peerA", "peerB") if sessions_open(net, n) > 0), None)
            assert victim is not None, "no peer ever held the client's session"
            if fault == "kill":
                children[victim].p.kill()  # SIGKILL mid-generation
            else:
                cut = subprocess.run(net.prefix("sentinel") + ["ss", "-K", "dst", ROUTERS[victim]],
                                     capture_output=True, text=True, timeout=30)
                assert cut.returncode == 0 and ROUTERS[victim] in cut.stdout, cut.stdout + cut.stderr  # sockets gone
            out, err = client.communicate(timeout=300)
        finally:
            if client.poll() is None:
                client.kill()
                client.wait()
        assert client.returncode == 0, err
        got = json.loads(out)
        assert got["token_ids"] == reference
        assert got["failovers"] and got["failovers"][0]["peer"] == ids[victim], got["failovers"]
        if fault == "cut":
            assert children[victim].p.poll() is None  # the peer lived on: its path broke
        survivor = "peerB" if victim == "peerA" else "peerA"
        assert [(h["peer"], h["reached"]["state"]) for h in got["route"]] == [(ids[survivor], "relayed")]
    finally:
        for child in reversed(list(children.values())):
            child.stop()


def test_relays_from_the_dht_and_hole_punching_by_default(home, tmp_path, key_env, internet, reference):
    """Everything at its defaults but the sentinel's relay, turned off: a public peer R relays
    (`join --relay`, blocks 1:10) and so is listed under the DHT's relays key; peer A (blocks
    10:20) behind a port-preserving home router and peer B (20:30) behind `MASQUERADE
    --random-fully` (a new port per flow: symmetric-like) are refused by the sentinel, find R in
    the DHT and reserve there. A client behind a third router asks: its hop to R is direct, DCUtR
    punches a direct path to A through both routers, and the prediction of B's port fails, so
    that hop stays relayed; `status` from the client's namespace shows the same; the answer is
    the in-process one."""
    net = internet
    net.public("sentinel", "10.97.0.1")
    net.public("relay", "10.97.0.2")
    net.home("peerA", "10.97.0.11", 1)
    net.home("peerB", "10.97.0.12", 2, random_fully=True)
    net.home("client", "10.97.0.13", 3)
    base = ["--home", str(home)]
    children: list[Child] = []
    try:
        sentinel = Child("sentinel", base + ["sentinel", "--no-relay", "--identity", str(tmp_path / "s.key"),
                                             "--listen", "/ip4/10.97.0.1/tcp/0"],
                         tmp_path / "sentinel.log", prefix=net.prefix("sentinel"))
        children.append(sentinel)
        boot = sentinel.wait_for("/ip4/", 120)
        addrs = {}
        for name, blocks in (("relay", "1:10"), ("peerA", "10:20"), ("peerB", "20:30")):
            extra = ["--relay"] if name == "relay" else []
            child = Child(name, base + ["join", "--bootstrap", boot, "--blocks", blocks, "--heartbeat", "5", *extra,
                                        "--identity", str(tmp_path / f"{name}.key")],
                          tmp_path / f"{name}.log", prefix=net.prefix(name))
            children.append(child)
            addrs[name] = child.wait_for("/ip4/", 180)
            child.wait_for("serving ", 180)
        ids = {name: addr.rsplit("/", 1)[1] for name, addr in addrs.items()}
        relay = ids["relay"]
        for name in ("peerA", "peerB"):  # announced only at the relay the DHT listed
            assert addrs[name] == f"{addrs['relay']}/p2p-circuit/p2p/{ids[name]}", addrs
        got = ask_json(net, "client", base, boot)
        assert got["token_ids"] == reference
        expect = [(relay, [1, 10], {"state": "direct", "via": None}),
                  (ids["peerA"], [10, 20], {"state": "hole-punched", "via": relay}),
                  (ids["peerB"], [20, 30], {"state": "relayed", "via": relay})]
        assert [(h["peer"], h["blocks"], h["reached"]) for h in got["route"]] == expect
        assert not got["failovers"]
        shown = {p["peer_id"]: p["reached"] for p in status_json(net, "client", base, boot)["models"][0]["peers"]}
        assert shown == {peer: reached for peer, _, reached in expect}, shown
    finally:
        for child in reversed(children):
            child.stop()
