"""The daemon: one process per home that keeps a node and the client service warm between commands.

It holds the home's pid file locked for its whole life (a second daemon, or `start`, sees it; the
lock dies with the process, so a SIGKILLed daemon leaves nothing that looks alive), binds the
control socket (mode 0600) before anything slow so that `start` can watch it come up, then runs
the peer (none for a client-only or local daemon) beside the client service, whose models, head,
tokenizer, draft head, connections and trust material stay loaded. Requests wait until the
service is open; each is answered on its own connection, and one's failure is its own.
"""

from __future__ import annotations

import fcntl
import logging
import math
import os
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import msgspec
import trio

from diffuse.client.service import Service, ServiceConfig, open_service
from diffuse.daemon import protocol
from diffuse.daemon.protocol import BAD_REQUEST, FAILED, MISMATCH, encode, error
from diffuse.errors import DiffuseError
from diffuse.model import store
from diffuse.validate import Malformed

log = logging.getLogger(__name__)
MAX_SOCKET_PATH = 100  # sun_path holds 108 bytes on Linux, 104 on macOS
WARM_S = 120.0  # the most a starting daemon waits for the trust plane's material
LOCK_S = 1.0  # how long a starting daemon tries for the pid file's lock
REQUEST_S = 30.0  # the most a connection may take to send its request line (then it is closed)


@dataclass(frozen=True)
class DaemonConfig:
    home: Path
    service: ServiceConfig  # the client service it keeps open
    role: str  # "peer", "client-only" or "local"


@contextmanager
def pid_lock(home: Path) -> Iterator[None]:
    """This home's pid file, locked and holding our pid while the daemon lives."""
    _, pid_path, _ = protocol.paths(home)
    home.mkdir(parents=True, exist_ok=True)
    fd = _lock(pid_path, home)
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    try:
        yield
    finally:
        protocol.paths(home)[0].unlink(missing_ok=True)
        pid_path.unlink(missing_ok=True)
        os.close(fd)


