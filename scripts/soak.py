#!/usr/bin/env python
"""Does a long run leak? Steady API load on a churning loopback swarm, every process sampled each
minute, and a verdict on those that live through it.

    .venv/bin/python scripts/soak.py [--minutes 30] [--users 3] [--seed 1] [--home DIR]
                                     [--plot docs/figures/soak.png] [--json PATH] [--keep]

The swarm of scripts/chaos.py (a sentinel, six peers on blocks 0:10, 10:20, 20:30 twice, `diffuse
api`; every peer and the sentinel with --metrics), and its users
(`openai` client, max_retries=0, greedy answers to eight prompts) for --minutes. Every 30-60 s one
of a1, b1, c0 and c1 is SIGKILLed and restarted 4 s later; a0 and b0 are never touched, so their
growth, like the API's and the sentinel's, is the process's own. Each minute, per process: RSS
(/proc/PID/status VmRSS), open file descriptors (/proc/PID/fd), open sessions (gauge
diffuse_sessions_open of its /metrics, all roles) and stored DHT records (gauge
diffuse_dht_records_stored; n/a where the process does not export it). After the load stops, up to
30 s for the sessions to close, and a last sample.

Verdict for the API, the sentinel, a0 and b0: RSS grew at most 5% or 20 MB from minute 5 (the
middle sample in runs under 10 minutes) to the last minute of load; file descriptors within 5 of
their minute-5 count; no session open after the load; stored records never above twice their
minute-5 count plus 10. Exit status 0 when every check passes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

os.environ["DIFFUSE_TRAIN_DRAFT"] = "0"  # no child trains a draft head behind the measurement

import httpx  # noqa: E402

from support.churn import PROMPTS, Injector, Load, Swarm, ask, client, launched  # noqa: E402

CHURNED = ["a1", "b1", "c0", "c1"]
LONG_LIVED = ["api", "sentinel", "a0", "b0"]
PROCESSES = ["api", "sentinel", "a0", "a1", "b0", "b1", "c0", "c1"]
FIELDS = ("rss_mb", "fds", "sessions", "records")


def rss_mb(pid: int) -> float | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:  # gone: a churned peer between its death and restart
        return None
    found = re.search(r"^VmRSS:\s+(\d+) kB", status, re.M)
    return int(found.group(1)) / 1024 if found else None


def open_fds(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def scrape(url: str | None) -> dict[str, float]:
    """A /metrics page as {'name{labels}': value}; empty where there is none or it does not answer."""
    if url is None:
        return {}
    try:
        text = httpx.get(url, timeout=10).text
    except httpx.HTTPError:
        return {}
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^([^#\s]+) (\S+)$", text, re.M)}


def gauge(metrics: dict[str, float], name: str) -> float | None:
    """The sum of a gauge over its labels; None where the page does not have it."""
    values = [v for k, v in metrics.items() if k == name or k.startswith(name + "{")]
    return sum(values) if values else None


def sample(swarm: Swarm, name: str) -> dict:
    pid = swarm.pid(name)
    metrics = scrape(swarm.metrics.get(name))
    return {"pid": pid, "rss_mb": rss_mb(pid), "fds": open_fds(pid),
            "sessions": gauge(metrics, "diffuse_sessions_open"),
            "records": gauge(metrics, "diffuse_dht_records_stored")}


def show(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}" if isinstance(value, float) and value % 1 else f"{value:.0f}"


def print_minute(label: str, rows: dict[str, dict]) -> None:
    print(f"\n{label}\n| process | pid | RSS MB | fds | sessions | DHT records |\n|---|---|---|---|---|---|")
    for name, row in rows.items():
        print(f"| {name} | {row['pid']} | " + " | ".join(show(row[f]) for f in FIELDS) + " |", flush=True)


def sessions_closed(swarm: Swarm, timeout: float) -> dict[str, dict]:
    """Samples once no long-lived process reports an open session, or after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        rows = {name: sample(swarm, name) for name in PROCESSES}
        if time.monotonic() > deadline or not any(rows[n]["sessions"] for n in LONG_LIVED):
            return rows
        time.sleep(2)


