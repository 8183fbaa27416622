#!/usr/bin/python3
"""A stand-in kubelet as strict as a real one about its configuration (lowtail's molecule scenario).

It reports a version (``--version``), reads ``--config``, and exits non-zero, as kubelet does at start
(its unit restarts it, Type=simple/Restart=always like the packaged kubelet.service), on:
  * a CPU manager option this version does not have, an alpha/beta option without its gate, a refused
    pair, align-by-socket with single-numa-node: lowtail.node.kubelet_options, the same table preflight
    uses (rules from kubernetes pkg/kubelet/cm/cpumanager/policy_options.go);
  * options given with the none policy (policy_none.go refuses any option);
  * memoryManagerPolicy Static whose reservedMemory does not sum to kubeReserved + systemReserved +
    evictionHard memory.available (kubelet resource managers docs; lowtail.node.kubelet_memory);
  * a checkpoint (cpu_manager_state, memory_manager_state) written under another policy ("could not
    restore state from checkpoint", cpu-management-policies docs);
  * /etc/lowtail-standin/fail-always existing (a kubelet that never becomes healthy for a reason no
    table knows).
Started, it writes the checkpoints of its policies (as kubelet does), publishes its running
configuration for the stand-in kubectl's /configz, and runs until SIGTERM.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time

sys.path.insert(0, "/usr/local/lib/lowtail-standin")

# PyYAML is copied next to lowtail_node: the image has no python3-yaml.
import yaml
from lowtail_node import kubelet_memory, kubelet_options

# LOWTAIL_STANDIN_PREFIX lets tests/ansible run the stand-in against a temporary tree.
_PREFIX = os.environ.get("LOWTAIL_STANDIN_PREFIX", "")
STATE = _PREFIX + "/etc/lowtail-standin"
RUN = _PREFIX + "/run/lowtail-standin"
ROOT = _PREFIX + "/var/lib/kubelet"


def version() -> str:
    with open(f"{STATE}/kubelet-version") as f:
        return f.read().strip()


def refuse(msg: str) -> None:
    print(f"E run.go: failed to run Kubelet: {msg}", file=sys.stderr)
    sys.exit(1)


def check_memory(cfg: dict) -> None:
    if cfg.get("memoryManagerPolicy", "None") != "Static":
        return
    want = sum(
        kubelet_memory.parse_quantity(str(v), k)
        for k, v in (
            ("kubeReserved", (cfg.get("kubeReserved") or {}).get("memory", "0")),
            ("systemReserved", (cfg.get("systemReserved") or {}).get("memory", "0")),
            ("evictionHard", (cfg.get("evictionHard") or {}).get("memory.available", "100Mi")),
        )
    )
    have = sum(
        kubelet_memory.parse_quantity(str((r.get("limits") or {}).get("memory", "0")), "reservedMemory")
        for r in cfg.get("reservedMemory") or []
    )
    if have != want:
        refuse(f"the total amount of reserved memory {have} is not equal to the value {want} of type memory")


def check_checkpoint(name: str, policy: str) -> None:
    path = f"{ROOT}/{name}"
    if not os.path.exists(path):
        return
    with open(path) as f:
        recorded = json.load(f).get("policyName")
    if recorded != policy:
        refuse(
            f"could not restore state from checkpoint: configured policy {policy!r} differs from state "
            f"checkpoint policy {recorded!r}, please drain this node and delete {path}"
        )


def main() -> None:
    if "--version" in sys.argv:
        print(f"Kubernetes v{version()}")
        return
    path = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--config=")), f"{ROOT}/config.yaml")
    with open(path) as f:
        cfg = yaml.safe_load(f) or {}
    if os.path.exists(f"{STATE}/fail-always"):
        refuse("stand-in told to fail (fail-always)")
    cpu_policy = cfg.get("cpuManagerPolicy", "none")
    options = cfg.get("cpuManagerPolicyOptions") or {}
    if cpu_policy == "none" and options:
        refuse(f"None policy: received unsupported options={options}")
    result = kubelet_options.check(
        f"v{version()}", options, cfg.get("featureGates") or {}, cfg.get("topologyManagerPolicy", "none")
    )
    if result.problems:
        refuse("; ".join(result.problems))
    check_memory(cfg)
    mem_policy = cfg.get("memoryManagerPolicy", "None")
    check_checkpoint("cpu_manager_state", cpu_policy)
    check_checkpoint("memory_manager_state", mem_policy)
    for name, policy in (("cpu_manager_state", cpu_policy), ("memory_manager_state", mem_policy)):
        if not os.path.exists(f"{ROOT}/{name}"):
            with open(f"{ROOT}/{name}", "w") as f:
                json.dump({"policyName": policy, "checksum": 1}, f)
            os.chmod(f"{ROOT}/{name}", 0o600)
    os.makedirs(RUN, exist_ok=True)
    with open(f"{RUN}/configz.json", "w") as f:
        json.dump({"kubeletconfig": cfg}, f)
    with open(f"{RUN}/kubelet.pid", "w") as f:
        f.write(str(os.getpid()))

    def stop(*_: object) -> None:
        for name in ("kubelet.pid", "configz.json"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"{RUN}/{name}")
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
