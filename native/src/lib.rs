//! lowtail's native core: the queue's hot path (client publish / spin / park / answer read, worker
//! claim / answer / wake) on the segment that `lowtail.shm.layout` describes, as a Python extension.
//!
//! Every offset comes from `layout.rs`, generated from `lowtail.shm.layout`. The segment is shared with
//! other processes, some possibly hostile: every word index is checked against the mapping's length
//! before use, every value read from it (a ring entry, a header length) is bounded by the geometry
//! before it indexes anything, and a bad index is a Python `IndexError`, never a stray access.
//! Words are accessed as atomics (plain `mov` on x86-64, the TSO the protocol is written for); the
//! Dekker handshakes use a SeqCst fence (`mfence`).

mod answer;
mod client;
mod header;
mod layout;
mod ndarray;
mod poll;
mod recorder;

use std::collections::HashMap;
use std::sync::atomic::{fence, AtomicU64, Ordering};
use std::sync::Mutex;

use pyo3::buffer::PyBuffer;
use pyo3::exceptions::{PyIndexError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::pybacked::PyBackedBytes;

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
        // spl a power of two: ring positions (number % spl) stay distinct across the counters' 2^64 wrap
        if lanes == 0 || lanes > MAX_LANES || !spl.is_power_of_two() || spl > 1 << 16 || req_bytes > 1 << 32 || resp_bytes > 1 << 32 {
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
    headers: Mutex<HeaderCache>,
    wakes: WakeTotals,
}

/// What the futex wakes of parked clients cost this mapping's worker so far (`Segment.wakes`).
#[derive(Default)]
struct WakeTotals {
    ns: AtomicU64,
    lanes: AtomicU64,
}

/// Request headers decoded by `take`, by their raw bytes (prefix included: the flags are part of the
/// key), each with an id that is never reused; bounded: a stream of ever new shapes costs no memory.
#[derive(Default)]
struct HeaderCache {
    ids: HashMap<Vec<u8>, u64>, // keyed by bytes other processes wrote: the std's keyed SipHash
    decoded: HashMap<u64, header::Header, IdHasher>,
    next: u64,
}

/// The hasher of maps keyed by the core's own ids (header ids, counted up from 0 and never taken from
/// the segment): the id itself, where the std's SipHash spent ~300 instructions per lookup.
#[derive(Default)]
struct IdHash(u64);

impl std::hash::Hasher for IdHash {
    fn finish(&self) -> u64 {
        // Spread over the high bits too: the map takes its control byte from the top 7 bits.
        self.0.wrapping_mul(0x9E37_79B9_7F4A_7C15)
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8) | b as u64; // not reached for u64 keys (write_u64)
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

type IdHasher = std::hash::BuildHasherDefault<IdHash>;

const HEADER_CACHE_MAX: usize = 4096;
const CLIENT_GONE_MESSAGE: &[u8] = b"the client that sent this request is gone";

/// One answer layout's plan as `answer_sources` reads it: (prefix and header bytes, each array's offset
/// from the start of the response region, its bytes per row, the payload's end).
type AnswerRowsPlan<'a> = (&'a [u8], &'a [u64], &'a [u64], u64);

/// A plan as `answer_sources` reads it, from what its caller holds (`answer_known` reads its kept plans
/// in place: no list of views made per call).
pub(crate) trait PlanView {
    fn view(&self) -> AnswerRowsPlan<'_>;
}

impl PlanView for AnswerRowsPlan<'_> {
    fn view(&self) -> AnswerRowsPlan<'_> {
        *self
    }
}

/// An array's bytes as `answer_sources` reads them, from what its caller holds.
pub(crate) trait SourceView {
    fn src(&self) -> &[u8];
}

impl SourceView for &[u8] {
    fn src(&self) -> &[u8] {
        self
    }
}

/// A C-contiguous buffer of any format (a numpy array of any dtype), seen as bytes; released on drop.
struct RawBuffer {
    view: Box<ffi::Py_buffer>,
}

