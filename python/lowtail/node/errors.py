"""The root of every error lowtail raises, and the exit status the command line gives it.

It lives in ``lowtail.node`` because that package is shipped alone to hosts by Ansible (as
``ansible.module_utils.lowtail``) and must not import anything outside itself; ``lowtail.errors``
re-exports it for the rest of the package.
"""

from __future__ import annotations


class LowtailError(Exception):
    """An error lowtail reports to its user: a message naming the bad value and what was expected.

    ``exit_code`` is the command's exit status when the error ends it: 1 is kept for "a check failed"
    (validate, compare), 2 for bad command-line input, 3 for everything that stopped the work itself.
    """

    exit_code: int = 3
