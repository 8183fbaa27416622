"""A private containerd and a standalone kubelet, built from their Go modules (build/kubelet/), for tests.

Everything lives under one state directory (``/run/lowtail-kubelet-test/<pid>``): containerd's root,
state, sockets and runc's state; the kubelet's root dir, static pod manifests, pod logs and
certificates; and a cgroup subtree of its own (``cgroupRoot``) in every cgroup v1 hierarchy. The kubelet
runs in a mount namespace of its own in which the kernel settings it would otherwise change on the host
(``vm.overcommit_memory``, ``kernel.panic``, ``kernel.panic_on_oops``: kubelet's "kernel tunables") are
bind-mounted files in the state directory, and so are ``/var/log`` (kubelet links every container's
log under ``/var/log/containers``) and ``/var/lib`` (it keeps device-plugins/ under /var/lib/kubelet
whatever its root dir). ``Stack.close`` stops everything it started by pid,
unmounts what is mounted under the state directory and removes it, the cgroups included.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[3]
EQUIPMENT = ROOT / "build" / "kubelet"
BIN = EQUIPMENT / "bin"
RUN_BASE = Path("/run/lowtail-kubelet-test")
CGROUP_FS = Path("/sys/fs/cgroup")
# The cgroup v1 hierarchies kubelet's cgroupfs driver needs (pids, hugetlb are optional for it).
CGROUP_CONTROLLERS = ("cpu", "cpuacct", "cpuset", "memory", "pids", "blkio", "devices", "freezer", "systemd")
# kubelet's KernelTunableModify settings (pkg/kubelet/cm/container_manager_linux.go): what it would
# write to the host's /proc/sys unless these are private files.
KERNEL_TUNABLES = ("vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic", "kernel/panic_on_oops")


class EquipmentMissing(RuntimeError):
    pass


class Fatal(RuntimeError):
    """Raised by a wait_for check: stop waiting at once (the process waited on has exited)."""


def manifest() -> dict[str, Any]:
    """build/kubelet/manifest.json: what each binary was built from (scripts/kubelet-equipment.sh)."""
    path = EQUIPMENT / "manifest.json"
    if not path.exists():
        raise EquipmentMissing(f"{path} is missing: run `make kubelet-equipment` first")
    data: dict[str, Any] = json.loads(path.read_text())
    for b in data["binaries"]:
        if not (BIN / b["name"]).is_file():
            raise EquipmentMissing(f"{BIN / b['name']} is missing: run `make kubelet-equipment`")
    return data


def kubelets() -> dict[str, str]:
    """Built kubelets: binary name (kubelet-1.37) -> upstream version (v1.37.2)."""
    return {b["name"]: b["version"] for b in manifest()["binaries"] if b["name"].startswith("kubelet-")}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(what: str, check: Callable[[], Any], timeout_s: float, interval_s: float = 0.5) -> Any:
    """check()'s first truthy result, or TimeoutError naming ``what`` and the last error seen."""
    deadline = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < deadline:
        try:
            got = check()
            if got:
                return got
        except Fatal:
            raise
        except Exception as e:
            last = e
        time.sleep(interval_s)
    raise TimeoutError(f"{what} did not happen within {timeout_s:.0f} s (last error: {last!r})")


