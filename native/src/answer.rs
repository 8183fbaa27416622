//! The worker's answer of a batch whose outputs have a layout it has answered before, in one call: the
//! check that the outputs are exactly that layout (what `validated_layout` finds by building a key of
//! names, dtypes and shapes and looking it up, about 3 us in the worker right after a model call) and
//! `answer_rows`'s copies, words and wakes, each request's rows by the plan of its size.
//!
//! The layout and the plans come from the Python side, which validated the outputs that made them; this
//! side only recognises outputs that are the same in every respect the answers' headers describe (each
//! name in order, the exact `ndarray` type, the same dtype object, the same shape). Anything else, or a
//! request of a size it has no plan for, returns None having written nothing, and the caller validates
//! and answers as before. Every copy is bounded by its source and the response region, as `answer_rows`
//! bounds them.

use pyo3::intern;
use pyo3::types::{PyDict, PyList, PyString, PyTuple};

use super::*;
use crate::ndarray::{exact_array, layout_ok, nbytes_of, ArrayBytes};

/// An output array the worker validated: its name, dtype object and shape (the batch's rows first).
type KnownArray = (Py<PyString>, PyObject, Vec<isize>);

/// An answer plan as the Python side makes it: the prefix and header bytes, each array's offset from
/// the start of the response region, its bytes per row, the payload's end.
type OwnedPlan = (Vec<u8>, Vec<u64>, Vec<u64>, u64);

/// An output layout the worker validated (its arrays in order, and the array type), and the answer
/// plan of each request size it answered it in: a batch of any composition of those sizes is answered
/// by `answer_known`.
#[pyclass(module = "lowtail_native", frozen)]
pub struct KnownOutputs {
    arrays: Vec<KnownArray>,
    nbytes: Vec<u64>, // each array's bytes (`ndarray::nbytes_of`)
    ndarray: PyObject,
    direct: bool, // its arrays' bytes read from their fields (`ndarray::layout_ok`)
    plans: Vec<(u64, OwnedPlan)>,
}

#[pymethods]
impl KnownOutputs {
    /// `arrays`: (name, dtype object, shape) of the validated outputs in their order; `ndarray`: the
    /// array type; `plans`: (request rows, plan) per request size, one offset and row size per array.
    #[new]
    fn new(py: Python<'_>, arrays: Vec<KnownArray>, ndarray: PyObject, plans: Vec<(u64, OwnedPlan)>) -> PyResult<Self> {
        let k = arrays.len();
        let rows = arrays.first().and_then(|a| a.2.first().copied()).unwrap_or(0);
        if rows < 1 || arrays.iter().any(|a| a.2.first() != Some(&rows)) {
            let shapes: Vec<&Vec<isize>> = arrays.iter().map(|a| &a.2).collect();
            return Err(PyValueError::new_err(format!("shapes {shapes:?}: expected at least one array, one leading dimension of at least 1 row")));
        }
        if plans.is_empty() {
            return Err(PyValueError::new_err("no plan: expected one per request size"));
        }
        for (i, (n, (_, offs, row_bytes, _))) in plans.iter().enumerate() {
            if offs.len() != k || row_bytes.len() != k {
                return Err(PyValueError::new_err(format!(
                    "{k} arrays, {} offsets and {} row sizes: expected one offset and one row size per array",
                    offs.len(),
                    row_bytes.len()
                )));
            }
            if *n < 1 || *n > rows as u64 || plans[..i].iter().any(|p| p.0 == *n) {
                return Err(PyValueError::new_err(format!("a plan for {n} rows: expected distinct sizes of 1 to {rows} rows")));
            }
        }
        let nbytes = arrays.iter().map(|(_, dtype, shape)| nbytes_of(py, dtype.bind(py), shape)).collect::<PyResult<_>>()?;
        let direct = layout_ok(py, ndarray.bind(py));
        Ok(KnownOutputs { arrays, nbytes, ndarray, direct, plans })
    }
}

