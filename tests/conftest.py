from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """tiny_model(name) → folder of a tiny random HF model (built once per session)."""
    from tests.tiny_models import build_tiny_model

    built: dict[str, object] = {}

    def get(name: str = "llama"):
        if name not in built:
            built[name] = build_tiny_model(name, tmp_path_factory.mktemp(name))
        return built[name]

    return get
