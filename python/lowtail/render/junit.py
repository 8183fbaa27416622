"""JUnit XML for CI: each check a test case, so a pipeline (GitLab, Jenkins, GitHub's test reporters)
shows which check failed without reading the log. The schema is the common subset every reader takes:
``testsuites > testsuite > testcase`` with ``failure``, ``error`` or ``skipped`` and ``system-out``."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Iterable
from dataclasses import dataclass

OUTCOMES = ("passed", "failure", "error", "skipped")


@dataclass(frozen=True)
class Case:
    name: str
    outcome: str  # one of OUTCOMES
    message: str = ""  # the one line a reader sees (the reason)
    detail: str = ""  # everything else (evidence), in system-out


def render(suite: str, classname: str, cases: Iterable[Case], seconds: float = 0.0) -> str:
    cases = list(cases)
    for c in cases:
        if c.outcome not in OUTCOMES:
            raise ValueError(f"test case {c.name!r}: outcome {c.outcome!r}, expected one of {OUTCOMES}")
    counts = {o: sum(1 for c in cases if c.outcome == o) for o in OUTCOMES}
    attrs = {
        "name": suite,
        "tests": str(len(cases)),
        "failures": str(counts["failure"]),
        "errors": str(counts["error"]),
        "skipped": str(counts["skipped"]),
        "time": f"{seconds:.3f}",
    }
    root = ET.Element("testsuites", {k: v for k, v in attrs.items() if k != "name"} | {"name": suite})
    ts = ET.SubElement(root, "testsuite", attrs)
    for c in cases:
        tc = ET.SubElement(ts, "testcase", {"classname": classname, "name": c.name, "time": "0"})
        if c.outcome != "passed":
            ET.SubElement(tc, c.outcome, {"message": c.message}).text = c.message
        if c.detail:
            ET.SubElement(tc, "system-out").text = c.detail
    ET.indent(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"
