#!/usr/bin/python3
"""A stand-in kubectl that keeps one node's state and a log of every call (lowtail's molecule scenario).

State (/var/lib/lowtail-standin/node.json): unschedulable, taints, labels, annotations. Ready is True
only while the stand-in kubelet runs (its pid file names a live process), as the node controller sees a
kubelet that posts status. Rules kept from the real kubectl: drain cordons first (adds the
node.kubernetes.io/unschedulable taint); annotate refuses to change an existing key without
--overwrite; an unknown node is NotFound; /configz answers only while kubelet runs.
"""

from __future__ import annotations

import json
import os
import sys

# LOWTAIL_STANDIN_PREFIX lets tests/ansible run the stand-in against a temporary tree.
_PREFIX = os.environ.get("LOWTAIL_STANDIN_PREFIX", "")
STATE = _PREFIX + "/var/lib/lowtail-standin/node.json"
LOG = _PREFIX + "/var/log/lowtail-kubectl.log"
RUN = _PREFIX + "/run/lowtail-standin"
TAINT = {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}


def fail(msg: str) -> None:
    print(msg, file=sys.stderr)
    sys.exit(1)


def kubelet_running() -> bool:
    try:
        with open(f"{RUN}/kubelet.pid") as f:
            os.kill(int(f.read()), 0)
        return True
    except (OSError, ValueError):
        return False


def main(argv: list[str]) -> None:
    with open(LOG, "a") as f:
        f.write(" ".join(argv) + "\n")
    with open(STATE) as f:
        node = json.load(f)
    words = [a for a in argv if not a.startswith("-")]

    def named(name: str) -> None:
        if name != node["name"]:
            fail(f'Error from server (NotFound): nodes "{name}" not found')

    def cordon(flag: bool) -> None:
        node["unschedulable"] = flag
        node["taints"] = [t for t in node["taints"] if t["key"] != TAINT["key"]] + ([TAINT] if flag else [])

    if argv[:2] == ["get", "--raw"]:
        path = argv[2]
        named(path.split("/")[4])
        if not kubelet_running():
            fail("Error from server: error trying to reach service: dial tcp: connection refused")
        with open(f"{RUN}/configz.json") as f:
            print(f.read())
        return
    if words[:2] == ["get", "node"]:
        named(words[2])
        ready = "True" if kubelet_running() else "Unknown"
        print(
            json.dumps(
                {
                    "metadata": {
                        "name": node["name"],
                        "labels": node["labels"],
                        "annotations": node["annotations"],
                    },
                    "spec": {"unschedulable": node["unschedulable"], "taints": node["taints"]},
                    "status": {"conditions": [{"type": "Ready", "status": ready}]},
                }
            )
        )
        return
    if words and words[0] in ("cordon", "uncordon", "drain"):
        named(words[1])
        cordon(words[0] != "uncordon")
    elif words[:2] == ["annotate", "node"]:
        named(words[2])
        for item in words[3:]:
            if item.endswith("-"):
                node["annotations"].pop(item[:-1], None)
                continue
            key, _, value = item.partition("=")
            if key in node["annotations"] and "--overwrite" not in argv:
                fail(f"error: --overwrite is false but found the following declared annotation(s): '{key}'")
            node["annotations"][key] = value
    elif words[:2] == ["label", "node"] and all(w.endswith("-") for w in words[3:]):
        # Removing a label the node lacks prints 'label "K" not found.' and succeeds (kubectl label).
        named(words[2])
        for item in words[3:]:
            node["labels"].pop(item[:-1], None)
    elif words[:2] == ["taint", "node"] and all(w.endswith("-") for w in words[3:]):
        # Removing a taint the node lacks fails: 'error: taint "K:E" not found' (kubectl taint).
        named(words[2])
        for item in words[3:]:
            key, _, effect = item[:-1].partition(":")
            kept = [
                t for t in node["taints"] if not (t["key"] == key and (not effect or t["effect"] == effect))
            ]
            if len(kept) == len(node["taints"]):
                fail(f'error: taint "{item[:-1]}" not found')
            node["taints"] = kept
    else:
        fail(f"stand-in kubectl does not know {argv}")
    with open(STATE, "w") as f:
        json.dump(node, f)
    print(f"node/{node['name']} {words[0]}ed")


if __name__ == "__main__":
    main(sys.argv[1:])
