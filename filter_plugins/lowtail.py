"""Jinja filters the lowtail roles need and ansible.builtin does not have.

Filters run on the controller. The small pieces of logic here (comparing a kernel command line or the
bootloader's entries with the plan, which kubelet fields changed) have no counterpart in the lowtail
package. The filters backed by the lowtail package (a CPU list read by ``lowtail.node.cpulist``, the
kubelet's rules) live in lowtail_kubelet.py, which alone loads the package.
"""

from __future__ import annotations

import re
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


# grub.cfg: `linux /vmlinuz-6.1.0-28-amd64 root=UUID=... ro quiet ...` (memtest entries use `linux` too,
# with a non-kernel image: only vmlinuz images count). grubby --info=ALL: `args="ro quiet ..."`.
_GRUB_LINUX = re.compile(r"^\s*linux(?:efi)?\s+\S*vmlinuz\S*\s*(.*)$", re.MULTILINE)
_GRUBBY_ARGS = re.compile(r'^args="(.*)"\s*$', re.MULTILINE)


def boot_entries(text: str) -> list[str]:
    """The kernel command line of every boot entry in a grub.cfg or in grubby's --info=ALL output."""
    if isinstance(text, bytes):
        text = text.decode()
    return [m.group(1) for m in _GRUB_LINUX.finditer(text or "")] + [
        m.group(1) for m in _GRUBBY_ARGS.finditer(text or "")
    ]


def boot_entries_missing(wanted: Iterable[str], text: str) -> list[str]:
    """Wanted arguments that some boot entry lacks; all of them when the text has no kernel entry
    (a missing or foreign grub.cfg must be regenerated)."""
    wanted = list(wanted)
    entries = boot_entries(text)
    if not entries:
        return wanted
    missing: set[str] = set()
    for entry in entries:
        missing.update(cmdline_missing(wanted, entry))
    return [arg for arg in wanted if arg in missing]


def boot_entries_present(args: Iterable[str], text: str) -> list[str]:
    """The arguments (exact words) that at least one boot entry still has."""
    words = {w for entry in boot_entries(text) for w in shlex.split(entry)}
    return [arg for arg in args if arg in words]


def args_dropped(old: Iterable[str], wanted: Iterable[str]) -> list[str]:
    """Arguments of an earlier plan whose key the new plan no longer sets (a changed value is not
    dropped: adding key=new replaces it)."""
    keys = {_key(a) for a in wanted}
    return [a for a in old if _key(a) not in keys]


def changed_keys(old: Mapping[str, Any] | None, new: Mapping[str, Any], keys: Iterable[str]) -> list[str]:
    """The keys whose values differ between two configs (a missing key differs from any value)."""
    old = old or {}
    missing = object()
    return [k for k in keys if old.get(k, missing) != new.get(k, missing)]


# systemd.syntax(7) and systemd.exec(5): inside a double-quoted word a backslash and a quote are escaped,
# "%" starts a specifier everywhere ("%%" is one "%"), and in Exec*= lines "$NAME" is expanded ("$$" is one
# "$"). A control character (a newline above all) has no place in a unit line: it would end the directive
# and start another one.
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def systemd_quote(value: Any, exec_line: bool = False) -> str:
    """``value`` as one double-quoted word of a unit file line (``exec_line``: an Exec*= line, where
    ``$`` is expanded too); a control character is refused, naming the value."""
    text = str(value)
    if _CONTROL.search(text):
        raise AnsibleFilterError(
            f"lowtail_systemd_quote: {text!r} has a control character (newline, tab, ...); a unit file "
            "line cannot hold one"
        )
    text = text.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%")
    if exec_line:
        text = text.replace("$", "$$")
    return f'"{text}"'


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {
            "lowtail_cmdline_missing": cmdline_missing,
            "lowtail_changed_keys": changed_keys,
            "lowtail_boot_entries_missing": boot_entries_missing,
            "lowtail_boot_entries_present": boot_entries_present,
            "lowtail_args_dropped": args_dropped,
            "lowtail_systemd_quote": systemd_quote,
        }
