from __future__ import annotations

import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

# No per-example time limit: a shared, loaded 2-vCPU machine makes hypothesis' 200 ms deadline a
# latency assertion in disguise (the project never asserts timings in tests).
settings.register_profile("lowtail", deadline=None)
settings.load_profile("lowtail")

# A run started in the background without job control (`nohup make test &`, some CI runners) inherits
# SIGINT ignored, and every child inherits that across exec: the tests that Ctrl-C a command would see
# it ignore the signal, as it should when its user asked for that. A caught signal is reset to the
# default on exec, so catching it here gives the children the terminal's disposition again.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # and blocked, which survives exec too

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.fixtures.machines import MACHINES, MachineSpec, write_machine  # noqa: E402


@pytest.fixture(scope="session")
def machine_roots(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """Every fixture machine written once per session: name -> (sys_root, proc_root)."""
    base = tmp_path_factory.mktemp("machines")
    return {name: write_machine(base / name, spec) for name, spec in MACHINES.items()}


@pytest.fixture
def make_machine(tmp_path: Path):  # type: ignore[no-untyped-def]
    """Write a custom machine: make_machine(spec) -> (sys_root, proc_root)."""

    def _make(spec: MachineSpec, name: str = "m") -> tuple[Path, Path]:
        return write_machine(tmp_path / name, spec)

    return _make


def _relative(item: pytest.Item) -> str:
    return Path(str(item.path)).resolve().relative_to(ROOT).as_posix()


# What makes a test slow here (seconds to minutes on a shared 2-vCPU machine): a Ray cluster, an
# ansible-playbook run, an OpenVINO model compiled in a spawned worker, a validation run with its
# probes, a benchmark. Marked in one place, by module and by fixture, so `make quick` (-m "not slow")
# skips them without a marker in every file; `make test` runs everything.
SLOW_MODULES = {
    "tests/ansible/test_site_playbook.py",  # ansible-playbook site.yml --check per bad input
    "tests/deploy/test_apply.py",  # the k8s role through ansible-playbook
    "tests/deploy/test_manifests.py",  # the k8s role rendered through ansible-playbook
    "tests/validation/test_role.py",  # playbooks/validate.yml
    "tests/validation/test_report.py",  # lowtail validate on this machine, probes included
    "tests/validation/test_probes.py",  # probes with thousands of samples per CPU
    "tests/validation/test_inference_progress.py",  # an OpenVINO model compiled in a pinned worker
    "tests/cli/test_cli_ray.py",  # a local Ray started by bench queue and by demo ray
    "tests/serve/test_worker.py",  # spawned pinned workers compiling OpenVINO models
    "tests/serve/test_standby.py",  # a primary and a standby worker, killed under clients
    "tests/benchmarks/test_serve_bench.py",
    "tests/benchmarks/test_queue_bench.py",
    "tests/benchmarks/test_soak_bench.py",  # a one-minute soak: 8 workers, clients killed and replaced
    "tests/validation/test_core_to_core_live.py",  # the C ping-pong built and run between the CPUs
    "tests/shm/test_queue_processes.py",  # kill/restart scenarios with real processes and timeouts
    "tests/shm/test_queue_withdraw.py",  # withdraw raced against claims, thousands of rounds
    # A Ray cluster (two raylets) or a local Ray started by the test itself.
    "tests/actors/test_actors.py",
    "tests/actors/test_allocator.py",
    "tests/actors/test_failover.py",
    "tests/actors/test_restart.py",
    "tests/actors/test_resources.py",
    "tests/demo/test_demo.py",
}
SLOW_FIXTURES = {"live_report", "ray_nodes", "hog"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        rel = _relative(item)
        if rel in SLOW_MODULES or SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


# Directories whose tests create no shared-memory segment on this host (their nodes are containers and
# fixture trees). `make test` runs them as a session of their own beside the rest (pytest-ansible).
SEGMENT_FREE_DIRS = ("tests/ansible/", "tests/deploy/")


@pytest.fixture(scope="session", autouse=True)
def no_private_shm_dir_left_behind(request: pytest.FixtureRequest) -> Iterator[None]:
    """The first queue a uid creates makes its private directory under /dev/shm (``lowtail-<uid>``,
    0700) and lowtail keeps it for the next one, as /run/user keeps a runtime directory. A test
    session that made it removes it again when it is empty (segments left in it are the queue suite's
    ``no_segment_left_behind`` to name). A session of segment-free tests only never made it: the
    directory it sees is a concurrent session's, which may be about to create a segment in it."""
    from lowtail.shm.segments import parse_name, private_dir, process_alive

    path = private_dir()
    existed = path.exists()
    segment_free = all(_relative(item).startswith(SEGMENT_FREE_DIRS) for item in request.session.items)
    yield
    if segment_free or existed or not path.is_dir() or path.is_symlink():
        return
    # The session's last actors can still be unlinking their queues: Ray stops (and its raylet kills)
    # their processes after the session's own teardown, and a worker orphaned by a killed actor exits
    # by itself later still, so no fixed wait is long enough on a loaded host. Wait while a segment's
    # owner (the pid in its name) lives to unlink its own, then name what is left: a leak, not a delay.
    deadline = time.monotonic() + 180
    while (left := sorted(e.name for e in path.iterdir())) and time.monotonic() < deadline:
        owners = [parse_name(name) for name in left]
        if not any(o is not None and process_alive(o.pid) for o in owners):
            break  # nobody is left to unlink them
        time.sleep(0.2)
    if left:
        pytest.fail(f"this session left {len(left)} entries in {path}: {', '.join(left)}", pytrace=False)
    path.rmdir()
