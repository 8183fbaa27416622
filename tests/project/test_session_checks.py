"""The session check of tests/conftest.py that removes the private /dev/shm directory a session made,
with a concurrent session beside it (`make test` runs several pytest sessions at once).

A session that started before the directory existed sees it at its end, empty, and may remove it. When
another session made it in between and is about to create a segment in it, that removal fails the
other session's queue. A session of segment-free tests only (tests/ansible, tests/deploy) must leave
it; any other session removes an empty one it believes it made. Both run as real pytest sessions in
subprocesses; a plugin points the check at a directory of this test and makes the directory while the
subprocess's test runs, as the concurrent session would. A session that leaves a segment whose owner
has exited fails, naming it (it waits only while an owner still lives to unlink its own).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from lowtail.shm.segments import segment_name

ROOT = Path(__file__).resolve().parents[2]

PLUGIN = """\
import os
from pathlib import Path

import lowtail.shm.segments

DIRECTORY = Path(os.environ["LOWTAIL_TEST_PRIVATE_DIR"])
lowtail.shm.segments.private_dir = lambda *args, **kwargs: DIRECTORY


def pytest_runtest_call(item):
    # The concurrent session makes the directory for the segment it is about to create.
    DIRECTORY.mkdir(mode=0o700, exist_ok=True)
    # Or the session's own test leaves a segment of an owner that has exited.
    if os.environ.get("LOWTAIL_TEST_LEAVE_SEGMENT"):
        (DIRECTORY / os.environ["LOWTAIL_TEST_LEAVE_SEGMENT"]).write_bytes(b"")
"""


def run_session(
    tmp_path: Path, test_id: str, **env_extra: str
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """Runs one test as a pytest session of its own while a "concurrent session" makes the private
    directory; returns the run and that directory."""
    (tmp_path / "concurrent_session.py").write_text(PLUGIN)
    directory = tmp_path / "shm/lowtail-test"
    directory.parent.mkdir()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]),
        "LOWTAIL_TEST_PRIVATE_DIR": str(directory),
        **env_extra,
    }
    # Its own --basetemp: in the shared /tmp/pytest-of-<user>, a session that ends removes the old
    # numbered directories of sessions that ended before it, and beside `make test` that is a finished
    # suite's gigabyte of fixture trees (two minutes of a loaded run's I/O, in the last CI run).
    done = subprocess.run(
        [
            *(sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "concurrent_session"),
            *("--basetemp", str(tmp_path / "basetemp"), test_id),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return done, directory


def session_beside_a_concurrent_one(tmp_path: Path, test_id: str) -> Path:
    done, directory = run_session(tmp_path, test_id)
    assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout + done.stderr
    return directory


def test_a_segment_free_session_leaves_the_directory_a_concurrent_session_made(tmp_path: Path) -> None:
    directory = session_beside_a_concurrent_one(
        tmp_path, "tests/ansible/test_filters.py::test_unparsable_cmdline_is_an_error_naming_it"
    )
    assert directory.is_dir()


def test_another_session_removes_the_empty_directory_it_did_not_find(tmp_path: Path) -> None:
    """The control: the same run with a test outside the segment-free directories removes it."""
    directory = session_beside_a_concurrent_one(
        tmp_path, "tests/project/test_run_suites.py::test_a_bad_job_count_is_refused_naming_it"
    )
    assert not directory.exists()


def test_a_session_that_leaves_a_segment_of_an_exited_owner_fails_naming_it(tmp_path: Path) -> None:
    exited = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], check=True, capture_output=True, text=True
    )
    name = segment_name("q", pid=int(exited.stdout))
    done, directory = run_session(
        tmp_path,
        "tests/project/test_run_suites.py::test_a_bad_job_count_is_refused_naming_it",
        LOWTAIL_TEST_LEAVE_SEGMENT=name,
    )
    assert done.returncode != 0 and "1 passed, 1 error" in done.stdout, done.stdout + done.stderr
    assert f"this session left 1 entries in {directory}: {name}" in done.stdout, done.stdout
