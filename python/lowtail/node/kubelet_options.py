"""What each kubelet minor lowtail claims accepts at start-up, read from that release's own code.

This is the one table lowtail's preflight (through the ``lowtail_kubelet_*`` filters) and the kubelet
role read, so "what kubelet X.Y refuses" is written once. Every row names the k8s.io/kubernetes module
version and the file it was read from (``go mod download k8s.io/kubernetes@vX.Y.Z``). lowtail claims
exactly the minors in ``OPTIONS_BY_MINOR``: tests/kubelet runs each one's own start-up code (the
oracle, one build per minor) over a generated corpus and fails on any case where ``check_files`` and
that kubelet disagree. The rules:

* ``pkg/kubelet/cm/cpumanager/policy_options.go``: ``CheckPolicyOptionAvailable`` refuses an option
  in none of the alpha/beta/stable sets ("unknown CPU Manager Policy option"), an alpha one without the
  ``CPUManagerPolicyAlphaOptions`` gate (off by default) and a beta one without
  ``CPUManagerPolicyBetaOptions`` (on by default); ``NewStaticPolicyOptions`` parses every value with
  Go's ``strconv.ParseBool`` and refuses four pairs; ``ValidateStaticPolicyOptions`` refuses
  ``align-by-socket`` with the ``single-numa-node`` topology policy or on more sockets than NUMA nodes.
* ``pkg/kubelet/cm/topologymanager/policy_options.go`` and ``topology_manager.go``: the same for the
  topology manager's options, and more than ``max-allowable-numa-nodes`` (8) NUMA nodes refused.
* ``pkg/kubelet/apis/config/validation``: the topology policy and scope, reservedSystemCPUs,
  reservedMemory, and ``failCgroupV1`` (default true) on a cgroup v1 host.
* ``pkg/kubelet/cm/memorymanager/memory_manager.go``: with the Static policy, reservedMemory must sum to
  kubeReserved + systemReserved + evictionHard memory exactly.
* feature gates: ``kubelet_gates`` (generated from each release): a gate the release does not register
  and a locked gate set to the other value are refused.

Stdlib only and no imports outside this package: Ansible ships it to hosts as module_utils.
"""

from __future__ import annotations

import math
import re
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from fractions import Fraction

from .errors import LowtailError
from .kubelet_gates import DEPENDS as GATE_DEPENDS
from .kubelet_gates import GATES as RELEASE_GATES
from .kubelet_gates import SOURCES as GATE_SOURCES
from .kubelet_memory import QUANTITY_FORMS, QuantityError, k8s_quantity, k8s_quantity_is_int64

ALPHA, BETA, GA = "alpha", "beta", "GA"
ALPHA_GATE = "CPUManagerPolicyAlphaOptions"
BETA_GATE = "CPUManagerPolicyBetaOptions"
# The gate each maturity needs and the gate's default (pkg/features/kube_features.go, the same at
# every claimed release).
GATE_OF: dict[str, tuple[str, bool] | None] = {ALPHA: (ALPHA_GATE, False), BETA: (BETA_GATE, True), GA: None}

FULL_PCPUS = "full-pcpus-only"
ACROSS_NUMA = "distribute-cpus-across-numa"
BY_SOCKET = "align-by-socket"
ACROSS_CORES = "distribute-cpus-across-cores"
STRICT_RESERVATION = "strict-cpu-reservation"
UNCORECACHE = "prefer-align-cpus-by-uncorecache"

# The module each claimed minor's rows were read from (the newest patch release the Go module proxy
# served when they were read) and upstream's support of it at that time (kubernetes.io releases page:
# the three newest minors are maintained).
SOURCE: dict[int, str] = {35: "v1.35.4", 36: "v1.36.3", 37: "v1.37.2"}
UPSTREAM_SUPPORT: dict[int, str] = {
    35: "maintained (the oldest minor upstream still patches)",
    36: "maintained",
    37: "maintained (newest)",
}

