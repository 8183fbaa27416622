"""A worker's outputs are answered as they are, call after call, whatever they change.

On the native path the worker keeps the layout of the outputs it answered last for each batch size, with
the answer plans of the request sizes it answered them in, and the core answers outputs of exactly that
layout without validating them again, in batches of one request or of several coalesced. These tests
change the outputs between calls of the same batch size (a dtype, the order of the names, a shape, a name
more or less, the memory layout, the array type, a mapping that is not a dict) and check that every
answer is what the worker returned, that outputs that are wrong after a known layout are refused as
before, and that requests done before the answer, fenced lanes and many batch compositions are handled
as the validated path handles them. On both paths, and each answered both ways (``answerer``): by
``Batch.complete``, and by the native recorder's ``finish_call``, the serving loop's way on the native
path, which answers a known layout in the core without ``complete``'s Python.
"""

from __future__ import annotations

import time
import types
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from lowtail.serve import call_recorder
from lowtail.serve.call_stats import RAW_FIELDS
from lowtail.serve.pinning import SchedFifo
from lowtail.serve.stats_segment import StatsSegment
from lowtail.shm import native
from lowtail.shm import server as server_module
from lowtail.shm.layout import L_GEN, L_PARKED, ST_CLIENT_GONE, ST_OK, W_RESP_STATUS
from lowtail.shm.queue import (
    BadRequest,
    BatchClosed,
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


class Answerer:
    """Answers a claimed batch with outputs one of two ways, and keeps, per answer of a batch size
    answered before, whether the core answered it as a known layout (``hits``)."""

    def __init__(self, how: str, monkeypatch: pytest.MonkeyPatch) -> None:
        self.how, self.hits = how, []
        self._complete_calls = 0
        self._rec: Any = None
        if how == "complete":  # counted where complete() asks the core (answer)
            return
        self._stats = StatsSegment.create(capacity=64)
        with native.use(True):
            self._rec = call_recorder.new_recorder(
                self._stats, SchedFifo(), hero="t", cpu=0, threads=1, slow_engine_cpu_ms=1e9,
                slow_total_ms=1e9, stats_every=1000,
            )  # fmt: skip
        complete = server_module.Batch.complete

        def counted_complete(batch: server_module.Batch, *a: Any, **kw: Any) -> Any:
            self._complete_calls += 1
            return complete(batch, *a, **kw)

        monkeypatch.setattr(server_module.Batch, "complete", counted_complete)

    def answer(self, batch: server_module.Batch, outputs: Any) -> None:
        if self._rec is None:
            w = batch._worker
            if batch._open and not w._closed and sum(batch.sizes) in w._known:
                # a layout of these rows known: whether the core answered it (not None) or declined
                core, got = w._complete_known, []
                w._complete_known = lambda *a: got.append(core(*a)) or got[-1]
                try:
                    batch.complete(outputs)
                finally:
                    w._complete_known = core
                    self.hits += [g is not None for g in got]
            else:
                batch.complete(outputs)
            return
        st = call_recorder.stamps()
        # t0, th0 and e0, from which (with its own stamps) finish_call makes what its answers carry: a
        # claim 5 ms ago that this thread did not run for, so the deschedule is never 0. The rest
        # play no part here.
        st[8] = time.monotonic_ns()
        st[0], st[1] = st[8] - 5_000_000, time.thread_time_ns()
        known, before = batch._worker._known.get(sum(batch.sizes)), self._complete_calls
        self._rec.finish_call(batch, outputs, sum(batch.sizes), st, False)
        if known is not None:  # complete() not called: the core answered the known layout itself
            self.hits.append(self._complete_calls == before)

    def recorded(self) -> int:
        """The calls ``finish_call`` recorded so far (0 answering by ``complete``)."""
        return 0 if self._rec is None else int(self._rec.count)

    def last_row(self) -> dict[str, int]:
        """The raw row ``finish_call`` recorded last."""
        k = self._rec.count - 1
        return dict(zip(RAW_FIELDS, self._stats.raw[k % len(self._stats.raw)].tolist(), strict=True))

    def close(self) -> None:
        if self._rec is not None:
            self._rec.close()
            self._stats.close()


@pytest.fixture(params=["complete", "finish_call"])
def answerer(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Answerer]:
    """``Batch.complete``, or the native recorder's ``finish_call``: on the Python path too, where it
    finds no known layout and answers with ``complete`` (new_recorder pairs it with the native path)."""
    if request.param == "finish_call" and not native.available():
        pytest.skip(f"the native core is not available: {native.implementation().reason}")
    a = Answerer(str(request.param), monkeypatch)
    try:
        yield a
    finally:
        a.close()


@pytest.mark.parametrize("clients", [1, 2])
def test_outputs_that_change_between_calls_of_one_batch_size_are_answered_as_they_are(
    server: InferenceQueue, queue_impl: str, clients: int, answerer: Answerer
) -> None:
    """One request per batch, then two coalesced: each client gets its rows of what the worker sent."""
    with QueueWorker.attach(server.descriptor) as w:
        cs = [QueueClient.attach(server.descriptor) for _ in range(clients)]
        hits = answerer.hits
        for round_ in range(2):  # the second round starts with a layout known
            for k in range(len(_outputs(filled(1.0)["x"]))):
                ts = [c.submit(filled(float(k + 1 + 100 * i))) for i, c in enumerate(cs)]
                with w.claim(timeout_s=5.0) as batch:
                    assert len(batch) == clients
                    sent = _outputs(np.array(batch.inputs["x"]))[k]
                    answerer.answer(batch, sent)
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


def _round(
    answerer: Answerer, w: QueueWorker, cs: list[QueueClient], rows: list[int], tag: float, *, fail: int = -1
) -> None:
    """Client k sends ``rows[k]`` rows of ``tag + k``; one batch answers them all (request ``fail`` of
    the batch failed first); each client gets its own rows back doubled, and their sums."""
    ts = [c.submit(filled(tag + k, n)) for k, (c, n) in enumerate(zip(cs, rows, strict=True))]
    with w.claim(timeout_s=5.0) as batch:
        assert sorted(batch.sizes) == sorted(rows) and len(batch) == len(rows)
        if fail >= 0:
            batch.fail_request(fail, "failed on its own")
        x = np.array(batch.inputs["x"])
        answerer.answer(batch, {"twice": x * 2, "rowsum": x.sum(axis=1, keepdims=True).astype(np.float64)})
        failed = batch.lanes[fail] if fail >= 0 else -1
    assert not w._outstanding  # every request answered, by the core or not, is no longer outstanding
    for k, (c, t, n) in enumerate(zip(cs, ts, rows, strict=True)):
        if c.lane == failed:
            with pytest.raises(RequestFailed, match="failed on its own"):
                c.wait(t, timeout_s=5.0)
            continue
        got = c.wait(t, timeout_s=5.0)
        np.testing.assert_array_equal(got["twice"], np.full((n, 4), 2 * (tag + k), np.float32))
        np.testing.assert_array_equal(got["rowsum"], np.full((n, 1), 4 * (tag + k), np.float64))


def test_a_coalesced_batch_of_a_known_layout_is_answered_by_the_core_in_any_composition(
    four: InferenceQueue, queue_impl: str, answerer: Answerer
) -> None:
    """The core answers a batch of several requests whose outputs are the layout it knows for that many
    rows, once it has the plan of each request's size; a size it has none for is validated, and its
    plan is kept with the others."""
    with QueueWorker.attach(four.descriptor) as w:
        cs = [QueueClient.attach(four.descriptor) for _ in range(4)]
        hits = answerer.hits
        compositions = [[1, 1, 1, 1], [1, 1, 1, 1], [2, 1, 1], [1, 1, 2], [3, 1], [2, 2], [1, 3]]
        for k, rows in enumerate(compositions):
            _round(answerer, w, cs[: len(rows)], rows, 10.0 * (k + 1))
        for c in cs:
            c.close()
        # the first batch of 4 rows is validated (no layout known), then: known, a size 2 unknown,
        # known, a size 3 unknown, known, known
        if queue_impl == "native":
            assert hits == [True, False, True, False, True, True], hits
        else:
            assert hits == [] and not w._known


def test_a_request_done_before_complete_is_skipped_and_the_rest_answered(
    four: InferenceQueue, queue_impl: str, answerer: Answerer
) -> None:
    with QueueWorker.attach(four.descriptor) as w:
        cs = [QueueClient.attach(four.descriptor) for _ in range(3)]
        hits = answerer.hits
        _round(answerer, w, cs, [1, 2, 1], 1.0)  # the layout known from here
        for fail in range(3):
            _round(answerer, w, cs, [1, 2, 1], 10.0 * (fail + 1), fail=fail)
        for c in cs:
            c.close()
        assert hits == ([True] * 3 if queue_impl == "native" else []), hits


def test_a_fenced_lane_in_a_coalesced_batch_is_answered_client_gone_and_the_rest_ok(
    four: InferenceQueue, queue_impl: str, answerer: Answerer
) -> None:
    """A lane that changed hands between the claim and the answer (its generation moved) gets the
    client-gone answer, the others their rows: on both paths, known layout or not."""
    with QueueWorker.attach(four.descriptor) as w:
        a, b = QueueClient.attach(four.descriptor), QueueClient.attach(four.descriptor)
        hits = answerer.hits
        q, geo = w._m.q, w._m.geo
        for _ in range(2):  # the second time with the layout known
            ta, tb = a.submit(filled(1.0)), b.submit(filled(2.0))
            with w.claim(timeout_s=5.0) as batch:
                x = np.array(batch.inputs["x"])
                gen = q[geo.lane(b.lane, L_GEN)]
                q[geo.lane(b.lane, L_GEN)] = gen + 1
                answerer.answer(batch, {"twice": x * 2})
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
    four: InferenceQueue, queue_impl: str, monkeypatch: pytest.MonkeyPatch, answerer: Answerer
) -> None:
    """Batch sizes and request sizes that vary without bound: the worker keeps at most
    KNOWN_OUTPUTS_MAX layouts and KNOWN_PLANS_MAX request sizes for each, and answers every batch."""
    monkeypatch.setattr(server_module, "KNOWN_OUTPUTS_MAX", 3)
    monkeypatch.setattr(server_module, "KNOWN_PLANS_MAX", 2)
    with QueueWorker.attach(four.descriptor) as w:
        cs = [QueueClient.attach(four.descriptor) for _ in range(3)]
        for k, rows in enumerate([[n, m, r] for n in (1, 2, 3) for m in (1, 4) for r in (2, 5)]):
            _round(answerer, w, cs, rows, float(k))
            assert len(w._known) <= 3 and w._known.keys() == w._known_plans.keys()
            assert all(len(plans) <= 2 for _, plans in w._known_plans.values())
        for c in cs:
            c.close()
        assert (len(w._known) > 0) is (queue_impl == "native")


