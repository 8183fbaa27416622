//! lowtail's native core: the queue's hot path (client publish / spin / park / answer read, worker
//! claim / answer / wake) on the segment that `lowtail.shm.layout` describes, as a Python extension.
//!
//! Every offset comes from `layout.rs`, generated from `lowtail.shm.layout`. The segment is shared with
//! other processes, some possibly hostile: every word index is checked against the mapping's length
//! before use, every value read from it (a ring entry, a header length) is bounded by the geometry
//! before it indexes anything, and a bad index is a Python `IndexError`, never a stray access.
//! Words are accessed as atomics (plain `mov` on x86-64, the TSO the protocol is written for); the
//! Dekker handshakes use a SeqCst fence (`mfence`).

mod header;
mod layout;

use std::sync::atomic::{fence, AtomicU64, Ordering};

use pyo3::buffer::PyBuffer;
use pyo3::exceptions::{PyIndexError, PyValueError};
use pyo3::prelude::*;

use layout::*;

fn align(n: u64, a: u64) -> u64 {
    n.div_ceil(a) * a
}

fn now_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // CLOCK_MONOTONIC: the clock of time.monotonic_ns, the same in every process of the host.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

const FUTEX_WAIT: i32 = 0;
const FUTEX_WAKE: i32 = 1;

/// FUTEX_WAIT on a shared (not private) word: other processes wake it. False on timeout.
fn futex_wait(addr: *const AtomicU64, expected: u32, timeout_ns: u64) -> bool {
    let ts = libc::timespec {
        tv_sec: (timeout_ns / 1_000_000_000) as libc::time_t,
        tv_nsec: (timeout_ns % 1_000_000_000) as libc::c_long,
    };
    let rc = unsafe {
        libc::syscall(libc::SYS_futex, addr as *const u32, FUTEX_WAIT, expected, &ts as *const libc::timespec, 0usize, 0u32)
    };
    if rc == 0 {
        return true;
    }
    std::io::Error::last_os_error().raw_os_error() != Some(libc::ETIMEDOUT)
}

fn futex_wake(addr: *const AtomicU64) -> i64 {
    unsafe { libc::syscall(libc::SYS_futex, addr as *const u32, FUTEX_WAKE, i32::MAX, 0usize, 0usize, 0u32) as i64 }
}

/// The geometry of a queue segment, computed as `lowtail.shm.layout.Geometry.of` does.
#[derive(Clone, Copy)]
#[allow(dead_code)] // every field of Geometry.of, for the checks and diagnostics
struct Geo {
    lanes: u64,
    spl: u64,
    req_bytes: u64,
    resp_bytes: u64,
    lane_bytes: u64,
    slot_base: u64,
    req_base: u64,
    resp_base: u64,
    total: u64,
}

impl Geo {
    fn of(lanes: u64, spl: u64, req_bytes: u64, resp_bytes: u64) -> Option<Geo> {
        if lanes == 0 || lanes > MAX_LANES || spl == 0 || spl > 1 << 16 || req_bytes > 1 << 32 || resp_bytes > 1 << 32 {
            return None;
        }
        let lane_bytes = align(L_RING + 8 * spl, 64);
        let slot_base = align(LANE_BASE + lanes * lane_bytes, 64);
        let req_base = align(slot_base + lanes * spl * SLOT_BYTES, PAGE);
        let resp_base = req_base + lanes * spl * req_bytes;
        let total = align(resp_base + lanes * spl * resp_bytes, PAGE);
        Some(Geo { lanes, spl, req_bytes, resp_bytes, lane_bytes, slot_base, req_base, resp_base, total })
    }
    fn lane_word(&self, lane: u64, field: u64) -> u64 {
        (LANE_BASE + lane * self.lane_bytes + field) >> 3
    }
    fn slot_word(&self, g: u64) -> u64 {
        (self.slot_base + g * SLOT_BYTES) >> 3
    }
}

/// A queue segment mapped by Python (its `mmap`), seen as words. Holds a buffer export of the mapping
/// until `close()`: the mapping cannot be unmapped under it (mmap.close raises BufferError first).
#[pyclass(module = "lowtail_native")]
struct Segment {
    buf: Option<PyBuffer<u8>>,
    base: *mut u8,
    words: u64,
    geo: Geo,
}

// The pointer is into a shared mapping that `buf` keeps exported; PyO3's borrow checking makes `close`
// (the only &mut method) fail while another thread is inside a call, so no call outlives the export.
unsafe impl Send for Segment {}
unsafe impl Sync for Segment {}