def _stop_pid(pid: int, grace_s: float = 20.0) -> None:
    """SIGTERM, then SIGKILL after ``grace_s``: one process we started (or our containerd started)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not Path(f"/proc/{pid}").exists() or _zombie(pid):
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


@dataclass
class Running:
    """A process of the stack: its Popen and where its output goes."""

    proc: subprocess.Popen[bytes]
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


class Stack:
    """One private containerd and at most one kubelet at a time (see the module docstring)."""

    def __init__(self) -> None:
        RUN_BASE.mkdir(mode=0o700, exist_ok=True)
        self.base = RUN_BASE / str(os.getpid())
        if self.base.exists():
            raise RuntimeError(f"{self.base} exists: a run of this pid was not cleaned up; remove it")
        self.base.mkdir(mode=0o700)
        # containerd's content store and snapshots (the pod image unpacked, some hundred MB) go on
        # disk: /run is a small tmpfs on most hosts.
        self.disk = EQUIPMENT / "run" / str(os.getpid())
        if self.disk.exists():
            raise RuntimeError(f"{self.disk} exists: a run of this pid was not cleaned up; remove it")
        self.disk.mkdir(parents=True)
        self.cgroup = f"lowtail-kubelet-test-{os.getpid()}"
        self.containerd: Running | None = None
        self.kubelet: Running | None = None
        self.service: tuple[Path, Path, str] | None = None
        self.kubelet_root = self.base / "kubelet"
        self.manifests = self.base / "manifests"
        self.pod_logs = self.base / "pod-logs"
        for d in (
            self.kubelet_root,
            self.manifests,
            self.pod_logs,
            self.base / "var-log" / "containers",
            self.base / "var-lib",
        ):
            d.mkdir(parents=True)
        self.socket = self.base / "containerd.sock"
        self.port = free_port()
        self.healthz_port = free_port()
        self._make_cgroups()

    # --- cgroups ---------------------------------------------------------------------------------------

    def _make_cgroups(self) -> None:
        for c in CGROUP_CONTROLLERS:
            d = CGROUP_FS / c / self.cgroup
            if not (CGROUP_FS / c).is_dir():
                continue
            d.mkdir()
            if c == "cpuset":  # a new v1 cpuset is empty: no task may join until it has CPUs and nodes
                for f in ("cpuset.cpus", "cpuset.mems"):
                    (d / f).write_text((CGROUP_FS / c / f).read_text())

    def _remove_cgroups(self) -> list[str]:
        """Our cgroup subtree in every hierarchy, the ones the kubelet made itself included (on this
        hybrid host libcontainer also makes it in the cgroup v2 ``unified`` one)."""
        left = []
        for top in sorted(CGROUP_FS.glob(f"*/{self.cgroup}")):
            for d in [*sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)), top]:
                try:
                    d.rmdir()
                except OSError as e:
                    left.append(f"{d}: {e}")
        return left

    # --- containerd --------------------------------------------------------------------------------------

    def containerd_config(self, sandbox_image: str) -> str:
        b = self.base
        runtime = "plugins.'io.containerd.cri.v1.runtime'"
        return f"""version = 4
root = "{self.disk}/containerd-root"
state = "{b}/containerd/state"
temp = "{b}/containerd/tmp"
# Nothing from the host's /etc/containerd.
imports = []
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.blockfile",
  "io.containerd.snapshotter.v1.erofs", "io.containerd.differ.v1.erofs",
  "io.containerd.nri.v1.nri", "io.containerd.tracing.processor.v1.otlp"]

[plugins.'io.containerd.server.v1.grpc']
  address = "{self.socket}"

[plugins.'io.containerd.server.v1.ttrpc']
  address = "{self.socket}.ttrpc"

# The shims' sockets (default /run/containerd/s; at most 42 characters).
[plugins.'io.containerd.shim.v1.manager']
  socket_dir = "{b}/s"

[plugins.'io.containerd.internal.v1.opt']
  path = "{b}/containerd/opt"

[plugins.'io.containerd.image-verifier.v1.bindir']
  bin_dir = "{b}/containerd/image-verifier"

[plugins.'io.containerd.grpc.v1.cri']
  disable_tcp_service = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"

