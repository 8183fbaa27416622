"""The lowtail_kubelet filters (through the plugin file, as Ansible loads it), kubelet flag overrides
and the OCI runtime's CPU-affinity fix."""

from __future__ import annotations

import re
from types import ModuleType

import pytest
from ansible.errors import AnsibleFilterError

from lowtail.node.kubelet_flags import overrides
from lowtail.node.kubelet_runtime import affinity_problems, resets_affinity

from .conftest import ROOT, load_module

FIELDS = ["cpuManagerPolicy", "reservedSystemCPUs", "evictionHard", "featureGates"]


@pytest.fixture(scope="module")
def kf() -> ModuleType:
    return load_module(ROOT / "filter_plugins/lowtail_kubelet.py", "lowtail_kubelet_filters")


def test_policy_filter_renders_what_each_version_accepts(kf: ModuleType) -> None:
    new = kf.kubelet_policy("Kubernetes v1.37.2", "auto", {}, "single-numa-node", 24)
    assert new == {
        "minor": 37,
        "options": {
            "full-pcpus-only": "true",
            "strict-cpu-reservation": "true",
            "prefer-align-cpus-by-uncorecache": "true",
        },
        "gates": {},
        "topology_options": {"max-allowable-numa-nodes": "24"},
        "problems": [],
    }
    assert kf.kubelet_policy("Kubernetes v1.35.4", "auto", {}, "single-numa-node")["options"] == {
        "full-pcpus-only": "true",
        "strict-cpu-reservation": "true",
        "prefer-align-cpus-by-uncorecache": "true",
    }


def test_policy_filter_reports_an_unsupported_version_as_a_problem(kf: ModuleType) -> None:
    result = kf.kubelet_policy("Kubernetes v1.34.3", "auto")
    assert result["problems"] == [
        "kubelet Kubernetes v1.34.3 is not supported; lowtail claims kubelet 1.35 to 1.37, the minors whose "
        "own start-up code it is tested against"
    ]


def test_eviction_filter_never_leaves_a_signal_at_zero(kf: ModuleType) -> None:
    merged = kf.kubelet_eviction_hard({"memory.available": "100Mi"}, "200Mi")
    assert merged["memory.available"] == "200Mi"
    assert merged["nodefs.available"] == "10%"
    assert len(merged) == 5


@pytest.mark.parametrize(("version", "supported"), [("v1.29.9", False), ("v1.30.0", True), ("v1.36.3", True)])
def test_config_dir_is_used_only_where_no_gate_is_needed(
    kf: ModuleType, version: str, supported: bool
) -> None:
    assert kf.kubelet_config_dir_supported(version) is supported


def test_kubeadm_flags_that_override_lowtail_fields_are_named() -> None:
    files = {
        "/var/lib/kubelet/kubeadm-flags.env": 'KUBELET_KUBEADM_ARGS="--container-runtime-endpoint=unix:///run/'
        'containerd/containerd.sock --cpu-manager-policy=none --pod-infra-container-image=pause:3.9"\n',
        "/etc/default/kubelet": "# extra\nKUBELET_EXTRA_ARGS='--feature-gates=Foo=true --node-ip 10.0.0.2'\n",
    }
    problems = overrides(files, FIELDS)
    assert len(problems) == 2
    assert problems[0].startswith("/etc/default/kubelet: KUBELET_EXTRA_ARGS passes --feature-gates")
    assert "--cpu-manager-policy, which overrides cpuManagerPolicy" in problems[1]


def test_flags_for_fields_lowtail_does_not_write_pass() -> None:
    assert (
        overrides({"/etc/default/kubelet": "KUBELET_EXTRA_ARGS=--max-pods=250 --node-ip=10.0.0.1"}, FIELDS)
        == []
    )


@pytest.mark.parametrize(
    ("runtime", "version", "fixed"),
    [
        ("runc", (1, 1, 15), False),
        ("runc", (1, 2, 6), False),
        ("runc", (1, 2, 7), True),
        ("runc", (1, 3, 0), False),
        ("runc", (1, 3, 1), True),
        ("runc", (1, 4, 0), True),
        ("crun", (1, 9, 2), False),
        ("crun", (1, 25, 0), True),
    ],
)
def test_runtime_versions_with_the_affinity_reset(
    runtime: str, version: tuple[int, int, int], fixed: bool
) -> None:
    assert resets_affinity(runtime, version) is fixed


def test_old_runc_is_a_problem_only_on_kernels_that_keep_the_affinity() -> None:
    runtimes = {"runc": "runc version 1.1.12\ncommit: v1.1.12-0-g51d5e94\nspec: 1.0.2-dev"}
    assert affinity_problems(runtimes, "5.15.0-105-generic") == []
    (problem,) = affinity_problems(runtimes, "6.8.0-31-generic")
    assert problem.startswith("runc 1.1.12 on kernel 6.8.0-31-generic does not reset the CPU affinity")
    assert affinity_problems({"runc": "runc version 1.3.1"}, "6.8.0") == []


