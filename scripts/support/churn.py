"""chaos.py's swarm and its load, shared by the scripts that churn one (chaos.py, soak.py): a
private loopback swarm behind `diffuse api` whose every process restarts on the same arguments
(Swarm, launched), users asking the fault-free prompts through the `openai` client (PROMPTS, ask,
client, Load), and the faults of each scenario, injected while they ask (Injector)."""

from __future__ import annotations

import argparse
import atexit
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import openai

from diffuse.peer.loopback import CLI, Child
from diffuse.control.host import parse_peer_addr
from diffuse.errors import DiffuseError
from diffuse.home import DEFAULT_MODEL

from .procs import free_port

SPANS = {"a0": "0:10", "a1": "0:10", "b0": "10:20", "b1": "10:20", "c0": "20:30", "c1": "20:30"}
# Chosen for a margin of at least 0.25 (two bf16 steps) between the greedy token's logit and the next
# one's at every token of their answers, measured in one process: with the default bf16 most prompts
# meet exact ties within 24 tokens, which batching with other users' steps flips without any fault.
PROMPTS = ["What is the capital of Japan?", "What is the plural of mouse?", "How many days are in a week?",
           "What is the capital of Germany?", "What is 12 times 12?",
           "What is the capital of Russia?", "Count from one to ten.", "What is the capital of England?"]
MAX_TOKENS = 24
START_TIMEOUT = 300.0  # seconds a process may take to serve: six peers load at once on two cores
PAUSE = 4.0  # seconds a killed process stays down, or a frozen one stopped
READY = {"sentinel": "/ip4/", "join": "serving ", "api": "listening on"}  # stdout line once each serves
GAPS = {"churn": (6, 12), "gentle": (15, 25), "cut": (6, 12), "sentinel": (6, 12), "span-down": (35, 45)}  # s


def run_cli(home: Path, *args: str, timeout: float = 600) -> None:
    r = subprocess.run([*CLI, "--home", str(home), *args], capture_output=True, text=True, timeout=timeout)
    if r.returncode:
        raise DiffuseError(f"diffuse {' '.join(args)} exited {r.returncode}:\n{r.stderr}")


