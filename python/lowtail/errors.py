"""The package's one error root (defined in ``lowtail.node.errors``, which Ansible ships alone)."""

from lowtail.node.errors import LowtailError


class UsageError(LowtailError):
    """Bad input from the command line: exit status 2 with the message."""

    exit_code = 2


__all__ = ["LowtailError", "UsageError"]
