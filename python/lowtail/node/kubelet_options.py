"""What each kubelet minor version accepts: CPU manager policy options, their gates, refused combinations.

This is the one table lowtail's preflight (through the ``lowtail_kubelet_*`` filters), the kubelet role
and the stand-in kubelet of the molecule scenario all read, so "what kubelet X.Y refuses" is written
once. Every row names its upstream source. The rules mirror kubernetes
``pkg/kubelet/cm/cpumanager/policy_options.go``:

* ``CheckPolicyOptionAvailable``: an option in none of the alpha/beta/stable sets is refused ("unknown
  CPU Manager Policy option"); an alpha option needs the ``CPUManagerPolicyAlphaOptions`` gate (off by
  default); a beta option needs ``CPUManagerPolicyBetaOptions`` (on by default); a stable one needs none.
* ``NewStaticPolicyOptions``: every value must parse with Go's ``strconv.ParseBool`` and some pairs of
  options may not both be true.
* ``ValidateStaticPolicyOptions``: ``align-by-socket`` is refused with the ``single-numa-node``
  topology manager policy.

``check_config`` applies these to a whole KubeletConfiguration (the merged file kubelet will read) together
with the resource managers' feature gates (``GATES``: locked, removed and disabled gates), the topology
manager's options (``pkg/kubelet/cm/topologymanager/policy_options.go``) and its NUMA-node limit.
kubelet refuses to start on each of these, so they are checked before any host is changed.

Stdlib only and no imports outside this package: Ansible ships it to hosts as module_utils.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from .errors import LowtailError

ALPHA, BETA, GA = "alpha", "beta", "GA"
ALPHA_GATE = "CPUManagerPolicyAlphaOptions"
BETA_GATE = "CPUManagerPolicyBetaOptions"
# The gate each maturity needs and the gate's default (kubernetes pkg/features/kube_features.go).
GATE_OF: dict[str, tuple[str, bool] | None] = {ALPHA: (ALPHA_GATE, False), BETA: (BETA_GATE, True), GA: None}

FULL_PCPUS = "full-pcpus-only"
ACROSS_NUMA = "distribute-cpus-across-numa"
BY_SOCKET = "align-by-socket"
ACROSS_CORES = "distribute-cpus-across-cores"
STRICT_RESERVATION = "strict-cpu-reservation"
UNCORECACHE = "prefer-align-cpus-by-uncorecache"

_1_28: dict[str, str] = {
    # kubernetes commit 077c0aa1be07 (1.23): the option added in 1.22 moved into the beta set.
    FULL_PCPUS: BETA,
    # kubernetes#105631 (1.23, KEP-2902): alpha (beta only from 1.33, enhancements#2902).
    ACROSS_NUMA: ALPHA,
    # kubernetes#111278 (1.25, KEP-3327): alpha.
    BY_SOCKET: ALPHA,
}
# Options and their maturity per Kubernetes minor version (1.x). policy_options.go at each release
# tag (pkg.go.dev k8s.io/kubernetes@v1.x/pkg/kubelet/cm/cpumanager lists the option constants) and the
# "Static policy options" list of kubernetes.io cpu-management-policies.
OPTIONS_BY_MINOR: dict[int, dict[str, str]] = {
    28: _1_28,
    29: _1_28,
    30: _1_28,
    # KEP-4176 (1.31, blog 2024-08-22 "currently in alpha", website#47014): distribute-cpus-across-cores.
    31: {**_1_28, ACROSS_CORES: ALPHA},
    # kubernetes#127483 (1.32, KEP-4540): strict-cpu-reservation, alpha (blog 2024-12-16 "currently in
    # alpha"); KEP-4800 (1.32): prefer-align-cpus-by-uncorecache, alpha.
    32: {**_1_28, ACROSS_CORES: ALPHA, STRICT_RESERVATION: ALPHA, UNCORECACHE: ALPHA},
    # 1.33: full-pcpus-only GA (KEP-2625), distribute-cpus-across-numa beta (KEP-2902,
    # enhancements#5117), strict-cpu-reservation beta (kubernetes#130290).
    33: {
        FULL_PCPUS: GA,
        ACROSS_NUMA: BETA,
        BY_SOCKET: ALPHA,
        ACROSS_CORES: ALPHA,
        STRICT_RESERVATION: BETA,
        UNCORECACHE: ALPHA,
    },
    # 1.34: prefer-align-cpus-by-uncorecache beta (KEP-4800); policy_options.go at kubernetes commit
    # 7ed318129ff5 lists alpha {align-by-socket, distribute-cpus-across-cores}, beta
    # {strict-cpu-reservation, distribute-cpus-across-numa, prefer-align-cpus-by-uncorecache}, stable
    # {full-pcpus-only}.
    34: {
        FULL_PCPUS: GA,
        ACROSS_NUMA: BETA,
        BY_SOCKET: ALPHA,
        ACROSS_CORES: ALPHA,
        STRICT_RESERVATION: BETA,
        UNCORECACHE: BETA,
    },
    # 1.35: strict-cpu-reservation GA (kubernetes#134388, website#52752).
    35: {
        FULL_PCPUS: GA,
        ACROSS_NUMA: BETA,
        BY_SOCKET: ALPHA,
        ACROSS_CORES: ALPHA,
        STRICT_RESERVATION: GA,
        UNCORECACHE: BETA,
    },
}
MIN_MINOR, MAX_MINOR = min(OPTIONS_BY_MINOR), max(OPTIONS_BY_MINOR)

# Pairs NewStaticPolicyOptions refuses when both are true, from the release that added the check
# (each check came with the later option of the pair).
FORBIDDEN_PAIRS: tuple[tuple[int, str, str], ...] = (
    # KEP-4176 (1.31; website#47014/#48356: "cannot be used with full-pcpus-only or
    # distribute-cpus-across-numa"), the message is "can not be used at the same time".
    (31, FULL_PCPUS, ACROSS_CORES),
    (31, ACROSS_NUMA, ACROSS_CORES),
    # KEP-4800 (1.32), checked in NewStaticPolicyOptions next to the KEP-4176 pairs.
    (32, UNCORECACHE, ACROSS_CORES),
    (32, UNCORECACHE, ACROSS_NUMA),
)

# The resource managers' feature gates: (first minor, default, locked) stages and the first minor without
# the gate, from kubernetes pkg/features/kube_features.go (the versioned specs at the 1.32 and 1.33 release
# trees). component-base featuregate refuses a locked gate set to the other value ("cannot set feature
# gate X to false, feature is locked to true") and a gate the binary does not have ("unrecognized
# feature gate"); kubelet then does not start.
GATES: dict[str, tuple[tuple[tuple[int, bool, bool], ...], int | None]] = {
    # GA and locked in 1.26 ("GA in 1.26"); present at 1.32, gone from the 1.33 tree.
    "CPUManager": (((26, True, True),), 33),
    # beta 1.23, GA and locked in 1.33 ("remove in 1.36").
    "CPUManagerPolicyOptions": (((23, True, False), (33, True, True)), None),
    ALPHA_GATE: (((23, False, False),), None),
    BETA_GATE: (((23, True, False),), None),
    # beta 1.22, GA and locked in 1.32. Off on 1.31, memoryManagerPolicy Static is ignored without an error.
    "MemoryManager": (((22, True, False), (32, True, True)), None),
    # GA and locked in 1.27 ("GA in 1.27; remove in 1.29"); gone from the 1.33 tree.
    "TopologyManager": (((27, True, True),), 33),
    # beta and on from 1.28, GA in 1.32 (not locked at 1.33).
    "TopologyManagerPolicyOptions": (((28, True, False),), None),
    "TopologyManagerPolicyBetaOptions": (((28, True, False),), None),
    "TopologyManagerPolicyAlphaOptions": (((26, False, False),), None),
}

# topologyManagerPolicyOptions per minor (topologymanager/policy_options.go, CheckPolicyOptionAvailable: the
# same alpha/beta/stable sets and gates as the CPU manager's, with the TopologyManagerPolicy*Options gates).
PREFER_CLOSEST = "prefer-closest-numa-nodes"
MAX_NUMA = "max-allowable-numa-nodes"
TOPOLOGY_ALPHA_GATE = "TopologyManagerPolicyAlphaOptions"
TOPOLOGY_BETA_GATE = "TopologyManagerPolicyBetaOptions"
_TOPOLOGY_GATE_OF: dict[str, tuple[str, bool] | None] = {
    ALPHA: (TOPOLOGY_ALPHA_GATE, False),
    BETA: (TOPOLOGY_BETA_GATE, True),
    GA: None,
}
TOPOLOGY_OPTIONS_BY_MINOR: dict[int, dict[str, str]] = {
    # KEP-3545: prefer-closest-numa-nodes beta from 1.28 (listed in betaOptions through the 1.33 tree;
    # a GA move would only lift the beta gate, which is on by default).
    **{m: {PREFER_CLOSEST: BETA} for m in range(28, 31)},
    # KEP-4622 (kep.yaml milestone beta v1.31, stable v1.35; kubernetes#124148 in the 1.31 changelog):
    # max-allowable-numa-nodes, an integer of at least 8.
    **{m: {PREFER_CLOSEST: BETA, MAX_NUMA: BETA} for m in range(31, 35)},
    35: {PREFER_CLOSEST: BETA, MAX_NUMA: GA},
}
# topologymanager defaultMaxAllowableNUMANodes: NewManager refuses a machine with more NUMA nodes
# ("unsupported on machines with more than 8 NUMA Nodes") unless max-allowable-numa-nodes raises it.
DEFAULT_MAX_NUMA_NODES = 8

# Options lowtail asks for when the inventory does not choose: each only where this kubelet has it at
# beta or GA, so the default never turns on an alpha gate.
RECOMMENDED: tuple[str, ...] = (FULL_PCPUS, STRICT_RESERVATION, UNCORECACHE)

# Hard-eviction defaults of a Linux kubelet (kubernetes pkg/kubelet/eviction/defaults_linux.go,
# DefaultEvictionHard). Setting any evictionHard signal makes the unset ones 0 (v1beta1 types.go,
# "mergeDefaultEvictionSettings" is off by default), so lowtail writes these along with its own.
DEFAULT_EVICTION_HARD: dict[str, str] = {
    "memory.available": "100Mi",
    "nodefs.available": "10%",
    "nodefs.inodesFree": "5%",
    "imagefs.available": "15%",
    "imagefs.inodesFree": "5%",
}

# KEP-3983 kubelet --config-dir drop-ins: alpha in 1.28 (KubeletConfigDropInDir gate), beta and on by
# default from 1.30; lowtail writes a drop-in only where no gate is needed.
CONFIG_DIR_MIN_MINOR = 30

# Go strconv.ParseBool's accepted spellings.
_GO_BOOLS = {"1": True, "t": True, "T": True, "TRUE": True, "true": True, "True": True}
_GO_BOOLS.update({"0": False, "f": False, "F": False, "FALSE": False, "false": False, "False": False})

_VERSION = re.compile(r"v?(\d+)\.(\d+)\.(\d+)")


class KubeletVersionError(LowtailError, ValueError):
    """A kubelet version lowtail cannot read or has no table row for."""


@dataclass(frozen=True)
class PolicyCheck:
    """What a kubelet of one version would make of a set of options and gates. ``topology_options`` are
    the topologyManagerPolicyOptions lowtail writes (max-allowable-numa-nodes on more than 8 NUMA nodes)."""

    minor: int
    problems: list[str] = field(default_factory=list)
    options: dict[str, str] = field(default_factory=dict)
    gates: dict[str, bool] = field(default_factory=dict)
    topology_options: dict[str, str] = field(default_factory=dict)


def parse_version(text: str) -> tuple[int, int, int]:
    """``Kubernetes v1.31.4`` (kubelet --version) or ``v1.31.4`` -> (1, 31, 4)."""
    m = _VERSION.search(str(text))
    if not m:
        raise KubeletVersionError(
            f"kubelet version {text!r} is not readable; expected e.g. 'Kubernetes v1.31.4'"
        )
    return int(m[1]), int(m[2]), int(m[3])


def supported_minor(text: str) -> int:
    """The minor version of a kubelet lowtail has a table row for, or an error naming the range."""
    major, minor, _ = parse_version(text)
    if major != 1 or minor not in OPTIONS_BY_MINOR:
        raise KubeletVersionError(
            f"kubelet {text.strip()} is not supported; lowtail knows the CPU manager options of "
            f"1.{MIN_MINOR} to 1.{MAX_MINOR}"
        )
    return minor


def go_bool(value: object) -> bool | None:
    """Go's strconv.ParseBool on a string; None when Go would refuse it (YAML booleans included:
    kubelet's cpuManagerPolicyOptions is a map of strings)."""
    return _GO_BOOLS.get(value) if isinstance(value, str) else None


