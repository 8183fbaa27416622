"""EnvSpec's batch is ``rows``; the old keyword ``heroes`` still works for a release, with a warning."""

from __future__ import annotations

import pytest

from lowtail.actors.sampler import EnvSpec, SyntheticEnv


def test_rows_is_the_batch_one_request_carries() -> None:
    assert SyntheticEnv(EnvSpec(features=16, rows=3)).obs.shape == (3, 16)


def test_the_old_heroes_keyword_is_rows_with_a_deprecation_warning() -> None:
    with pytest.warns(DeprecationWarning, match=r"EnvSpec\(heroes=\) is renamed EnvSpec\(rows=\)"):
        spec = EnvSpec(features=16, heroes=5)
    assert spec.rows == 5
    assert spec == EnvSpec(features=16, rows=5)
