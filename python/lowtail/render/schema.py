"""The two fields every lowtail JSON report starts with: what it is (``schema``, ``schema_version``) and
which lowtail wrote it (``lowtail_version``), so a reader can refuse a report it does not understand."""

from __future__ import annotations

from typing import Any

from lowtail import __version__


def stamp(kind: str, version: int = 1) -> dict[str, Any]:
    """``{"schema": "lowtail.KIND", "schema_version": N, "lowtail_version": ...}``; bump N when a field's
    meaning changes or a field is removed (adding one is compatible)."""
    return {"schema": f"lowtail.{kind}", "schema_version": version, "lowtail_version": __version__}