impl RawBuffer {
    fn get(obj: &Bound<'_, PyAny>) -> PyResult<RawBuffer> {
        // PyBUF_C_CONTIGUOUS without PyBUF_FORMAT: the exporter hands out its bytes, whatever the dtype.
        Self::with_flags(obj, ffi::PyBUF_C_CONTIGUOUS)
    }
    fn with_flags(obj: &Bound<'_, PyAny>, flags: std::ffi::c_int) -> PyResult<RawBuffer> {
        let mut view: Box<ffi::Py_buffer> = Box::new(unsafe { std::mem::zeroed() });
        let rc = unsafe { ffi::PyObject_GetBuffer(obj.as_ptr(), &mut *view, flags) };
        if rc != 0 {
            return Err(PyErr::fetch(obj.py()));
        }
        Ok(RawBuffer { view })
    }
    /// The exporter's shape (C-contiguous requests fill it); empty for a 0-d buffer.
    fn shape(&self) -> &[isize] {
        if self.view.shape.is_null() || self.view.ndim <= 0 {
            return &[];
        }
        unsafe { std::slice::from_raw_parts(self.view.shape, self.view.ndim as usize) }
    }
    fn bytes(&self) -> &[u8] {
        if self.view.buf.is_null() || self.view.len <= 0 {
            return &[];
        }
        unsafe { std::slice::from_raw_parts(self.view.buf as *const u8, self.view.len as usize) }
    }
    fn bytes_mut(&mut self) -> PyResult<&mut [u8]> {
        if self.view.readonly != 0 {
            return Err(PyValueError::new_err("the destination array is read-only"));
        }
        if self.view.buf.is_null() || self.view.len <= 0 {
            return Ok(&mut []);
        }
        Ok(unsafe { std::slice::from_raw_parts_mut(self.view.buf as *mut u8, self.view.len as usize) })
    }
}

impl Drop for RawBuffer {
    fn drop(&mut self) {
        // Dropped inside the method that made it, with the GIL held.
        unsafe { ffi::PyBuffer_Release(&mut *self.view) };
    }
}

/// An output array's bytes in C order for `answer_rows`: the exporter's own when they are C-contiguous,
/// else a copy made here by `PyBuffer_ToContiguous` (a strided or Fortran-ordered view), so the worker
/// hands its outputs over as they are and a strided one costs a copy, not a refused call and a retry.
struct SrcBytes {
    pub(crate) view: RawBuffer, // holds the export while the bytes are read
    copy: Option<Vec<u8>>,
}

impl SrcBytes {
    fn get(obj: &Bound<'_, PyAny>) -> PyResult<SrcBytes> {
        // PyBUF_STRIDES without PyBUF_FORMAT: any dtype, any memory layout, read-only allowed.
        let view = RawBuffer::with_flags(obj, ffi::PyBUF_STRIDES)?;
        if unsafe { ffi::PyBuffer_IsContiguous(&*view.view, b'C' as std::ffi::c_char) } == 1 {
            return Ok(SrcBytes { view, copy: None });
        }
        let len = view.view.len.max(0);
        let mut copy = vec![0u8; len as usize];
        let rc = unsafe {
            ffi::PyBuffer_ToContiguous(copy.as_mut_ptr().cast(), &*view.view, len, b'C' as std::ffi::c_char)
        };
        if rc != 0 {
            return Err(PyErr::fetch(obj.py()));
        }
        Ok(SrcBytes { view, copy: Some(copy) })
    }
    fn bytes(&self) -> &[u8] {
        match &self.copy {
            Some(c) => c,
            None => self.view.bytes(),
        }
    }
}

/// A buffer export of an array: what `ndarray::exact_array` falls back to, and checks the shape of.
trait Exported {
    fn raw(&self) -> &RawBuffer;
    fn bytes(&self) -> &[u8];
    fn bytes_mut(&mut self) -> PyResult<&mut [u8]> {
        Err(PyValueError::new_err("a source array is not written"))
    }
}

