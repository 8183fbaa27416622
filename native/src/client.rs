//! The client's round trip in the core: a request's layout check, copy-in and publication in one call
//! (`send_request`), and an answer's words, the check of its header against the one the client parsed
//! last in that slot, and the copy-out into fresh arrays in one call (`receive_answer`, which may spin for the answer first).
//!
//! What to copy comes from plans the Python side builds once per payload layout (`RequestPlan`,
//! `AnswerPlan`) and checks nothing against the mapping: every offset and length is bounded here, at
//! each call, by the slot's region before the first byte is written or read. Bytes of the mapping are
//! written and read through raw pointers (other processes share them), never as Rust slices.

use pyo3::intern;
use pyo3::types::{PyBool, PyDict, PyString, PyTuple};

use super::*;
use crate::ndarray::{exact_array, fresh_array, layout_ok, nbytes_of, ArrayBytes};

/// Refused unless each array's byte count is what its dtype and shape take: a direct read of an array
/// (`ndarray::exact_array`) takes that count as the array's length.
fn check_nbytes(py: Python<'_>, arrays: impl Iterator<Item = (u64, Vec<isize>, PyObject)>) -> PyResult<()> {
    for (k, (n, shape, dtype)) in arrays.enumerate() {
        let want = nbytes_of(py, dtype.bind(py), &shape)?;
        if n != want {
            return Err(PyValueError::new_err(format!("array {k}: {n} bytes, its dtype and shape {shape:?} take {want}")));
        }
    }
    Ok(())
}

/// Bounds shared by both plans: every array at or after the prefix/key and within `end`.
fn check_arrays(head: usize, arrays: &[(u64, u64)]) -> PyResult<u64> {
    let mut end = head as u64;
    for (k, &(off, n)) in arrays.iter().enumerate() {
        let e = off.checked_add(n).ok_or_else(|| PyValueError::new_err(format!("array {k}: {off}+{n} overflows")))?;
        if off < head as u64 {
            return Err(PyValueError::new_err(format!("array {k} at {off} overlaps the {head}-byte header")));
        }
        end = end.max(e);
    }
    Ok(end)
}

/// A request array: its name, offset from the start of the request region, bytes, shape and dtype.
type RequestArray = (Py<PyString>, u64, u64, Vec<isize>, PyObject);

/// What `send_request` copies for one request layout: the prefix and header bytes, then each array by
/// name to its offset from the start of the request region; and what a request must be to have that
/// layout (the mapping's size, each value's type `ndarray`, its dtype object and its shape).
#[pyclass(module = "lowtail_native", frozen)]
pub struct RequestPlan {
    prefix: Vec<u8>,
    arrays: Vec<RequestArray>,
    end: u64,
    ndarray: PyObject,
    direct: bool, // the arrays' bytes read from their fields (`ndarray::layout_ok`)
}

#[pymethods]
impl RequestPlan {
    /// `arrays`: (name, offset, nbytes, shape, dtype) in header order; `ndarray`: the array type.
    #[new]
    fn new(py: Python<'_>, prefix: Vec<u8>, arrays: Vec<RequestArray>, ndarray: PyObject) -> PyResult<Self> {
        let spans: Vec<(u64, u64)> = arrays.iter().map(|a| (a.1, a.2)).collect();
        let end = check_arrays(prefix.len(), &spans)?;
        check_nbytes(py, arrays.iter().map(|a| (a.2, a.3.clone(), a.4.clone_ref(py))))?;
        let direct = layout_ok(py, ndarray.bind(py));
        Ok(RequestPlan { prefix, arrays, end, ndarray, direct })
    }
    /// The payload's end: the bytes a request of this layout takes in its region.
    #[getter]
    fn end(&self) -> u64 {
        self.end
    }
}

