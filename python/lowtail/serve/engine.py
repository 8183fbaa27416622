"""One OpenVINO model compiled for one pinned core, with input tensors bound once.

Compiled with ``INFERENCE_NUM_THREADS=1`` (one core per worker), ``ENABLE_CPU_PINNING=False`` (the worker
pins itself; OpenVINO's own pinning would fight the lease) and an explicit ``INFERENCE_PRECISION_HINT``:
on a CPU with AVX-512 BF16 the default is bf16, which would silently change the outputs. The precision is
read back after compiling and a mismatch is an error, not a warning.

Input tensors wrap preallocated numpy buffers and are set on the request once per batch size; a call
copies the observations into the buffer (a ~32 kB memcpy at batch 16) and runs ``infer()`` in the
calling thread. Field notes: pre-bound tensors + ``infer()`` were ~25% faster than a dict per call.
Output tensors are bound the same way (where the model's outputs have a static per-sample shape), so a
call returns numpy arrays it already holds instead of asking OpenVINO for its tensors: that lookup cost
1.3 us per output warm but 11-13 us inside the worker loop (a temporary timer in one ``bench serve``
run), right after ``infer()`` has evicted the caches. Outputs are overwritten by the next call.

Batch shapes are padded (``padded_batch``): a call of n samples runs at the next power of two, on the
first n rows of the bound buffers, and returns the first n rows. OpenVINO keeps state per input shape
that we cannot free (160 distinct batch sizes grew a worker by 126 MB), and so did the tensors bound
per size here; with padding both are bounded by log2 of the largest batch (5 shapes up to the queue's
16, 9 up to 256), whatever the traffic. An LRU of exact sizes would bound our tensors but not
OpenVINO's per-shape state. The price is computing up to twice the rows of an odd-sized batch; the
padding rows hold earlier calls' data and are computed but never returned (each row's outputs depend
on that row alone in the policy models served here: no cross-batch ops).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import openvino as ov

from lowtail.errors import LowtailError
from lowtail.serve.model import find_model_xml
from lowtail.serve.openvino_core import shared_core

CHECKED_LAYOUTS = 64  # input layouts whose check result is remembered

PRECISIONS = {"f32": ov.Type.f32, "bf16": ov.Type.bf16, "f16": ov.Type.f16}


class PrecisionNotApplied(LowtailError, RuntimeError):
    """OpenVINO compiled the model at a different precision than the one asked for."""


class MalformedInput(LowtailError, ValueError):
    """A request's inputs do not match the model (name, dtype or shape)."""


def compile_config(precision: str, threads: int = 1) -> dict[str, Any]:
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: expected one of {sorted(PRECISIONS)}")
    return {
        "INFERENCE_NUM_THREADS": threads,
        "NUM_STREAMS": 1,
        "ENABLE_CPU_PINNING": False,
        "PERFORMANCE_HINT": "LATENCY",
        "INFERENCE_PRECISION_HINT": precision,
    }


def check_precision(compiled: Any, precision: str) -> None:
    """Raise PrecisionNotApplied unless ``compiled`` really runs at ``precision``."""
    got = compiled.get_property("INFERENCE_PRECISION_HINT")
    if got != PRECISIONS[precision]:
        raise PrecisionNotApplied(
            f"asked OpenVINO for INFERENCE_PRECISION_HINT={precision}, "
            f"the compiled model reports {got.get_type_name()}"
        )


def padded_batch(n: int) -> int:
    """The batch shape a call of ``n`` samples runs at (see the module docstring)."""
    return 1 << (n - 1).bit_length()


