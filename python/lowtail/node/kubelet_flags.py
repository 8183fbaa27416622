"""Command-line flags that override what lowtail writes into the KubeletConfiguration file.

kubelet applies flags over its --config file (kubelet docs "Set Kubelet Parameters Via A Configuration
File": flags take precedence), and kubeadm passes flags through ``KUBELET_KUBEADM_ARGS`` in
``/var/lib/kubelet/kubeadm-flags.env`` and ``KUBELET_EXTRA_ARGS`` in ``/etc/default/kubelet`` (Debian)
or ``/etc/sysconfig/kubelet`` (RHEL). A flag for a field lowtail sets would silently win, so preflight
refuses it.

Stdlib only: shipped to hosts as module_utils.
"""

from __future__ import annotations

import shlex

# kubelet flag -> KubeletConfiguration field (k8s.io/kubelet/config/v1beta1 types.go).
FLAG_FIELDS: dict[str, str] = {
    "--cpu-manager-policy": "cpuManagerPolicy",
    "--cpu-manager-policy-options": "cpuManagerPolicyOptions",
    "--reserved-cpus": "reservedSystemCPUs",
    "--topology-manager-policy": "topologyManagerPolicy",
    "--topology-manager-scope": "topologyManagerScope",
    "--topology-manager-policy-options": "topologyManagerPolicyOptions",
    "--memory-manager-policy": "memoryManagerPolicy",
    "--reserved-memory": "reservedMemory",
    "--kube-reserved": "kubeReserved",
    "--system-reserved": "systemReserved",
    "--eviction-hard": "evictionHard",
    "--feature-gates": "featureGates",
}


def env_flags(text: str) -> dict[str, list[str]]:
    """Flags per variable of an environment file (``NAME="--a=b --c"`` lines)."""
    found: dict[str, list[str]] = {}
    for raw in (text or "").splitlines():
        line = raw.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        name, _, value = line.partition("=")
        try:
            words = shlex.split(value)
            found[name.strip()] = [w for v in words for w in shlex.split(v)]
        except ValueError:
            found[name.strip()] = value.split()
    return found


def overrides(files: dict[str, str], fields: list[str]) -> list[str]:
    """One message per flag in these files (path -> content) that sets one of ``fields``."""
    problems = []
    for path, text in sorted(files.items()):
        for var, words in sorted(env_flags(text).items()):
            for word in words:
                flag = word.split("=", 1)[0]
                field = FLAG_FIELDS.get(flag)
                if field and field in fields:
                    problems.append(
                        f"{path}: {var} passes {flag}, which overrides {field} that lowtail writes to the "
                        f"configuration file; remove the flag and let lowtail set {field}"
                    )
    return problems