/// The request's arrays in the plan's order when `arrays` has exactly the plan's layout (the same
/// number of entries, each name an `ndarray` of the plan's dtype object and shape, C-contiguous): as
/// `PayloadLayout.matches` decides, plus the contiguity the copy needs. None otherwise.
fn layout_buffers<'py>(py: Python<'py>, plan: &RequestPlan, arrays: &Bound<'py, PyAny>) -> PyResult<Option<Vec<ArrayBytes<'py, RawBuffer>>>> {
    if !matches!(arrays.len(), Ok(n) if n == plan.arrays.len()) {
        return Ok(None);
    }
    // Every value looked up first: a mapping's __getitem__ is Python code, which must not run once
    // an array's bytes are taken (it could resize or free that array).
    let mut objs = Vec::with_capacity(plan.arrays.len());
    for (name, ..) in &plan.arrays {
        let Ok(obj) = arrays.get_item(name.bind(py)) else {
            return Ok(None); // not a mapping with this name
        };
        objs.push(obj);
    }
    let ndarray = plan.ndarray.bind(py);
    let mut bufs = Vec::with_capacity(plan.arrays.len());
    for ((_, _, n, shape, dtype), obj) in plan.arrays.iter().zip(objs) {
        // Not C-contiguous (a strided view) too: the caller's copy handles any strides.
        let Some(b) = exact_array(obj, plan.direct, ndarray, dtype.bind(py), shape, *n, RawBuffer::get) else {
            return Ok(None);
        };
        bufs.push(b);
    }
    Ok(Some(bufs))
}

/// Copy a request of `plan`'s layout from `arrays` into `slot` of `lane` and publish it as ring
/// position `head` (`Segment.publish`). Returns (seq, now), or None when `arrays` is not exactly the
/// plan's layout or an array is not C-contiguous (nothing written: the caller validates and copies).
/// Everything is checked before the first byte is written.
#[pyfunction]
pub fn send_request(
    py: Python<'_>,
    seg: PyRef<'_, Segment>,
    lane: u64,
    slot: u64,
    head: u64,
    plan: PyRef<'_, RequestPlan>,
    arrays: &Bound<'_, PyAny>,
) -> PyResult<Option<(u64, u64)>> {
    send(py, &seg, lane, slot, head, &plan, arrays)
}

/// `send_request` on a borrowed segment and plan.
fn send(py: Python<'_>, seg: &Segment, lane: u64, slot: u64, head: u64, plan: &RequestPlan, arrays: &Bound<'_, PyAny>) -> PyResult<Option<(u64, u64)>> {
    seg.check_lane(lane)?;
    seg.check_slot(slot)?;
    let g = &seg.geo;
    if plan.end > g.req_bytes {
        return Err(PyIndexError::new_err(format!("a {}-byte request in a {}-byte request region", plan.end, g.req_bytes)));
    }
    let Some(bufs) = layout_buffers(py, plan, arrays)? else {
        return Ok(None);
    };
    let region = g.req_base + (lane * g.spl + slot) * g.req_bytes;
    seg.st(g.slot_word(lane * g.spl + slot) + (S_REQ_STATE >> 3), WRITING)?;
    seg.write_bytes(region, &plan.prefix)?;
    for ((_, off, _, _, _), b) in plan.arrays.iter().zip(&bufs) {
        seg.write_bytes(region + off, b.bytes())?;
    }
    drop(bufs);
    seg.publish(lane, slot, plan.end, head).map(Some)
}

/// How `receive_answer` reads an answer whose prefix and header bytes are `key` (what the client parsed last
/// in that slot): each array by name, its offset from the start of the response region and bytes, and
/// the shape and dtype of the fresh array `empty(shape, dtype)` makes (made through numpy's C API
/// instead when `empty` is numpy's and the arrays' fields are read directly). No arrays: an answer in an
/// ndarray segment, whose key alone is checked.
/// An answer array: its name, offset from the start of the response region, bytes, shape and dtype.
type AnswerArray = (Py<PyString>, u64, u64, Py<PyTuple>, PyObject);

#[pyclass(module = "lowtail_native", frozen)]
pub struct AnswerPlan {
    key: Vec<u8>,
    arrays: Vec<AnswerArray>,
    end: u64,
    empty: PyObject,
    ndarray: PyObject, // the type of `empty`'s arrays: what a caller's array to copy into must be
    shapes: Vec<Vec<isize>>, // each array's shape, as a caller's array to copy into must have it
    direct: bool, // a caller's arrays' bytes read from their fields (`ndarray::layout_ok`)
    fresh: bool, // `empty` is numpy's and `direct`: the fresh arrays made by the C API (`fresh_array`)
}

