"""The Kubernetes manifests rendered by roles/lowtail_k8s: schema, QoS, privileges, sizes, bad input."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.deploy.conftest import IMAGE, Rendered
from tests.deploy.kube_schema import RAYCLUSTER_SCHEMA, core_errors, pod_from_template, raycluster_errors

MIB = 1024 * 1024


def all_containers(spec: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield from spec.get("initContainers", [])
    yield from spec["containers"]


def worker_spec(objects: dict[str, dict[str, Any]]) -> dict[str, Any]:
    spec: dict[str, Any] = objects["RayCluster"]["spec"]["workerGroupSpecs"][0]["template"]["spec"]
    return spec


def mib(quantity: str) -> int:
    assert quantity.endswith("Mi"), f"expected a quantity in Mi, got {quantity!r}"
    return int(quantity[:-2])


def test_vendored_crd_schema_is_kuberays_raycluster_v1_as_extracted() -> None:
    """The copy in tests/deploy/data is the v1 openAPIV3Schema of KubeRay's CRD ray.io_rayclusters.yaml
    (ray-project/kuberay; commit and extraction command in tests/deploy/data/README.md), written as compact
    JSON with sorted keys: an edit by hand or a reformatted file shows here."""
    text = RAYCLUSTER_SCHEMA.read_text()
    schema = json.loads(text)
    assert text == json.dumps(schema, sort_keys=True, separators=(",", ":")) + "\n"
    assert set(schema["properties"]) == {"apiVersion", "kind", "metadata", "spec", "status"}
    assert {"headGroupSpec", "workerGroupSpecs"} <= set(schema["properties"]["spec"]["properties"])


def test_raycluster_validates_against_kuberay_crd(default_render: Rendered) -> None:
    assert raycluster_errors(default_render.objects()["RayCluster"]) == []


def test_crd_check_rejects_a_misspelled_field(default_render: Rendered) -> None:
    # The check must be able to fail: a typo the API server would silently prune.
    obj = default_render.objects()["RayCluster"]
    obj["spec"]["workerGroupSpecs"][0]["replica"] = 2
    errors = raycluster_errors(obj)
    assert any("replica" in e for e in errors), errors


def test_core_kinds_and_pod_templates_validate(default_render: Rendered) -> None:
    objects = default_render.objects()
    assert set(objects) == {"Namespace", "RuntimeClass", "RayCluster", "NetworkPolicy"}
    assert core_errors(objects["Namespace"]) == []
    assert core_errors(objects["RuntimeClass"]) == []
    assert core_errors(objects["NetworkPolicy"]) == []
    cluster = objects["RayCluster"]["spec"]
    assert core_errors(pod_from_template(cluster["headGroupSpec"]["template"], "head")) == []
    for group in cluster["workerGroupSpecs"]:
        assert core_errors(pod_from_template(group["template"], group["groupName"])) == []


def test_core_check_rejects_an_unknown_pod_field(default_render: Rendered) -> None:
    template = default_render.objects()["RayCluster"]["spec"]["workerGroupSpecs"][0]["template"]
    template["spec"]["containers"][0]["resource"] = {}
    assert core_errors(pod_from_template(template, "w")) != []


def test_namespace_allows_sys_nice_through_pod_security(default_render: Rendered) -> None:
    labels = default_render.objects()["Namespace"]["metadata"]["labels"]
    # Neither baseline nor restricted admits capabilities.add: [SYS_NICE].
    assert labels["pod-security.kubernetes.io/enforce"] == "privileged"


def test_worker_pod_is_guaranteed_with_integer_cpus(default_render: Rendered) -> None:
    spec = worker_spec(default_render.objects())
    containers = list(all_containers(spec))
    assert len(spec["initContainers"]) >= 1, "the init container is part of the QoS rule too"
    for c in containers:
        res = c["resources"]
        assert res["requests"] == res["limits"], f"{c['name']}: requests != limits"
        assert set(res["limits"]) >= {"cpu", "memory"}, c["name"]
        assert str(res["limits"]["cpu"]).isdigit(), (
            f"{c['name']}: cpu {res['limits']['cpu']!r} not an integer"
        )


def test_head_pod_is_guaranteed(default_render: Rendered) -> None:
    spec = default_render.objects()["RayCluster"]["spec"]["headGroupSpec"]["template"]["spec"]
    for c in all_containers(spec):
        assert c["resources"]["requests"] == c["resources"]["limits"], c["name"]


def test_no_container_is_privileged_and_only_ray_worker_adds_sys_nice(default_render: Rendered) -> None:
    cluster = default_render.objects()["RayCluster"]["spec"]
    specs = [cluster["headGroupSpec"]["template"]["spec"]] + [
        g["template"]["spec"] for g in cluster["workerGroupSpecs"]
    ]
    added: dict[str, list[str]] = {}
    for spec in specs:
        assert not spec.get("hostPID") and not spec.get("hostIPC") and not spec.get("hostNetwork")
        for c in all_containers(spec):
            sc = c["securityContext"]
            assert sc.get("privileged") is False, c["name"]
            assert sc.get("allowPrivilegeEscalation") is False, c["name"]
            assert sc["capabilities"]["drop"] == ["ALL"], c["name"]
            added[c["name"]] = sc["capabilities"].get("add", [])
    assert added.pop("ray-worker") == ["SYS_NICE"]
    assert all(not caps for caps in added.values()), added


def test_worker_pods_select_tuned_nodes_and_tolerate_their_taint(render: Callable[..., Rendered]) -> None:
    rendered = render(
        {
            "lowtail_k8s_node_label": {"key": "example.com/lowlat", "value": "yes"},
            "lowtail_k8s_node_taint": {"key": "example.com/iso", "value": "1", "effect": "NoExecute"},
        }
    )
    assert rendered.returncode == 0, rendered.output
    objects = rendered.objects()
    spec = worker_spec(objects)
    assert spec["nodeSelector"] == {"example.com/lowlat": "yes"}
    toleration = {"key": "example.com/iso", "operator": "Equal", "value": "1", "effect": "NoExecute"}
    assert spec["tolerations"] == [toleration]
    assert objects["RuntimeClass"]["scheduling"]["tolerations"] == [toleration]
    head = objects["RayCluster"]["spec"]["headGroupSpec"]["template"]["spec"]
    assert "nodeSelector" not in head, "the head does not belong on the isolated cores"


def test_shm_and_memory_sizes_add_up(render: Callable[..., Rendered]) -> None:
    shm = {
        "lanes": 8,
        "slots_per_lane": 32,
        "request_bytes": 16384,
        "response_bytes": 32768,
        "header_bytes": 8192,
        "ndarray_slots": 10,
        "ndarray_slot_bytes": 3 * MIB + 5,
        "object_store_mib": 300,
        "headroom_mib": 32,
    }
    worker = {"replicas": 3, "cpus": 6, "memory_mib": 5000, "inference_actors": 2}
    rendered = render({"lowtail_k8s_shm": shm, "lowtail_k8s_worker": worker})
    assert rendered.returncode == 0, rendered.output
    group = rendered.objects()["RayCluster"]["spec"]["workerGroupSpecs"][0]
    spec = group["template"]["spec"]

    queue = shm["lanes"] * shm["slots_per_lane"] * (16 * 1024 + 32 * 1024) + shm["header_bytes"]
    want_bytes = (
        worker["inference_actors"] * queue
        + shm["ndarray_slots"] * shm["ndarray_slot_bytes"]
        + (shm["object_store_mib"] + shm["headroom_mib"]) * MIB
    )
    want_shm_mib = math.ceil(want_bytes / MIB)
    (dshm,) = [v for v in spec["volumes"] if v["name"] == "dshm"]
    assert dshm["emptyDir"] == {"medium": "Memory", "sizeLimit": f"{want_shm_mib}Mi"}
    (ray,) = [c for c in spec["containers"] if c["name"] == "ray-worker"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in ray["volumeMounts"]
    assert mib(ray["resources"]["limits"]["memory"]) == worker["memory_mib"] + want_shm_mib
    assert group["rayStartParams"]["object-store-memory"] == str(shm["object_store_mib"] * MIB)
    assert group["rayStartParams"]["num-cpus"] == str(worker["cpus"]) == ray["resources"]["limits"]["cpu"]
    assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == 3


def test_default_shm_holds_the_predecessors_queue_shape(default_render: Rendered) -> None:
    # 256 slots of 16 KiB + 32 KiB (the predecessor's queue) plus Ray's object store must fit in /dev/shm.
    spec = worker_spec(default_render.objects())
    (dshm,) = [v for v in spec["volumes"] if v["name"] == "dshm"]
    assert mib(dshm["emptyDir"]["sizeLimit"]) * MIB >= 256 * (16 + 32) * 1024 + 512 * MIB


def test_containerd_gets_no_runtimeclass_and_removes_a_stale_one(render: Callable[..., Rendered]) -> None:
    first = render()
    assert first.returncode == 0, first.output
    assert (first.out_dir / "10-runtimeclass.yaml").exists()
    rendered = render(
        {"lowtail_k8s_container_runtime": "containerd", "lowtail_k8s_output_dir": str(first.out_dir)}
    )
    assert rendered.returncode == 0, rendered.output
    objects = rendered.objects()
    assert "RuntimeClass" not in objects, "a RuntimeClass left from the crio run would still be applied"
    template = objects["RayCluster"]["spec"]["workerGroupSpecs"][0]["template"]
    assert "runtimeClassName" not in template["spec"]
    assert "annotations" not in template["metadata"]


def test_crio_runtimeclass_carries_the_high_performance_annotations(default_render: Rendered) -> None:
    objects = default_render.objects()
    template = objects["RayCluster"]["spec"]["workerGroupSpecs"][0]["template"]
    assert template["spec"]["runtimeClassName"] == objects["RuntimeClass"]["metadata"]["name"]
    assert template["metadata"]["annotations"]["cpu-quota.crio.io"] == "disable"
    assert objects["RuntimeClass"]["handler"] == "high-performance"


def test_image_is_used_by_every_container(default_render: Rendered) -> None:
    cluster = default_render.objects()["RayCluster"]["spec"]
    specs = [cluster["headGroupSpec"]["template"]["spec"], worker_spec(default_render.objects())]
    assert {c["image"] for s in specs for c in all_containers(s)} == {IMAGE}


def test_second_run_changes_nothing(render: Callable[..., Rendered]) -> None:
    first = render()
    assert first.returncode == 0, first.output
    # Render again into the same directory through the same inventory.
    again = render({"lowtail_k8s_output_dir": str(first.out_dir)})
    assert again.returncode == 0, again.output
    assert "changed=0" in again.output, again.output


def test_check_mode_writes_nothing(render: Callable[..., Rendered]) -> None:
    rendered = render(check=True)
    assert rendered.returncode == 0, rendered.output
    assert "changed=" in rendered.output and "changed=0" not in rendered.output
    assert not rendered.out_dir.exists()


@pytest.mark.parametrize(
    ("inventory_vars", "message"),
    [
        ({"lowtail_k8s_worker": {"cpus": 2.5}}, '"2.5" cannot be converted to an int'),
        ({"lowtail_k8s_worker": {"cpus": 0}}, "lowtail_k8s_worker.cpus is 0"),
        ({"lowtail_k8s_worker": {"cpus": 2, "inference_actors": 3}}, "inference_actors is 3"),
        ({"lowtail_k8s_worker": {"cpu": 4}}, "lowtail_k8s_worker.cpu. Supported parameters include: cpus"),
        ({"lowtail_k8s_shm": {"object_store_mib": 10}}, "lowtail_k8s_shm.object_store_mib is 10"),
        ({"lowtail_k8s_shm": {"lanes": -1}}, "lowtail_k8s_shm.lanes is -1"),
        ({"lowtail_k8s_shm": {"slots_per_lane": 12}}, "slots_per_lane is 12: expected a power of two"),
        ({"lowtail_k8s_namespace": "Low_Tail"}, '"Low_Tail"'),
        ({"lowtail_k8s_image": ""}, 'image ""'),
        ({"lowtail_k8s_container_runtime": "docker"}, "one of: crio, containerd, got: docker"),
        ({"lowtail_k8s_node_taint": {"key": "a", "value": "b", "effect": "Never"}}, "got: Never"),
    ],
    ids=[
        "fractional-cpus",
        "zero-cpus",
        "more-actors-than-cpus",
        "unknown-key",
        "object-store-below-ray-minimum",
        "negative-lanes",
        "slots-not-a-power-of-two",
        "bad-namespace",
        "empty-image",
        "unknown-runtime",
        "bad-taint-effect",
    ],
)
def test_bad_inventory_value_fails_before_anything_is_written(
    render: Callable[..., Rendered], inventory_vars: dict[str, Any], message: str
) -> None:
    rendered = render(inventory_vars)
    assert rendered.returncode != 0
    assert message in rendered.output, rendered.output
    assert not rendered.out_dir.exists(), "nothing may be written when an input is bad"


def test_worker_pods_read_the_hosts_plan_read_only(default_render: Rendered) -> None:
    spec = worker_spec(default_render.objects())
    ray = next(c for c in spec["containers"] if c["name"] == "ray-worker")
    env = {e["name"]: e.get("value") for e in ray.get("env", [])}
    mount = next(m for m in ray["volumeMounts"] if m["mountPath"] == env["LOWTAIL_PLAN"])
    assert env["LOWTAIL_PLAN"] == "/etc/lowtail/plan.json"
    assert mount["readOnly"] is True
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    # type File: a node without the plan fails the pod instead of letting it recompute one.
    assert volume["hostPath"] == {"path": "/etc/lowtail/plan.json", "type": "File"}


def test_plan_path_follows_the_inventory(render: Callable[..., Rendered]) -> None:
    rendered = render({"lowtail_k8s_plan_path": "/srv/lowtail/plan.json"})
    assert rendered.returncode == 0, rendered.output
    spec = worker_spec(rendered.objects())
    env = {e["name"]: e.get("value") for e in spec["containers"][0].get("env", [])}
    assert env["LOWTAIL_PLAN"] == "/srv/lowtail/plan.json"
    assert {"path": "/srv/lowtail/plan.json", "type": "File"} in [v.get("hostPath") for v in spec["volumes"]]


def test_ray_token_authentication_is_on(render: Callable[..., Rendered], default_render: Rendered) -> None:
    assert default_render.objects()["RayCluster"]["spec"]["authOptions"] == {"mode": "token"}
    rendered = render({"lowtail_k8s_ray_auth_secret": "lowtail-ray-token"})
    cluster = rendered.objects()["RayCluster"]
    assert cluster["spec"]["authOptions"] == {"mode": "token", "secretName": "lowtail-ray-token"}
    assert raycluster_errors(cluster) == []


def test_dashboard_listens_on_the_head_loopback_only(default_render: Rendered) -> None:
    params = default_render.objects()["RayCluster"]["spec"]["headGroupSpec"]["rayStartParams"]
    assert params["dashboard-host"] == "127.0.0.1"


def test_network_policy_admits_only_the_clusters_own_pods(default_render: Rendered) -> None:
    policy = default_render.objects()["NetworkPolicy"]
    cluster = default_render.objects()["RayCluster"]
    mine = {"ray.io/cluster": cluster["metadata"]["name"]}
    assert policy["metadata"]["namespace"] == cluster["metadata"]["namespace"]
    assert policy["spec"]["podSelector"] == {"matchLabels": mine}
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert policy["spec"]["ingress"] == [{"from": [{"podSelector": {"matchLabels": mine}}]}]


def test_network_policy_lets_named_clients_reach_only_the_ray_client_port(
    render: Callable[..., Rendered],
) -> None:
    peer = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "rl-learner"}}}
    rendered = render({"lowtail_k8s_ray_clients": [peer]})
    assert rendered.returncode == 0, rendered.output
    policy = rendered.objects()["NetworkPolicy"]
    assert core_errors(policy) == []
    assert policy["spec"]["ingress"][1] == {"from": [peer], "ports": [{"protocol": "TCP", "port": 10001}]}


def test_network_policy_check_rejects_a_bad_peer(default_render: Rendered) -> None:
    # The schema check can fail: a peer with a misspelled selector is refused.
    policy = default_render.objects()["NetworkPolicy"]
    policy["spec"]["ingress"][0]["from"][0]["podSelectr"] = {}
    assert core_errors(policy) != []


def test_init_container_needs_no_ray_token_and_no_capability(default_render: Rendered) -> None:
    spec = worker_spec(default_render.objects())
    (init,) = spec["initContainers"]
    assert "health-check" not in " ".join(init["command"] + init["args"])  # needs the token with auth on
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert init["securityContext"].get("runAsUser") is None
