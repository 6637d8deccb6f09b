"""The commands' side of the control socket: plain sockets and JSON, no torch, no py-libp2p, so that
`ask`, `status` and `api` cost a connection while a daemon runs. Each call says None where no
daemon of the home answers (or it answers "mismatch": not the swarm or model asked for), and the
caller does the work itself; a stale socket (a daemon killed with SIGKILL) is said and removed.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import suppress
from pathlib import Path
from typing import Any

from diffuse.daemon import units
from diffuse.daemon.protocol import BAD_REQUEST, MISMATCH, OPTIONS, SAMPLING, encode, paths
from diffuse.errors import DiffuseError

Say = Callable[[str], None]
CONNECT_S = 5.0  # a live daemon accepts at once; a starting one binds its socket first thing
START_S, STOP_S = 600.0, 120.0  # the most `daemon start` waits for it to answer, `stop` for it to leave


def notice(text: str) -> None:
    print(f"notice: {text}", file=sys.stderr, flush=True)


def running(home: Path) -> int | None:
    """The pid of the daemon holding this home's pid-file lock, None where none does."""
    _, pid_path, _ = paths(home)
    try:
        fd = os.open(pid_path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        text = os.read(fd, 32).decode(errors="replace").strip()
        return int(text) if text.isdigit() else -1
    finally:
        os.close(fd)
    return None


def _clear_stale(home: Path, say: Say) -> None:
    """Remove a dead daemon's socket and pid file, holding the pid file's exclusive lock: a daemon
    starting now holds it (then nothing is stale) or waits, and checks that the file it locks is
    still the one at the path."""
    sock_path, pid_path, _ = paths(home)
    if not sock_path.exists():
        return
    try:
        fd = os.open(pid_path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if sock_path.exists() and os.stat(pid_path).st_ino == os.fstat(fd).st_ino:
            say(f"the daemon of {home} is gone (a stale socket: killed?); going on without it")
            sock_path.unlink(missing_ok=True)
            pid_path.unlink(missing_ok=True)
    except OSError:  # locked: a daemon lives (or is starting); the path changed: someone else cleaned up
        pass
    finally:
        os.close(fd)


def _open(home: Path, say: Say) -> socket.socket | None:
    sock_path, _, _ = paths(home)
    if running(home) is None:
        _clear_stale(home, say)
        return None
    deadline = time.monotonic() + CONNECT_S
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(str(sock_path))
            return sock
        except OSError:
            sock.close()
            if time.monotonic() > deadline or running(home) is None:
                say(f"the daemon of {home} does not answer on {sock_path}; going on without it")
                return None
            time.sleep(0.05)


class _Garbled(DiffuseError):
    """A reply line that is no JSON object: a daemon of another version (or not one)."""


def _replies(sock: socket.socket) -> Iterator[dict[str, Any]]:
    with sock.makefile("rb") as f:
        for line in f:
            try:
                reply = json.loads(line)
            except ValueError:
                raise _Garbled(line[:80]) from None
            if not isinstance(reply, dict):
                raise _Garbled(line[:80])
            yield reply


def _declined(reply: dict[str, Any], say: Say) -> bool:
    """Whether an error reply means "do it yourself": a daemon serving another swarm or model
    (mismatch), or one that does not understand the request (bad request: an older daemon whose
    protocol lacks a field this command sent); said."""
    if reply.get("kind") == MISMATCH:
        say(f"the daemon does not answer this ({reply['error']}); going on without it")
        return True
    if reply.get("kind") == BAD_REQUEST:
        say(f"the daemon does not understand this request ({reply['error']}: another version?); "
            "going on without it")
        return True
    return False


def call(home: Path, request: dict[str, Any], on_reply: Callable[[dict[str, Any]], None] | None = None,
         say: Say = lambda text: None) -> dict[str, Any] | None:
    """Send `request`, hand each intermediate reply to `on_reply`, return the last one's "ok";
    None where no daemon answers, or it answers for another swarm or model (said)."""
    sock = _open(home, say)
    if sock is None:
        return None
    replied = False
    try:
        with sock:
            sock.sendall(encode(request))
            for reply in _replies(sock):
                if "ok" in reply:
                    return reply["ok"]
                if "error" in reply:
                    if _declined(reply, say):
                        return None
                    raise DiffuseError(f"the daemon: {reply['error']}")
                replied = True
                if on_reply is not None:
                    on_reply(reply)
    except ConnectionError:
        pass
    except _Garbled as e:
        if not replied:
            say(f"the daemon of {home} answered what this command does not read ({e}); going on without it")
            return None
        raise DiffuseError(f"the daemon of {home} answered what this command does not read ({e})") from None
    if not replied:  # it died before a word (a SIGKILL as we connected): nothing to take back
        say(f"the daemon of {home} went away before it answered; going on without it")
        return None
    raise DiffuseError(f"the daemon of {home} went away mid-answer (see `diffuse daemon logs`)")


def fetched_first(options: dict[str, Any], home: Path, models: Sequence[str | None],
                  swarm: Callable[[], tuple[Any, ...]]) -> Sequence[str | None]:
    """`ask / api --from-swarm` (not --local): what the client holds, fetched by this process
    before a daemon is asked (client/options.py `fetch_for_client`, from the swarm `swarm()`
    resolves: its bootstrap addresses, access and mDNS); the store names to serve, by the daemon
    as any stored model or, where none answers for them, by this process. `options` (the
    command's, mutable) then says --from-swarm no more: nothing is fetched twice. Else `models`
    as given, and nothing heavy is imported."""
    if not options.get("from_swarm") or options.get("local"):
        return models
    from diffuse.client.options import fetch_for_client

    names = fetch_for_client(options, home, tuple(models), *swarm())
    options["from_swarm"] = False
    return names


def ask(home: Path, request: dict[str, Any] | None, on_text: Callable[[str], None] | None, say: Say) -> dict | None:
    """`diffuse ask` through the daemon: the answer as `ask --json` prints it, streamed to `on_text`
    (None: not through the daemon)."""
    if request is None:
        return None
    def reply(r: dict[str, Any]) -> None:
        if "text" in r and on_text is not None:
            on_text(r["text"])
        elif "notice" in r:
            say(r["notice"])

    return call(home, {"op": "ask"} | request, reply, say)


def given(options: dict[str, Any]) -> dict[str, Any]:
    """The per-ask options (--quant, --accept-quant, --route, --exact) the user set: the daemon
    answers only where its service runs with the same."""
    return {k: options[k] for k, default in OPTIONS.items() if options.get(k, default) != default}


def ask_request(options: dict[str, Any], messages: list[dict[str, str]]) -> dict[str, Any]:
    """What `ask`'s options ask of the daemon: the sampling, the model, whether it must be this
    machine's (--local) or a given swarm's (--bootstrap), whether to keep it in the history.
    With --from-swarm the command has fetched what the store lacked before (`fetched_first`):
    the model is then a stored one."""
    return {"messages": messages, "sampling": {k: options[k] for k in SAMPLING}, "model": options["model"],
            "local": options["local"], "bootstrap": options["bootstrap"], "keep": options["history"] is not False,
            **given(options)}


def survey_request(options: dict[str, Any]) -> dict[str, Any]:
    """What `status`'s options ask of the daemon; --accept-quant and --model-hash only where given,
    so that a daemon from before them answers a plain `status`."""
    request = {"op": "survey", "models": options["model"], "reach": options["reach"], "wait": options["wait"],
               "bootstrap": options["bootstrap"]}
    if options.get("accept_quant") is not None:
        request["accept_quant"] = options["accept_quant"]
    if options.get("model_hash"):
        request["model_hash"] = options["model_hash"]
    return request


def api_request(options: dict[str, Any], keys: frozenset[str]) -> dict[str, Any]:
    """What `api`'s options ask of the daemon (its history and draft-head options are the daemon's)."""
    return {"listen": options["listen"], "api_keys": sorted(keys), "max_sessions": options["max_sessions"],
            "max_queue": options["max_queue"], "default_max_tokens": options["max_tokens"],
            "models": options["model"], "local": options["local"], "bootstrap": options["bootstrap"],
            **given(options)}


def serve_api(home: Path, request: dict[str, Any], on_listening: Callable[[str], None], say: Say) -> bool:
    """`diffuse api` through the daemon: it serves HTTP from its client service for as long as
    this process holds the connection, that is until SIGINT or SIGTERM. False: no daemon did."""
    sock = _open(home, say)
    if sock is None:
        return False
    stop = {"now": False}

    def leave(*_: Any) -> None:
        stop["now"] = True
        with suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, leave)
    with sock:
        sock.sendall(encode({"op": "api"} | request))
        for reply in _replies(sock):
            if "error" in reply:
                if _declined(reply, say):
                    return False
                raise DiffuseError(f"the daemon: {reply['error']}")
            on_listening(reply["ok"]["listening"])
    if not stop["now"]:
        raise DiffuseError(f"the daemon of {home} stopped; so does this API")
    return True


def start(home: Path, argv: list[str], timeout: float, say: Say) -> dict[str, Any]:
    """Start `diffuse daemon run ARGV` in the background, its output appended to the home's log;
    back once it answers requests (its status), or with the log's end if it exits first."""
    pid = running(home)
    if pid is not None:
        raise DiffuseError(f"a daemon already runs for {home} (pid {pid}): `diffuse daemon stop` first")
    _open(home, say)  # removes a stale socket
    home.mkdir(parents=True, exist_ok=True)
    _, _, log_path = paths(home)
    with open(log_path, "ab") as log:
        child = subprocess.Popen([sys.executable, "-m", "diffuse", "--home", str(home.resolve()), *argv],
                                 stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
                                 env=os.environ | {"PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if child.poll() is not None:
            raise DiffuseError(f"the daemon exited with {child.returncode}; the end of {log_path}:\n{tail(home, 15)}")
        status = call(home, {"op": "status"}) if running(home) == child.pid else None
        if status is not None and status["state"] != "starting":
            return status
        time.sleep(0.1)
    raise DiffuseError(f"the daemon (pid {child.pid}) is still starting after {timeout:g} s: "
                       "see `diffuse daemon status` and `diffuse daemon logs`")


def stop(home: Path, timeout: float) -> int | None:
    """Ask the daemon to leave (a peer drains first) and wait until it is gone; SIGKILL past
    `timeout`. Its pid, or None where none ran."""
    pid = running(home)
    if pid is None:
        _open(home, lambda text: None)
        return None
    try:
        call(home, {"op": "stop"})
    except (OSError, DiffuseError):
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while running(home) is not None:
        if time.monotonic() > deadline:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            raise DiffuseError(f"the daemon (pid {pid}) did not stop within {timeout:g} s: killed")
        time.sleep(0.1)
    return pid


def run_argv(argv: list[str]) -> list[str]:
    """`daemon start|install OPTIONS` as the `daemon run OPTIONS` that runs the daemon: the global
    options kept but --home (given by whoever starts it, as an absolute path)."""
    at = argv.index("daemon")
    before, skip = [], False
    for arg in argv[:at]:
        if not skip and not arg.startswith("--home"):
            before.append(arg)
        skip = arg == "--home"
    return [*before, "daemon", "run", *argv[at + 2:]]


def tail(home: Path, lines: int) -> str:
    _, _, log_path = paths(home)
    try:
        with open(log_path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 256 * max(1, lines)))
            return b"\n".join(f.read().splitlines()[-lines:]).decode(errors="replace")
    except FileNotFoundError:
        return ""


def command(home: Path, action: str, argv: list[str], as_json: bool = False, lines: int = 40) -> tuple[str, int]:
    """`diffuse daemon ACTION` but run: what to print, and the exit status."""
    if action in ("start", "install"):
        run = run_argv(argv)
        return describe(start(home, run, START_S, notice)) if action == "start" else units.install(home, run), 0
    if action == "stop":
        pid = stop(home, STOP_S)
        return f"stopped the daemon of {home} (pid {pid})" if pid else f"no daemon runs for {home}", 0
    if action == "status":
        status = call(home, {"op": "status"}, say=notice)
        text = json.dumps(status) if as_json else describe(status) if status else f"no daemon runs for {home}"
        return text, 0 if status else 3
    return tail(home, lines) if action == "logs" else units.uninstall(home), 0


def describe(status: dict[str, Any]) -> str:
    """`diffuse daemon status` for people."""
    auto = status.get("contribution") or {}
    level = auto.get("level", "")
    paused = f" (paused: {auto['paused']})" if auto.get("paused") else ""
    lines = [f"daemon pid {status['pid']} for {status['home']}: {status['state']}, a {status['role']} node",
             f"answering: {', '.join(status.get('models', [])) or '-'} ({status.get('mode') or '-'})"]
    if level:
        lines.append(f"contribution: {level}{paused}")
    lines += status.get("serving", [])
    return "\n".join(lines)

