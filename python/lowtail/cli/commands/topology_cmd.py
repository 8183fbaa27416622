"""``lowtail topology`` and ``lowtail plan``."""

from __future__ import annotations

import argparse
from typing import Any

from lowtail.errors import UsageError
from lowtail.node import cpulist
from lowtail.node.plan import Plan, PlanError, make_plan
from lowtail.node.topology import Topology, TopologyError, read_topology
from lowtail.options import add_json, json_to_stdout, write_json
from lowtail.render import console, table
from lowtail.render.schema import stamp


def add_root_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sysfs-root", default="/sys", help="read sysfs under DIR (a fixture tree)")
    p.add_argument("--procfs-root", default="/proc", help="read procfs under DIR (a fixture tree)")


def load_topology(args: argparse.Namespace) -> Topology:
    try:
        return read_topology(args.sysfs_root, args.procfs_root)
    except (TopologyError, cpulist.CpuListError) as e:
        raise UsageError(str(e)) from None


def register(sub: Any) -> None:
    p = sub.add_parser("topology", help="show the CPU topology and any sign of virtualization")
    add_root_args(p)
    add_json(p, "the topology")
    p.set_defaults(func=run_topology)

    p = sub.add_parser("plan", help="compute housekeeping and isolated CPUs and the kernel arguments")
    add_root_args(p)
    p.add_argument(
        "--housekeeping",
        default="auto",
        metavar="auto|N|CPULIST",
        help="auto (one L3 group per socket), N whole cores per socket, or an explicit cpulist",
    )
    add_json(p, "the plan")
    p.set_defaults(func=run_plan)


def run_topology(args: argparse.Namespace) -> int:
    topo = load_topology(args)
    d = topo.to_dict()
    if not json_to_stdout(args):  # the table first: a file that cannot be written never hides it
        _print_topology(topo, d)
    write_json(args.json, {**stamp("topology"), **d})
    console.wrote(args)
    return 0


def _print_topology(topo: Topology, d: dict[str, Any]) -> None:
    print(
        table.render(
            ["model", "vendor", "sockets", "numa nodes", "cores/socket", "threads/core", "online"],
            [
                [
                    d["model_name"],
                    topo.vendor,
                    d["sockets"],
                    d["numa_nodes"],
                    d["cores_per_socket"],
                    d["threads_per_core"],
                    d["online"],
                ]
            ],
            title="Machine",
        )
    )
    print()
    rows = []
    for i, group in enumerate(topo.l3_groups):
        first = topo.by_cpu()[min(group)]
        rows.append([i, first.socket, first.node, cpulist.format(group), len(group)])
    print(table.render(["l3", "socket", "node", "cpus", "n"], rows, title="L3 groups (a CCD on Zen)"))
    print()
    print(f"kernel isolated: {d['isolated'] or '-'}    nohz_full: {d['nohz_full'] or '-'}")
    if topo.findings:
        print()
        print(
            table.render(
                ["finding", "deceptive", "evidence"],
                [[f.code, "yes" if f.deceptive else "no", f.detail] for f in topo.findings],
                title="Virtualization "
                + ("(topology is made up)" if topo.deceptive else "(topology is plausible)"),
            )
        )
    else:
        print("no sign of virtualization")


def run_plan(args: argparse.Namespace) -> int:
    topo = load_topology(args)
    try:
        plan = make_plan(topo, args.housekeeping)
    except PlanError as e:
        raise UsageError(str(e)) from None
    # Stamped like every report; plan readers (Plan.from_dict, hence validate --plan and the lease
    # allocator) read their fields by name and ignore the stamp.
    if not json_to_stdout(args):
        _print_plan(plan)
    write_json(args.json, {**stamp("plan"), **plan.to_dict()})
    console.wrote(args)
    return 0


def _print_plan(plan: Plan) -> None:
    print(
        table.render(
            ["node", "housekeeping", "isolated"],
            [
                [n, cpulist.format(hk) or "-", cpulist.format(iso) or "-"]
                for n, (hk, iso) in sorted(plan.per_node.items())
            ],
            title=f"CPU plan (housekeeping {plan.spec}): {len(plan.housekeeping)} housekeeping, "
            f"{len(plan.isolated)} isolated",
        )
    )
    print()
    print(
        table.render(
            ["l3", "socket", "node", "isolated pool"],
            [[p.index, p.socket, p.node, cpulist.format(p.isolated) or "-"] for p in plan.l3_pools],
            title="Lease pools per L3 group",
        )
    )
    print()
    print("Kernel arguments:")
    for arg in plan.kernel_args:
        print(f"  {arg}")
