"""Fixtures of the client tests: the small policy model of the runtime tests."""

from tests.runtime.conftest import small_model  # noqa: F401 - a fixture, shared
