"""Test-only bytecode cache for code that Python imports from zip files.

Ansible runs every module from a fresh AnsiballZ zip, and zipimport can neither read nor write
``__pycache__``: each module run compiles ``ansible.module_utils.basic`` and its imports again, about a
third of the CPU of a module run on this host. The tests' ``ansible-playbook`` runs put this directory
on ``PYTHONPATH`` (``tests/ansible/conftest.py: ansible_env``), so the processes they start, the
modules of local-connection hosts included, keep the code objects zipimport compiles in
``$LOWTAIL_TEST_ZIP_BYTECODE``, keyed by the source bytes and the bytecode magic number (what a .pyc
file is checked by): the same code objects, compiled once. molecule ``default`` mounts both
directories into its containers, whose modules inherit the environment through nsenter. Nothing
outside the tests loads it: hosts run Ansible's modules as shipped.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import marshal
import os
import sys
import types
import zipimport

_DIR = os.environ.get("LOWTAIL_TEST_ZIP_BYTECODE", "")
_TAG = importlib.util.MAGIC_NUMBER


def _with_filename(code: types.CodeType, filename: str) -> types.CodeType:
    """``code`` and the code objects nested in it, naming ``filename`` (this zip's path) in tracebacks."""
    consts = tuple(
        _with_filename(c, filename) if isinstance(c, types.CodeType) else c for c in code.co_consts
    )
    return code.replace(co_filename=filename, co_consts=consts)


def _install(directory: str) -> None:
    compile_source = zipimport._compile_source  # type: ignore[attr-defined]

    def cached(pathname: str, source: bytes) -> types.CodeType | None:
        path = os.path.join(directory, hashlib.blake2b(source + b"\0" + _TAG, digest_size=20).hexdigest())
        try:
            with open(path, "rb") as f:
                code = marshal.loads(f.read())
            if not isinstance(code, types.CodeType):
                raise ValueError(f"{path} holds no code object")  # any other marshal data: compile again
        except (OSError, ValueError, EOFError, TypeError):
            code = compile_source(pathname, source)
            if code is not None:
                # pid and random bytes: a container's writer has pids of its own namespace
                tmp = f"{path}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
                try:
                    with open(tmp, "wb") as f:
                        f.write(marshal.dumps(code))
                    os.replace(tmp, path)  # whole or absent for a concurrent reader
                except OSError:
                    pass  # a cache that cannot be written only costs the compile
            return code
        return _with_filename(code, pathname)

    zipimport._compile_source = cached  # type: ignore[attr-defined]


if _DIR and os.path.isdir(_DIR) and hasattr(zipimport, "_compile_source"):
    _install(_DIR)

# The interpreter's own sitecustomize (Debian's installs apport's hook), which this one shadows.
_here = os.path.dirname(os.path.abspath(__file__))
_path = sys.path[:]
try:
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
    del sys.modules[__name__]
    importlib.import_module(__name__)
except ImportError:
    pass
finally:
    sys.path[:] = _path
