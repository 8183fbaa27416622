//! The serving loop's stamps and its bookkeeping after each answered call, as the loop and
//! `lowtail.serve.call_recorder.CallRecorder` do them (the reference): the scheduler counters when the
//! call was sampled or descheduled, the raw row in the stats ring, the served and sampled counters, the
//! slow check and the SCHED_FIFO words.
//!
//! The stats segment is the worker's own mapping (other processes only read it), so nothing here is
//! hostile input; still every place is checked once, when the recorder is made: the row's fields by
//! name against `RAW_FIELDS`, each header word and the whole ring against the mapping's length. A row
//! goes in before the count that publishes it (a release store), as the readers expect.

use std::sync::atomic::{AtomicI64, Ordering};

use pyo3::buffer::PyBuffer;
use pyo3::exceptions::{PyOSError, PyOverflowError, PyValueError};
use pyo3::ffi;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::answer::complete_known;
use crate::now_ns;

/// `call_stats.RAW_FIELDS`, in order: the stamps the loop takes, then what the recorder adds. Checked
/// against the Python tuple when a recorder is made, so the two can never drift apart silently.
const RAW_FIELDS: [&str; 29] = [
    "t0", "th0", "c0", "m0", "f0", "k0", "et0", "ec0", "e0", "e1", "et1", "ec1", "a0", "a1", "f1", "th1", "c1",
    "t1", "wk", "wn", "batch", "slots", "wait_ns", "claimed_ns", "run_delay_ns", "nivcsw", "read_ns",
    "record_ns", "sampled",
];
const N_STAMPS: usize = 20;
// The stamps the recorder reads, by their index in RAW_FIELDS.
const T0: usize = 0;
const TH0: usize = 1;
const C0: usize = 2;
const M0: usize = 3;
const F0: usize = 4;
const K0: usize = 5;
const ET0: usize = 6;
const EC0: usize = 7;
const E0: usize = 8;
const E1: usize = 9;
const ET1: usize = 10;
const EC1: usize = 11;
const A0: usize = 12;
const A1: usize = 13;
const F1: usize = 14;
const TH1: usize = 15;
const C1: usize = 16;
const T1: usize = 17;
const WK: usize = 18;
const WN: usize = 19;

/// The header words the recorder writes (`stats_segment`'s indices, passed in by name).
#[derive(Clone, Copy)]
struct Words {
    count: usize,
    heartbeat: usize,
    samples: usize,
    slow: usize,
    engine_cpu: usize,
    engine_thread: usize,
    fifo: usize,
    fifo_switches: usize,
    fifo_cooldowns: usize,
}

/// One serving loop's recorder (`lowtail.serve.call_recorder.new_recorder` makes it): used by the
/// thread that made it alone, whose scheduler counters it reads.
#[pyclass(module = "lowtail_native", unsendable)]
pub struct CallRecorder {
    buf: Option<PyBuffer<u8>>,
    base: *mut u8,
    words: Words,
    first: usize,
    cap: u64,
    width: usize,
    fifo: Py<PyAny>,
    on_slow: Py<PyAny>,
    slow_cpu_ns: i64,
    slow_total_ns: i64,
    descheduled_ns: i64,
    every: u64,
    schedstat: libc::c_int,
    rd_last: i64,
    iv_last: i64,
    record_ns: i64,
    samples: i64,
    #[pyo3(get)]
    count: u64,
    #[pyo3(get)]
    sampled: bool,
    #[pyo3(get, set)]
    threads: i64,
}

/// This thread's run_delay (ns, the second field of its schedstat) from the file kept open.
fn run_delay_ns(fd: libc::c_int) -> PyResult<i64> {
    let mut b = [0u8; 96];
    let n = unsafe { libc::pread(fd, b.as_mut_ptr() as *mut libc::c_void, b.len(), 0) };
    if n < 0 {
        return Err(PyOSError::new_err(format!("reading /proc/thread-self/schedstat: {}", std::io::Error::last_os_error())));
    }
    std::str::from_utf8(&b[..n as usize])
        .ok()
        .and_then(|s| s.split_ascii_whitespace().nth(1))
        .and_then(|f| f.parse::<i64>().ok())
        .ok_or_else(|| PyValueError::new_err("/proc/thread-self/schedstat: no run_delay field"))
}