def check(
    version: str,
    options: Mapping[str, object],
    gates: Mapping[str, object] | None = None,
    topology_policy: str = "none",
) -> PolicyCheck:
    """Every reason kubelet ``version`` would refuse to start with these cpuManagerPolicyOptions,
    featureGates and topologyManagerPolicy (empty ``problems``: it starts)."""
    minor = supported_minor(version)
    gates = dict(gates or {})
    known = OPTIONS_BY_MINOR[minor]
    problems: list[str] = []
    on: set[str] = set()
    for name, value in options.items():
        maturity = known.get(name)
        if maturity is None:
            problems.append(f"unknown CPU Manager Policy option {name!r} for kubelet 1.{minor}")
            continue
        gate = GATE_OF[maturity]
        if gate and not gates.get(gate[0], gate[1]):
            problems.append(
                f"option {name!r} is {maturity} in kubelet 1.{minor} and needs featureGates.{gate[0]}: true"
            )
        parsed = go_bool(value)
        if parsed is None:
            problems.append(f"option {name!r} has value {value!r}; expected the string 'true' or 'false'")
        elif parsed:
            on.add(name)
    for since, a, b in FORBIDDEN_PAIRS:
        if minor >= since and a in on and b in on:
            problems.append(f"options {a!r} and {b!r} can not be used at the same time (kubelet 1.{minor})")
    if BY_SOCKET in on and topology_policy == "single-numa-node":
        problems.append(f"option {BY_SOCKET!r} is incompatible with topologyManagerPolicy single-numa-node")
    return PolicyCheck(
        minor,
        problems,
        {k: str(v) for k, v in options.items()},
        {k: v for k, v in gates.items() if isinstance(v, bool)},
    )


