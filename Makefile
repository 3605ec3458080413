.PHONY: setup test lint

setup:  ## set everything up and ask the default model a question
	bash deploy/setup.sh

test:  ## lint and run the test suite (sets up first if needed)
	bash deploy/test.sh -q

lint:
	.venv/bin/ruff check .
