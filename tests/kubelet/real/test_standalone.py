"""A real kubelet, built from its Go module, on a real containerd and runc (tests/kubelet/real/stack.py):
lowtail's rendered KubeletConfiguration for this host is accepted, and files lowtail's preflight refuses
are refused by the kubelet too, for the same reason."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.kubelet.real.conftest import built_kubelets, cpu_list, kubelet_version, render
from tests.kubelet.real.stack import BIN, Stack, wait_for

# The session's containerd and image import count against the first test's timeout.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def test_every_binary_records_its_upstream_version(equipment: dict[str, Any]) -> None:
    versions = {b["name"]: b["version"] for b in equipment["binaries"]}
    asks = {
        "containerd": ["--version"],
        "ctr": ["--version"],
        "containerd-shim-runc-v2": ["-v"],
        "runc": ["--version"],
        "pause": ["-v"],
    }
    for name, version in versions.items():
        out = subprocess.run(
            [str(BIN / name), *asks.get(name, ["--version"])], capture_output=True, text=True, check=True
        ).stdout
        if name.startswith("kubelet-"):
            assert out.strip() == f"Kubernetes {version}", (name, out)
        elif name == "runc":
            assert f"runc version {version.lstrip('v')}" in out, out
        elif name != "pause":
            assert version in out, (name, out)
    assert {
        "kubelet-1.37",
        "containerd",
        "ctr",
        "containerd-shim-runc-v2",
        "runc",
        "pause",
    } <= versions.keys()


def _claimed_or_skip(verdict: dict[str, list[str]], binary: str) -> None:
    unclaimed = [p for p in verdict["problems"] if "is not supported" in p]
    if unclaimed:
        pytest.skip(f"lowtail does not claim {kubelet_version(binary)}: {unclaimed[0]}")


def start_clean(kube: Stack, binary: str, cfg: dict[str, Any], name: str) -> None:
    """Start the kubelet on ``cfg`` with no resource manager checkpoints (as the role's window does)."""
    for state in ("cpu_manager_state", "memory_manager_state"):
        (kube.kubelet_root / state).unlink(missing_ok=True)
    kube.start_kubelet(BIN / binary, kube.write_config(name, cfg))


@pytest.mark.parametrize("binary", built_kubelets())
def test_rendered_config_is_accepted(
    kube: Stack, binary: str, plan: dict[str, Any], verdicts: Callable[[str], tuple[Any, ...]]
) -> None:
    cfg, verdict, _ = verdicts(binary)
    _claimed_or_skip(verdict, binary)
    assert verdict["problems"] == [], verdict
    start_clean(kube, binary, cfg, f"{binary}-rendered.yaml")
    try:
        running = kube.wait_healthy()["kubeletconfig"]
        for field in (
            "cpuManagerPolicy",
            "reservedSystemCPUs",
            "topologyManagerPolicy",
            "memoryManagerPolicy",
        ):
            assert running[field] == cfg[field], (field, running[field], cfg[field])
        assert running.get("cpuManagerPolicyOptions", {}) == cfg["cpuManagerPolicyOptions"]
        assert cfg["reservedSystemCPUs"] == plan["housekeeping"]
        state = wait_for("the CPU manager's checkpoint", kube.cpu_manager_state, 60)
        assert state["policyName"] == "static"
        # No pod yet: the shared pool is every CPU, less the reserved ones with strict-cpu-reservation.
        every = set(cpu_list(plan["housekeeping"])) | set(cpu_list(plan["isolated"]))
        strict = cfg["cpuManagerPolicyOptions"].get("strict-cpu-reservation") == "true"
        assert set(cpu_list(state["defaultCpuSet"])) == every - (
            set(cpu_list(plan["housekeeping"])) if strict else set()
        )
    finally:
        kube.stop_kubelet()


# (id, what the bad file changes, lowtail's preflight message, the kubelet's log message): each pair of
# patterns captures the option the refusal names, and both must name the same one.
REFUSED = [
    (
        "unknown-option",
        {"cpuManagerPolicyOptions": {"lowtail-no-such-option": "true"}},
        r"unknown CPU Manager Policy option '([a-z-]+)'",
        r'unknown CPU Manager Policy option: \\?"([a-z-]+)\\?"',
    ),
    (
        "alpha-option-without-gate",
        {"cpuManagerPolicyOptions": {"distribute-cpus-across-cores": "true"}},
        r"option '([a-z-]+)' is alpha in kubelet 1\.\d+ and needs "
        r"featureGates\.CPUManagerPolicyAlphaOptions: true",
        r'CPU Manager Policy Alpha-level Options not enabled, but option \\?"([a-z-]+)\\?" provided',
    ),
    (
        "options-that-exclude-each-other",
        {
            "cpuManagerPolicyOptions": {"full-pcpus-only": "true", "distribute-cpus-across-cores": "true"},
            "featureGates": {"CPUManagerPolicyAlphaOptions": True},
        },
        r"options '([a-z-]+)' and '([a-z-]+)' can not be used at the same time",
        r"static policy options ([a-z-]+) and ([a-z-]+) can not be used at the same time",
    ),
]


def refused(kube: Stack, binary: str, cfg: dict[str, Any], name: str) -> str:
    """The kubelet's log once it has exited non-zero on ``cfg`` (it must not start)."""
    start_clean(kube, binary, cfg, name)
    try:
        rc, log = kube.wait_exit()
    finally:
        kube.stop_kubelet()
    assert rc != 0, log[-4000:]
    return log


def bad_file(good: dict[str, Any], change: dict[str, Any]) -> dict[str, Any]:
    bad = {**good, **change}
    if "featureGates" in change:
        bad["featureGates"] = {**good.get("featureGates", {}), **change["featureGates"]}
    return bad


@pytest.fixture(scope="module")
def verdicts(kube: Stack, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Any, ...]]:
    """Per kubelet: lowtail's rendered file, and preflight's verdict on it and on each REFUSED file
    (one render.yml run for the file, one for the verdicts)."""
    cache: dict[str, tuple[Any, ...]] = {}

    def get(binary: str) -> tuple[Any, ...]:
        if binary not in cache:
            workdir = tmp_path_factory.mktemp(binary)
            good, verdict, _ = render(kube, binary, workdir / "good")
            bad = [bad_file(good, r[1]) for r in REFUSED]
            _, _, bad_verdicts = render(kube, binary, workdir / "bad", check=bad)
            cache[binary] = (
                good,
                verdict,
                dict(zip([r[0] for r in REFUSED], zip(bad, bad_verdicts, strict=True), strict=True)),
            )
        return cache[binary]

    return get