def choose_options(
    version: str,
    wanted: Mapping[str, object] | None,
    gates: Mapping[str, object] | None = None,
    topology_policy: str = "none",
    numa_nodes: int = 0,
) -> PolicyCheck:
    """The options and gates lowtail writes for this kubelet.

    ``wanted`` None means lowtail's recommendation: each of RECOMMENDED that this kubelet has at beta or
    GA. An explicit map is taken as asked; the alpha gate is added when an asked option needs it (unless
    the inventory set that gate to false, which is then a problem), and every refusal is reported.
    A host with more than 8 NUMA nodes gets ``max-allowable-numa-nodes`` where this kubelet has it.
    """
    minor = supported_minor(version)
    known = OPTIONS_BY_MINOR[minor]
    merged: dict[str, object] = dict(gates or {})
    if wanted is None:
        options: dict[str, object] = {o: "true" for o in RECOMMENDED if known.get(o) in (BETA, GA)}
    else:
        options = dict(wanted)
        if any(known.get(o) == ALPHA and go_bool(v) is not None for o, v in options.items()):
            merged.setdefault(ALPHA_GATE, True)
    result = check(version, options, merged, topology_policy)
    only_set = {k: v for k, v in merged.items() if isinstance(v, bool)}
    # Where this kubelet lacks the option, check_config refuses the host naming its NUMA-node count.
    topology_options: dict[str, str] = {}
    if (
        numa_nodes > DEFAULT_MAX_NUMA_NODES
        and topology_policy != "none"
        and MAX_NUMA in TOPOLOGY_OPTIONS_BY_MINOR.get(minor, {})
    ):
        topology_options[MAX_NUMA] = str(numa_nodes)
    return PolicyCheck(
        minor, result.problems, {k: str(v) for k, v in options.items()}, only_set, topology_options
    )


