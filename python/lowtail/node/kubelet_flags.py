"""kubelet's command line as systemd starts it, and the flags that override what lowtail writes.

kubelet applies flags over its --config file and its --config-dir drop-ins (kubelet docs "Set Kubelet
Parameters Via A Configuration File", merging order: flags take precedence). kubeadm's unit drop-in
(``10-kubeadm.conf``) builds the command line from ``KUBELET_KUBEADM_ARGS`` in
``/var/lib/kubelet/kubeadm-flags.env`` and ``KUBELET_EXTRA_ARGS`` in ``/etc/default/kubelet`` (Debian)
or ``/etc/sysconfig/kubelet`` (RHEL); other installers put flags straight into ``ExecStart=`` of a
drop-in under ``/etc/systemd/system/kubelet.service.d/``. ``command_line`` reads what
``systemctl cat kubelet.service`` prints (the unit and its drop-ins, in the order systemd applies them)
with the environment files it names, so preflight sees the flags kubelet really gets: a flag for a
field lowtail sets would silently win, and ``--config`` / ``--config-dir`` say which files kubelet reads.

Stdlib only: shipped to hosts as module_utils.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import PurePosixPath

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


def _assignments(text: str) -> dict[str, str]:
    """``NAME="value"`` lines of an environment file, the value unquoted (systemd.exec EnvironmentFile=)."""
    found: dict[str, str] = {}
    for raw in (text or "").splitlines():
        line = raw.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        name, _, value = line.partition("=")
        try:
            found[name.strip()] = " ".join(shlex.split(value))
        except ValueError:
            found[name.strip()] = value
    return found


def env_flags(text: str) -> dict[str, list[str]]:
    """Flags per variable of an environment file (``NAME="--a=b --c"`` lines)."""
    found: dict[str, list[str]] = {}
    for name, value in _assignments(text).items():
        try:
            found[name] = shlex.split(value)
        except ValueError:
            found[name] = value.split()
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


# Flags whose value may follow as the next word (pflag: "--config /x" as well as "--config=/x").
_VALUE_FLAGS = frozenset(FLAG_FIELDS) | {"--config", "--config-dir"}
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)")


@dataclass(frozen=True)
class CommandLine:
    """kubelet's command line from its unit: the flags (name -> value; "" for a bare flag), the
    environment files it reads and whether it is kubeadm's unit."""

    flags: dict[str, str] = field(default_factory=dict)
    env_files: list[str] = field(default_factory=list)
    kubeadm: bool = False

    @property
    def config(self) -> str | None:
        return self.flags.get("--config")

    @property
    def config_dir(self) -> str | None:
        return self.flags.get("--config-dir") or None


def _unit_directives(unit_text: str) -> list[tuple[str, str]]:
    """(key, value) of the [Service] lines of ``systemctl cat`` output, continuation lines joined."""
    out: list[tuple[str, str]] = []
    section = ""
    for raw in re.sub(r"\\\n", " ", unit_text or "").splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line
            continue
        if section == "[Service]" and "=" in line:
            key, _, value = line.partition("=")
            out.append((key.strip(), value.strip()))
    return out


def env_files(unit_text: str) -> list[str]:
    """The EnvironmentFile= paths of the unit (a leading "-" marks an optional file)."""
    return [v.lstrip("-") for k, v in _unit_directives(unit_text) if k == "EnvironmentFile" and v]


def command_line(unit_text: str, files: Mapping[str, str]) -> CommandLine:
    """kubelet's flags from its unit and the contents of its environment files (path -> text).

    systemd.service: an empty ``ExecStart=`` resets the list, so a drop-in replaces the command; in a
    command, ``$NAME`` alone is split into words and ``${NAME}`` stays one word; Environment= and
    EnvironmentFile= set the variables (a later assignment wins)."""
    env: dict[str, str] = {}
    exec_start = ""
    for key, value in _unit_directives(unit_text):
        if key == "Environment":
            for word in shlex.split(value):
                name, sep, val = word.partition("=")
                if sep:
                    env[name] = val
        elif key == "EnvironmentFile":
            env.update(_assignments(files.get(value.lstrip("-"), "")))
        elif key == "ExecStart":
            exec_start = value
    try:
        words = shlex.split(exec_start)
    except ValueError:
        words = exec_start.split()
    expanded: list[str] = []
    for word in words[1:]:
        whole = re.fullmatch(r"\$([A-Za-z_][A-Za-z0-9_]*)", word)
        if whole:
            expanded += env.get(whole[1], "").split()
        else:
            expanded.append(_VAR.sub(lambda m: env.get(m[1] or m[2], ""), word))
    flags: dict[str, str] = {}
    i = 0
    while i < len(expanded):
        word = expanded[i]
        if word.startswith("--"):
            name, sep, value = word.partition("=")
            if not sep and name in _VALUE_FLAGS and i + 1 < len(expanded):
                value = expanded[i + 1]
                i += 1
            flags[name] = value
        i += 1
    kubeadm = "KUBELET_KUBEADM_ARGS" in (unit_text or "") or "10-kubeadm.conf" in (unit_text or "")
    return CommandLine(flags, env_files(unit_text), kubeadm)