def test_unreadable_runtime_version_is_a_problem() -> None:
    assert affinity_problems({"crun": "garbage"}, "6.12.0") == [
        "crun --version printed 'garbage'; expected a version such as '1.3.1'"
    ]


def test_config_check_filter_reports_the_merged_files_problems(kf: ModuleType) -> None:
    merged = {
        "cpuManagerPolicy": "static",
        "reservedSystemCPUs": "0-3",
        "featureGates": {"CPUManagerPolicyOptions": False},
    }
    result = kf.kubelet_config_check(merged, "Kubernetes v1.36.3", 2, {"sockets": 2, "online": "0-7"}, "2")
    assert result["problems"] == [
        "cannot set feature gate CPUManagerPolicyOptions to false, feature is locked to true (kubelet 1.36)"
    ]
    # The host's cgroup version and online CPUs reach the check.
    v1 = kf.kubelet_config_check({**merged, "featureGates": {}}, "v1.36.3", 2, {"online": "0-2"}, 1)[
        "problems"
    ]
    assert [p.split(";")[0] for p in v1] == [
        "kubelet 1.36 is configured to not run on a host using cgroup v1 (failCgroupV1 defaults to true) and "
        "this host runs cgroup v1",
        "reservedSystemCPUs '0-3' names CPUs this host does not have online: [3]",
    ]
    assert kf.kubelet_config_check("garbage", "v1.36.3")["problems"] == [
        "the kubelet configuration is 'garbage'; expected a map"
    ]
    assert kf.kubelet_config_check({}, "v1.27.1")["problems"][0].startswith(
        "kubelet v1.27.1 is not supported"
    )


def test_command_line_follows_execstart_resets_and_variable_expansion() -> None:
    from lowtail.node.kubelet_flags import command_line

    unit = (
        "# /lib/systemd/system/kubelet.service\n[Service]\nExecStart=/usr/bin/kubelet --config=/old.yaml\n"
        "# /etc/systemd/system/kubelet.service.d/10-kubeadm.conf\n[Service]\n"
        'Environment="KUBELET_CONFIG_ARGS=--config=/var/lib/kubelet/config.yaml" "ONE=--max-pods=9 --x"\n'
        "EnvironmentFile=-/var/lib/kubelet/kubeadm-flags.env\n"
        "ExecStart=\nExecStart=/usr/bin/kubelet $KUBELET_CONFIG_ARGS $KUBELET_KUBEADM_ARGS ${ONE} \\\n"
        "  --config-dir /etc/kubernetes/kubelet.conf.d\n"
    )
    env = {
        "/var/lib/kubelet/kubeadm-flags.env": 'KUBELET_KUBEADM_ARGS="--reserved-cpus=0-3 --node-ip=10.0.0.2"'
    }
    cmd = command_line(unit, env)
    assert cmd.config == "/var/lib/kubelet/config.yaml"
    assert cmd.config_dir == "/etc/kubernetes/kubelet.conf.d"
    assert cmd.flags["--reserved-cpus"] == "0-3" and cmd.kubeadm
    # ${ONE} stays one word: kubelet gets the flag --max-pods with the value "9 --x".
    assert cmd.flags["--max-pods"] == "9 --x"
    assert cmd.env_files == ["/var/lib/kubelet/kubeadm-flags.env"]


def test_files_check_filter_judges_the_main_file_and_drop_ins_as_kubelet_loads_them(kf: ModuleType) -> None:
    main = {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "cpuManagerPolicy": "static",
        "reservedSystemCPUs": "0-3",
    }
    ok = kf.kubelet_files_check(main, [], "v1.37.2", 1, {"online": "0-7"}, 2)
    assert ok == {"problems": [], "warnings": []}
    headless = [["/etc/kubernetes/kubelet.conf.d/50-x.conf", {"maxPods": 10}]]
    assert kf.kubelet_files_check(main, headless, "v1.37.2", 1)["problems"] == [
        "drop-in /etc/kubernetes/kubelet.conf.d/50-x.conf has apiVersion None and kind None; expected "
        "kubelet.config.k8s.io/v1beta1 KubeletConfiguration (kubelet fails to load it)"
    ]


def test_cpus_expands_a_cpulist_with_the_package_parser(kf: ModuleType) -> None:
    assert kf.cpus("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert kf.cpus("") == []


@pytest.mark.parametrize("bad", ["3-1", "0-3,,8", "a", "0-15:2"])
def test_cpus_refuses_a_malformed_cpulist_naming_it(kf: ModuleType, bad: str) -> None:
    with pytest.raises(AnsibleFilterError, match=r"lowtail_cpus: .*" + re.escape(bad)):
        kf.cpus(bad)