def gate_value(minor: int, name: str, gates: Mapping[str, object]) -> bool:
    """The value a resource-manager gate has on kubelet 1.minor with these featureGates set (a locked
    gate keeps its value: setting it otherwise is refused by _gate_problems)."""
    stages, _ = GATES[name]
    default, locked = False, False
    for since, stage_default, stage_locked in stages:
        if minor >= since:
            default, locked = stage_default, stage_locked
    value = gates.get(name)
    return value if isinstance(value, bool) and not locked else default


def _gate_problems(minor: int, gates: Mapping[str, object]) -> tuple[list[str], list[str]]:
    """(problems, warnings) for featureGates on kubelet 1.minor: values that are not booleans, gates
    the binary no longer has, locked gates set against their lock; gates outside GATES are warnings."""
    problems, warnings = [], []
    for name, value in gates.items():
        if not isinstance(value, bool):
            problems.append(
                f"featureGates.{name} is {value!r}; expected true or false (kubelet's featureGates is a "
                "map of booleans and does not start with another value)"
            )
            continue
        if name not in GATES:
            warnings.append(
                f"featureGates.{name}: lowtail's table does not know this gate, so it cannot tell whether "
                f"kubelet 1.{minor} has it (kubelet refuses an unrecognized feature gate)"
            )
            continue
        stages, removed = GATES[name]
        if removed is not None and minor >= removed:
            problems.append(f"unrecognized feature gate: {name} (kubelet 1.{minor} no longer has it)")
            continue
        current = [s for s in stages if minor >= s[0]]
        if not current:
            problems.append(f"unrecognized feature gate: {name} (kubelet 1.{minor} does not have it yet)")
        elif current[-1][2] and value != current[-1][1]:
            problems.append(
                f"cannot set feature gate {name} to {str(value).lower()}, feature is locked to "
                f"{str(current[-1][1]).lower()} (kubelet 1.{minor})"
            )
    return problems, warnings


