"""One unit per kind of figure, and one spelling, in everything lowtail prints (docs/cli.md, "Units").

- Milliseconds for the latencies a node verdict or a serving run is about: deschedule (wall - CPU),
  timer wake-up, cyclictest and oslat, hwlat gaps, an inference request's round trip and its parts. The
  limits (``validate --threshold``) and the figures of the predecessor's write-up (0.02 ms on bare metal,
  400-470 ms on the VMware guest) are in ms, and a report mixing units invites a factor-1000 misreading.
- Microseconds for the queue microbenchmarks (``bench queue``, ``bench lanes``, ``bench ndslot``): their
  round trips and claim costs are 1-100 us, which in ms would be 0.001-0.1.
- C-state exit latency is in us, the kernel's unit for it (sysfs ``cpuidle/state*/latency``).
- Microseconds are spelt ``us`` (ASCII, as in the JSON keys ``p50_us``); the 99.9th percentile is
  ``p99.9`` in text and ``p999`` in JSON keys.
"""

from __future__ import annotations

P999 = "p99.9"  # the spelling in tables, titles and messages
P999_KEY = "p999"  # the spelling in JSON keys

# The latency unit of each command's tables (the header of every percentile column states it).
LATENCY_UNIT: dict[str, str] = {
    "lowtail validate": "ms",
    "lowtail compare": "ms",
    "lowtail demo ray": "ms",
    "lowtail bench serve": "ms",
    "lowtail tb-report": "ms",
    "lowtail bench queue": "us",
    "lowtail bench lanes": "us",
    "lowtail bench ndslot": "us",
}
