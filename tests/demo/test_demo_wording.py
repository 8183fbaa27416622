"""What demo ray's actor table says about a worker's CPU: what its check saw, never "isolated" for a CPU
that the demo override shares with samplers."""

from __future__ import annotations

from lowtail.demo.local import _pinning


def _actor(cpu: int, ok: bool = True, detail: str = "") -> dict[str, object]:
    return {"owner": "infer:demo:0", "cpu": cpu, "isolation": {"ok": ok, "threads": 5, "detail": detail}}


def test_a_worker_on_a_cpu_of_its_own_is_pinned_there() -> None:
    assert _pinning(_actor(3), {3: 1, 4: 1}) == "all 5 threads pinned to CPU 3"


def test_a_worker_on_a_shared_cpu_says_who_shares_it() -> None:
    text = _pinning(_actor(0), {0: 3})
    assert text == "all 5 threads pinned to CPU 0; 2 other lease owner(s) on that CPU (demo override)"
    assert "isolated" not in text


def test_a_failed_check_shows_what_it_found() -> None:
    assert _pinning(_actor(0, ok=False, detail="thread masks {'0-1': 2}, expected all 0"), {}) == (
        "thread masks {'0-1': 2}, expected all 0"
    )
    assert _pinning({"cpu": 0}, {}) == "-"