impl Segment {
    #[inline]
    fn w(&self, i: u64) -> PyResult<&AtomicU64> {
        if i >= self.words || self.buf.is_none() {
            return Err(PyIndexError::new_err(format!("word {i} outside the {}-word segment (or closed)", self.words)));
        }
        // In bounds, 8-aligned (the mapping is page-aligned), alive while `buf` holds the export.
        Ok(unsafe { &*(self.base.add((i * 8) as usize) as *const AtomicU64) })
    }
    #[inline]
    fn ld(&self, i: u64) -> PyResult<u64> {
        Ok(self.w(i)?.load(Ordering::Acquire))
    }
    #[inline]
    fn st(&self, i: u64, v: u64) -> PyResult<()> {
        self.w(i)?.store(v, Ordering::Release);
        Ok(())
    }
    fn check_lane(&self, lane: u64) -> PyResult<()> {
        if lane >= self.geo.lanes {
            return Err(PyIndexError::new_err(format!("lane {lane}, expected 0..{}", self.geo.lanes - 1)));
        }
        Ok(())
    }
    fn check_slot(&self, slot: u64) -> PyResult<()> {
        if slot >= self.geo.spl {
            return Err(PyIndexError::new_err(format!("slot {slot}, expected 0..{}", self.geo.spl - 1)));
        }
        Ok(())
    }
    /// Wake the client of `lane` when it is parked (after a fence the caller made).
    fn wake_lane_if_parked(&self, lane: u64) -> PyResult<bool> {
        if self.ld(self.geo.lane_word(lane, L_PARKED))? != 0 {
            futex_wake(self.w(self.geo.lane_word(lane, L_RESP_COUNT))?);
            return Ok(true);
        }
        Ok(false)
    }
}

#[pymethods]
impl Segment {
    /// Map the words of `buffer` (a writable buffer over the whole segment) with the geometry Python
    /// computed; refused unless it is what this core computes from the same four numbers and fits.
    #[new]
    #[pyo3(signature = (buffer, lanes, spl, req_bytes, resp_bytes, total))]
    fn new(buffer: &Bound<'_, PyAny>, lanes: u64, spl: u64, req_bytes: u64, resp_bytes: u64, total: u64) -> PyResult<Self> {
        let buf = PyBuffer::<u8>::get(buffer)?;
        if buf.readonly() || !buf.is_c_contiguous() {
            return Err(PyValueError::new_err("the segment buffer must be writable and contiguous"));
        }
        let geo = Geo::of(lanes, spl, req_bytes, resp_bytes).ok_or_else(|| {
            PyValueError::new_err(format!("geometry lanes={lanes} spl={spl} req={req_bytes} resp={resp_bytes} out of range"))
        })?;
        if geo.total != total || (buf.len_bytes() as u64) < total {
            return Err(PyValueError::new_err(format!(
                "segment of {} bytes, geometry needs {} (Python computed {total})",
                buf.len_bytes(),
                geo.total
            )));
        }
        let base = buf.buf_ptr() as *mut u8;
        if (base as usize) % 64 != 0 {
            return Err(PyValueError::new_err("the segment buffer is not 64-byte aligned"));
        }
        Ok(Segment { words: geo.total / 8, base, buf: Some(buf), geo })
    }

    /// Release the buffer export (before the mapping is closed); every later call raises.
    fn close(&mut self, py: Python<'_>) {
        if let Some(b) = self.buf.take() {
            b.release(py);
        }
        self.words = 0;
    }

    #[getter]
    fn closed(&self) -> bool {
        self.buf.is_none()
    }

    // -- client ----------------------------------------------------------------------------------

    /// Publish the request written in `slot` of `lane` as ring position `head`: its words, the ring
    /// entry, then the doorbell (head + 1) last; wakes the worker if it is parked. Returns (seq, now).
    fn publish(&self, lane: u64, slot: u64, nbytes: u64, head: u64) -> PyResult<(u64, u64)> {
        self.check_lane(lane)?;
        self.check_slot(slot)?;
        let g = &self.geo;
        let si = g.slot_word(lane * g.spl + slot);
        let seq = self.ld(si + (S_REQ_SEQ >> 3))?.wrapping_add(1);
        let now = now_ns();
        self.st(si + (S_REQ_LEN >> 3), nbytes)?;
        self.st(si + (S_SUBMIT_NS >> 3), now)?;
        self.st(si + (S_REQ_SEQ >> 3), seq)?;
        self.st(si + (S_REQ_STATE >> 3), READY)?;
        self.st(g.lane_word(lane, L_RING) + head % g.spl, slot)?;
        self.st((H_DOORBELLS >> 3) + lane, head.wrapping_add(1))?; // publication (TSO: after the above)
        fence(Ordering::SeqCst); // the doorbell before the load of worker_sleep (Dekker)
        let sleep = self.w(H_WORKER_SLEEP >> 3)?;
        if sleep.load(Ordering::Acquire) != 0 {
            sleep.store(0, Ordering::Release);
            futex_wake(sleep);
        }
        Ok((seq, now))
    }