class Swarm:
    """The sentinel, the peers and the API as `diffuse` children, each restartable on the same
    arguments (identity, blocks, ports, flags); `close` SIGKILLs whatever still runs."""

    def __init__(self, home: Path, work: Path, api_args: list[str] | None = None, metrics: bool = False):
        self.home, self.work, self.key = home, work, work / "swarm.key"
        self.api_args, self.with_metrics = api_args or [], metrics
        self.args: dict[str, list[str]] = {}
        self.children: dict[str, Child] = {}
        self.starts: Counter[str] = Counter()
        self.ready_at: dict[tuple[str, int], float] = {}  # (name, start number) -> when it served
        self.ready_line: dict[str, str] = {}
        self.names: dict[str, str] = {}  # peer id -> name
        self.metrics: dict[str, str] = {}  # name -> /metrics URL
        self.problems: list[str] = []
        atexit.register(self.close)

    def launch(self, peers: dict[str, str] = SPANS) -> None:
        run_cli(self.home, "swarm", "new", "--out", str(self.key))
        key = ["--swarm-key", str(self.key)]
        self.args["sentinel"] = ["sentinel", "--identity", str(self.work / "sentinel.key"), "--listen",
                                 f"/ip4/127.0.0.1/tcp/{free_port()}", *key,
                                 *self._metrics("sentinel", self.with_metrics)]
        self.restart("sentinel")
        self.wait_ready(["sentinel"])
        boot = self.ready_line["sentinel"]
        for name, span in peers.items():
            self.args[name] = ["join", "--bootstrap", boot, "--blocks", span, "--identity",
                               str(self.work / f"{name}.key"), "--listen", "/ip4/127.0.0.1/tcp/0", *key,
                               *self._metrics(name, self.with_metrics)]
        for name in peers:
            self.restart(name)
        self.wait_ready(list(peers))
        self.args["api"] = ["api", "--bootstrap", boot, "--listen", f"127.0.0.1:{free_port()}", *key, *self.api_args]
        self.restart("api")
        self.wait_ready(["api"])
        self.url = self.ready_line["api"].split()[-1]
        self.metrics["api"] = self.url + "/metrics"

    def _metrics(self, name: str, on: bool) -> list[str]:
        if not on:
            return []
        port = free_port()
        self.metrics[name] = f"http://127.0.0.1:{port}/metrics"
        return ["--metrics", f"127.0.0.1:{port}"]

    def restart(self, name: str) -> None:
        """Start `name` (again) on its arguments, without waiting for it to serve."""
        self.starts[name] += 1
        n = self.starts[name]
        child = Child(name, ["--home", str(self.home), *self.args[name]], self.work / f"{name}.{n}.log")
        self.children[name] = child
        threading.Thread(target=self._watch, args=(name, n, child), daemon=True).start()

    def _watch(self, name: str, n: int, child: Child) -> None:
        """Note when this start of `name` serves (and a peer's id), or why it never did, unless we killed it."""
        kind = self.args[name][0]
        try:
            if kind == "join":
                self.names[parse_peer_addr(child.wait_for("/ip4/", START_TIMEOUT)).peer_id.to_base58()] = name
            line = child.wait_for(READY[kind], START_TIMEOUT)
        except DiffuseError as e:
            if child.p.returncode != -signal.SIGKILL:
                self.problems.append(f"{name} (start {n}): {e}")
            return
        self.ready_line[name] = line
        self.ready_at[(name, n)] = time.monotonic()

    def wait_ready(self, names: list[str], timeout: float = START_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while not all(self.up(name) for name in names):
            if self.problems or time.monotonic() > deadline:
                late = [f"{n} (log {self.children[n].log.name})" for n in names if not self.up(n)]
                raise DiffuseError(f"not serving after {timeout:g} s: {', '.join(late)}; {self.problems}")
            time.sleep(0.2)

    def up(self, name: str) -> bool:
        """Whether the current start of `name` runs and has said it serves."""
        return (name, self.starts[name]) in self.ready_at and self.children[name].p.poll() is None

    def kill(self, name: str) -> None:
        child = self.children[name]
        child.p.kill()
        child.p.wait(timeout=10)
        child.stop()  # closes its log

    def signal(self, name: str, sig: int) -> None:
        if self.children[name].p.poll() is None:
            self.children[name].p.send_signal(sig)

    def cut(self, name: str) -> int:
        """Reset every established TCP connection of `name` (both ends); returns how many ports."""
        pid = self.children[name].p.pid
        out = subprocess.run(["ss", "-tnpH", "state", "established"], capture_output=True, text=True,
                             timeout=10, check=True).stdout
        ports = {line.split()[2].rsplit(":", 1)[1] for line in out.splitlines() if f"pid={pid}," in line}
        if ports:
            match = " or ".join(f"sport = :{p} or dport = :{p}" for p in sorted(ports))
            subprocess.run(["ss", "-K", "-tnH", "state", "established", f"( {match} )"], capture_output=True,
                           timeout=10, check=True)
        return len(ports)

    def pid(self, name: str) -> int:
        return self.children[name].p.pid

    def close(self) -> None:
        for child in self.children.values():
            if child.p.poll() is None:
                child.p.kill()  # a stopped process dies of it too
        for child in self.children.values():
            try:
                child.p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.problems.append(f"{child.name} (pid {child.p.pid}) outlived SIGKILL by 10 s")
            child.log.close()


class CutShort(Exception):
    """An answer that ended for another reason than a stop or its length."""


@dataclass
class Record:
    """One request as a user met it; times in seconds since the load began."""

    user: int
    prompt: int
    t0: float
    t1: float = 0.0
    error: str | None = None
    text: str | None = None
    diffuse: dict | None = None  # the answer's route facts; None where the API gave none
    same: bool | None = None


def client(url: str, timeout: float) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=timeout)


def ask(api: openai.OpenAI, prompt: int) -> tuple[str, dict | None]:
    """The greedy answer and its `diffuse` route facts; an answer cut short (say, by uncovered
    blocks) is a failure, as a user would count it."""
    r = api.chat.completions.create(model=DEFAULT_MODEL, messages=[{"role": "user", "content": PROMPTS[prompt]}],
                                    temperature=0, max_tokens=MAX_TOKENS)
    choice = r.choices[0]
    if choice.finish_reason not in ("stop", "length"):
        raise CutShort(f"finish_reason {choice.finish_reason}")
    return choice.message.content or "", (r.model_extra or {}).get("diffuse")


class Load:
    """`users` threads asking the prompts in turn (each from its own first one) until stopped."""

    def __init__(self, url: str, users: int, timeout: float, refs: list[str], origin: float):
        self.api, self.refs, self.origin = client(url, timeout), refs, origin
        self.records: list[Record] = []
        self.halt = threading.Event()
        self.threads = [threading.Thread(target=self._user, args=(u,), daemon=True) for u in range(users)]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def _user(self, u: int) -> None:
        i = u
        while not self.halt.is_set():
            self.records.append(self.one(u, i % len(PROMPTS)))
            i += 1

    def one(self, user: int, prompt: int) -> Record:
        rec = Record(user, prompt, time.monotonic() - self.origin)
        try:
            rec.text, rec.diffuse = ask(self.api, prompt)
            rec.same = rec.text == self.refs[prompt]
        except openai.APIStatusError as e:
            rec.error = f"HTTP {e.status_code}"
        except openai.APIError as e:
            rec.error = type(e).__name__
        except CutShort as e:
            rec.error = str(e)
        rec.t1 = time.monotonic() - self.origin
        return rec

    def routed(self, answers: int = 6) -> set[str]:
        """The peer ids the latest `answers` answers were routed through."""
        return {h["peer"] for r in self.records[-answers:] for h in (r.diffuse or {}).get("route") or ()}

    def stop(self, timeout: float) -> None:
        self.halt.set()
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))


