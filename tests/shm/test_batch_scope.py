"""A claimed batch's zero-copy input views live only inside its ``with`` block and before its answer.

The inputs of a claimed request are views of the client's request slot (or of the worker's copy of
its ndarray segment): the client may write its next request there as soon as it has its answer, so a
view kept past ``complete()`` reads someone else's data. The batch refuses access loudly from then
on, and leaving the block answers whatever it did not (clients get an error, never a hang).
"""

from __future__ import annotations

import numpy as np
import pytest

from lowtail.errors import LowtailError
from lowtail.shm.queue import (
    BatchClosed,
    InferenceQueue,
    QueueClient,
    QueueError,
    QueueWorker,
    RequestFailed,
)
from tests.shm.helpers import echo, filled


def test_a_batch_refuses_its_views_after_its_answer_and_after_its_block(server: InferenceQueue) -> None:
    with QueueClient.attach(server.descriptor) as c, QueueWorker.attach(server.descriptor) as w:
        t = c.submit(filled(1.0))
        with w.claim(timeout_s=5.0) as batch:
            x = batch.inputs["x"]
            np.testing.assert_array_equal(x, np.full((2, 4), 1.0, np.float32))
            with pytest.raises(ValueError, match="read-only"):  # the client's slot, never written through
                x[0, 0] = 9.0
            batch.complete(echo(x))
            with pytest.raises(BatchClosed, match=r"inputs of a batch already answered") as inside:
                batch.inputs  # noqa: B018 - the access is what is tested
        assert isinstance(inside.value, QueueError) and isinstance(inside.value, LowtailError)
        np.testing.assert_allclose(c.wait(t, timeout_s=5.0)["twice"], 3.0)
        with pytest.raises(BatchClosed, match=r"inputs of a batch already answered"):
            batch.inputs  # noqa: B018
        with pytest.raises(BatchClosed, match=r"complete\(\) on a batch already answered"):
            batch.complete(echo(x))
        with pytest.raises(BatchClosed, match=r"fail\(\) on a batch already answered"):
            batch.fail("late")
        with pytest.raises(BatchClosed, match=r"a batch already answered cannot be entered again"), batch:
            pass
        # What is not a view stays readable: the bookkeeping after the answer needs it.
        assert batch.sizes == [2] and len(batch) == 1 and batch.total == 2 and batch.lanes == [c.lane]


def test_a_merged_batch_refuses_its_views_after_its_block_too(server: InferenceQueue) -> None:
    with (
        QueueClient.attach(server.descriptor) as c1,
        QueueClient.attach(server.descriptor) as c2,
        QueueWorker.attach(server.descriptor) as w,
    ):
        t1, t2 = c1.submit(filled(1.0, 1)), c2.submit(filled(2.0, 3))
        with w.claim(timeout_s=5.0) as batch:
            assert sorted(batch.sizes) == [1, 3]
            batch.complete(echo(batch.inputs["x"]))
        with pytest.raises(BatchClosed):
            batch.inputs  # noqa: B018
        np.testing.assert_allclose(c1.wait(t1, timeout_s=5.0)["twice"], 3.0)
        np.testing.assert_allclose(c2.wait(t2, timeout_s=5.0)["twice"], 5.0)


def test_an_exception_in_the_block_fails_only_its_requests_and_the_worker_serves_on(
    server: InferenceQueue,
) -> None:
    with (
        QueueClient.attach(server.descriptor) as victim,
        QueueClient.attach(server.descriptor) as neighbour,
        QueueWorker.attach(server.descriptor) as w,
    ):
        t = victim.submit(filled(1.0))
        with pytest.raises(ValueError, match="the model code broke"), w.claim(timeout_s=5.0) as batch:
            assert batch.lanes == [victim.lane]
            raise ValueError("the model code broke")
        with pytest.raises(
            RequestFailed, match=r"worker error while serving this batch: ValueError: the model code broke"
        ):
            victim.wait(t, timeout_s=5.0)
        with pytest.raises(BatchClosed):
            batch.inputs  # noqa: B018
        # The neighbour's request published afterwards, and the victim's next one, are served.
        tn, tv = neighbour.submit(filled(2.0)), victim.submit(filled(3.0))
        served = 0
        while served < 2:
            with w.claim(timeout_s=5.0) as batch:
                batch.complete(echo(batch.inputs["x"]))
                served += len(batch)
        np.testing.assert_allclose(neighbour.wait(tn, timeout_s=5.0)["twice"], 5.0)
        np.testing.assert_allclose(victim.wait(tv, timeout_s=5.0)["twice"], 7.0)


