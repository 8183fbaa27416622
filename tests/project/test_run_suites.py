"""scripts/run-suites.sh, which `make test` runs its long suites with: a failed suite is named last.

CI keeps only the tail of a run's output, so the script's summary, with each suite's status and a
failed one's failing tests, must come after every suite's own output, and the exit status must be the
failure's.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "run-suites.sh"

MAKEFILE = """\
slow:
\t@sleep 1; echo slow suite ok
broken:
\t@echo "FAILED tests/test_x.py::test_y - AssertionError: boom"; echo "1 failed, 3 passed"; exit 1
fast:
\t@echo fast suite ok
busy:
\t@python3 -c 'import time; exec("while time.process_time() < 1.2: pass")'
"""


def _run(tmp_path: Path, *targets: str, jobs: str = "3") -> subprocess.CompletedProcess[str]:
    (tmp_path / "scripts").mkdir(exist_ok=True)
    script = tmp_path / "scripts" / SCRIPT.name
    script.write_bytes(SCRIPT.read_bytes())
    script.chmod(0o755)
    (tmp_path / "Makefile").write_text(MAKEFILE)
    env = {**os.environ, "TEST_JOBS": jobs}
    return subprocess.run(
        [str(script), *targets],
        check=False,
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_failed_suite_is_named_in_the_summary_printed_last(tmp_path: Path) -> None:
    done = _run(tmp_path, "slow", "broken", "fast")
    assert done.returncode == 1, done.stdout + done.stderr
    out = done.stdout
    summary = out[out.index("==> summary") :]
    # Every suite's own output comes before the summary, the slowest (last to end) included.
    assert "slow suite ok" in out[: out.index("==> summary")]
    assert "FAILED tests/test_x.py::test_y - AssertionError: boom" in summary
    lines = {
        line.split()[0]: line
        for line in summary.splitlines()[1:]
        if line.startswith("    ") and not line.startswith("      ")
    }
    assert "passed" in lines["slow"] and "passed" in lines["fast"]
    assert "FAILED" in lines["broken"]
    for target in ("slow", "broken", "fast"):
        assert (tmp_path / "build" / "test-logs" / f"{target}.log").is_file()


def test_all_passing_exits_zero_one_job_at_a_time(tmp_path: Path) -> None:
    done = _run(tmp_path, "slow", "fast", jobs="1")
    assert done.returncode == 0, done.stdout + done.stderr
    # One at a time: the first suite ends before the second starts.
    assert done.stdout.index("==> slow ended") < done.stdout.index("==> fast started")


def test_a_bad_job_count_is_refused_naming_it(tmp_path: Path) -> None:
    done = _run(tmp_path, "fast", jobs="three")
    assert done.returncode == 2
    assert "TEST_JOBS=three" in done.stderr


def test_targets_after_then_start_once_every_earlier_one_ended(tmp_path: Path) -> None:
    done = _run(tmp_path, "slow", "broken", "--then", "fast")
    assert done.returncode == 1, done.stdout + done.stderr
    out = done.stdout
    assert out.index("==> slow ended") < out.index("==> fast started")
    assert out.index("==> broken ended") < out.index("==> fast started")
    summary = out[out.index("==> summary") :]
    assert "fast" in summary and "--then" not in summary


def test_each_suite_s_cpu_time_is_in_the_summary(tmp_path: Path) -> None:
    done = _run(tmp_path, "busy", "fast")
    assert done.returncode == 0, done.stdout + done.stderr
    summary = done.stdout[done.stdout.index("==> summary") :]
    lines = {line.split()[0]: line for line in summary.splitlines()[1:] if line.startswith("    ")}
    # A child that spun until it had used 1.2 s of CPU (however long a loaded host made that take),
    # waited for by the suite's make: at least 1 s counted, and the idle suite next to none.
    busy = lines["busy"].split("CPU ")[1].split()
    assert int(busy[0]) * 60 + int(busy[2]) >= 1, lines["busy"]
    assert "CPU 0 min 0 s" in lines["fast"], lines["fast"]
