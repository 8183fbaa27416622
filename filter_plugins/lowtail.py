"""Jinja filters the lowtail roles need and ansible.builtin does not have.

Self-contained on purpose: filters run on the controller, and these two small pieces of logic
(comparing a kernel command line, which kubelet fields changed) have no
counterpart in the lowtail package.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterable, Mapping
from typing import Any

from ansible.errors import AnsibleFilterError


def _key(arg: str) -> str:
    return arg.split("=", 1)[0]


def cmdline_missing(wanted: Iterable[str], cmdline: str) -> list[str]:
    """The wanted kernel arguments that the running command line does not have with the same value.

    A key given twice on the command line takes its last value (the kernel's own rule for most
    parameters); an argument without '=' must be present as a word.
    """
    if isinstance(cmdline, bytes):
        cmdline = cmdline.decode()
    try:
        words = shlex.split(cmdline)
    except ValueError as e:
        raise AnsibleFilterError(
            f"lowtail_cmdline_missing: unparsable command line {cmdline!r}: {e}"
        ) from None
    # Arguments after a bare "--" belong to init, not the kernel.
    if "--" in words:
        words = words[: words.index("--")]
    last: dict[str, str] = {}
    for w in words:
        last[_key(w)] = w
    return [arg for arg in wanted if last.get(_key(arg)) != arg]


def changed_keys(old: Mapping[str, Any] | None, new: Mapping[str, Any], keys: Iterable[str]) -> list[str]:
    """The keys whose values differ between two configs (a missing key differs from any value)."""
    old = old or {}
    missing = object()
    return [k for k in keys if old.get(k, missing) != new.get(k, missing)]


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {
            "lowtail_cmdline_missing": cmdline_missing,
            "lowtail_changed_keys": changed_keys,
        }