/// Whether `fresh_array` may make a plan's arrays: `empty` is `numpy.empty`, `ndarray` `numpy.ndarray`
/// itself (a subclass's `__array_finalize__` is Python code) and every dtype a `numpy.dtype` (what the C
/// API takes as a descriptor; an object that only looks like one is given to `empty`, which refuses it).
fn numpy_fresh(py: Python<'_>, arrays: &[AnswerArray], empty: &Bound<'_, PyAny>, ndarray: &Bound<'_, PyAny>) -> PyResult<bool> {
    let np = py.import("numpy")?;
    let dtype = np.getattr("dtype")?;
    Ok(np.getattr("empty")?.is(empty)
        && np.getattr("ndarray")?.is(ndarray)
        && arrays.iter().map(|a| a.4.bind(py).is_instance(&dtype)).collect::<PyResult<Vec<bool>>>()?.into_iter().all(|ok| ok))
}

#[pymethods]
impl AnswerPlan {
    #[new]
    #[pyo3(signature = (key, arrays, empty, ndarray=None))]
    fn new(py: Python<'_>, key: Vec<u8>, arrays: Vec<AnswerArray>, empty: PyObject, ndarray: Option<PyObject>) -> PyResult<Self> {
        if key.len() < 8 {
            return Err(PyValueError::new_err(format!("a {}-byte key, expected the 8-byte prefix and a header", key.len())));
        }
        let spans: Vec<(u64, u64)> = arrays.iter().map(|a| (a.1, a.2)).collect();
        let end = check_arrays(key.len(), &spans)?;
        let ndarray = ndarray.unwrap_or_else(|| py.None()); // None: no array is of its type, none taken
        let shapes: Vec<Vec<isize>> = arrays.iter().map(|a| a.3.bind(py).extract::<Vec<isize>>()).collect::<PyResult<_>>()?;
        check_nbytes(py, arrays.iter().zip(&shapes).map(|(a, s)| (a.2, s.clone(), a.4.clone_ref(py))))?;
        let direct = !ndarray.is_none(py) && layout_ok(py, ndarray.bind(py));
        let fresh = direct && numpy_fresh(py, &arrays, empty.bind(py), ndarray.bind(py)).unwrap_or(false);
        Ok(AnswerPlan { key, arrays, end, empty, ndarray, shapes, direct, fresh })
    }
}

/// The answer in `slot` of `lane`, once its resp_seq is `seq`. With a spin budget (`spin_ns` > 0) it
/// spins for it first, the GIL released: the whole budget when the answer is due by then (`due_ns`, the
/// predicted answer time, at most now + `spin_ns`), else `short_ns`. With a park budget (`park_ns` > 0)
/// an answer not there by then is waited for parked (`Segment.park`: one futex wait of at most
/// `park_ns`), so a parked client's wait and its answer's read are one call. Returns (answered, now,
/// status, claim_ns, done_ns, engine_ns, call, out, parked_at, slept): `now` when the answer was seen
/// or the wait ended; `out`: with `plan` and an ST_OK answer whose prefix and header are the plan's
/// key, a dict of fresh arrays copied out of the response region when `copy` and the plan has arrays,
/// else True (the caller's cached layout holds); None when the header differs (the caller parses it),
/// for an error status, or without a plan; `parked_at`: when the park began (0: none); `slept`: the
/// park made its futex wait (else the re-check after setting the parked flag found the answer).
/// `copy` may also be the caller's mapping of preallocated arrays (a copy into them, not into fresh
/// ones): `out` is then that mapping once every answer array was copied into the array of its name,
/// an `ndarray` of its dtype object and shape, C-contiguous and writable, no two overlapping (all
/// checked before the first byte is written); True when one is not (the caller copies, or says why it
/// cannot).
#[pyfunction]
#[pyo3(signature = (seg, lane, slot, seq, plan, copy, spin_ns=0, short_ns=0, due_ns=0, park_ns=0))]
#[allow(clippy::too_many_arguments, clippy::type_complexity)]
pub fn receive_answer(
    py: Python<'_>,
    seg: PyRef<'_, Segment>,
    lane: u64,
    slot: u64,
    seq: u64,
    plan: Option<PyRef<'_, AnswerPlan>>,
    copy: &Bound<'_, PyAny>,
    spin_ns: u64,
    short_ns: u64,
    due_ns: u64,
    park_ns: u64,
) -> PyResult<Received> {
    receive(py, &seg, lane, slot, seq, plan.as_deref(), copy, (spin_ns, short_ns, due_ns, park_ns))
}

/// `receive_answer`'s result: (answered, now, status, claim_ns, done_ns, engine_ns, call, out,
/// parked_at, slept).
type Received = (bool, u64, u64, u64, u64, u64, u64, PyObject, u64, bool);

