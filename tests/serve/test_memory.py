"""Default sizing: a normal batch and its answer travel inline, never through an ndarray segment."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import psutil

from lowtail.serve.engine import Engine
from lowtail.serve.model import ModelSpec, write_model
from lowtail.shm import payload, segments
from lowtail.shm.queue import InferenceQueue, QueueClient, QueueConfig, QueueWorker


def test_default_queue_holds_a_16_by_512_batch_and_the_default_models_answer_inline(tmp_path: Path) -> None:
    spec = ModelSpec()
    engine = Engine(write_model(tmp_path, spec), max_batch=16)
    x = {"obs": np.random.default_rng(0).standard_normal((16, spec.features), dtype=np.float32)}
    answer = engine.infer(x)
    cfg = QueueConfig()
    assert spec.features == 512
    assert payload.validated_layout(x).inline_end <= cfg.request_bytes
    assert payload.validated_layout(answer).inline_end <= cfg.response_bytes
    # Through a real queue of the default geometry: no ndarray-segment segment appears on either side.
    shm = segments.private_dir(cfg.shm_dir)
    before = {p.name for p in shm.iterdir()}
    with InferenceQueue.create(cfg) as queue:
        with QueueClient.attach(queue.descriptor) as client, QueueWorker.attach(queue.descriptor) as worker:
            pending = client.start(x)
            batch = worker.claim(timeout_s=5)
            assert batch is not None
            batch.complete(engine.infer(batch.inputs))
            got = pending.finish(timeout_s=5)
            during = {p.name for p in shm.iterdir()} - before
        assert during == {queue.descriptor.name}  # only the control segment itself
    for name in answer:
        np.testing.assert_array_equal(got[name], answer[name])


def rss_growth_over_batch_sizes(model: Path, sizes: list[int]) -> tuple[float, float]:
    """RSS growth (MB) of an engine over one call per size in ``sizes``, after one warm call of 16, and
    the mean seconds per call."""
    engine = Engine(model, max_batch=16)
    rng = np.random.default_rng(0)
    features = engine.inputs["obs"][1][0]
    engine.infer({"obs": rng.standard_normal((16, features), dtype=np.float32)})
    proc = psutil.Process()
    before = proc.memory_info().rss
    t0 = time.perf_counter()
    for n in sizes:
        x = rng.standard_normal((n, features), dtype=np.float32)
        out = engine.infer({"obs": x})
        assert all(a.shape[0] == n for a in out.values())
    took = (time.perf_counter() - t0) / len(sizes)
    return (proc.memory_info().rss - before) / 1e6, took


def test_rss_stays_bounded_over_160_distinct_batch_sizes(tmp_path: Path) -> None:
    """Bound tensors and OpenVINO's per-shape state grew 126 MB over these 160 sizes; padded shapes
    bound both (docs/benchmarks.md has the figure)."""
    growth_mb, _ = rss_growth_over_batch_sizes(write_model(tmp_path, ModelSpec()), list(range(160, 0, -1)))
    assert growth_mb < 80, f"RSS grew {growth_mb:.1f} MB over 160 distinct batch sizes"