/// The outputs' bytes in the layout's order when `outputs` is exactly `known`'s layout (a `dict` of
/// its names in its order, each an `ndarray` of its dtype object and shape); None otherwise.
fn known_sources<'py>(py: Python<'py>, known: &KnownOutputs, outputs: &Bound<'py, PyAny>) -> PyResult<Option<Vec<ArrayBytes<'py, SrcBytes>>>> {
    let Ok(dict) = outputs.downcast_exact::<PyDict>() else {
        return Ok(None);
    };
    if dict.len() != known.arrays.len() {
        return Ok(None);
    }
    // The names first, on a snapshot of the entries: a key's __eq__ is Python code, which must not run
    // once an array's bytes are taken (it could resize or free that array, or change the dict).
    let entries: Vec<(Bound<'py, PyAny>, Bound<'py, PyAny>)> = dict.iter().collect();
    for ((key, _), (name, ..)) in entries.iter().zip(&known.arrays) {
        let name = name.bind(py);
        if !(key.is(name) || key.eq(name)?) {
            return Ok(None);
        }
    }
    let ndarray = known.ndarray.bind(py);
    let mut srcs = Vec::with_capacity(known.arrays.len());
    for ((_, value), ((_, dtype, shape), &n)) in entries.into_iter().zip(known.arrays.iter().zip(&known.nbytes)) {
        let Some(src) = exact_array(value, known.direct, ndarray, dtype.bind(py), shape, n, SrcBytes::get) else {
            return Ok(None);
        };
        srcs.push(src);
    }
    Ok(Some(srcs))
}

/// What `answer_sources` does for the requests of `items` not done yet: (lane, slot, seq, gen, first
/// row, rows, plan) each, and its index in `items`; None when the rows are not `known`'s or a request's
/// size has no plan. Each request's lane and slot come from `g`, its slot's index in the queue.
#[allow(clippy::type_complexity)]
fn known_work<'py>(
    py: Python<'py>,
    spl: u64,
    known: &KnownOutputs,
    items: &Bound<'py, PyList>,
    rows: &Bound<'py, PyList>,
    gs: &mut Vec<Bound<'py, PyAny>>,
) -> PyResult<Option<(Vec<(u64, u64, u64, u64, u64, u64, usize)>, Vec<usize>)>> {
    if items.len() != rows.len() {
        return Err(PyValueError::new_err(format!("{} requests and {} row counts: expected one each", items.len(), rows.len())));
    }
    let (mut work, mut index) = (Vec::with_capacity(rows.len()), Vec::with_capacity(rows.len()));
    let mut row0 = 0u64;
    for (i, (it, n)) in items.iter().zip(rows.iter()).enumerate() {
        let n: u64 = n.extract()?;
        if !it.getattr(intern!(py, "done"))?.is_truthy()? {
            let Some(plan) = known.plans.iter().position(|p| p.0 == n) else {
                return Ok(None);
            };
            let word = |name: &Bound<'_, PyString>| -> PyResult<u64> { it.getattr(name)?.extract::<u64>() };
            let g_obj = it.getattr(intern!(py, "g"))?;
            let g: u64 = g_obj.extract()?;
            work.push((g / spl, g % spl, word(intern!(py, "seq"))?, word(intern!(py, "gen"))?, row0, n, plan));
            index.push(i);
            gs.push(g_obj);
        }
        row0 = row0.checked_add(n).ok_or_else(|| PyValueError::new_err("the rows overflow"))?;
    }
    // The batch's rows are the outputs' leading dimension: known's shapes have exactly that many.
    Ok((row0 == known.arrays[0].2[0] as u64).then_some((work, index)))
}

impl PlanView for (u64, OwnedPlan) {
    fn view(&self) -> AnswerRowsPlan<'_> {
        let (_, (prefix, offs, row_bytes, end)) = self;
        (prefix, offs, row_bytes, *end)
    }
}

impl<B: crate::Exported> SourceView for ArrayBytes<'_, B> {
    fn src(&self) -> &[u8] {
        self.bytes()
    }
}

