"""Fixtures of the actor tests: the small policy model and the session's two-node Ray cluster."""

from tests.fixtures.ray_cluster import alloc_cfg, model, ray_nodes  # noqa: F401 - fixtures, shared
from tests.serve.conftest import small_model  # noqa: F401 - a fixture, shared