/// This thread's involuntary context switches (getrusage RUSAGE_THREAD, as ThreadCounters reads them).
fn nivcsw() -> PyResult<i64> {
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    if unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut ru) } != 0 {
        return Err(PyOSError::new_err(format!("getrusage: {}", std::io::Error::last_os_error())));
    }
    Ok(ru.ru_nivcsw as i64)
}

/// A clock as Python's `time` module reads it: CLOCK_THREAD_CPUTIME_ID is `thread_time_ns`,
/// CLOCK_PROCESS_CPUTIME_ID `process_time_ns` (both system calls: no vDSO path for CPU clocks).
fn clock_ns(id: libc::clockid_t) -> i64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    unsafe { libc::clock_gettime(id, &mut ts) };
    ts.tv_sec * 1_000_000_000 + ts.tv_nsec
}

/// The longest of a call's waits, as int64: a wait below int64 (a forged submit stamp far in the
/// future) reads as no wait, as it does in Python; one above it cannot be stored (Python's pack_into
/// refuses it too).
fn longest_wait(waits: &Bound<'_, PyList>) -> PyResult<i64> {
    if waits.is_empty() {
        return Err(PyValueError::new_err("a call of no requests: expected at least one wait"));
    }
    let mut longest = i64::MIN;
    for w in waits.iter() {
        let mut overflow: std::ffi::c_int = 0;
        let v = unsafe { ffi::PyLong_AsLongLongAndOverflow(w.as_ptr(), &mut overflow) };
        if v == -1 && overflow == 0 {
            if let Some(e) = PyErr::take(w.py()) {
                return Err(e);
            }
        }
        let v = match overflow {
            0 => v,
            o if o < 0 => i64::MIN,
            _ => return Err(PyOverflowError::new_err(format!("a wait of {w} ns does not fit the ring's int64"))),
        };
        longest = longest.max(v);
    }
    Ok(longest.max(0))
}

impl CallRecorder {
    fn word(&self, i: usize) -> &AtomicI64 {
        // Checked in new(): every index the recorder writes is within the header.
        unsafe { &*(self.base.add(i * 8) as *const AtomicI64) }
    }

    fn store(&self, i: usize, v: i64) {
        self.word(i).store(v, Ordering::Relaxed);
    }

    fn add(&self, i: usize, v: i64) {
        let w = self.word(i);
        w.store(w.load(Ordering::Relaxed).wrapping_add(v), Ordering::Relaxed);
    }

