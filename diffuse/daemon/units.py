"""`diffuse daemon install | uninstall`: the daemon started at login by the system's own service
manager, a systemd user unit on Linux or a launchd agent on macOS, running `diffuse daemon run`
with the options given to `install` (the working directory and the DIFFUSE_* variables of the
moment too, so relative paths and $DIFFUSE_SWARM_KEY mean what they meant)."""

from __future__ import annotations

import hashlib
import os
import plistlib
import re
import sys
from pathlib import Path

from diffuse.daemon.protocol import paths
from diffuse.home import data_home

STOP_S = 90  # a peer's drain gets this long before the service manager kills it


def name(home: Path) -> str:
    """`diffuse` for the default home; another home's unit carries a digest of its path."""
    home = home.expanduser().resolve()
    if home == data_home(None).expanduser().resolve() and "DIFFUSE_HOME" not in os.environ:
        return "diffuse"
    return f"diffuse-{hashlib.sha256(str(home).encode()).hexdigest()[:8]}"


def command(home: Path, argv: list[str]) -> list[str]:
    return [sys.executable, "-m", "diffuse", "--home", str(home.expanduser().resolve()), *argv]


def _environment() -> dict[str, str]:
    return {"PYTHONUNBUFFERED": "1"} | {k: v for k, v in sorted(os.environ.items()) if k.startswith("DIFFUSE_")}


def _quote(arg: str) -> str:
    """One word of a systemd command line: specifiers (%) and variables ($) escaped, quoted if needed."""
    arg = arg.replace("%", "%%").replace("$", "$$")
    if arg and re.fullmatch(r"[\w@%+=:,./-]+", arg):
        return arg
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'


def systemd_unit(home: Path, argv: list[str]) -> str:
    log = paths(home.expanduser().resolve())[2]
    env = "".join(f"Environment={_quote(f'{k}={v}')}\n" for k, v in _environment().items())
    return (f"[Unit]\nDescription=Diffuse node of {home}\n\n"
            f"[Service]\nType=simple\nExecStart={' '.join(map(_quote, command(home, argv)))}\n"
            f"WorkingDirectory={_quote(os.getcwd())}\n{env}KillSignal=SIGTERM\nTimeoutStopSec={STOP_S}\n"
            f"Restart=on-failure\nRestartSec=10\nStandardOutput=append:{log}\nStandardError=append:{log}\n\n"
            "[Install]\nWantedBy=default.target\n")


def launchd_agent(home: Path, argv: list[str]) -> bytes:
    log = str(paths(home.expanduser().resolve())[2])
    return plistlib.dumps({"Label": f"org.diffuse.{name(home)}", "ProgramArguments": command(home, argv),
                           "WorkingDirectory": os.getcwd(), "EnvironmentVariables": _environment(),
                           "RunAtLoad": True, "KeepAlive": {"SuccessfulExit": False}, "ExitTimeOut": STOP_S,
                           "StandardOutPath": log, "StandardErrorPath": log})


def unit_path(home: Path, platform: str = sys.platform) -> Path:
    if platform == "darwin":
        return Path.home() / "Library" / "LaunchAgents" / f"org.diffuse.{name(home)}.plist"
    config = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return config / "systemd" / "user" / f"{name(home)}.service"


def install(home: Path, argv: list[str], platform: str = sys.platform) -> str:
    """Write the unit (agent) for `diffuse daemon run ARGV`; what to run to start it."""
    path = unit_path(home, platform)
    path.parent.mkdir(parents=True, exist_ok=True)
    if platform == "darwin":
        path.write_bytes(launchd_agent(home, argv))
        return f"wrote {path}\nstart it now and at every login: launchctl load -w {path}"
    path.write_text(systemd_unit(home, argv))
    return (f"wrote {path}\nstart it now and at every login: systemctl --user daemon-reload && "
            f"systemctl --user enable --now {path.name}\n(to run it while logged out too: loginctl enable-linger)")


def uninstall(home: Path, platform: str = sys.platform) -> str:
    path = unit_path(home, platform)
    if not path.exists():
        return f"no unit for {home} at {path}"
    if platform == "darwin":
        stop = f"launchctl remove org.diffuse.{name(home)}"
    else:  # what `systemctl --user disable` removes, so that no dangling link is left
        (path.parent / "default.target.wants" / path.name).unlink(missing_ok=True)
        stop = "systemctl --user daemon-reload"
    path.unlink()
    return f"removed {path}; a daemon it started runs on until `diffuse daemon stop` (then: {stop})"