impl Exported for RawBuffer {
    fn raw(&self) -> &RawBuffer {
        self
    }
    fn bytes(&self) -> &[u8] {
        RawBuffer::bytes(self)
    }
    fn bytes_mut(&mut self) -> PyResult<&mut [u8]> {
        RawBuffer::bytes_mut(self)
    }
}

impl Exported for SrcBytes {
    fn raw(&self) -> &RawBuffer {
        &self.view
    }
    fn bytes(&self) -> &[u8] {
        SrcBytes::bytes(self)
    }
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
    /// `len` bytes at byte `off` of the mapping, bounded by it (a copy: another process writes there).
    fn read_bytes(&self, off: u64, len: u64) -> PyResult<Vec<u8>> {
        let end = off.checked_add(len).filter(|&e| e <= self.words * 8 && self.buf.is_some());
        if end.is_none() {
            return Err(PyIndexError::new_err(format!("bytes {off}+{len} outside the {}-byte segment", self.words * 8)));
        }
        let mut out = vec![0u8; len as usize];
        unsafe { std::ptr::copy_nonoverlapping(self.base.add(off as usize), out.as_mut_ptr(), len as usize) };
        Ok(out)
    }
    /// Copy `src` to byte `off` of the mapping, bounded by it. Through a raw pointer, never a `&mut`
    /// slice: the bytes are shared with other processes (the protocol gives this region to the worker
    /// until it answers; a process writing there anyway garbles only its own answer).
    fn write_bytes(&self, off: u64, src: &[u8]) -> PyResult<()> {
        let len = src.len() as u64;
        let end = off.checked_add(len).filter(|&e| e <= self.words * 8 && self.buf.is_some());
        if end.is_none() {
            return Err(PyIndexError::new_err(format!("bytes {off}+{len} outside the {}-byte segment", self.words * 8)));
        }
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.base.add(off as usize), src.len()) };
        Ok(())
    }
    /// The payload header of request slot `g`: its id in the cache, or why it is refused.
    fn header_id(&self, g: u64) -> PyResult<Result<u64, String>> {
        let geo = &self.geo;
        let off = geo.req_base + g * geo.req_bytes;
        let word = self.ld(off >> 3)?;
        let (hlen, flags) = (word & 0xFFFF_FFFF, word >> 32);
        if hlen == 0 || 8 + hlen > geo.req_bytes || (flags != 0 && flags != P_FLAG_EXTERNAL) {
            return Ok(Err(format!(
                "corrupt payload header: length {hlen} flags {flags:#x} in a {}-byte region (expected flags 0 or {P_FLAG_EXTERNAL})",
                geo.req_bytes
            )));
        }
        let raw = self.read_bytes(off, 8 + hlen)?;
        let mut cache = self.headers.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(&id) = cache.ids.get(&raw) {
            return Ok(Ok(id));
        }
        // The copy re-reads the prefix: decode only a copy whose prefix is the word bounded above, so a
        // writer flipping it in between cannot cache one prefix's decode under another's key.
        if raw[..8] != word.to_le_bytes() {
            return Ok(Err("corrupt payload header: its prefix changed while it was read".to_string()));
        }
        let decoded = match header::decode(&raw[8..], flags == P_FLAG_EXTERNAL) {
            Ok(h) => h,
            Err(e) => return Ok(Err(format!("corrupt payload header: {e}"))),
        };
        if cache.ids.len() >= HEADER_CACHE_MAX {
            cache.ids.clear(); // shapes that vary without bound must not grow memory without bound
            cache.decoded.clear();
        }
        let id = cache.next;
        cache.next += 1;
        cache.ids.insert(raw, id);
        cache.decoded.insert(id, decoded);
        Ok(Ok(id))
    }

    /// The words of one answer, resp_seq last (its publication, TSO), then its lane's answer count.
    #[allow(clippy::too_many_arguments)]
    fn publish_answer(&self, lane: u64, slot: u64, seq: u64, status: u64, len: u64, engine_ns: u64, call: u64) -> PyResult<()> {
        let g = &self.geo;
        let si = g.slot_word(lane * g.spl + slot);
        self.st(si + (S_RESP_LEN >> 3), len)?;
        self.st(si + (S_RESP_STATUS >> 3), status)?;
        self.st(si + (S_CALL_ENGINE_NS >> 3), engine_ns)?;
        self.st(si + (S_CALL >> 3), call)?;
        self.st(si + (S_DONE_NS >> 3), now_ns())?;
        self.st(si + (S_RESP_SEQ >> 3), seq)?;
        let ci = g.lane_word(lane, L_RESP_COUNT);
        self.st(ci, self.ld(ci)?.wrapping_add(1) & 0xFFFF_FFFF)
    }

    /// Wake the client of `lane` when it is parked (after a fence the caller made); the ns the wake's
    /// system call took, or None when the lane was not parked.
    fn wake_lane_if_parked(&self, lane: u64) -> PyResult<Option<u64>> {
        if self.ld(self.geo.lane_word(lane, L_PARKED))? != 0 {
            let word = self.w(self.geo.lane_word(lane, L_RESP_COUNT))?;
            let t0 = now_ns();
            futex_wake(word);
            return Ok(Some(now_ns().saturating_sub(t0)));
        }
        Ok(None)
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
            PyValueError::new_err(format!(
                "geometry lanes={lanes} spl={spl} req={req_bytes} resp={resp_bytes}: expected lanes 1..{MAX_LANES}, spl a power of two up to 65536 and regions up to 2^32 bytes"
            ))
        })?;
        if geo.total != total || (buf.len_bytes() as u64) < total {
            return Err(PyValueError::new_err(format!(
                "segment of {} bytes, geometry needs {} (Python computed {total})",
                buf.len_bytes(),
                geo.total
            )));
        }
        let base = buf.buf_ptr() as *mut u8;
        if !(base as usize).is_multiple_of(64) {
            return Err(PyValueError::new_err("the segment buffer is not 64-byte aligned"));
        }
        Ok(Segment {
            words: geo.total / 8,
            base,
            buf: Some(buf),
            geo,
            headers: Mutex::new(HeaderCache::default()),
            wakes: WakeTotals::default(),
        })
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
        // modulo 2^64 and never 0, a slot's claim_seq and resp_seq before its first request
        let seq = self.ld(si + (S_REQ_SEQ >> 3))?.wrapping_add(1).max(1);
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
    /// Returns what the wakes cost: (ns in their system calls, lanes woken).
    #[pyo3(signature = (items, engine_ns, call, wake=true))]
    fn answer(&self, items: Vec<(u64, u64, u64, u64, u64)>, engine_ns: u64, call: u64, wake: bool) -> PyResult<(u64, u64)> {
        let mut lanes: [u64; 4] = [0; 4]; // lanes up to 256: a bitset
        for &(lane, slot, seq, status, len) in &items {
            self.check_lane(lane)?;
            self.check_slot(slot)?;
            self.publish_answer(lane, slot, seq, status, len, engine_ns, call)?;
            lanes[(lane >> 6) as usize] |= 1 << (lane & 63);
        }
        if wake {
            return self.wake(lanes);
        }
        Ok((0, 0))
    }

    /// `claim` and the payload header's decode in one call. Returns (kind, slot, seq, gen, submit_ns,
    /// header): for a claimed request (kind 0) the header is the id of its decoded header (`header`
    /// gives it) or a str saying why the header is refused (answer it ST_BAD_REQUEST).
    fn take(&self, py: Python<'_>, lane: u64, tail: u64, now: u64) -> PyResult<(u8, u64, u64, u64, u64, PyObject)> {
        let (kind, s, seq, gen, submit) = self.claim(lane, tail, now)?;
        let hdr = if kind == 0 {
            match self.header_id(lane * self.geo.spl + s)? {
                Ok(id) => id.into_pyobject(py)?.into_any().unbind(),
                Err(why) => why.into_pyobject(py)?.into_any().unbind(),
            }
        } else {
            py.None()
        };
        Ok((kind, s, seq, gen, submit, hdr))
    }

    /// A header `take` decoded, by id: (segment name or None, ((name, dtype code, shape), ...)), or
    /// None when the cache no longer holds it.
    fn header(&self, py: Python<'_>, id: u64) -> PyResult<PyObject> {
        let cache = self.headers.lock().unwrap_or_else(|e| e.into_inner());
        match cache.decoded.get(&id) {
            Some(h) => {
                let arrays: Vec<(String, u8, Vec<u64>)> = h.arrays.iter().map(|a| (a.name.clone(), a.code, a.shape.clone())).collect();
                Ok((h.slot_name.clone(), arrays).into_pyobject(py)?.into_any().unbind())
            }
            None => Ok(py.None()),
        }
    }

    /// Copy the inline inputs of several requests into the arrays of one batch: `items` are (lane,
    /// slot, row0, rows, plan) and `plans` (offsets, row_bytes) per layout, offsets from the start of
    /// the request region; `dst` the batch's C-contiguous arrays in header order. Every copy bounded
    /// by the request region and by the destination.
    fn gather(&self, items: Vec<(u64, u64, u64, u64, usize)>, plans: Vec<(Vec<u64>, Vec<u64>)>, dst: Vec<Bound<'_, PyAny>>) -> PyResult<()> {
        let g = &self.geo;
        let mut outs: Vec<RawBuffer> = dst.iter().map(RawBuffer::get).collect::<PyResult<_>>()?;
        for &(lane, slot, row0, rows, plan) in &items {
            self.check_lane(lane)?;
            self.check_slot(slot)?;
            let (offs, row_bytes) = plans.get(plan).ok_or_else(|| PyIndexError::new_err(format!("plan {plan} of {}", plans.len())))?;
            if offs.len() != outs.len() || row_bytes.len() != outs.len() {
                return Err(PyValueError::new_err(format!("a plan of {} arrays for {} destinations", offs.len(), outs.len())));
            }
            let region = g.req_base + (lane * g.spl + slot) * g.req_bytes;
            for (k, out) in outs.iter_mut().enumerate() {
                let n = rows.checked_mul(row_bytes[k]).ok_or_else(|| PyValueError::new_err("rows x row bytes overflows"))?;
                let at = row0.checked_mul(row_bytes[k]).ok_or_else(|| PyValueError::new_err("row x row bytes overflows"))?;
                if offs[k].checked_add(n).is_none_or(|e| e > g.req_bytes) {
                    return Err(PyIndexError::new_err(format!("array {k}: {n} bytes at {} outside the {}-byte request region", offs[k], g.req_bytes)));
                }
                let d = out.bytes_mut()?;
                if at.checked_add(n).is_none_or(|e| e as usize > d.len()) {
                    return Err(PyIndexError::new_err(format!("array {k}: rows {row0}+{rows} outside the {}-byte destination", d.len())));
                }
                let src = self.read_bytes(region + offs[k], n)?;
                d[at as usize..(at + n) as usize].copy_from_slice(&src);
            }
        }
        Ok(())
    }

    /// Answer a batch whose outputs are `src` (arrays in header order, leading dimension the batch's
    /// samples; any memory layout: one that is not C-contiguous is copied to C order first): `items`
    /// are (lane, slot, seq, gen, row0, rows, plan) and `plans` (prefix, offsets, row_bytes) per answer
    /// layout (the prefix and header bytes, each array's offset from the
    /// start of the response region, its bytes per row, the payload's end). Per request: rows row0..row0+rows of each
    /// array and the prefix into its response region (or ST_CLIENT_GONE when its lane changed hands
    /// since the claim), its words, resp_seq last, its lane's count; then one fence and one wake per
    /// parked lane. Returns (the statuses written, ns in the wakes' system calls, lanes woken). Every
    /// copy is bounded by the source and the region.
    #[allow(clippy::type_complexity)]
    fn answer_rows(
        &self,
        items: Vec<(u64, u64, u64, u64, u64, u64, usize)>,
        plans: Vec<(PyBackedBytes, Vec<u64>, Vec<u64>, u64)>,
        src: Vec<Bound<'_, PyAny>>,
        engine_ns: u64,
        call: u64,
    ) -> PyResult<(Vec<u64>, u64, u64)> {
        let ins: Vec<SrcBytes> = src.iter().map(SrcBytes::get).collect::<PyResult<_>>()?;
        let plans: Vec<AnswerRowsPlan<'_>> = plans.iter().map(|(p, o, r, e)| (&p[..], o.as_slice(), r.as_slice(), *e)).collect();
        let ins: Vec<&[u8]> = ins.iter().map(SrcBytes::bytes).collect();
        self.answer_sources(&items, &plans, &ins, engine_ns, call, &mut |_| ())
    }

    /// Wake the parked clients of `lanes` (after one fence): one system call per parked lane. Returns
    /// (ns in those system calls, lanes woken).
    fn wake_lanes(&self, lanes: Vec<u64>) -> PyResult<(u64, u64)> {
        let mut set: [u64; 4] = [0; 4];
        for lane in lanes {
            self.check_lane(lane)?;
            set[(lane >> 6) as usize] |= 1 << (lane & 63);
        }
        self.wake(set)
    }

    /// What the wakes of parked clients cost since this mapping was made, summed over every call
    /// above: (ns in their system calls, lanes woken).
    fn wakes(&self) -> (u64, u64) {
        (self.wakes.ns.load(Ordering::Relaxed), self.wakes.lanes.load(Ordering::Relaxed))
    }
}