    /// The call's row (`row`, its stamps filled in), counters and words, and the slow check: (the slow
    /// call's index, the worker's threads and the callback that logs it, when it was slow; the call's
    /// end stamp; the counters' read time).
    #[allow(clippy::type_complexity)]
    fn write_call(
        &mut self,
        py: Python<'_>,
        waits_ns: &Bound<'_, PyList>,
        claimed_ns: i64,
        n: i64,
        mut row: [i64; 29],
    ) -> PyResult<(Option<(u64, i64, Py<PyAny>)>, i64, i64)> {
        if self.buf.is_none() {
            return Err(PyValueError::new_err("the recorder is closed"));
        }
        let sampled = self.sampled;
        let t1 = row[T1];
        let wall_ns = t1.wrapping_sub(row[T0]);
        let (mut rd_delta, mut iv_delta, mut read_ns) = (0, 0, 0);
        if sampled || wall_ns.wrapping_sub(row[TH1].wrapping_sub(row[TH0])) > self.descheduled_ns {
            let r0 = now_ns() as i64;
            let (rd, iv) = (run_delay_ns(self.schedstat)?, nivcsw()?);
            rd_delta = rd.wrapping_sub(self.rd_last);
            iv_delta = iv.wrapping_sub(self.iv_last);
            (self.rd_last, self.iv_last) = (rd, iv);
            read_ns = (now_ns() as i64).wrapping_sub(r0);
        }
        let k = self.count;
        let wait = longest_wait(waits_ns)?;
        row[N_STAMPS..].copy_from_slice(&[
            n,
            waits_ns.len() as i64,
            wait,
            claimed_ns,
            rd_delta,
            iv_delta,
            read_ns,
            self.record_ns,
            sampled as i64,
        ]);
        // Checked in new(): every row of the ring lies in the mapping.
        let at = unsafe { self.base.add(self.first + (k % self.cap) as usize * self.width) as *mut i64 };
        for (i, v) in row.iter().enumerate() {
            unsafe { std::ptr::write_volatile(at.add(i), *v) };
        }
        let w = self.words;
        self.store(w.heartbeat, t1);
        let count = k + 1;
        self.count = count;
        self.sampled = count % self.every == 0;
        self.word(w.count).store(count as i64, Ordering::Release); // the row before the count
        self.samples = self.samples.wrapping_add(n);
        self.store(w.samples, self.samples);
        let engine_thread_ns = row[ET1].wrapping_sub(row[ET0]);
        let mut engine_cpu_ns = engine_thread_ns;
        if sampled {
            engine_cpu_ns = row[EC1].wrapping_sub(row[EC0]);
            self.add(w.engine_cpu, engine_cpu_ns);
            self.add(w.engine_thread, engine_thread_ns);
        }
        let mut slow = None;
        if engine_cpu_ns > self.slow_cpu_ns || wall_ns > self.slow_total_ns {
            self.add(w.slow, 1);
            slow = Some((k, self.threads, self.on_slow.clone_ref(py)));
        }
        Ok((slow, t1, read_ns))
    }

    /// The SCHED_FIFO words and what this call's recording cost (stored in the next call's row).
    fn finish(&mut self, py: Python<'_>, t1: i64, read_ns: i64) -> PyResult<()> {
        if self.buf.is_none() {
            // closed by the slow call's log handler: its words are not the recorder's to write any more
            return Err(PyValueError::new_err("the recorder was closed while its slow call was logged"));
        }
        let w = self.words;
        let fifo = self.fifo.bind(py);
        if !fifo.getattr(intern!(py, "available"))?.is_truthy()? && self.word(w.fifo).load(Ordering::Relaxed) != 0 {
            self.store(w.fifo, 0);
        }
        self.store(w.fifo_switches, fifo.getattr(intern!(py, "switches"))?.extract()?);
        self.store(w.fifo_cooldowns, fifo.getattr(intern!(py, "cooldowns"))?.extract()?);
        self.record_ns = (now_ns() as i64).wrapping_sub(t1).wrapping_sub(read_ns);
        Ok(())
    }
}