/// `receive_answer` on a borrowed segment; `wait` is (spin_ns, short_ns, due_ns, park_ns).
#[allow(clippy::too_many_arguments)]
fn receive(
    py: Python<'_>,
    seg: &Segment,
    lane: u64,
    slot: u64,
    seq: u64,
    plan: Option<&AnswerPlan>,
    copy: &Bound<'_, PyAny>,
    wait: (u64, u64, u64, u64),
) -> PyResult<Received> {
    let (answered, now, parked_at, slept) = await_answer(py, seg, lane, slot, seq, wait)?;
    if !answered {
        return Ok((false, now, 0, 0, 0, 0, 0, py.None(), parked_at, slept));
    }
    let (status, claim, done, engine, call, out) = read_found(py, seg, lane, slot, plan, copy, None)?;
    Ok((true, now, status, claim, done, engine, call, out, parked_at, slept))
}

/// The wait for the answer to `seq` in `slot` of `lane`: a spin within `spin_ns` (`short_ns` while
/// the answer is due later than that), then a park of `park_ns` (0: none). Returns (answered, now,
/// parked_at, slept): when the wait ended, when it parked (0: it did not), whether it made a futex wait.
fn await_answer(
    py: Python<'_>,
    seg: &Segment,
    lane: u64,
    slot: u64,
    seq: u64,
    (spin_ns, short_ns, due_ns, park_ns): (u64, u64, u64, u64),
) -> PyResult<(bool, u64, u64, bool)> {
    let (mut answered, mut now) = if spin_ns != 0 {
        let now = now_ns();
        let budget = if due_ns <= now.saturating_add(spin_ns) { spin_ns } else { short_ns.min(spin_ns) };
        seg.spin(py, lane, slot, seq, now.saturating_add(budget))?
    } else {
        seg.check_lane(lane)?;
        seg.check_slot(slot)?;
        (seg.ld(seg.geo.slot_word(lane * seg.geo.spl + slot) + (S_RESP_SEQ >> 3))? == seq, now_ns())
    };
    let (mut parked_at, mut slept) = (0, false);
    if !answered && park_ns != 0 {
        parked_at = now;
        (answered, slept) = seg.park(py, lane, slot, seq, park_ns)?;
        now = now_ns();
    }
    Ok((answered, now, parked_at, slept))
}

/// An answer found in `slot` of `lane`: its words (status, claim_ns, done_ns, engine_ns, call) and,
/// for an ST_OK answer of `plan`'s header, its arrays (fresh, or copied into `copy`); else None.
fn read_found<'py>(
    py: Python<'py>,
    seg: &Segment,
    lane: u64,
    slot: u64,
    plan: Option<&AnswerPlan>,
    copy: &Bound<'_, PyAny>,
    made: Option<Made<'py>>,
) -> PyResult<(u64, u64, u64, u64, u64, PyObject)> {
    let (status, _, claim, done, engine, call) = seg.answer_words(lane, slot)?;
    let mut out = py.None();
    if let (Some(plan), ST_OK) = (plan, status) {
        let g = lane * seg.geo.spl + slot;
        out = match copy.downcast::<PyBool>() {
            Ok(copy) => read_answer(py, seg, g, plan, copy.is_true(), made)?,
            Err(_) => read_answer_into(py, seg, g, plan, copy)?,
        };
    }
    Ok((status, claim, done, engine, call, out))
}

/// The client's prediction (`lowtail.shm.client._Prediction`) as `round_trip` learns from it: the
/// learned submit-to-answer time, the late bits and the spin budget that makes an answer late.
struct Learned {
    predicted: i128,
    late: u64,
    spin: i128,
}

/// `pred`'s late bits and spin budget, with the prediction the call was given (`predicted_ns`). Read
/// once the request is published, while the worker serves it (not before the publication: its
/// attribute reads cost about 400 instructions); an error here means the answer goes to `wait`.
fn learned(pred: &Bound<'_, PyAny>, predicted: i128) -> PyResult<Learned> {
    let py = pred.py();
    let late = pred.getattr(intern!(py, "late"))?.extract::<u64>()?;
    let spin = i128::from(pred.getattr(intern!(py, "spin_ns"))?.extract::<u64>()?);
    Ok(Learned { predicted, late, spin })
}

