# The two commands a new user needs: `make run` and `make test` (both set everything up first).
.PHONY: setup run test

setup:
	@scripts/setup.sh

run: setup
	.venv/bin/diffuse demo "What is the capital of France?"

test: setup
	.venv/bin/ruff check diffuse scripts tests
	.venv/bin/lint-imports
	.venv/bin/python -m pytest -q -n 2 --dist loadfile -m "not alone"
	.venv/bin/python -m pytest -q -m alone
