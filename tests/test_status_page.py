"""The status page (GET /) rendered by headless Chromium: every peer and block is on it.

The API serves a fake swarm (api_helpers.FakeSwarm: three peers, an excluded one, a model with
uncovered blocks). Chromium runs the page's script, and its DOM is read back through the
data-* attributes the page sets. The screenshot is kept as artifacts/status_page.png.
"""

from __future__ import annotations

import re
from html.parser import HTMLParser

import httpx
import pytest

from browser import ARTIFACTS, render
from api_helpers import FULL, NUM_BLOCKS, PARTIAL, PEER_A, PEER_B, PEER_C, PEER_X, fake_server_cmd
from support.procs import start_server, stop_server

pytestmark = pytest.mark.slow
# The page rendered, after its first fetch of status.json and two refreshes (the browser's own
# resource timings).
REFRESHED = ('document.body.dataset.ready && '
             'performance.getEntriesByType("resource").filter(e => e.name.endsWith("/status.json")).length >= 3')


class Elements(HTMLParser):
    """Collects, per model section, the data-* attributes of the elements in it."""

    def __init__(self):
        super().__init__()
        self.model: str | None = None
        self.found: dict[str, list[dict[str, str]]] = {}
        self.ready = False

    def handle_starttag(self, tag, attrs):
        a = {k: v or "" for k, v in attrs}
        if tag == "body" and a.get("data-ready"):
            self.ready = True
        if "data-model" in a:
            self.model = a["data-model"]
            self.found[self.model] = []
        elif self.model and any(k.startswith("data-") for k in a):
            self.found[self.model].append(a)


def test_status_page_shows_every_peer_and_block(smollm2, tmp_path):
    proc, url = start_server(fake_server_cmd(smollm2), tmp_path / "server.log")
    try:
        ARTIFACTS.mkdir(exist_ok=True)
        shot = ARTIFACTS / "status_page.png"
        shot.unlink(missing_ok=True)
        dom = render(url + "/", tmp_path / "profile", REFRESHED, shot)
        metrics = httpx.get(url + "/metrics").text
    finally:
        stop_server(proc)

    page = Elements()
    page.feed(dom)
    assert page.ready, "the page never rendered /status.json"
    assert set(page.found) == {FULL, PARTIAL}
    expected = {FULL: ({PEER_A, PEER_B, PEER_C}, [2] * 10 + [3, 3] + [2] * 18),
                PARTIAL: ({PEER_A, PEER_B}, [1] * 10 + [2, 2] + [1] * 8 + [0] * 10)}
    for model, (peers, replicas) in expected.items():
        found = page.found[model]
        blocks = {int(a["data-block"]): int(a["data-replicas"]) for a in found if "data-block" in a}
        assert blocks == dict(enumerate(replicas)) and len(blocks) == NUM_BLOCKS
        assert {a["data-peer"] for a in found if "data-peer" in a} == peers  # the block map
        assert {a["data-peer-row"] for a in found if "data-peer-row" in a} == peers  # the peer table
    assert [a["data-excluded"] for a in page.found[FULL] if "data-excluded" in a] == [PEER_X]
    assert "NOT servable: blocks 20-29 uncovered" in dom and "late" in dom  # PEER_C missed heartbeats

    served = re.search(r'^diffuse_api_requests_total{code="200",endpoint="/status.json"} (\S+)$', metrics, re.M)
    assert served and float(served.group(1)) >= 3, "the page did not refresh itself"
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
