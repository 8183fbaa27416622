"""Shared fixtures for the runtime tests: a small policy model built once per session (no downloads)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lowtail.serve.model import ModelSpec, write_model

# Small enough that compiling and serving it takes milliseconds; same structure as the default model.
SMALL_SPEC = ModelSpec(features=64, hidden=(128, 64), heads=(("action", 6), ("move", 8)), seed=7)


@pytest.fixture(scope="session")
def small_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("model")
    write_model(out, SMALL_SPEC)
    return out


def write_slow_model(out: Path, layers: int = 100, width: int = 1024) -> Path:
    """A model that keeps one core busy ~0.1 s per batch of 64 (one shared weight, a 4 MB file).

    Used to kill a worker while a request is certainly PROCESSING.
    """
    import numpy as np
    import openvino as ov
    import openvino.opset13 as ops

    rng = np.random.default_rng(0)
    obs = ops.parameter([-1, width], ov.Type.f32, name="obs")
    obs.output(0).get_tensor().set_names({"obs"})
    w = ops.constant(rng.standard_normal((width, width), dtype=np.float32) / np.float32(32))
    x = obs
    for _ in range(layers):
        x = ops.tanh(ops.matmul(x, w, False, False))
    x.output(0).get_tensor().set_names({"value"})
    out.mkdir(parents=True, exist_ok=True)
    xml = out / "slow.xml"
    ov.save_model(ov.Model([x], [obs], "slow"), str(xml), compress_to_fp16=False)
    return xml
