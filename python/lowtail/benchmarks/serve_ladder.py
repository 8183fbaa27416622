"""``lowtail bench serve --model-ms``: what the worker's overhead means for models of other sizes.

The default ``bench serve`` model takes ~0.7 ms per batch-16 call, where 35 us of worker overhead is 5%
of the call; the predecessor system's model averaged 16.6 ms per call at batch 8-16, where the same
overhead is 0.2%. The ladder builds one policy model per requested size (``ModelSpec`` with three
hidden layers of one width), calibrated on the engine's CPU so that a batch-16 ``infer()`` costs about
that much CPU time here, and measures each the way the default run does: the bare loop, then 4 samplers
through the queue (``served x4``). Reported per size: the model's measured call time, served/bare,
the worker's overhead per call and its share of the call, the samplers' p50/p99.9 with n.

Calibration: a width's cost is ~ a + b * MACs (MACs ~ 2 w^2 for the two w x w layers); each step
times the compiled model (its CPU time per call, median, pinned like the bare loop) and moves the
width by the square root of the time ratio, a few steps until it lands within CALIBRATE_TOLERANCE. A
size below what the smallest width takes (``infer()``'s own floor) is reported at what it really
took: the measured cost, not the asked one, is the ladder's x axis. The targets are decided only
where the bare and the served runs saw the model's ``infer()`` at about the same speed
(INFER_AGREEMENT): a host whose load changes between the two runs decides nothing.
"""

from __future__ import annotations

import io
import math
import multiprocessing
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lowtail.benchmarks.serve_run import REPORT_GRACE_S, DesignResult
from lowtail.node.signals import deaf_to_ctrl_c
from lowtail.serve.model import DEFAULT_FEATURES, ModelSpec
from lowtail.serve.pinning import pin_thread_to_cpu, raise_priority, start_pinned

PREDECESSOR_MODEL_MS = 16.6  # the predecessor's mean engine time per call at batch 8-16
LADDER_SAMPLERS = 4
TARGET_AT_PREDECESSOR = 0.99  # served x4 / bare at the predecessor's model size
TARGET_AT_1MS = 0.95  # ... and at a 1 ms model
CALIBRATE_TOLERANCE = 0.15
CALIBRATE_STEPS = 5
MIN_WIDTH, MAX_WIDTH = 8, 8192
DEPTH = 3
# A ratio is decided only when the model's infer() ran at about the same speed bare and served.
INFER_AGREEMENT = 1.25


