"""A MOBA-style policy network written as OpenVINO IR, built in code from a seed.

Tests, demos and benchmarks build the model here instead of downloading one: an MLP over one feature
vector (``obs``, float32 ``[batch, features]``, dynamic batch), one softmax head per action type and a
scalar value head. Weights are float32 and saved uncompressed (``ov.save_model`` compresses to FP16 by
default, which would change the outputs the tests compare). The same seed gives the same bytes.

Any other IR directory can be served as well: ``find_model_xml`` accepts a directory holding exactly one
``.xml`` file, or the ``.xml`` file itself.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lowtail.errors import LowtailError

INPUT_NAME = "obs"
VALUE_NAME = "value"
MODEL_BASENAME = "policy"
FORMAT = "lowtail-policy/1"

# Action heads of a MOBA hero: what to do, where to move, which skill, which unit to target.
DEFAULT_HEADS: tuple[tuple[str, int], ...] = (
    ("action", 12),
    ("move_x", 16),
    ("move_y", 16),
    ("skill", 8),
    ("target", 10),
)
# Three wide layers: at batch 16 one call costs ~1 ms of one core here, the order of a small policy
# network's per-call engine time, so queue overhead is measured against a realistic amount of work.
DEFAULT_HIDDEN: tuple[int, ...] = (1024, 1024, 512)
DEFAULT_FEATURES = 512

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class ModelSpecError(LowtailError, ValueError):
    """A model shape option is out of range or malformed."""


class ModelNotFound(LowtailError, FileNotFoundError):
    """No single OpenVINO IR (.xml + .bin) at the given path."""


@dataclass(frozen=True)
class ModelSpec:
    features: int = DEFAULT_FEATURES
    hidden: tuple[int, ...] = DEFAULT_HIDDEN
    heads: tuple[tuple[str, int], ...] = DEFAULT_HEADS
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.features <= 1 << 16:
            raise ModelSpecError(f"features={self.features}: expected 1..65536")
        if not self.hidden or any(not 1 <= h <= 1 << 15 for h in self.hidden):
            raise ModelSpecError(f"hidden={list(self.hidden)}: expected one or more sizes in 1..32768")
        if not self.heads:
            raise ModelSpecError("heads: expected at least one action head")
        seen: set[str] = set()
        for name, size in self.heads:
            if not _NAME.match(name) or name in (INPUT_NAME, VALUE_NAME) or name in seen:
                raise ModelSpecError(
                    f"head name {name!r}: expected a unique identifier, not {INPUT_NAME!r} or {VALUE_NAME!r}"
                )
            if not 2 <= size <= 1 << 15:
                raise ModelSpecError(f"head {name!r} size {size}: expected 2..32768 actions")
            seen.add(name)
        if not 0 <= self.seed < 1 << 63:
            raise ModelSpecError(f"seed={self.seed}: expected 0..2**63-1")

    @property
    def output_names(self) -> list[str]:
        return [name for name, _ in self.heads] + [VALUE_NAME]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["hidden"] = list(self.hidden)
        d["heads"] = [[n, s] for n, s in self.heads]
        return d


def parse_hidden(text: str) -> tuple[int, ...]:
    """``"1024,512"`` -> (1024, 512)."""
    try:
        sizes = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ModelSpecError(
            f"--hidden {text!r}: expected comma-separated layer sizes like 1024,512"
        ) from None
    if not sizes:
        raise ModelSpecError(f"--hidden {text!r}: expected at least one layer size")
    return sizes


def parse_heads(text: str) -> tuple[tuple[str, int], ...]:
    """``"action:12,move:16"`` -> (("action", 12), ("move", 16))."""
    heads = []
    for part in (p.strip() for p in text.split(",")):
        name, sep, size = part.partition(":")
        if not sep or not size.strip().isdigit():
            raise ModelSpecError(f"--heads item {part!r}: expected NAME:ACTIONS like move:16")
        heads.append((name.strip(), int(size)))
    return tuple(heads)


def build_model(spec: ModelSpec | None = None) -> Any:
    """The policy network as an ``openvino.Model`` (not saved)."""
    import openvino as ov
    import openvino.opset13 as ops

    spec = spec or ModelSpec()
    rng = np.random.default_rng(spec.seed)

    def dense(x: Any, n_in: int, n_out: int, scale: float) -> Any:
        w = rng.standard_normal((n_in, n_out), dtype=np.float32) * np.float32(scale)
        b = rng.standard_normal((n_out,), dtype=np.float32) * np.float32(0.01)
        return ops.add(ops.matmul(x, ops.constant(w.astype(np.float32)), False, False), ops.constant(b))

    obs = ops.parameter([-1, spec.features], ov.Type.f32, name=INPUT_NAME)
    obs.output(0).get_tensor().set_names({INPUT_NAME})
    x, width = obs, spec.features
    for h in spec.hidden:
        x = ops.relu(dense(x, width, h, (2.0 / width) ** 0.5))  # He initialisation keeps activations O(1)
        width = h
    outputs = []
    for name, size in spec.heads:
        probs = ops.softmax(dense(x, width, size, (1.0 / width) ** 0.5), 1)
        probs.set_friendly_name(name)
        probs.output(0).get_tensor().set_names({name})
        outputs.append(probs)
    value = dense(x, width, 1, (1.0 / width) ** 0.5)
    value.set_friendly_name(VALUE_NAME)
    value.output(0).get_tensor().set_names({VALUE_NAME})
    outputs.append(value)
    return ov.Model(outputs, [obs], "lowtail_policy")


def write_model(out_dir: str | Path, spec: ModelSpec | None = None) -> Path:
    """Build and save the IR under ``out_dir`` (policy.xml, policy.bin, model.json); return the .xml path."""
    import openvino as ov

    spec = spec or ModelSpec()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    xml = out / f"{MODEL_BASENAME}.xml"
    ov.save_model(build_model(spec), str(xml), compress_to_fp16=False)
    meta = {
        "format": FORMAT,
        "spec": spec.to_dict(),
        "inputs": {INPUT_NAME: {"shape": [-1, spec.features], "dtype": "float32"}},
        "outputs": spec.output_names,
        "bin_sha256": hashlib.sha256(xml.with_suffix(".bin").read_bytes()).hexdigest(),
    }
    (out / "model.json").write_text(json.dumps(meta, indent=2) + "\n")
    return xml


def find_model_xml(path: str | Path) -> Path:
    """The IR's .xml given the file or a directory holding exactly one .xml (with its .bin)."""
    p = Path(path)
    if p.is_file() and p.suffix == ".xml":
        xml = p
    elif p.is_dir():
        found = sorted(p.glob("*.xml"))
        if len(found) != 1:
            raise ModelNotFound(
                f"{p}: expected a directory with exactly one OpenVINO .xml, found {[f.name for f in found]}"
            )
        xml = found[0]
    else:
        raise ModelNotFound(f"{p}: expected an OpenVINO IR directory or .xml file")
    if not xml.with_suffix(".bin").is_file():
        raise ModelNotFound(f"{xml}: its weights {xml.with_suffix('.bin').name} are missing")
    return xml


def feature_input(xml: str | Path) -> tuple[str, int]:
    """Name and size of an IR's single float32 ``[batch, features]`` input (what samplers send)."""
    from lowtail.serve.openvino_core import shared_core

    m = shared_core().read_model(str(xml))
    ps = m.inputs[0].get_partial_shape() if len(m.inputs) == 1 else None
    if ps is None or ps.rank.is_dynamic or ps.rank.get_length() != 2 or ps[1].is_dynamic:
        raise ModelSpecError(
            f"{xml}: expected one [batch, features] input, found {[str(i) for i in m.inputs]}"
        )
    return m.inputs[0].get_any_name(), int(ps[1].get_length())


def example_inputs(features: int, batch: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Random observations for the policy model, the shape a sampler sends."""
    rng = np.random.default_rng(seed)
    return {INPUT_NAME: rng.standard_normal((batch, features), dtype=np.float32)}
