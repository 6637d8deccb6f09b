#!/usr/bin/env python
"""A user-space TCP relay that makes loopback look like a wide-area link (no netem here).

    python scripts/latency_relay.py --rtt-ms 80 [--jitter-ms 5] [--mbps 50] [LISTEN_PORT:]TARGET_HOST:PORT ...

Each mapping listens on 127.0.0.1:LISTEN_PORT (0 or omitted: any free port) and forwards every
connection to its target. Each direction holds each chunk it reads for RTT/2 (+ uniform jitter
in [0, jitter]) before writing it, and, with a bandwidth limit, for its serialisation time
behind the chunks ahead of it; release times never decrease, so bytes keep their order.
The CLI prints `LISTEN_PORT TARGET` per mapping, then `ready`, and reads commands on stdin to
change the link while connections stay up: `rtt MS`, `jitter MS`, `mbps X` (0 = unlimited).
As a library: `Link` + `relay()` (trio), or `RelayProcess` of scripts/support/relay.py (this
script as a subprocess, driven the same way).
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import dataclass, field

import trio

CHUNK = 65536


@dataclass
class Link:
    """The emulated link; the relay reads it for every chunk, so changes apply at once."""

    rtt: float = 0.0  # seconds
    jitter: float = 0.0  # seconds, added uniformly to each one-way delay
    bandwidth: float = 0.0  # bytes per second per direction, 0 = unlimited
    seed: int = 0
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self.set(rtt=self.rtt, jitter=self.jitter, bandwidth=self.bandwidth)
        self.rng = random.Random(self.seed)

    def set(self, rtt: float | None = None, jitter: float | None = None, bandwidth: float | None = None) -> None:
        for name, value in (("rtt", rtt), ("jitter", jitter), ("bandwidth", bandwidth)):
            if value is not None:
                if value < 0:
                    raise ValueError(f"{name} must be >= 0, got {value}")
                setattr(self, name, value)

    def delay(self) -> float:
        return self.rtt / 2 + (self.rng.uniform(0, self.jitter) if self.jitter else 0.0)


async def _pump(src: trio.SocketStream, dst: trio.SocketStream, link: Link) -> None:
    """One direction: a reader stamping release times and a writer honouring them, in order."""
    send, receive = trio.open_memory_channel[tuple[float, bytes]](1 << 16)

    async def reader() -> None:
        last = wire_free = 0.0
        async with send:
            while data := await src.receive_some(CHUNK):
                now = trio.current_time()
                if link.bandwidth:
                    wire_free = max(wire_free, now) + len(data) / link.bandwidth
                    ready = wire_free
                else:
                    ready = now
                last = max(last, ready + link.delay())  # never overtake an earlier chunk
                await send.send((last, data))

    async def writer() -> None:
        async with receive:
            async for release, data in receive:
                await trio.sleep_until(release)
                await dst.send_all(data)
        await dst.send_eof()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader)
        nursery.start_soon(writer)


async def _connection(client: trio.SocketStream, target: tuple[str, int], link: Link) -> None:
    async with client:
        try:
            upstream = await trio.open_tcp_stream(*target)
        except OSError:
            return
        async with upstream:
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(_pump, client, upstream, link)
                    nursery.start_soon(_pump, upstream, client, link)
            except* (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass  # either side hung up: drop the other too, as a real link would


async def relay(target: tuple[str, int], link: Link, port: int = 0, host: str = "127.0.0.1", *,
                task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve one mapping forever; `await nursery.start(relay, ...)` returns the listening port."""
    listeners = await trio.open_tcp_listeners(port, host=host)
    task_status.started(listeners[0].socket.getsockname()[1])

    async def handle(stream: trio.SocketStream) -> None:
        await _connection(stream, target, link)

    await trio.serve_listeners(handle, listeners)


def parse_mapping(text: str) -> tuple[int, tuple[str, int]]:
    """[LISTEN_PORT:]HOST:PORT -> (listen port, (host, port))."""
    parts = text.split(":")
    try:
        if len(parts) == 2:
            return 0, (parts[0], int(parts[1]))
        if len(parts) == 3:
            return int(parts[0]), (parts[1], int(parts[2]))
    except ValueError:
        pass
    raise ValueError(f"mapping wants [LISTEN_PORT:]HOST:PORT, got {text!r}")


def apply_command(link: Link, line: str) -> None:
    """`rtt MS` | `jitter MS` | `mbps X`; ValueError on anything else."""
    words = line.split()
    if len(words) != 2 or words[0] not in ("rtt", "jitter", "mbps"):
        raise ValueError(f"unknown command {line.strip()!r}: want rtt MS, jitter MS or mbps X")
    value = float(words[1])
    if words[0] == "mbps":
        link.set(bandwidth=value * 1e6 / 8)
    else:
        link.set(**{words[0]: value / 1e3})


async def _main(mappings: list[tuple[int, tuple[str, int]]], link: Link, host: str = "127.0.0.1") -> None:
    async with trio.open_nursery() as nursery:
        for port, target in mappings:
            got = await nursery.start(relay, target, link, port, host)
            print(got, f"{target[0]}:{target[1]}", flush=True)
        print("ready", flush=True)
        async with trio.wrap_file(sys.stdin) as stdin:
            async for line in stdin:
                try:
                    apply_command(link, line)
                    print("ok", flush=True)
                except ValueError as e:
                    print(f"error: {e}", flush=True)
        nursery.cancel_scope.cancel()  # stdin closed: the parent is gone


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mapping", nargs="+", help="[LISTEN_PORT:]TARGET_HOST:TARGET_PORT")
    ap.add_argument("--rtt-ms", type=float, default=0.0)
    ap.add_argument("--jitter-ms", type=float, default=0.0)
    ap.add_argument("--mbps", type=float, default=0.0, help="bandwidth per direction (0 = unlimited)")
    ap.add_argument("--seed", type=int, default=0, help="jitter's random seed")
    ap.add_argument("--host", default="127.0.0.1", help="the address every mapping listens on")
    args = ap.parse_args()
    try:
        mappings = [parse_mapping(m) for m in args.mapping]
        link = Link(args.rtt_ms / 1e3, args.jitter_ms / 1e3, args.mbps * 1e6 / 8, args.seed)
    except ValueError as e:
        ap.error(str(e))
    trio.run(_main, mappings, link, args.host)


if __name__ == "__main__":
    main()