def checks(minutes: list[dict[str, dict]], after: dict[str, dict]) -> list[tuple[str, str, bool]]:
    """(process, check and figures, passed) for each long-lived process."""
    base = 5 if len(minutes) > 10 else len(minutes) // 2
    out = []
    for name in LONG_LIVED:
        first, last = minutes[base][name], minutes[-1][name]
        grew = last["rss_mb"] - first["rss_mb"]
        out.append((name, f"RSS {first['rss_mb']:.0f} -> {last['rss_mb']:.0f} MB ({grew:+.1f})",
                    grew <= max(0.05 * first["rss_mb"], 20.0)))
        out.append((name, f"fds {first['fds']} -> {last['fds']}", abs(last["fds"] - first["fds"]) <= 5))
        if after[name]["sessions"] is not None:
            out.append((name, f"sessions open after the load: {show(after[name]['sessions'])}",
                        after[name]["sessions"] == 0))
        if first["records"] is not None:
            top = max(m[name]["records"] or 0 for m in minutes[base:])
            out.append((name, f"DHT records {show(first['records'])} at minute {base}, at most {show(top)} after",
                        top <= 2 * first["records"] + 10))
    return out


def plot(minutes: list[dict[str, dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(9, 10), sharex=True)
    for ax, (field, title) in zip(axes, [("rss_mb", "RSS (MB)"), ("fds", "open file descriptors"),
                                         ("records", "stored DHT records")]):
        for name in PROCESSES:
            ys = [m[name][field] for m in minutes]
            if any(y is not None for y in ys):
                ax.plot(range(len(ys)), [float("nan") if y is None else y for y in ys], label=name,
                        linestyle="--" if name in CHURNED else "-")
        ax.set_ylabel(title)
        ax.grid(alpha=0.3)
    axes[0].legend(ncol=4, fontsize="small")
    axes[-1].set_xlabel("minute (dashed: churned peers, restarted on new PIDs)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def soak(args: argparse.Namespace, swarm: Swarm) -> bool:
    refs = [ask(client(swarm.url, 120), i)[0] for i in range(len(PROMPTS))]
    origin = time.monotonic()
    load = Load(swarm.url, args.users, 120, refs, origin)
    churn = Injector(swarm, "gentle", args.seed, origin, args.minutes * 60, CHURNED, gaps=(30, 60))
    faults = threading.Thread(target=churn.run, daemon=True)
    load.start()
    faults.start()
    minutes: list[dict[str, dict]] = []
    for m in range(args.minutes + 1):
        time.sleep(max(0.0, origin + 60 * m - time.monotonic()))
        minutes.append({name: sample(swarm, name) for name in PROCESSES})
        print_minute(f"minute {m}: {len(load.records)} requests, {sum(r.error is not None for r in load.records)} "
                     f"failed, {len(churn.faults)} restarts", minutes[-1])
    churn.halt.set()
    faults.join(60)
    load.stop(130)
    after = sessions_closed(swarm, 30)
    print_minute("after the load", after)
    verdict = checks(minutes, after)
    print("\n| process | check | ok |\n|---|---|---|")
    for name, what, ok in verdict:
        print(f"| {name} | {what} | {'yes' if ok else 'NO'} |")
    plot(minutes, Path(args.plot))
    print(f"\nplot: {args.plot}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "minutes": minutes, "after": after,
                                               "faults": churn.faults, "problems": swarm.problems}, indent=1))
    return all(ok for _, _, ok in verdict)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=int, default=30)
    ap.add_argument("--users", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--home", help="a data directory holding the model (default: a temporary one, pulled)")
    ap.add_argument("--plot", default="docs/figures/soak.png")
    ap.add_argument("--json", help="write every sample and restart here")
    ap.add_argument("--keep", action="store_true", help="keep the children's logs (printed where)")
    args = ap.parse_args()
    if args.minutes < 2:
        ap.error("--minutes must be at least 2")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # so `finally` kills the children
    with launched(args, "diffuse-soak-", metrics=True) as swarm:
        ok = soak(args, swarm)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