[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "{sandbox_image}"

[{runtime}]
  cdi_spec_dirs = []
  # Containers get the oom_score_adj the kubelet asks for (-998 for the sandbox, -997 for a Guaranteed
  # container) only with CAP_SYS_RESOURCE, which root lacks on some test hosts (this one): containerd's
  # option for that case raises each to containerd's own.
  restrict_oom_score_adj = true
  [{runtime}.containerd]
    default_runtime_name = "runc"
    [{runtime}.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [{runtime}.containerd.runtimes.runc.options]
        BinaryName = "{BIN / "runc"}"
        Root = "{b}/runc"
        SystemdCgroup = false
  [{runtime}.cni]
    bin_dirs = ["{b}/cni/bin"]
    conf_dir = "{b}/cni/conf"
"""

    def start_containerd(self, sandbox_image: str, affinity: set[int] | None = None) -> None:
        """containerd on its own socket; ``affinity`` confines it (and so its shims and runc) as
        systemd.cpu_affinity= confines every service on a lowtail node."""
        conf = self.base / "containerd.toml"
        conf.write_text(self.containerd_config(sandbox_image))
        log = self.base / "containerd.log"
        env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"}

        confine = ["taskset", "--cpu-list", ",".join(map(str, sorted(affinity)))] if affinity else []
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [*confine, str(BIN / "containerd"), "--config", str(conf), "--log-level", "info"],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        self.containerd = Running(proc, log)
        wait_for("containerd's socket", lambda: self.ctr("version").returncode == 0, 60)

    def ctr(
        self, *args: str, namespace: str = "k8s.io", timeout: float = 600
    ) -> subprocess.CompletedProcess[str]:
        if self.containerd is not None and self.containerd.proc.poll() is not None:
            raise RuntimeError(
                f"containerd exited ({self.containerd.proc.returncode}): {self.containerd.output()[-3000:]}"
            )
        return subprocess.run(
            [str(BIN / "ctr"), "--address", str(self.socket), "--namespace", namespace, *args],
            check=False,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def import_image(self, archive: Path) -> None:
        r = self.ctr("images", "import", "--no-unpack=false", str(archive))
        if r.returncode != 0:
            raise RuntimeError(f"ctr images import {archive} failed ({r.returncode}): {r.stderr}{r.stdout}")

    # --- kubelet -----------------------------------------------------------------------------------------

    def base_config(self) -> dict[str, Any]:
        """The standalone kubelet's own settings, the file before lowtail (what kubeadm would have
        written on a real node): no API server, static pods, the cgroupfs driver on this cgroup v1 host."""
        return {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "cgroupDriver": "cgroupfs",
            "cgroupRoot": f"/{self.cgroup}",
            # The host is cgroup v1: kubelet 1.35 and later refuse to start on it without this.
            "failCgroupV1": False,
            "failSwapOn": False,
            "containerRuntimeEndpoint": f"unix://{self.socket}",
            "staticPodPath": str(self.manifests),
            "fileCheckFrequency": "1s",
            "podLogsDir": str(self.pod_logs),
            "address": "127.0.0.1",
            "port": self.port,
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": self.healthz_port,
            "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
            "authorization": {"mode": "AlwaysAllow"},
            "resolvConf": "/etc/resolv.conf",
        }

    def kubelet_argv(self, binary: Path, config: Path) -> list[str]:
        """The kubelet's command line, in a mount namespace of its own (see the module docstring)."""
        tunables = self.base / "proc-sys"
        mounts = []
        for t in KERNEL_TUNABLES:
            f = tunables / t.replace("/", "_")
            if not f.exists():
                tunables.mkdir(exist_ok=True)
                f.write_text(Path("/proc/sys", t).read_text())
            mounts.append(f"mount --bind {f} /proc/sys/{t}")
        # kubelet writes under /var/lib/kubelet whatever --root-dir says (device-plugins/, and pki/
        # unless --cert-dir) and links container logs under /var/log/containers: both are the state
        # directory's in its namespace.
        mounts.append(f"mount --bind {self.base / 'var-log'} /var/log")
        mounts.append(f"mount --bind {self.base / 'var-lib'} /var/lib")
        args = [
            str(binary),
            f"--config={config}",
            f"--root-dir={self.kubelet_root}",
            f"--cert-dir={self.base / 'pki'}",
            "--hostname-override=lowtail-real-kubelet",
            "--v=2",
        ]
        script = " && ".join(mounts) + ' && exec "$@"'
        return ["unshare", "--mount", "--propagation", "slave", "sh", "-c", script, "kubelet", *args]

    def start_kubelet(self, binary: Path, config: Path) -> Running:
        assert self.kubelet is None or self.kubelet.proc.poll() is not None, "a kubelet is running"
        log = self.base / f"kubelet-{time.monotonic_ns()}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                self.kubelet_argv(binary, config),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.kubelet = Running(proc, log)
        return self.kubelet

    def install_systemctl(self, unit: str, binary: Path, config: Path) -> Path:
        """The systemctl stand-in (systemctl.py) for ``unit`` running this kubelet on ``config``, in a
        directory to put first on PATH; returns the directory."""
        d = self.base / "systemctl"
        d.mkdir(exist_ok=True)
        state = d / "state.json"
        log = self.base / f"{unit}.log"
        state.write_text(
            json.dumps({"unit": unit, "argv": self.kubelet_argv(binary, config), "log": str(log)})
        )
        tool = d / "systemctl"
        tool.write_text(
            "#!/usr/bin/env python3\n"
            + Path(__file__).with_name("systemctl.py").read_text().replace("@STATE@", str(state))
        )
        tool.chmod(0o755)
        self.service = (tool, log, unit)
        return d

    def systemctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        assert self.service is not None, "install_systemctl first"
        return subprocess.run(
            [str(self.service[0]), *args], check=False, capture_output=True, text=True, timeout=120
        )

    def stop_kubelet(self) -> None:
        if self.kubelet is not None and self.kubelet.proc.poll() is None:
            _stop_pid(self.kubelet.proc.pid)
            self.kubelet.proc.wait(timeout=30)

    def healthz(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.healthz_port}/healthz", timeout=5) as r:
            return r.read().decode()

    def configz(self) -> dict[str, Any]:
        """/configz on kubelet's authenticated port (anonymous + AlwaysAllow here: no API server)."""
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        with urllib.request.urlopen(f"https://127.0.0.1:{self.port}/configz", timeout=5, context=ctx) as r:
            data: dict[str, Any] = json.loads(r.read())
        return data

    def wait_healthy(self, timeout_s: float = 180) -> dict[str, Any]:
        """/healthz answering ok and /configz readable, or an error with kubelet's log tail."""
        k = self.kubelet
        assert k is not None

        def ready() -> dict[str, Any] | None:
            if k.proc.poll() is not None:
                raise KubeletExited(k.proc.returncode, k.output())
            return self.configz() if self.healthz() == "ok" else None

        try:
            got: dict[str, Any] = wait_for("kubelet /healthz and /configz", ready, timeout_s)
        except KubeletExited:
            raise
        except TimeoutError as e:
            raise TimeoutError(f"{e}; kubelet's log ends:\n{k.output()[-6000:]}") from None
        return got

    def wait_exit(self, timeout_s: float = 120) -> tuple[int, str]:
        """kubelet's exit status and log once it exits (a refused configuration)."""
        k = self.kubelet
        assert k is not None
        try:
            rc = k.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise TimeoutError(
                f"kubelet still runs after {timeout_s:.0f} s; its log ends:\n{k.output()[-6000:]}"
            ) from None
        return rc, k.output()

    def write_config(self, name: str, cfg: dict[str, Any]) -> Path:
        path = self.base / name
        path.write_text(yaml.safe_dump(cfg, sort_keys=True))
        return path

    def cpu_manager_state(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads((self.kubelet_root / "cpu_manager_state").read_text())
        return data

    # --- teardown ----------------------------------------------------------------------------------------

    def _our_processes(self) -> list[int]:
        """Processes whose command line names our state directory or socket: containerd's shims and
        anything they left (started by our containerd, so ours to end)."""
        mine = []
        needles = (str(self.base).encode(), str(self.disk).encode())
        for p in Path("/proc").iterdir():
            if not p.name.isdigit() or int(p.name) == os.getpid():
                continue
            with contextlib.suppress(OSError):
                cmdline = (p / "cmdline").read_bytes()
                if any(n in cmdline for n in needles):
                    mine.append(int(p.name))
        return mine

    def _mounts_under_base(self) -> list[str]:
        out = []
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            point = line.split()[4].replace("\\040", " ")
            for d in (str(self.base), str(self.disk)):
                if point == d or point.startswith(f"{d}/"):
                    out.append(point)
        return out

    def remove_static_pods(self, timeout_s: float = 120) -> None:
        for f in self.manifests.iterdir():
            f.unlink()
        if self.kubelet is not None and self.kubelet.proc.poll() is None:
            with contextlib.suppress(TimeoutError, RuntimeError):
                wait_for("the pods' containers to stop", lambda: not self._tasks(), timeout_s)

    def _tasks(self) -> list[str]:
        r = self.ctr("tasks", "ls", "-q")
        return r.stdout.split() if r.returncode == 0 else []

    def close(self) -> list[str]:
        """Stop and remove everything; returns what could not be removed (empty: nothing left)."""
        problems: list[str] = []
        with contextlib.suppress(Exception):
            self.remove_static_pods()
        self.stop_kubelet()
        if self.service is not None:
            with contextlib.suppress(Exception):
                self.systemctl("stop", self.service[2])
        if self.containerd is not None and self.containerd.proc.poll() is None:
            for task in self._tasks():
                self.ctr("tasks", "kill", "-s", "SIGKILL", task)
                self.ctr("tasks", "delete", "-f", task)
            _stop_pid(self.containerd.proc.pid)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.containerd.proc.wait(timeout=30)
        for pid in self._our_processes():
            _stop_pid(pid, grace_s=5)
        for point in sorted(self._mounts_under_base(), key=len, reverse=True):
            r = subprocess.run(["umount", "--lazy", point], check=False, capture_output=True, text=True)
            if r.returncode != 0:
                problems.append(f"umount {point}: {r.stderr.strip()}")
        problems += self._remove_cgroups()
        if not problems:
            for d in (self.base, self.disk):
                subprocess.run(["rm", "-rf", "--one-file-system", str(d)], check=False)
            for d in (RUN_BASE, self.disk.parent):
                with contextlib.suppress(OSError):
                    d.rmdir()
        left = [str(p) for p in self._our_processes()]
        if left:
            problems.append(f"processes still running: {left}")
        return problems


class KubeletExited(Fatal):
    def __init__(self, rc: int, log: str) -> None:
        super().__init__(f"kubelet exited with status {rc}; its log ends:\n{log[-6000:]}")
        self.rc = rc
        self.log = log


# Where a kubelet or containerd writes by default: none of them may appear on the host because of a run.
HOST_PATHS = (
    "/var/lib/kubelet",
    "/var/log/containers",
    "/var/log/pods",
    "/etc/kubernetes",
    "/run/containerd",
    "/var/lib/containerd",
    "/opt/containerd",
    "/run/nri",
    "/var/run/nri",
)


@contextlib.contextmanager
def stack() -> Iterator[Stack]:
    """A Stack, closed however the block ends; fails if anything is left, the stack's own state or a
    default path of the kubelet or containerd that did not exist before."""
    existed = {p for p in HOST_PATHS if os.path.lexists(p)}
    s = Stack()
    try:
        yield s
    finally:
        left = s.close()
        left += [f"{p} was created" for p in HOST_PATHS if p not in existed and os.path.lexists(p)]
        left += [f"{p} is left" for p in CGROUP_FS.glob(f"*/{s.cgroup}")]
        assert not left, f"the kubelet test stack left things behind: {left}"
