"""Benchmarks behind ``lowtail bench NAME``: each module's ``register(subparsers)`` adds one.

A benchmark compares designs side by side in one run and reports ratios with sample counts as a table,
JSON and a plot; it is a command with a report, never a test with a time limit.
"""
