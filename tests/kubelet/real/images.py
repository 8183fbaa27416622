"""The two images the real-kubelet tests import with ``ctr`` (no registry, nothing downloaded but Debian
packages and PyPI wheels through their own clients): the pod sandbox's pause image (lowtail's own static
pause binary, built by scripts/kubelet-equipment.sh) and the pod image (a Debian bookworm minbase root
filesystem made with debootstrap, numpy/psutil/OpenVINO at the versions python/constraints.txt pins,
installed with pip, and this repository's lowtail package with the in-pod probe).

Each is an OCI image layout archive under build/kubelet/images/, named by a hash of what goes into it,
so an unchanged input is built once: the root filesystem (the package list), the Python dependencies
(the pins) and lowtail's layer (its sources) are separate layers, and only lowtail's is rebuilt when
lowtail changes.

Run as ``python -m tests.kubelet.real.images`` (``make kubelet-equipment``) to build both ahead of the
tests; it prints their references.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
OUT = ROOT / "build" / "kubelet" / "images"
PAUSE_BIN = ROOT / "build" / "kubelet" / "bin" / "pause"
SUITE = "bookworm"
PACKAGES = "python3"
MIRROR = os.environ.get("LOWTAIL_DEBIAN_MIRROR", "http://deb.debian.org/debian")
# What the in-pod probe imports beyond the standard library (pinned by python/constraints.txt).
PIP_PACKAGES = ("numpy", "psutil", "openvino", "pyyaml")
SITE = "opt/lowtail/site"
PROBE = Path(__file__).with_name("pod_probe.py")


class ImageBuildError(RuntimeError):
    pass


def _run(cmd: list[str], **kw: object) -> None:
    r = subprocess.run(cmd, check=False, capture_output=True, text=True, **kw)  # type: ignore[call-overload]
    if r.returncode != 0:
        raise ImageBuildError(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout}{r.stderr}")


def _hash(*parts: bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(hashlib.sha256(p).digest())
    return h.hexdigest()[:16]


def _tar_dir(src: Path, layer: Path) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    tmp = layer.with_suffix(".tmp")
    _run(["tar", "--numeric-owner", "--sort=name", "--mtime=@0", "-C", str(src), "-cf", str(tmp), "."])
    tmp.rename(layer)


def _base_layer() -> Path:
    """Debian bookworm minbase with python3 (debootstrap, as scripts/sandbox-image.sh makes the sandbox's)."""
    layer = OUT / f"layer-base-{_hash(SUITE.encode(), PACKAGES.encode())}.tar"
    if layer.exists():
        return layer
    if shutil.which("debootstrap") is None:
        raise ImageBuildError("debootstrap is missing: apt-get install debootstrap (make system-deps)")
    with tempfile.TemporaryDirectory(prefix="lowtail-pod-rootfs.") as d:
        rootfs = Path(d) / "rootfs"
        _run(["debootstrap", "--variant=minbase", f"--include={PACKAGES}", SUITE, str(rootfs), MIRROR])
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for f in (rootfs / junk).glob("*"):
                if f.is_file():
                    f.unlink()
        _tar_dir(rootfs, layer)
        _run(["rm", "-rf", "--one-file-system", str(rootfs)])
    return layer


def _deps_layer() -> Path:
    """numpy, psutil, OpenVINO (with their own dependencies) for the bookworm python3, under SITE."""
    constraints = ROOT / "python" / "constraints.txt"
    layer = OUT / f"layer-deps-{_hash(constraints.read_bytes(), ' '.join(PIP_PACKAGES).encode())}.tar"
    if layer.exists():
        return layer
    if sys.version_info[:2] != (3, 11):
        raise ImageBuildError(
            f"the pod image's python3 is bookworm's 3.11 but this venv's is {sys.version.split()[0]}: "
            "pip would pick wheels the pod cannot import; build the venv with Python 3.11"
        )
    with tempfile.TemporaryDirectory(prefix="lowtail-pod-deps.") as d:
        target = Path(d) / SITE
        # This venv's Python is 3.11 on a glibc no newer than bookworm's 2.36 (the test host is
        # bookworm), as the pod image's python3 is: the wheels pip picks here run there.
        _run(
            [
                sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                "--no-compile", "--only-binary=:all:", "--target", str(target), "-c", str(constraints),
                *PIP_PACKAGES,
            ]
        )  # fmt: skip
        _tar_dir(Path(d), layer)
    return layer


def _lowtail_layer() -> Path:
    """This repository's lowtail package and the probe the pod runs."""
    sources = [*sorted((ROOT / "python" / "lowtail").rglob("*.py")), PROBE]
    layer = OUT / f"layer-lowtail-{_hash(*(p.read_bytes() for p in sources))}.tar"
    if layer.exists():
        return layer
    OUT.mkdir(parents=True, exist_ok=True)
    tmp = layer.with_suffix(".tmp")
    with tarfile.open(tmp, "w") as t:
        pkg = ROOT / "python" / "lowtail"
        for p in sorted(pkg.rglob("*")):
            if "__pycache__" in p.parts:
                continue
            t.add(p, arcname=f"{SITE}/lowtail/{p.relative_to(pkg)}", recursive=False)
        t.add(PROBE, arcname="opt/lowtail/pod_probe.py")
    tmp.rename(layer)
    return layer


def _file_layer(name: str, data: bytes, mode: int = 0o755) -> Path:
    layer = OUT / f"layer-{name}-{_hash(data)}.tar"
    if not layer.exists():
        OUT.mkdir(parents=True, exist_ok=True)
        tmp = layer.with_suffix(".tmp")
        with tarfile.open(tmp, "w") as t:
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), mode
            t.addfile(info, io.BytesIO(data))
        tmp.rename(layer)
    return layer


