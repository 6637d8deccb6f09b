#!/usr/bin/env python
"""Round trips of a decode STEP's size over one Noise + yamux stream, with and without
diffuse.control.quick_io (py-libp2p as released is the baseline, measured in the same run).

    .venv/bin/python scripts/bench_transport.py [--trips 1000] [--gap-ms 20] [--repeats 3]

An echo server and a client run in two processes made by `make_host` (so with TCP_NODELAY,
Noise, yamux and PY_YAMUX_RELEASE_ON_READ=0 as every Diffuse node), both with
DIFFUSE_QUICK_IO=0 or both without it, alternating. The client sends 1,200-byte messages (a
one-token STEP of a 576-wide model in fp16 is 1,152 bytes of tensor plus its header) and waits for
each echo: back to back, and after sleeping --gap-ms (as a client waits while a peer computes, so
both processes wake up cold). Per mode: the median round trip, the client's CPU per round trip, how
often the client's trio run loop went to epoll per round trip, and the WINDOW_UPDATE frames the
client sent per round trip; then each quick_io value's ratio to the baseline's.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

SIZE = 1200
PROTO = "/diffuse/bench-echo/1"


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def _serve() -> None:
    import multiaddr
    import trio
    from libp2p.crypto.ed25519 import create_new_key_pair

    from diffuse.control.host import make_host

    host = make_host(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"])

    async def echo(stream) -> None:
        while data := await stream.read(65536):
            await stream.write(data)

    host.set_stream_handler(PROTO, echo)
    async with host.run([multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
        print(f"{host.get_addrs()[0]}", flush=True)
        await trio.sleep_forever()


async def _client(addr: str, trips: int, gap: float) -> dict:
    import multiaddr
    import trio
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.stream_muxer.yamux import yamux

    from diffuse.control.host import make_host, parse_peer_addr

    updates = 0
    send_update = yamux.YamuxStream.send_window_update

    async def counted(self, *a, **kw):
        nonlocal updates
        updates += 1
        await send_update(self, *a, **kw)

    yamux.YamuxStream.send_window_update = counted

    class Passes(trio.abc.Instrument):
        n = 0

        def before_io_wait(self, timeout: float) -> None:
            self.n += 1

    host = make_host(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"])
    async with host.run([multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
        info = parse_peer_addr(addr)
        await host.connect(info)
        stream = await host.new_stream(info.peer_id, [PROTO])
        msg = os.urandom(SIZE)

        async def trip() -> float:
            t = time.perf_counter()
            await stream.write(msg)
            got = 0
            while got < SIZE:
                got += len(await stream.read(65536))
            return time.perf_counter() - t

        for _ in range(100):
            await trip()
        out = {}
        for name, pause in (("back to back", 0.0), ("after a gap", gap)):
            n = trips if not pause else max(trips // 5, 50)
            passes = Passes()
            trio.lowlevel.add_instrument(passes)
            updates, cpu, rtts = 0, 0.0, []
            for _ in range(n):
                if pause:
                    time.sleep(pause)  # the whole process idles, as a client does while a peer computes
                c = _cpu()
                rtts.append(await trip())
                cpu += _cpu() - c
            trio.lowlevel.remove_instrument(passes)
            out[name] = {"rtt_ms": statistics.median(rtts) * 1e3, "cpu_ms": cpu / n * 1e3,
                         "passes": passes.n / n, "updates": updates / n}
        await stream.close()
        return out


def _child(args: list[str], quick: bool) -> subprocess.Popen:
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    env.pop("DIFFUSE_QUICK_IO", None)
    if not quick:
        env["DIFFUSE_QUICK_IO"] = "0"
    return subprocess.Popen([sys.executable, __file__, *args], stdout=subprocess.PIPE, text=True, env=env)


def _round(quick: bool, trips: int, gap_ms: float) -> dict:
    server = _child(["--serve"], quick)
    try:
        addr = server.stdout.readline().strip()
        if not addr:
            raise SystemExit("the echo server did not start")
        client = _child(["--client", addr, "--trips", str(trips), "--gap-ms", str(gap_ms)], quick)
        try:
            out, _ = client.communicate(timeout=600)
        finally:
            client.kill()
        return json.loads(out.strip().splitlines()[-1])
    finally:
        server.kill()
        server.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trips", type=int, default=1000)
    ap.add_argument("--gap-ms", type=float, default=20.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--client", help=argparse.SUPPRESS)
    args = ap.parse_args()
    import trio

    if args.serve:
        trio.run(_serve)
        return
    if args.client:
        print(json.dumps(trio.run(_client, args.client, args.trips, args.gap_ms / 1000)))
        return

    runs: dict[bool, list[dict]] = {False: [], True: []}
    for r in range(args.repeats):
        for quick in (False, True) if r % 2 == 0 else (True, False):
            runs[quick].append(_round(quick, args.trips, args.gap_ms))
            print(f"repeat {r} quick_io={'on' if quick else 'off'}: {runs[quick][-1]}", file=sys.stderr)

    def med(quick: bool, case: str, key: str) -> float:
        return statistics.median(run[case][key] for run in runs[quick])

    print(f"\n1,200-byte round trips over one Noise + yamux stream, 2 processes on 127.0.0.1; median of "
          f"{args.repeats} alternated repeats ({args.trips} back to back, {max(args.trips // 5, 50)} after "
          f"{args.gap_ms:g} ms idle each); load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}\n")
    print("| case | quick_io | round trip ms | client CPU ms per trip | run-loop passes per trip | "
          "window updates per trip | round trip vs off | CPU vs off |")
    print("|---|---|---|---|---|---|---|---|")
    for case in ("back to back", "after a gap"):
        for quick in (False, True):
            rtt, cpu = med(quick, case, "rtt_ms"), med(quick, case, "cpu_ms")
            print(f"| {case} | {'on' if quick else 'off'} | {rtt:.3f} | {cpu:.3f} | {med(quick, case, 'passes'):.1f} | "
                  f"{med(quick, case, 'updates'):.2f} | {rtt / med(False, case, 'rtt_ms'):.2f}x | "
                  f"{cpu / med(False, case, 'cpu_ms'):.2f}x |")


if __name__ == "__main__":
    main()
