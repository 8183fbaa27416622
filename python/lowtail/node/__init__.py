"""What a node is and how its CPUs are split: cpulist format, topology from sysfs, the CPU plan.

Standard library only: Ansible ships this package to hosts (module_utils/lowtail links here)."""
