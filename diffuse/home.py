"""The data directory: models, keys and logs of a node live under one root.

~/.diffuse by default; DIFFUSE_HOME or --home override it, so several peers on one machine
can share one model store while keeping separate identities (--identity).
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_MODEL = "SmolLM2-135M-Instruct"


def data_home(override: str | os.PathLike | None = None) -> Path:
    if override:
        return Path(override).expanduser()
    env = os.environ.get("DIFFUSE_HOME")
    return Path(env).expanduser() if env else Path.home() / ".diffuse"


def models_dir(home: Path) -> Path:
    return home / "models"
