#!/usr/bin/python3
"""A stand-in kubelet as strict as a real one about its configuration (lowtail's molecule scenario).

It reports a version (``--version``) and builds its configuration the way kubelet does: ``--config``,
then every ``*.conf`` file of ``--config-dir`` in lexical order merged over it (maps key by key, lists
replaced; kubernetes.io "Kubelet Configuration Directory Merging", KEP-3983). It exits non-zero, as
kubelet does at start (its unit restarts it, Type=simple/Restart=always like the packaged
kubelet.service), on:
  * a file that is not a KubeletConfiguration of kubelet.config.k8s.io/v1beta1, or a drop-in directory
    on 1.28/1.29 without KUBELET_CONFIG_DROPIN_DIR_ALPHA in the environment (kubelet-config-file docs);
  * everything lowtail.node.kubelet_options.check_config refuses, the same table preflight uses: CPU
    manager options this version lacks, alpha/beta options without their gate, refused pairs,
    align-by-socket with single-numa-node (pkg/kubelet/cm/cpumanager/policy_options.go), options with
    the none policy (policy_none.go), gates locked to the other value, gates the binary no longer has
    and non-boolean gate values (component-base featuregate, pkg/features/kube_features.go),
    topologyManagerPolicyOptions (pkg/kubelet/cm/topologymanager/policy_options.go) and more NUMA nodes
    than the topology manager allows (topology_manager.go NewManager: 8 unless
    max-allowable-numa-nodes raises it) - the NUMA nodes are read from sysfs like cadvisor does;
  * memoryManagerPolicy Static whose reservedMemory does not sum to kubeReserved + systemReserved +
    evictionHard memory.available (kubelet resource managers docs; lowtail.node.kubelet_memory);
  * a checkpoint (cpu_manager_state, memory_manager_state) written under another policy ("could not
    restore state from checkpoint", cpu-management-policies docs);
  * /etc/lowtail-standin/fail-always existing (a kubelet that never becomes healthy for a reason no
    table knows).
A field KubeletConfiguration does not have is what kubelet's strict decoder rejects; for v1beta1 kubelet
then decodes leniently, logs "Using lenient decoding as strict decoding failed" and drops the field
(pkg/kubelet/kubeletconfig/util/codec/codec.go DecodeKubeletConfiguration): so does this stand-in, and
the dropped field is missing from /configz.
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
from typing import Any

sys.path.insert(0, "/usr/local/lib/lowtail-standin")

# PyYAML is copied next to lowtail_node: the image has no python3-yaml.
import yaml
from lowtail_node import cpulist, kubelet_memory, kubelet_options

# LOWTAIL_STANDIN_PREFIX lets tests/ansible run the stand-in against a temporary tree.
_PREFIX = os.environ.get("LOWTAIL_STANDIN_PREFIX", "")
STATE = _PREFIX + "/etc/lowtail-standin"
RUN = _PREFIX + "/run/lowtail-standin"
ROOT = _PREFIX + "/var/lib/kubelet"
# The NUMA nodes come from this sysfs tree: a fixture machine's (LOWTAIL_STANDIN_SYSFS) when the node is one.
NODE_ONLINE = os.environ.get("LOWTAIL_STANDIN_SYSFS", _PREFIX + "/sys") + "/devices/system/node/online"

API_VERSION, KIND = "kubelet.config.k8s.io/v1beta1", "KubeletConfiguration"
# The top-level fields of KubeletConfiguration (json names in staging/src/k8s.io/kubelet/config/v1beta1/
# types.go at kubernetes 001332b0; newer than every version lowtail supports, so a field a given
# version lacks passes here: lenient either way).
FIELDS = frozenset(
    """apiVersion kind enableServer staticPodPath podLogsDir syncFrequency fileCheckFrequency
    httpCheckFrequency staticPodURL staticPodURLHeader address port readOnlyPort tlsCertFile
    tlsPrivateKeyFile tlsCipherSuites tlsCurvePreferences tlsMinVersion rotateCertificates
    serverTLSBootstrap authentication authorization registryPullQPS registryBurst
    imagePullCredentialsVerificationPolicy preloadedImagesVerificationAllowlist eventRecordQPS eventBurst
    enableDebuggingHandlers enableContentionProfiling healthzPort healthzBindAddress oomScoreAdj
    clusterDomain clusterDNS streamingConnectionIdleTimeout nodeStatusUpdateFrequency
    nodeStatusReportFrequency nodeLeaseDurationSeconds imageMinimumGCAge imageMaximumGCAge
    imageGCHighThresholdPercent imageGCLowThresholdPercent volumeStatsAggPeriod kubeletCgroups
    systemCgroups cgroupRoot cgroupsPerQOS cgroupDriver cpuManagerPolicy singleProcessOOMKill
    cpuManagerPolicyOptions cpuManagerReconcilePeriod draManagerReconcilePeriod memoryManagerPolicy
    topologyManagerPolicy topologyManagerScope topologyManagerPolicyOptions qosReserved
    runtimeRequestTimeout hairpinMode maxPods podCIDR podPidsLimit resolvConf runOnce cpuCFSQuota
    cpuCFSQuotaPeriod nodeStatusMaxImages maxOpenFiles contentType kubeAPIQPS kubeAPIBurst
    serializeImagePulls maxParallelImagePulls evictionHard evictionSoft evictionSoftGracePeriod
    evictionPressureTransitionPeriod evictionMaxPodGracePeriod evictionMinimumReclaim
    mergeDefaultEvictionSettings podsPerCore enableControllerAttachDetach protectKernelDefaults
    makeIPTablesUtilChains iptablesMasqueradeBit iptablesDropBit featureGates failSwapOn memorySwap
    containerLogMaxSize containerLogMaxFiles containerLogMaxWorkers containerLogMonitorInterval
    configMapAndSecretChangeDetectionStrategy systemReserved kubeReserved reservedSystemCPUs
    showHiddenMetricsForVersion systemReservedCgroup kubeReservedCgroup enforceNodeAllocatable
    allowedUnsafeSysctls volumePluginDir providerID kernelMemcgNotification logging
    enableSystemLogHandler enableSystemLogQuery shutdownGracePeriod shutdownGracePeriodCriticalPods
    shutdownGracePeriodByPodPriority crashLoopBackOff reservedMemory enableProfilingHandler
    enableDebugFlagsHandler seccompDefault memoryThrottlingFactor memoryReservationPolicy
    registerWithTaints registerNode tracing localStorageCapacityIsolation containerRuntimeEndpoint
    imageServiceEndpoint failCgroupV1 userNamespaces""".split()
)


def version() -> str:
    with open(f"{STATE}/kubelet-version") as f:
        return f.read().strip()


def refuse(msg: str) -> None:
    print(f"E run.go: failed to run Kubelet: {msg}", file=sys.stderr)
    sys.exit(1)


def info(msg: str) -> None:
    print(f"I server.go: {msg}", file=sys.stderr)


def flag(name: str) -> str | None:
    """``--name=value`` or ``--name value`` from the command line (pflag accepts both)."""
    args = sys.argv[1:]
    for i, arg in enumerate(args):
        if arg.startswith(f"--{name}="):
            return arg.split("=", 1)[1]
        if arg == f"--{name}" and i + 1 < len(args):
            return args[i + 1]
    return None


def decode(path: str) -> dict[str, Any]:
    """One configuration file, decoded as kubelet decodes it (see the module docstring)."""
    try:
        with open(path) as f:
            doc = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as e:
        refuse(f"failed to load Kubelet config file {path}, error: {e}")
    if not isinstance(doc, dict):
        refuse(f"failed to load Kubelet config file {path}, error: Object 'Kind' is missing in '{doc!r}'")
    if doc.get("kind") != KIND or doc.get("apiVersion") != API_VERSION:
        refuse(
            f"failed to load Kubelet config file {path}, error: no kind {doc.get('kind')!r} is registered "
            f"for version {doc.get('apiVersion')!r}; expected {KIND} of {API_VERSION}"
        )
    unknown = sorted(set(doc) - FIELDS)
    if unknown:
        info(
            'Using lenient decoding as strict decoding failed err="strict decoding error: '
            + ", ".join(f'unknown field "{k}"' for k in unknown)
            + f'" path={path}'
        )
    return {k: v for k, v in doc.items() if k in FIELDS}


def load_config(minor: int) -> dict[str, Any]:
    cfg = decode(flag("config") or f"{ROOT}/config.yaml")
    config_dir = flag("config-dir")
    if not config_dir:
        return cfg
    # 1.28 and 1.29 read --config-dir only with this variable set (alpha of KEP-3983).
    if minor < kubelet_options.CONFIG_DIR_MIN_MINOR and "KUBELET_CONFIG_DROPIN_DIR_ALPHA" not in os.environ:
        refuse("--config-dir needs the KUBELET_CONFIG_DROPIN_DIR_ALPHA environment variable on this kubelet")
    try:
        names = sorted(n for n in os.listdir(config_dir) if n.endswith(".conf"))
    except OSError as e:
        refuse(f"failed to read the drop-in directory {config_dir}: {e}")
    for name in names:
        cfg = kubelet_options.merge_dropin(cfg, decode(os.path.join(config_dir, name)))
    return cfg


def numa_nodes() -> int:
    """The machine's NUMA nodes, from sysfs as cadvisor reads them (no node directory: one node)."""
    try:
        with open(NODE_ONLINE) as f:
            return len(cpulist.parse(f.read())) or 1
    except OSError:
        return 1


