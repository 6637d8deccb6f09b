"""The `diffuse credits` command prints the books."""

import json

from diffuse.trust.credits import ALLOWANCE


def test_the_credits_command_reports_the_books(tmp_path, capsys):
    from diffuse.cli import main

    assert main(["--home", str(tmp_path), "credits", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["earned"] == {"receipts": 0, "signers": 0, "work": 0, "from": {}} and r["allowance"]["work"] == ALLOWANCE
