"""Metrics export under the predecessor system's names: TensorBoard scalars and Prometheus gauges.

The predecessor's write-up reads its inference tails from TensorBoard scalars ``sample_infos/sl_remote_*``
(written by the model dispatcher: the mean of a window and the mean of window maxima) and from a
periodic ``p999_deschedule_ms``. lowtail writes the same names, so a dashboard or ``lowtail tb-report``
built for the predecessor system reads lowtail's, and adds the percentiles the predecessor lacked:

    sample_infos/sl_remote_<series>_ms        window mean       (the write-up's "average")
    sample_infos/sl_remote_<series>_max_ms    window maximum    (the write-up's "tail")
    sample_infos/sl_remote_<series>_p50_ms / _p99_ms / _p999_ms
    sample_infos/sl_remote_samples_per_s      throughput of the window
    sample_infos/p999_deschedule_ms           p999 of deschedule = wall - CPU per inference call

Series with a unit other than ms (``batch_size``) drop the ``_ms``. Prometheus gets one gauge per
series, ``lowtail_sl_remote_<series>{node, source, stat}`` with stat in mean/p50/p99/p999/max/n, and
``lowtail_p999_deschedule_ms{node, source}``, served on one port per node. Milliseconds rather than
Prometheus's base unit (seconds) so both exports carry the write-up's numbers unconverted.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from lowtail.telemetry.percentiles import Percentiles

TB_RUN = "model_dispatcher"  # the predecessor's TensorBoard run holding the sampler-side scalars
TB_PREFIX = "sample_infos/sl_remote_"
P999_DESCHEDULE_TAG = "sample_infos/p999_deschedule_ms"
SAMPLES_PER_S_TAG = TB_PREFIX + "samples_per_s"
PROM_PREFIX = "lowtail_sl_remote_"
STATS: tuple[str, ...] = ("mean", "p50", "p99", "p999", "max")

# The series lowtail records (any other name is exported the same way): which side measures each, and
# where the number comes from. The predecessor's sl_remote_* names were its samplers' per-request
# figures (its client's rpc_elapsed_s, queue_wait_s, infer_exec_s, client_overhead_s), so those names
# are the sampler-side series here; the worker's per-call series that measure the same things are
# worker_*.
SAMPLER, WORKER = "sampler", "worker"
SERIES: dict[str, tuple[str, str]] = {
    "rpc_elapsed_ms": (SAMPLER, "round trip of one request, publication to its answer being ready"),
    "queue_wait_ms": (SAMPLER, "one request's publication to the worker's claim"),
    "infer_exec_ms": (SAMPLER, "engine wall time of the call a request rode in"),
    "client_overhead_ms": (SAMPLER, "the client's own copy-in and copy-out of one request"),
    "worker_infer_exec_ms": (WORKER, "model execution wall time per batch"),
    "infer_total_ms": (WORKER, "the worker's whole call: claim returned to results written back"),
    "engine_cpu_ms": (WORKER, "process CPU time of the worker during the batch"),
    "engine_thread_cpu_ms": (WORKER, "CPU time of the inference thread during the batch"),
    "deschedule_ms": (WORKER, "wall - CPU of the inference call (the write-up's formula)"),
    "run_delay_ms": (WORKER, "growth of schedstat run_delay during the call (time runnable but not running)"),
    "worker_queue_wait_ms": (WORKER, "the longest publication -> claim wait among a batch's requests"),
    "worker_batch_size": (WORKER, "samples per batch the worker ran"),
}


def series_side(key: str) -> str:
    """``sampler``, ``worker`` or ``?`` for a series name, an exported tag or a tb-report key
    (``infer_exec_max_ms``, ``sample_infos/sl_remote_worker_batch_size_p99``)."""
    base, unit = _split_unit(key.rpartition(TB_PREFIX)[2])
    for stat in ("_max", "_p50", "_p99", "_p999"):
        if base.endswith(stat):
            base = base[: -len(stat)]
            break
    return SERIES.get(base + unit, ("?", ""))[0]


# A window's summary is the package's one percentile definition (nearest rank, with n, mean and max).
WindowStats = Percentiles


def window_stats(series: Mapping[str, Iterable[float]]) -> dict[str, WindowStats]:
    return {name: WindowStats.of(values) for name, values in series.items()}


def _split_unit(series: str) -> tuple[str, str]:
    return (series[:-3], "_ms") if series.endswith("_ms") else (series, "")


def scalars(stats: Mapping[str, WindowStats], samples_per_s: float | None = None) -> dict[str, float]:
    """TensorBoard tag -> value for one window (empty series are left out rather than written as NaN)."""
    tags: dict[str, float] = {}
    for series, s in sorted(stats.items()):
        if s.n == 0:
            continue
        name, unit = _split_unit(series)
        base = TB_PREFIX + name
        tags[f"{base}{unit}"] = s.mean
        tags[f"{base}_max{unit}"] = s.max
        tags[f"{base}_p50{unit}"] = s.p50
        tags[f"{base}_p99{unit}"] = s.p99
        tags[f"{base}_p999{unit}"] = s.p999
    if "deschedule_ms" in stats and stats["deschedule_ms"].n:
        tags[P999_DESCHEDULE_TAG] = stats["deschedule_ms"].p999
    if samples_per_s is not None:
        tags[SAMPLES_PER_S_TAG] = samples_per_s
    return tags


class TensorBoardExport:
    """Scalars into ``LOGDIR/model_dispatcher`` (tensorboardX event files)."""

    def __init__(self, logdir: str | Path, run: str = TB_RUN) -> None:
        from tensorboardX import SummaryWriter

        self.path = Path(logdir) / run
        self._writer = SummaryWriter(logdir=str(self.path), flush_secs=5)
        self._lock = threading.Lock()

    def write(self, step: int, tags: Mapping[str, float], walltime: float | None = None) -> None:
        with self._lock:
            for tag, value in tags.items():
                self._writer.add_scalar(tag, value, global_step=step, walltime=walltime)

    def flush(self) -> None:
        with self._lock:
            self._writer.flush()

    def close(self) -> None:
        with self._lock:
            self._writer.close()


class PrometheusExport:
    """Gauges per series in their own registry, optionally served over HTTP (one port per node)."""

    def __init__(self, node: str, port: int | None = None, addr: str = "0.0.0.0") -> None:
        from prometheus_client import CollectorRegistry, Gauge

        self.node = node
        self.registry = CollectorRegistry(auto_describe=True)
        self._gauge_cls = Gauge
        self._gauges: dict[str, Any] = {}
        self._p999 = Gauge(
            "lowtail_p999_deschedule_ms",
            "p999 of wall - CPU per inference call over the last window (ms)",
            ["node", "source"],
            registry=self.registry,
        )
        self._rate = Gauge(
            PROM_PREFIX + "samples_per_s",
            "samples per second over the last window",
            ["node", "source"],
            registry=self.registry,
        )
        self._lock = threading.Lock()
        self._server: Any = None
        self.port: int | None = None
        if port is not None:
            from prometheus_client import start_http_server

            self._server, _thread = start_http_server(port, addr=addr, registry=self.registry)
            self.port = int(self._server.server_port)

    def _gauge(self, series: str) -> Any:
        name = PROM_PREFIX + series
        if name not in self._gauges:
            self._gauges[name] = self._gauge_cls(
                name, SERIES.get(series, ("", series))[1], ["node", "source", "stat"], registry=self.registry
            )
        return self._gauges[name]

    def update(
        self, source: str, stats: Mapping[str, WindowStats], samples_per_s: float | None = None
    ) -> None:
        with self._lock:
            for series, s in stats.items():
                if s.n == 0:
                    continue
                gauge = self._gauge(series)
                for stat in STATS:
                    gauge.labels(self.node, source, stat).set(getattr(s, stat))
                gauge.labels(self.node, source, "n").set(s.n)
            if "deschedule_ms" in stats and stats["deschedule_ms"].n:
                self._p999.labels(self.node, source).set(stats["deschedule_ms"].p999)
            if samples_per_s is not None:
                self._rate.labels(self.node, source).set(samples_per_s)

    def render(self) -> str:
        """The exposition text, as a scrape would get it."""
        from prometheus_client import generate_latest

        return bytes(generate_latest(self.registry)).decode()

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
