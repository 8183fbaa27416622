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
        assert w._poller.fast_items
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
                gen = int(w._m.q[w._gen_i[0]])
                # what _polled makes of this request: _Item's own call, whatever its __init__ stores
                ref = _Item(
                    0, 0, w._slot_i[0], t.seq, gen, t.submit_ns, batch.claimed_ns, layout, views, True
                )
                assert type(it) is _Item
                for name in _Item.__slots__:  # every slot set (no AttributeError), as the call sets it
                    got, want = getattr(it, name), getattr(ref, name)
                    assert type(got) is type(want) and (got is want or got == want), name
            with batch:
                batch.complete(echo(batch.inputs["x"]))
            assert (c.wait(t, 1.0)["twice"] == 2 * (X["x"] + k) + 1).all()


class _Counted:
    """An item class with a ``__dict__``: the core makes its items by calling it (counted)."""

    made = 0

    def __init__(self, *args: object) -> None:
        _Counted.made += 1
        self.lane, self.g, self.si, self.seq, self.gen, self.submit_ns, self.claim_ns = args[:7]
        self.layout, self.inputs, self.inline, self.done = *args[7:10], False


class _Tagged(_Item):
    """A slotted item class whose ``__init__`` stores one slot more: made by its call (counted)."""

    __slots__ = ("tag",)
    made = 0

    def __init__(self, *args: Any) -> None:
        _Tagged.made += 1
        super().__init__(*args)
        self.tag = "tagged"


class _Meta(type):
    pass


class _OfMeta(_Item, metaclass=_Meta):
    """A slotted item class of a metaclass of its own (which could lie about its size): made by its call."""

    __slots__ = ()
    made = 0

    def __init__(self, *args: Any) -> None:
        _OfMeta.made += 1
        super().__init__(*args)


class _Same(_Item):
    """A slotted subclass storing what ``_Item`` stores: its items made without its call."""

    __slots__ = ()


@pytest.mark.parametrize(
    ("cls", "fast"), [(_Counted, False), (_Tagged, False), (_OfMeta, False), (_Same, True)]
)
def test_only_an_item_class_whose_init_stores_the_item_slots_gets_them_set_and_any_other_its_call(
    cls: Any, fast: bool
) -> None:
    with native_pair(slots_per_lane=1) as (c, w):
        cfg, cache = w._cfg, w._claim_cache
        cls.made = 0
        w._poller.bind(w._native, cfg.max_batch_slots, cfg.max_batch_samples, (*cache[:3], cls))
        assert w._poller.fast_items is fast
        probes = cls.made  # the bind's probe of a slotted class calls it once
        for k in range(3):
            t = c.submit({"x": X["x"] + k})
            batch = w.claim(1.0)
            assert batch is not None
            it = batch._items[0]
            assert type(it) is (cls if k else _Item)  # the first request's item is _polled's
            assert (it.lane, it.seq, it.submit_ns, it.claim_ns, it.inline, it.done) == (
                0, t.seq, t.submit_ns, batch.claimed_ns, True, False,
            )  # fmt: skip
            if cls is _Tagged and k:
                assert it.tag == "tagged"  # its __init__ ran
            with batch:
                batch.complete(echo(batch.inputs["x"]))
            assert (c.wait(t, 1.0)["twice"] == 2 * (X["x"] + k) + 1).all()
        if cls is not _Same:
            assert cls.made - probes == 2
