#!/usr/bin/python
"""Ansible module: keep the sysfs values lowtail's tmpfiles drop-in overwrites, and put them back.

lowtail applies its sysfs settings (governor, THP, KSM, workqueue masks, PM QoS, machine-check
polling) with ``systemd-tmpfiles --create``, whose "w" lines overwrite a file without keeping what it
held. Before they are applied this module records the value of every file those lines name; rollback
writes the recorded values back, so the host runs as before lowtail without waiting for a reboot.
"""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: lowtail_sysfs_values
short_description: Record the sysfs values a tmpfiles drop-in overwrites, or restore them
description:
  - With I(state=record), reads every file named by a C(w) or C(w+) line of I(tmpfiles) (shell-style
    globs expanded, as systemd-tmpfiles does, tmpfiles.d(5)) and adds its value to I(record), a JSON map
    of path to value. A path already recorded keeps its value, so the record is what the host had
    before lowtail first wrote it. The record is written atomically.
  - A choice file such as C(transparent_hugepage/enabled) (C(always madvise [never])) is recorded as its
    bracketed choice, which is what writing restores.
  - With I(state=restore), writes each recorded value back where the file now differs; files that no
    longer exist are reported as C(gone), and values the kernel refuses as C(refused) (not a failure).
  - Only paths under C(/sys/) are handled; I(sysfs_root) stands in for C(/sys) (a fixture tree in tests).
options:
  state:
    description: C(record) before the drop-in is applied, C(restore) on rollback.
    type: str
    choices: [record, restore]
    required: true
  record:
    description: JSON file with the values from before lowtail.
    type: path
    required: true
  tmpfiles:
    description: The tmpfiles.d drop-in whose C(w) lines name the files (needed with I(state=record)).
    type: path
  sysfs_root:
    description: Root of sysfs (a fixture tree in tests).
    type: path
    default: /sys
author: lowtail
"""

EXAMPLES = r"""
- name: Keep the sysfs values lowtail's tmpfiles drop-in overwrites
  lowtail_sysfs_values:
    state: record
    tmpfiles: /etc/tmpfiles.d/lowtail-tuning.conf
    record: /var/lib/lowtail/sysfs-before-lowtail.json
"""

RETURN = r"""
recorded:
  description: Paths added to the record.
  type: list
  returned: always
restored:
  description: Paths written back (or, in check mode, that would be).
  type: list
  returned: always
gone:
  description: Recorded paths that no longer exist.
  type: list
  returned: always
refused:
  description: Recorded paths whose value the kernel refused, with the error.
  type: dict
  returned: always
"""

import errno
import glob
import json
import os
import re
from pathlib import Path
from typing import Any

from ansible.module_utils.basic import AnsibleModule

# What DOCUMENTATION describes (tests/ansible/test_module_docs.py checks that they agree).
ARGUMENT_SPEC: dict[str, Any] = {
    "state": {"type": "str", "choices": ["record", "restore"], "required": True},
    "record": {"type": "path", "required": True},
    "tmpfiles": {"type": "path"},
    "sysfs_root": {"type": "path", "default": "/sys"},
}

_CHOICE = re.compile(r"\[([^\]\s]+)\]")


def written_paths(tmpfiles: str) -> list[str]:
    """The path globs of the "w" lines (tmpfiles.d(5): type, path, mode, user, group, age, argument)."""
    paths = []
    for line in tmpfiles.splitlines():
        fields = line.split(None, 6)
        if fields and fields[0] in ("w", "w+") and len(fields) > 1:
            if not fields[1].startswith("/sys/"):
                raise ValueError(f"tmpfiles line {line!r}: expected a path under /sys/")
            paths.append(fields[1])
        elif fields and not fields[0].startswith("#"):
            raise ValueError(f"tmpfiles line {line!r}: expected only 'w' lines")
    return paths


def value_of(text: str) -> str:
    """What writing back restores: the bracketed choice of a choice file, else the stripped text."""
    choice = _CHOICE.search(text)
    return choice.group(1) if choice else text.strip()


def _host(path: str, root: Path) -> Path:
    return root / path[len("/sys/") :]


def read_record(record: Path) -> dict[str, str]:
    if not record.exists():
        return {}
    data = json.loads(record.read_text())
    if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
        raise ValueError(f"{record}: expected a JSON object of path to value")
    return data


def record_values(tmpfiles: Path, root: Path, record: Path, check_mode: bool) -> dict[str, Any]:
    kept = read_record(record)
    added = []
    for pattern in written_paths(tmpfiles.read_text()):
        for found in sorted(glob.glob(str(_host(pattern, root)))):
            path = "/sys/" + str(Path(found).relative_to(root))
            if path in kept:
                continue
            try:
                kept[path] = value_of(Path(found).read_text())
            except OSError:
                continue  # unreadable (write-only or gone): nothing to restore
            added.append(path)
    if added and not check_mode:
        tmp = record.with_name(record.name + ".tmp")
        tmp.write_text(json.dumps(kept, indent=1, sort_keys=True) + "\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, record)
    return {"recorded": added, "restored": [], "gone": [], "refused": {}}


def restore_values(root: Path, record: Path, check_mode: bool) -> dict[str, Any]:
    restored: list[str] = []
    gone: list[str] = []
    refused: dict[str, str] = {}
    for path, value in sorted(read_record(record).items()):
        host = _host(path, root)
        try:
            if value_of(host.read_text()) == value:
                continue
            if not check_mode:
                host.write_text(value + "\n")
        except FileNotFoundError:
            gone.append(path)
            continue
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.EIO, errno.EPERM, errno.EBUSY, errno.EACCES):
                raise
            refused[path] = f"{value!r}: {e.strerror}"
            continue
        restored.append(path)
    return {"recorded": [], "restored": restored, "gone": gone, "refused": refused}


def main() -> None:
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    record = Path(module.params["record"])
    root = Path(module.params["sysfs_root"])
    try:
        if module.params["state"] == "restore":
            result = restore_values(root, record, module.check_mode)
        elif not module.params["tmpfiles"]:
            raise ValueError("state=record needs tmpfiles: the drop-in whose 'w' lines name the files")
        else:
            result = record_values(Path(module.params["tmpfiles"]), root, record, module.check_mode)
    except (OSError, ValueError) as e:
        module.fail_json(msg=f"sysfs values: {e}")
    for path, why in result["refused"].items():
        module.warn(f"{path} was not restored: the kernel refused {why}")
    module.exit_json(changed=bool(result["recorded"] or result["restored"]), **result)


if __name__ == "__main__":
    main()
