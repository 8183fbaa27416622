"""A verdict claims no more than was shown: a percentile needs enough samples, compare says worse when
the after report is worse, and an output that cannot be written is refused before any work."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from lowtail.benchmarks.queue_bench import targets
from lowtail.cli.main import main
from lowtail.validation.check import Limits, Status
from lowtail.validation.evidence import beyond, min_samples, shortfall
from lowtail.validation.probes import grade
from tests.cli.test_cli_convention import all_parsers
from tests.validation.conftest import PROBE_CPU


def test_the_sample_minimum_is_where_the_maximum_bounds_the_percentile_with_95_percent() -> None:
    n = min_samples(0.999)
    assert n == 2995
    assert 1 - 0.999**n >= 0.95 > 1 - 0.999 ** (n - 1)  # the rule in docs/validation.md, exactly
    assert (min_samples(0.99), min_samples(0.5)) == (299, 5)
    assert beyond(3000, 0.999) == 3 and beyond(999, 0.999) == 0
    assert shortfall(10, 0.999) == "too few samples for p99.9: n=10, need at least 2,995"
    assert shortfall(2995, 0.999) == ""


def test_a_p999_of_too_few_samples_never_passes() -> None:
    quiet = [0.001] * 10  # far below the limit: only the count is wrong
    check = grade("deschedule", {3: quiet}, Limits(0.1, 1.0), "deschedule")
    assert check.status is Status.WARN
    assert check.reason.startswith("too few samples for p99.9: n=10, need at least 2,995 (CPU 3")  # the cause
    assert "0 samples over 0.1 ms" in check.reason
    assert check.data["enough_samples"] is False and check.data["per_cpu"]["3"]["status"] == "warn"
    enough = grade("deschedule", {3: [0.001] * 3000}, Limits(0.1, 1.0), "deschedule")
    assert enough.status is Status.PASS and enough.reason == ""
    assert "p99.9 rests on 3 beyond it" in enough.evidence[0]


def test_one_cpu_short_of_samples_keeps_the_node_from_passing() -> None:
    check = grade("timer", {1: [0.001] * 3000, 2: [0.001] * 100}, Limits(0.1, 1.0), "timer")
    assert check.status is Status.WARN and "n=100" in check.reason and "(CPU 2" in check.reason


def test_a_failure_on_few_samples_stays_a_failure_and_says_both() -> None:
    check = grade("deschedule", {1: [0.001] * 9 + [5.0]}, Limits(0.1, 1.0), "deschedule")
    assert check.status is Status.FAIL
    assert "too few samples" in check.reason and "deschedule p99.9 5 ms on CPU 1" in check.reason


def test_validate_with_ten_samples_does_not_pass(tmp_path: Path) -> None:
    js = tmp_path / "r.json"
    argv = ["validate", "--only", "deschedule", "--cpus", str(PROBE_CPU), "--samples", "10"]
    rc = main([*argv, "--no-progress", "--threshold", "deschedule=1000:1000", "--json", str(js)])
    doc = json.loads(js.read_text())
    (check,) = doc["checks"]
    assert check["status"] == "warn" and rc == 0  # a warn, never a pass, even under a 1 s limit
    assert check["reason"].startswith("too few samples for p99.9: n=10, need at least 2,995")
    assert doc["summary"]["status"] == "warn"


def _lat(n: int, p50: float = 1.0, p999: float = 2.0) -> dict[str, Any]:
    return {"n": n, "p50_us": p50, "p99_us": p999, "p999_us": p999, "max_us": p999}


def test_bench_queue_does_not_decide_a_p999_target_on_a_quick_run() -> None:
    quick = {"lowtail": _lat(300, 10, 20), "seed_flock_poll": _lat(100, 1000, 5000)}
    by = {t["target"]: t for t in targets(quick, "fifo")}
    t = by["lowtail p99.9 >= 10x lower than seed_flock_poll"]
    assert t["met"] is None and t["why"] == "too few samples for p99.9: n=300, need at least 2,995"
    own = by["lowtail p99.9 within 3x of its own p50 under --priority fifo"]
    assert own["met"] is None and "n=300" in own["why"]
    assert by["lowtail p50 >= 40x lower than seed_flock_poll"]["met"] is True  # a p50 needs 5
    full = {"lowtail": _lat(20000, 10, 20), "seed_flock_poll": _lat(5000, 1000, 5000)}
    assert {t["target"]: t for t in targets(full)}["lowtail p99.9 >= 10x lower than seed_flock_poll"]["met"]
    assert not any("issue" in t["target"] for t in targets(full))


# ---- compare ---------------------------------------------------------------------------------------


def _report(status: str, value: float, host: str = "node-a", version: str = "0.1.0", **extra: Any) -> dict:
    # As validate writes it: the p99.9's 95% interval and the largest samples of all CPUs.
    data = {
        "metric": "p999",
        "ci": [value * 0.9, value * 1.1],
        "all": {"n": 10000, "top": [value * 2] + [value * 1.2] * 31, "block_p50": value},
    }
    check = {
        "name": "deschedule",
        "kind": "probe",
        "status": status,
        "value": value,
        "unit": "ms",
        "data": data,
    }
    head = {"p999_deschedule_ms": value, "n": 10000, "max_ms": value * 2, "cpu": 1, "status": status}
    doc: dict[str, Any] = {
        "schema": "lowtail.validate",
        "schema_version": 1,
        "lowtail_version": version,
        "host": {"hostname": host, "cpu_model": "EPYC", "cpus": 2, "probe_cpus": {"cpus": "1"}},
        "settings": {"samples_per_cpu": 10000, "duration_s": 10.0},
        "checks": [check, {"name": "thp", "kind": "static", "status": "pass", "value": "never"}],
        "summary": {"status": status, "headline": head},
    }
    doc.update(extra)
    return doc


def _compare(tmp_path: Path, before: dict, after: dict, *flags: str) -> tuple[int, str, str]:
    b, a = tmp_path / "b.json", tmp_path / "a.json"
    b.write_text(json.dumps(before))
    a.write_text(json.dumps(after))
    return main(["compare", str(b), str(a), *flags]), str(b), str(a)


def test_compare_says_worse_and_exits_1_on_a_regression(tmp_path: Path, capsys: Any) -> None:
    rc, _, _ = _compare(tmp_path, _report("pass", 0.020), _report("pass", 0.147))
    out = capsys.readouterr().out
    assert rc == 1
    flat = " ".join(out.split())
    assert "headline p99.9 deschedule: 0.02 ms [0.018, 0.022] ms (n=10,000, max 0.04 ms)" in flat
    assert "-> 0.147 ms [0.1323, 0.1617] ms (n=10,000, max 0.294 ms): worse" in flat
    row = next(line for line in out.splitlines() if line.startswith("deschedule "))
    assert "worse: p99.9 0.02 ms [0.018, 0.022] -> 0.147 ms [0.1323, 0.1617], 7.35x" in row
    assert out.splitlines()[0] == "result: WORSE after on deschedule, deschedule max (exit 1)"
    assert "warning" not in out  # same host, version, CPUs and settings


def test_compare_pass_to_fail_exits_1_even_with_a_tolerance(tmp_path: Path, capsys: Any) -> None:
    rc, _, _ = _compare(tmp_path, _report("pass", 0.05), _report("fail", 0.05), "--status-only")
    assert rc == 1 and "worse: pass -> fail" in capsys.readouterr().out


def test_compare_better_and_noise_exit_0(tmp_path: Path, capsys: Any) -> None:
    rc, _, _ = _compare(tmp_path, _report("fail", 450.0), _report("pass", 0.02))
    out = capsys.readouterr().out
    assert rc == 0 and "better: fail -> pass, p99.9 450 ms" in out and "22,500x lower" in out
    rc, _, _ = _compare(tmp_path, _report("pass", 0.020), _report("pass", 0.021))
    assert rc == 0 and "same: within noise: p99.9 0.02 ms [0.018, 0.022]" in capsys.readouterr().out
    # A status that flipped on noise is not worse: the intervals overlap.
    rc, _, _ = _compare(tmp_path, _report("pass", 0.095), _report("warn", 0.105))
    assert rc == 0 and "same: pass -> warn, within noise" in capsys.readouterr().out
    rc, _, _ = _compare(tmp_path, _report("pass", 0.020), _report("pass", 0.03), "--tolerance", "60")
    assert rc == 0
    rc, _, _ = _compare(tmp_path, _report("pass", 0.020), _report("pass", 0.03), "--status-only")
    assert rc == 0 and "values not judged" in capsys.readouterr().out


def test_compare_warns_when_hosts_versions_cpus_or_settings_differ(tmp_path: Path, capsys: Any) -> None:
    after = _report("pass", 0.02, host="node-b", version="0.2.0")
    after["host"]["cpu_model"] = "Xeon"
    after["settings"]["samples_per_cpu"] = 3000
    _compare(tmp_path, _report("pass", 0.02), after)
    out = capsys.readouterr().out
    assert 'warning: host differ: before "node-a", after "node-b"' in out
    assert 'warning: lowtail version differ: before "0.1.0", after "0.2.0"' in out
    assert 'warning: CPU model differ: before "EPYC", after "Xeon"' in out
    assert "warning: probe settings differ" in out and "3000" in out


@pytest.mark.parametrize(
    ("mangle", "message"),
    [
        (lambda d: d.update(checks="oops"), 'checks is "oops", expected a JSON list'),
        (lambda d: d["checks"][0].update(status="great"), 'checks[0].status (deschedule) is "great"'),
        (lambda d: d["checks"].append(3), "checks[2] is 3, expected an object"),
        (lambda d: d["summary"]["headline"].update(n="many"), 'summary.headline.n is "many"'),
        (lambda d: d.update(schema_version=99), "schema_version is 99, expected at most 1"),
        (lambda d: d.update(schema="lowtail.bench"), 'schema is "lowtail.bench"'),
    ],
)
def test_a_malformed_report_is_exit_2_naming_the_field(
    tmp_path: Path, capsys: Any, mangle: Any, message: str
) -> None:
    bad = _report("pass", 0.02)
    mangle(bad)
    rc, _, a = _compare(tmp_path, _report("pass", 0.02), bad)
    err = capsys.readouterr().err
    assert rc == 2 and f"lowtail compare: {a} is not a lowtail validate report: {message}" in err
    assert "Traceback" not in err


# ---- output paths ----------------------------------------------------------------------------------


def _output_options() -> list[tuple[str, str]]:
    found = []
    for p in all_parsers():
        for action in p._actions:
            if getattr(action.type, "lowtail_output", False):
                found.append((p.prog, action.option_strings[0]))
    return found


OUTPUT_WORDS = ("--json", "--html", "--plot", "--png", "--out", "--tb-logdir")


def test_every_output_option_is_checked_while_parsing() -> None:
    found = set(_output_options())
    for p in all_parsers():
        for action in p._actions:
            if any(s in OUTPUT_WORDS for s in action.option_strings):
                assert (p.prog, action.option_strings[0]) in found, f"{p.prog} {action.option_strings}"
    assert ("lowtail model build", "--out") in found and ("lowtail compare", "--html") in found
    assert ("lowtail demo ray", "--tb-logdir") in found


def test_every_output_option_refuses_an_unwritable_path_before_any_work(capsys: Any) -> None:
    options = _output_options()
    assert len(options) >= 15
    for prog, flag in options:
        argv = [*prog.split()[1:], flag, "/proc/lowtail-unwritable.out"]
        with pytest.raises(SystemExit) as exc:
            main(argv)
        err = capsys.readouterr().err
        assert exc.value.code == 2, argv
        assert f"{prog}: error: argument {flag}" in err and "/proc/lowtail-unwritable.out" in err, err
        assert "cannot be written" in err and "Traceback" not in err
    assert not Path("/proc/lowtail-unwritable.out").exists()


def test_a_writable_new_path_is_accepted_and_left_absent(tmp_path: Path) -> None:
    from lowtail.options import output_path

    target = tmp_path / "r.json"
    assert output_path()(str(target)) == str(target) and not target.exists()
    with pytest.raises(argparse.ArgumentTypeError, match="is a directory"):
        output_path()(str(tmp_path))


# ---- one fix per cause -----------------------------------------------------------------------------


def test_a_p999_over_the_limit_names_the_limit_first_and_is_not_fixed_by_more_samples() -> None:
    from lowtail.validation.report import fix

    # validate --only deschedule --samples 500 at 8 ms: more samples cannot make 8 ms pass 0.1 ms.
    check = grade("deschedule", {3: [0.01] * 490 + [8.03] * 10}, Limits(0.1, 1.0), "deschedule")
    assert check.status is Status.FAIL
    assert check.reason.startswith("deschedule p99.9 8.03 ms on CPU 3 (n=500")
    assert "too few samples for p99.9" in check.reason  # still said, after the cause
    assert "--samples" not in fix(check.to_dict()) and "leased_threads" in fix(check.to_dict())
    quiet = grade("deschedule", {3: [0.01] * 500}, Limits(0.1, 1.0), "deschedule")
    assert fix(quiet.to_dict()).startswith("run again with --samples 2,995 or more")


def test_the_oslat_plot_counts_the_same_n_as_its_title() -> None:
    """The plot's legend (its histogram) and the title (the parsed statistics) said n one apart."""
    from lowtail.validation.rttests import histograms, parse_oslat

    doc = json.loads((Path(__file__).parent / "data/oslat-kvm-2vcpu.json").read_text())
    stats, hist = parse_oslat(doc), histograms(doc)
    for cpu, s in stats.items():
        assert sum(c for _, c in hist[cpu]) == s["n"]
        assert max(v for v, c in hist[cpu] if c) == s["max"]  # the plot still runs to the maximum
