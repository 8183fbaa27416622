"""The native poll makes a sampler's next request an ``_Item`` without the class call (allocated as
``object.__new__`` allocates it, its slots set one by one: ``ItemMaker::item`` in native/src/poll.rs).
It must be the item ``_Item.__init__`` makes of the same request, slot for slot; and the poll is bound
only to an item class whose instances ``object.__new__`` makes."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from lowtail.shm import native
from lowtail.shm.server import _Item
from tests.shm.helpers import echo, native_pair

pytestmark = pytest.mark.skipif(
    not native.available(), reason=f"no native core: {native.implementation().reason}"
)

X = {"x": np.arange(16, dtype=np.float32).reshape(2, 8)}


def test_the_core_makes_the_item_init_makes() -> None:
    with native_pair(slots_per_lane=1) as (c, w):
        polled: list[int] = []
        real = w._polled
        w._polled = lambda entries, *a: polled.append(len(entries)) or real(entries, *a)  # type: ignore[method-assign]
        for k in range(3):  # the first request's header is decoded in Python; the next are the core's
            t = c.submit({"x": X["x"] + k})
            batch = w.claim(1.0)
            assert batch is not None
            it = batch._items[0]
            if k:
                assert len(polled) == 1, "the core did not make the item"
                _, views, layout = w._in_views[it.g]
                want = {
                    "lane": 0, "g": 0, "si": w._slot_i[0], "seq": t.seq, "gen": int(w._m.q[w._gen_i[0]]),
                    "submit_ns": t.submit_ns, "claim_ns": batch.claimed_ns, "layout": layout,
                    "inputs": views, "inline": True, "done": False,
                }  # fmt: skip
                assert type(it) is _Item and sorted(want) == sorted(_Item.__slots__)
                for name, value in want.items():  # every slot set, to what _polled would set it
                    got = getattr(it, name)
                    assert type(got) is type(value) and (got is value or got == value), name
            with batch:
                batch.complete(echo(batch.inputs["x"]))
            assert (c.wait(t, 1.0)["twice"] == 2 * (X["x"] + k) + 1).all()


class _Counted:
    """An item class without slots: the core makes its items by calling it (counted)."""

    made = 0

    def __init__(self, *args: object) -> None:
        _Counted.made += 1
        self.lane, self.g, self.si, self.seq, self.gen, self.submit_ns, self.claim_ns = args[:7]
        self.layout, self.inputs, self.inline, self.done = *args[7:10], False


class _SlottedInit(_Item):
    """A slotted item class made by ``object.__new__``: the core sets its slots, its ``__init__`` is
    never called (counted)."""

    __slots__ = ()
    made = 0

    def __init__(self, *args: Any) -> None:
        _SlottedInit.made += 1
        super().__init__(*args)


@pytest.mark.parametrize(("cls", "called"), [(_Counted, True), (_SlottedInit, False)])
def test_a_slotted_item_class_gets_its_slots_set_and_any_other_its_call(cls: Any, called: bool) -> None:
    with native_pair(slots_per_lane=1) as (c, w):
        cfg_, cache = w._cfg, w._claim_cache
        w._poller.bind(w._native, cfg_.max_batch_slots, cfg_.max_batch_samples, (*cache[:3], cls))
        cls.made = 0
        for k in range(3):
            t = c.submit({"x": X["x"] + k})
            batch = w.claim(1.0)
            assert batch is not None
            it = batch._items[0]
            assert type(it) is (cls if k else _Item)  # the first request's item is _polled's
            assert (it.lane, it.seq, it.submit_ns, it.claim_ns, it.inline, it.done) == (
                0, t.seq, t.submit_ns, batch.claimed_ns, True, False,
            )  # fmt: skip
            with batch:
                batch.complete(echo(batch.inputs["x"]))
            assert (c.wait(t, 1.0)["twice"] == 2 * (X["x"] + k) + 1).all()
        assert cls.made == (2 if called else 0)
