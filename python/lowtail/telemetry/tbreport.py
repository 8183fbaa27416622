"""The training-run metrics of the predecessor's write-up from a training run's TensorBoard logs, and a
before/after view.

Tags are matched by suffix, so any prefix (``learner/``, ``model_dispatcher/``, a run subdirectory) works:

    batch_recv_ms, learn_total_ms   the learner's wait for samples and its whole step; their ratio of
                                    means is the share of time the GPU waits (write-up: 2615.9 / 2774.8
                                    = 94.3 %)
    samples_per_s (or samples_per_sec, samples_per_second, samples/s)   sampling throughput (write-up: 735)
    sample_infos/sl_remote_*        the samplers' inference timings (write-up: 16.6 ms mean execution,
                                    160.5 ms mean of the window maxima, 1126 ms batch round trip tail)
    p999_deschedule_ms              the workers' p99.9 deschedule per window (write-up: 400-470 ms)
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

from lowtail.render import table
from lowtail.telemetry.export import series_side
from lowtail.telemetry.tfevents import Series, read_scalars
from lowtail.validation.evidence import min_samples

BATCH_RECV = ("batch_recv_ms",)
LEARN_TOTAL = ("learn_total_ms",)
SAMPLES_PER_S = ("samples_per_s", "samples_per_sec", "samples_per_second", "samples/s")
DESCHEDULE = ("p999_deschedule_ms",)
SL_REMOTE = "sample_infos/sl_remote_"


@dataclass(frozen=True)
class Stats:
    tag: str
    n: int
    mean: float
    p50: float
    p99: float | None  # None below the windows a p99 needs (299): a "p99" of two windows is their max
    max: float
    last: float
    first_step: int
    last_step: int

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def stats(s: Series) -> Stats:
    xs = sorted(s.values)
    n = len(xs)

    def rank(q: float) -> float:
        return xs[min(n - 1, max(0, math.ceil(q * n) - 1))]

    return Stats(
        tag=s.tag,
        n=n,
        mean=math.fsum(xs) / n,
        p50=rank(0.5),
        p99=rank(0.99) if n >= min_samples(0.99) else None,
        max=xs[-1],
        last=s.values[-1],
        first_step=s.steps[0],
        last_step=s.steps[-1],
    )


def find(scalars: dict[str, Series], suffixes: tuple[str, ...]) -> Series | None:
    """The series whose tag ends with one of ``suffixes`` (the longest run when several do)."""
    hits = [s for tag, s in scalars.items() if s.values and any(tag.endswith(x) for x in suffixes)]
    return max(hits, key=lambda s: (len(s.values), s.tag), default=None)


def training_metrics(scalars: dict[str, Series]) -> dict[str, Any]:
    out: dict[str, Any] = {"tags": len(scalars)}
    recv, total = find(scalars, BATCH_RECV), find(scalars, LEARN_TOTAL)
    if recv and total:
        r, t = stats(recv), stats(total)
        out["learner"] = {
            "batch_recv_ms": r.to_dict(),
            "learn_total_ms": t.to_dict(),
            "waiting_share": r.mean / t.mean if t.mean > 0 else None,
        }
    rate = find(scalars, SAMPLES_PER_S)
    if rate:
        out["samples_per_s"] = stats(rate).to_dict()
    out["sl_remote"] = {
        tag[tag.index(SL_REMOTE) + len(SL_REMOTE) :]: stats(s).to_dict()
        for tag, s in sorted(scalars.items())
        if SL_REMOTE in tag and s.values
    }
    desched = find(scalars, DESCHEDULE)
    if desched:
        out["p999_deschedule_ms"] = stats(desched).to_dict()
    return out


def task_a(scalars: dict[str, Series]) -> dict[str, Any]:
    """Deprecated name of ``training_metrics``, kept for a release."""
    warnings.warn("tbreport.task_a is renamed training_metrics", DeprecationWarning, stacklevel=2)
    return training_metrics(scalars)


def load(logdir: str) -> dict[str, Any]:
    report = training_metrics(read_scalars(logdir))
    report["logdir"] = logdir
    return report


def _f(x: float | None) -> str:
    """4 significant digits: 0.02 ms reads 0.02, not 0.0."""
    return "-" if x is None else f"{x:.4g}"


SIDES = {"?": "unknown"}  # a tag the export does not name: say so instead of a "?"


def render(report: dict[str, Any]) -> str:
    out = [f"Training-run metrics of {report['logdir']} ({report['tags']} scalar tags)"]
    lr = report.get("learner")
    if lr:
        r, t = lr["batch_recv_ms"], lr["learn_total_ms"]
        share = lr["waiting_share"]
        out.append(
            f"learner waits for samples: batch_recv_ms / learn_total_ms = {r['mean']:.1f} / {t['mean']:.1f} "
            f"= {share:.1%} (means over {t['n']} steps, step range [{t['first_step']}, {t['last_step']}])"
        )
    else:
        out.append("learner: no *batch_recv_ms and *learn_total_ms tags")
    rate = report.get("samples_per_s")
    out.append(
        f"samples/s: mean {rate['mean']:.1f}, p50 {rate['p50']:.1f}, last {rate['last']:.1f} (n={rate['n']})"
        if rate
        else "samples/s: no *samples_per_s tag"
    )
    d = report.get("p999_deschedule_ms")
    out.append(
        f"p999_deschedule_ms: mean {d['mean']:.3f}, max {d['max']:.3f}, last {d['last']:.3f} ms "
        f"(n={d['n']} windows)"
        if d
        else "p999_deschedule_ms: no tag"
    )
    sl = report.get("sl_remote") or {}
    if sl:
        out.append("")
        out.append(
            table.render(
                ["sl_remote_*", "side", "n", "mean", "p50", "p99", "max"],
                [
                    [
                        k,
                        SIDES.get(series_side(k), series_side(k)),
                        s["n"],
                        _f(s["mean"]),
                        _f(s["p50"]),
                        _f(s["p99"]),
                        _f(s["max"]),
                    ]
                    for k, s in sl.items()
                ],
                title="inference timings (sample_infos/sl_remote_*, ms; statistics over the logged windows, "
                f"p99 only from {min_samples(0.99)} windows): side = measured by the samplers (per request) "
                "or the workers (per call)",
            )
        )
    return "\n".join(out)


def _pairs(a: dict[str, Any], b: dict[str, Any]) -> list[tuple[str, float | None, float | None]]:
    def get(r: dict[str, Any], *path: str) -> float | None:
        cur: Any = r
        for p in path:
            if not isinstance(cur, dict) or p not in cur:
                return None
            cur = cur[p]
        return float(cur) if isinstance(cur, int | float) else None

    rows = [
        (
            "p999_deschedule_ms (mean)",
            get(a, "p999_deschedule_ms", "mean"),
            get(b, "p999_deschedule_ms", "mean"),
        ),
        (
            "p999_deschedule_ms (max)",
            get(a, "p999_deschedule_ms", "max"),
            get(b, "p999_deschedule_ms", "max"),
        ),
        ("waiting share", get(a, "learner", "waiting_share"), get(b, "learner", "waiting_share")),
        (
            "batch_recv_ms",
            get(a, "learner", "batch_recv_ms", "mean"),
            get(b, "learner", "batch_recv_ms", "mean"),
        ),
        (
            "learn_total_ms",
            get(a, "learner", "learn_total_ms", "mean"),
            get(b, "learner", "learn_total_ms", "mean"),
        ),
        ("samples/s", get(a, "samples_per_s", "mean"), get(b, "samples_per_s", "mean")),
    ]
    for key in sorted(set(a.get("sl_remote", {})) | set(b.get("sl_remote", {}))):
        rows.append(
            (f"sl_remote_{key} (mean)", get(a, "sl_remote", key, "mean"), get(b, "sl_remote", key, "mean"))
        )
    return rows


def compare(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    rows = []
    for name, x, y in _pairs(a, b):
        ratio = x / y if x is not None and y not in (None, 0) else None
        rows.append({"metric": name, "before": x, "after": y, "before_over_after": ratio})
    return {"before": a["logdir"], "after": b["logdir"], "metrics": rows}


def render_compare(cmp: dict[str, Any]) -> str:
    def v(x: float | None) -> str:
        return "-" if x is None else f"{x:.4g}"

    return table.render(
        ["metric", "before", "after", "before/after"],
        [[r["metric"], v(r["before"]), v(r["after"]), v(r["before_over_after"])] for r in cmp["metrics"]],
        title=f"before: {cmp['before']}   after: {cmp['after']}",
    )
