"""The serial rollout's failure paths, end to end over local connections against fixture machines.

A host that fails or becomes unreachable stops the rollout before the next batch; the other hosts of
its batch finish their own change (their live tuning applied); a rerun after a failure applies the
tuning the failed run did not. Live tuning runs against stand-in sysctl / systemd-tmpfiles /
systemctl first on PATH, which log their calls, and files redirected into the test's directory, so
nothing here touches this machine.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.ansible.conftest import ROOT, ansible_env
from tests.ansible.test_kubelet_preflight import KUBEADM, run_preflight
from tests.ansible.test_site_playbook import GOOD, recap_line, write_inventory

# Logs its name and arguments, one call a line, and succeeds (sysctl -p, systemd-tmpfiles --create and
# systemctl daemon-reexec print nothing on success).
STANDIN = """#!/bin/sh
echo "$(basename "$0") $*" >> {log}
"""


def provision_output(out: str) -> str:
    return out[out.index("PLAY [Provision") :]


def ansible_playbook(*args: str, bin_dir: Path | None = None) -> tuple[int, str]:
    """ansible-playbook from the repository root, with `bin_dir` (the stand-ins) first on PATH."""
    env = ansible_env()
    if bin_dir is not None:
        env["PATH"] = f"{bin_dir}:{env['PATH']}"
    result = subprocess.run(
        ["ansible-playbook", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    return result.returncode, result.stdout + result.stderr


def run(inventory: Path, tmp_path: Path, *extra: str) -> tuple[int, str]:
    return ansible_playbook("-i", str(inventory), "site.yml", *extra, bin_dir=tmp_path / "bin")


@pytest.mark.slow
def test_unreachable_host_stops_the_rollout_before_the_next_batch(
    tmp_path: Path, machine_roots: dict[str, tuple[Path, Path]]
) -> None:
    """Serial 2 over 3 hosts: a-lost's connection drops after preflight (as a host whose reboot does not
    come back, or whose drain delegate is down). Ansible counts it unreachable, not failed, so
    max_fail_percentage alone would start the second batch."""
    lost = {
        **GOOD,
        # Preflight reaches it; from the provision play's first fact on, it answers as a closed SSH
        # port (the play's first tasks are set_fact, which connect nowhere).
        "ansible_connection": "{{ 'ssh' if __lowtail_provision_reboot_ok is defined else 'local' }}",
        "ansible_host": "127.0.0.1",
        "ansible_port": 9,
    }
    inventory = write_inventory(
        tmp_path,
        machine_roots,
        {"a-lost": lost, "b-ok": GOOD, "c-next": GOOD},
    )
    rc, out = ansible_playbook(
        "-i", str(inventory), "site.yml", "playbooks/runtime.yml", "--check", "-e", "lowtail_serial=2"
    )
    assert rc != 0, out
    provision = provision_output(out)
    assert "UNREACHABLE" in provision and "unreachable=1" in recap_line(out, "a-lost"), out
    words = " ".join(provision.split())
    assert "stopping the rollout before the next batch: a-lost failed or became unreachable" in words, out
    # The second batch never started.
    assert "[c-next]" not in provision, provision
    # b-ok, its batch neighbour, finished its own change and is not failed for a-lost's sake.
    assert "fatal: [b-ok]" not in provision and "ok: [b-ok]" in provision, provision
    # The failed run ends there: the runtime playbook on the same command line never starts.
    assert "PLAY [Runtime" not in out, out


def live_tuning_inventory(
    tmp_path: Path, machine_roots: dict[str, tuple[Path, Path]], hosts: dict[str, dict[str, Any]]
) -> tuple[Path, list[str]]:
    """Hosts with live tuning on, against the stand-ins, with every file the roles write in tmp_path."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    log = tmp_path / "calls.log"
    for name in ("sysctl", "systemd-tmpfiles", "systemctl"):
        (bin_dir / name).write_text(STANDIN.format(log=log))
        (bin_dir / name).chmod(0o755)
    etc = tmp_path / "etc"
    for d in ("sysctl.d", "tmpfiles.d"):
        (etc / d).mkdir(parents=True, exist_ok=True)
    private = {
        "__lowtail_tuning_sysctl_file": str(etc / "sysctl.d/60-lowtail.conf"),
        "__lowtail_tuning_tmpfiles_file": str(etc / "tmpfiles.d/lowtail-tuning.conf"),
        "__lowtail_tuning_systemd_dropin": str(etc / "systemd/system.conf.d/60-lowtail-cpu-affinity.conf"),
        "__lowtail_tuning_state_dir": str(tmp_path / "state"),
    }
    live = {
        **GOOD,
        "lowtail_tuning_apply": True,
        "lowtail_tuning_apply_irq_affinity": False,
        "lowtail_tuning_irqbalance": False,
        "lowtail_tuning_fwupd_refresh_off": False,
        "lowtail_kernel_state_dir": str(tmp_path / "state"),
    }
    shutil.rmtree(tmp_path / "hosts", ignore_errors=True)
    inventory = write_inventory(tmp_path, machine_roots, {n: {**live, **h} for n, h in hosts.items()})
    return inventory, ["-e", json.dumps(private)]