def _lock(pid_path: Path, home: Path) -> int:
    """The pid file open and exclusively locked. Tried for LOCK_S: a `running` probe holds a shared
    lock for an instant, and is no daemon. The file locked must still be the one at the path (a
    leaving daemon or a stale cleanup unlinks it while holding the lock)."""
    deadline = time.monotonic() + LOCK_S
    while True:
        fd = os.open(pid_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if time.monotonic() < deadline:
                os.close(fd)
                time.sleep(0.05)
                continue
            other = os.read(fd, 32).decode(errors="replace").strip()
            os.close(fd)
            raise DiffuseError(f"a daemon already runs for {home} (pid {other})") from None
        with suppress(FileNotFoundError):
            if os.stat(pid_path).st_ino == os.fstat(fd).st_ino:
                return fd
        os.close(fd)


async def _listen(path: Path) -> trio.SocketListener:
    if len(str(path)) > MAX_SOCKET_PATH:
        raise DiffuseError(f"the control socket's path {path} is too long for a Unix socket: use a shorter --home")
    path.unlink(missing_ok=True)  # ours: the pid lock says no daemon holds it
    sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
    old = os.umask(0o177)  # created 0600: only the owner speaks to its daemon
    try:
        await sock.bind(str(path))
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    sock.listen(64)
    return trio.SocketListener(sock)


class Daemon:
    """`run` is the body `until_signal` runs; `peer` (peer/join.py's Peer) serves beside it."""

    def __init__(self, config: DaemonConfig, peer: Any = None) -> None:
        self.config, self.peer = config, peer
        if peer is not None:
            peer.show = self.show  # what it serves is part of the daemon's status
        self.service: Service | None = None
        self.ready = trio.Event()
        self.started = time.time()
        self.listeners: set[trio.MemorySendChannel] = set()  # asks streaming now: they get the notices
        self.shown: list[str] = []  # what the peer said it serves
        self.names: dict[str, str] = {}  # store names and ids of the offered models -> model id

    def say(self, text: str) -> None:
        print(f"notice: {text}", file=sys.stderr, flush=True)
        for channel in list(self.listeners):
            with suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                channel.send_nowait({"notice": text})

    def show(self, text: str) -> None:
        print(text, flush=True)
        self.shown += text.splitlines()

    async def run(self) -> None:
        home = self.config.home
        with pid_lock(home):
            listener = await _listen(protocol.paths(home)[0])
            async with trio.open_nursery() as nursery:
                nursery.start_soon(trio.serve_listeners, self._handle, [listener])
                if self.peer is not None:
                    nursery.start_soon(self.peer.run)
                    while not self.shown:  # its node up and its blocks announced, then the client's node
                        await trio.sleep(0.1)
                config = replace(self.config.service, say=self.say)
                async with open_service(config) as service:
                    self.names = {n: i.manifest.model_id for n in config.models
                                  if (i := store.info(store.resolve(home, n)))}
                    self.names |= {m: m for m in service.orders}
                    await _trust_warm(service)
                    self.service = service
                    self.ready.set()
                    print(f"daemon ready: pid {os.getpid()}, socket {protocol.paths(home)[0]}", flush=True)
                    await trio.sleep_forever()

    def status(self) -> dict[str, Any]:
        service, auto = self.service, getattr(self.peer, "lending", None)
        contribution = auto.state() if auto is not None else (
            {"level": self.peer.config.serve.contribution} if self.peer is not None else {})
        return {"pid": os.getpid(), "home": str(self.config.home), "role": self.config.role,
                "state": "ready" if service else "starting", "started": self.started,
                "models": list(service.orders) if service else [], "mode": service.mode if service else None,
                "contribution": contribution, "serving": self.shown[-4:],
                "load": dict(self.peer.hooks.status_fn() or {}) if self.peer and self.peer.hooks.status_fn else {}}

    def mismatch(self, local: bool, bootstrap: list[str], models: list[str]) -> str | None:
        """Why this daemon's service is not what a request asks for (None: it is). A request that
        names neither --local nor a swarm takes the daemon's, whichever it is."""
        swarm = self.config.service.swarm
        if local and swarm is not None:
            return "it answers through the swarm"
        if bootstrap and (swarm is None or set(bootstrap) - set(swarm.bootstrap)):
            return "it answers from a whole model in its process" if swarm is None else "it joined the swarm " \
                "through other bootstrap peers"
        unknown = [m for m in models if m not in self.names]
        return f"it does not offer {', '.join(unknown)}" if unknown else None

    def _why_not(self, request: protocol.Ask | protocol.Survey | protocol.Api) -> str | None:
        if isinstance(request, protocol.Survey):
            return self.mismatch(False, request.bootstrap, []) if self.config.service.swarm else "it runs no swarm"
        models = ([request.model] if request.model else []) if isinstance(request, protocol.Ask) else request.models
        return self.mismatch(request.local, request.bootstrap, models) or self.other_options(request)

    def other_options(self, request: protocol.Routed) -> str | None:
        """The first per-ask option the request gives that this daemon's service does not run with."""
        service, swarm = self.config.service, self.config.service.swarm
        runs = {"quant": service.quant, "exact": service.exact, "route": swarm.options.route if swarm else None,
                "accept_quant": _variants(swarm.options.accept_quant) if swarm else None}
        for name in protocol.OPTIONS:
            asked = getattr(request, name)
            asked = _variants(asked) if name == "accept_quant" else asked
            if asked is not None and asked != runs[name]:
                if swarm is None and name in ("route", "accept_quant"):
                    return f"it answers from a whole model in its process, not with {_flag(name, asked)}"
                return f"it runs with {_flag(name, runs[name])}, not {_flag(name, asked)}"
        return None

    async def _handle(self, stream: trio.SocketStream) -> None:
        async with stream:
            try:
                line = None
                with trio.move_on_after(REQUEST_S):  # a silent connection does not hold a task forever
                    line = await _read_line(stream)
                if line is None:
                    return
                try:
                    request = protocol.parse(line)
                except Malformed as e:
                    await stream.send_all(error(f"bad request: {e}"))
                    return
                await self._answer(request, stream)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                log.info("a control connection closed mid-answer")
            except Exception:  # noqa: BLE001 - a bug answering one request must not take the node down
                log.exception("a control request failed")

    async def _answer(self, request: protocol.Requests, stream: trio.SocketStream) -> None:
        if isinstance(request, protocol.Status):
            await stream.send_all(encode({"ok": self.status()}))
            return
        if isinstance(request, protocol.Stop):
            await stream.send_all(encode({"ok": {"pid": os.getpid()}}))
            os.kill(os.getpid(), signal.SIGTERM)  # the way out a signal takes: a peer drains first
            return
        await self.ready.wait()
        why = self._why_not(request)
        if why is not None:
            await stream.send_all(error(why, MISMATCH))
            return
        try:
            if isinstance(request, protocol.Ask):
                await self._ask(request, stream)
            elif isinstance(request, protocol.Survey):
                await stream.send_all(encode({"ok": await self._survey(request)}))
            else:
                await self._api(request, stream)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise
        except ValueError as e:  # sampling parameters out of range
            await stream.send_all(error(str(e), BAD_REQUEST))
        except Exception as e:  # noqa: BLE001 - one request's failure is its own: the daemon serves on
            if not isinstance(e, DiffuseError):
                log.exception("a %s request failed", type(request).__name__.lower())
            await stream.send_all(error(str(e) or type(e).__name__, FAILED))

    async def _ask(self, request: protocol.Ask, stream: trio.SocketStream) -> None:
        from diffuse.client.sampling import SamplingParams

        params = SamplingParams(**msgspec.structs.asdict(request.sampling))
        service = self.service
        assert service is not None
        messages = [{"role": m.role, "content": m.content} for m in request.messages]
        send, receive = trio.open_memory_channel[dict](math.inf)

        async def pump() -> None:
            async for reply in receive:
                await stream.send_all(encode(reply))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(pump)
            self.listeners.add(send)
            try:
                answer = await service.answer(messages, params, lambda text: send.send_nowait({"text": text}),
                                              model=self.names.get(request.model or ""), store=request.keep)
                send.send_nowait({"ok": service.answer_dict(answer)})
            finally:
                self.listeners.discard(send)
                send.close()

    async def _survey(self, request: protocol.Survey) -> dict[str, Any]:
        from diffuse.client.survey import status

        swarm = replace(self.config.service.swarm, wait=request.wait)
        return await status(self.config.home, request.models, swarm, request.reach, request.accept_quant,
                            request.model_hash)

    async def _api(self, request: protocol.Api, stream: trio.SocketStream) -> None:
        from diffuse.api.app import Settings, create_app
        from diffuse.http import serve_http

        settings = Settings(api_keys=frozenset(request.api_keys), max_sessions=request.max_sessions,
                            max_queue=request.max_queue, default_max_tokens=request.default_max_tokens)
        async with trio.open_nursery() as nursery:
            urls = await nursery.start(serve_http, create_app(self.service, settings), request.listen)
            await stream.send_all(encode({"ok": {"listening": urls[0]}}))
            while await stream.receive_some(4096):  # served until `diffuse api` lets go
                pass
            nursery.cancel_scope.cancel()


def _variants(accept: str | None) -> str | None:
    """--accept-quant's LIST in one spelling ("int8, none" and "none,int8" are the same)."""
    return None if accept is None else ",".join(sorted({v.strip().lower() for v in accept.split(",") if v.strip()}))


def _flag(name: str, value: Any) -> str:
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return flag if value else "--no-" + flag[2:]
    return f"the default {flag}" if value is None else f"{flag} {value}"


async def _trust_warm(service: Service) -> None:
    """Until the trust plane's material for the spans a first session would route through is
    computed (client/swarm_backend.py warms it in the background; the first `ask` would wait for
    it), at most WARM_S: a daemon is ready when an answer costs only its own steps."""
    trust = getattr(service.backend, "trust", None)
    if trust is None:
        return
    await trio.sleep(0.05)  # the warm-up tasks say their state before their first wait
    with trio.move_on_after(WARM_S):
        while any(state["state"] in ("waiting for a route", "computing") for state in trust.values()):
            await trio.sleep(0.1)


async def _read_line(stream: trio.SocketStream) -> bytes | None:
    """One request line (None: closed before one came); too long a line is answered and refused."""
    buf = b""
    while b"\n" not in buf:
        if len(buf) > protocol.MAX_LINE:
            await stream.send_all(error(f"bad request: a line longer than {protocol.MAX_LINE} bytes"))
            return None
        chunk = await stream.receive_some(65536)
        if not chunk:
            return buf or None
        buf += chunk
    return buf.split(b"\n", 1)[0]

