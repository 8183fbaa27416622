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
    """What a kubelet of one version would make of a set of options and gates."""

    minor: int
    problems: list[str] = field(default_factory=list)
    options: dict[str, str] = field(default_factory=dict)
    gates: dict[str, bool] = field(default_factory=dict)


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
) -> PolicyCheck:
    """The options and gates lowtail writes for this kubelet.

    ``wanted`` None means lowtail's recommendation: each of RECOMMENDED that this kubelet has at beta or
    GA. An explicit map is taken as asked; the alpha gate is added when an asked option needs it (unless
    the inventory set that gate to false, which is then a problem), and every refusal is reported.
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
    return PolicyCheck(minor, result.problems, {k: str(v) for k, v in options.items()}, only_set)


def eviction_hard(existing: Mapping[str, object] | None, memory_available: str) -> dict[str, str]:
    """evictionHard with kubelet's defaults for the signals the file leaves unset, the file's own
    values kept, and lowtail's memory.available (it balances reservedMemory)."""
    merged = {**DEFAULT_EVICTION_HARD, **{str(k): str(v) for k, v in (existing or {}).items()}}
    merged["memory.available"] = memory_available
    return merged
