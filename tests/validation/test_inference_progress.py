"""The inference probe's progress bar moves while the worker serves, not only once per CPU."""

from __future__ import annotations

import os
from typing import Any, ClassVar

import pytest

from lowtail.render.progress import Progress
from lowtail.validation import runtime_probes
from lowtail.validation.probes import ProbeOptions


class RecordingProgress(Progress):
    """The real bar, drawing nowhere, keeping every position it was given."""

    instances: ClassVar[list[RecordingProgress]] = []

    def __init__(self, label: str, total: float, **kw: Any) -> None:
        super().__init__(label, total, enabled=False)
        self.seen: list[float] = []
        RecordingProgress.instances.append(self)

    def update(self, done: float, note: str = "") -> None:
        self.seen.append(done)
        super().update(done, note)


def test_the_inference_bar_advances_per_batch_of_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runtime_probes, "Progress", RecordingProgress)
    cpu = max(os.sched_getaffinity(0))
    calls = 400
    check = runtime_probes.probe_inference(
        ProbeOptions(cpus=frozenset({cpu}), main_cpu=min(os.sched_getaffinity(0)), samples=calls)
    )
    assert check.status.value != "skip", check.reason
    (bar,) = RecordingProgress.instances
    assert bar.total == calls  # one CPU: the bar counts its calls
    inside = sorted({d for d in bar.seen if 0 < d < calls})
    assert len(inside) >= 10, bar.seen  # it moved while the worker served, in steps
    assert bar.seen[-1] == calls
    assert bar.seen == sorted(bar.seen)  # never backwards
