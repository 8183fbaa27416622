"""Shared fixtures for the runtime tests: a small policy model built once per session (no downloads)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lowtail.model import ModelSpec, write_model

# Small enough that compiling and serving it takes milliseconds; same structure as the default model.
SMALL_SPEC = ModelSpec(features=64, hidden=(128, 64), heads=(("action", 6), ("move", 8)), seed=7)


@pytest.fixture(scope="session")
def small_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("model")
    write_model(out, SMALL_SPEC)
    return out