#[pymethods]
impl CallRecorder {
    /// `buffer` the stats mapping, its ring of `capacity` rows of `width` bytes from byte `first`;
    /// `fields` the names of a row's values (`RAW_FIELDS`), `words` the header's word index of each
    /// name the recorder writes.
    #[new]
    #[pyo3(signature = (buffer, first, capacity, width, fields, words, fifo, on_slow, *, threads, slow_cpu_ns, slow_total_ns, descheduled_ns, stats_every))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        buffer: &Bound<'_, PyAny>,
        first: usize,
        capacity: u64,
        width: usize,
        fields: Vec<String>,
        words: std::collections::HashMap<String, usize>,
        fifo: Py<PyAny>,
        on_slow: Py<PyAny>,
        threads: i64,
        slow_cpu_ns: i64,
        slow_total_ns: i64,
        descheduled_ns: i64,
        stats_every: u64,
    ) -> PyResult<Self> {
        let named = [(T0, "t0"), (TH0, "th0"), (ET0, "et0"), (EC0, "ec0"), (ET1, "et1"), (EC1, "ec1"), (TH1, "th1"), (T1, "t1")];
        debug_assert!(named.iter().all(|&(i, n)| RAW_FIELDS[i] == n));
        if fields != RAW_FIELDS {
            return Err(PyValueError::new_err(format!(
                "the stats ring's row is {fields:?}; this core writes {RAW_FIELDS:?}: rebuild it (make native)"
            )));
        }
        let buf = PyBuffer::<u8>::get(buffer)?;
        if buf.readonly() || !buf.is_c_contiguous() {
            return Err(PyValueError::new_err("the stats buffer must be writable and contiguous"));
        }
        let len = buf.len_bytes();
        let name = |n: &str| -> PyResult<usize> {
            let i = *words.get(n).ok_or_else(|| PyValueError::new_err(format!("no header word named {n}")))?;
            if i >= first / 8 {
                return Err(PyValueError::new_err(format!("header word {n} = {i} lies past the header (ring at byte {first})")));
            }
            Ok(i)
        };
        let w = Words {
            count: name("count")?,
            heartbeat: name("heartbeat")?,
            samples: name("samples")?,
            slow: name("slow")?,
            engine_cpu: name("engine_cpu")?,
            engine_thread: name("engine_thread")?,
            fifo: name("fifo")?,
            fifo_switches: name("fifo_switches")?,
            fifo_cooldowns: name("fifo_cooldowns")?,
        };
        let ring_end = (capacity as usize).checked_mul(width).and_then(|r| r.checked_add(first));
        if capacity == 0 || width != 8 * RAW_FIELDS.len() || ring_end.is_none_or(|e| e > len) || first % 8 != 0 {
            return Err(PyValueError::new_err(format!(
                "a ring of {capacity} rows of {width} bytes from byte {first} in a mapping of {len}: expected \
                 rows of {} bytes that fit",
                8 * RAW_FIELDS.len()
            )));
        }
        let base = buf.buf_ptr() as *mut u8;
        if !(base as usize).is_multiple_of(8) || stats_every == 0 {
            return Err(PyValueError::new_err("the stats buffer must be 8-byte aligned and stats_every positive"));
        }
        // Opened by the thread it describes (/proc/thread-self resolves at open time), as ThreadCounters.
        let path = c"/proc/thread-self/schedstat";
        let fd = unsafe { libc::open(path.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
        if fd < 0 {
            return Err(PyOSError::new_err(format!("opening /proc/thread-self/schedstat: {}", std::io::Error::last_os_error())));
        }
        let (rd, iv) = match (run_delay_ns(fd), nivcsw()) {
            (Ok(rd), Ok(iv)) => (rd, iv),
            (Err(e), _) | (_, Err(e)) => {
                unsafe { libc::close(fd) };
                return Err(e);
            }
        };
        Ok(CallRecorder {
            buf: Some(buf),
            base,
            words: w,
            first,
            cap: capacity,
            width,
            fifo,
            on_slow,
            slow_cpu_ns,
            slow_total_ns,
            descheduled_ns,
            every: stats_every,
            schedstat: fd,
            rd_last: rd,
            iv_last: iv,
            record_ns: 0,
            samples: 0,
            count: 0,
            sampled: true,
            threads,
        })
    }

    /// One answered call of `n` samples from the requests that waited `waits_ns`; `st` its stamps
    /// (`call_stats.T0` ... `WN`), `claimed_ns` the poll that took the first request.
    fn record(slf: &Bound<'_, Self>, waits_ns: &Bound<'_, PyList>, claimed_ns: i64, n: i64, st: &Bound<'_, PyList>) -> PyResult<()> {
        let mut row = [0i64; 29];
        stamps_into(st, &mut row[..N_STAMPS])?;
        record_row(slf, waits_ns, claimed_ns, n, row)
    }

    /// The start of a call on a claimed batch, as the loop takes it: the stamps `t0`, `th0`, `c0` (on
    /// sampled calls), `m0`, then `fifo.enter()` (with the recorder not borrowed), `f0`, into `st`;
    /// returns the batch's inputs. An open batch of a live worker has them read here without the
    /// `inputs` property's Python frame; any other object's `inputs` is read as an attribute, so a
    /// closed batch's property refuses it (after the stamps and `enter()`: the loop leaves SCHED_FIFO).
    #[pyo3(signature = (batch, st))]
    fn begin_call<'py>(slf: &Bound<'py, Self>, batch: &Bound<'py, PyAny>, st: &Bound<'py, PyList>) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        if st.len() != N_STAMPS {
            return Err(PyValueError::new_err(format!("{} stamps: expected {N_STAMPS}", st.len())));
        }
        st.set_item(T0, now_ns() as i64)?;
        let (sampled, fifo) = {
            let r = slf.try_borrow()?;
            (r.sampled, r.fifo.clone_ref(py))
        };
        st.set_item(TH0, clock_ns(libc::CLOCK_THREAD_CPUTIME_ID))?;
        st.set_item(C0, if sampled { clock_ns(libc::CLOCK_PROCESS_CPUTIME_ID) } else { 0 })?;
        st.set_item(M0, now_ns() as i64)?;
        fifo.bind(py).call_method0(intern!(py, "enter"))?;
        st.set_item(F0, now_ns() as i64)?;
        batch_inputs(py, batch)
    }

    /// The stamps between the model's check and its call, as the loop takes them: `k0`, `et0`, `ec0`
    /// (on sampled calls), `e0`, into `st`.
    fn start_engine(&self, st: &Bound<'_, PyList>) -> PyResult<()> {
        if st.len() != N_STAMPS {
            return Err(PyValueError::new_err(format!("{} stamps: expected {N_STAMPS}", st.len())));
        }
        st.set_item(K0, now_ns() as i64)?;
        st.set_item(ET0, clock_ns(libc::CLOCK_THREAD_CPUTIME_ID))?;
        st.set_item(EC0, if self.sampled { clock_ns(libc::CLOCK_PROCESS_CPUTIME_ID) } else { 0 })?;
        st.set_item(E0, now_ns() as i64)
    }

    /// The rest of a call once its `infer()` returned, in one core call (moving the loop's Python here
    /// took its count from 60,318 to 56,823 instructions per call beyond `infer()`): the stamps from
    /// `e1` on, each from the clock the loop reads; the answer with the call's engine time and its
    /// deschedule so far, as the loop computes them (`complete_known`, else
    /// `batch.complete(outputs, engine_ns=, deschedule_ns=)`); `fifo.leave()` between `a1` and `f1`
    /// when `per_call`; then `record`'s bookkeeping. `st` holds the stamps `t0` ... `e0` (`begin_call`'s and `start_engine`'s, or the loop's); the
    /// later ones go into the row, not back into `st`. Whatever `complete` raises propagates with
    /// nothing recorded, as in the loop; a recorder closed since raises after the answer.
    #[pyo3(signature = (batch, outputs, n, st, per_call))]
    fn finish_call(
        slf: &Bound<'_, Self>,
        batch: &Bound<'_, PyAny>,
        outputs: &Bound<'_, PyAny>,
        n: i64,
        st: &Bound<'_, PyList>,
        per_call: bool,
    ) -> PyResult<()> {
        let py = slf.py();
        let mut row = [0i64; 29];
        row[E1] = now_ns() as i64;
        let sampled = slf.try_borrow()?.sampled;
        row[ET1] = clock_ns(libc::CLOCK_THREAD_CPUTIME_ID);
        row[EC1] = if sampled { clock_ns(libc::CLOCK_PROCESS_CPUTIME_ID) } else { 0 };
        row[A0] = now_ns() as i64;
        stamps_into(st, &mut row[..=E0])?;
        let engine_ns = row[E1].wrapping_sub(row[E0]);
        let deschedule = row[A0].wrapping_sub(row[T0]).wrapping_sub(row[ET1]).wrapping_add(row[TH0]);
        // A layout answered before is answered here (without complete()'s Python frames: 56,823 to
        // 49,576 instructions per call beyond infer()); anything else by the batch's complete().
        (row[WK], row[WN]) = match complete_known(py, batch, outputs, engine_ns.max(0) as u64, deschedule)? {
            Some((ns, woken)) => (ns as i64, woken as i64),
            None => {
                let kw = PyDict::new(py);
                kw.set_item(intern!(py, "engine_ns"), engine_ns)?;
                kw.set_item(intern!(py, "deschedule_ns"), deschedule)?;
                batch.call_method(intern!(py, "complete"), (outputs,), Some(&kw))?.extract()?
            }
        };
        row[A1] = now_ns() as i64;
        row[F1] = row[A1];
        if per_call {
            // Called with the recorder not borrowed: leave() may log, and a log handler may use it.
            let fifo = slf.try_borrow()?.fifo.clone_ref(py);
            fifo.bind(py).call_method0(intern!(py, "leave"))?;
            row[F1] = now_ns() as i64;
        }
        row[TH1] = clock_ns(libc::CLOCK_THREAD_CPUTIME_ID);
        row[C1] = if sampled { clock_ns(libc::CLOCK_PROCESS_CPUTIME_ID) } else { 0 };
        row[T1] = now_ns() as i64;
        let waits = batch.getattr(intern!(py, "queue_wait_ns"))?;
        let claimed_ns: i64 = batch.getattr(intern!(py, "claimed_ns"))?.extract()?;
        record_row(slf, waits.downcast::<PyList>()?, claimed_ns, n, row)
    }

    /// Release the stats buffer and the schedstat file; every later record raises.
    fn close(&mut self, py: Python<'_>) {
        if let Some(b) = self.buf.take() {
            b.release(py);
            unsafe { libc::close(self.schedstat) };
        }
    }

    #[getter]
    fn closed(&self) -> bool {
        self.buf.is_none()
    }
}