def parse_model_ms(text: str) -> list[float]:
    """``"0.1,1,16"`` -> [0.1, 1.0, 16.0]; ValueError naming the bad item."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            v = float(part)
        except ValueError:
            raise ValueError(f"--model-ms {text!r}: {part!r} is not a number of milliseconds") from None
        if not 0.01 <= v <= 200:
            raise ValueError(f"--model-ms {text!r}: {part} ms is outside 0.01..200")
        out.append(v)
    if not out:
        raise ValueError(f"--model-ms {text!r}: expected sizes in ms like 0.1,1,16")
    return sorted(set(out))


def spec_of(width: int) -> ModelSpec:
    return ModelSpec(features=DEFAULT_FEATURES, hidden=(width,) * DEPTH)


def size_tag(target_ms: float) -> str:
    """The ladder size a row belongs to, as its label shows it (``served x4 @1 ms``)."""
    return f"{target_ms:g} ms"


@dataclass(frozen=True)
class Calibrated:
    target_ms: float
    width: int
    measured_ms: float  # CPU ms of a batch-16 infer() at calibration, median
    steps: list[tuple[int, float]]  # (width, ms) of every step

    def to_dict(self) -> dict[str, Any]:
        return {
            "tag": size_tag(self.target_ms),
            "target_ms": self.target_ms,
            "width": self.width,
            "hidden": list(spec_of(self.width).hidden),
            "measured_ms": round(self.measured_ms, 4),
            "steps": [[w, round(ms, 4)] for w, ms in self.steps],
        }


def _time_width(width: int, batch: int, tmp: Path) -> float:
    """ms of CPU per batch-``batch`` infer() of the width's model, compiled as the worker compiles it.

    The process's CPU time (the engine's threads included; this child runs nothing else), median of
    the calls: on a shared host the wall time carries whatever else ran (a 1024-wide model's calls
    took 5 ms of wall at load 20 on the 2-vCPU guest, ~0.7 ms quiet), its CPU time stays the model's.
    """
    from lowtail.serve.engine import Engine
    from lowtail.serve.model import write_model

    xml = write_model(tmp / f"w{width}", spec_of(width))
    engine = Engine(xml, max_batch=batch)
    x = {"obs": np.random.default_rng(0).standard_normal((batch, DEFAULT_FEATURES), dtype=np.float32)}
    cpu = time.process_time_ns
    engine.infer(x)
    c0 = cpu()
    engine.infer(x)
    first_ms = (cpu() - c0) / 1e6
    calls = int(min(200, max(5, 300 / max(first_ms, 0.01))))  # ~0.3 s of calls
    costs = []
    for _ in range(calls):
        c0 = cpu()
        engine.infer(x)
        costs.append(cpu() - c0)
    return float(np.median(costs)) / 1e6


def calibrate(target_ms: float, batch: int, tmp: Path, start: tuple[int, float] | None) -> Calibrated:
    """The width whose batch-``batch`` call takes about ``target_ms`` on this (pinned) thread."""
    w, ms = start if start else (1024, _time_width(1024, batch, tmp))
    steps = [(w, ms)]
    for _ in range(CALIBRATE_STEPS):
        if abs(ms - target_ms) <= CALIBRATE_TOLERANCE * target_ms:
            break
        nxt = int(min(MAX_WIDTH, max(MIN_WIDTH, round(w * math.sqrt(target_ms / ms) / 8) * 8)))
        if nxt == w:
            break  # at a bound: the floor of infer(), or the widest model allowed
        w, ms = nxt, _time_width(nxt, batch, tmp)
        steps.append((w, ms))
    best_w, best_ms = min(steps, key=lambda s: abs(math.log(s[1] / target_ms)))
    return Calibrated(target_ms, best_w, best_ms, steps)


def _calibrate_child(targets: list[float], cpu: int, batch: int, tmp: str, conn: Any) -> None:
    pin_thread_to_cpu(cpu)
    raise_priority(-20)
    out, start = [], None
    try:
        for t in targets:  # ascending: each search starts from the last one's answer
            c = calibrate(t, batch, Path(tmp), start)
            start = (c.width, c.measured_ms)
            out.append(c)
        conn.send({"calibrated": [c.to_dict() for c in out], "error": ""})
    except Exception as e:  # the run reports it, never hangs on a child that died
        conn.send({"calibrated": [], "error": f"{type(e).__name__}: {e}"})
    conn.close()


def calibrate_all(targets: list[float], cpu: int, batch: int, tmp: Path) -> list[dict[str, Any]]:
    """Calibrate every size in one child pinned to the engine CPU (as the bare loop and the worker)."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_calibrate_child, args=(targets, cpu, batch, str(tmp), child), daemon=True)
    try:
        with deaf_to_ctrl_c():  # a Ctrl-C meanwhile is raised as it ends, and reaps the child below
            start_pinned(proc, cpu)
        child.close()
        if not parent.poll(REPORT_GRACE_S * 5):
            raise RuntimeError("model calibration did not report in time")
        try:
            r = parent.recv()
        except EOFError:
            raise RuntimeError("model calibration died before reporting") from None
    finally:
        if proc.pid is not None:  # started
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join()
    if r["error"]:
        raise RuntimeError(f"model calibration failed: {r['error']}")
    return list(r["calibrated"])


# ---- the ladder's rows, targets and plot -----------------------------------------------------------


Pair = tuple[DesignResult | None, DesignResult | None]  # (bare, served) of one round of one size


def _failed(pair: Pair) -> bool:
    bare, served = pair
    return (
        bare is None or served is None or bool(bare.error or served.error) or math.isnan(served.ratio_to_bare)
    )