impl Segment {
    /// `answer_rows` of sources already taken (`ins`, each array's bytes in the plans' array order);
    /// shared with `answer_known`, which learns each request answered (`published`, called with its
    /// index in `items` right after its resp_seq: no Python code runs here, whatever happens) and marks
    /// them when this returns, so no Python code runs between an answer and its mark.
    pub(crate) fn answer_sources<P: PlanView, S: SourceView>(
        &self,
        items: &[(u64, u64, u64, u64, u64, u64, usize)],
        plans: &[P],
        ins: &[S],
        engine_ns: u64,
        call: u64,
        published: &mut dyn FnMut(usize),
    ) -> PyResult<(Vec<u64>, u64, u64)> {
        let g = &self.geo;
        // Everything checked before the first answer is written: a bad call answers nothing.
        for &(lane, slot, _, _, row0, rows, plan) in items {
            self.check_lane(lane)?;
            self.check_slot(slot)?;
            let (prefix, offs, row_bytes, end) = plans.get(plan).ok_or_else(|| PyIndexError::new_err(format!("plan {plan} of {}", plans.len())))?.view();
            if offs.len() != ins.len() || row_bytes.len() != ins.len() {
                return Err(PyValueError::new_err(format!("a plan of {} arrays for {} sources", offs.len(), ins.len())));
            }
            if prefix.len() as u64 > g.resp_bytes || end > g.resp_bytes {
                return Err(PyIndexError::new_err(format!("a {}-byte header in a {}-byte response region", prefix.len(), g.resp_bytes)));
            }
            for (k, inp) in ins.iter().enumerate() {
                let n = rows.checked_mul(row_bytes[k]);
                let at = row0.checked_mul(row_bytes[k]);
                let (Some(n), Some(at)) = (n, at) else {
                    return Err(PyValueError::new_err("rows x row bytes overflows"));
                };
                if offs[k] < prefix.len() as u64 || offs[k].checked_add(n).is_none_or(|e| e > g.resp_bytes) {
                    return Err(PyIndexError::new_err(format!("array {k}: {n} bytes at {} outside the {}-byte response region", offs[k], g.resp_bytes)));
                }
                if at.checked_add(n).is_none_or(|e| e as usize > inp.src().len()) {
                    return Err(PyIndexError::new_err(format!("array {k}: rows {row0}+{rows} outside the {}-byte output", inp.src().len())));
                }
            }
        }
        let mut lanes: [u64; 4] = [0; 4];
        let mut statuses = Vec::with_capacity(items.len());
        for (i, &(lane, slot, seq, gen, row0, rows, plan)) in items.iter().enumerate() {
            let (prefix, offs, row_bytes, end) = plans[plan].view();
            let gi = lane * g.spl + slot;
            let region = g.resp_base + gi * g.resp_bytes;
            let (status, len) = if self.ld(g.lane_word(lane, L_GEN))? != gen {
                self.write_bytes(region, CLIENT_GONE_MESSAGE)?;
                (ST_CLIENT_GONE, CLIENT_GONE_MESSAGE.len() as u64)
            } else {
                // Written every time, as the client does: a header another process overwrote heals.
                self.write_bytes(region, prefix)?;
                for (k, inp) in ins.iter().enumerate() {
                    let n = rows * row_bytes[k];
                    let at = (row0 * row_bytes[k]) as usize;
                    self.write_bytes(region + offs[k], &inp.src()[at..at + n as usize])?;
                }
                (ST_OK, end)
            };
            self.publish_answer(lane, slot, seq, status, len, engine_ns, call)?;
            published(i);
            lanes[(lane >> 6) as usize] |= 1 << (lane & 63);
            statuses.push(status);
        }
        let (ns, woken) = self.wake(lanes)?;
        Ok((statuses, ns, woken))
    }

