"""tb-report on event files written here by tensorboardX with the figures of the write-up's training run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tensorboardX import SummaryWriter
from tensorboardX.proto import summary_pb2, tensor_pb2, types_pb2

from lowtail.cli.main import main
from lowtail.telemetry.tbreport import load
from lowtail.telemetry.tfevents import EventFileError, read_scalars

STEPS = range(3, 20211, 202)  # 103 steps over the write-up's step range [3, 20210]


def _tensor_scalar(tag: str, value: float) -> summary_pb2.Summary:
    """A scalar as TF2 writes it: a rank-0 float tensor instead of simple_value."""
    tensor = tensor_pb2.TensorProto(dtype=types_pb2.DT_FLOAT, float_val=[value])
    return summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=tag, tensor=tensor)])


def _write_run(
    logdir: Path, *, recv: float, total: float, rate: float, exec_ms: float, desched: float
) -> None:
    """Values alternate +-d around each figure, so the mean is the figure and the series is not flat."""
    with SummaryWriter(str(logdir / "learner")) as w:
        for i, step in enumerate(STEPS[:-1]):  # an even count: the +-d cancel exactly
            d = 1 if i % 2 else -1
            w.add_scalar("learner/batch_recv_ms", recv + 50 * d, step)
            w.add_scalar("learner/learn_total_ms", total + 50 * d, step)
            w.add_scalar("sampler/samples_per_s", rate + 5 * d, step)
    with SummaryWriter(str(logdir / "model_dispatcher")) as w:
        for i, step in enumerate(STEPS[:-1]):
            d = 1 if i % 2 else -1
            w.add_scalar("sample_infos/sl_remote_infer_exec_ms", exec_ms + 0.1 * d, step)
            # TF2-style tensor scalars must read the same as simple_value ones.
            w._get_file_writer().add_summary(
                _tensor_scalar("sample_infos/sl_remote_infer_exec_ms_max", 10 * exec_ms), step
            )
            w.add_scalar("infer/hero_3/p999_deschedule_ms", desched, step)


@pytest.fixture
def runs(tmp_path: Path) -> tuple[Path, Path]:
    before, after = tmp_path / "vmware", tmp_path / "baremetal"
    _write_run(before, recv=2615.9, total=2774.8, rate=735, exec_ms=16.6, desched=435.0)
    _write_run(after, recv=120.0, total=280.0, rate=9000, exec_ms=9.1, desched=0.02)
    return before, after


def test_the_write_ups_wait_share_is_94_3_percent(
    runs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    before, _ = runs
    assert main(["tb-report", str(before)]) == 0
    out = capsys.readouterr().out
    assert "batch_recv_ms / learn_total_ms = 2615.9 / 2774.8 = 94.3%" in out
    assert "step range [3, 20001]" in out
    assert "samples/s: mean 735.0" in out
    assert "p999_deschedule_ms: mean 435.000" in out
    assert "infer_exec_ms" in out and "infer_exec_ms_max" in out


def test_tags_are_matched_by_suffix_and_tensor_scalars_read(runs: tuple[Path, Path]) -> None:
    report = load(str(runs[0]))
    assert report["learner"]["waiting_share"] == pytest.approx(2615.9 / 2774.8)
    assert report["p999_deschedule_ms"]["tag"] == "model_dispatcher/infer/hero_3/p999_deschedule_ms"
    assert report["sl_remote"]["infer_exec_ms"]["mean"] == pytest.approx(16.6)
    assert report["sl_remote"]["infer_exec_ms_max"]["mean"] == pytest.approx(166.0)
    assert report["sl_remote"]["infer_exec_ms"]["n"] == len(STEPS) - 1


def test_two_runs_are_compared(runs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    before, after = runs
    assert main(["tb-report", str(before), str(after), "--json", "-"]) == 0
    doc = json.loads(capsys.readouterr().out)
    rows = {r["metric"]: r for r in doc["compare"]["metrics"]}
    assert rows["p999_deschedule_ms (mean)"]["before_over_after"] == pytest.approx(435.0 / 0.02)
    assert rows["waiting share"]["after"] == pytest.approx(120.0 / 280.0)
    assert rows["samples/s"]["before_over_after"] == pytest.approx(735 / 9000)
    assert main(["tb-report", str(before), str(after)]) == 0
    assert "before/after" in capsys.readouterr().out


def test_a_corrupt_record_is_an_error_naming_the_file(runs: tuple[Path, Path]) -> None:
    path = next((runs[0] / "learner").glob("*tfevents*"))
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(EventFileError, match=rf"{path}: bad (data|length) CRC"):
        read_scalars(runs[0])


def test_a_record_cut_short_at_the_end_is_a_run_still_being_written(runs: tuple[Path, Path]) -> None:
    path = next((runs[0] / "learner").glob("*tfevents*"))
    whole = read_scalars(runs[0])["learner/learner/batch_recv_ms"]
    path.write_bytes(path.read_bytes()[:-7])
    cut = read_scalars(runs[0])["learner/learner/batch_recv_ms"]
    assert 0 < len(cut.values) <= len(whole.values)


def test_a_directory_without_event_files_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tb-report", str(tmp_path)]) == 2
    assert "no TensorBoard event files" in capsys.readouterr().err


def test_small_figures_keep_their_digits_and_no_p99_rests_on_two_windows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with SummaryWriter(str(tmp_path / "run")) as w:
        for step in range(2):  # two windows: their "p99" would be their maximum
            w.add_scalar("sample_infos/sl_remote_infer_exec_ms", 0.0213 + step * 0.001, step)
            w.add_scalar("sample_infos/sl_remote_something_new_ms", 1.0, step)
    assert main(["tb-report", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("infer_exec_ms "))
    assert "0.0218" in row and "0.0213" in row and " 0.0 " not in row  # was printed 0.0
    assert row.split()[-2] == "-"  # p99: not from 2 windows
    new = next(line for line in out.splitlines() if line.startswith("something_new_ms"))
    assert "unknown" in new and "?" not in new
    assert load(str(tmp_path / "run"))["sl_remote"]["infer_exec_ms"]["p99"] is None
