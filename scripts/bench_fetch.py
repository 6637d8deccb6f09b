#!/usr/bin/env python
"""The block fetcher (diffuse/data/fetcher.py) from 1, 2 and 4 sources on loopback, against `cp`
of the same bytes and one raw libp2p stream moving them, in the same run.

    .venv/bin/python scripts/bench_fetch.py [--mib 256] [--repeats 2]

Each source is a process with a libp2p host (`make_host`: Noise, yamux, as every Diffuse node)
serving one random file with the reference FileServer, and a raw protocol that writes the file's
bytes down one stream with no framing (the baseline: what the transport alone moves), in writes
as long as the server's DATA frames (files.CHUNK, 1 MiB), so the ratio compares the same writes
and only the protocol differs; a second raw row writes 256 KiB at a time (the server's frames
before files 1.2), to show what the write size alone is worth. Each fetch
runs in a fresh process, so its peak RSS (ru_maxrss) is its own: the fetcher's should not grow
with the file (pieces go straight to disk), and the raw stream's process, which does the same
without the files protocol, is the floor. MB/s is the file's bytes over the fetch's wall time,
hash check and rename included; the median of the repeats. The last column says how many
sources the fetcher had at work when it finished (data/crew.py steers it by the rate they add).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RAW = "/diffuse/bench-raw/1"
SMALL_WRITE = 256 << 10  # the raw stream's writes in the second raw row


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


async def _serve(path: str) -> None:
    import multiaddr
    import trio
    from libp2p.crypto.ed25519 import create_new_key_pair

    from diffuse.control.host import make_host
    from diffuse.data.files import CHUNK, PROTOCOL_ID, FileServer

    host = make_host(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"])
    server = FileServer()
    sha, size = server.add(Path(path))

    async def files(stream) -> None:
        await server.serve(stream, str(stream.muxed_conn.peer_id))

    def raw(write: int):
        async def handle(stream) -> None:
            with open(path, "rb") as f:
                while block := f.read(write):
                    await stream.write(block)
            await stream.close()
        return handle

    host.set_stream_handler(PROTOCOL_ID, files)
    for write in (CHUNK, SMALL_WRITE):
        host.set_stream_handler(f"{RAW}/{write}", raw(write))
    async with host.run([multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
        print(json.dumps({"addr": f"{host.get_addrs()[0]}", "sha": sha, "size": size}), flush=True)
        await trio.sleep_forever()


async def _fetch(addrs: list[str], sha: str, size: int, dest: str, raw: int) -> dict:
    """The fetcher's run, or with `raw` (bytes per write) the raw stream's."""
    import multiaddr
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.network.stream.exceptions import StreamEOF

    from diffuse.control.host import make_host, parse_peer_addr
    from diffuse.data.fetcher import Fetcher
    from diffuse.data.files import PROTOCOL_ID

    host = make_host(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"])
    async with host.run([multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
        infos = {str(i.peer_id): i for i in map(parse_peer_addr, addrs)}
        for info in infos.values():
            await host.connect(info)
        start = time.perf_counter()
        if raw:
            (info,) = infos.values()
            stream = await host.new_stream(info.peer_id, [f"{RAW}/{raw}"])
            with open(dest, "wb") as out:
                try:
                    while data := await stream.read(1 << 20):
                        out.write(data)
                except StreamEOF:
                    pass
        else:
            async def open_stream(peer: str):
                return await host.new_stream(infos[peer].peer_id, [PROTOCOL_ID])

            fetcher = Fetcher(open_stream)
            await fetcher.fetch(sha, size, Path(dest), list(infos), "the file")
            await fetcher.close()
            kept = fetcher.width
        took = time.perf_counter() - start
    if os.path.getsize(dest) != size:
        raise SystemExit(f"fetched {os.path.getsize(dest)} bytes of {size}")
    return {"mbps": size / took / 1e6, "rss_mib": _rss_mib(), "kept": 1 if raw else kept}


def _child(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, *args], stdout=subprocess.PIPE, text=True,
                            env=os.environ | {"PYTHONUNBUFFERED": "1"})


def _run_fetch(addrs: list[str], sha: str, size: int, dest: Path, raw: int) -> dict:
    dest.unlink(missing_ok=True)
    p = _child("--fetch", json.dumps({"addrs": addrs, "sha": sha, "size": size, "dest": str(dest), "raw": raw}))
    out, _ = p.communicate(timeout=600)
    if p.returncode:
        raise SystemExit(f"a fetch failed (exit {p.returncode})")
    return json.loads(out.strip().splitlines()[-1])


def _cp(src: Path, dest: Path) -> dict:
    dest.unlink(missing_ok=True)
    start = time.perf_counter()
    subprocess.run(["cp", str(src), str(dest)], check=True)
    return {"mbps": src.stat().st_size / (time.perf_counter() - start) / 1e6, "rss_mib": float("nan"), "kept": 0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="the file's size")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    ap.add_argument("--fetch", help=argparse.SUPPRESS)
    args = ap.parse_args()
    import trio

    from diffuse.data.files import CHUNK

    if args.serve:
        trio.run(_serve, args.serve)
        return
    if args.fetch:
        job = json.loads(args.fetch)
        print(json.dumps(trio.run(_fetch, job["addrs"], job["sha"], job["size"], job["dest"], job["raw"])))
        return
    tmp = Path(tempfile.mkdtemp(prefix="bench-fetch-"))
    sources: list[subprocess.Popen] = []
    try:
        src = tmp / "file"
        with open(src, "wb") as f:
            for _ in range(args.mib):
                f.write(os.urandom(1 << 20))
        sources = [_child("--serve", str(src)) for _ in range(4)]
        info = [json.loads(p.stdout.readline()) for p in sources]
        addrs, sha, size = [i["addr"] for i in info], info[0]["sha"], info[0]["size"]
        cases = {"cp": lambda: _cp(src, tmp / "out"),
                 "raw libp2p stream, 1 source": lambda: _run_fetch(addrs[:1], sha, size, tmp / "out", CHUNK),
                 "raw stream, 256 KiB writes": lambda: _run_fetch(addrs[:1], sha, size, tmp / "out", SMALL_WRITE)}
        cases |= {f"fetcher, {n} source{'s' if n > 1 else ''}": (lambda n=n: _run_fetch(addrs[:n], sha, size,
                                                                                       tmp / "out", 0))
                  for n in (1, 2, 4)}
        runs: dict[str, list[dict]] = {name: [] for name in cases}
        for r in range(args.repeats):
            for name, case in cases.items() if r % 2 == 0 else reversed(cases.items()):
                runs[name].append(case())
                print(f"repeat {r} {name}: {runs[name][-1]}", file=sys.stderr)
    finally:
        for p in sources:
            p.kill()
            p.wait()
        shutil.rmtree(tmp, ignore_errors=True)

    def med(name: str, key: str) -> float:
        return statistics.median(run[key] for run in runs[name])

    raw = med("raw libp2p stream, 1 source", "mbps")
    print(f"\n{args.mib} MiB over loopback, sources in processes of their own; median of {args.repeats} alternated "
          f"repeats; the raw stream written {CHUNK >> 10} KiB at a time (as the server's frames); "
          f"{os.cpu_count()} CPUs, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}\n")
    print("| case | MB/s | vs raw stream | peak RSS MiB | sources at work at the end, per repeat |")
    print("|---|---|---|---|---|")
    for name in runs:
        rss, kept = med(name, "rss_mib"), ", ".join(str(run["kept"]) for run in runs[name])
        print(f"| {name} | {med(name, 'mbps'):.1f} | {med(name, 'mbps') / raw:.2f}x | "
              f"{'-' if rss != rss else f'{rss:.0f}'} | {kept if name.startswith('fetcher') else '-'} |")


if __name__ == "__main__":
    main()
