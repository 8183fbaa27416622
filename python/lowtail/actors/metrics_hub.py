"""The per-node metrics hub: one Ray actor per node that owns the node's Prometheus port and TensorBoard run.

Inference actors push the worker's per-call series, samplers push their round trips; every
``interval_s`` the hub turns what arrived into window statistics (``export.WindowStats``), per source
for Prometheus and merged over the node for TensorBoard (``sample_infos/sl_remote_*``,
``p999_deschedule_ms``). Named, detached and node-pinned like the lease allocator, for the same reason:
exactly one per node, found by every process on it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from lowtail.telemetry.export import PrometheusExport, TensorBoardExport, WindowStats, scalars, window_stats

NAMESPACE = "lowtail"
SUMMARY_CAP = 1_000_000  # values per series kept for the run summary
NODE_SOURCE = "node"  # the Prometheus source label of the merged window
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MetricsConfig:
    port: int | None = None  # None: no HTTP server; 0: any free port
    addr: str = "0.0.0.0"
    tb_logdir: str | None = None
    interval_s: float = 1.0


def hub_name(node_id: str) -> str:
    return f"lowtail-metrics-{node_id}"


@dataclass
class _Totals:
    samples: int = 0
    requests: int = 0


@ray.remote(num_cpus=0, max_restarts=-1)
class NodeMetricsActor:
    def __init__(self, node_id: str, config: MetricsConfig) -> None:
        self._node = node_id
        self._config = config
        self._lock = threading.Lock()
        self._pending: dict[str, dict[str, list[np.ndarray]]] = {}
        self._samples: dict[str, int] = {}
        self._totals: dict[str, _Totals] = {}
        self._everything: dict[str, list[np.ndarray]] = {}  # the whole run, merged (for summaries)
        self._prom = PrometheusExport(node_id, config.port, config.addr)
        self._tb = None if config.tb_logdir is None else TensorBoardExport(Path(config.tb_logdir))
        self._step = 0
        self._t_last = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="metrics-flush", daemon=True)
        self._thread.start()

    def port(self) -> int | None:
        return self._prom.port

    def push(self, source: str, series: Mapping[str, Sequence[float] | np.ndarray], samples: int = 0) -> None:
        with self._lock:
            into = self._pending.setdefault(source, {})
            for name, values in series.items():
                arr = np.asarray(values, dtype=np.float64)
                if arr.size:
                    into.setdefault(name, []).append(arr)
                    kept = self._everything.setdefault(name, [])
                    kept.append(arr)
                    while sum(a.size for a in kept) > SUMMARY_CAP and len(kept) > 1:
                        kept.pop(0)  # bounded memory on a long run: the summary covers the latest values
            self._samples[source] = self._samples.get(source, 0) + samples
            t = self._totals.setdefault(source, _Totals())
            t.samples += samples
            t.requests += len(np.asarray(series.get("rpc_elapsed_ms", ())))

    def _loop(self) -> None:
        while not self._stop.wait(self._config.interval_s):
            try:
                self.flush()
            except Exception:
                log.exception("metrics flush failed")

    def flush(self) -> dict[str, float]:
        """Close the current window: update Prometheus, write one TensorBoard step; returns its scalars."""
        with self._lock:
            pending, self._pending = self._pending, {}
            samples, self._samples = self._samples, {}
            now = time.monotonic()
            span, self._t_last = max(now - self._t_last, 1e-9), now
        merged: dict[str, list[np.ndarray]] = {}
        for source, series in pending.items():
            stats = window_stats({k: np.concatenate(v) for k, v in series.items()})
            self._prom.update(source, stats, samples.get(source, 0) / span)
            for k, v in series.items():
                merged.setdefault(k, []).extend(v)
        node_stats = window_stats({k: np.concatenate(v) for k, v in merged.items()})
        rate = sum(samples.values()) / span
        self._prom.update(NODE_SOURCE, node_stats, rate)
        tags = scalars(node_stats, rate)
        if self._tb is not None and pending:
            self._tb.write(self._step, tags)
            self._step += 1
        return tags

    def totals(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {s: {"samples": t.samples, "requests": t.requests} for s, t in self._totals.items()}

    def summary(self) -> dict[str, WindowStats]:
        """Statistics of every value pushed since the hub started, merged over sources."""
        with self._lock:
            return window_stats({k: np.concatenate(v) for k, v in self._everything.items()})

    def values(self, names: Sequence[str]) -> dict[str, np.ndarray]:
        """The values kept for the run summary (for plots), merged over sources."""
        with self._lock:
            return {n: np.concatenate(self._everything[n]) for n in names if self._everything.get(n)}

    def render(self) -> str:
        return self._prom.render()

    def shutdown(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.flush()
        if self._tb is not None:
            self._tb.close()
        self._prom.close()


def get_node_metrics(node_id: str | None = None, config: MetricsConfig | None = None) -> Any:
    """The metrics hub of ``node_id`` (default: this process's node), created on first use."""
    node = node_id or ray.get_runtime_context().get_node_id()
    return NodeMetricsActor.options(  # type: ignore[attr-defined]
        name=hub_name(node),
        namespace=NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False),
    ).remote(node, config or MetricsConfig())


def stop_node_metrics(node_id: str | None = None) -> bool:
    node = node_id or ray.get_runtime_context().get_node_id()
    try:
        handle: Any = ray.get_actor(hub_name(node), namespace=NAMESPACE)
    except ValueError:
        return False
    with contextlib.suppress(ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError):
        ray.get(handle.shutdown.remote(), timeout=15)
    ray.kill(handle, no_restart=True)
    return True
