"""A kubectl stand-in that keeps a cluster's objects in a JSON file (tests/deploy/test_apply.py).

There is no API server on this machine. The stand-in holds objects by kind, namespace and name, and
follows kubectl where the role relies on it (https://kubernetes.io/docs/reference/kubectl/generated/):

- ``-f PATH`` names a file, or a directory whose ``.json``, ``.yaml`` and ``.yml`` files are read in
  lexical order, not recursively without ``-R`` (kubectl's resource builder); a path that does not exist
  is ``error: the path "PATH" does not exist``.
- ``apply`` refuses a namespaced object whose namespace does not exist (``namespaces "x" not found``);
  ``diff`` exits 0 without differences, 1 with some, above 1 on error.
- ``get`` and ``delete`` of an object that does not exist fail with ``NotFound`` (exit 1) unless
  ``--ignore-not-found`` is given, which makes them print nothing for it and exit 0. kubectl goes on
  with the other objects and exits 1 at the end when one failed.
- ``delete`` prints ``<resource>.<group> "<name>" deleted``; deleting a Namespace deletes every object in
  it (the namespace controller: "This deletes everything under the namespace!", Kubernetes docs,
  tasks/administer-cluster/namespaces). ``--cascade`` takes background, foreground or orphan, ``--wait``
  a boolean and ``--timeout`` a duration; an unknown flag is ``error: unknown flag: --x``.
- ``-o name`` prints ``<resource>.<group>/<name>`` (core kinds without the group).

State file (``cluster.json`` next to the executable): ``objects`` maps ``Kind/namespace/name`` to the
object; ``nodes`` holds node labels and taints; ``forbidden`` lists ``"verb Kind"`` pairs the user may
not do (RBAC), answered as the API server answers them. Every call is appended to ``calls.log``.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml


@dataclass(frozen=True)
class Kind:
    resource: str
    singular: str
    group: str
    namespaced: bool

    @property
    def ref(self) -> str:
        """The resource as the API server names it in errors: rayclusters.ray.io, namespaces."""
        return self.resource + (f".{self.group}" if self.group else "")


# The kinds lowtail applies, with their API group and scope (Kubernetes API reference; KubeRay's CRD).
KINDS = {
    "Namespace": Kind("namespaces", "namespace", "", False),
    "RuntimeClass": Kind("runtimeclasses", "runtimeclass", "node.k8s.io", False),
    "RayCluster": Kind("rayclusters", "raycluster", "ray.io", True),
    "NetworkPolicy": Kind("networkpolicies", "networkpolicy", "networking.k8s.io", True),
}
DELETE_FLAGS = {"--ignore-not-found", "--wait", "--timeout", "--cascade"}
GET_FLAGS = {"--ignore-not-found", "-o"}
# A Go duration as --timeout takes it (time.ParseDuration), e.g. 300s, 5m, 1h30m.
DURATION = re.compile(r"\A(\d+(\.\d+)?(ns|us|ms|s|m|h))+\Z")


class KubectlError(Exception):
    """What kubectl prints on stderr before it exits 1."""


def key(obj: dict[str, Any]) -> str:
    kind = KINDS[obj["kind"]]
    namespace = obj["metadata"].get("namespace", "default") if kind.namespaced else ""
    return f"{obj['kind']}/{namespace}/{obj['metadata']['name']}"


def display(obj: dict[str, Any]) -> str:
    kind = KINDS[obj["kind"]]
    return kind.singular + (f".{kind.group}" if kind.group else "")


def read_objects(path_text: str) -> list[tuple[str, dict[str, Any]]]:
    path = Path(path_text)
    if not path.exists():
        raise KubectlError(f'error: the path "{path_text}" does not exist')
    files = (
        sorted(p for p in path.iterdir() if p.is_file() and p.suffix in (".json", ".yaml", ".yml"))
        if path.is_dir()
        else [path]
    )
    found: list[tuple[str, dict[str, Any]]] = []
    for file in files:
        for doc in yaml.safe_load_all(file.read_text()):
            if not doc:
                continue
            if doc.get("kind") not in KINDS:
                raise KubectlError(
                    f'error: resource mapping not found for name: "{doc["metadata"]["name"]}" from "{file}": '
                    f'no matches for kind "{doc.get("kind")}" in version "{doc.get("apiVersion")}"\n'
                    "ensure CRDs are installed first"
                )
            found.append((str(file), doc))
    return found


def parse(args: list[str], allowed: set[str]) -> tuple[dict[str, str], list[str]]:
    """Flags (``--a=b``, ``--a b`` for -f and -o, ``--flag`` alone) and the positional arguments."""
    flags: dict[str, str] = {}
    positional: list[str] = []
    rest = iter(args)
    for arg in rest:
        if arg in ("-f", "-o"):
            flags[arg] = next(rest)
        elif arg.startswith("-"):
            name, _, value = arg.partition("=")
            if name not in allowed:
                raise KubectlError(f"error: unknown flag: {name}")
            flags[name] = value or "true"
        else:
            positional.append(arg)
    return flags, positional


def not_found(obj: dict[str, Any], doing: str = "", file: str = "") -> str:
    where = f'error when {doing} "{file}": ' if doing else ""
    return (
        f'Error from server (NotFound): {where}{KINDS[obj["kind"]].ref} "{obj["metadata"]["name"]}" not found'
    )


def check_allowed(state: dict[str, Any], verb: str, obj: dict[str, Any], file: str) -> None:
    if f"{verb} {obj['kind']}" in state.get("forbidden", []):
        kind = KINDS[obj["kind"]]
        where = (
            f' in the namespace "{obj["metadata"].get("namespace", "default")}"' if kind.namespaced else ""
        )
        raise KubectlError(
            f'Error from server (Forbidden): error when {verb.removesuffix("e")}ing "{file}": {kind.ref} '
            f'"{obj["metadata"]["name"]}" is forbidden: User "lab" cannot {verb} resource "{kind.resource}" '
            f'in API group "{kind.group}"{where}'
        )


def apply(state: dict[str, Any], path: str) -> list[str]:
    errors: list[str] = []
    for file, obj in read_objects(path):
        namespace = obj["metadata"].get("namespace", "default")
        if KINDS[obj["kind"]].namespaced and f"Namespace//{namespace}" not in state["objects"]:
            errors.append(
                f'Error from server (NotFound): error when creating "{file}": '
                f'namespaces "{namespace}" not found'
            )
            continue
        state["objects"][key(obj)] = obj
        print(f"{display(obj)}/{obj['metadata']['name']} configured")
    return errors


def delete(state: dict[str, Any], flags: dict[str, str], path: str) -> list[str]:
    if flags.get("--cascade", "background") not in ("background", "foreground", "orphan"):
        raise KubectlError(
            f"error: invalid cascade value ({flags['--cascade']}). "
            'Must be "background", "foreground", or "orphan".'
        )
    if flags.get("--wait", "true") not in ("true", "false"):
        raise KubectlError(f'error: invalid argument "{flags["--wait"]}" for "--wait" flag')
    if "--timeout" in flags and not DURATION.match(flags["--timeout"]):
        raise KubectlError(f'error: invalid argument "{flags["--timeout"]}" for "--timeout" flag')
    errors: list[str] = []
    for file, obj in read_objects(path):
        try:
            check_allowed(state, "delete", obj, file)
        except KubectlError as e:
            errors.append(str(e))
            continue
        if state["objects"].pop(key(obj), None) is None:
            if "--ignore-not-found" not in flags:
                errors.append(not_found(obj, "deleting", file))
            continue
        if obj["kind"] == "Namespace":
            name = obj["metadata"]["name"]
            for inside in [k for k in state["objects"] if k.split("/")[1] == name]:
                del state["objects"][inside]
        print(f'{display(obj)} "{obj["metadata"]["name"]}" deleted')
    return errors


def get(state: dict[str, Any], flags: dict[str, str], positional: list[str]) -> list[str]:
    if positional[:1] == ["node"]:
        node = state["nodes"][positional[1]]
        meta = {"name": positional[1], "labels": node["labels"]}
        print(json.dumps({"metadata": meta, "spec": {"taints": node["taints"]}}))
        return []
    if flags.get("-o") != "name":
        raise KubectlError(f"error: the stand-in prints only -o name for objects, not {flags.get('-o')}")
    errors: list[str] = []
    for _file, obj in read_objects(flags["-f"]):
        if key(obj) in state["objects"]:
            print(f"{display(obj)}/{obj['metadata']['name']}")
        elif "--ignore-not-found" not in flags:
            errors.append(not_found(obj))
    return errors


def main(state_path: Path, argv: list[str]) -> int:
    state = json.loads(state_path.read_text())
    args = [a for a in argv if not a.startswith("--context")]
    with open(state_path.with_name("calls.log"), "a") as log:
        log.write(" ".join(args) + "\n")
    verb, rest = args[0], args[1:]
    errors: list[str] = []
    try:
        if verb == "diff":
            flags, _ = parse(rest, set())
            objects = read_objects(flags["-f"])
            return 0 if all(state["objects"].get(key(o)) == o for _, o in objects) else 1
        if verb == "apply":
            flags, _ = parse(rest, set())
            errors = apply(state, flags["-f"])
        elif verb == "delete":
            flags, _ = parse(rest, DELETE_FLAGS)
            errors = delete(state, flags, flags["-f"])
        elif verb == "get":
            flags, positional = parse(rest, GET_FLAGS)
            errors = get(state, flags, positional)
        elif verb == "label":
            key_, value = rest[2].split("=", 1)
            state["nodes"][rest[1]]["labels"][key_] = value
        elif verb == "taint":
            kv, effect = rest[2].rsplit(":", 1)
            key_, value = kv.split("=", 1)
            state["nodes"][rest[1]]["taints"].append({"key": key_, "value": value, "effect": effect})
        else:
            raise KubectlError(f'error: unknown command "{verb}" for "kubectl"')
    except KubectlError as e:
        errors.append(str(e))
    state_path.write_text(json.dumps(state))
    for error in errors:
        print(error, file=sys.stderr)
    # diff exits above 1 on an error; every other command exits 1.
    return (2 if verb == "diff" else 1) if errors else 0
