from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import openvino as ov
import pytest

from lowtail.cli.main import main
from lowtail.serve.model import (
    ModelNotFound,
    ModelSpec,
    ModelSpecError,
    find_model_xml,
    parse_heads,
    parse_hidden,
    write_model,
)
from lowtail.serve.openvino_core import shared_core
from tests.serve.conftest import SMALL_SPEC


def test_same_seed_gives_identical_weights_and_another_seed_does_not(tmp_path: Path) -> None:
    a = write_model(tmp_path / "a", SMALL_SPEC).with_suffix(".bin").read_bytes()
    b = write_model(tmp_path / "b", SMALL_SPEC).with_suffix(".bin").read_bytes()
    c_spec = ModelSpec(features=64, hidden=(128, 64), heads=(("action", 6), ("move", 8)), seed=8)
    c = write_model(tmp_path / "c", c_spec).with_suffix(".bin").read_bytes()
    assert a == b
    assert a != c


def test_saved_model_is_full_precision_with_softmax_heads_and_value(small_model: Path) -> None:
    core = shared_core()
    m = core.read_model(str(find_model_xml(small_model)))
    consts = [op for op in m.get_ops() if op.get_type_name() == "Constant"]
    assert consts and all(op.get_output_element_type(0) == ov.Type.f32 for op in consts)
    assert [o.get_any_name() for o in m.outputs] == ["action", "move", "value"]
    assert [i.get_any_name() for i in m.inputs] == ["obs"]
    assert m.inputs[0].get_partial_shape()[0].is_dynamic
    compiled = core.compile_model(m, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    x = np.random.default_rng(1).standard_normal((5, 64), dtype=np.float32)
    out = compiled(x)
    assert np.allclose(out["action"].sum(axis=1), 1.0, atol=1e-5)
    assert out["move"].shape == (5, 8) and out["value"].shape == (5, 1)
    meta = json.loads((small_model / "model.json").read_text())
    assert meta["spec"]["seed"] == 7 and meta["outputs"] == ["action", "move", "value"]


def test_model_build_command_writes_ir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "m"
    code = main(
        ["model", "build", "--out", str(out), "--features", "32", "--hidden", "64", "--heads", "a:4,b:3"]
    )
    assert code == 0
    assert {p.name for p in out.iterdir()} == {"policy.xml", "policy.bin", "model.json"}
    assert "value" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--heads", "move"], "'move': expected NAME:ACTIONS"),
        (["--heads", "value:3"], "head name 'value'"),
        (["--hidden", "64,x"], "--hidden '64,x'"),
        (["--features", "0"], "features=0"),
        (["--heads", "a:1"], "size 1: expected 2..32768"),
    ],
)
def test_bad_model_options_exit_2_naming_the_value(
    argv: list[str], needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["model", "build", "--out", str(tmp_path / "m"), *argv]) == 2
    assert needle in capsys.readouterr().err
    assert not (tmp_path / "m").exists()


def test_find_model_xml_names_what_is_missing(tmp_path: Path, small_model: Path) -> None:
    with pytest.raises(ModelNotFound, match="exactly one"):
        find_model_xml(tmp_path)
    (tmp_path / "x.xml").write_text("<net/>")
    with pytest.raises(ModelNotFound, match=r"x\.bin are missing"):
        find_model_xml(tmp_path)
    assert find_model_xml(small_model).name == "policy.xml"
    assert find_model_xml(small_model / "policy.xml") == small_model / "policy.xml"


def test_parsers() -> None:
    assert parse_hidden("1024, 512") == (1024, 512)
    assert parse_heads("a:2,b:30") == (("a", 2), ("b", 30))
    with pytest.raises(ModelSpecError):
        parse_hidden("")
