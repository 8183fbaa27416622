from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import tempfile
from collections.abc import Iterator
from multiprocessing.context import BaseContext
from pathlib import Path
from typing import Any

import pytest

from lowtail.shm import native, segments
from lowtail.shm.queue import InferenceQueue, QueueConfig
from tests.fixtures.tmpfs import tmpfs  # noqa: F401 - a fixture, shared
from tests.shm.helpers import QUEUE_IMPLEMENTATIONS


def _ours_or_dead() -> set[str]:
    """Lowtail segments this test session could have left: owned by a dead process or by us."""
    return {s.name for s in segments.list_segments() if s.liveness == "dead" or s.pid == os.getpid()}


@pytest.fixture(scope="session", autouse=True)
def no_segment_left_behind() -> Iterator[None]:
    """The suite must leave no lowtail segment in this uid's directory under /dev/shm (segments of other
    live processes are theirs)."""
    before = _ours_or_dead()
    yield
    left = _ours_or_dead() - before
    assert not left, f"lowtail segments left in /dev/shm after the queue tests: {sorted(left)}"


@pytest.fixture
def server() -> Iterator[InferenceQueue]:
    """2 lanes x 2 slots, no coalescing: one process plays client and worker step by step (a module
    that needs another geometry defines its own ``server``)."""
    with InferenceQueue.create(QueueConfig(lanes=2, slots_per_lane=2, coalesce_us=0)) as s:
        yield s


@pytest.fixture(scope="session")
def _forkserver() -> BaseContext:
    """forkserver: children start clean (no inherited fds, so no inherited OFD lane locks) and fast."""
    c = mp.get_context("forkserver")
    c.set_forkserver_preload(["numpy", "lowtail.shm.queue", "tests.shm.helpers"])
    return c


class _PathContext:
    """A multiprocessing context whose children attach with the hot path of the test (``queue_impl``)."""

    def __init__(self, ctx: BaseContext, use_native: bool) -> None:
        self._ctx = ctx
        self._native = use_native

    def Process(self, target: Any = None, args: tuple[Any, ...] = (), **kw: Any) -> Any:
        from tests.shm import helpers

        return self._ctx.Process(target=helpers.with_path, args=(self._native, target, *args), **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ctx, name)


@pytest.fixture
def ctx(request: pytest.FixtureRequest, _forkserver: BaseContext) -> Any:
    """The forkserver context; in a module that runs on both paths, one that passes the path on."""
    if "queue_impl" in request.fixturenames:
        impl = request.getfixturevalue("queue_impl")
        return _PathContext(_forkserver, impl == "native")
    return _forkserver


@pytest.fixture(scope="session")
def small_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The runtime tests' small policy model (built here, no downloads)."""
    from lowtail.serve.model import write_model
    from tests.serve.conftest import SMALL_SPEC

    out = tmp_path_factory.mktemp("model")
    write_model(out, SMALL_SPEC)
    return out


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A sticky world-writable directory like /dev/shm, private to the test (pytest's tmp_path is
    under a 0700 directory the second uid cannot enter)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to setuid a forked child to a second uid")
    d = Path(tempfile.mkdtemp(prefix="lowtail-test-shm-"))
    d.chmod(0o1777)
    try:
        yield d
    finally:
        shutil.rmtree(d)


@pytest.fixture(params=sorted(QUEUE_IMPLEMENTATIONS))
def queue_impl(request: pytest.FixtureRequest) -> Iterator[str]:
    """The name of a queue implementation (``QUEUE_IMPLEMENTATIONS``): a test that takes it runs on each,
    with its mappings (and those of the children ``ctx`` starts) on that hot path."""
    impl = str(request.param)
    if impl == "native" and not native.available():
        pytest.skip(f"the native core is not available: {native.implementation().reason}")
    with native.use(impl == "native"):
        yield impl