# Options and their maturity per minor: the alphaOptions, betaOptions and stableOptions sets of
# pkg/kubelet/cm/cpumanager/policy_options.go at k8s.io/kubernetes@SOURCE[minor].
OPTIONS_BY_MINOR: dict[int, dict[str, str]] = {
    # v1.35.4: alpha {align-by-socket, distribute-cpus-across-cores}, beta {distribute-cpus-across-numa,
    # prefer-align-cpus-by-uncorecache}, stable {full-pcpus-only, strict-cpu-reservation}.
    35: {
        FULL_PCPUS: GA,
        ACROSS_NUMA: BETA,
        BY_SOCKET: ALPHA,
        ACROSS_CORES: ALPHA,
        STRICT_RESERVATION: GA,
        UNCORECACHE: BETA,
    },
    # v1.36.3 and v1.37.2: prefer-align-cpus-by-uncorecache moved to stable, the rest as in 1.35.
    **{
        m: {
            FULL_PCPUS: GA,
            ACROSS_NUMA: BETA,
            BY_SOCKET: ALPHA,
            ACROSS_CORES: ALPHA,
            STRICT_RESERVATION: GA,
            UNCORECACHE: GA,
        }
        for m in (36, 37)
    },
}
MIN_MINOR, MAX_MINOR = min(OPTIONS_BY_MINOR), max(OPTIONS_BY_MINOR)

# Pairs NewStaticPolicyOptions refuses when both are true ("static policy options A and B can not be
# used at the same time"), the same four at every claimed release.
FORBIDDEN_PAIRS: tuple[tuple[str, str], ...] = (
    (FULL_PCPUS, ACROSS_CORES),
    (ACROSS_NUMA, ACROSS_CORES),
    (UNCORECACHE, ACROSS_CORES),
    (UNCORECACHE, ACROSS_NUMA),
)

# topologyManagerPolicyOptions per minor (topologymanager/policy_options.go: both options in
# stableOptions at v1.35.4, v1.36.3 and v1.37.2).
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
    m: {PREFER_CLOSEST: GA, MAX_NUMA: GA} for m in (35, 36, 37)
}
# topology_manager.go defaultMaxAllowableNUMANodes: NewManager refuses a machine with more NUMA nodes
# ("unsupported on machines with more than 8 NUMA Nodes") unless max-allowable-numa-nodes raises it.
DEFAULT_MAX_NUMA_NODES = 8
# pkg/kubelet/apis/config/validation/validation.go: the policies and scopes it accepts.
TOPOLOGY_POLICIES = ("none", "best-effort", "restricted", "single-numa-node")
TOPOLOGY_SCOPES = ("container", "pod")
# cpumanager.NewManager and memorymanager.NewManager: the policies they know on Linux.
CPU_POLICIES = ("none", "static")
MEMORY_POLICIES = ("None", "Static")

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

# KEP-3983 kubelet --config-dir drop-ins: beta and on by default from 1.30 (every claimed minor);
# lowtail writes a drop-in only where no gate is needed.
CONFIG_DIR_MIN_MINOR = 30

# Go strconv.ParseBool's accepted spellings.
_GO_BOOLS = {"1": True, "t": True, "T": True, "TRUE": True, "true": True, "True": True}
_GO_BOOLS.update({"0": False, "f": False, "F": False, "FALSE": False, "false": False, "False": False})

_VERSION = re.compile(r"v?(\d+)\.(\d+)\.(\d+)")


class KubeletVersionError(LowtailError, ValueError):
    """A kubelet version lowtail cannot read or does not claim."""


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
    """``Kubernetes v1.36.3`` (kubelet --version) or ``v1.36.3`` -> (1, 36, 3)."""
    m = _VERSION.search(str(text))
    if not m:
        raise KubeletVersionError(
            f"kubelet version {text!r} is not readable; expected e.g. 'Kubernetes v1.36.3'"
        )
    return int(m[1]), int(m[2]), int(m[3])


def claimed_range() -> str:
    return f"1.{MIN_MINOR} to 1.{MAX_MINOR}"


def supported_minor(text: str) -> int:
    """The minor version of a kubelet lowtail claims, or an error naming the version and the range."""
    major, minor, _ = parse_version(text)
    if major != 1 or minor not in OPTIONS_BY_MINOR:
        raise KubeletVersionError(
            f"kubelet {str(text).strip()} is not supported; lowtail claims kubelet {claimed_range()}, the "
            "minors whose own start-up code it is tested against"
        )
    return minor


def go_bool(value: object) -> bool | None:
    """Go's strconv.ParseBool on a string; None when Go would refuse it (YAML booleans included:
    kubelet's cpuManagerPolicyOptions is a map of strings)."""
    return _GO_BOOLS.get(value) if isinstance(value, str) else None