/// The late bits' window and the prediction's rise after a longer answer: `lowtail.shm.client`'s
/// `LATE_WINDOW` and `PREDICT_UP_SHIFT` (exported, and held equal by a test).
pub const LATE_WINDOW: u64 = 0xFF;
pub const PREDICT_UP_SHIFT: u32 = 2;

/// What `pred` learns from an answer that took `latency` ns, as `QueueClient.wait` learns it
/// (`next_prediction_ns`): the late bits shifted in, the prediction dropped at once or risen by a
/// quarter of the gap. Python ints both ways: the i128 arithmetic is exact for every difference of
/// two u64 stamps and every prediction learned from them.
fn learn(pred: &Bound<'_, PyAny>, was: &Learned, latency: i128) -> PyResult<()> {
    let py = pred.py();
    let late = ((was.late << 1) | u64::from(latency > was.predicted + was.spin)) & LATE_WINDOW;
    let p = was.predicted;
    let next = if latency < p || p == 0 { latency } else { p + ((latency - p) >> PREDICT_UP_SHIFT) };
    pred.setattr(intern!(py, "late"), late)?;
    match i64::try_from(next) {
        Ok(n) => pred.setattr(intern!(py, "predicted_ns"), n),
        Err(_) => pred.setattr(intern!(py, "predicted_ns"), next),
    }
}

/// A whole round trip in one call, `QueueClient.infer`'s common case: `send_request` (a request of
/// `plan`'s layout into `slot` of `lane`, published as ring position `head`), then `receive_answer` for
/// it with `answer`'s plan and fresh copies, where `due_ns` is the publication's stamp plus
/// `predicted_ns` (`pred`'s, the client's `_Prediction`). Returns None when `arrays` is not the plan's
/// layout (nothing written), else (seq, submit_ns, answered, now, claim_ns, done_ns, out, parked_at,
/// slept) as `receive_answer` gives them (an answer's status, engine time and call word are left to
/// `wait`: `out` is a dict only for an ST_OK answer of the plan's header). With a dict, the call has
/// also done what `wait` does after it: `pred` learned the answer's latency, and the slot's request
/// state is FREE (the caller puts the slot back on its free list). Once the request is published it
/// is never lost to an error here, and the caller's `wait` reads it again, with a ticket, and raises
/// it: an error in the wait comes back unanswered (no stamps); a failed read of an answer the wait
/// found (or a failure to learn from it: `wait` learns it then) comes back answered with `out` None
/// and no stamps, so the caller counts the answer where it was found (spinning, parked), not
/// where `wait` reads it again (at once).
#[pyfunction]
#[pyo3(signature = (seg, lane, slot, head, plan, arrays, answer, spin_ns, short_ns, predicted_ns, park_ns, pred))]
#[allow(clippy::too_many_arguments, clippy::type_complexity)]
pub fn round_trip(
    py: Python<'_>,
    seg: PyRef<'_, Segment>,
    lane: u64,
    slot: u64,
    head: u64,
    plan: PyRef<'_, RequestPlan>,
    arrays: &Bound<'_, PyAny>,
    answer: Option<PyRef<'_, AnswerPlan>>,
    spin_ns: u64,
    short_ns: u64,
    predicted_ns: &Bound<'_, PyAny>,
    park_ns: u64,
    pred: &Bound<'_, PyAny>,
) -> PyResult<Option<(u64, u64, bool, u64, u64, u64, PyObject, u64, bool)>> {
    // A prediction learned from a garbage stamp may be negative or past 2^64 (the difference of two
    // u64 stamps): a due time all the same. An i64 first, the common case's cheap conversion; read
    // before anything is published, so a bad one fails the call with nothing sent.
    let predicted = match predicted_ns.extract::<i64>() {
        Ok(p) => i128::from(p),
        Err(_) => predicted_ns.extract::<i128>()?,
    };
    let Some((seq, submitted)) = send(py, &seg, lane, slot, head, &plan, arrays)? else {
        return Ok(None);
    };
    let was = learned(pred, predicted);
    let made = answer.as_deref().and_then(|plan| premade(py, plan));
    let copy = PyBool::new(py, true);
    let due = (submitted as i128).saturating_add(predicted).clamp(0, u64::MAX as i128) as u64;
    let wait = (spin_ns, short_ns, due, park_ns);
    let Ok((answered, now, parked_at, slept)) = await_answer(py, &seg, lane, slot, seq, wait) else {
        return Ok(Some((seq, submitted, false, now_ns(), 0, 0, py.None(), 0, false))); // read again by `wait`
    };
    if !answered {
        return Ok(Some((seq, submitted, false, now, 0, 0, py.None(), parked_at, slept)));
    }
    let unread = (seq, submitted, true, now, 0, 0, py.None(), parked_at, slept); // read again by `wait`
    let Ok((_, claim, done, _, _, out)) = read_found(py, &seg, lane, slot, answer.as_deref(), copy.as_any(), made) else {
        return Ok(Some(unread));
    };
    if out.bind(py).is_exact_instance_of::<PyDict>() {
        // The answer is taken: its slot freed as `wait` frees one whose answer it returns (the slot's
        // index checked by `send`, its word by `st`), then its latency learned.
        let freed = seg.st(seg.geo.slot_word(lane * seg.geo.spl + slot) + (S_REQ_STATE >> 3), FREE);
        if freed.is_err() || was.and_then(|was| learn(pred, &was, done as i128 - submitted as i128)).is_err() {
            return Ok(Some(unread));
        }
    }
    Ok(Some((seq, submitted, true, now, claim, done, out, parked_at, slept)))
}