    /// Spin until the answer `seq` is in `slot` of `lane` or the clock passes `spin_end_ns`; returns
    /// (answered, now). The GIL is released while spinning.
    fn spin(&self, py: Python<'_>, lane: u64, slot: u64, seq: u64, spin_end_ns: u64) -> PyResult<(bool, u64)> {
        self.check_lane(lane)?;
        self.check_slot(slot)?;
        let word = self.w(self.geo.slot_word(lane * self.geo.spl + slot) + (S_RESP_SEQ >> 3))? as *const AtomicU64 as usize;
        Ok(py.allow_threads(move || {
            let w = unsafe { &*(word as *const AtomicU64) }; // the export lives: self is borrowed
            loop {
                let now = now_ns();
                if w.load(Ordering::Acquire) == seq {
                    return (true, now);
                }
                if now > spin_end_ns {
                    return (false, now);
                }
                for _ in 0..16 {
                    std::hint::spin_loop();
                    if w.load(Ordering::Acquire) == seq {
                        return (true, now_ns());
                    }
                }
            }
        }))
    }

    /// One park on the lane's answer counter: set the parked flag, fence, re-check, futex-wait at most
    /// `timeout_ns`, clear the flag. Returns (answered, slept) where slept counts the futex call.
    fn park(&self, py: Python<'_>, lane: u64, slot: u64, seq: u64, timeout_ns: u64) -> PyResult<(bool, bool)> {
        self.check_lane(lane)?;
        self.check_slot(slot)?;
        let g = &self.geo;
        let resp = self.w(g.slot_word(lane * g.spl + slot) + (S_RESP_SEQ >> 3))?;
        let count = self.w(g.lane_word(lane, L_RESP_COUNT))?;
        let parked = self.w(g.lane_word(lane, L_PARKED))?;
        let expected = count.load(Ordering::Acquire) as u32;
        parked.store(1, Ordering::Release);
        fence(Ordering::SeqCst); // the parked store before the re-check (Dekker)
        if resp.load(Ordering::Acquire) == seq {
            parked.store(0, Ordering::Release);
            return Ok((true, false));
        }
        let addr = count as *const AtomicU64 as usize;
        py.allow_threads(move || futex_wait(addr as *const AtomicU64, expected, timeout_ns));
        parked.store(0, Ordering::Release);
        Ok((resp.load(Ordering::Acquire) == seq, true))
    }

    /// The answer words of `slot` in `lane`: (status, resp_len, claim_ns, done_ns, engine_ns, call).
    fn answer_words(&self, lane: u64, slot: u64) -> PyResult<(u64, u64, u64, u64, u64, u64)> {
        self.check_lane(lane)?;
        self.check_slot(slot)?;
        let si = self.geo.slot_word(lane * self.geo.spl + slot);
        Ok((
            self.ld(si + (S_RESP_STATUS >> 3))?,
            self.ld(si + (S_RESP_LEN >> 3))?,
            self.ld(si + (S_CLAIM_NS >> 3))?,
            self.ld(si + (S_DONE_NS >> 3))?,
            self.ld(si + (S_CALL_ENGINE_NS >> 3))?,
            self.ld(si + (S_CALL >> 3))?,
        ))
    }

    // -- worker ----------------------------------------------------------------------------------

    /// Claim ring position `tail` of `lane` (the tail word moves past it). Returns
    /// (kind, slot, seq, gen, submit_ns): kind 0 claimed, 1 bad ring entry (slot = the entry; nothing
    /// claimed: fence the lane), 2 already claimed or answered (skipped), 3 withdrawn by its client
    /// (claimed: answer it ST_WITHDRAWN).
    fn claim(&self, lane: u64, tail: u64, now: u64) -> PyResult<(u8, u64, u64, u64, u64)> {
        self.check_lane(lane)?;
        let g = &self.geo;
        let tail_i = g.lane_word(lane, L_TAIL);
        let s = self.ld(g.lane_word(lane, L_RING) + tail % g.spl)?;
        if s >= g.spl {
            self.st(tail_i, tail.wrapping_add(1))?;
            return Ok((1, s, 0, 0, 0));
        }
        let si = g.slot_word(lane * g.spl + s);
        let seq = self.ld(si + (S_REQ_SEQ >> 3))?;
        if self.ld(si + (S_CLAIM_SEQ >> 3))? == seq || self.ld(si + (S_RESP_SEQ >> 3))? == seq {
            self.st(tail_i, tail.wrapping_add(1))?;
            return Ok((2, s, seq, 0, 0));
        }
        let gen = self.ld(g.lane_word(lane, L_GEN))?;
        let submit = self.ld(si + (S_SUBMIT_NS >> 3))?;
        self.st(si + (S_CLAIM_NS >> 3), now)?;
        self.st(si + (S_CLAIM_SEQ >> 3), seq)?; // PROCESSING
        fence(Ordering::SeqCst); // the claim before the load of the withdrawn mark (Dekker)
        self.st(tail_i, tail.wrapping_add(1))?;
        let kind = if self.ld(si + (S_WITHDRAWN >> 3))? == seq { 3 } else { 0 };
        Ok((kind, s, seq, gen, submit))
    }

