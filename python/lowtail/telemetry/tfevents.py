"""Read scalars from TensorBoard event files without TensorFlow or the tensorboard package.

An event file is a TFRecord stream; each record is

    uint64 length (little endian) | uint32 masked CRC-32C of the length | data | uint32 masked CRC-32C of data

and each data is an ``Event`` protobuf (tensorboardX ships the compiled ``event_pb2``, pinned at 2.6.5).
Scalars are either ``simple_value`` (tensorboardX, TF1 summaries) or a one-element ``tensor`` (TF2,
``new_style``). A record cut short at the end of a file is a run still being written and ends the
file quietly; a CRC mismatch anywhere else is corruption and an error naming the file and offset.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tensorboardX.proto import event_pb2
from tensorboardX.record_writer import masked_crc32c

from lowtail.errors import LowtailError


class EventFileError(LowtailError, ValueError):
    """An event file that is corrupt (bad CRC, undecodable protobuf) or a log directory without events."""


@dataclass
class Series:
    tag: str
    steps: list[int] = field(default_factory=list)
    values: list[float] = field(default_factory=list)


def read_records(path: Path) -> Iterator[bytes]:
    data = path.read_bytes()
    off = 0
    while off < len(data):
        if off + 12 > len(data):
            return  # a header cut short: the writer is mid-record
        header = data[off : off + 8]
        (length,) = struct.unpack("<Q", header)
        (len_crc,) = struct.unpack("<I", data[off + 8 : off + 12])
        if masked_crc32c(header) != len_crc:
            raise EventFileError(f"{path}: bad length CRC at offset {off}: not a TFRecord file, or corrupt")
        end = off + 12 + length + 4
        if end > len(data):
            return
        payload = data[off + 12 : off + 12 + length]
        (data_crc,) = struct.unpack("<I", data[off + 12 + length : end])
        if masked_crc32c(payload) != data_crc:
            raise EventFileError(f"{path}: bad data CRC in the record at offset {off} ({length} bytes)")
        yield payload
        off = end


def _scalar(value: Any) -> float | None:
    kind = value.WhichOneof("value")
    if kind == "simple_value":
        return float(value.simple_value)
    if kind == "tensor":
        t = value.tensor
        for field_name in ("float_val", "double_val", "int_val", "int64_val"):
            vals = getattr(t, field_name)
            if len(vals) == 1:
                return float(vals[0])
        if t.tensor_content and t.dtype in (1, 2):  # DT_FLOAT, DT_DOUBLE
            fmt = "<f" if t.dtype == 1 else "<d"
            if len(t.tensor_content) == struct.calcsize(fmt):
                return float(struct.unpack(fmt, t.tensor_content)[0])
    return None


def event_files(logdir: Path) -> list[Path]:
    if not logdir.is_dir():
        raise EventFileError(f"{logdir}: not a directory")
    files = sorted(p for p in logdir.rglob("*tfevents*") if p.is_file())
    if not files:
        raise EventFileError(f"{logdir}: no TensorBoard event files (events.out.tfevents.*) under it")
    return files


def read_scalars(logdir: str | Path) -> dict[str, Series]:
    """Every scalar tag under ``logdir`` (recursively). Tags of event files in a subdirectory get the
    subdirectory as a prefix, as TensorBoard shows them as separate runs. A step written twice (a
    resumed run) keeps its last value."""
    root = Path(logdir)
    by_tag: dict[str, dict[int, float]] = {}
    for path in event_files(root):
        rel = path.parent.relative_to(root)
        prefix = "" if str(rel) == "." else f"{rel.as_posix()}/"
        for payload in read_records(path):
            event = event_pb2.Event()
            try:
                event.ParseFromString(payload)
            except Exception as e:  # protobuf raises its own DecodeError type
                raise EventFileError(f"{path}: undecodable event record: {e}") from None
            if not event.HasField("summary"):
                continue
            for value in event.summary.value:
                x = _scalar(value)
                if x is not None:
                    by_tag.setdefault(prefix + value.tag, {})[int(event.step)] = x
    return {
        tag: Series(tag, sorted(points), [points[s] for s in sorted(points)])
        for tag, points in by_tag.items()
    }
