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


HEAVY = """
import sys
from diffuse.cli import main
try:
    main({argv!r})
except SystemExit:
    pass
print("HEAVY", sorted(m for m in ("torch", "libp2p") if m in sys.modules))
"""

HELPS = [[], ["model"], ["model", "pull"], ["model", "import-gguf"], ["model", "list"], ["model", "info"],
         ["model", "draft-head"], ["ask"], ["demo"], ["id"], ["sentinel"], ["join"], ["status"], ["api"],
         ["swarm"], ["swarm", "new"], ["credits"], ["history"], ["daemon"], *(["daemon", a] for a in (
             "start", "run", "install", "stop", "status", "logs", "uninstall"))]


def _heavy(argv: list[str]) -> tuple[str, str]:
    out = subprocess.run([sys.executable, "-c", HEAVY.format(argv=argv)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()[-1], out.stderr


def test_help_of_every_command_loads_neither_torch_nor_libp2p():
    for argv in HELPS:
        line, _ = _heavy([*argv, "--help"])
        assert line == "HEAVY []", (argv, line)


def test_a_bad_argument_is_reported_before_any_heavy_import():
    line, err = _heavy(["ask", "--temperature", "x", "q"])
    assert line == "HEAVY []" and "invalid float value: 'x'" in err, (line, err)
    line, err = _heavy(["join", "--contribution", "lots"])
    assert line == "HEAVY []" and "invalid choice: 'lots'" in err, (line, err)
    # a bad multiaddr needs libp2p to say so, and is said before torch is loaded
    line, err = _heavy(["ask", "q", "--bootstrap", "/not-a-multiaddr"])
    assert line == "HEAVY ['libp2p']" and "error: bad multiaddr" in err, (line, err)
