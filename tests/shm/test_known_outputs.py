"""A worker's outputs are answered as they are, call after call, whatever they change.

On the native path the worker keeps the layout of the outputs it answered last for each batch size, with
the answer plans of the request sizes it answered them in, and the core answers outputs of exactly that
layout without validating them again, in batches of one request or of several coalesced. These tests
change the outputs between calls of the same batch size (a dtype, the order of the names, a shape, a name
more or less, the memory layout, the array type, a mapping that is not a dict) and check that every
answer is what the worker returned, that outputs that are wrong after a known layout are refused as
before, and that requests done before the answer, fenced lanes and many batch compositions are handled
as the validated path handles them. On both paths.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from lowtail.shm import server as server_module
from lowtail.shm.layout import L_GEN, ST_CLIENT_GONE, ST_OK, W_RESP_STATUS
from lowtail.shm.queue import (
    BadRequest,
    InferenceQueue,
    QueueClient,
    QueueConfig,
    QueueWorker,
    RequestFailed,
)
from tests.shm.helpers import filled


class _Sub(np.ndarray):  # type: ignore[type-arg]
    """An ndarray subclass: a valid output, never the layout the core recognises."""


def _outputs(x: np.ndarray[Any, Any]) -> list[dict[str, np.ndarray[Any, Any]]]:
    """Each change alone, the first layout between two: every change is met with that layout known."""
    twice, rowsum = x * 2.0, x.sum(axis=1, keepdims=True).astype(np.float64)
    changed = [
        {"twice": twice.astype(np.float64), "rowsum": rowsum},  # another dtype
        {"rowsum": rowsum, "twice": twice},  # the names in another order
        {"double": twice, "rowsum": rowsum},  # another name, the same arrays
        {"twice": np.repeat(twice, 2, axis=1), "rowsum": rowsum},  # another shape
        {"twice": twice, "rowsum": rowsum, "more": rowsum * 3},  # a name more
        {"twice": twice},  # a name less
        {"twice": np.asfortranarray(twice), "rowsum": rowsum[::-1][::-1]},  # other memory layouts
        {"twice": twice.view(_Sub), "rowsum": rowsum},  # a subclass
        types.MappingProxyType({"twice": twice, "rowsum": rowsum}),  # a mapping, not a dict
    ]
    first = {"twice": twice, "rowsum": rowsum}
    return [first, {"twice": twice + 1, "rowsum": rowsum + 1}] + [o for c in changed for o in (c, first)]


def _count_core_answers(w: QueueWorker) -> list[bool]:
    """Each call of the worker's known-layout answer from now on: True when the core answered."""
    answer_known, hits = w._answer_known, []

    def counted(*a: Any) -> Any:
        got = answer_known(*a)
        hits.append(got is not None)
        return got

    w._answer_known = counted  # type: ignore[method-assign]
    return hits


@pytest.mark.parametrize("clients", [1, 2])
def test_outputs_that_change_between_calls_of_one_batch_size_are_answered_as_they_are(
    server: InferenceQueue, queue_impl: str, clients: int
) -> None:
    """One request per batch, then two coalesced: each client gets its rows of what the worker sent."""
    with QueueWorker.attach(server.descriptor) as w:
        cs = [QueueClient.attach(server.descriptor) for _ in range(clients)]
        hits = _count_core_answers(w)
        for round_ in range(2):  # the second round starts with a layout known
            for k in range(len(_outputs(filled(1.0)["x"]))):
                ts = [c.submit(filled(float(k + 1 + 100 * i))) for i, c in enumerate(cs)]
                with w.claim(timeout_s=5.0) as batch:
                    assert len(batch) == clients
                    sent = _outputs(np.array(batch.inputs["x"]))[k]
                    batch.complete(sent)
                for c, t in zip(cs, ts, strict=True):
                    got = c.wait(t, timeout_s=5.0)
                    assert list(got) == list(sent), (round_, k)
                    rows = slice(2 * batch.lanes.index(c.lane), 2 * batch.lanes.index(c.lane) + 2)
                    for name, a in sent.items():
                        assert got[name].dtype == a.dtype, (round_, k, name)
                        np.testing.assert_array_equal(got[name], a[rows], err_msg=f"{round_} {k} {name}")
        for c in cs:
            c.close()
        # The core answered the repeats of a known layout (each round's second call, the other memory
        # layouts and the first layout after them) and declined the changes, which were validated.
        if queue_impl == "native":
            assert sum(hits) >= 6 and not all(hits), hits
        else:
            assert hits == [] and not w._known