def calls(tmp_path: Path) -> list[str]:
    log = tmp_path / "calls.log"
    return log.read_text().splitlines() if log.exists() else []


def break_irq_tree(tmp_path: Path, host: str) -> None:
    """The IRQ move of `host` fails: its procfs tree has no irq directory."""
    shutil.rmtree(tmp_path / "hosts" / host / "proc/irq", ignore_errors=True)


@pytest.mark.slow
def test_a_host_failing_in_its_batch_leaves_the_other_to_finish_with_its_tuning_applied(
    tmp_path: Path, machine_roots: dict[str, tuple[Path, Path]]
) -> None:
    inventory, private = live_tuning_inventory(
        tmp_path, machine_roots, {"a-fails": {"lowtail_tuning_apply_irq_affinity": True}, "b-ok": {}}
    )
    break_irq_tree(tmp_path, "a-fails")
    rc, out = run(inventory, tmp_path, "-e", "lowtail_serial=2", *private)
    assert rc != 0, out
    assert "failed=1" in recap_line(out, "a-fails"), out
    assert "failed=0" in recap_line(out, "b-ok"), out
    # b-ok applied its sysctls, sysfs settings and systemd affinity (both hosts share this machine's
    # files here, so one apply of each; a-fails failed before its own).
    made = calls(tmp_path)
    sysctl_file = json.loads(private[1])["__lowtail_tuning_sysctl_file"]
    assert f"sysctl -e -q -p {sysctl_file}" in made, (made, out)
    assert any(c.startswith("systemd-tmpfiles --create ") for c in made), made
    assert "systemctl daemon-reexec" in made, made


@pytest.mark.slow
def test_rerun_after_a_failure_applies_the_tuning_the_failed_run_did_not(
    tmp_path: Path, machine_roots: dict[str, tuple[Path, Path]]
) -> None:
    inventory, private = live_tuning_inventory(
        tmp_path, machine_roots, {"host": {"lowtail_tuning_apply_irq_affinity": True}}
    )
    break_irq_tree(tmp_path, "host")
    rc, out = run(inventory, tmp_path, *private)
    assert rc != 0 and "failed=1" in recap_line(out, "host"), out
    assert calls(tmp_path) == [], calls(tmp_path)
    # The rerun renders the same files (nothing to notify) and must still apply them.
    fixed = yaml.safe_load(inventory.read_text())
    fixed["all"]["children"]["lowtail_nodes"]["hosts"]["host"]["lowtail_tuning_apply_irq_affinity"] = False
    inventory.write_text(yaml.safe_dump(fixed))
    rc, out = run(inventory, tmp_path, *private)
    assert rc == 0, out
    made = calls(tmp_path)
    assert any(c.startswith("sysctl -e -q -p ") for c in made), (made, out)
    assert "systemctl daemon-reexec" in made, made
    assert "changed=0" not in recap_line(out, "host"), out
    # Applied and recorded: a third run applies nothing again.
    rc, out = run(inventory, tmp_path, *private)
    assert rc == 0 and calls(tmp_path) == made, (calls(tmp_path), out)


@pytest.mark.slow
def test_kubelet_version_failure_names_its_cause(tmp_path: Path) -> None:
    """A kubelet binary that cannot run: the preflight problem says why, not just the return code."""
    missing = tmp_path / "no-such-kubelet"
    rc, out = run_preflight(tmp_path, "1.36.3", KUBEADM, lowtail_kubelet_binary=str(missing))
    assert rc != 0, out
    assert f"kubelet --version failed (rc 2): no output; {missing}: Error executing" in out, out


# systemd-tmpfiles --create FILE for "w" lines, under a fixture sysfs tree: tmpfiles.d(5) "w" writes
# the argument to the file if it exists, and its path may be a shell-style glob. lowtail's file holds
# only "w" lines on /sys (roles/lowtail_tuning/templates); any other line type is refused here.
TMPFILES_STANDIN = """#!{python}
import glob, sys
with open({log!r}, "a") as log:
    log.write("systemd-tmpfiles " + " ".join(sys.argv[1:]) + "\\n")
for line in open(sys.argv[-1]):
    fields = line.split(None, 6)
    if not fields or fields[0].startswith("#"):
        continue
    if fields[0] != "w" or not fields[1].startswith("/sys/") or len(fields) != 7:
        sys.exit("unsupported tmpfiles line: " + line)
    for path in sorted(glob.glob({root!r} + fields[1][len("/sys"):])):
        with open(path, "w") as f:
            f.write(fields[6].strip() + "\\n")
"""