def _go_atoi(text: str) -> int | None:
    """Go's strconv.Atoi: an optional sign and decimal digits, nothing else."""
    return int(text) if re.fullmatch(r"[+-]?[0-9]+", text) else None


def go_cpuset(text: str) -> set[int] | None:
    """k8s.io/utils/cpuset.Parse: comma-separated CPUs and inclusive ranges, no spaces; None when it
    refuses the text."""
    if text == "":
        return set()
    cpus: set[int] = set()
    for part in text.split(","):
        bounds = part.split("-", 1)
        numbers = [_go_atoi(b) for b in bounds]
        if any(n is None for n in numbers):
            return None
        if len(numbers) == 1:
            cpus.add(numbers[0])  # type: ignore[arg-type]
            continue
        start, end = numbers
        assert start is not None and end is not None
        if start > end:
            return None
        cpus.update(range(start, end + 1))
    return cpus


def check(
    version: str,
    options: Mapping[str, object],
    gates: Mapping[str, object] | None = None,
    topology_policy: str = "none",
) -> PolicyCheck:
    """Every reason kubelet ``version`` would refuse these cpuManagerPolicyOptions with these option
    gates and topologyManagerPolicy (empty ``problems``: NewStaticPolicyOptions accepts them)."""
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
    for a, b in FORBIDDEN_PAIRS:
        if a in on and b in on:
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
    A host with more than 8 NUMA nodes gets ``max-allowable-numa-nodes``.
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
    """The value a gate has on kubelet 1.minor with these featureGates set (a locked gate keeps its
    value: setting it otherwise is refused by _gate_problems; a gate the release lacks is off)."""
    spec = RELEASE_GATES.get(name, {}).get(minor)
    if spec is None:
        return False
    default, locked = spec
    value = gates.get(name)
    return value if isinstance(value, bool) and not locked else default


def _gate_problems(minor: int, gates: Mapping[str, object]) -> list[str]:
    """Problems for featureGates on kubelet 1.minor: values that are not booleans, gates the release
    does not register, locked gates set against their lock (component-base featuregate SetFromMap)."""
    problems = []
    for name, value in gates.items():
        if not isinstance(value, bool):
            problems.append(
                f"featureGates.{name} is {value!r}; expected true or false (kubelet's featureGates is a "
                "map of booleans and does not start with another value)"
            )
            continue
        spec = RELEASE_GATES.get(name, {}).get(minor)
        if spec is None:
            others = sorted(m for m in RELEASE_GATES.get(name, {}))
            where = f"; the claimed minors with it: {', '.join(f'1.{m}' for m in others)}" if others else ""
            problems.append(
                f"unrecognized feature gate: {name} (kubelet 1.{minor}, k8s.io/kubernetes@"
                f"{GATE_SOURCES[minor]}, does not have it{where})"
            )
        elif spec[1] and value != spec[0]:
            problems.append(
                f"cannot set feature gate {name} to {str(value).lower()}, feature is locked to "
                f"{str(spec[0]).lower()} (kubelet 1.{minor})"
            )
    if problems:
        return problems
    bool_gates = {k: v for k, v in gates.items() if isinstance(v, bool)}
    for name, per in sorted(GATE_DEPENDS.items()):
        deps = per.get(minor, ())
        if deps and gate_value(minor, name, bool_gates):
            off = [d for d in deps if not gate_value(minor, d, bool_gates)]
            if off:
                problems.append(
                    f"{name} is enabled, but depends on features that are disabled: {off} "
                    f"(kubelet 1.{minor}; set {', '.join(off)} back on or {name} off)"
                )
    return problems


@dataclass(frozen=True)
class ConfigCheck:
    """Every reason kubelet would refuse a whole configuration, and what lowtail warns about."""

    minor: int
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


