"""Shared fixtures: the tiny-model helpers, scripts/support (the processes, swarms and relays
that tests and scripts share) and the scripts under test are importable; the real model is
converted once.

No claim is green by skipping: when `CI` is set, a test that skips (a missing browser, package,
privilege or tool) fails the run, naming what it lacked; elsewhere the run ends by listing each
test it could not run and why (each reason says how to install what it needs)."""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

import pytest

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1] / "scripts")]
os.environ["DIFFUSE_TRAIN_DRAFT"] = "0"  # no peer or API a test starts trains a draft head behind it
os.environ["DIFFUSE_TEST_ZYGOTE"] = "1"  # `Procs` children fork from a process that has imported torch


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("CI") and report.skipped and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        report.longrepr = f"{item.nodeid}: skipped, and under CI every claim must run: {_reason(report)}"


def pytest_terminal_summary(terminalreporter) -> None:
    skipped = terminalreporter.stats.get("skipped", [])
    if skipped:
        count = f"{len(skipped)} test{'s' if len(skipped) != 1 else ''}"
        terminalreporter.section(f"{count} not run on this machine (CI would fail them)", yellow=True)
        for report in skipped:
            terminalreporter.line(f"{report.nodeid}: {_reason(report)}")


def _reason(report) -> str:
    """A skip's reason, without pytest's "Skipped: " prefix."""
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return text.removeprefix("Skipped: ")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Modules with slow tests (multi-process swarms, real models) first, each module's tests in
    their own order: the two workers of `make test` take whole modules, so the long ones start
    early and the short ones fill the end."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)


@pytest.fixture(scope="session")
def home(tmp_path_factory) -> Path:
    """A data directory holding the embedded SmolLM2, converted once per test run (~5 s)."""
    from diffuse.model import store

    home = tmp_path_factory.mktemp("home")
    store.pull(home, None)
    return home


@pytest.fixture(scope="session")
def smollm2(home) -> Path:
    from diffuse.home import DEFAULT_MODEL, models_dir

    return models_dir(home) / DEFAULT_MODEL


@pytest.fixture(scope="session")
def gemma_pulled(tmp_path_factory, worker_id) -> tuple[Path, Path, list[str]]:
    """A store with gemma-3-270m pulled as `diffuse model pull` does: (home, model dir, what it said).
    Pulled once per run (about 30 s): under xdist the first worker to need it pulls, under a lock,
    into the run's shared directory, and the others take that store (they only read its model)."""
    from filelock import FileLock

    from diffuse.model import packages, store

    shared = tmp_path_factory.getbasetemp().parent if worker_id != "master" else tmp_path_factory.mktemp("gemma")
    home, said = shared / "gemma-home", shared / "gemma-home.json"
    with FileLock(str(shared / "gemma-home.lock")):
        if not said.exists():
            lines: list[str] = []
            path = store.pull(home, packages.GEMMA_3_270M.name, lines.append)
            said.write_text(json.dumps({"path": str(path), "lines": lines}))
        pulled = json.loads(said.read_text())
    return home, Path(pulled["path"]), pulled["lines"]


def pytest_collection_finish(session) -> None:
    """What collection imported (torch, libp2p, every test module: about half a million objects)
    lives until the end: frozen, no collection walks it again (see _free_cycles)."""
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def _free_cycles():
    """After each test, collect reference cycles: a client's or a peer's weights held in a cycle
    (an object and a bound method of it) are otherwise freed only when Python's collector next
    runs, which counts objects, not bytes, so a worker's memory grows test by test. Only what
    is not frozen is walked: a full walk took about 0.3-0.7 s a test, most of the suite's CPU in
    its runs of short tests."""
    yield
    gc.collect()


@pytest.fixture(scope="module", autouse=True)
def _freeze_after_module():
    """After each module (its module-scoped fixtures gone), everything is walked once, what lives
    on frozen: a cycle that held a frozen object is collected here at the latest."""
    yield
    gc.unfreeze()
    gc.collect()
    gc.freeze()
