"""The native payload-header decoder (slot names included) fuzzed against the Python reference for a
stated time (LOWTAIL_FUZZ_SECONDS, default 30 s), from the corpus kept in tests/shm/fuzz/corpus."""

from __future__ import annotations

import os

import pytest

from lowtail.shm import native
from tests.shm.fuzz import header_fuzz

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not native.available(), reason=native.implementation().reason),
]

FUZZ_SECONDS = float(os.environ.get("LOWTAIL_FUZZ_SECONDS", "30"))


def test_the_corpus_decodes_alike_and_the_valid_seeds_are_accepted() -> None:
    seeds = header_fuzz.seeds()
    assert len(seeds) >= 12
    for s in seeds:
        header_fuzz.check(s)
    assert sum(header_fuzz._native(s[1:], bool(s[0] & 1)) is not None for s in seeds) >= 12


def test_a_disagreement_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    # the checker itself: a reference that accepted a header the native decoder refuses must fail it
    bad = b"\x00" + b"\x02\x01\x00\x00"  # version 2: refused by both
    header_fuzz.check(bad)
    monkeypatch.setattr(header_fuzz, "_python", lambda raw, external: ("accepted", []))
    with pytest.raises(AssertionError, match="decoders disagree"):
        header_fuzz.check(bad)


def test_mutated_headers_decode_alike_for_the_stated_time() -> None:
    checked = header_fuzz.run(FUZZ_SECONDS, seed=int(os.environ.get("LOWTAIL_FUZZ_SEED", "0")))
    assert checked > 0
