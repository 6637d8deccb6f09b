"""--contribution levels, apart from data/serve.py (which imports torch) so that the command
line's parser can offer them without loading it."""

from __future__ import annotations

# (share of the cores, sessions, share of the cache); pause lends nothing.
LEVELS: dict[str, tuple[float, int, float] | None] = {
    "max": (1.0, 64, 1.0), "moderate": (0.5, 32, 0.5), "min": (0.0, 8, 0.125), "pause": None}