ISOLATED_CPUS = [*range(7, 84), *range(91, 168)]
FULL_MASK = "ff,ffffffff,ffffffff,ffffffff,ffffffff,ffffffff"


def sysfs_before_lowtail(sys_root: Path) -> dict[str, str]:
    """Values a host had before lowtail, none of them lowtail's; relative path -> content."""
    values = {
        "kernel/mm/transparent_hugepage/enabled": "[always] madvise never",
        "kernel/mm/transparent_hugepage/defrag": "always defer defer+madvise [madvise] never",
        "kernel/mm/ksm/run": "1",
        "devices/virtual/workqueue/cpumask": FULL_MASK,
        "bus/workqueue/devices/writeback/cpumask": FULL_MASK,
        "devices/system/machinecheck/machinecheck0/ignore_ce": "0",
        "devices/system/machinecheck/machinecheck1/ignore_ce": "0",
        **{f"devices/system/cpu/cpu{c}/cpufreq/scaling_governor": "schedutil" for c in range(168)},
        **{f"devices/system/cpu/cpu{c}/power/pm_qos_resume_latency_us": "0" for c in ISOLATED_CPUS},
    }
    for rel, value in values.items():
        (sys_root / rel).parent.mkdir(parents=True, exist_ok=True)
        (sys_root / rel).write_text(value + "\n")
    return values


# The tuning role's rollback entry point alone: playbooks/rollback.yml also removes the runtime's
# files under /opt, /etc and /usr/local, which are this machine's own here.
ROLLBACK_TUNING = """
- name: Roll the runtime tuning back
  hosts: lowtail_nodes
  gather_facts: true
  gather_subset: [min]
  tasks:
    - name: Remove lowtail's runtime tuning
      ansible.builtin.include_role:
        name: lowtail_tuning
        tasks_from: rollback
"""


def selected(text: str) -> str:
    """The value a sysfs choice file holds: the bracketed word of "always [madvise] never"."""
    words = text.split()
    return next((w[1:-1] for w in words if w.startswith("[")), text.strip())


@pytest.mark.slow
def test_rollback_restores_the_irq_affinities_and_sysfs_values_lowtail_changed(
    tmp_path: Path, machine_roots: dict[str, tuple[Path, Path]]
) -> None:
    inventory, private = live_tuning_inventory(
        tmp_path, machine_roots, {"host": {"lowtail_tuning_apply_irq_affinity": True}}
    )
    sys_root, proc_root = tmp_path / "hosts/host/sys", tmp_path / "hosts/host/proc"
    before = sysfs_before_lowtail(sys_root)
    shutil.rmtree(proc_root / "irq", ignore_errors=True)
    irqs_before = {0: "0-167", 1: "100-110", 2: "0-3"}
    for irq, cpus in irqs_before.items():
        (proc_root / f"irq/{irq}").mkdir(parents=True)
        (proc_root / f"irq/{irq}/smp_affinity_list").write_text(cpus + "\n")
    (proc_root / "irq/default_smp_affinity").write_text(FULL_MASK + "\n")
    (tmp_path / "bin/systemd-tmpfiles").write_text(
        TMPFILES_STANDIN.format(python=sys.executable, log=str(tmp_path / "calls.log"), root=str(sys_root))
    )
    private_vars = {**json.loads(private[1]), "__lowtail_tuning_irqbalance_env": str(tmp_path / "irqbalance")}

    rc, out = run(inventory, tmp_path, "-e", json.dumps(private_vars))
    assert rc == 0, out
    # lowtail changed them: the governor, THP, KSM, the masks, PM QoS, ignore_ce; IRQs 0 and 1 moved.
    assert (sys_root / "devices/system/cpu/cpu9/cpufreq/scaling_governor").read_text() == "performance\n"
    assert (sys_root / "kernel/mm/ksm/run").read_text() == "2\n"
    assert (proc_root / "irq/1/smp_affinity_list").read_text().strip() == "0-6,84-90"
    assert (proc_root / "irq/2/smp_affinity_list").read_text().strip() == "0-3"  # already housekeeping

    rollback = tmp_path / "rollback.yml"
    rollback.write_text(ROLLBACK_TUNING)
    rc, out = ansible_playbook(
        "-i", str(inventory), str(rollback), "-e", json.dumps(private_vars), bin_dir=tmp_path / "bin"
    )
    assert rc == 0, out
    after = {rel: selected((sys_root / rel).read_text()) for rel in before}
    assert after == {rel: selected(value) for rel, value in before.items()}, out
    assert {
        irq: (proc_root / f"irq/{irq}/smp_affinity_list").read_text().strip() for irq in irqs_before
    } == irqs_before, out
    assert (proc_root / "irq/default_smp_affinity").read_text().strip() == FULL_MASK
    # The records of what was there before are gone with the rest of lowtail's state.
    assert not list((tmp_path / "state").glob("*before-lowtail*")), list((tmp_path / "state").iterdir())
