"""Modules that changed their name keep the old one for a release, as a deprecated alias.

Users' code imports ``lowtail.actors.client`` or ``lowtail.lease``; it keeps working, with a
``DeprecationWarning`` that names the new module. No file stays at the old path (two files named
``worker.py`` in two layers were the reason for the renames): a finder on ``sys.meta_path`` answers the old
names with the new modules, so both names are one module object and ``isinstance`` checks agree.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import ModuleType

RENAMED = {
    "lowtail.lease": "lowtail.node.lease",
    "lowtail.cli.options": "lowtail.options",
    "lowtail.shm.worker": "lowtail.shm.server",
    "lowtail.serve.worker": "lowtail.serve.worker_process",
    "lowtail.serve.worker_child": "lowtail.serve.worker_main",
    "lowtail.serve.metrics": "lowtail.serve.call_stats",
    "lowtail.actors.client": "lowtail.actors.inference_client",
    "lowtail.actors.metrics": "lowtail.actors.metrics_hub",
    "lowtail.validation.echo_worker": "lowtail.validation.echo_server",
    "lowtail.validation.probe_worker": "lowtail.validation.probe_process",
}


class _RenamedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(
        self, fullname: str, path: object = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        return importlib.util.spec_from_loader(fullname, self) if fullname in RENAMED else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = RENAMED[spec.name]
        warnings.warn(
            f"{spec.name} is renamed {new}; the old name will be removed in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        return importlib.import_module(new)

    def exec_module(self, module: ModuleType) -> None:
        pass  # the new module ran already


def install() -> None:
    if not any(isinstance(f, _RenamedFinder) for f in sys.meta_path):
        sys.meta_path.append(_RenamedFinder())
