"""The queue consumer of the ``shm_rtt`` probe: pinned, it returns every request's input as its output.

Run as ``python -m lowtail.validation.echo_server CPU`` with the queue descriptor's bytes
(``QueueDescriptor.to_bytes``) on stdin; it prints ``ready`` once attached and exits on SIGTERM.
A plain subprocess rather than multiprocessing, so no resource-tracker process outlives the probe.
"""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C to the group: end quietly, the probe cleans up
    cpu = int(sys.argv[1])
    os.sched_setaffinity(0, {cpu})
    from lowtail.shm.queue import QueueDescriptor, QueueWorker

    desc = QueueDescriptor.from_bytes(sys.stdin.buffer.read())

    stop = False

    def on_term(signum: int, frame: FrameType | None) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    worker = QueueWorker.attach(desc)
    print("ready", flush=True)
    try:
        while not stop:
            batch = worker.claim(timeout_s=0.05)
            if batch is not None:
                with batch:
                    batch.complete({"out": next(iter(batch.inputs.values()))})
    finally:
        worker.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