def test_a_block_left_without_an_answer_fails_its_requests_instead_of_leaving_them_waiting(
    server: InferenceQueue,
) -> None:
    with QueueClient.attach(server.descriptor) as c, QueueWorker.attach(server.descriptor) as w:
        t = c.submit(filled(1.0))
        with w.claim(timeout_s=5.0) as batch:
            pass
        with pytest.raises(RequestFailed, match=r"the worker left the batch without answering it"):
            c.wait(t, timeout_s=5.0)
        with pytest.raises(BatchClosed):
            batch.inputs  # noqa: B018
        assert w.claim(timeout_s=0.0) is None  # answered once: nothing is left claimed or queued


def test_closing_the_worker_closes_its_open_batch_and_fails_its_request(server: InferenceQueue) -> None:
    with QueueClient.attach(server.descriptor) as c:
        t = c.submit(filled(1.0))
        w = QueueWorker.attach(server.descriptor)
        batch = w.claim(timeout_s=5.0)
        assert batch is not None
        w.close()  # e.g. the serving loop's finally after a stop word, with a batch still in hand
        with pytest.raises(BatchClosed, match=r"inputs of a batch whose worker was closed"):
            batch.inputs  # noqa: B018 - its views pointed into the mapping close() released
        with pytest.raises(BatchClosed, match=r"complete\(\) on a batch whose worker was closed"):
            batch.complete({"twice": np.zeros((2, 4), np.float32)})
        with pytest.raises(RequestFailed, match="worker closed before answering"):
            c.wait(t, timeout_s=5.0)
        # The client goes on: the next worker on the same queue serves its next request.
        with QueueWorker.attach(server.descriptor) as w2:
            t2 = c.submit(filled(2.0))
            with w2.claim(timeout_s=5.0) as b2:
                assert b2 is not None
                b2.complete(echo(b2.inputs["x"]))
            np.testing.assert_allclose(c.wait(t2, timeout_s=5.0)["twice"], 5.0)


@pytest.mark.usefixtures("queue_impl")
def test_outputs_that_are_strided_views_are_answered_as_given_alone_and_merged(
    server: InferenceQueue,
) -> None:
    """The engine's outputs need not be C-contiguous (a transposed or sliced view): every request gets
    its own rows of them, on both paths, alone and in a merged batch."""
    with (
        QueueClient.attach(server.descriptor) as a,
        QueueClient.attach(server.descriptor) as b,
        QueueWorker.attach(server.descriptor) as w,
    ):
        for clients in ((a,), (a, b)):
            tickets = [c.submit(filled(float(k + 1))) for k, c in enumerate(clients)]
            with w.claim(timeout_s=5.0) as batch:
                x = batch.inputs["x"]
                assert x.shape[0] == 2 * len(clients)
                wide = np.ascontiguousarray(np.repeat(x * 2, 2, axis=1))
                # a strided view and a Fortran-ordered copy, each with every request's tag in its rows
                outputs = {"twice": wide[:, ::2], "tag": np.asfortranarray(x[:, :3] * 10)}
                assert not outputs["twice"].flags.c_contiguous and not outputs["tag"].flags.c_contiguous
                batch.complete(outputs)
            for k, (c, t) in enumerate(zip(clients, tickets, strict=True)):
                got = c.wait(t, timeout_s=5.0)
                np.testing.assert_array_equal(got["twice"], np.full((2, 4), 2.0 * (k + 1), np.float32))
                np.testing.assert_array_equal(got["tag"], np.full((2, 3), 10.0 * (k + 1), np.float32))


@pytest.mark.usefixtures("queue_impl")
def test_a_batchs_layout_is_its_inputs_layout_alone_merged_and_from_ndarray_segments(
    server: InferenceQueue,
) -> None:
    """``Batch.layout`` describes ``inputs`` exactly (the model's check relies on it): one request, a
    merged batch, and requests whose inputs came through ndarray segments (36 kB slots here)."""
    from lowtail.shm.payload import validated_layout

    big = {"x": np.ones((2, 10_000), np.float32)}  # 80 kB: an ndarray segment
    with (
        QueueClient.attach(server.descriptor) as a,
        QueueClient.attach(server.descriptor) as b,
        QueueWorker.attach(server.descriptor) as w,
    ):
        for requests in ([filled(1.0)], [filled(1.0, 1), filled(2.0, 3)], [big], [big, big]):
            tickets = [c.submit(r) for c, r in zip((a, b), requests, strict=False)]
            with w.claim(timeout_s=5.0) as batch:
                assert batch.sizes == [r["x"].shape[0] for r in requests] or len(requests) > 1
                assert sum(batch.sizes) == sum(r["x"].shape[0] for r in requests)
                assert batch.layout is validated_layout(batch.inputs)
                batch.complete({"y": np.array(batch.inputs["x"][:, :1])})
            for c, t in zip((a, b), tickets, strict=False):
                c.wait(t, timeout_s=5.0)
