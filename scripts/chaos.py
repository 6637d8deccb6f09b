#!/usr/bin/env python
"""Chaos against a real loopback swarm behind the OpenAI-compatible API, as a user meets it: do
answers survive peers dying, freezing or losing their connections, the sentinel restarting and a
whole span going down, and how soon do routes return to the peers afterwards?

    .venv/bin/python scripts/chaos.py [--scenario churn|gentle|cut|sentinel|span-down] [--duration 300]
                                      [--tail 30] [--seed 1] [--no-rescue] [--home DIR] [--json PATH] [--keep]

A private swarm (its key made by `diffuse swarm new`) starts on 127.0.0.1: a sentinel, six
`diffuse join` peers (blocks 0:10, 10:20 and 20:30, each twice, each on its own identity file, so
a restarted peer keeps its peer id) and `diffuse api`, all on the CLI's defaults (trust,
speculation, dtype). Without --home the embedded model is pulled into a temporary home. Eight
short prompts (with no near-tie in their answers: see PROMPTS) are asked once each with no fault
(greedy, at most 24 tokens): the references. Then 3 users loop over the prompts with the `openai`
client (max_retries=0, so that no retry hides a failure) for --duration seconds, while until
--tail seconds before the end an injector does, by --scenario:
- churn: every 6-12 s a random serving peer is SIGKILLed and restarted 4 s later (same identity,
  blocks and flags), or frozen for 4 s (SIGSTOP, then SIGCONT);
- gentle: a SIGKILL and restart every 15-25 s, no freezes;
- cut: every 6-12 s a random peer's TCP connections are reset by `ss -K` (the kernel's socket
  destroy, as root; this machine has no iptables): both ends see a reset, the process lives on;
- sentinel: churn, and the sentinel killed and restarted 4 s later (same identity and port) once,
  twice when the fault window is 2 minutes or more;
- span-down: both peers of blocks 10:20 down together for 15 s, then restarted, every 35-45 s.
A fault's random peer is drawn among the serving peers the latest answers were routed through
(any serving peer when none of those is up), so that faults meet sessions.
--no-rescue passes --no-rescue to `diffuse api` (it then computes no span in its own process).

The table: requests, failures by HTTP status or exception, answers that differ from their
reference, tokens computed by peers and by the API itself, each failover, and the time from the
end of the last fault (when the last restarted process printed that it serves) to the answer
from which on every route is peers only. Route facts come from each chat completion's `diffuse`
field; where it is absent they are reported as unknown. Exit status 0 only with no failed request
and every answer equal to its reference.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path

os.environ["DIFFUSE_TRAIN_DRAFT"] = "0"  # no child trains a draft head behind the measurement

from support.churn import GAPS, PROMPTS, SPANS, Injector, Load, Record, Swarm, ask, client, launched  # noqa: E402


def recovery(records: list[Record], since: float) -> float | str:
    """Seconds from `since` to the end of the first answer from which on every answer's route is
    peers only (or why there is no such figure)."""
    after = sorted((r for r in records if r.t0 >= since and r.error is None), key=lambda r: r.t0)
    known = [r for r in after if r.diffuse is not None]
    if not known:
        return "unknown (no route facts)" if after else "no answer after it"
    rescued = [k for k, r in enumerate(known) if r.diffuse.get("in_process")]
    if rescued and rescued[-1] == len(known) - 1:
        return "never: the last answer still had an in-process span"
    return known[rescued[-1] + 1 if rescued else 0].t1 - since


def summarize(records: list[Record], faults: list[dict], swarm: Swarm) -> dict:
    failed = Counter(r.error for r in records if r.error is not None)
    known = [r for r in records if r.diffuse is not None]
    tokens: Counter[str] = Counter()
    for r in known:
        tokens.update({k: v for k, v in (r.diffuse.get("tokens") or {}).items() if k in ("peers", "here")})
    ends = [f["back"] for f in faults]
    last = None if None in ends or not ends else max(ends)
    if last is not None:
        rec = recovery(records, last)
    else:
        rec = "a restarted process never served again" if ends else "no fault"
    failovers = [{**f, "answer_t0": r.t0, "answer_t1": r.t1} for r in known for f in r.diffuse.get("failovers") or []]
    return {"requests": len(records), "failed": dict(failed), "different": sum(r.same is False for r in records),
            "without_route_facts": sum(r.error is None for r in records) - len(known), "tokens": dict(tokens),
            "faults": dict(Counter(f["kind"] for f in faults)), "failovers": failovers, "last_fault_end": last,
            "recovery": rec,
            "problems": list(swarm.problems),
            "ok": not failed and all(r.same for r in records if r.error is None)}


def seconds(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def name_of(swarm: Swarm, peer: str | None) -> str:
    return swarm.names.get(peer or "", (peer or "?")[-6:])


def fault_before(faults: list[dict], t: float) -> str:
    prior = [f for f in faults if f["t"] <= t]
    return f"{prior[-1]['kind']} {'+'.join(prior[-1]['targets'])} @{prior[-1]['t']:.1f}" if prior else "-"


def report(args: argparse.Namespace, s: dict, records: list[Record], faults: list[dict], swarm: Swarm,
           refs: list[str]) -> None:
    here, peers = s["tokens"].get("here", 0), s["tokens"].get("peers", 0)
    share = (f"{peers} ({100 * peers / (peers + here):.1f}%) / {here} ({100 * here / (peers + here):.1f}%)"
             if peers + here else "unknown")
    last = "-" if s["last_fault_end"] is None else f"{s['last_fault_end']:.1f} s"
    rec = s["recovery"] if isinstance(s["recovery"], str) else f"{s['recovery']:.1f} s"
    rows = [("requests", s["requests"]), ("failed", sum(s["failed"].values())),
            ("failed by cause", ", ".join(f"{k}: {v}" for k, v in s["failed"].items()) or "-"),
            ("answers unlike the fault-free ones", s["different"]),
            ("answers without route facts", s["without_route_facts"]),
            ("tokens by peers / in the API", share),
            ("faults", ", ".join(f"{k} {v}" for k, v in s["faults"].items()) or "-"),
            ("failovers", len(s["failovers"])), ("last fault ended at", last),
            ("peers-only routes again after", rec)]
    print(f"\nscenario {args.scenario}, {args.duration:g} s of load by {args.users} users, faults until "
          f"{args.duration - args.tail:g} s, seed {args.seed}, {'no rescue' if args.no_rescue else 'rescue on'}\n")
    print("| measure | value |\n|---|---|")
    for k, v in rows:
        print(f"| {k} | {v} |")
    if s["failovers"]:
        print("\n| answer at s | peer | blocks | during | cause | noticed s | recovery s | last fault before |\n"
              "|---|---|---|---|---|---|---|---|")
        for f in s["failovers"]:
            print(f"| {f['answer_t0']:.1f} | {name_of(swarm, f.get('peer'))} | {f.get('blocks')} | {f.get('during')} | "
                  f"{f.get('cause')} | {seconds(f.get('noticed_s'))} | {seconds(f.get('recovery_s'))} | "
                  f"{fault_before(faults, f['answer_t1'])} |")
    for r in [r for r in records if r.same is False][:3]:
        route = [f"{name_of(swarm, h.get('peer'))}{h.get('blocks')}" for h in (r.diffuse or {}).get("route", [])]
        print(f"\ndiffers: prompt {r.prompt} at {r.t0:.1f} s, route {route or '?'}, in process "
              f"{(r.diffuse or {}).get('in_process', '?')}\n  want {refs[r.prompt]!r}\n  got  {r.text!r}")
    for p in s["problems"]:
        print(f"\nproblem: {p}")


def drive(args: argparse.Namespace, swarm: Swarm) -> dict:
    """References, then load and faults for --duration seconds; the summary."""
    refs = [ask(client(swarm.url, args.request_timeout), i)[0] for i in range(len(PROMPTS))]
    origin = time.monotonic()
    load = Load(swarm.url, args.users, args.request_timeout, refs, origin)
    injector = Injector(swarm, args.scenario, args.seed, origin, args.duration - args.tail, list(SPANS),
                        routed=load.routed)
    fault_thread = threading.Thread(target=injector.run, daemon=True)
    load.start()
    fault_thread.start()
    time.sleep(args.duration)
    injector.halt.set()
    fault_thread.join(60)
    load.stop(args.request_timeout + 10)
    injector.settle()
    records = sorted(load.records, key=lambda r: r.t0)
    s = summarize(records, injector.faults, swarm)
    report(args, s, records, injector.faults, swarm, refs)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "summary": s, "faults": injector.faults,
                                               "references": refs, "peers": swarm.names,
                                               "records": [asdict(r) for r in records]}, indent=1))
    return s


def run(args: argparse.Namespace) -> dict:
    """The whole run: the summary."""
    with launched(args, "diffuse-chaos-", ["--no-rescue"] if args.no_rescue else []) as swarm:
        return drive(args, swarm)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenario", default="churn", choices=list(GAPS))
    ap.add_argument("--duration", type=float, default=300.0, help="seconds of load")
    ap.add_argument("--tail", type=float, default=30.0, help="seconds at the end with no fault")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--users", type=int, default=3)
    ap.add_argument("--request-timeout", type=float, default=120.0)
    ap.add_argument("--no-rescue", action="store_true", help="pass --no-rescue to `diffuse api`")
    ap.add_argument("--home", help="a data directory holding the model (default: a temporary one, pulled)")
    ap.add_argument("--json", help="write the summary, the faults and every request here")
    ap.add_argument("--keep", action="store_true", help="keep the children's logs (printed where)")
    return ap


def main() -> None:
    args = parser().parse_args()
    if args.tail >= args.duration:
        parser().error("--tail must be shorter than --duration")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # so `finally` kills the children
    sys.exit(0 if run(args)["ok"] else 1)


if __name__ == "__main__":
    main()