/// The answer of slot `g` by `plan` copied into the caller's arrays `into` (see `receive_answer`): None
/// when its header is not the plan's key, True when `into` does not have the plan's arrays exactly.
fn read_answer_into(py: Python<'_>, seg: &Segment, g: u64, plan: &AnswerPlan, into: &Bound<'_, PyAny>) -> PyResult<PyObject> {
    let Some(region) = answer_region(seg, g, plan)? else {
        return Ok(py.None());
    };
    let cached = || Ok(true.into_pyobject(py)?.to_owned().into_any().unbind());
    if plan.arrays.is_empty() || !matches!(into.len(), Ok(n) if n == plan.arrays.len()) {
        return cached();
    }
    // Every value looked up before any bytes are taken, as in `layout_buffers`.
    let mut objs = Vec::with_capacity(plan.arrays.len());
    for (name, ..) in &plan.arrays {
        let Ok(obj) = into.get_item(name.bind(py)) else {
            return cached();
        };
        objs.push(obj);
    }
    let mut dsts = Vec::with_capacity(plan.arrays.len());
    for (((_, _, n, _, dtype), shape), obj) in plan.arrays.iter().zip(&plan.shapes).zip(objs) {
        // Not C-contiguous too: the caller's copy handles any strides.
        let Some(b) = exact_array(obj, plan.direct, plan.ndarray.bind(py), dtype.bind(py), shape, *n, RawBuffer::get) else {
            return cached();
        };
        if !b.writeable() {
            return cached();
        }
        dsts.push(b);
    }
    // Two names over one buffer would take each other's bytes: the Python copy refuses that by name
    let spans: Vec<(usize, usize)> = dsts.iter().map(|b| (b.bytes().as_ptr() as usize, b.bytes().len())).collect();
    for (i, &(a, n)) in spans.iter().enumerate() {
        if spans[..i].iter().any(|&(b, m)| a < b + m && b < a + n) {
            return cached();
        }
    }
    for ((_, off, n, _, _), mut dst) in plan.arrays.iter().zip(dsts) {
        copy_from_region(seg, region + off, *n, dst.bytes_mut()?)?;
    }
    Ok(into.clone().unbind())
}

/// The byte offset of slot `g`'s response region when its prefix and header are `plan`'s key, bounded
/// by the queue's slots; None otherwise (a layout its slots cannot hold, or another header).
fn answer_region(seg: &Segment, g: u64, plan: &AnswerPlan) -> PyResult<Option<u64>> {
    let geo = &seg.geo;
    let klen = plan.key.len() as u64;
    if klen > geo.resp_bytes || plan.end > geo.resp_bytes {
        return Ok(None); // a layout this queue's slots cannot hold: the Python parse says why
    }
    let region = geo.resp_base + g * geo.resp_bytes;
    Ok(region_is(seg, region, &plan.key)?.then_some(region))
}

/// Whether the mapping's bytes at `off` are `want`: copied out in chunks to the stack and compared (the
/// key of every answer read, on the wait's critical path: no allocation), bounded by the segment.
fn region_is(seg: &Segment, off: u64, want: &[u8]) -> PyResult<bool> {
    let mut buf = [0u8; 256];
    for (k, chunk) in want.chunks(buf.len()).enumerate() {
        let got = &mut buf[..chunk.len()];
        copy_from_region(seg, off + (k * 256) as u64, chunk.len() as u64, got)?;
        if got != chunk {
            return Ok(false);
        }
    }
    Ok(true)
}

