"""The kubectl stand-in keeps kubectl's rules the rollback tests rely on (tests/deploy/kubectl_standin.py):
a stand-in that deleted anything it was given, or ignored a missing object silently, would let a
rollback that names the wrong objects pass."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.kubectl_standin import main


def manifest(kind: str, name: str, namespace: str = "") -> str:
    meta = f"  name: {name}\n" + (f"  namespace: {namespace}\n" if namespace else "")
    return f"apiVersion: v1\nkind: {kind}\nmetadata:\n{meta}"


def obj(kind: str, name: str, namespace: str = "") -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": kind,
        "metadata": {"name": name, **({"namespace": namespace} if namespace else {})},
    }


@pytest.fixture
def state(tmp_path: Path) -> Path:
    path = tmp_path / "cluster.json"
    objects = {
        "Namespace//lowtail": obj("Namespace", "lowtail"),
        "Namespace//team-x": obj("Namespace", "team-x"),
        "RayCluster/lowtail/lowtail": obj("RayCluster", "lowtail", "lowtail"),
        "RayCluster/team-x/lowtail": obj("RayCluster", "lowtail", "team-x"),
    }
    path.write_text(json.dumps({"objects": objects, "nodes": {}}))
    return path


def objects(state: Path) -> list[str]:
    return sorted(json.loads(state.read_text())["objects"])


def test_delete_of_a_missing_object_fails_unless_ignore_not_found(
    state: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "rc.yaml"
    missing.write_text(manifest("RayCluster", "gone", "lowtail"))
    assert main(state, ["delete", "-f", str(missing)]) == 1
    assert 'Error from server (NotFound): error when deleting "' in capsys.readouterr().err
    assert main(state, ["delete", "--ignore-not-found", "-f", str(missing)]) == 0
    assert capsys.readouterr() == ("", "")


def test_delete_directory_reads_manifest_extensions_only_and_names_what_it_deleted(
    state: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = tmp_path / "manifests"
    (d / "nested").mkdir(parents=True)
    (d / "20-rc.yaml").write_text(manifest("RayCluster", "lowtail", "lowtail"))
    (d / "notes.txt").write_text(manifest("Namespace", "team-x"))
    (d / "nested" / "ns.yaml").write_text(manifest("Namespace", "team-x"))
    assert main(state, ["delete", "-f", str(d)]) == 0
    assert capsys.readouterr().out == 'raycluster.ray.io "lowtail" deleted\n'
    assert objects(state) == ["Namespace//lowtail", "Namespace//team-x", "RayCluster/team-x/lowtail"]
    assert main(state, ["delete", "-f", str(tmp_path / "absent")]) == 1
    assert f'error: the path "{tmp_path / "absent"}" does not exist' in capsys.readouterr().err


def test_deleting_a_namespace_deletes_what_is_in_it_and_nothing_else(state: Path, tmp_path: Path) -> None:
    ns = tmp_path / "ns.yaml"
    ns.write_text(manifest("Namespace", "lowtail"))
    assert main(state, ["delete", "--ignore-not-found", "-f", str(ns)]) == 0
    assert objects(state) == ["Namespace//team-x", "RayCluster/team-x/lowtail"]


def test_unknown_flags_and_bad_values_are_refused(
    state: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ns = tmp_path / "ns.yaml"
    ns.write_text(manifest("Namespace", "lowtail"))
    for bad, message in (
        ("--ignore-notfound", "unknown flag: --ignore-notfound"),
        ("--cascade=true", "invalid cascade value (true)"),
        ("--timeout=300", 'invalid argument "300" for "--timeout" flag'),
    ):
        assert main(state, ["delete", bad, "-f", str(ns)]) == 1
        assert message in capsys.readouterr().err
    assert "Namespace//lowtail" in objects(state)


def test_get_names_objects_as_kubectl_prints_them(
    state: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = tmp_path / "both.yaml"
    f.write_text(manifest("Namespace", "lowtail") + "---\n" + manifest("RayCluster", "other", "lowtail"))
    assert main(state, ["get", "--ignore-not-found", "-o", "name", "-f", str(f)]) == 0
    assert capsys.readouterr().out == "namespace/lowtail\n"
    assert main(state, ["get", "-o", "name", "-f", str(f)]) == 1
    assert 'Error from server (NotFound): rayclusters.ray.io "other" not found' in capsys.readouterr().err
