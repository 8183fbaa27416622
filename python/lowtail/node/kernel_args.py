"""Which kernel arguments may reach the bootloader configuration.

GRUB drop-ins (``/etc/default/grub.d/*.cfg``) are sourced by a root shell when grub-mkconfig runs, so a
kernel argument is data only if it has none of the characters a shell acts on: quotes, ``$``,
backquotes, ``;``, ``|``, ``&``, ``<``, ``>``, parentheses, backslashes and whitespace (a newline
included: ``\\Z``, not ``$``, ends the pattern). Preflight (library/lowtail_node_plan.py) refuses such
an argument naming it, and the kernel role checks every argument again before it writes one.

Stdlib only: shipped to hosts as module_utils.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

ARG_SAFE = re.compile(r"[A-Za-z0-9_.][A-Za-z0-9_.,:/+=@-]*\Z")


def is_safe(arg: object) -> bool:
    """Whether ``arg`` is one kernel argument made of shell-inert characters only."""
    return isinstance(arg, str) and ARG_SAFE.match(arg) is not None


def unsafe(args: Iterable[object]) -> list[object]:
    """The arguments that are not shell-inert, in order."""
    return [a for a in args if not is_safe(a)]
