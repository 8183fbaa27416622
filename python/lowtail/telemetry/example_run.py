"""Two small example training runs for ``lowtail tb-report``, written as TensorBoard event files.

``python -m lowtail.telemetry.example_run OUTDIR`` writes ``OUTDIR/vmware`` and ``OUTDIR/baremetal``
(the repository ships their output in ``docs/tb-report-example/``), so ``lowtail tb-report
OUTDIR/vmware OUTDIR/baremetal`` can be tried without a training run. The figures are the predecessor's
write-up's: on the VMware guest the learner waited 2615.9 of 2774.8 ms per batch for samples (94.3%) at
735 samples/s with a p99.9 deschedule of 435 ms; the bare-metal run is the target, not a measurement.

The files are the same bytes on every run (fixed wall times and file names, no host name), written with
TensorBoard's record framing (length, masked CRC-32C of the length, data, masked CRC-32C of the data)
around ``Event`` protobufs, as tensorboardX writes them.
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path

from tensorboardX.proto import event_pb2, summary_pb2
from tensorboardX.record_writer import masked_crc32c

STEPS = range(3, 20211, 808)  # 26 steps over the write-up's step range
WALL_TIME_0 = 1_700_000_000.0  # fixed, so the files are reproducible
RUNS = {
    "vmware": {"recv": 2615.9, "total": 2774.8, "rate": 735.0, "exec_ms": 16.6, "desched": 435.0},
    "baremetal": {"recv": 120.0, "total": 280.0, "rate": 9000.0, "exec_ms": 9.1, "desched": 0.02},
}


def _record(data: bytes) -> bytes:
    header = struct.pack("<Q", len(data))
    return header + struct.pack("<I", masked_crc32c(header)) + data + struct.pack("<I", masked_crc32c(data))


def _event_file(path: Path, scalars: list[tuple[int, dict[str, float]]]) -> None:
    events = [event_pb2.Event(wall_time=WALL_TIME_0, file_version="brain.Event:2")]
    for step, values in scalars:
        summary = summary_pb2.Summary(
            value=[summary_pb2.Summary.Value(tag=tag, simple_value=v) for tag, v in values.items()]
        )
        events.append(event_pb2.Event(wall_time=WALL_TIME_0 + step, step=step, summary=summary))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(_record(e.SerializeToString()) for e in events))


def write(outdir: Path) -> list[Path]:
    """Write both runs under ``outdir``; return the files written. Values alternate +-d around each
    figure over an even number of steps, so each series' mean is the figure and the series is not flat."""
    written = []
    steps = list(STEPS)[: len(STEPS) // 2 * 2]
    for run, f in RUNS.items():
        learner, dispatcher = [], []
        for i, step in enumerate(steps):
            d = 1 if i % 2 else -1
            learner.append((step, {
                "learner/batch_recv_ms": f["recv"] + 50 * d,
                "learner/learn_total_ms": f["total"] + 50 * d,
                "sampler/samples_per_s": f["rate"] + 5 * d,
            }))  # fmt: skip
            dispatcher.append((step, {
                "sample_infos/sl_remote_infer_exec_ms": f["exec_ms"] + 0.1 * d,
                "infer/hero_3/p999_deschedule_ms": f["desched"],
            }))  # fmt: skip
        for part, scalars in (("learner", learner), ("model_dispatcher", dispatcher)):
            path = outdir / run / part / "events.out.tfevents.1700000000.example"
            _event_file(path, scalars)
            written.append(path)
    return written


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m lowtail.telemetry.example_run OUTDIR")
    for p in write(Path(sys.argv[1])):
        print(p)