    /// Publish the answers of a batch whose payloads the caller wrote: `items` are (lane, slot, seq,
    /// status, resp_len); every answer carries `engine_ns` and `call`. Each answer's words, resp_seq
    /// last, and its lane's answer count; then (`wake`) one fence and one wake per parked lane.
    #[pyo3(signature = (items, engine_ns, call, wake=true))]
    fn answer(&self, items: Vec<(u64, u64, u64, u64, u64)>, engine_ns: u64, call: u64, wake: bool) -> PyResult<()> {
        let g = &self.geo;
        let mut lanes: [u64; 4] = [0; 4]; // lanes up to 256: a bitset
        for &(lane, slot, seq, status, len) in &items {
            self.check_lane(lane)?;
            self.check_slot(slot)?;
            let si = g.slot_word(lane * g.spl + slot);
            self.st(si + (S_RESP_LEN >> 3), len)?;
            self.st(si + (S_RESP_STATUS >> 3), status)?;
            self.st(si + (S_CALL_ENGINE_NS >> 3), engine_ns)?;
            self.st(si + (S_CALL >> 3), call)?;
            self.st(si + (S_DONE_NS >> 3), now_ns())?;
            self.st(si + (S_RESP_SEQ >> 3), seq)?; // publication of the answer (TSO)
            let ci = g.lane_word(lane, L_RESP_COUNT);
            self.st(ci, (self.ld(ci)? + 1) & 0xFFFF_FFFF)?;
            lanes[(lane >> 6) as usize] |= 1 << (lane & 63);
        }
        if wake {
            self.wake(lanes)?;
        }
        Ok(())
    }

    /// Wake the parked clients of `lanes` (after one fence): one system call per parked lane.
    fn wake_lanes(&self, lanes: Vec<u64>) -> PyResult<()> {
        let mut set: [u64; 4] = [0; 4];
        for lane in lanes {
            self.check_lane(lane)?;
            set[(lane >> 6) as usize] |= 1 << (lane & 63);
        }
        self.wake(set)
    }
}

impl Segment {
    fn wake(&self, set: [u64; 4]) -> PyResult<()> {
        if set == [0; 4] {
            return Ok(());
        }
        fence(Ordering::SeqCst); // the answers' stores before the loads of client_parked (Dekker)
        for (k, bits) in set.iter().enumerate() {
            let mut b = *bits;
            while b != 0 {
                let lane = (k as u64) * 64 + b.trailing_zeros() as u64;
                b &= b - 1;
                self.wake_lane_if_parked(lane)?;
            }
        }
        Ok(())
    }
}

/// A full memory barrier (mfence), for the Python path's Dekker handshakes.
#[pyfunction]
fn full_barrier() {
    fence(Ordering::SeqCst);
}

/// Decode a payload header (the bytes after the 8-byte prefix), as `lowtail.shm.payload.decode_header`
/// does: (slot name or None, ((name, dtype code, shape), ...)); ValueError naming what is wrong.
#[pyfunction]
fn decode_header(py: Python<'_>, raw: &[u8], external: bool) -> PyResult<PyObject> {
    match header::decode(raw, external) {
        Ok(h) => {
            let arrays: Vec<(String, u8, Vec<u64>)> = h.arrays.into_iter().map(|a| (a.name, a.code, a.shape)).collect();
            Ok((h.slot_name, arrays).into_pyobject(py)?.into_any().unbind())
        }
        Err(e) => Err(PyValueError::new_err(format!("corrupt payload header: {e}"))),
    }
}

#[pymodule]
fn lowtail_native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Segment>()?;
    m.add_function(wrap_pyfunction!(full_barrier, m)?)?;
    m.add_function(wrap_pyfunction!(decode_header, m)?)?;
    m.add("LAYOUT_DIGEST", LAYOUT_DIGEST)?;
    m.add("VERSION", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
