"""The native payload-header decoder (slot names included, field by field at their bounds) and the
client's answer read (``receive_answer``'s header compare and copy-out) fuzzed against the Python
reference for a stated time (LOWTAIL_FUZZ_SECONDS, default 30 s), from the corpus kept in
tests/shm/fuzz/corpus."""

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


def test_an_answer_read_by_another_rule_than_the_clients_is_caught() -> None:
    # the answer checker itself: a core read with another key than the one the rule compares must fail
    keys = header_fuzz.answer_keys(header_fuzz.seeds())
    assert len(keys) >= 3
    (key, plan), (_, other) = keys[0], keys[1]
    region = key + bytes(range(256)) * 8
    header_fuzz.check_answer(key, plan, region, True, True)  # the key: its arrays, as Python reads them
    header_fuzz.check_answer(key, plan, b"\xff" + region[1:], True, True)  # another header: not read
    header_fuzz.check_answer(key, plan, region, False, True)  # an error status: not read
    with pytest.raises(AssertionError, match="key equal"):
        header_fuzz.check_answer(key, other, region, True, True)


def test_slot_names_at_their_bounds_decode_alike() -> None:
    import random

    rnd = random.Random(0)
    pool = [s for s in header_fuzz.seeds() if s and s[0] & 1 and not s[0] & 2]
    accepted = 0
    for _ in range(2000):
        data = bytes(header_fuzz._mutate_name(bytearray(rnd.choice(pool)), rnd))
        header_fuzz.check(data)
        accepted += header_fuzz._python(data[1:], True) is not None
    assert 0 < accepted < 2000  # both sides of the bounds were reached


def test_mutated_headers_decode_alike_for_the_stated_time() -> None:
    checked = header_fuzz.run(FUZZ_SECONDS, seed=int(os.environ.get("LOWTAIL_FUZZ_SEED", "0")))
    assert checked > 0