/// `n` bytes of the mapping at `src` into `d` (`d.len() == n`; `src + n` within the segment, checked).
fn copy_from_region(seg: &Segment, src: u64, n: u64, d: &mut [u8]) -> PyResult<()> {
    if d.len() as u64 != n || src.checked_add(n).is_none_or(|e| e > seg.words * 8) || seg.buf.is_none() {
        return Err(PyIndexError::new_err(format!("bytes {src}+{n} outside the {}-byte segment", seg.words * 8)));
    }
    unsafe { std::ptr::copy_nonoverlapping(seg.base.add(src as usize), d.as_mut_ptr(), n as usize) };
    Ok(())
}

/// The outputs' dict and its fresh arrays in the plan's order, made before the answer is there.
type Made<'py> = (Bound<'py, PyDict>, Vec<Bound<'py, PyAny>>);

/// `round_trip`'s outputs made while the worker serves the request (each fresh array and its dict
/// entry moved off the wait's critical path), for an answer of `plan`'s layout, the one
/// the slot's last answer had; filled once the answer is there and of that layout, else dropped. None
/// when the plan's arrays are not made by the C API (`empty` is then called after the answer, as
/// before), or making one failed (the same, and its error is met there).
fn premade<'py>(py: Python<'py>, plan: &AnswerPlan) -> Option<Made<'py>> {
    if !plan.fresh || plan.arrays.is_empty() {
        return None;
    }
    let out = PyDict::new(py);
    let mut arrays = Vec::with_capacity(plan.arrays.len());
    for ((name, _, _, _, dtype), dims) in plan.arrays.iter().zip(&plan.shapes) {
        let arr = fresh_array(py, plan.ndarray.bind(py), dtype.bind(py), dims)?.ok()?;
        out.set_item(name.bind(py), &arr).ok()?;
        arrays.push(arr);
    }
    Some((out, arrays))
}

/// The answer of slot `g` by `plan` (see `receive_answer`): None when its header is not the plan's key.
/// `made`: its outputs made already (`premade`), filled here.
fn read_answer(py: Python<'_>, seg: &Segment, g: u64, plan: &AnswerPlan, copy: bool, made: Option<Made<'_>>) -> PyResult<PyObject> {
    let Some(region) = answer_region(seg, g, plan)? else {
        return Ok(py.None());
    };
    if !copy || plan.arrays.is_empty() {
        return Ok(true.into_pyobject(py)?.to_owned().into_any().unbind());
    }
    // The outputs made while the worker served (`premade`), or made now: `fresh_array`'s, or `empty`'s
    let (out, arrays) = match made {
        Some(made) => made,
        None => {
            let out = PyDict::new(py);
            let mut arrays = Vec::with_capacity(plan.arrays.len());
            for ((name, _, _, shape, dtype), dims) in plan.arrays.iter().zip(&plan.shapes) {
                let arr = match plan.fresh.then(|| fresh_array(py, plan.ndarray.bind(py), dtype.bind(py), dims)).flatten() {
                    Some(made) => made?,
                    None => plan.empty.bind(py).call1((shape.clone_ref(py), dtype.clone_ref(py)))?,
                };
                out.set_item(name.bind(py), &arr)?;
                arrays.push(arr);
            }
            (out, arrays)
        }
    };
    // Each filled with no Python code run between its bytes taken and the copy: a fresh array of the
    // plan's dtype and shape read from its fields; anything else `empty` made through its export, its
    // length checked.
    for (((name, off, n, _, dtype), dims), arr) in plan.arrays.iter().zip(&plan.shapes).zip(arrays) {
        let mut dst = match exact_array(arr.clone(), plan.direct, plan.ndarray.bind(py), dtype.bind(py), dims, *n, RawBuffer::get) {
            Some(b) if b.writeable() => b,
            _ => ArrayBytes::Export(RawBuffer::get(&arr)?),
        };
        let d = dst.bytes_mut()?;
        if d.len() as u64 != *n {
            let name = name.bind(py);
            return Err(PyValueError::new_err(format!("array {name}: a fresh array of {} bytes, its layout has {n}", d.len())));
        }
        copy_from_region(seg, region + off, *n, d)?; // off + n <= end <= resp_bytes: within the region
    }
    Ok(out.into_any().unbind())
}