def command_line_overrides(cmd: CommandLine, fields: list[str], source: str) -> list[str]:
    """One message per flag on kubelet's command line that sets one of ``fields``."""
    problems = []
    for flag in sorted(cmd.flags):
        field_name = FLAG_FIELDS.get(flag)
        if field_name and field_name in fields:
            problems.append(
                f"{source}: kubelet is started with {flag}, which overrides {field_name} that lowtail writes "
                f"to the configuration file; remove the flag and let lowtail set {field_name}"
            )
    return problems


def dropin_overrides(
    dropins: Mapping[str, Mapping[str, object]], fields: list[str], ours: str | None = None
) -> list[str]:
    """One message per --config-dir drop-in (path -> content) that sets a field lowtail writes.

    Without ``ours`` lowtail writes the main file and every drop-in merges over it, so any drop-in's
    value would win. With ``ours`` (the path of lowtail's own drop-in) only drop-ins whose file name
    sorts after it win (kubelet merges them in file-name order, KEP-3983); earlier ones lose to it."""
    if ours is None:
        return [
            f"{path} sets {name}, which overrides {name} that lowtail writes to the configuration file "
            "(--config-dir drop-ins merge over it); remove it from the drop-in and let lowtail set it"
            for path, content in sorted(dropins.items())
            for name in fields
            if name in content
        ]
    mine = PurePosixPath(ours).name
    return [
        f"{path} sets {name}, which overrides {name} that lowtail writes to its drop-in {ours} ({path} "
        f"sorts after it and kubelet merges drop-ins in file-name order); remove it from the drop-in or "
        "rename the drop-in to sort before lowtail's"
        for path, content in sorted(dropins.items(), key=lambda item: PurePosixPath(item[0]).name)
        if PurePosixPath(path).name > mine
        for name in fields
        if name in content
    ]


def dropin_target_problems(
    cmd: CommandLine, minor: int | None, source: str, config_dir_min_minor: int
) -> list[str]:
    """Why lowtail cannot own its settings as a --config-dir drop-in on this kubelet: no --config-dir on
    its command line, or a version that reads drop-ins only behind an alpha switch (KEP-3983: alpha in
    1.28 with the KUBELET_CONFIG_DROPIN_DIR_ALPHA environment variable, beta and on by default from
    1.30)."""
    problems = []
    if not cmd.config_dir:
        problems.append(
            f"lowtail_kubelet_config_target is dropin but {source} starts kubelet without --config-dir, so "
            "kubelet reads no drop-in; add --config-dir=/etc/kubernetes/kubelet.conf.d to kubelet's command "
            "line (KUBELET_EXTRA_ARGS in /etc/default/kubelet or /etc/sysconfig/kubelet on a kubeadm node, "
            "or an ExecStart= drop-in under /etc/systemd/system/kubelet.service.d/) and create the "
            "directory, or set lowtail_kubelet_config_target: file"
        )
    if minor is not None and minor < config_dir_min_minor:
        problems.append(
            f"lowtail_kubelet_config_target is dropin but kubelet 1.{minor} reads --config-dir drop-ins only "
            "as an alpha feature (KEP-3983: with the KUBELET_CONFIG_DROPIN_DIR_ALPHA environment variable; "
            f"beta and on by default from 1.{config_dir_min_minor}); upgrade kubelet to "
            f"1.{config_dir_min_minor} or later, or set lowtail_kubelet_config_target: file"
        )
    return problems


def ownership(
    cmd: CommandLine,
    config_path: str,
    minor: int | None,
    config_dir_min_minor: int,
    dropin: str | None = None,
) -> list[str]:
    """What owning kubelet's configuration means on this node: who else rewrites it, and what a kubeadm
    upgrade does to lowtail's settings (kept in ``config_path``, or in the drop-in ``dropin``).
    Messages for the operator, not problems."""
    notes = []
    if cmd.kubeadm and dropin:
        notes.append(
            f"kubeadm manages {config_path}: `kubeadm upgrade node` (phase kubelet-config) rewrites it "
            f"from the kube-system/kubelet-config ConfigMap, and leaves lowtail's drop-in {dropin} alone, "
            "so lowtail's settings survive the upgrade; the ConfigMap's other fields apply as before"
        )
    elif cmd.kubeadm:
        notes.append(
            f"kubeadm manages {config_path}: `kubeadm upgrade node` (phase kubelet-config) rewrites "
            "it from the kube-system/kubelet-config ConfigMap, which drops lowtail's settings; kubelet "
            "then finds cpuManagerPolicy back at the ConfigMap's value while cpu_manager_state still "
            "records static, and refuses to start until the checkpoints are reset. Run lowtail again "
            "on each node after a kubeadm upgrade (it drains and resets), or keep the settings across "
            "upgrades with a kubeadm patch (--patches DIR with a kubeletconfiguration target) or in "
            "the ConfigMap itself, or let lowtail write a drop-in (lowtail_kubelet_config_target: dropin)"
        )
    if cmd.config_dir and not dropin:
        if minor is not None and minor < config_dir_min_minor:
            notes.append(
                f"kubelet reads drop-ins from {cmd.config_dir}, an alpha feature on kubelet 1.{minor} "
                "(KUBELET_CONFIG_DROPIN_DIR_ALPHA); lowtail checks them but keeps its settings in the "
                "main file"
            )
        else:
            notes.append(
                f"kubelet reads drop-ins from {cmd.config_dir}: they merge over {config_path}, and "
                "kubeadm upgrades leave them alone, so a drop-in is where settings that must survive an "
                "upgrade belong (lowtail_kubelet_config_target: dropin); lowtail checks them against what "
                "it writes"
            )
    return notes