# The fields lowtail reads and the JSON type kubelet's decoder needs for each (k8s.io/kubelet/config/
# v1beta1 types.go): a value of another type fails decoding, strict or lenient.
_STRING_MAPS = (
    "cpuManagerPolicyOptions",
    "topologyManagerPolicyOptions",
    "kubeReserved",
    "systemReserved",
    "evictionHard",
)
_STRINGS = (
    "cpuManagerPolicy",
    "topologyManagerPolicy",
    "topologyManagerScope",
    "memoryManagerPolicy",
    "reservedSystemCPUs",
)
# cmd/kubelet/app parseResourceList: the resources kubeReserved and systemReserved may name.
_RESERVABLE = ("cpu", "memory", "ephemeral-storage", "pid")
# The signals eviction.ParseThresholdConfig accepts (pkg/kubelet/eviction/api/types.go and helpers.go
# signalToResource, the same in 1.35.4, 1.36.3 and 1.37.2).
EVICTION_SIGNALS = frozenset(
    {
        "memory.available",
        "allocatableMemory.available",
        "nodefs.available",
        "nodefs.inodesFree",
        "imagefs.available",
        "imagefs.inodesFree",
        "containerfs.available",
        "containerfs.inodesFree",
        "pid.available",
    }
)


def _decode_problems(cfg: Mapping[str, object]) -> list[str]:
    problems = []
    for key in _STRINGS:
        if key in cfg and cfg[key] is not None and not isinstance(cfg[key], str):
            problems.append(f"{key} is {cfg[key]!r}; expected a string (kubelet fails to decode the file)")
    for key in _STRING_MAPS:
        value = cfg.get(key)
        if value is None:
            continue
        if not isinstance(value, Mapping):
            problems.append(f"{key} is {value!r}; expected a map (kubelet fails to decode the file)")
            continue
        for k, v in value.items():
            if not isinstance(v, str):
                problems.append(
                    f"{key}.{k} is {v!r}; expected a string such as 'true' or '1Gi' (kubelet fails to decode "
                    "the file: YAML true and numbers are not strings)"
                )
    gates = cfg.get("featureGates")
    if gates is not None and not isinstance(gates, Mapping):
        problems.append(f"featureGates is {gates!r}; expected a map")
    fail = cfg.get("failCgroupV1")
    if fail is not None and not isinstance(fail, bool):
        problems.append(
            f"failCgroupV1 is {fail!r}; expected true or false (kubelet fails to decode the file)"
        )
    return problems


def _map(cfg: Mapping[str, object], key: str) -> dict[str, object]:
    value = cfg.get(key)
    return {str(k): v for k, v in value.items()} if isinstance(value, Mapping) else {}


def _str(cfg: Mapping[str, object], key: str, default: str) -> str:
    value = cfg.get(key)
    return value if isinstance(value, str) and value != "" else default