/// `batch.inputs` (`lowtail.shm.server.Batch`): read from the open batch of a live worker, else the
/// property's, which raises `BatchClosed` with its reason (one source for that message).
fn batch_inputs<'py>(py: Python<'py>, batch: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    if let (Ok(open), Ok(worker)) = (batch.getattr(intern!(py, "_open")), batch.getattr(intern!(py, "_worker"))) {
        if open.is_truthy()? && !worker.getattr(intern!(py, "_closed"))?.is_truthy()? {
            return batch.getattr(intern!(py, "_inputs"));
        }
    }
    batch.getattr(intern!(py, "inputs"))
}

/// The stamps of `st` (the loop's list, `N_STAMPS` long) into `into`, from the first.
fn stamps_into(st: &Bound<'_, PyList>, into: &mut [i64]) -> PyResult<()> {
    if st.len() != N_STAMPS {
        return Err(PyValueError::new_err(format!("{} stamps: expected {N_STAMPS}", st.len())));
    }
    for (i, v) in into.iter_mut().enumerate() {
        *v = st.get_item(i)?.extract()?;
    }
    Ok(())
}

/// `record` of a row whose stamps are filled in.
fn record_row(slf: &Bound<'_, CallRecorder>, waits_ns: &Bound<'_, PyList>, claimed_ns: i64, n: i64, row: [i64; 29]) -> PyResult<()> {
    let py = slf.py();
    let (slow, t1, read_ns) = slf.try_borrow_mut()?.write_call(py, waits_ns, claimed_ns, n, row)?;
    if let Some((k, threads, on_slow)) = slow {
        // Called with the recorder not borrowed: a log handler may read it (count, threads).
        on_slow.call1(py, (k, threads))?;
    }
    slf.try_borrow_mut()?.finish(py, t1, read_ns)
}

impl Drop for CallRecorder {
    fn drop(&mut self) {
        if self.buf.is_some() {
            unsafe { libc::close(self.schedstat) };
        }
    }
}
