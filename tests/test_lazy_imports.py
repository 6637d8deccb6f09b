"""What a process does not load: the tampering test double (trust/tamper.py) only with
`diffuse join --tamper`, the client's noise experiment (client/privacy.py) only with
SwarmOptions.noise on."""

from __future__ import annotations

import subprocess
import sys

CODE = """
import sys
from diffuse.cli import build_parser
import diffuse.client.swarm
args = build_parser().parse_args(["join"])
assert args.tamper is None
print(sorted(m for m in ("diffuse.trust.tamper", "diffuse.client.privacy") if m in sys.modules))
args = build_parser().parse_args(["join", "--tamper", "noise:20", "--tamper-rate", "0.5"])
assert args.tamper == ("noise", 20.0) and args.tamper_rate == 0.5, args
print("diffuse.trust.tamper" in sys.modules)
"""


def test_test_double_and_experiment_load_only_when_asked_for():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["[]", "True"], out.stdout
