"""A Guaranteed static pod running lowtail's runtime on the real kubelet with lowtail's rendered file:
the kubelet's CPU manager gives it exactly the plan's isolated CPUs, and inside the pod lowtail sees
that cpuset, leases only those CPUs and answers a request from a worker pinned to its lease (a real
OpenVINO inference through the shared-memory queue)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.kubelet.real.conftest import cpu_list, newest_claimed
from tests.kubelet.real.stack import BIN, Fatal, Stack, wait_for

# The session's containerd and image import count against the first test's timeout.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]
POD, CONTAINER = "lowtail-probe", "lowtail"


def static_pod(kube: Stack, image: str, plan_path: str, out: Path, cpus: int) -> dict[str, Any]:
    """The pod as the lowtail_k8s role shapes a worker pod: the host's plan mounted read-only with
    LOWTAIL_PLAN naming it, UID 0 with SYS_NICE alone, RuntimeDefault seccomp; requests equal to limits
    in whole CPUs (Guaranteed, so the static CPU manager gives it exclusive CPUs)."""
    resources = {"cpu": str(cpus), "memory": "1Gi"}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": POD, "namespace": "default"},
        "spec": {
            "hostNetwork": True,
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 5,
            "containers": [
                {
                    "name": CONTAINER,
                    "image": image,
                    "imagePullPolicy": "Never",
                    "env": [{"name": "LOWTAIL_PLAN", "value": "/etc/lowtail/plan.json"}],
                    "resources": {"requests": resources, "limits": resources},
                    "securityContext": {
                        "runAsUser": 0,
                        "privileged": False,
                        "allowPrivilegeEscalation": False,
                        "capabilities": {"drop": ["ALL"], "add": ["SYS_NICE"]},
                        "seccompProfile": {"type": "RuntimeDefault"},
                    },
                    "volumeMounts": [
                        {"name": "plan", "mountPath": "/etc/lowtail/plan.json", "readOnly": True},
                        {"name": "out", "mountPath": "/out"},
                    ],
                }
            ],
            "volumes": [
                {"name": "plan", "hostPath": {"path": plan_path, "type": "File"}},
                {"name": "out", "hostPath": {"path": str(out), "type": "Directory"}},
            ],
        },
    }


def test_guaranteed_pod_gets_the_isolated_cpus_and_lowtail_serves_on_them(
    kube: Stack, tmp_path: Path, plan: dict[str, Any]
) -> None:
    binary, cfg = newest_claimed(kube, tmp_path)
    isolated = cpu_list(plan["isolated"])
    out = kube.base / "pod-out"
    out.mkdir()
    for name in ("cpu_manager_state", "memory_manager_state"):
        (kube.kubelet_root / name).unlink(missing_ok=True)
    kube.start_kubelet(BIN / binary, kube.write_config("pod-kubelet.yaml", cfg))
    try:
        kube.wait_healthy()
        pod = static_pod(kube, kube.images["pod"], plan["path"], out, len(isolated))  # type: ignore[attr-defined]
        (kube.manifests / f"{POD}.yaml").write_text(yaml.safe_dump(pod))
        result_file = out / "result.json"

        def done() -> bool:
            if kube.kubelet is not None and kube.kubelet.proc.poll() is not None:
                raise Fatal(f"kubelet exited: {kube.kubelet.output()[-4000:]}")
            return result_file.exists()

        try:
            wait_for("the pod's result", done, 900, interval_s=2)
        except TimeoutError as e:
            logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in kube.pod_logs.rglob("*.log"))
            kubelet = kube.kubelet.output()[-4000:] if kube.kubelet else ""
            raise AssertionError(f"{e}\npod logs:\n{logs}\nkubelet:\n{kubelet}") from None
        result = json.loads(result_file.read_text())
        state = kube.cpu_manager_state()
    finally:
        kube.remove_static_pods()
        kube.stop_kubelet()

    assert "error" not in result, result["error"]
    # The kubelet's checkpoint: this pod's container holds exactly the plan's isolated CPUs.
    entries = [containers for containers in state.get("entries", {}).values() if CONTAINER in containers]
    assert len(entries) == 1, state
    assert cpu_list(entries[0][CONTAINER]) == isolated, state
    # Exclusive: no other container may run there (the shared pool is the housekeeping CPUs, or
    # nothing once strict-cpu-reservation keeps the reserved ones out of it too).
    assert set(cpu_list(state["defaultCpuSet"])) <= set(cpu_list(plan["housekeeping"])), state
    # Inside the pod: lowtail's cpuset reader sees them, the affinity is that cpuset (runc reset the
    # housekeeping-only affinity containerd runs with), and the lease pool is exactly those CPUs.
    assert result["cpuset"] == isolated, result
    assert result["affinity"] == isolated, result
    assert result["plan_isolated"] == isolated and result["plan_source"] == "/etc/lowtail/plan.json", result
    assert result["lease_pool"] == isolated, result
    assert result["lease_cpu"] in isolated, result
    assert result["worker_cpus_allowed"] == str(result["lease_cpu"]), result
    assert result["outputs"] == {"action": [4, 6], "move": [4, 8], "value": [4, 1]}, result
    assert result["worker_calls"] >= 1 and result["worker_exit"] == 0, result