@pytest.fixture
def four() -> Iterator[InferenceQueue]:
    """4 lanes x 2 slots, no coalescing wait: batches of up to 4 clients' requests."""
    with InferenceQueue.create(QueueConfig(lanes=4, slots_per_lane=2, coalesce_us=0)) as s:
        yield s


def _round(w: QueueWorker, cs: list[QueueClient], rows: list[int], tag: float, fail: int = -1) -> None:
    """Client k sends ``rows[k]`` rows of ``tag + k``; one batch answers them all (request ``fail`` of
    the batch failed first); each client gets its own rows back doubled, and their sums."""
    ts = [c.submit(filled(tag + k, n)) for k, (c, n) in enumerate(zip(cs, rows, strict=True))]
    with w.claim(timeout_s=5.0) as batch:
        assert sorted(batch.sizes) == sorted(rows) and len(batch) == len(rows)
        if fail >= 0:
            batch.fail_request(fail, "failed on its own")
        x = np.array(batch.inputs["x"])
        batch.complete({"twice": x * 2, "rowsum": x.sum(axis=1, keepdims=True).astype(np.float64)})
        failed = batch.lanes[fail] if fail >= 0 else -1
    for k, (c, t, n) in enumerate(zip(cs, ts, rows, strict=True)):
        if c.lane == failed:
            with pytest.raises(RequestFailed, match="failed on its own"):
                c.wait(t, timeout_s=5.0)
            continue
        got = c.wait(t, timeout_s=5.0)
        np.testing.assert_array_equal(got["twice"], np.full((n, 4), 2 * (tag + k), np.float32))
        np.testing.assert_array_equal(got["rowsum"], np.full((n, 1), 4 * (tag + k), np.float64))


def test_a_coalesced_batch_of_a_known_layout_is_answered_by_the_core_in_any_composition(
    four: InferenceQueue, queue_impl: str
) -> None:
    """The core answers a batch of several requests whose outputs are the layout it knows for that many
    rows, once it has the plan of each request's size; a size it has none for is validated, and its
    plan is kept with the others."""
    with QueueWorker.attach(four.descriptor) as w:
        cs = [QueueClient.attach(four.descriptor) for _ in range(4)]
        hits = _count_core_answers(w)
        compositions = [[1, 1, 1, 1], [1, 1, 1, 1], [2, 1, 1], [1, 1, 2], [3, 1], [2, 2], [1, 3]]
        for k, rows in enumerate(compositions):
            _round(w, cs[: len(rows)], rows, 10.0 * (k + 1))
        for c in cs:
            c.close()
        # the first batch of 4 rows is validated (no layout known), then: known, a size 2 unknown,
        # known, a size 3 unknown, known, known
        if queue_impl == "native":
            assert hits == [True, False, True, False, True, True], hits
        else:
            assert hits == [] and not w._known


def test_a_request_done_before_complete_is_skipped_and_the_rest_answered(
    four: InferenceQueue, queue_impl: str
) -> None:
    with QueueWorker.attach(four.descriptor) as w:
        cs = [QueueClient.attach(four.descriptor) for _ in range(3)]
        hits = _count_core_answers(w)
        _round(w, cs, [1, 2, 1], 1.0)  # the layout known from here
        for fail in range(3):
            _round(w, cs, [1, 2, 1], 10.0 * (fail + 1), fail=fail)
        for c in cs:
            c.close()
        assert hits == ([True] * 3 if queue_impl == "native" else []), hits


