//! The worker's answer of a one-request batch whose outputs have a layout it has answered before, in one
//! call: the check that the outputs are exactly that layout (what `validated_layout` finds by building a
//! key of names, dtypes and shapes and looking it up, about 3 us in the worker right after a model call)
//! and `answer_rows`'s copy, words and wake.
//!
//! The layout and the plan come from the Python side, which validated the outputs that made them; this
//! side only recognises outputs that are the same in every respect the answer's header describes (each
//! name in order, the exact `ndarray` type, the same dtype object, the same shape). Anything else
//! returns None having written nothing, and the caller validates and answers as before. Every copy is
//! bounded by its source and the response region, as `answer_rows` bounds them.

use pyo3::intern;
use pyo3::types::{PyDict, PyString};

use super::*;

/// An output array the worker validated: its name, dtype object and shape.
type KnownArray = (Py<PyString>, PyObject, Vec<isize>);

/// An output layout the worker validated (its arrays in order, and the array type), and its answer
/// plan for one request of all its rows: the prefix and header bytes, each array's offset from the
/// start of the response region, its bytes per row, the payload's end.
#[pyclass(module = "lowtail_native", frozen)]
pub struct KnownOutputs {
    arrays: Vec<KnownArray>,
    ndarray: PyObject,
    plan: (Vec<u8>, Vec<u64>, Vec<u64>, u64),
}

#[pymethods]
impl KnownOutputs {
    /// `arrays`: (name, dtype object, shape) of the validated outputs in their order; `ndarray`: the
    /// array type; `plan`: (prefix, offsets, row bytes, end), one offset and row size per array.
    #[new]
    fn new(arrays: Vec<KnownArray>, ndarray: PyObject, plan: (Vec<u8>, Vec<u64>, Vec<u64>, u64)) -> PyResult<Self> {
        let k = arrays.len();
        if k == 0 || plan.1.len() != k || plan.2.len() != k {
            return Err(PyValueError::new_err(format!(
                "{k} arrays, {} offsets and {} row sizes: expected one offset and one row size per array, at least one array",
                plan.1.len(),
                plan.2.len()
            )));
        }
        let rows = arrays[0].2.first().copied().unwrap_or(0);
        if rows < 1 || arrays.iter().any(|a| a.2.first() != Some(&rows)) {
            let shapes: Vec<&Vec<isize>> = arrays.iter().map(|a| &a.2).collect();
            return Err(PyValueError::new_err(format!("shapes {shapes:?}: expected one leading dimension of at least 1 row")));
        }
        Ok(KnownOutputs { arrays, ndarray, plan })
    }
}

/// The outputs' bytes in the layout's order when `outputs` is exactly `known`'s layout (a `dict` of
/// its names in its order, each an `ndarray` of its dtype object and shape); None otherwise.
fn known_sources(py: Python<'_>, known: &KnownOutputs, outputs: &Bound<'_, PyAny>) -> PyResult<Option<Vec<SrcBytes>>> {
    let Ok(dict) = outputs.downcast_exact::<PyDict>() else {
        return Ok(None);
    };
    if dict.len() != known.arrays.len() {
        return Ok(None);
    }
    let ndarray = known.ndarray.bind(py);
    let mut srcs = Vec::with_capacity(known.arrays.len());
    for ((key, value), (name, dtype, shape)) in dict.iter().zip(&known.arrays) {
        let name = name.bind(py);
        if !(key.is(name) || key.eq(name)?) {
            return Ok(None);
        }
        if !value.get_type().is(ndarray) || !matches!(value.getattr(intern!(py, "dtype")), Ok(d) if d.is(dtype.bind(py))) {
            return Ok(None);
        }
        let Ok(src) = SrcBytes::get(&value) else {
            return Ok(None);
        };
        if src.view.shape() != shape.as_slice() {
            return Ok(None);
        }
        srcs.push(src);
    }
    Ok(Some(srcs))
}

/// Answer the one request (`lane`, `slot`, `seq`, `gen`) of a batch with `outputs`, all its rows, when
/// they are exactly `known`'s layout: `answer_rows` with `known`'s plan. Returns (ns in the wakes'
/// system calls, lanes woken), or None when the outputs are not that layout (nothing written).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn answer_known(
    py: Python<'_>,
    seg: PyRef<'_, Segment>,
    known: PyRef<'_, KnownOutputs>,
    outputs: &Bound<'_, PyAny>,
    lane: u64,
    slot: u64,
    seq: u64,
    gen: u64,
    engine_ns: u64,
    call: u64,
) -> PyResult<Option<(u64, u64)>> {
    let Some(srcs) = known_sources(py, &known, outputs)? else {
        return Ok(None);
    };
    let rows = known.arrays[0].2[0] as u64; // at least 1 (checked when made)
    let (prefix, offs, row_bytes, end) = &known.plan;
    let plan = (prefix.as_slice(), offs.as_slice(), row_bytes.as_slice(), *end);
    let (_, ns, woken) = seg.answer_sources(&[(lane, slot, seq, gen, 0, rows, 0)], &[plan], &srcs, engine_ns, call)?;
    Ok(Some((ns, woken)))
}
