"""A worker's outputs are answered as they are, call after call, whatever they change.

On the native path the worker keeps the layout of the outputs it answered last for each batch size, and
the core answers outputs of exactly that layout without validating them again. These tests change the
outputs between calls of the same batch size (a dtype, the order of the names, a shape, a name more or
less, the memory layout, the array type) and check that every answer is what the worker returned, and
that outputs that are wrong after a known layout are refused as before. On both paths.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from lowtail.shm.queue import BadRequest, InferenceQueue, QueueClient, QueueWorker, RequestFailed
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
    ]
    first = {"twice": twice, "rowsum": rowsum}
    return [first, {"twice": twice + 1, "rowsum": rowsum + 1}] + [o for c in changed for o in (c, first)]


def test_outputs_that_change_between_calls_of_one_batch_size_are_answered_as_they_are(
    server: InferenceQueue, queue_impl: str
) -> None:
    with QueueClient.attach(server.descriptor) as c, QueueWorker.attach(server.descriptor) as w:
        answer_known, hits = w._answer_known, []

        def counted(*a: Any) -> Any:
            got = answer_known(*a)
            hits.append(got is not None)
            return got

        w._answer_known = counted  # type: ignore[method-assign]
        for round_ in range(2):  # the second round starts with a layout known
            for k in range(len(_outputs(filled(1.0)["x"]))):
                t = c.submit(filled(float(k + 1)))
                with w.claim(timeout_s=5.0) as batch:
                    sent = _outputs(np.array(batch.inputs["x"]))[k]
                    batch.complete(sent)
                got = c.wait(t, timeout_s=5.0)
                assert list(got) == list(sent), (round_, k)
                for name, a in sent.items():
                    assert got[name].dtype == a.dtype and got[name].shape == a.shape, (round_, k, name)
                    np.testing.assert_array_equal(got[name], a, err_msg=f"{round_} {k} {name}")
        # The core answered the repeats of a known layout (each round's second call, the other memory
        # layouts and the first layout after them) and declined the changes, which were validated.
        if queue_impl == "native":
            assert sum(hits) >= 6 and not all(hits), hits
        else:
            assert hits == [] and not w._known


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