class Engine:
    def __init__(self, model_path: str | Path, precision: str = "f32", max_batch: int = 16) -> None:
        self.xml = find_model_xml(model_path)
        self.core = shared_core()  # one per process: see openvino_core
        self.config = compile_config(precision)
        self.compiled = self.core.compile_model(self.core.read_model(str(self.xml)), "CPU", self.config)
        check_precision(self.compiled, precision)
        self.precision = precision
        self.request = self.compiled.create_infer_request()
        # name -> (dtype, per-sample shape); the batch axis must be the first and dynamic or 1.
        self.inputs: dict[str, tuple[np.dtype[Any], tuple[int, ...]]] = {}
        for port in self.compiled.inputs:
            ps = port.get_partial_shape()
            if ps.rank.is_dynamic or any(d.is_dynamic for d in list(ps)[1:]):
                raise MalformedInput(
                    f"{self.xml}: input {port.get_any_name()} {ps}: only the batch axis may be dynamic"
                )
            self.inputs[port.get_any_name()] = (
                np.dtype(port.get_element_type().to_dtype()),
                tuple(d.get_length() for d in list(ps)[1:]),
            )
        self.output_names = [port.get_any_name() for port in self.compiled.outputs]
        # name -> (dtype, per-sample shape) where it is static, so the output can be pre-bound
        self._out_specs: dict[str, tuple[np.dtype[Any], tuple[int, ...]]] | None = {}
        for port in self.compiled.outputs:
            ps = port.get_partial_shape()
            if ps.rank.is_dynamic or not ps[0].is_dynamic or any(d.is_dynamic for d in list(ps)[1:]):
                self._out_specs = None  # not [batch, static...]: OpenVINO allocates, we read its tensors
                break
            self._out_specs[port.get_any_name()] = (
                np.dtype(port.get_element_type().to_dtype()),
                tuple(d.get_length() for d in list(ps)[1:]),
            )
        self._outputs: dict[int, dict[str, np.ndarray]] = {}
        self._buffers: dict[str, np.ndarray] = {}
        self._tensors: dict[int, list[tuple[str, ov.Tensor]]] = {}
        self._bound_batch = -1
        self._checked: dict[tuple[Any, ...], int] = {}
        self._by_layout: dict[object, int] = {}
        self._grow(padded_batch(max_batch))

    def properties(self) -> dict[str, str]:
        names = ("INFERENCE_NUM_THREADS", "NUM_STREAMS", "ENABLE_CPU_PINNING", "INFERENCE_PRECISION_HINT")
        props = {n: self.compiled.get_property(n) for n in names}
        return {n: v.get_type_name() if isinstance(v, ov.Type) else str(v) for n, v in props.items()}

    def _grow(self, max_batch: int) -> None:
        self.max_batch = max_batch
        self._buffers = {
            name: np.zeros((max_batch, *shape), dtype=dtype) for name, (dtype, shape) in self.inputs.items()
        }
        self._tensors.clear()
        self._outputs = {}
        self._bound_batch = -1

    def check(self, inputs: Mapping[str, np.ndarray], layout: object = None) -> int:
        """The batch size of ``inputs``, or MalformedInput naming what is wrong.

        A layout (names, dtypes, shapes) seen before costs one dict lookup: the full check took ~10 us
        per call in the worker loop (bench serve --breakdown), as much as the rest of the bookkeeping.
        ``layout``: an object hashed by identity that describes ``inputs`` exactly (the queue's interned
        layout of a claimed batch, ``Batch.layout``): its result is kept per layout, so a layout checked
        before costs one lookup without reading the arrays (the key above costs ~1.5 us per call in the
        worker loop). Only a check that passed is kept.
        """
        if layout is not None:
            n = self._by_layout.get(layout)
            if n is None:
                n = self.check(inputs)
                if len(self._by_layout) >= CHECKED_LAYOUTS:
                    self._by_layout.clear()
                self._by_layout[layout] = n
            return n
        try:
            key = tuple([(k, a.dtype, a.shape) for k, a in inputs.items()])
        except AttributeError:
            return self._check(inputs)  # not arrays: let the full check name the problem
        n = self._checked.get(key)
        if n is None:
            n = self._check(inputs)
            if len(self._checked) >= CHECKED_LAYOUTS:
                self._checked.clear()  # a client cycling through shapes cannot grow it without bound
            self._checked[key] = n
        return n

    def _check(self, inputs: Mapping[str, np.ndarray]) -> int:
        if set(inputs) != set(self.inputs):
            raise MalformedInput(f"inputs {sorted(inputs)}: the model expects exactly {sorted(self.inputs)}")
        n = -1
        for name, (dtype, shape) in self.inputs.items():
            a = inputs[name]
            if a.dtype != dtype or a.ndim != len(shape) + 1 or tuple(a.shape[1:]) != shape:
                raise MalformedInput(
                    f"input {name!r} is {a.dtype}{list(a.shape)}: "
                    f"expected {dtype}[batch, {', '.join(map(str, shape))}]"
                )
            if n not in (-1, a.shape[0]):
                raise MalformedInput(f"input {name!r} has batch {a.shape[0]}, other inputs have {n}")
            n = a.shape[0]
        if n < 1:
            raise MalformedInput("empty batch: expected at least one sample")
        return n

    def infer(self, inputs: Mapping[str, np.ndarray], checked_batch: int = 0) -> dict[str, np.ndarray]:
        """Run one batch; the result arrays are views valid until the next call.

        ``checked_batch``: the batch size ``check`` already returned for these inputs (skips checking again).
        """
        n = checked_batch or self.check(inputs)
        b = padded_batch(n)
        if b > self.max_batch:
            self._grow(b)
        if b != self._bound_batch:
            self._bind(b)
        for name, buf in self._buffers.items():
            np.copyto(buf[:n], inputs[name])
        self.request.infer()
        outputs = self._outputs.get(b)
        if outputs is None:
            return {name: self.request.get_tensor(name).data[:n] for name in self.output_names}
        if n == b:
            return dict(outputs)  # a dict of its own per call; the arrays are the bound buffers
        return {name: a[:n] for name, a in outputs.items()}

    def _bind(self, n: int) -> None:
        """Set the tensors of (padded) batch size ``n`` on the request (built once per size, then reused)."""
        tensors = self._tensors.get(n)
        if tensors is None:
            tensors = [(k, ov.Tensor(b[:n], shared_memory=True)) for k, b in self._buffers.items()]
            if self._out_specs is not None:
                out = {name: np.empty((n, *shape), dtype) for name, (dtype, shape) in self._out_specs.items()}
                tensors += [(k, ov.Tensor(a, shared_memory=True)) for k, a in out.items()]
                self._outputs[n] = out
            self._tensors[n] = tensors
        for name, t in tensors:
            self.request.set_tensor(name, t)
        self._bound_batch = n