def _mapping(cfg: Mapping[str, object], key: str, problems: list[str]) -> dict[str, object]:
    value = cfg.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        problems.append(f"{key} is {value!r}; expected a map")
        return {}
    return {str(k): v for k, v in value.items()}


@dataclass(frozen=True)
class ConfigCheck:
    """Every reason kubelet would refuse a whole configuration, and what it would silently ignore."""

    minor: int
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def check_config(version: str, cfg: Mapping[str, object], numa_nodes: int = 0) -> ConfigCheck:
    """Check a whole KubeletConfiguration, as kubelet ``version`` would read it, on a host with
    ``numa_nodes`` NUMA nodes (0: unknown, the NUMA limit is not checked)."""
    minor = supported_minor(version)
    problems: list[str] = []
    gates = _mapping(cfg, "featureGates", problems)
    gate_problems, warnings = _gate_problems(minor, gates)
    problems += gate_problems
    bool_gates = {k: v for k, v in gates.items() if isinstance(v, bool)}
    cpu_policy = str(cfg.get("cpuManagerPolicy", "none"))
    topology_policy = str(cfg.get("topologyManagerPolicy", "none"))
    options = _mapping(cfg, "cpuManagerPolicyOptions", problems)
    if options and not gate_value(minor, "CPUManagerPolicyOptions", bool_gates):
        # cmd/kubelet/app/server.go: options with the gate off are an error, not ignored.
        problems.append(
            f"CPU Manager policy options {sorted(options)} require feature gate CPUManagerPolicyOptions, "
            "which featureGates turns off"
        )
    if options and cpu_policy == "none":
        # policy_none.go: the none policy refuses any option.
        problems.append(f"None policy: received unsupported options {sorted(options)}")
    # Checked with the effective values of the two option gates, defaults included.
    effective = {g: gate_value(minor, g, bool_gates) for g in (ALPHA_GATE, BETA_GATE)}
    problems += check(version, options, effective, topology_policy).problems
    if str(cfg.get("memoryManagerPolicy", "None")) == "Static" and not gate_value(
        minor, "MemoryManager", bool_gates
    ):
        problems.append(
            "featureGates.MemoryManager: false turns the memory manager off, so memoryManagerPolicy Static "
            f"would be ignored on kubelet 1.{minor} (no NUMA-aligned memory); remove the gate"
        )
    problems += _topology_problems(minor, cfg, bool_gates, topology_policy, numa_nodes)
    return ConfigCheck(minor, problems, warnings)


