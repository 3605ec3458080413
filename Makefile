.PHONY: setup run test coverage chaos soak interop lint

setup:  ## set everything up, start a local cluster, ask it a question, stop it
	bash deploy/setup.sh

run:  ## the local cluster in the foreground, proxy on :8000 (Ctrl-C stops it); ARGS="--decode 2"
	.venv/bin/python -m deploy.local $(ARGS)

test:  ## lint and run the test suite (sets up first if needed)
	bash deploy/test.sh -q

coverage:  ## the suite under coverage.py, the workers it starts included; a report of the runtime packages
	rm -rf .coverage-data && mkdir -p .coverage-data
	-.venv/bin/python -m coverage run -m pytest -n 2 --dist loadfile -q -p no:cacheprovider $(ARGS)
	.venv/bin/python -m coverage combine -q && .venv/bin/python -m coverage report --skip-covered

chaos:  ## the chaos tests alone (kills, freezes and restarts of real workers; also in make test)
	.venv/bin/python -m pytest tests/chaos -q

soak:  ## 10 minutes, 64 streams, 10% aborts through proxy + 2 P + 2 D; exit 1 on leaks, hangs, RSS growth
	.venv/bin/python benchmarks/studies/soak.py --duration 600 $(ARGS)

interop:  ## our proxy in front of vLLM's own P/D workers (vLLM's CPU build, installed once; minutes)
	.venv/bin/python -m tests.interop.vllm_workers $(ARGS)

lint:
	.venv/bin/ruff check .
