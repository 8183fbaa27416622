"""The shared-memory inference queue and what it stands on: segments, payload format, futex, locks, NUMA."""
