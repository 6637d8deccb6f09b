"""`python -m diffuse` is the `diffuse` command (used to start peers as child processes)."""

import sys

from diffuse.cli import main

sys.exit(main())
