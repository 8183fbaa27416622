"""lowtail's verdict on every case of the corpus equals what each claimed kubelet's own code answers.

The oracle (tests/kubelet/oracle, built by ``make oracle``) runs one kubelet release's start-up code
over a batch of cases in one process per minor. A disagreement fails showing both answers.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from lowtail.node import kubelet_gates
from lowtail.node import kubelet_options as ko
from tests.kubelet.corpus import Case, cases, lowtail_verdict, write_machines
from tests.kubelet.oracle_minors import MINORS, oracle_path

pytestmark = pytest.mark.slow


def _oracle(minor: str) -> Path:
    path = oracle_path(minor)
    if not path.exists():
        pytest.fail(f"{path} is missing: build the kubelet oracles first (make oracle)", pytrace=False)
    return path


@pytest.fixture(scope="module")
def machines(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return write_machines(tmp_path_factory.mktemp("machines"))


def ask(minor: str, batch: list[Case]) -> dict[str, dict]:
    stdin = "".join(json.dumps(c.to_oracle()) + "\n" for c in batch)
    done = subprocess.run(
        [_oracle(minor)], input=stdin, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, f"oracle {minor} failed (rc {done.returncode}): {done.stderr[-2000:]}"
    answers = [json.loads(line) for line in done.stdout.splitlines()]
    assert [a["id"] for a in answers] == [c.id for c in batch], "the oracle answered other cases"
    return {a["id"]: a for a in answers}


def test_claimed_minors_are_the_oracles() -> None:
    assert [f"1.{m}" for m in sorted(ko.OPTIONS_BY_MINOR)] == list(MINORS)


@pytest.mark.parametrize("minor", MINORS)
def test_the_rows_cite_the_module_the_oracle_is_built_from(minor: str) -> None:
    built = subprocess.run(
        [_oracle(minor), "-version"], capture_output=True, text=True, check=True
    ).stdout.strip()
    m = int(minor.split(".")[1])
    assert ko.SOURCE[m] == built
    assert kubelet_gates.SOURCES[m] == built


@pytest.mark.parametrize("minor", MINORS)
def test_the_gate_table_is_the_releases_own(minor: str) -> None:
    m = int(minor.split(".")[1])
    gates = json.loads(
        subprocess.run([_oracle(minor), "-gates"], capture_output=True, text=True, check=True).stdout
    )
    ours = {name: per[m] for name, per in kubelet_gates.GATES.items() if m in per}
    assert ours == {name: (g["default"], g["locked"]) for name, g in gates.items()}, (
        "python/lowtail/node/kubelet_gates.py is stale: run python tests/kubelet/oracle/gen_gates.py"
    )


@pytest.mark.parametrize("minor", MINORS)
def test_lowtail_agrees_with_the_kubelet_on_every_case(minor: str, machines: dict) -> None:
    version = "v" + ko.SOURCE[int(minor.split(".")[1])].lstrip("v")
    batch = list(cases(version, machines))
    assert len(batch) >= 1000
    assert len({c.id for c in batch}) == len(batch), "case ids must be unique"
    answers = ask(minor, batch)
    disagreements = []
    for case in batch:
        accept, reason = lowtail_verdict(version, case)
        kubelet = answers[case.id]
        if accept != kubelet["accept"]:
            theirs = "accepts" if kubelet["accept"] else "refuses: " + kubelet["reason"]
            ours = "accepts" if accept else "refuses: " + reason
            disagreements.append(f"{case.id}:\n  kubelet {minor}: {theirs}\n  lowtail: {ours}")
    refused = sum(not a["accept"] for a in answers.values())
    assert not disagreements, f"{len(disagreements)} of {len(batch)} cases disagree:\n" + "\n".join(
        disagreements
    )
    # The corpus exercises both answers.
    assert 0.2 < refused / len(batch) < 0.9
