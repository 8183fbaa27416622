"""A bench transport whose server process was created but never started: ``stop()`` must not raise
(``Process.join`` asserts a started process, which would hide start()'s own error) and must still close
everything the transport owns; and stop() twice is harmless."""

from __future__ import annotations

import errno
from multiprocessing.context import SpawnProcess
from pathlib import Path
from typing import Any

import pytest

from lowtail.benchmarks.queue_transports import TRANSPORTS, Transport
from lowtail.shm import segments

# ray_actor starts no process of its own (Ray's daemons are Ray's); every other transport does.
WITH_A_PROCESS = sorted(n for n in TRANSPORTS if n != "ray_actor")


def _owned_paths(t: Transport) -> list[Path]:
    """The files and directories a half-started transport holds: its segments, lock file, temp dirs."""
    state: dict[str, Any] = vars(t)
    paths = [Path(state[k]) for k in ("lock_path", "tmp", "root") if k in state]
    if "seg" in state:
        paths.append(state["seg"].path)
    if "server" in state:  # lowtail's queue segment
        paths.append(state["server"].descriptor.path)
    if "prefix" in state:  # iceoryx2's shared-memory files
        paths += list(Path(segments.SHM_DIR).glob(f"{state['prefix']}*"))
    return paths


@pytest.mark.usefixtures("no_segment_left_behind")
@pytest.mark.parametrize("name", WITH_A_PROCESS)
def test_stop_after_the_server_process_failed_to_start_closes_everything(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Process.start() fails as it does when the host is out of processes (EAGAIN from the spawn): the
    Process object exists, unstarted. start() raises that error, stop() then closes what start() had
    made (twice, without raising) and forgets the process."""

    def no_more_processes(_process: SpawnProcess) -> None:
        raise OSError(errno.EAGAIN, "Resource temporarily unavailable")

    monkeypatch.setattr(SpawnProcess, "_Popen", staticmethod(no_more_processes))
    t = TRANSPORTS[name](None, "normal")
    try:
        with pytest.raises(OSError, match="Resource temporarily unavailable"):
            t.start()
        assert t.proc is not None or name.startswith("iceoryx2")  # iceoryx2's start() stops itself
        owned = _owned_paths(t)
    finally:
        t.stop()
    assert t.proc is None
    assert [p for p in owned if p.exists()] == []
    conn = getattr(t, "conn", None)
    assert conn is None or conn.closed
    t.stop()  # a second stop (a caller's finally after start()'s own cleanup) is harmless
    # What it owned is still gone (not the whole temp directory: other suites write there meanwhile)
    assert [p for p in owned if p.exists()] == []