def test_a_new_request_size_adds_to_the_kept_plans_up_to_the_bound(
    four: InferenceQueue, queue_impl: str, monkeypatch: pytest.MonkeyPatch, answerer: Answerer
) -> None:
    """A batch with one new request size beside known ones adds that size: the sizes kept before stay
    answerable while the union fits KNOWN_PLANS_MAX (sizes already kept were counted twice and the
    union of three sizes under a bound of 3 dropped one)."""
    monkeypatch.setattr(server_module, "KNOWN_PLANS_MAX", 3)
    with QueueWorker.attach(four.descriptor) as w:
        cs = [QueueClient.attach(four.descriptor) for _ in range(3)]
        _round(answerer, w, cs[:2], [1, 3], 1.0)  # 4 rows: sizes 1 and 3 kept
        _round(answerer, w, cs, [1, 1, 2], 2.0)  # 4 rows again: size 2 is new, 1 is kept
        for c in cs:
            c.close()
        kept = w._known_plans.get(4)
        assert (sorted(kept[1]) if kept else []) == ([1, 2, 3] if queue_impl == "native" else [])


@pytest.mark.usefixtures("queue_impl")
def test_wrong_outputs_after_a_known_layout_are_refused_as_before(
    server: InferenceQueue, answerer: Answerer
) -> None:
    with QueueClient.attach(server.descriptor) as c, QueueWorker.attach(server.descriptor) as w:
        t = c.submit(filled(1.0))
        with w.claim(timeout_s=5.0) as batch:
            x = np.array(batch.inputs["x"])
            answerer.answer(batch, {"twice": x * 2})
        np.testing.assert_array_equal(c.wait(t, timeout_s=5.0)["twice"], x * 2)
        bad: list[tuple[Any, str]] = [
            ({"twice": x[:1] * 2}, "leading dimension 2"),
            ({"twice": (x * 2).tolist()}, "expected a numpy array"),
            ({}, "non-empty dict"),
        ]
        for outputs, why in bad:
            t = c.submit(filled(1.0))
            with w.claim(timeout_s=5.0) as batch, pytest.raises(BadRequest, match=why):
                answerer.answer(batch, outputs)
            with pytest.raises(RequestFailed, match=why):
                c.wait(t, timeout_s=5.0)
        t = c.submit(filled(2.0))
        with w.claim(timeout_s=5.0) as batch:
            answerer.answer(batch, {"twice": np.array(batch.inputs["x"]) * 2})
        np.testing.assert_array_equal(c.wait(t, timeout_s=5.0)["twice"], np.full((2, 4), 4.0, np.float32))