class Injector:
    """The scenario's faults, from the start of the load until `until` seconds into it. Each fault
    keeps when it began (t) and when the swarm had all of it back (back; for a restart, filled
    in by `settle` once the process said it serves again)."""

    def __init__(self, swarm: Swarm, scenario: str, seed: int, origin: float, until: float, churned: list[str],
                 gaps: tuple[float, float] | None = None, routed: Callable[[], set[str]] = set):
        self.swarm, self.scenario, self.rng, self.routed = swarm, scenario, random.Random(seed), routed
        self.origin, self.until, self.churned = origin, until, churned
        self.gaps = gaps or GAPS[scenario]
        self.faults: list[dict] = []
        self.halt = threading.Event()
        self.sentinel_due = [until / 3, 2 * until / 3] if until >= 120 else [until / 2]

    def now(self) -> float:
        return time.monotonic() - self.origin

    def gap(self) -> float:
        return self.rng.uniform(*self.gaps)

    def run(self) -> None:
        at = self.gap()
        while at < self.until and not self.halt.wait(max(0.0, at - self.now())):
            try:
                self.fault()
            except (OSError, subprocess.SubprocessError) as e:  # a fault that could not be done is reported
                self.swarm.problems.append(f"fault at {self.now():.1f} s: {e!r}")
            at = max(at + self.gap(), self.now())

    def fault(self) -> None:
        if self.scenario == "span-down":
            return self.down(["b0", "b1"], 15.0)
        if self.scenario == "sentinel" and self.sentinel_due and self.now() >= self.sentinel_due[0]:
            self.sentinel_due.pop(0)
            return self.down(["sentinel"], PAUSE)
        serving = [n for n in self.churned if self.swarm.up(n)]
        if not serving:
            return None
        routed = {self.swarm.names.get(peer) for peer in self.routed()}
        name = self.rng.choice([n for n in serving if n in routed] or serving)
        if self.scenario == "cut":
            self.faults.append({"kind": "cut", "targets": [name], "t": self.now(), "sockets": self.swarm.cut(name)})
            self.faults[-1]["back"] = self.faults[-1]["t"]
        elif self.scenario in ("churn", "sentinel") and self.rng.random() < 0.5:
            self.freeze(name)
        else:
            self.down([name], PAUSE)

    def down(self, names: list[str], seconds: float) -> None:
        fault = {"kind": "kill", "targets": names, "t": self.now()}
        self.faults.append(fault)
        for name in names:
            self.swarm.kill(name)
        self.halt.wait(seconds)
        for name in names:
            self.swarm.restart(name)
        fault["starts"] = {name: self.swarm.starts[name] for name in names}

    def freeze(self, name: str) -> None:
        self.faults.append({"kind": "freeze", "targets": [name], "t": self.now()})
        self.swarm.signal(name, signal.SIGSTOP)
        try:
            self.halt.wait(PAUSE)
        finally:
            self.swarm.signal(name, signal.SIGCONT)
        self.faults[-1]["back"] = self.now()

    def settle(self) -> None:
        """Fill in when each restart served again (None: it never did)."""
        for f in self.faults:
            if f["kind"] == "kill":
                times = [self.swarm.ready_at.get((n, s)) for n, s in f.get("starts", {}).items()]
                f["back"] = None if None in times or not times else max(times) - self.origin


def home_for(args: argparse.Namespace, work: Path) -> Path:
    if args.home:
        return Path(args.home)
    home = work / "home"
    print("pulling the embedded model into a temporary home...", file=sys.stderr, flush=True)
    run_cli(home, "model", "pull")
    return home


@contextmanager
def launched(args: argparse.Namespace, prefix: str, api_args: list[str] | None = None,
             metrics: bool = False) -> Iterator[Swarm]:
    """The swarm, serving, in a temporary work folder; every child killed and (unless --keep)
    the folder removed at the end."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    swarm = Swarm(home_for(args, work), work, api_args, metrics)
    try:
        print("starting a sentinel, 6 peers and the API...", file=sys.stderr, flush=True)
        swarm.launch()
        yield swarm
    finally:
        swarm.close()
        if args.keep:
            print(f"logs kept in {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
