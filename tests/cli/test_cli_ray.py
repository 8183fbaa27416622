"""What Ray leaves behind and opens for lowtail's commands: ``bench queue``'s ray_actor transport leaves
no ``/tmp/ray/session_*`` directory, and ``demo ray`` opens no port of its own unless asked, and names
every port its local Ray listens on (Ray's gRPC servers bind all interfaces; Ray has no option to stop
that, so the demo says so)."""

from __future__ import annotations

import glob
import json
import subprocess
import sys
import tempfile
from pathlib import Path

RAY_TMP = Path(tempfile.gettempdir()) / "ray"


def _lowtail(*argv: str, timeout_s: float = 600) -> tuple[int, str, str, int]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "lowtail.cli", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = proc.communicate(timeout=timeout_s)
    return proc.returncode, out, err, proc.pid


def _sessions_of(pid: int) -> list[str]:
    """Ray names a session after the driver's pid (session_<date>_<time>_<pid>): only this run's count,
    not those of other Ray users on the machine."""
    return glob.glob(str(RAY_TMP / f"session_*_{pid}"))


def test_ray_actor_transport_leaves_no_ray_session_directory(tmp_path: Path) -> None:
    report = tmp_path / "q.json"
    before = set(glob.glob(str(Path(tempfile.gettempdir()) / "lt-bench-ray-*")))
    rc, _, err, pid = _lowtail(
        "bench", "queue", "--transports", "ray_actor", "--samples", "300", "--json", str(report), "-q"
    )
    assert rc == 0, err
    assert json.loads(report.read_text())["transports"]["ray_actor"]["n"] == 300
    assert _sessions_of(pid) == []
    assert set(glob.glob(str(Path(tempfile.gettempdir()) / "lt-bench-ray-*"))) == before


def test_demo_ray_opens_no_metrics_port_unless_asked_and_names_rays_ports() -> None:
    rc, out, err, pid = _lowtail(
        "demo", "ray", "--seconds", "1", "--actors", "1", "--samplers", "1", "--no-standby", "--json", "-"
    )
    assert rc == 0, err
    assert "Started a local Ray instance" not in err  # Ray's INFO lines would land on the bar (-v shows them)
    doc = json.loads(out)
    assert doc["metrics_port"] is None  # no Prometheus server: nobody asked for one
    listening = doc["listening"]
    assert listening and all(isinstance(p["port"], int) and p["process"] and p["address"] for p in listening)
    assert {"gcs_server", "raylet"} <= {p["process"] for p in listening}
    assert _sessions_of(pid) == []


def test_demo_ray_prints_the_ports_it_listens_on() -> None:
    from lowtail.demo.local import render_listening

    text = render_listening(
        [
            {"process": "gcs_server", "address": "::", "port": 40001},
            {"process": "raylet", "address": "::", "port": 40002},
        ],
        metrics_port=9100,
    )
    assert "127.0.0.1:9100" in text and "gcs_server [::]:40001" in text and "raylet [::]:40002" in text