def test_the_native_cores_answer_in_finish_call_carries_the_calls_words_and_its_wakes(
    four: InferenceQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The answers ``finish_call`` writes itself carry the call's words as ``complete`` writes them: the
    engine time and the deschedule (whole us) its stamps make, and the batch's rows; the row it records
    holds the wake of the one parked client (its flag set as park() sets it)."""
    if not native.available():
        pytest.skip(f"the native core is not available: {native.implementation().reason}")
    answerer = Answerer("finish_call", monkeypatch)
    try:
        with native.use(True), QueueWorker.attach(four.descriptor) as w:
            cs = [QueueClient.attach(four.descriptor) for _ in range(2)]
            _round(answerer, w, cs, [1, 2], 1.0)  # validated: the layout is known from here
            tickets = [c.submit(filled(5.0 + k, n)) for k, (c, n) in enumerate(zip(cs, [1, 2], strict=True))]
            parked = w._m.geo.lane(cs[1].lane, L_PARKED)
            with w.claim(timeout_s=5.0) as batch:
                x = np.array(batch.inputs["x"])
                rowsum = x.sum(axis=1, keepdims=True).astype(np.float64)
                w._m.q[parked] = 1
                answerer.answer(batch, {"twice": x * 2, "rowsum": rowsum})
                w._m.q[parked] = 0
                with pytest.raises(BatchClosed):  # answered: its views are refused from here
                    _ = batch.inputs
            assert answerer.hits == [True] and not w._outstanding
            row = answerer.last_row()
            assert row["wn"] == 1 and row["wk"] > 0
            d = row["a0"] - row["t0"] - row["et1"] + row["th0"]
            assert d > 5_000_000
            for c, t in zip(cs, tickets, strict=True):
                c.wait(t, timeout_s=5.0)
                assert t.timing is not None and t.timing.batch_size == 3
                assert t.timing.engine_s == pytest.approx((row["e1"] - row["e0"]) / 1e9)
                assert t.timing.call_deschedule_s == pytest.approx((d // 1000 if d > 0 else 0) / 1e6)
            for c in cs:
                c.close()
    finally:
        answerer.close()


class _Unmarkable(server_module._Item):
    """A claimed request whose ``done`` cannot be set: the mark after its answer raises."""

    __slots__ = ()

    @property  # type: ignore[override]
    def done(self) -> bool:
        return False

    @done.setter
    def done(self, value: bool) -> None:
        if value:
            raise RuntimeError("this request cannot be marked done")


def _unmarkable_second(batch: server_module.Batch) -> _Unmarkable:
    """The batch's second request swapped for an ``_Unmarkable`` copy of it (the same request)."""
    it = batch._items[1]
    stuck = _Unmarkable.__new__(_Unmarkable)
    for name in server_module._Item.__slots__:
        if name != "done":
            setattr(stuck, name, getattr(it, name))
    batch._items[1] = stuck
    return stuck


def test_a_mark_that_raises_after_the_cores_answer_closes_the_batch_and_fails_what_is_not_done(
    four: InferenceQueue, queue_impl: str, answerer: Answerer
) -> None:
    """Whichever way the batch is answered: the error propagates and the batch is closed; the request
    that could not be marked was answered before its mark raised, and its answer stands (an error
    written over an answer its client may be reading was the behaviour until the fifteenth step's
    review): both clients get their rows, each answered once."""
    with QueueWorker.attach(four.descriptor) as w:
        cs = [QueueClient.attach(four.descriptor) for _ in range(2)]
        _round(answerer, w, cs, [1, 1], 1.0)
        assert (2 in w._known) is (queue_impl == "native")  # the core answers the layout from here
        tickets = [c.submit(filled(3.0 + k, 1)) for k, c in enumerate(cs)]
        with w.claim(timeout_s=5.0) as batch:
            stuck = _unmarkable_second(batch)
            x = np.array(batch.inputs["x"])
            with pytest.raises(RuntimeError, match="cannot be marked done"):
                answerer.answer(
                    batch, {"twice": x * 2, "rowsum": x.sum(axis=1, keepdims=True).astype(np.float64)}
                )
            with pytest.raises(BatchClosed):
                _ = batch.inputs
        assert stuck.lane in [c.lane for c in cs] and not w._outstanding
        for c, t in zip(cs, tickets, strict=True):
            got = c.wait(t, timeout_s=5.0)["twice"]
            np.testing.assert_array_equal(got, np.full((1, 4), 2 * (3.0 + cs.index(c)), np.float32))
        for c in cs:
            c.close()


def test_a_batch_answered_or_of_a_closed_worker_is_refused_with_its_layout_known(
    four: InferenceQueue, queue_impl: str, answerer: Answerer
) -> None:
    """A second answer of one batch, and the answer of a batch whose worker was closed, are refused
    (``BatchClosed``) with nothing recorded, whichever way they come: the core's known-layout answer
    declines them to ``complete()``, which refuses them (without its checks the core answered nothing
    and ``finish_call`` recorded a call that never ran)."""
    w = QueueWorker.attach(four.descriptor)
    cs = [QueueClient.attach(four.descriptor) for _ in range(2)]
    try:
        _round(answerer, w, cs, [1, 1], 1.0)
        assert (2 in w._known) is (queue_impl == "native")  # the core answers the layout from here
        outputs = {"twice": np.zeros((2, 4), np.float32), "rowsum": np.zeros((2, 1), np.float64)}
        for k, c in enumerate(cs):
            c.submit(filled(1.0 + k, 1))
        with w.claim(timeout_s=5.0) as batch:
            answerer.answer(batch, outputs)
            recorded = answerer.recorded()
            with pytest.raises(BatchClosed, match="already answered"):
                answerer.answer(batch, outputs)
            assert answerer.recorded() == recorded
        tickets = [c.submit(filled(3.0 + k, 1)) for k, c in enumerate(cs)]
        batch = w.claim(timeout_s=5.0)
        assert batch is not None and len(batch) == 2
        w.close()
        with pytest.raises(BatchClosed, match="worker was closed"):
            answerer.answer(batch, outputs)
        assert answerer.recorded() == recorded
        for c, t in zip(cs, tickets, strict=True):
            with pytest.raises(RequestFailed):
                c.wait(t, timeout_s=5.0)
    finally:
        for c in cs:
            c.close()
        w.close()


def test_an_error_while_failing_what_a_raised_answer_left_has_that_answers_error_as_its_context(
    four: InferenceQueue, answerer: Answerer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A mark that raises after the answer, then failing the rest raising too: the second error
    propagates with the first as its ``__context__`` (as Python sets it), whichever way the batch is
    answered."""
    with QueueWorker.attach(four.descriptor) as w:
        cs = [QueueClient.attach(four.descriptor) for _ in range(2)]
        _round(answerer, w, cs, [1, 1], 1.0)
        for k, c in enumerate(cs):
            c.submit(filled(3.0 + k, 1))

        def failing_too(batch: server_module.Batch, e: BaseException) -> tuple[int, int]:
            raise OSError("failing the rest failed too")  # what is left is failed when w closes

        monkeypatch.setattr(server_module.Batch, "_fail_unanswered", failing_too)
        with w.claim(timeout_s=5.0) as batch:
            _unmarkable_second(batch)
            x = np.array(batch.inputs["x"])
            outputs = {"twice": x * 2, "rowsum": x.sum(axis=1, keepdims=True).astype(np.float64)}
            with pytest.raises(OSError, match="failing the rest failed too") as raised:
                answerer.answer(batch, outputs)
        assert isinstance(raised.value.__context__, RuntimeError) and raised.value.__cause__ is None
        assert "cannot be marked done" in str(raised.value.__context__)
        for c in cs:
            c.close()


def test_figures_out_of_range_are_answered_as_the_validating_path_answers_them(
    four: InferenceQueue, queue_impl: str
) -> None:
    """``complete(engine_ns=, deschedule_ns=)`` with a figure out of range, its layout known: the same as
    with a layout new to the worker. An ``engine_ns`` an answer word cannot hold fails the batch with
    the error named (its client is answered, not left to time out); a ``deschedule_ns`` beyond 64 bits
    is clamped, as every deschedule is. (The core's known-layout answer once refused such figures
    before it ran, leaving the batch open and its request unanswered: seen failing first.)"""
    w = QueueWorker.attach(four.descriptor)
    c = QueueClient.attach(four.descriptor)

    def answer(engine_ns: int, deschedule_ns: int, fails: bool, why: tuple[Any, ...]) -> None:
        t = c.submit(filled(2.0, 1))
        with w.claim(timeout_s=5.0) as batch:
            x = np.array(batch.inputs["x"])
            out = {"twice": x * 2, "rowsum": x.sum(axis=1, keepdims=True).astype(np.float64)}
            try:
                batch.complete(out, engine_ns=engine_ns, deschedule_ns=deschedule_ns)
            except (OverflowError, ValueError):  # the core's, or a memoryview's word
                assert fails, why
            assert not batch._open and not w._outstanding, why
        if fails:
            with pytest.raises(RequestFailed, match=r"answer not written: (OverflowError|ValueError)"):
                c.wait(t, timeout_s=5.0)
        else:
            np.testing.assert_array_equal(c.wait(t, timeout_s=5.0)["twice"], np.full((1, 4), 4.0), str(why))

    try:
        for engine_ns, deschedule_ns, fails in ((-1, 0, True), (2**64, 0, True), (0, 2**63, False),
                                                 (0, -(2**63) - 1, False)):  # fmt: skip
            w._known.clear()
            answer(engine_ns, deschedule_ns, fails, (engine_ns, deschedule_ns, "a layout new to it"))
            answer(0, 0, False, "the layout learned")
            assert (1 in w._known) is (queue_impl == "native")
            answer(engine_ns, deschedule_ns, fails, (engine_ns, deschedule_ns, "the layout known"))
    finally:
        c.close()
        w.close()


@pytest.mark.skipif(not native.available(), reason=native.implementation().reason)
def test_an_error_after_part_of_a_batch_was_answered_fails_only_the_rest(four: InferenceQueue) -> None:
    """The core answers a coalesced batch request after request, then wakes the parked: an error after
    the first answer went out (here a stand-in for the core call answers the first request alone, then
    raises) fails the requests not answered, never the answered one, whose client gets its rows and not
    an error written over them (each request answered once)."""
    with native.use(True):
        w = QueueWorker.attach(four.descriptor)
        cs = [QueueClient.attach(four.descriptor) for _ in range(2)]
    with w:
        real = w._answer_rows

        def first_then_raise(work: list[Any], *rest: Any) -> Any:
            real(work[:1], *rest)
            raise RuntimeError("the wake failed")

        w._answer_rows = first_then_raise  # type: ignore[method-assign]
        ts = [c.submit(filled(1.0 + k, 1)) for k, c in enumerate(cs)]
        with w.claim(timeout_s=5.0) as batch:
            assert len(batch) == 2
            x = np.array(batch.inputs["x"])
            with pytest.raises(RuntimeError, match="the wake failed"):
                batch.complete({"twice": x * 2})
            first = batch.lanes[0]
        assert not w._outstanding
        for k, (c, t) in enumerate(zip(cs, ts, strict=True)):
            if c.lane == first:
                np.testing.assert_array_equal(
                    c.wait(t, 5.0)["twice"], np.full((1, 4), 2 * (1.0 + k), np.float32)
                )
            else:
                with pytest.raises(RequestFailed, match="answer not written: RuntimeError: the wake failed"):
                    c.wait(t, 5.0)
        for c in cs:
            c.close()
