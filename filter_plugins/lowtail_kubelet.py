"""Jinja filters backed by lowtail.node: what a kubelet of a given version accepts, which flags override
lowtail's settings, whether the OCI runtime resets inherited CPU affinity, which kernel arguments are
not shell-inert, the CPUs of a cpulist (``lowtail_cpus``: the one parser the plan, the kernel arguments
and the lease pool use, never expanded by hand in a template).

The rules live once, in lowtail.node (kubelet_options, kubelet_flags, kubelet_runtime, kernel_args),
which preflight's module and the stand-in kubelet of the molecule scenario read too. Filters run on
the controller; the package is loaded from module_utils/lowtail next to this file so an Ansible
installed apart from lowtail's venv finds it as well.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

from ansible.errors import AnsibleFilterError

_PACKAGE = "_lowtail_node_for_filters"


def _module(name: str) -> ModuleType:
    if _PACKAGE not in sys.modules:
        root = Path(__file__).resolve().parent.parent / "module_utils" / "lowtail"
        spec = importlib.util.spec_from_file_location(
            _PACKAGE, root / "__init__.py", submodule_search_locations=[str(root)]
        )
        assert spec and spec.loader
        package = importlib.util.module_from_spec(spec)
        sys.modules[_PACKAGE] = package
        spec.loader.exec_module(package)
    return importlib.import_module(f"{_PACKAGE}.{name}")


def cpus(cpulist: str) -> list[int]:
    """The CPUs of a kernel cpulist (``0-3,8``) in ascending order; a malformed list is an error naming it."""
    module = _module("cpulist")
    try:
        return sorted(module.parse(str(cpulist)))
    except module.CpuListError as e:
        raise AnsibleFilterError(f"lowtail_cpus: {e}") from e


def kubelet_policy(
    version: str,
    wanted: Any,
    gates: Mapping[str, Any] | None = None,
    topology_policy: str = "none",
    numa_nodes: int = 0,
) -> dict[str, Any]:
    """{minor, options, gates, topology_options, problems} for kubelet ``version`` on a host with
    ``numa_nodes`` NUMA nodes; ``wanted`` 'auto' is lowtail's recommendation for that version, a map is
    taken as asked. An unsupported version is a problem."""
    ko = _module("kubelet_options")
    if wanted not in ("auto", None) and not isinstance(wanted, Mapping):
        raise AnsibleFilterError(f"cpu manager policy options {wanted!r}: expected 'auto' or a map")
    try:
        result = ko.choose_options(
            str(version),
            None if wanted in ("auto", None) else wanted,
            gates or {},
            topology_policy,
            int(numa_nodes or 0),
        )
    except ko.KubeletVersionError as e:
        return {"minor": None, "options": {}, "gates": {}, "topology_options": {}, "problems": [str(e)]}
    return {
        "minor": result.minor,
        "options": result.options,
        "gates": result.gates,
        "topology_options": result.topology_options,
        "problems": result.problems,
    }


def _machine(topology: Mapping[str, Any] | None, cgroup_version: Any) -> dict[str, Any]:
    """check_config's machine arguments from lowtail_node.topology (sockets, online) and the cgroup
    version preflight read (1 or 2; none: unknown)."""
    topo = dict(topology or {})
    online = topo.get("online")
    return {
        "sockets": int(topo.get("sockets") or 0),
        "cpus": set(_module("cpulist").parse(str(online))) if online else None,
        "cgroup_version": int(cgroup_version) if cgroup_version not in (None, "") else None,
    }


def kubelet_config_check(
    config: Any,
    version: str,
    numa_nodes: int = 0,
    topology: Mapping[str, Any] | None = None,
    cgroup_version: Any = None,
) -> dict[str, list[str]]:
    """{problems, warnings} for the whole configuration kubelet ``version`` will read (the merged file),
    on a host with ``numa_nodes`` NUMA nodes; ``topology`` (lowtail_node.topology: sockets, online) and
    ``cgroup_version`` (1 or 2) add the checks that need them. An unsupported version or a file that is
    not a map is a problem."""
    ko = _module("kubelet_options")
    if not isinstance(config, Mapping):
        return {"problems": [f"the kubelet configuration is {config!r}; expected a map"], "warnings": []}
    try:
        result = ko.check_config(
            str(version),
            config,
            int(numa_nodes or 0),
            **_machine(topology, cgroup_version),
        )
    except ko.KubeletVersionError as e:
        return {"problems": [str(e)], "warnings": []}
    return {"problems": list(result.problems), "warnings": list(result.warnings)}


def kubelet_files_check(  # noqa: PLR0917 - a Jinja filter takes its arguments by position
    main: Any,
    dropins: list[list[Any]],
    version: str,
    numa_nodes: int = 0,
    topology: Mapping[str, Any] | None = None,
    cgroup_version: Any = None,
) -> dict[str, list[str]]:
    """{problems, warnings} for what kubelet ``version`` loads: the main file and its --config-dir
    drop-ins ([[path, content], ...]) as kubelet_options.check_files judges them (each file's header,
    kubelet's eviction defaults before the merge, the merge, then every check_config rule)."""
    ko = _module("kubelet_options")
    try:
        result = ko.check_files(
            str(version),
            main,
            [(str(p), c) for p, c in dropins],
            int(numa_nodes or 0),
            **_machine(topology, cgroup_version),
        )
    except ko.KubeletVersionError as e:
        return {"problems": [str(e)], "warnings": []}
    return {"problems": list(result.problems), "warnings": list(result.warnings)}


def kubelet_eviction_hard(existing: Mapping[str, Any] | None, memory_available: str) -> dict[str, str]:
    """evictionHard keeping kubelet's default signals and the file's values, with lowtail's memory."""
    return dict(_module("kubelet_options").eviction_hard(existing, memory_available))


def kubelet_config_dir_supported(version: str) -> bool:
    """Whether this kubelet reads --config-dir drop-ins without a feature gate (KEP-3983)."""
    ko = _module("kubelet_options")
    return ko.parse_version(str(version))[1] >= ko.CONFIG_DIR_MIN_MINOR


def kubelet_flag_overrides(files: Mapping[str, str], fields: list[str]) -> list[str]:
    """Problems for flags in kubelet's environment files that override ``fields``."""
    return list(_module("kubelet_flags").overrides(dict(files), list(fields)))


def runtime_affinity_problems(runtimes: Mapping[str, str], kernel_release: str) -> list[str]:
    """Problems for installed OCI runtimes that leave containers on systemd's CPU affinity."""
    return list(_module("kubelet_runtime").affinity_problems(dict(runtimes), str(kernel_release)))


def containerd_support(engines: Mapping[str, str], kubelet_version: str) -> dict[str, list[str]]:
    """{problems, warnings} for the node's containerd (engines: name -> its ``--version`` output) under
    this kubelet; none without containerd or for a kubelet lowtail does not claim (refused elsewhere)."""
    ko = _module("kubelet_options")
    try:
        minor = ko.supported_minor(str(kubelet_version))
    except ko.KubeletVersionError:
        return {"problems": [], "warnings": []}
    if "containerd" not in engines:
        return {"problems": [], "warnings": []}
    problems, warnings = _module("kubelet_runtime").containerd_support(str(engines["containerd"]), minor)
    return {"problems": list(problems), "warnings": list(warnings)}


def kubelet_unit_env_files(unit_text: str) -> list[str]:
    """The EnvironmentFile= paths of kubelet's unit (``systemctl cat`` output)."""
    return list(_module("kubelet_flags").env_files(str(unit_text or "")))


def kubelet_command_line(unit_text: str, env_files: Mapping[str, str] | None = None) -> dict[str, Any]:
    """kubelet's command line from its unit and environment files: {flags, config, config_dir, kubeadm}."""
    cmd = _module("kubelet_flags").command_line(str(unit_text or ""), dict(env_files or {}))
    return {"flags": cmd.flags, "config": cmd.config, "config_dir": cmd.config_dir, "kubeadm": cmd.kubeadm}


def kubelet_command_line_overrides(cmd: Mapping[str, Any], fields: list[str], source: str) -> list[str]:
    """Problems for flags on kubelet's command line that override ``fields``."""
    kf = _module("kubelet_flags")
    line = kf.CommandLine(dict(cmd.get("flags") or {}), [], bool(cmd.get("kubeadm")))
    return list(kf.command_line_overrides(line, list(fields), str(source)))


def kubelet_dropins(texts: Mapping[str, str]) -> list[list[Any]]:
    """[[path, content], ...] of --config-dir drop-ins (path -> YAML text) in the order kubelet merges
    them (by file name); a file that is not a YAML map becomes {} and is left to check_config."""
    import yaml

    out = []
    for path in sorted(texts, key=lambda p: Path(p).name):
        try:
            content = yaml.safe_load(texts[path])
        except yaml.YAMLError as e:
            raise AnsibleFilterError(f"kubelet drop-in {path} is not YAML: {e}") from None
        out.append([path, content if isinstance(content, Mapping) else {}])
    return out


def kubelet_merge_dropins(config: Mapping[str, Any], dropins: list[list[Any]]) -> dict[str, Any]:
    """The configuration with the drop-ins ([[path, content], ...]) merged over it, as kubelet does."""
    ko = _module("kubelet_options")
    merged = dict(config)
    for _path, content in dropins:
        merged = ko.merge_dropin(merged, content)
    return merged


def kubelet_with_dropin(
    dropins: list[list[Any]], path: str, content: Mapping[str, Any] | None
) -> list[list[Any]]:
    """The drop-ins ([[path, content], ...]) with the one named like ``path`` replaced by ``content``
    (None: removed), in the order kubelet merges them (by file name)."""
    name = Path(str(path)).name
    out = [[p, c] for p, c in dropins if Path(str(p)).name != name]
    if content is not None:
        out.append([str(path), dict(content)])
    return sorted(out, key=lambda item: Path(str(item[0])).name)


def kubelet_dropin_of(dropins: list[list[Any]], path: str) -> dict[str, Any] | None:
    """The content of the drop-in named like ``path``, or None when there is none."""
    name = Path(str(path)).name
    return next((dict(c) for p, c in dropins if Path(str(p)).name == name), None)


def kubelet_dropin_overrides(
    dropins: list[list[Any]], fields: list[str], ours: str | None = None
) -> list[str]:
    """Problems for drop-ins that set a field lowtail writes: to the main file (``ours`` None), or to
    lowtail's drop-in ``ours`` (only drop-ins sorting after it win)."""
    kf = _module("kubelet_flags")
    return list(kf.dropin_overrides({p: c for p, c in dropins}, list(fields), str(ours) if ours else None))


def kubelet_dropin_target_problems(cmd: Mapping[str, Any], version: str, source: str) -> list[str]:
    """Why lowtail cannot write its settings as a --config-dir drop-in on this kubelet."""
    kf, ko = _module("kubelet_flags"), _module("kubelet_options")
    try:
        minor: int | None = ko.parse_version(str(version))[1]
    except ko.KubeletVersionError:
        minor = None  # preflight reports the version itself
    line = kf.CommandLine(dict(cmd.get("flags") or {}), [], bool(cmd.get("kubeadm")))
    return list(kf.dropin_target_problems(line, minor, str(source), ko.CONFIG_DIR_MIN_MINOR))


def kubelet_ownership(
    cmd: Mapping[str, Any], config_path: str, version: str, dropin: str | None = None
) -> list[str]:
    """Notes on who else writes kubelet's configuration and what a kubeadm upgrade does to it, with
    lowtail's settings in ``config_path`` or in the drop-in ``dropin``."""
    kf, ko = _module("kubelet_flags"), _module("kubelet_options")
    try:
        minor: int | None = ko.parse_version(str(version))[1]
    except ko.KubeletVersionError:
        minor = None
    line = kf.CommandLine(dict(cmd.get("flags") or {}), [], bool(cmd.get("kubeadm")))
    return list(
        kf.ownership(line, str(config_path), minor, ko.CONFIG_DIR_MIN_MINOR, str(dropin) if dropin else None)
    )


def kernel_args_unsafe(args: list[Any]) -> list[Any]:
    """Kernel arguments that are not shell-inert (the rule preflight applies, lowtail.node.kernel_args)."""
    return list(_module("kernel_args").unsafe(list(args)))


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {
            "lowtail_cpus": cpus,
            "lowtail_kubelet_policy": kubelet_policy,
            "lowtail_kubelet_config_check": kubelet_config_check,
            "lowtail_kubelet_files_check": kubelet_files_check,
            "lowtail_kubelet_eviction_hard": kubelet_eviction_hard,
            "lowtail_kubelet_config_dir_supported": kubelet_config_dir_supported,
            "lowtail_kubelet_flag_overrides": kubelet_flag_overrides,
            "lowtail_runtime_affinity_problems": runtime_affinity_problems,
            "lowtail_containerd_support": containerd_support,
            "lowtail_kernel_args_unsafe": kernel_args_unsafe,
            "lowtail_kubelet_unit_env_files": kubelet_unit_env_files,
            "lowtail_kubelet_command_line": kubelet_command_line,
            "lowtail_kubelet_command_line_overrides": kubelet_command_line_overrides,
            "lowtail_kubelet_dropins": kubelet_dropins,
            "lowtail_kubelet_merge_dropins": kubelet_merge_dropins,
            "lowtail_kubelet_dropin_overrides": kubelet_dropin_overrides,
            "lowtail_kubelet_with_dropin": kubelet_with_dropin,
            "lowtail_kubelet_dropin_of": kubelet_dropin_of,
            "lowtail_kubelet_dropin_target_problems": kubelet_dropin_target_problems,
            "lowtail_kubelet_ownership": kubelet_ownership,
        }
