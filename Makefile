# The two commands a new user needs: `make run` and `make test` (both set everything up first).
# `make test`: the chaos run and the admission-order test alone first (on two cores anything beside
# them would change what they measure), then the rest on two workers, whose last lines name any test
# it could not run here.
.PHONY: setup run test

setup:
	@scripts/setup.sh

run: setup
	.venv/bin/diffuse demo "What is the capital of France?"

test: setup
	.venv/bin/ruff check diffuse scripts tests
	.venv/bin/lint-imports
	.venv/bin/python scripts/check_house.py
	.venv/bin/python -m pytest -q -m alone
	.venv/bin/python -m pytest -q -n 2 --dist loadfile -m "not alone" --durations=15
