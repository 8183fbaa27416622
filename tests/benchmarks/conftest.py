"""Fixtures of the benchmark tests: the queue suite's spawn context and leak check, the small policy model."""

from tests.serve.conftest import small_model  # noqa: F401 - a fixture, shared
from tests.shm.conftest import ctx, no_segment_left_behind  # noqa: F401 - fixtures, shared