@pytest.mark.parametrize("binary", built_kubelets())
@pytest.mark.parametrize("case", REFUSED, ids=[r[0] for r in REFUSED])
def test_preflight_refusal_is_the_kubelets(
    kube: Stack,
    binary: str,
    case: tuple[str, dict[str, Any], str, str],
    verdicts: Callable[[str], tuple[Any, ...]],
) -> None:
    name, _, lowtail_says, kubelet_says = case
    _, verdict, bad_files = verdicts(binary)
    _claimed_or_skip(verdict, binary)
    bad, bad_verdict = bad_files[name]
    ours = [m for p in bad_verdict["problems"] if (m := re.search(lowtail_says, p))]
    assert len(ours) == 1, f"preflight's problems {bad_verdict['problems']} do not match {lowtail_says!r}"
    log = refused(kube, binary, bad, f"{binary}-{name}.yaml")
    theirs = re.search(kubelet_says, log)
    assert theirs, f"the kubelet's log does not say {kubelet_says!r}; it ends:\n{log[-4000:]}"
    assert ours[0].groups() == theirs.groups(), (ours[0].group(0), theirs.group(0))


@pytest.mark.parametrize("binary", built_kubelets())
def test_cgroup_v1_host_needs_failcgroupv1_false(
    kube: Stack, binary: str, tmp_path: Path, verdicts: Callable[[str], tuple[Any, ...]]
) -> None:
    """This host is cgroup v1: kubelet 1.35 and later refuse to start on it unless the file says
    failCgroupV1: false. Over a file without it, lowtail must write the field (and the kubelet then
    start) or preflight must refuse."""
    _, verdict, _ = verdicts(binary)
    _claimed_or_skip(verdict, binary)
    before = {k: v for k, v in kube.base_config().items() if k != "failCgroupV1"}
    rendered, rendered_verdict, _ = render(kube, binary, tmp_path, before=before)
    without = {k: v for k, v in rendered.items() if k != "failCgroupV1"}
    log = refused(kube, binary, without, f"{binary}-no-failcgroupv1.yaml")
    assert "kubelet is configured to not run on a host using cgroup v1" in log, log[-4000:]
    if rendered.get("failCgroupV1") is False:
        start_clean(kube, binary, rendered, f"{binary}-lowtail-failcgroupv1.yaml")
        try:
            assert kube.wait_healthy()["kubeletconfig"]["failCgroupV1"] is False
        finally:
            kube.stop_kubelet()
    elif not any("failCgroupV1" in p for p in rendered_verdict["problems"]):
        pytest.xfail(
            f"over a file without failCgroupV1, lowtail neither writes it nor refuses the result on this "
            f"cgroup v1 host, and {kubelet_version(binary)} refuses that file: {rendered_verdict}"
        )