def _topology_problems(
    minor: int,
    cfg: Mapping[str, object],
    gates: Mapping[str, bool],
    topology_policy: str,
    numa_nodes: int,
) -> list[str]:
    problems: list[str] = []
    options = _mapping(cfg, "topologyManagerPolicyOptions", problems)
    if options and not gate_value(minor, "TopologyManagerPolicyOptions", gates):
        problems.append(
            f"Topology Manager policy options {sorted(options)} require feature gate "
            "TopologyManagerPolicyOptions, which featureGates turns off"
        )
    known = TOPOLOGY_OPTIONS_BY_MINOR.get(minor, {})
    limit = DEFAULT_MAX_NUMA_NODES
    for name, value in options.items():
        maturity = known.get(name)
        if maturity is None:
            problems.append(f"unknown Topology Manager Policy option {name!r} for kubelet 1.{minor}")
            continue
        gate = _TOPOLOGY_GATE_OF[maturity]
        if gate and not gates.get(gate[0], gate[1]):
            problems.append(
                f"Topology Manager Policy option {name!r} is {maturity} in kubelet 1.{minor} and needs "
                f"featureGates.{gate[0]}: true"
            )
        if name == MAX_NUMA:
            text = str(value) if isinstance(value, str) else ""
            if not re.fullmatch(r"[+-]?[0-9]+", text) or int(text) < DEFAULT_MAX_NUMA_NODES:
                problems.append(
                    f"topologyManagerPolicyOptions {MAX_NUMA} is {value!r}; expected a string holding an "
                    f"integer of at least {DEFAULT_MAX_NUMA_NODES}"
                )
            else:
                limit = int(text)
        elif go_bool(value) is None:
            problems.append(
                f"topologyManagerPolicyOptions {name} is {value!r}; expected the string 'true' or 'false'"
            )
    if topology_policy != "none" and numa_nodes > limit:
        problems.append(
            f"the topology manager ({topology_policy}) is unsupported on machines with more than {limit} "
            f"NUMA nodes and this host has {numa_nodes}; topologyManagerPolicyOptions {MAX_NUMA} of at "
            f"least {numa_nodes} needs kubelet 1.31 or later (or fewer NUMA nodes: the BIOS NPS and "
            "L3-as-NUMA settings)"
        )
    return problems


def merge_dropin(base: Mapping[str, object], over: Mapping[str, object]) -> dict[str, object]:
    """A --config-dir drop-in over the configuration as kubelet merges it (kubernetes.io "Kubelet
    Configuration Directory Merging"): structures and maps field by field, lists and scalars replaced."""
    out = dict(base)
    for key, value in over.items():
        old = out.get(key)
        out[key] = (
            merge_dropin(old, value) if isinstance(value, Mapping) and isinstance(old, Mapping) else value
        )
    return out


def eviction_hard(existing: Mapping[str, object] | None, memory_available: str) -> dict[str, str]:
    """evictionHard with kubelet's defaults for the signals the file leaves unset, the file's own
    values kept, and lowtail's memory.available (it balances reservedMemory)."""
    merged = {**DEFAULT_EVICTION_HARD, **{str(k): str(v) for k, v in (existing or {}).items()}}
    merged["memory.available"] = memory_available
    return merged