def test_a_fenced_lane_in_a_coalesced_batch_is_answered_client_gone_and_the_rest_ok(
    four: InferenceQueue, queue_impl: str
) -> None:
    """A lane that changed hands between the claim and the answer (its generation moved) gets the
    client-gone answer, the others their rows: on both paths, known layout or not."""
    with QueueWorker.attach(four.descriptor) as w:
        a, b = QueueClient.attach(four.descriptor), QueueClient.attach(four.descriptor)
        hits = _count_core_answers(w)
        q, geo = w._m.q, w._m.geo
        for _ in range(2):  # the second time with the layout known
            ta, tb = a.submit(filled(1.0)), b.submit(filled(2.0))
            with w.claim(timeout_s=5.0) as batch:
                x = np.array(batch.inputs["x"])
                gen = q[geo.lane(b.lane, L_GEN)]
                q[geo.lane(b.lane, L_GEN)] = gen + 1
                batch.complete({"twice": x * 2})
                g_of = {it.lane: it.g for it in batch._items}
            q[geo.lane(b.lane, L_GEN)] = gen  # b's own again: it may close
            assert q[geo.slot_word(g_of[b.lane]) + W_RESP_STATUS] == ST_CLIENT_GONE
            assert q[geo.slot_word(g_of[a.lane]) + W_RESP_STATUS] == ST_OK
            twice = a.wait(ta, timeout_s=5.0)["twice"]
            np.testing.assert_array_equal(twice, np.full((2, 4), 2.0, np.float32))
            with pytest.raises(RequestFailed, match="gone"):
                b.wait(tb, timeout_s=5.0)
        a.close()
        b.close()
        assert hits == ([True] if queue_impl == "native" else []), hits


def test_many_batch_compositions_keep_the_known_layouts_bounded(
    four: InferenceQueue, queue_impl: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batch sizes and request sizes that vary without bound: the worker keeps at most
    KNOWN_OUTPUTS_MAX layouts and KNOWN_PLANS_MAX request sizes for each, and answers every batch."""
    monkeypatch.setattr(server_module, "KNOWN_OUTPUTS_MAX", 3)
    monkeypatch.setattr(server_module, "KNOWN_PLANS_MAX", 2)
    with QueueWorker.attach(four.descriptor) as w:
        cs = [QueueClient.attach(four.descriptor) for _ in range(3)]
        for k, rows in enumerate([[n, m, r] for n in (1, 2, 3) for m in (1, 4) for r in (2, 5)]):
            _round(w, cs, rows, float(k))
            assert len(w._known) <= 3 and w._known.keys() == w._known_plans.keys()
            assert all(len(plans) <= 2 for _, plans in w._known_plans.values())
        for c in cs:
            c.close()
        assert (len(w._known) > 0) is (queue_impl == "native")


def test_a_new_request_size_adds_to_the_kept_plans_up_to_the_bound(
    four: InferenceQueue, queue_impl: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch with one new request size beside known ones adds that size: the sizes kept before stay
    answerable while the union fits KNOWN_PLANS_MAX (sizes already kept were counted twice and the
    union of three sizes under a bound of 3 dropped one)."""
    monkeypatch.setattr(server_module, "KNOWN_PLANS_MAX", 3)
    with QueueWorker.attach(four.descriptor) as w:
        cs = [QueueClient.attach(four.descriptor) for _ in range(3)]
        _round(w, cs[:2], [1, 3], 1.0)  # 4 rows: sizes 1 and 3 kept
        _round(w, cs, [1, 1, 2], 2.0)  # 4 rows again: size 2 is new, 1 is kept
        for c in cs:
            c.close()
        kept = w._known_plans.get(4)
        assert (sorted(kept[1]) if kept else []) == ([1, 2, 3] if queue_impl == "native" else [])


@pytest.mark.usefixtures("queue_impl")
def test_wrong_outputs_after_a_known_layout_are_refused_as_before(server: InferenceQueue) -> None:
    with QueueClient.attach(server.descriptor) as c, QueueWorker.attach(server.descriptor) as w:
        t = c.submit(filled(1.0))
        with w.claim(timeout_s=5.0) as batch:
            x = np.array(batch.inputs["x"])
            batch.complete({"twice": x * 2})
        np.testing.assert_array_equal(c.wait(t, timeout_s=5.0)["twice"], x * 2)
        bad: list[tuple[Any, str]] = [
            ({"twice": x[:1] * 2}, "leading dimension 2"),
            ({"twice": (x * 2).tolist()}, "expected a numpy array"),
            ({}, "non-empty dict"),
        ]
        for outputs, why in bad:
            t = c.submit(filled(1.0))
            with w.claim(timeout_s=5.0) as batch, pytest.raises(BadRequest, match=why):
                batch.complete(outputs)
            with pytest.raises(RequestFailed, match=why):
                c.wait(t, timeout_s=5.0)
        t = c.submit(filled(2.0))
        with w.claim(timeout_s=5.0) as batch:
            batch.complete({"twice": np.array(batch.inputs["x"]) * 2})
        np.testing.assert_array_equal(c.wait(t, timeout_s=5.0)["twice"], np.full((2, 4), 4.0, np.float32))