/// Answer the requests of a batch (`items`, the worker's claimed requests: `g` (the slot's index in
/// the queue), `seq`, `gen`, `done`; `rows`: each one's rows in the outputs, in order) with `outputs`
/// when they are exactly `known`'s layout and `known` has a plan for each size not done: `answer_rows`
/// with those plans, each answered request's `done` set True after the last copy, before this returns
/// (no Python code runs between its answer and its mark). A request already
/// done is skipped (its rows still counted). Returns (ns in the wakes' system calls, lanes woken), or
/// None when the outputs are not that layout or a size has no plan (nothing written).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn answer_known(
    py: Python<'_>,
    seg: PyRef<'_, Segment>,
    known: PyRef<'_, KnownOutputs>,
    outputs: &Bound<'_, PyAny>,
    items: &Bound<'_, PyList>,
    rows: &Bound<'_, PyList>,
    engine_ns: u64,
    call: u64,
) -> PyResult<Option<(u64, u64)>> {
    answer_known_in(py, &seg, &known, outputs, items, rows, engine_ns, call, &mut Vec::new())
}

/// `answer_known`'s work; `gs` gets the `g` of each request it read (those not done), in order.
#[allow(clippy::too_many_arguments)]
fn answer_known_in<'py>(
    py: Python<'py>,
    seg: &Segment,
    known: &KnownOutputs,
    outputs: &Bound<'py, PyAny>,
    items: &Bound<'py, PyList>,
    rows: &Bound<'py, PyList>,
    engine_ns: u64,
    call: u64,
    gs: &mut Vec<Bound<'py, PyAny>>,
) -> PyResult<Option<(u64, u64)>> {
    let Some((work, index)) = known_work(py, seg.geo.spl, known, items, rows, gs)? else {
        return Ok(None);
    };
    let Some(srcs) = known_sources(py, known, outputs)? else {
        return Ok(None);
    };
    // No Python code runs while the sources' bytes are read (they may be read from the arrays' own
    // fields): the requests answered are marked done after the last copy, still before this returns.
    // The plans and sources are read in place; answer_sources publishes `work` in its order and stops
    // at an error, so the requests answered are the first `answered` of it.
    let mut answered = 0;
    let result = seg.answer_sources(&work, &known.plans, &srcs, engine_ns, call, &mut |i| answered = i + 1);
    drop(srcs);
    let done = intern!(py, "done");
    let mut marked = Ok(()); // every answered request marked, whatever one mark raised (the first kept)
    for &i in &index[..answered] {
        if let Err(e) = items.get_item(i).and_then(|it| it.setattr(done, true)) {
            marked = marked.and(Err(e));
        }
    }
    let (_, ns, woken) = result?; // the answer's own error first
    marked?;
    Ok(Some((ns, woken)))
}

/// `complete_known` as `Batch.complete` calls it, with the call's figures as the caller gave them: an
/// `engine_ns` that is not a u64 or a `deschedule_ns` that is not an i64 (out of range, or not an int)
/// comes back None with nothing done, so `complete()`'s validating path meets it as it meets any
/// figure (it fails the batch naming the error, or clamps the deschedule), rather than raising here
/// with the batch left open and its requests unanswered. (The recorder passes figures of its own.)
#[pyfunction(name = "complete_known")]
pub fn complete_known_py(
    py: Python<'_>,
    batch: &Bound<'_, PyAny>,
    outputs: &Bound<'_, PyAny>,
    engine_ns: &Bound<'_, PyAny>,
    deschedule_ns: &Bound<'_, PyAny>,
) -> PyResult<Option<(u64, u64)>> {
    let (Ok(engine_ns), Ok(deschedule_ns)) = (engine_ns.extract::<u64>(), deschedule_ns.extract::<i64>()) else {
        return Ok(None);
    };
    complete_known(py, batch, outputs, engine_ns, deschedule_ns)
}

