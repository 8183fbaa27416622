"""Applying the manifests from a control host (roles/lowtail_k8s tasks/apply.yml, label_nodes.yml) and
deleting them on rollback (tasks/rollback.yml, the first play of playbooks/rollback.yml).

There is no API server on this machine, so kubectl is replaced by a stand-in that keeps a cluster's
objects in a JSON file (tests/deploy/kubectl_standin.py: kubectl's rules for -f, NotFound,
--ignore-not-found and namespace deletion, each with its source): `diff` exits 1 while the applied
objects differ from what it holds, `apply` stores them, `get -o name` and `delete` find them by kind,
namespace and name, `get node` / `label` / `taint` read and change node objects. What is tested is the
role's logic: which kubectl calls it makes, in which order, what it reports as changed, that --check
changes nothing, and that a rollback deletes lowtail's objects and nobody else's.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from tests.deploy.conftest import IMAGE, REPO, Rendered, render_manifests

WRAPPER = """#!{python}
import sys
from collections.abc import Sequence
from pathlib import Path
sys.path.insert(0, {repo!r})
from tests.deploy.kubectl_standin import main
sys.exit(main(Path(__file__).with_name("cluster.json"), sys.argv[1:]))
"""

# lowtail's objects with the default inventory below, as Kind/namespace/name.
LOWTAIL_OBJECTS = [
    "Namespace//lowtail",
    "RuntimeClass//lowtail-performance",
    "RayCluster/lowtail/lowtail",
    "NetworkPolicy/lowtail/lowtail-ray",
]


def _object(kind: str, name: str, namespace: str = "") -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, **({"namespace": namespace} if namespace else {})}
    return {"kind": kind, "metadata": {**meta, "labels": {"owner": "operator"}}}


# The operator's own objects of the same kinds: other names, or lowtail's names in another namespace.
OPERATOR_OBJECTS = {
    "Namespace//team-x": _object("Namespace", "team-x"),
    "RuntimeClass//runc-fast": _object("RuntimeClass", "runc-fast"),
    "RayCluster/team-x/lowtail": _object("RayCluster", "lowtail", "team-x"),
    "RayCluster/team-x/trainer": _object("RayCluster", "trainer", "team-x"),
    "NetworkPolicy/team-x/lowtail-ray": _object("NetworkPolicy", "lowtail-ray", "team-x"),
}


def setup_cluster(tmp: Path, objects: dict[str, Any] | None = None) -> tuple[Path, Path]:
    bin_dir = tmp / "kube"
    bin_dir.mkdir()
    kubectl = bin_dir / "kubectl"
    kubectl.write_text(WRAPPER.format(python=sys.executable, repo=str(REPO)))
    kubectl.chmod(0o755)
    nodes = {
        name: {"labels": {"kubernetes.io/hostname": name}, "taints": []} for name in ("node-a", "node-b")
    }
    state = {"objects": objects or {}, "nodes": nodes}
    (bin_dir / "cluster.json").write_text(json.dumps(state))
    return kubectl, bin_dir


def cluster(bin_dir: Path) -> dict[str, Any]:
    state: dict[str, Any] = json.loads((bin_dir / "cluster.json").read_text())
    return state


def run(
    tmp: Path,
    kubectl: Path,
    check: bool = False,
    playbook: Path | None = None,
    control: bool = True,
    *,
    extra: Sequence[str] = (),
) -> Rendered:
    local = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}
    children: dict[str, Any] = {
        **({"lowtail_k8s_control": {"hosts": {"k8s-control": local}}} if control else {}),
        # Never contacted: only their names (and lowtail_k8s_node_name) are used.
        "lowtail_nodes": {"hosts": {"node-a": {}, "epyc-b": {"lowtail_k8s_node_name": "node-b"}}},
    }
    inventory_vars = {
        "lowtail_k8s_image": IMAGE,
        "lowtail_k8s_output_dir": str(tmp / "manifests"),
        "lowtail_k8s_kubectl": str(kubectl),
        "lowtail_k8s_kubectl_args": ["--context=lab"],
        "lowtail_k8s_remote_dir": str(tmp / "remote"),
        "lowtail_k8s_label_nodes": True,
    }
    return render_manifests(
        tmp,
        inventory_vars,
        check=check,
        children=children,
        playbook=playbook or REPO / "playbooks" / "k8s.yml",
        extra=extra,
    )


def calls(bin_dir: Path) -> list[str]:
    log = bin_dir / "calls.log"
    lines = log.read_text().splitlines() if log.exists() else []
    log.unlink(missing_ok=True)
    return lines


def test_apply_labels_and_taints_then_second_run_changes_nothing(tmp_path: Path) -> None:
    kubectl, bin_dir = setup_cluster(tmp_path)
    remote = str(tmp_path / "remote")

    first = run(tmp_path, kubectl)
    assert first.returncode == 0, first.output
    made = calls(bin_dir)
    assert made[:2] == [f"diff -f {remote}", f"apply -f {remote}"]
    assert "label node node-a lowtail.io/tuned=true --overwrite" in made
    assert "taint node node-b lowtail.io/isolated=true:NoSchedule --overwrite" in made
    state = cluster(bin_dir)
    assert sorted(state["objects"]) == sorted(LOWTAIL_OBJECTS)
    assert state["nodes"]["node-b"]["labels"]["lowtail.io/tuned"] == "true"

    second = run(tmp_path, kubectl)
    assert second.returncode == 0, second.output
    assert "changed=0" in second.output, second.output
    made = calls(bin_dir)
    assert not [c for c in made if c.split()[0] in ("apply", "label", "taint")], made


def test_check_mode_compares_but_applies_nothing(tmp_path: Path) -> None:
    kubectl, bin_dir = setup_cluster(tmp_path)
    rendered = run(tmp_path, kubectl, check=True)
    assert rendered.returncode == 0, rendered.output
    made = calls(bin_dir)
    assert not [c for c in made if c.split()[0] in ("apply", "label", "taint")], made
    assert cluster(bin_dir)["objects"] == {}
    assert "changed=0" not in rendered.output, "check mode must report the pending changes"


def rollback_play(tmp: Path) -> Path:
    """The play of playbooks/rollback.yml that deletes the Kubernetes objects, then a marker play: the
    other plays of rollback.yml change the hosts themselves (tests/ansible/test_rollout.py runs those)."""
    plays = yaml.safe_load((REPO / "playbooks" / "rollback.yml").read_text())
    mine = [p for p in plays if _includes_k8s_rollback(p.get("tasks", []))]
    assert len(mine) == 1, f"rollback.yml must have one play running lowtail_k8s rollback, found {len(mine)}"
    assert plays.index(mine[0]) == 0, "the Kubernetes objects go first, before any node is rolled back"
    # Stands for the node plays that follow it in rollback.yml: they must not start after a failure.
    nodes_next = {
        "name": "Stand-in for the node plays",
        "hosts": "lowtail_nodes",
        "gather_facts": False,
        "tasks": [{"name": "Mark", "ansible.builtin.debug": {"msg": "the node plays started"}}],
    }
    playbook = tmp / "k8s-rollback.yml"
    playbook.write_text(yaml.safe_dump([*mine, nodes_next]))
    return playbook


def _includes_k8s_rollback(tasks: list[dict[str, Any]]) -> bool:
    return any(
        (t.get("ansible.builtin.include_role") or {}) == {"name": "lowtail_k8s", "tasks_from": "rollback"}
        for t in tasks
    )


def deletes(made: list[str]) -> list[str]:
    """The file each `kubectl delete` call named, in call order."""
    return [c.split()[-1].rsplit("/", 1)[-1] for c in made if c.split()[0] == "delete"]


def test_rollback_deletes_lowtail_objects_workload_first_and_keeps_the_operators(tmp_path: Path) -> None:
    kubectl, bin_dir = setup_cluster(tmp_path, dict(OPERATOR_OBJECTS))
    assert run(tmp_path, kubectl).returncode == 0
    assert sorted(cluster(bin_dir)["objects"]) == sorted([*LOWTAIL_OBJECTS, *OPERATOR_OBJECTS])
    calls(bin_dir)

    playbook = rollback_play(tmp_path)
    first = run(tmp_path, kubectl, playbook=playbook)
    assert first.returncode == 0, first.output
    made = calls(bin_dir)
    # The workload before the policy that fences its ports, the RuntimeClass, and the Namespace last.
    assert deletes(made) == [
        "20-raycluster.yaml",
        "30-networkpolicy.yaml",
        "10-runtimeclass.yaml",
        "00-namespace.yaml",
    ]
    assert all("--ignore-not-found" in c.split() for c in made if c.startswith("delete")), made
    assert "--cascade=foreground" in next(
        c for c in made if c.endswith("20-raycluster.yaml") and c.startswith("delete")
    )
    assert cluster(bin_dir)["objects"] == OPERATOR_OBJECTS
    assert not (tmp_path / "remote").exists(), "the manifest directory stays on the control host"
    # Once for the play, not once per node (the play runs for two nodes): one listing per manifest.
    assert len([c for c in made if c.startswith("get ")]) == 4, made

    second = run(tmp_path, kubectl, playbook=playbook)
    assert second.returncode == 0, second.output
    assert "changed=0" in second.output and "failed=0" in second.output, second.output
    assert calls(bin_dir) == []
    assert cluster(bin_dir)["objects"] == OPERATOR_OBJECTS


def test_rollback_in_check_mode_reports_what_it_would_delete_and_deletes_nothing(tmp_path: Path) -> None:
    kubectl, bin_dir = setup_cluster(tmp_path, dict(OPERATOR_OBJECTS))
    assert run(tmp_path, kubectl).returncode == 0
    before = cluster(bin_dir)["objects"]
    calls(bin_dir)

    checked = run(tmp_path, kubectl, check=True, playbook=rollback_play(tmp_path))
    assert checked.returncode == 0, checked.output
    assert deletes(calls(bin_dir)) == []
    assert cluster(bin_dir)["objects"] == before
    assert sorted(p.name for p in (tmp_path / "remote").iterdir()) == sorted(
        p.name for p in (tmp_path / "manifests").iterdir()
    )
    assert (
        "kubectl delete would remove raycluster.ray.io/lowtail, networkpolicy.networking.k8s.io/lowtail-ray, "
        "runtimeclass.node.k8s.io/lowtail-performance, namespace/lowtail" in " ".join(checked.output.split())
    ), checked.output
    assert re.search(r"changed=[1-9]", checked.output), "check mode must report the pending deletion"


def test_rollback_stops_at_a_failed_delete_with_kubectls_message(tmp_path: Path) -> None:
    kubectl, bin_dir = setup_cluster(tmp_path, dict(OPERATOR_OBJECTS))
    assert run(tmp_path, kubectl).returncode == 0
    state = cluster(bin_dir)
    state["forbidden"] = ["delete RayCluster"]
    (bin_dir / "cluster.json").write_text(json.dumps(state))
    calls(bin_dir)
    playbook = rollback_play(tmp_path)

    failed = run(tmp_path, kubectl, playbook=playbook)
    assert failed.returncode != 0, failed.output
    output = " ".join(failed.output.split())
    assert (
        'Error from server (Forbidden): error when deleting "' in output
        and 'rayclusters.ray.io "lowtail" is forbidden: User "lab" cannot delete resource "rayclusters"'
        in output
    ), failed.output
    assert "not deleted: the rest of raycluster.ray.io/lowtail and the manifests after it" in output, output
    assert "the node plays started" not in failed.output, "a failed delete must stop the rollback"
    # Nothing after the RayCluster was deleted: the Namespace would have taken the workload with it.
    assert deletes(calls(bin_dir)) == ["20-raycluster.yaml"]
    assert sorted(cluster(bin_dir)["objects"]) == sorted([*LOWTAIL_OBJECTS, *OPERATOR_OBJECTS])
    assert (tmp_path / "remote" / "00-namespace.yaml").exists(), "a rerun needs the manifests"

    state = cluster(bin_dir)
    state["forbidden"] = []
    (bin_dir / "cluster.json").write_text(json.dumps(state))
    rerun = run(tmp_path, kubectl, playbook=playbook)
    assert rerun.returncode == 0, rerun.output
    assert "the node plays started" in rerun.output
    assert cluster(bin_dir)["objects"] == OPERATOR_OBJECTS


def test_rollback_without_control_host_or_manifests_does_nothing(tmp_path: Path) -> None:
    """As in the molecule scenario: no lowtail_k8s_control group; then a control host that never
    applied anything (no manifest directory on it)."""
    kubectl, bin_dir = setup_cluster(tmp_path, dict(OPERATOR_OBJECTS))
    playbook = rollback_play(tmp_path)
    for control in (False, True):
        done = run(tmp_path, kubectl, playbook=playbook, control=control)
        assert done.returncode == 0, done.output
        assert "changed=0" in done.output and "failed=0" in done.output, done.output
        assert calls(bin_dir) == []
    assert cluster(bin_dir)["objects"] == OPERATOR_OBJECTS
