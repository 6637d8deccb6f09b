"""`python -m diffuse` is the `diffuse` command (used to start peers as child processes)."""

from diffuse.cli import run

run()
