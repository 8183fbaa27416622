#!/usr/bin/python3
"""A stand-in kubelet that starts or refuses exactly as the real kubelet of its version would (molecule).

Whether a configuration starts is decided by upstream's code alone: the stand-in hands its --config
file, every file of --config-dir and the machine (the sysfs tree of LOWTAIL_STANDIN_SYSFS, the
fixture's when the node is one, and that tree's cgroup version) to the kubelet oracle of its minor
(tests/kubelet/oracle, built by ``make oracle`` from k8s.io/kubernetes at that release): decoding
with the kubelet's codec, the drop-in merge, feature gates, ValidateKubeletConfiguration and the CPU,
topology and memory managers' start-up checks. The oracle's refusal is the stand-in's, word for word.
Without the oracle of its minor the stand-in does not start at all (exit 2, naming the missing file):
judging with lowtail's own table would let the table prove itself right, which is what it must not do.

What the oracle does not model, the stand-in keeps:
  * a checkpoint (cpu_manager_state, memory_manager_state) written under another policy ("could not
    restore state from checkpoint", cpu-management-policies docs): the oracle starts from an empty
    state directory;
  * /etc/lowtail-standin/fail-always existing (a kubelet that never becomes healthy for a reason no
    check knows).
Started, it writes the checkpoints of its policies (as kubelet does), publishes its running
configuration for the stand-in kubectl's /configz (the files merged as kubelet merges them, a field
KubeletConfiguration does not have dropped with kubelet's lenient-decoding message), and runs until
SIGTERM. Its unit restarts it (Type=simple/Restart=always like the packaged kubelet.service).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, "/usr/local/lib/lowtail-standin")

# PyYAML is copied next to lowtail_node: the image has no python3-yaml.
import yaml
from lowtail_node import kubelet_options

# LOWTAIL_STANDIN_PREFIX lets tests/ansible run the stand-in against a temporary tree.
_PREFIX = os.environ.get("LOWTAIL_STANDIN_PREFIX", "")
STATE = _PREFIX + "/etc/lowtail-standin"
RUN = _PREFIX + "/run/lowtail-standin"
ROOT = _PREFIX + "/var/lib/kubelet"
# The machine the oracle judges: a fixture machine's sysfs (LOWTAIL_STANDIN_SYSFS) when the node is one.
SYSFS = os.environ.get("LOWTAIL_STANDIN_SYSFS", _PREFIX + "/sys")
# One oracle per claimed minor, kubelet-oracle-1.<minor>, as make oracle names them.
ORACLE_DIR = os.environ.get("LOWTAIL_STANDIN_ORACLE_DIR", "/usr/local/lib/lowtail-standin/oracle")

API_VERSION, KIND = "kubelet.config.k8s.io/v1beta1", "KubeletConfiguration"
# The top-level fields of KubeletConfiguration (json names in staging/src/k8s.io/kubelet/config/v1beta1/
# types.go at kubernetes 001332b0), for /configz only: whether a file starts is the oracle's answer.
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


def broken(msg: str) -> None:
    """The stand-in itself cannot judge: not a kubelet refusal, so a different exit status."""
    print(f"E lowtail stand-in kubelet cannot run: {msg}", file=sys.stderr)
    sys.exit(2)


def read_text(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError as e:
        refuse(f"failed to load Kubelet config file {path}, error: {e}")
    raise AssertionError("unreachable")


def config_files() -> tuple[str, str | None, list[str]]:
    """The main file, the drop-in directory and its files (every regular file: kubelet picks *.conf)."""
    main = flag("config") or f"{ROOT}/config.yaml"
    config_dir = flag("config-dir")
    if not config_dir:
        return main, None, []
    try:
        names = sorted(n for n in os.listdir(config_dir) if os.path.isfile(os.path.join(config_dir, n)))
    except OSError as e:
        refuse(f"failed to read the drop-in directory {config_dir}: {e}")
    return main, config_dir, names


def cgroup_version() -> int:
    # The unified hierarchy's root has cgroup.controllers; preflight reads the same file of the same tree.
    return 2 if os.path.exists(f"{SYSFS}/fs/cgroup/cgroup.controllers") else 1


def ask_oracle(minor: int, main: str, config_dir: str | None, names: list[str]) -> None:
    """Refuse with the kubelet's own reason when that release's start-up code refuses the files."""
    oracle = f"{ORACLE_DIR}/kubelet-oracle-1.{minor}"
    if not os.access(oracle, os.X_OK):
        broken(
            f"no kubelet 1.{minor} oracle at {oracle} (make oracle builds it): this stand-in judges a "
            "configuration only with that release's own code"
        )
    case = {
        "id": "standin",
        "config": read_text(main),
        "dropins": [[n, read_text(os.path.join(config_dir, n))] for n in names] if config_dir else [],
        "sysfs": SYSFS,
        "cgroup": cgroup_version(),
    }
    try:
        done = subprocess.run(
            [oracle], input=json.dumps(case) + "\n", capture_output=True, text=True, timeout=300, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        broken(f"the kubelet 1.{minor} oracle {oracle} did not answer: {e}")
    if done.returncode != 0 or not done.stdout.strip():
        broken(
            f"the kubelet 1.{minor} oracle {oracle} failed (exit {done.returncode}): {done.stderr[-2000:]}"
        )
    answer = json.loads(done.stdout)
    if not answer["accept"]:
        refuse(answer["reason"])


def decode(path: str) -> dict[str, Any]:
    """A file the oracle accepted, for /configz: unknown fields dropped as kubelet's lenient decoding does."""
    doc = yaml.safe_load(read_text(path))
    unknown = sorted(set(doc) - FIELDS)
    if unknown:
        info(
            'Using lenient decoding as strict decoding failed err="strict decoding error: '
            + ", ".join(f'unknown field "{k}"' for k in unknown)
            + f'" path={path}'
        )
    return {k: v for k, v in doc.items() if k in FIELDS}


def running_config(main: str, config_dir: str | None, names: list[str]) -> dict[str, Any]:
    cfg = decode(main)
    for name in names:
        if config_dir and name.endswith(".conf"):
            cfg = kubelet_options.merge_dropin(cfg, decode(os.path.join(config_dir, name)))
    return cfg


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
    try:
        minor = kubelet_options.supported_minor(f"v{version()}")
    except kubelet_options.KubeletVersionError as e:
        broken(f"{e}: there is no oracle to judge with")
    main_file, config_dir, names = config_files()
    ask_oracle(minor, main_file, config_dir, names)
    if os.path.exists(f"{STATE}/fail-always"):
        refuse("stand-in told to fail (fail-always)")
    cfg = running_config(main_file, config_dir, names)
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
