"""The package's one error root (defined in ``lowtail.node.errors``, which Ansible ships alone)."""

from lowtail.node.errors import LowtailError

__all__ = ["LowtailError"]