def _digest(path: Path) -> tuple[str, int]:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return f"sha256:{h.hexdigest()}", path.stat().st_size


def oci_archive(name: str, layers: list[Path], config: dict[str, object]) -> tuple[str, Path]:
    """An OCI image layout archive of uncompressed ``layers``; returns (reference, archive). The tag
    hashes the layers and the config, so an archive already built is reused."""
    digests = [_digest(p) for p in layers]
    image_config = {
        "architecture": "amd64",
        "os": "linux",
        "config": config,
        "rootfs": {"type": "layers", "diff_ids": [d for d, _ in digests]},
    }
    config_bytes = json.dumps(image_config, sort_keys=True).encode()
    tag = _hash(config_bytes)
    ref = f"lowtail.test/{name}:{tag}"
    archive = OUT / f"{name}-{tag}.oci.tar"
    if archive.exists():
        return ref, archive
    config_digest = f"sha256:{hashlib.sha256(config_bytes).hexdigest()}"
    manifest = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {
                "mediaType": "application/vnd.oci.image.config.v1+json",
                "digest": config_digest,
                "size": len(config_bytes),
            },
            "layers": [
                {"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": d, "size": s}
                for d, s in digests
            ],
        },
        sort_keys=True,
    ).encode()
    manifest_digest = f"sha256:{hashlib.sha256(manifest).hexdigest()}"
    index = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.index.v1+json",
            "manifests": [
                {
                    "mediaType": "application/vnd.oci.image.manifest.v1+json",
                    "digest": manifest_digest,
                    "size": len(manifest),
                    "platform": {"architecture": "amd64", "os": "linux"},
                    "annotations": {
                        "io.containerd.image.name": ref,
                        "org.opencontainers.image.ref.name": tag,
                    },
                }
            ],
        }
    ).encode()
    tmp = archive.with_suffix(".tmp")
    with tarfile.open(tmp, "w") as t:

        def add_bytes(arcname: str, data: bytes) -> None:
            info = tarfile.TarInfo(arcname)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))

        add_bytes("oci-layout", b'{"imageLayoutVersion": "1.0.0"}')
        add_bytes("index.json", index)
        add_bytes(f"blobs/sha256/{manifest_digest[7:]}", manifest)
        add_bytes(f"blobs/sha256/{config_digest[7:]}", config_bytes)
        for p, (d, _) in zip(layers, digests, strict=True):
            t.add(p, arcname=f"blobs/sha256/{d[7:]}")
    tmp.rename(archive)
    return ref, archive


def pause_image() -> tuple[str, Path]:
    OUT.mkdir(parents=True, exist_ok=True)
    layer = _file_layer("pause", PAUSE_BIN.read_bytes())
    return oci_archive("pause", [layer], {"Entrypoint": ["/pause"]})


def pod_image() -> tuple[str, Path]:
    OUT.mkdir(parents=True, exist_ok=True)
    layers = [_base_layer(), _deps_layer(), _lowtail_layer()]
    config = {
        "Cmd": ["/usr/bin/python3", "/opt/lowtail/pod_probe.py"],
        "Env": [f"PYTHONPATH=/{SITE}", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
    }
    return oci_archive("pod", layers, config)


def prune() -> None:
    """Remove archives and layers no current input names (earlier lowtail sources)."""
    keep = {pause_image()[1], pod_image()[1], _base_layer(), _deps_layer(), _lowtail_layer()}
    keep.add(_file_layer("pause", PAUSE_BIN.read_bytes()))
    for p in OUT.iterdir():
        if p not in keep:
            p.unlink()


if __name__ == "__main__":
    try:
        for ref, archive in (pause_image(), pod_image()):
            print(f"{ref} {archive}")
        prune()
    except ImageBuildError as e:
        print(f"kubelet images: {e}", file=sys.stderr)
        sys.exit(1)
