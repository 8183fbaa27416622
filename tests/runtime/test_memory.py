"""Default sizing: a normal batch and its answer travel inline, never through an ndarray slot."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from lowtail.serve.engine import Engine
from lowtail.serve.model import ModelSpec, write_model
from lowtail.shm import payload
from lowtail.shm.queue import InferenceQueue, QueueClient, QueueConfig, QueueWorker


def test_default_queue_holds_a_16_by_512_batch_and_the_default_models_answer_inline(tmp_path: Path) -> None:
    spec = ModelSpec()
    engine = Engine(write_model(tmp_path, spec), max_batch=16)
    x = {"obs": np.random.default_rng(0).standard_normal((16, spec.features), dtype=np.float32)}
    answer = engine.infer(x)
    cfg = QueueConfig()
    assert spec.features == 512
    assert payload.layout_of(x).inline_end <= cfg.request_bytes
    assert payload.layout_of(answer).inline_end <= cfg.response_bytes
    # Through a real queue of the default geometry: no ndarray-slot segment appears on either side.
    shm = Path(cfg.shm_dir)
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
