"""Headless Chromium driven over the DevTools protocol: a page is loaded, waited for until a
condition the test names holds, read back as HTML and photographed, each step under a deadline.

Why not `--dump-dom` / `--screenshot`: they wait on a virtual-time budget, which on a loaded
machine sometimes never ends, and they cannot wait for what the test needs to see. Here a
browser that stops answering fails the step's deadline, is killed, and is tried once afresh.
"""

from __future__ import annotations

import base64
import itertools
import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import trio
from trio_websocket import ConnectionClosed, HandshakeError, open_websocket_url

ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--remote-debugging-port=0"]


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if not found:  # under CI the skip fails the run (conftest.py)
        pytest.skip("no Chromium on this machine (apt-get install -y chromium)")
    return found


class DevTools:
    """Calls on one DevTools websocket; events that arrive between replies are dropped."""

    def __init__(self, ws) -> None:
        self.ws = ws
        self.ids = itertools.count(1)

    async def call(self, method: str, session: str | None = None, **params) -> dict:
        n = next(self.ids)
        message = {"id": n, "method": method, "params": params} | ({"sessionId": session} if session else {})
        await self.ws.send_message(json.dumps(message))
        while True:
            reply = json.loads(await self.ws.get_message())
            if reply.get("id") == n:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]

    async def value(self, session: str, expression: str):
        got = await self.call("Runtime.evaluate", session, expression=expression, returnByValue=True)
        return got["result"].get("value")


async def _drive(ws_url: str, url: str, until: str, shot: Path | None, size: tuple[int, int],
                 timeout: float) -> str:
    with trio.fail_after(timeout):
        async with open_websocket_url(ws_url, max_message_size=64 << 20) as ws:
            dt = DevTools(ws)
            target = await dt.call("Target.createTarget", url="about:blank")
            session = (await dt.call("Target.attachToTarget", targetId=target["targetId"], flatten=True))["sessionId"]
            await dt.call("Emulation.setDeviceMetricsOverride", session, width=size[0], height=size[1],
                          deviceScaleFactor=1, mobile=False)
            await dt.call("Page.navigate", session, url=url)
            while not await dt.value(session, f"Boolean({until})"):
                await trio.sleep(0.2)
            html = await dt.value(session, "document.documentElement.outerHTML")
            if shot is not None:
                png = await dt.call("Page.captureScreenshot", session, format="png")
                shot.write_bytes(base64.b64decode(png["data"]))
            return html


def _devtools_url(proc: subprocess.Popen, profile: Path, timeout: float) -> str:
    """The browser's websocket, from the DevToolsActivePort file it writes once it listens."""
    port_file = profile / "DevToolsActivePort"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        lines = port_file.read_text().split() if port_file.exists() else []
        if len(lines) == 2:
            return f"ws://127.0.0.1:{lines[0]}{lines[1]}"
        time.sleep(0.1)
    raise RuntimeError(f"chromium did not open its DevTools port (exit {proc.poll()})")


def render(url: str, profile: Path, until: str, screenshot: Path | None = None,
           size: tuple[int, int] = (1400, 1000), timeout: float = 90) -> str:
    """The page's HTML once the JavaScript expression `until` is true, photographed then if asked.
    A browser that hangs is killed and tried once more with a fresh profile."""
    browser, failed = chromium(), None
    for attempt in (1, 2):
        folder = Path(f"{profile}-{attempt}")
        folder.mkdir(parents=True, exist_ok=True)
        log = (folder / "chromium.log").open("w")
        proc = subprocess.Popen([browser, *FLAGS, f"--user-data-dir={folder}", "about:blank"],
                                stdout=subprocess.DEVNULL, stderr=log)
        try:
            ws_url = _devtools_url(proc, folder, timeout)
            return trio.run(_drive, ws_url, url, until, screenshot, size, timeout)
        except (trio.TooSlowError, RuntimeError, OSError, ConnectionClosed, HandshakeError) as e:
            failed = f"{e!r}; its log: {folder / 'chromium.log'}"
        finally:
            proc.kill()
            proc.wait(timeout=30)
            log.close()
    raise AssertionError(f"chromium on {url}, twice: {failed}")
