"""Fixtures of the real-kubelet tests: the built equipment, the two images, one private containerd for
the session (stack.py), lowtail's plan and its rendered KubeletConfiguration per kubelet."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.kubelet.real import images
from tests.kubelet.real.stack import BIN, ROOT, Stack, kubelets, manifest, stack

VENV_BIN = Path(os.environ.get("VIRTUAL_ENV", ROOT / ".venv")) / "bin"
if not (VENV_BIN / "ansible-playbook").exists():
    VENV_BIN = ROOT / ".venv" / "bin"


def _term_as_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@pytest.fixture(scope="session")
def equipment() -> dict[str, Any]:
    if os.geteuid() != 0:
        pytest.fail("the real-kubelet tests run containerd and kubelet as root: run them as root")
    return manifest()


@pytest.fixture(scope="session")
def plan(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """`lowtail plan` for this host, as JSON (what the runtime role installs as /etc/lowtail/plan.json)."""
    out = tmp_path_factory.mktemp("plan") / "plan.json"
    subprocess.run(
        [sys.executable, "-m", "lowtail.cli", "plan", "-q", "--json", str(out)],
        check=True,
        capture_output=True,
    )
    data: dict[str, Any] = json.loads(out.read_text())
    data["path"] = str(out)
    return data


@pytest.fixture(scope="session")
def kube(equipment: dict[str, Any], plan: dict[str, Any]) -> Iterator[Stack]:
    """The session's containerd with both images imported. It runs confined to the plan's
    housekeeping CPUs, as systemd.cpu_affinity= confines it on a lowtail node. SIGTERM (a CI timeout,
    scripts/run-suites.sh stopping a suite) ends the session like Ctrl-C, so the teardown still runs."""
    previous = signal.signal(signal.SIGTERM, _term_as_interrupt)
    housekeeping = {int(c) for c in cpu_list(plan["housekeeping"])}
    try:
        pause_ref, pause_archive = images.pause_image()
        pod_ref, pod_archive = images.pod_image()
        with stack() as s:
            s.start_containerd(pause_ref, affinity=housekeeping)
            s.import_image(pause_archive)
            s.import_image(pod_archive)
            s.images = {"pause": pause_ref, "pod": pod_ref}  # type: ignore[attr-defined]
            yield s
    finally:
        signal.signal(signal.SIGTERM, previous)


def cpu_list(text: str) -> list[int]:
    out: list[int] = []
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out


def kubelet_version(binary: str) -> str:
    return subprocess.run(
        [str(BIN / binary), "--version"], check=True, capture_output=True, text=True
    ).stdout.strip()


def render(
    kube: Stack,
    binary: str,
    workdir: Path,
    check: list[dict[str, Any]] | None = None,
    before: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]]]:
    """lowtail's rendered file for this host's plan and this kubelet (tests/kubelet/real/render.yml,
    which evaluates roles/lowtail_kubelet's own vars) over ``before`` (default: the standalone kubelet's
    own file), preflight's verdict on it, and preflight's verdicts on the files in ``check``."""
    workdir.mkdir(parents=True, exist_ok=True)
    base = workdir / "base.yaml"
    base.write_text(yaml.safe_dump(kube.base_config() if before is None else before))
    files = []
    for i, cfg in enumerate(check or []):
        f = workdir / f"check-{i}.yaml"
        f.write_text(yaml.safe_dump(cfg))
        files.append(str(f))
    out, verdicts = workdir / "rendered.yaml", workdir / "verdicts.json"
    extra = {
        "kubelet_version": kubelet_version(binary),
        "base_config": str(base),
        "out": str(out),
        "verdicts": str(verdicts),
        "check": files,
    }
    r = playbook("render.yml", extra)
    assert r.returncode == 0, f"render.yml failed:\n{r.stdout[-4000:]}{r.stderr[-2000:]}"
    got = json.loads(verdicts.read_text())
    return yaml.safe_load(out.read_text()), got[str(out)], [got[f] for f in files]


def playbook(
    name: str, extra: dict[str, Any], path_first: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """ansible-playbook on tests/kubelet/real/<name> with the repository's ansible.cfg (its library,
    module_utils and filter plugins); ``path_first`` goes first on PATH (the systemctl stand-in)."""
    path = f"{VENV_BIN}:{os.environ['PATH']}"
    env = {
        **os.environ,
        "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"),
        "PATH": f"{path_first}:{path}" if path_first else path,
    }
    return subprocess.run(
        [str(VENV_BIN / "ansible-playbook"), str(Path(__file__).with_name(name)), "-e", json.dumps(extra)],
        check=False,
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=900,
    )


def built_kubelets() -> list[str]:
    """The kubelet binaries build/kubelet/manifest.json lists (empty until `make kubelet-equipment`)."""
    try:
        return sorted(kubelets(), reverse=True)
    except Exception:
        return ["kubelet-1.37", "kubelet-1.35"]


def newest_claimed(kube: Stack, workdir: Path) -> tuple[str, dict[str, Any]]:
    """The newest built kubelet lowtail claims, and lowtail's rendered file for it."""
    refused = []
    for binary in built_kubelets():
        cfg, verdict, _ = render(kube, binary, workdir / binary)
        if not verdict["problems"]:
            return binary, cfg
        refused.append(f"{binary}: {verdict['problems']}")
    pytest.fail(f"lowtail accepts none of the built kubelets: {refused}")
