"""`lowtail bench queue --quick`: every transport runs, the JSON has the issue's schema, plots are written.

A smoke run: it checks behaviour (schema, counts, files, cleanup), never a latency or a ratio.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from lowtail.cli.main import main

NAMES = ["lowtail", "seed_flock_poll", "mp_pipe", "tcp_pickle", "ray_actor", "spin_floor"]


def test_quick_bench_reports_every_transport(tmp_path: Path) -> None:
    out = tmp_path / "q.json"
    png, page = tmp_path / "q.png", tmp_path / "q.html"
    # A subprocess: Ray is started and shut down there, never in the test session's process.
    proc = subprocess.run(
        [sys.executable, "-m", "lowtail.cli.main", "bench", "queue", "--quick", "--json", str(out),
         "--png", str(png), "--html", str(page), "--throughput-seconds", "0.3"],
        check=False, capture_output=True, text=True, timeout=600,
        env={**os.environ, "COLUMNS": "200"},  # wide enough that no header wraps
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert set(doc["transports"]) == set(NAMES)
    for name in NAMES:
        r = doc["transports"][name]
        assert r["n"] >= 50
        assert 0 < r["p50_us"] <= r["p99_us"] <= r["p999_us"] <= r["max_us"]
        assert r["client_run_delay_ms"] >= 0 and r["client_involuntary_switches"] >= 0
    assert doc["workload"]["request"].startswith("obs: float32[16, 512]")
    assert set(doc["throughput"]) == {"lowtail", "seed_flock_poll"}
    assert all(v["clients"] == 4 and v["requests_per_s"] > 0 for v in doc["throughput"].values())
    fair = doc["fairness"]  # 8 staggered saturating clients: none starves, nothing is left unanswered
    assert fair["clients"] == 8 and fair["starved_clients"] == 0
    assert all(c["answered"] > 0 and c["unanswered"] == 0 for c in fair["per_client"]), fair["per_client"]
    assert "fairness: queue wait of a ready request" in proc.stdout
    assert doc["targets"][0]["target"].startswith("lowtail p50 within 2x of spin_floor")
    assert any(t["target"].startswith("lowtail p99.9 within 3x of its own p50") for t in doc["targets"])
    lt = doc["transports"]["lowtail"]  # where the answers found the client, and the host's interrupts
    assert sum(lt["client_wait_counts"][k] for k in ("immediate", "spinning", "parked")) >= lt["n"]
    assert lt["client_gc_collections"] >= 0 and isinstance(lt["timer_interrupts_per_cpu"], dict)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    html = page.read_text()
    assert "<img" in html
    # a report, not a terminal dump: the targets first, tables as tables, the JSON folded
    assert html.index("<h2>Targets</h2>") < html.index("<h2>Plots</h2>") < html.index("<h2>JSON</h2>")
    assert (
        "<pre>" not in html.split("<h2>JSON</h2>")[0] and "<details><summary>Show the JSON</summary>" in html
    )
    assert "<th>p50 us</th>" in html and "Workload and settings" in html
    assert (doc["schema"], doc["complete"], doc["interrupted"]) == ("lowtail.bench.queue", True, False)
    # a quick run's p99.9 targets rest on a few hundred samples: never decided (lowtail.validation.evidence)
    p999 = [t for t in doc["targets"] if "p99.9" in t["target"]]
    assert p999 and all(t["met"] is None and "too few samples for p99.9" in t["why"] for t in p999)
    assert not any("issue" in t["target"] for t in doc["targets"])
    assert "p50 vs lowtail" in proc.stdout and "seed_flock_poll" in proc.stdout


def test_bench_rejects_unknown_transport(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["bench", "queue", "--transports", "lowtail,carrier_pigeon"]) == 2
    assert "unknown ['carrier_pigeon']" in capsys.readouterr().err


def test_seed_baseline_unpickles_only_numpy_arrays() -> None:
    """The seed design's pickled dicts are kept for the comparison, but a pickle naming any other
    callable (here os.system) is refused before it runs."""
    import os
    import pickle

    import numpy as np
    import pytest

    from lowtail.benchmarks.queue_transports import arrays_loads

    got = arrays_loads(pickle.dumps({"x": np.arange(6, dtype=np.float32).reshape(2, 3)}, protocol=5))
    assert got["x"].shape == (2, 3) and float(got["x"].sum()) == 15.0

    class Exploit:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (os.system, ("true",))

    with pytest.raises(pickle.UnpicklingError, match="system"):
        arrays_loads(pickle.dumps(Exploit()))