/// `Batch.complete(outputs, engine_ns=, deschedule_ns=)` of a batch whose outputs are a layout its
/// worker answered before, in one call: `Batch.complete`'s first step and the native recorder's
/// `finish_call`'s answer, with no Python frame between the model's call and the answers (7,247 fewer
/// instructions per call in the serving loop when it was written). It reads the batch's `_open`,
/// `_items` and `sizes`, and its worker's `_closed` and `_answer_with` (its `_native`, `_known` and
/// `_outstanding`, one tuple bound at attach: two attribute reads fewer per call); it closes the batch
/// as the batch's `_close` does (`_open` False, `_inputs` an empty dict, without its Python frame) and,
/// when the answer raised, calls `_close` and `_fail_unanswered`. Returns (wake ns, lanes
/// woken), or None with nothing written where `complete`'s validating path must run instead: a batch
/// closed or of a closed worker (`complete` refuses it), a stand-in without `_open`, a request not
/// decoded, no known layout of its rows, or outputs not exactly that layout.
pub fn complete_known(
    py: Python<'_>,
    batch: &Bound<'_, PyAny>,
    outputs: &Bound<'_, PyAny>,
    engine_ns: u64,
    deschedule_ns: i64,
) -> PyResult<Option<(u64, u64)>> {
    let Ok(open) = batch.getattr(intern!(py, "_open")) else {
        return Ok(None);
    };
    let worker = batch.getattr(intern!(py, "_worker"))?;
    if !open.is_truthy()? || worker.getattr(intern!(py, "_closed"))?.is_truthy()? {
        return Ok(None);
    }
    let (items, sizes) = (batch.getattr(intern!(py, "_items"))?, batch.getattr(intern!(py, "sizes"))?);
    let (items, sizes) = (items.downcast::<PyList>()?, sizes.downcast::<PyList>()?);
    if sizes.len() != items.len() {
        return Ok(None); // a request not decoded (no rows): validated by complete
    }
    let mut total = 0u64;
    for n in sizes.iter() {
        total = total.checked_add(n.extract()?).ok_or_else(|| PyValueError::new_err("the rows overflow"))?;
    }
    let with = worker.getattr(intern!(py, "_answer_with"))?;
    let with = with.downcast::<PyTuple>()?;
    if with.len() != 3 {
        return Err(PyValueError::new_err(format!("an _answer_with of {} parts: expected 3", with.len())));
    }
    let Some(known) = with.get_item(1)?.downcast::<PyDict>()?.get_item(total)? else {
        return Ok(None);
    };
    let seg = with.get_item(0)?;
    let (Ok(known), Ok(seg)) = (known.downcast::<KnownOutputs>(), seg.downcast::<Segment>()) else {
        return Ok(None); // another build's objects: complete answers with that build
    };
    // The call word of every answer, as complete() makes it: the rows, and the deschedule in us.
    let d_us = if deschedule_ns > 0 { (deschedule_ns as u64 / 1000).min(CALL_BATCH_MASK) } else { 0 };
    let call = (total & CALL_BATCH_MASK) | (d_us << CALL_DESCHEDULE_SHIFT);
    // The segment borrowed for the answer alone: the Python called after it may use the segment.
    let mut gs = Vec::with_capacity(items.len());
    let got = answer_known_in(py, &*seg.try_borrow()?, known.get(), outputs, items, sizes, engine_ns, call, &mut gs);
    match got {
        Ok(None) => Ok(None),
        Ok(Some(woken)) => {
            let out = with.get_item(2)?;
            let out = out.downcast::<PyDict>()?;
            if gs.len() == items.len() {
                // every request was read for its answer, its `g` with it (the common batch)
                for g in gs {
                    if out.contains(&g)? {
                        out.del_item(g)?;
                    }
                }
            } else {
                for it in items.iter() {
                    let g = it.getattr(intern!(py, "g"))?;
                    if out.contains(&g)? {
                        out.del_item(g)?;
                    }
                }
            }
            // `Batch._close`: the merged copy dropped, the slot views stay cached in the worker
            batch.setattr(intern!(py, "_open"), false)?;
            batch.setattr(intern!(py, "_inputs"), PyDict::new(py))?;
            Ok(Some(woken))
        }
        Err(e) => {
            let failed = batch
                .call_method0(intern!(py, "_close"))
                .and_then(|_| batch.call_method1(intern!(py, "_fail_unanswered"), (e.value(py),)));
            if let Err(later) = failed {
                // Its __context__, as Python sets it on an error raised while handling another.
                later.value(py).setattr(intern!(py, "__context__"), e.value(py))?;
                return Err(later);
            }
            Err(e)
        }
    }
}