def _cpu_millis(value: Fraction) -> int:
    """parseResourceList's CPU: q.SetMilli((q.ScaledValue(resource.Micro) + 500) / 1000)."""
    micro = -((-value * 10**6) // 1)  # ScaledValue rounds up
    return int((micro + 500) // 1000)


def _reserved_problems(
    cfg: Mapping[str, object], reserved_cpus: int, problems: list[str]
) -> dict[str, Fraction]:
    """kubeReserved and systemReserved as cmd/kubelet/app parseResourceList reads them, and the
    memory (bytes, exact) and CPU (millis) they reserve together. With ``reserved_cpus`` CPUs in
    reservedSystemCPUs kubelet first drops kubeReserved's cpu and sets systemReserved's to that count
    (cmd/kubelet/app/server.go run), so neither CPU value is ever parsed. Problems go to ``problems``."""
    total = {"cpu": Fraction(reserved_cpus * 1000), "memory": Fraction(0)}
    for key in ("kubeReserved", "systemReserved"):
        for name, value in _map(cfg, key).items():
            if name == "cpu" and reserved_cpus:
                continue
            if not isinstance(value, str):
                continue  # a decode problem already
            if name not in _RESERVABLE:
                problems.append(f'{key}: cannot reserve "{name}" resource')
                continue
            try:
                q = k8s_quantity(value)
            except QuantityError:
                problems.append(f"{key}.{name} is {value!r}; expected {QUANTITY_FORMS}")
                continue
            if q < 0:
                problems.append(f'{key}: resource quantity for "{name}" cannot be negative: {value}')
            elif name == "cpu":
                total["cpu"] += _cpu_millis(q)
            elif name == "memory":
                total["memory"] += q
    return total


def _json_number(value: float) -> str:
    """How Go's encoding/json writes a YAML float on its way to Quantity: without an exponent between
    1e-6 and 1e21 (2252341248.0 is '2252341248'), else with a short one ('1e-7', '1e+21')."""
    if value != 0 and not 1e-6 <= abs(value) < 1e21:
        mantissa, _, exponent = repr(value).partition("e")
        return f"{mantissa}e{exponent[0]}{exponent[1:].lstrip('0')}"
    return format(Decimal(repr(value)).normalize(), "f")


def go_float32(text: str) -> float | None:
    """float32(strconv.ParseFloat(text, 32)): decimal or hexadecimal, inf and nan; None when Go refuses."""
    body = text[1:] if text[:1] in ("+", "-") else text
    if body.lower() in ("inf", "infinity", "nan"):
        value = float(text)
    elif re.fullmatch(r"(?:{d}\.?(?:{d})?|\.{d})(?:[eE][+-]?{d})?".format(d="[0-9](?:_?[0-9])*"), body):
        value = float(text)  # Python's float takes underscores between digits, as Go's ParseFloat does
    elif re.fullmatch(r"0[xX](?:[0-9a-fA-F]+\.?[0-9a-fA-F]*|\.[0-9a-fA-F]+)[pP][+-]?[0-9]+", body):
        value = float.fromhex(text)
    else:
        return None
    try:
        return float(struct.unpack("f", struct.pack("f", value))[0])
    except OverflowError:
        return None  # out of float32's range: Go's ParseFloat reports ErrRange


def _eviction_memory(cfg: Mapping[str, object], problems: list[str], memory_bytes: int | None) -> Fraction:
    """What evictionHard reserves of memory, its statements parsed as eviction.ParseThresholdConfig
    parses them (pkg/kubelet/eviction/helpers.go parseThresholdStatement): kubelet's Linux default 100Mi
    when the file sets no evictionHard, 0 when it sets evictionHard without memory.available; a
    percentage is of the machine's memory, as GetThresholdQuantity takes it ("0%" and "100%" are
    ignored); ``memory_bytes`` None: the machine's memory is unknown."""
    if "evictionHard" not in cfg or cfg.get("evictionHard") is None:
        return Fraction(100 * 2**20)
    reserved = Fraction(0)
    for signal, value in _map(cfg, "evictionHard").items():
        if not isinstance(value, str):
            continue  # a decode problem already
        if signal not in EVICTION_SIGNALS:
            problems.append(f"evictionHard: unsupported eviction signal {signal}")
            continue
        if value.endswith("%"):
            if value in ("0%", "100%"):
                continue
            fraction = go_float32(value.rstrip("%"))
            if fraction is None:
                problems.append(f"evictionHard {signal} is {value!r}; expected a percentage such as '10%'")
                continue
            fraction = float(struct.unpack("f", struct.pack("f", fraction / 100))[0])
            if fraction < 0:
                problems.append(f"eviction percentage threshold {signal} must be >= 0%: {value}")
            elif fraction > 1:
                problems.append(f"eviction percentage threshold {signal} must be <= 100%: {value}")
            elif signal == "memory.available":
                if memory_bytes is None:
                    problems.append(
                        f"evictionHard memory.available is {value!r}, a percentage of the machine's memory, "
                        "which lowtail does not know here: give it in bytes (such as '100Mi')"
                    )
                elif not math.isnan(fraction):
                    reserved = Fraction(int(float(memory_bytes) * fraction))
            continue
        try:
            q = k8s_quantity(value)
        except QuantityError:
            problems.append(f"evictionHard {signal} is {value!r}; expected a percentage or {QUANTITY_FORMS}")
            continue
        if q <= 0:
            problems.append(f"eviction threshold {signal} must be positive: {value}")
        elif signal == "memory.available":
            reserved = q
    return reserved


def _reserved_limit(what: str, value: object, problems: list[str]) -> Fraction | None:
    """A reservedMemory limit as Quantity's UnmarshalJSON decodes it (a JSON number or string, spaces
    around it trimmed) and as the memory manager converts it (Quantity.AsInt64); None after a problem."""
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        problems.append(f"{what} is {value!r}; expected {QUANTITY_FORMS}")
        return None
    text = _json_number(value) if isinstance(value, float) else str(value).strip()
    try:
        n = k8s_quantity(text)
    except QuantityError:
        problems.append(f"{what} is {value!r}; expected {QUANTITY_FORMS}")
        return None
    if not k8s_quantity_is_int64(text):
        problems.append(
            f"{what} is {value!r}, which kubelet's memory manager cannot convert to an int64 (it takes a "
            "whole number with at most 18 digits, and no fraction with a binary suffix); write it in bytes "
            "or as such as '1536Mi'"
        )
        return None
    return n


def _memory_problems(
    cfg: Mapping[str, object], numa_nodes: int, reserved: Fraction, eviction: Fraction
) -> list[str]:
    """reservedMemory as validateReservedMemoryConfiguration and, with the Static policy, as
    memorymanager.NewManager check it."""
    problems: list[str] = []
    policy = _str(cfg, "memoryManagerPolicy", "None")
    if policy not in MEMORY_POLICIES:
        problems.append(f"memoryManagerPolicy {policy!r} is unknown; expected one of {list(MEMORY_POLICIES)}")
    raw = cfg.get("reservedMemory") or []
    if not isinstance(raw, Sequence) or isinstance(raw, str):
        return [*problems, f"reservedMemory is {raw!r}; expected a list of {{numaNode, limits}}"]
    seen: set[tuple[int, str]] = set()
    total = Fraction(0)
    for entry in raw:
        node = entry.get("numaNode") if isinstance(entry, Mapping) else None
        limits = entry.get("limits") if isinstance(entry, Mapping) else None
        if not isinstance(node, int) or isinstance(node, bool) or not isinstance(limits, Mapping):
            problems.append(
                f"reservedMemory entry {entry!r}: expected {{numaNode: N, limits: {{memory: Q}}}}"
            )
            continue
        if numa_nodes and not 0 <= node < numa_nodes and policy == "Static":
            problems.append(
                f"the reserved memory configuration references a NUMA node {node} that does not exist on "
                f"this machine ({numa_nodes} NUMA nodes)"
            )
        for name, value in limits.items():
            if name != "memory" and not str(name).startswith("hugepages-"):
                problems.append(
                    f"reservedMemory: the limit type {name!r} for NUMA node {node} is not supported"
                )
                continue
            n = _reserved_limit(f"reservedMemory[{node}].{name}", value, problems)
            if n is None:
                continue
            if n == 0:
                problems.append(f"reserved memory may not be zero for NUMA node {node} and resource {name!r}")
            if (node, str(name)) in seen:
                problems.append(
                    f"the reserved memory has a duplicate value for NUMA node {node} and resource {name!r}"
                )
            seen.add((node, str(name)))
            if name == "memory":
                total += n
    if policy == "Static" and not problems:
        wanted = reserved + eviction
        if total != wanted:
            problems.append(
                f"memoryManagerPolicy Static: reservedMemory sums to {total} bytes but kubeReserved + "
                f"systemReserved + evictionHard memory.available is {wanted} bytes; kubelet requires them "
                "equal"
            )
        elif total == 0:
            problems.append("memoryManagerPolicy Static needs reservedMemory (the system reserved memory)")
    return problems


def check_config(
    version: str,
    cfg: Mapping[str, object],
    numa_nodes: int = 0,
    *,
    sockets: int = 0,
    cpus: set[int] | frozenset[int] | None = None,
    cgroup_version: int | None = None,
    memory_bytes: int | None = None,
) -> ConfigCheck:
    """Every reason kubelet ``version`` would refuse to start with the whole (merged)
    KubeletConfiguration ``cfg`` on a host with ``numa_nodes`` NUMA nodes over ``sockets`` sockets,
    online ``cpus``, cgroup ``cgroup_version`` and ``memory_bytes`` (0 / None: unknown, not checked)."""
    minor = supported_minor(version)
    problems = _decode_problems(cfg)
    warnings: list[str] = []
    gates = _map(cfg, "featureGates")
    problems += _gate_problems(minor, gates)
    bool_gates = {k: v for k, v in gates.items() if isinstance(v, bool)}
    problems += _cgroup_problems(minor, cfg, cgroup_version)
    topology_policy = _str(cfg, "topologyManagerPolicy", "none")
    if topology_policy not in TOPOLOGY_POLICIES:
        problems.append(f"topologyManagerPolicy {topology_policy!r} must be one of {list(TOPOLOGY_POLICIES)}")
    scope = _str(cfg, "topologyManagerScope", "container")
    if scope not in TOPOLOGY_SCOPES:
        problems.append(f"topologyManagerScope {scope!r} must be one of {list(TOPOLOGY_SCOPES)}")
    reserved_cpus = _reserved_cpus(cfg, cpus, problems)
    reserved = _reserved_problems(cfg, len(reserved_cpus), problems)
    reserved_any = bool(reserved_cpus) or reserved["cpu"] != 0 or bool(cfg.get("reservedSystemCPUs"))
    problems += _cpu_policy_problems(
        version,
        minor,
        cfg,
        bool_gates,
        topology_policy=topology_policy,
        reserved_any=reserved_any,
        sockets=sockets,
        numa_nodes=numa_nodes,
    )
    evicted = _eviction_memory(cfg, problems, memory_bytes)  # appends its own problems first
    problems += _memory_problems(cfg, numa_nodes, reserved["memory"], evicted)
    problems += _topology_problems(minor, cfg, bool_gates, topology_policy, numa_nodes)
    return ConfigCheck(minor, problems, warnings)


def _cgroup_problems(minor: int, cfg: Mapping[str, object], cgroup_version: int | None) -> list[str]:
    """The refusal of a kubelet left to fail on a cgroup v1 host (none when the version is unknown)."""
    if cgroup_version == 1 and cfg.get("failCgroupV1", True) is not False:
        return [
            f"kubelet 1.{minor} is configured to not run on a host using cgroup v1 (failCgroupV1 defaults to "
            "true) and this host runs cgroup v1; set failCgroupV1: false (lowtail writes it on cgroup v1 "
            "hosts) or boot the host with the unified hierarchy (systemd.unified_cgroup_hierarchy=1)"
        ]
    return []


def _reserved_cpus(
    cfg: Mapping[str, object], cpus: set[int] | frozenset[int] | None, problems: list[str]
) -> set[int]:
    """The CPUs reservedSystemCPUs names (empty if unset or refused); appends why it is refused."""
    reserved_text = cfg.get("reservedSystemCPUs")
    if not isinstance(reserved_text, str):
        return set()
    parsed = go_cpuset(reserved_text)
    if parsed is None:
        problems.append(
            f"reservedSystemCPUs {reserved_text!r} is not a CPU list; expected e.g. '0-6,84-90' (no spaces)"
        )
        return set()
    if cpus is not None and not parsed <= set(cpus):
        problems.append(
            f"reservedSystemCPUs {reserved_text!r} names CPUs this host does not have online: "
            f"{sorted(parsed - set(cpus))[:8]}"
        )
        return set()
    return parsed


def _cpu_policy_problems(
    version: str,
    minor: int,
    cfg: Mapping[str, object],
    bool_gates: Mapping[str, bool],
    *,
    topology_policy: str,
    reserved_any: bool,
    sockets: int,
    numa_nodes: int,
) -> list[str]:
    """Why the CPU manager would refuse its policy and options; ``reserved_any``: some CPU is reserved."""
    cpu_policy = _str(cfg, "cpuManagerPolicy", "none")
    options = _map(cfg, "cpuManagerPolicyOptions")
    if cpu_policy not in CPU_POLICIES:
        return [f"cpuManagerPolicy {cpu_policy!r} is unknown; expected one of {list(CPU_POLICIES)}"]
    if cpu_policy == "none" and options:
        # policy_none.go: the none policy refuses any option.
        return [f"None policy: received unsupported options {sorted(options)}"]
    if cpu_policy != "static":
        return []
    problems: list[str] = []
    if not reserved_any:
        problems.append(
            "the static CPU manager policy requires reservedSystemCPUs or systemReserved.cpu + "
            "kubeReserved.cpu greater than zero"
        )
    effective = {g: gate_value(minor, g, bool_gates) for g in (ALPHA_GATE, BETA_GATE)}
    problems += check(version, options, effective, topology_policy).problems
    if (
        go_bool(options.get(BY_SOCKET)) is True
        and sockets
        and numa_nodes
        and sockets > numa_nodes
        and topology_policy != "single-numa-node"
    ):
        problems.append(
            f"option {BY_SOCKET!r} is not compatible with hardware where the sockets ({sockets}) "
            f"outnumber the NUMA nodes ({numa_nodes})"
        )
    return problems


def _topology_problems(
    minor: int,
    cfg: Mapping[str, object],
    gates: Mapping[str, bool],
    topology_policy: str,
    numa_nodes: int,
) -> list[str]:
    problems: list[str] = []
    options = _map(cfg, "topologyManagerPolicyOptions")
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
            number = _go_atoi(value) if isinstance(value, str) else None
            if number is None or number < DEFAULT_MAX_NUMA_NODES:
                problems.append(
                    f"topologyManagerPolicyOptions {MAX_NUMA} is {value!r}; expected a string holding an "
                    f"integer of at least {DEFAULT_MAX_NUMA_NODES}"
                )
            else:
                limit = number
        elif go_bool(value) is None:
            problems.append(
                f"topologyManagerPolicyOptions {name} is {value!r}; expected the string 'true' or 'false'"
            )
    if topology_policy != "none" and numa_nodes > limit:
        problems.append(
            f"the topology manager ({topology_policy}) is unsupported on machines with more than {limit} "
            f"NUMA nodes and this host has {numa_nodes}; set topologyManagerPolicyOptions {MAX_NUMA} to at "
            f"least {numa_nodes} (or fewer NUMA nodes: the BIOS NPS and L3-as-NUMA settings)"
        )
    return problems


API_VERSION, KIND = "kubelet.config.k8s.io/v1beta1", "KubeletConfiguration"


def _header_problem(what: str, doc: object) -> str | None:
    if not isinstance(doc, Mapping) or not doc:
        return f"{what} is {doc!r}; expected a KubeletConfiguration map (kubelet fails to load it)"
    if doc.get("apiVersion") != API_VERSION or doc.get("kind") != KIND:
        return (
            f"{what} has apiVersion {doc.get('apiVersion')!r} and kind {doc.get('kind')!r}; expected "
            f"{API_VERSION} {KIND} (kubelet fails to load it)"
        )
    return None


def check_files(
    version: str,
    main: object,
    dropins: Sequence[tuple[str, object]] = (),
    numa_nodes: int = 0,
    **machine: object,
) -> ConfigCheck:
    """check_config over what kubelet reads: the main file (its decoded YAML) and the --config-dir
    drop-ins ([(file name, decoded YAML)]), only ``*.conf`` ones, merged in file-name order; each file
    must be a KubeletConfiguration of kubelet.config.k8s.io/v1beta1. ``machine``: check_config's."""
    minor = supported_minor(version)
    problems = []
    header = _header_problem("the kubelet configuration file", main)
    if header:
        return ConfigCheck(minor, [header])
    assert isinstance(main, Mapping)
    merged = dict(main)
    # loadConfigFile: kubelet's Linux eviction defaults go in before the drop-ins merge over them.
    if merged.get("evictionHard") is None:
        merged["evictionHard"] = dict(DEFAULT_EVICTION_HARD)
    for name, content in sorted(dropins, key=lambda d: d[0]):
        if not name.endswith(".conf"):
            continue
        header = _header_problem(f"drop-in {name}", content)
        if header:
            problems.append(header)
            continue
        assert isinstance(content, Mapping)
        merged = merge_dropin(merged, content)
    if problems:
        return ConfigCheck(minor, problems)
    # A drop-in that removed evictionHard leaves kubelet with no hard eviction at all: its default
    # went in before the merge.
    merged.setdefault("evictionHard", {})
    return check_config(version, merged, numa_nodes, **machine)  # type: ignore[arg-type]


def merge_dropin(base: Mapping[str, object], over: Mapping[str, object]) -> dict[str, object]:
    """A --config-dir drop-in over the configuration as kubelet merges it (a JSON merge patch, RFC 7386:
    maps field by field, lists and scalars replaced, null removes the field)."""
    out = dict(base)
    for key, value in over.items():
        old = out.get(key)
        if value is None:
            out.pop(key, None)
        elif isinstance(value, Mapping) and isinstance(old, Mapping):
            out[key] = merge_dropin(old, value)
        else:
            out[key] = value
    return out


def eviction_hard(existing: Mapping[str, object] | None, memory_available: str) -> dict[str, str]:
    """evictionHard with kubelet's defaults for the signals the file leaves unset, the file's own
    values kept, and lowtail's memory.available (it balances reservedMemory)."""
    merged = {**DEFAULT_EVICTION_HARD, **{str(k): str(v) for k, v in (existing or {}).items()}}
    merged["memory.available"] = memory_available
    return merged
