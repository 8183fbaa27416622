"""Applying the manifests from a control host (roles/lowtail_k8s tasks/apply.yml, label_nodes.yml).

There is no API server on this machine, so kubectl is replaced by a small stand-in that keeps a cluster's
state in a JSON file: `diff` exits 1 while the applied files differ from what it holds, `apply` stores
them, `get node` / `label` / `taint` read and change node objects. What is tested is the role's logic:
which kubectl calls it makes, in which order, what it reports as changed, and that --check applies nothing.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from tests.deploy.conftest import IMAGE, Rendered, render_manifests

FAKE_KUBECTL = r"""#!PYTHON
import json, sys
from pathlib import Path
state_path = Path(__file__).with_name("cluster.json")
state = json.loads(state_path.read_text())
args = [a for a in sys.argv[1:] if not a.startswith("--context")]
with open(state_path.with_name("calls.log"), "a") as log:
    log.write(" ".join(args) + "\n")
def files(d):
    return {p.name: p.read_text() for p in sorted(Path(d).glob("*.yaml"))}
verb = args[0]
if verb == "diff":
    sys.exit(0 if state["applied"] == files(args[2]) else 1)
if verb == "apply":
    state["applied"] = files(args[2])
elif verb == "get":
    node = state["nodes"][args[2]]
    meta = {"name": args[2], "labels": node["labels"]}
    print(json.dumps({"metadata": meta, "spec": {"taints": node["taints"]}}))
elif verb == "label":
    key, value = args[3].split("=", 1)
    state["nodes"][args[2]]["labels"][key] = value
elif verb == "taint":
    kv, effect = args[3].rsplit(":", 1)
    key, value = kv.split("=", 1)
    state["nodes"][args[2]]["taints"].append({"key": key, "value": value, "effect": effect})
state_path.write_text(json.dumps(state))
"""


def setup_cluster(tmp: Path) -> tuple[Path, Path]:
    bin_dir = tmp / "kube"
    bin_dir.mkdir()
    kubectl = bin_dir / "kubectl"
    kubectl.write_text(FAKE_KUBECTL.replace("PYTHON", sys.executable))
    kubectl.chmod(0o755)
    nodes = {
        name: {"labels": {"kubernetes.io/hostname": name}, "taints": []} for name in ("node-a", "node-b")
    }
    (bin_dir / "cluster.json").write_text(json.dumps({"applied": {}, "nodes": nodes}))
    return kubectl, bin_dir


def run(tmp: Path, kubectl: Path, check: bool = False) -> Rendered:
    local = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}
    children: dict[str, Any] = {
        "lowtail_k8s_control": {"hosts": {"k8s-control": local}},
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
    return render_manifests(tmp, inventory_vars, check=check, children=children)


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
    state = json.loads((bin_dir / "cluster.json").read_text())
    assert sorted(state["applied"]) == [
        "00-namespace.yaml",
        "10-runtimeclass.yaml",
        "20-raycluster.yaml",
        "30-networkpolicy.yaml",
    ]
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
    assert json.loads((bin_dir / "cluster.json").read_text())["applied"] == {}
    assert "changed=0" not in rendered.output, "check mode must report the pending changes"