def _median_round(results: list[DesignResult], tag: str) -> tuple[Pair, list[float]]:
    """(bare, served) of size ``tag``'s median round by served/bare (the lower middle of an even count:
    a median never rounds a target up), and every round's served/bare in round order. A failed round
    is returned instead, so its error reaches the row rather than being outvoted by the others."""
    pairs: list[Pair] = []
    for rnd in sorted({r.round for r in results if r.size == tag}):
        mine = [r for r in results if r.size == tag and r.round == rnd]
        pairs.append(
            (
                next((r for r in mine if r.design == "bare"), None),
                next((r for r in mine if r.design == "served"), None),
            )
        )
    ratios = [served.ratio_to_bare if served is not None else float("nan") for _, served in pairs]
    if not pairs:
        return (None, None), []
    failed = [p for p in pairs if _failed(p)]
    if failed:
        return failed[0], ratios
    ordered = sorted(pairs, key=lambda p: p[1].ratio_to_bare if p[1] is not None else math.nan)
    return ordered[(len(ordered) - 1) // 2], ratios


def ladder_rows(results: list[DesignResult], sizes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per size: the bare loop's call time, served x4/bare, overhead and its share, latency,
    each from the size's median round (by served/bare) when it ran several; ``rounds`` lists them all."""
    rows = []
    for size in sizes:
        (bare, served), ratios = _median_round(results, size["tag"])
        model_ms = bare.latency_ms.p50 if bare else float("nan")
        ratio = served.ratio_to_bare if served else float("nan")
        over = served.overhead_us_mean if served else float("nan")
        call_us = served.engine_ms_mean * 1000 if served else float("nan")
        lat = served.latency_ms if served else None
        rows.append(
            {
                "target_ms": size["target_ms"],
                "hidden": size["hidden"],
                "calibrated_ms": size["measured_ms"],
                "model_ms": model_ms,
                "served_vs_bare": ratio,
                "overhead_us": over,
                "overhead_share": over / (call_us + over) if call_us + over > 0 else float("nan"),
                "engine_batch": served.engine_batch_mean if served else float("nan"),
                "bare_infer_ms": bare.engine_ms_mean if bare else float("nan"),
                "served_infer_ms": served.engine_ms_mean if served else float("nan"),
                "p50_ms": lat.p50 if lat else float("nan"),
                "p999_ms": lat.p999 if lat else float("nan"),
                "n": lat.n if lat else 0,
                "sampler_cpu_us_per_request": served.sampler_cpu_us_per_request if served else float("nan"),
                "rounds": ratios,
                "error": "; ".join(r.error for r in (bare, served) if r is not None and r.error),
            }
        )
    return rows


def _nearest(rows: list[dict[str, Any]], ms: float) -> dict[str, Any] | None:
    """The row whose calibrated model time is nearest ``ms`` (log scale), if within a factor 1.5 (the
    calibration's CPU time per call: the model's cost, not the host's load at the moment of its run)."""
    ok = [r for r in rows if r["calibrated_ms"] > 0]
    if not ok:
        return None
    best = min(ok, key=lambda r: abs(math.log(r["calibrated_ms"] / ms)))
    return best if abs(math.log(best["calibrated_ms"] / ms)) <= math.log(1.5) else None


def ladder_targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """served x4/bare at the predecessor's size and at 1 ms: met / not met, or not decided when no
    size of the ladder measured within a factor 1.5 of it (or its run failed)."""
    out: list[dict[str, Any]] = []
    for ms, floor, name in (
        (PREDECESSOR_MODEL_MS, TARGET_AT_PREDECESSOR, f"the predecessor's {PREDECESSOR_MODEL_MS} ms"),
        (1.0, TARGET_AT_1MS, "1 ms"),
    ):
        target = f"served x{LADDER_SAMPLERS} >= {floor:.0%} of bare, a model of {name} per batch-16 call"
        row = _nearest(rows, ms)
        if row is None or math.isnan(row["served_vs_bare"]) or row["error"]:
            why = "no size of the ladder measured within 1.5x of it" if row is None else "its run failed"
            out.append({"target": target, "met": None, "why": why, "figure": "-"})
            continue
        bare_ms, served_ms = row.get("bare_infer_ms", math.nan), row.get("served_infer_ms", math.nan)
        if not abs(math.log(served_ms / bare_ms)) <= math.log(INFER_AGREEMENT):
            # The same model's infer() ran at another speed in the two runs: the host's load changed
            # between them, and the ratio measures that rather than the serving.
            why = (
                f"infer() took {bare_ms:.2f} ms per call in the bare run and {served_ms:.2f} ms served: "
                f"the host changed between the runs (more than {INFER_AGREEMENT}x apart)"
            )
            figure = f"{row['served_vs_bare']:.3f} at {row['calibrated_ms']:.2f} ms per call"
            out.append({"target": target, "met": None, "why": why, "figure": figure})
            continue
        ratios = row.get("rounds", [])
        spread = (
            f" (median of {len(ratios)} rounds, {min(ratios):.3f}-{max(ratios):.3f})"
            if len(ratios) > 1
            else ""
        )
        out.append(
            {
                "target": target,
                "met": bool(row["served_vs_bare"] >= floor),
                "figure": f"{row['served_vs_bare']:.3f}{spread} at {row['calibrated_ms']:.2f} ms per call "
                f"(calibrated; bare p50 {row['model_ms']:.2f} ms); worker "
                f"overhead {row['overhead_us']:.0f} us/call, {row['overhead_share']:.2%} of it",
            }
        )
    return out


def _rounds_cell(ratios: list[float]) -> str:
    """``3: 0.953-0.981``: how many rounds the row's median came from, and their spread."""
    if len(ratios) < 2:
        return str(len(ratios))
    return f"{len(ratios)}: {min(ratios):.3f}-{max(ratios):.3f}"


def ladder_table(rows: list[dict[str, Any]]) -> tuple[str, list[str], list[list[str]]]:
    def f(v: float, spec: str) -> str:
        return "-" if isinstance(v, float) and math.isnan(v) else format(v, spec)

    body = [
        [
            f"{r['target_ms']:g}",
            "x".join(str(h) for h in r["hidden"][:1]) + f"x{len(r['hidden'])}",
            f(r["calibrated_ms"], ".3f"),
            f(r["model_ms"], ".3f"),
            f(r["served_vs_bare"], ".3f"),
            f(r["overhead_us"], ".0f"),
            f(r["overhead_share"], ".2%"),
            f(r["p50_ms"], ".3f"),
            f(r["p999_ms"], ".3f"),
            str(r["n"]),
            f(r["sampler_cpu_us_per_request"], ".0f"),
            _rounds_cell(r.get("rounds", [])),
            ("ERROR " + r["error"][:40]) if r["error"] else "",
        ]
        for r in rows
    ]
    headers = ["asked ms", "hidden", "model ms", "bare p50", "x4 vs bare", "+us/call", "share"]
    headers += ["p50 ms", "p99.9 ms", "n", "sampler us/req", "rounds (x4 vs bare)", "error"]
    return (f"model-size ladder: served x{LADDER_SAMPLERS} against bare, batch 16", headers, body)


def ladder_plot(rows: list[dict[str, Any]]) -> bytes:
    """served/bare against the model's measured call time (log x), with the two targets."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if not math.isnan(r["served_vs_bare"])]
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = [r["calibrated_ms"] for r in ok]
    ax.plot(xs, [r["served_vs_bare"] for r in ok], "o-", label="served x4 / bare")
    for r in ok:
        ax.annotate(
            f"{r['overhead_share']:.1%}",
            (r["calibrated_ms"], r["served_vs_bare"]),
            fontsize=8,
            textcoords="offset points",
            xytext=(4, -12),
        )
    ax.axhline(
        TARGET_AT_PREDECESSOR, color="tab:green", ls="--", lw=0.8, label=f"{TARGET_AT_PREDECESSOR} target"
    )
    ax.axhline(TARGET_AT_1MS, color="tab:orange", ls="--", lw=0.8, label=f"{TARGET_AT_1MS} target (1 ms)")
    ax.axvline(PREDECESSOR_MODEL_MS, color="grey", ls=":", lw=0.8, label="predecessor's model")
    ax.set_xscale("log")
    ax.set_xlabel("model CPU time per batch-16 call (ms, calibrated on the engine CPU)")
    ax.set_ylabel("served / bare")
    ax.set_title("worker overhead against model size (labels: overhead share of a call)")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()
