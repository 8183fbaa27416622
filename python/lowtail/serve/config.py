"""The worker's configuration: standard library only, so the spawned child can type its loop with it
before numpy or OpenVINO are imported (it pins itself first; see ``lowtail.serve.worker_main``)."""

from __future__ import annotations

from dataclasses import dataclass

# The predecessor's slow_infer thresholds.
SLOW_ENGINE_CPU_MS = 100.0
SLOW_TOTAL_MS = 200.0

# "work": SCHED_FIFO while requests keep coming, dropped before any idle wait (default: no system call
# between back-to-back batches). "call": around each batch (two system calls per
# batch). "busy": also through the idle spin and park of a claim timeout after the last batch.
FIFO_SCOPES = ("work", "call", "busy")


@dataclass(frozen=True)
class WorkerConfig:
    name: str = ""  # the predecessor's "hero" label in slow_infer lines
    precision: str = "f32"
    nice: int = -20
    sched_fifo: bool = True  # try SCHED_FIFO around inference (falls back to nice if not permitted)
    fifo_priority: int = 1
    fifo_scope: str = "work"  # see FIFO_SCOPES
    slow_engine_cpu_ms: float = SLOW_ENGINE_CPU_MS
    slow_total_ms: float = SLOW_TOTAL_MS
    claim_timeout_s: float = 0.05  # bounded wait per claim: an idle loop checks stop at least this often
    max_batch: int = 16  # initial size of the bound input buffers (grows if a batch is larger)
    ring_capacity: int = 65536  # per-call rows kept for percentiles
    # Process CPU clock and scheduler counters cost ~3-6 us per read on a KVM guest (bench serve
    # --breakdown): read them on every Nth call and on every call that was descheduled, not on all.
    stats_every: int = 16
    # Run every shape the engine will run up to max_batch once before reporting ready (first inferences
    # of a shape cost tens of ms in OpenVINO; see worker_main.warm_up).
    warm_up: bool = True
    probe_cpu_view: bool = False  # also report how many threads OpenVINO would pick by itself
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        if self.fifo_scope not in FIFO_SCOPES:
            raise ValueError(f"fifo_scope={self.fifo_scope!r}: expected one of {FIFO_SCOPES}")
        if self.stats_every < 1:
            raise ValueError(f"stats_every={self.stats_every}: expected >= 1")
        if self.claim_timeout_s <= 0:
            raise ValueError(f"claim_timeout_s={self.claim_timeout_s}: expected > 0")