def check_memory(cfg: dict[str, Any]) -> None:
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
    ver = f"v{version()}"
    minor = kubelet_options.supported_minor(ver)
    cfg = load_config(minor)
    if os.path.exists(f"{STATE}/fail-always"):
        refuse("stand-in told to fail (fail-always)")
    result = kubelet_options.check_config(ver, cfg, numa_nodes())
    for warning in result.warnings:
        info(warning)
    if result.problems:
        refuse("; ".join(result.problems))
    check_memory(cfg)
    cpu_policy = cfg.get("cpuManagerPolicy", "none")
    mem_policy = cfg.get("memoryManagerPolicy", "None")
    check_checkpoint("cpu_manager_state", cpu_policy)
    check_checkpoint("memory_manager_state", mem_policy)
    for name, policy in (("cpu_manager_state", cpu_policy), ("memory_manager_state", mem_policy)):
        if not os.path.exists(f"{ROOT}/{name}"):
            with open(f"{ROOT}/{name}", "w") as f:
                json.dump({"policyName": policy, "checksum": 1}, f)
            os.chmod(f"{ROOT}/{name}", 0o600)
    os.makedirs(RUN, exist_ok=True)
    # /configz as the release writes it: the v1beta1 fields under "kubeletconfig"; from 1.36 the object
    # also carries its apiVersion and kind (cmd/kubelet/app setConfigz sets the GroupVersionKind and
    # component-base configz.Set requires one), before that the TypeMeta is empty and omitted.
    running = cfg if minor >= 36 else {k: v for k, v in cfg.items() if k not in ("apiVersion", "kind")}
    with open(f"{RUN}/configz.json", "w") as f:
        json.dump({"kubeletconfig": running}, f)
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
