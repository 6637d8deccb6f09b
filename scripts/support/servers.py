"""Server processes for the scripts that measure through them: the `diffuse` command line as this
interpreter runs it, and a process started and waited for until it prints that it serves."""

from __future__ import annotations

import subprocess
import sys
import threading

DIFFUSE = [sys.executable, "-c", "from diffuse.cli import run; run()"]


def start_server(cmd: list[str], ready: str = "listening on ") -> tuple[subprocess.Popen, str]:
    """Start a process and wait for its stdout line starting with `ready`; return it and that
    line's last word (a URL or multiaddr). Blocking reads with a kill timer: select() on a pipe
    misses lines a buffered readline has already pulled in."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    timer = threading.Timer(300, proc.kill)
    timer.start()
    try:
        for line in proc.stdout:
            if line.startswith(ready):
                return proc, line.split()[-1]
    finally:
        timer.cancel()
    proc.kill()
    sys.exit(f"{' '.join(cmd[cmd.index('-c') + 2:][:4])}... did not start within 300 s")
