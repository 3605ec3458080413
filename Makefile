.PHONY: setup run test lint

setup:  ## set everything up, start a local cluster, ask it a question, stop it
	bash deploy/setup.sh

run:  ## the local cluster in the foreground, proxy on :8000 (Ctrl-C stops it); ARGS="--decode 2"
	.venv/bin/python -m deploy.local $(ARGS)

test:  ## lint and run the test suite (sets up first if needed)
	bash deploy/test.sh -q

lint:
	.venv/bin/ruff check .
