"""Fixtures of the demo tests: the two-node Ray cluster (package scope: started for this folder alone)."""

from tests.fixtures.ray_cluster import alloc_cfg, model, ray_nodes  # noqa: F401 - fixtures, shared