    /// Wake the parked clients of the lanes in `set`; (ns in the wakes' system calls, lanes woken),
    /// timed around each system call alone (the loads of the parked flags are not wakes).
    fn wake(&self, set: [u64; 4]) -> PyResult<(u64, u64)> {
        if set == [0; 4] {
            return Ok((0, 0));
        }
        fence(Ordering::SeqCst); // the answers' stores before the loads of client_parked (Dekker)
        let (mut ns, mut woken) = (0u64, 0u64);
        for (k, bits) in set.iter().enumerate() {
            let mut b = *bits;
            while b != 0 {
                let lane = (k as u64) * 64 + b.trailing_zeros() as u64;
                b &= b - 1;
                if let Some(took) = self.wake_lane_if_parked(lane)? {
                    ns += took;
                    woken += 1;
                }
            }
        }
        if woken != 0 {
            self.wakes.ns.fetch_add(ns, Ordering::Relaxed);
            self.wakes.lanes.fetch_add(woken, Ordering::Relaxed);
        }
        Ok((ns, woken))
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
    m.add_class::<client::RequestPlan>()?;
    m.add_class::<client::AnswerPlan>()?;
    m.add_function(wrap_pyfunction!(client::send_request, m)?)?;
    m.add_function(wrap_pyfunction!(client::receive_answer, m)?)?;
    m.add_function(wrap_pyfunction!(client::round_trip, m)?)?;
    m.add_class::<poll::Poller>()?;
    m.add_class::<answer::KnownOutputs>()?;
    m.add_class::<recorder::CallRecorder>()?;
    m.add_function(wrap_pyfunction!(answer::answer_known, m)?)?;
    m.add_function(wrap_pyfunction!(answer::complete_known_py, m)?)?;
    m.add_function(wrap_pyfunction!(ndarray::direct_array_reads, m)?)?;
    m.add_function(wrap_pyfunction!(ndarray::fresh_arrays_by_c_api, m)?)?;
    m.add_function(wrap_pyfunction!(full_barrier, m)?)?;
    m.add_function(wrap_pyfunction!(decode_header, m)?)?;
    m.add("LAYOUT_DIGEST", LAYOUT_DIGEST)?;
    m.add("LATE_WINDOW", client::LATE_WINDOW)?;
    m.add("PREDICT_UP_SHIFT", client::PREDICT_UP_SHIFT)?;
    m.add("VERSION", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
