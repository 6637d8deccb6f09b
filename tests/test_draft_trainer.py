"""Background draft-head training: it waits for idleness, stops its child while the parent is
busy and continues it after, writes the head, leaves nothing behind when killed, runs once per
home, and is off with --no-train-draft or DIFFUSE_TRAIN_DRAFT=0; a `diffuse api` process left idle
starts it, and ends it as it leaves."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from tokenizers import pre_tokenizers

from diffuse.client import draft_trainer as DT
from diffuse.client import draft_head
from diffuse.model.tokenizer import build_tokenizer_json
from tiny import make_tiny

SHORT = ("--answers", "100", "--text", "0", "--epochs", "1")


@pytest.fixture(scope="module")
def tiny_home(tmp_path_factory) -> Path:
    """A home holding a tiny model with a byte-level tokenizer (no chat template: plain prompts)."""
    home = tmp_path_factory.mktemp("trainer")
    path = make_tiny(home / "models" / "tiny")
    (path / "tokenizer.json").write_text(build_tokenizer_json(sorted(pre_tokenizers.ByteLevel.alphabet()), [],
                                                              [1] * 256))
    (path / "tokenizer_config.json").write_text("{}")
    return home


def until(cond: Callable[[], bool], timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.05)


def state(pid: int) -> str:
    """The process state letter in /proc (T: stopped), '' once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return ""


def gone(pid: int) -> bool:
    return state(pid) in ("", "Z", "X")


def test_trains_when_idle_pauses_while_busy(tiny_home):
    busy = threading.Event()
    busy.set()
    lines: list[str] = []
    file = draft_head.path(tiny_home, "tiny")
    trainer = DT.DraftTrainer(tiny_home, "tiny", busy.is_set, idle=0.5, poll=0.05, extra=SHORT, log=lines.append)
    with trainer:  # leaving kills the child, whatever happened
        time.sleep(1.0)
        assert trainer.child is None, "started while busy"
        busy.clear()
        until(lambda: trainer.child is not None, 10, "the child to start")
        pid = trainer.child.pid
        assert os.getpriority(os.PRIO_PROCESS, pid) == 19
        busy.set()
        until(lambda: state(pid) == "T", 10, "the child to stop")
        time.sleep(1.0)
        assert state(pid) == "T" and not file.exists()
        busy.clear()
        until(lambda: state(pid) != "T", 10, "the child to continue")
        until(lambda: trainer.child.poll() is not None, 50, "the training to end")
        until(lambda: lines[-1].startswith(("trained", "training failed")), 10, "the trainer to see it end")
    assert draft_head.load(file, 64) is not None
    assert [ln.split(":")[0].split(" ")[0] for ln in lines] == ["training", "paused", "resumed", "trained"], lines
    with DT.DraftTrainer(tiny_home, "tiny", lambda: False, idle=0.0, poll=0.05, extra=SHORT) as again:
        time.sleep(0.3)
        assert again.child is None, "trained a model that has a head"


def test_leaving_kills_the_child_and_a_second_trainer_waits_its_turn(tiny_home, tmp_path):
    home = tmp_path / "home"
    (home / "models").mkdir(parents=True)
    (home / "models" / "tiny").symlink_to(tiny_home / "models" / "tiny")
    file = draft_head.path(home, "tiny")
    lines: list[str] = []
    first = DT.DraftTrainer(home, "tiny", lambda: False, idle=0.0, poll=0.05, extra=("--answers", "10000000"),
                            log=lines.append)
    with first:
        until(lambda: first.child is not None, 10, "the child to start")
        pid = first.child.pid
        with DT.DraftTrainer(home, "tiny", lambda: False, idle=0.0, poll=0.05, log=lines.append) as second:
            until(lambda: any("another process" in ln for ln in lines), 10, "the second to find the lock")
            assert second.child is None
        time.sleep(2.0)  # the child is importing or decoding
    assert gone(pid) and first.child.returncode is not None
    assert not file.exists() and not file.with_suffix(".tmp").exists()
    assert lines[-1] == "training stopped: leaving", lines


def test_off_by_flag_or_environment(monkeypatch):
    from diffuse.cli import build_parser

    monkeypatch.delenv(DT.ENV, raising=False)
    assert DT.enabled(True) and not DT.enabled(False)
    monkeypatch.setenv(DT.ENV, "0")
    assert not DT.enabled(True)
    parser = build_parser()
    assert parser.parse_args(["join", "--no-train-draft"]).train_draft is False
    assert parser.parse_args(["join"]).train_draft is True
    assert parser.parse_args(["api", "--no-train-draft"]).train_draft is False
    assert parser.parse_args(["api"]).train_draft is True


def test_conftest_turns_it_off_for_spawned_processes():
    assert os.environ.get(DT.ENV) == "0"


def test_counting_counts_v1_requests_only():
    import trio

    activity: dict[str, float] = {}
    seen: list[float] = []

    async def app(scope, receive, send):
        seen.append(activity["requests"])

    wrapped = DT.counting(app, activity)
    trio.run(wrapped, {"type": "http", "path": "/v1/chat/completions"}, None, None)
    trio.run(wrapped, {"type": "http", "path": "/status.json"}, None, None)
    assert seen == [1, 0] and activity["requests"] == 0


@pytest.mark.timeout(300)
def test_an_idle_api_trains_a_head_in_the_background_and_stops_it_when_it_leaves(tiny_home, tmp_path):
    """`diffuse api` as a process, training left on: after DraftTrainer's 30 idle seconds it
    starts `diffuse model draft-head` at nice 19 as its child, and a SIGTERM to the API ends it,
    leaving no head behind."""
    from support.procs import Procs

    home = tmp_path / "home"
    (home / "models").mkdir(parents=True)
    (home / "models" / "tiny").symlink_to(tiny_home / "models" / "tiny")
    with Procs(home) as procs:
        api = procs.start("api", "--local", "--model", "tiny", "--listen", "127.0.0.1:0", env={DT.ENV: "1"})
        api.read_until("listening on", timeout=120)
        training = lambda: [ln for ln in api.stderr if ln.startswith("draft head: training")]  # noqa: E731
        until(lambda: bool(training()), 120, "the API to start training")
        line = training()[0]
        pid = int(line.split("(pid ")[1].split(",")[0])
        assert b"draft-head" in Path(f"/proc/{pid}/cmdline").read_bytes() and os.getpriority(os.PRIO_PROCESS, pid) == 19
        api.signal(signal.SIGTERM)
        assert api.wait(60) == 0
    assert gone(pid), state(pid)
    assert "draft head: training stopped: leaving" in api.stderr, api.stderr
    assert not draft_head.path(home, "tiny").exists()
