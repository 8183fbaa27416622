//! An exact numpy array's bytes read from the array object's own fields, without a buffer export.
//!
//! Every plan of the core (a request's, an answer's, a known output's) takes "the array the Python side
//! validated": exactly `ndarray` (the type, not a subclass), the same dtype object, the same shape.
//! Through the buffer protocol that check and the export cost about 900 instructions per array (numpy
//! builds the buffer's format and shape info on every export) plus an attribute lookup for the dtype:
//! with six outputs, these reads and the poll's maps took 8,500 of 82,350 instructions per call off. numpy's array object starts with
//! fields its C API has exposed unchanged since numpy 1.7, through 2.x (`PyArrayObject_fields` in
//! `numpy/ndarraytypes.h`: data, nd, dimensions, strides, base, descr, flags); `rust-numpy` reads the
//! same struct. They are read here only after `layout_ok` has checked them once per process against what
//! numpy itself reports for probe arrays; where that check fails, every array goes through the buffer
//! export as before.
//!
//! The bytes stay valid while the caller holds the array (`ArrayBytes` does) and the GIL, and no Python
//! code runs: nothing can then resize or free the array's data. The callers copy with the GIL held and
//! run no Python code between taking the bytes and the last copy.

use std::ffi::c_int;

use pyo3::ffi;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::GILOnceCell;

use crate::Exported;

// numpy's flag bits (`numpy/ndarraytypes.h`): stable since numpy 1.0, WARN_ON_WRITE since 1.17 (an
// array numpy warns about when written, e.g. `broadcast_arrays`'s: its buffer export is read-only).
const NPY_ARRAY_C_CONTIGUOUS: c_int = 0x0001;
const NPY_ARRAY_WRITEABLE: c_int = 0x0400;
const NPY_ARRAY_WARN_ON_WRITE: u32 = 0x8000_0000;

/// Whether an array of these flags may be written as its buffer export would allow.
fn writeable(flags: c_int) -> bool {
    flags & NPY_ARRAY_WRITEABLE != 0 && (flags as u32) & NPY_ARRAY_WARN_ON_WRITE == 0
}

/// numpy's array object up to its flags (`PyArrayObject_fields`).
#[repr(C)]
struct NdHead {
    ob_base: ffi::PyObject,
    data: *mut u8,
    nd: c_int,
    dimensions: *const isize,
    strides: *const isize,
    base: *mut ffi::PyObject,
    descr: *mut ffi::PyObject,
    flags: c_int,
}

/// The head of `obj`, which the caller has checked is exactly the `ndarray` type.
fn head<'a>(obj: &'a Bound<'_, PyAny>) -> &'a NdHead {
    // An instance of the exact ndarray type is a PyArrayObject: at least these fields, alive while held.
    unsafe { &*(obj.as_ptr() as *const NdHead) }
}

fn dims(h: &NdHead) -> &[isize] {
    if h.nd <= 0 || h.dimensions.is_null() {
        return &[];
    }
    unsafe { std::slice::from_raw_parts(h.dimensions, h.nd as usize) }
}

/// The array type probed (held, so its address is never another type's) and whether it passed. A
/// GILOnceCell, not a OnceLock: the probe runs Python, which may let another thread take the GIL, and
/// that thread must not block on a lock while holding it.
static LAYOUT_OK: GILOnceCell<(Py<PyAny>, bool)> = GILOnceCell::new();

/// Set (to anything) in the environment: every array goes through the buffer export, as where the
/// probe fails (the tests run the core's array paths both ways with it).
const EXPORTS_ONLY: &str = "LOWTAIL_NATIVE_ARRAY_EXPORTS";

/// Whether the fields of `ndarray`'s instances read as `NdHead` says, checked once per process against
/// numpy's own answers for probe arrays (C-contiguous, transposed, read-only, 0-d, empty): the data
/// address, the dimensions, the dtype object, the C-contiguous and writeable flags.
/// Only for the type probed first: any other is read through exports.
pub(crate) fn layout_ok(py: Python<'_>, ndarray: &Bound<'_, PyAny>) -> bool {
    let (probed, ok) = LAYOUT_OK.get_or_init(py, || {
        let ok = std::env::var_os(EXPORTS_ONLY).is_none() && probe(py, ndarray).unwrap_or(false);
        (ndarray.clone().unbind(), ok)
    });
    *ok && probed.is(ndarray)
}

/// Whether this process reads exact arrays of the type `ndarray` from their fields (`layout_ok`): for
/// the tests and the reports; the plans ask the same once each.
#[pyfunction]
pub fn direct_array_reads(py: Python<'_>, ndarray: &Bound<'_, PyAny>) -> bool {
    layout_ok(py, ndarray)
}

/// Whether this process makes a plan's fresh arrays through numpy's C API (`fresh_array`: its ABI is
/// one this core knows), for the tests and the reports.
#[pyfunction]
pub fn fresh_arrays_by_c_api(py: Python<'_>) -> bool {
    new_from_descr(py).is_some()
}

fn probe(py: Python<'_>, ndarray: &Bound<'_, PyAny>) -> PyResult<bool> {
    let a = ndarray.call1(((2usize, 3usize, 5usize), "<f4"))?;
    let ro = a.call_method0(intern!(py, "view"))?;
    ro.getattr(intern!(py, "flags"))?.setattr(intern!(py, "writeable"), false)?;
    let probes = [
        a.clone(),
        a.getattr(intern!(py, "T"))?,
        ro,
        ndarray.call1(((), "<i8"))?,
        ndarray.call1(((0usize, 4usize), "<u2"))?,
    ];
    for p in &probes {
        if !p.get_type().is(ndarray) {
            return Ok(false);
        }
        let h = head(p);
        let iface = p.getattr(intern!(py, "__array_interface__"))?;
        let data: usize = iface.get_item("data")?.get_item(0)?.extract()?;
        let shape: Vec<isize> = p.getattr(intern!(py, "shape"))?.extract()?;
        let flags = p.getattr(intern!(py, "flags"))?;
        let c: bool = flags.getattr(intern!(py, "c_contiguous"))?.extract()?;
        let w: bool = flags.getattr(intern!(py, "writeable"))?.extract()?;
        let same = h.data as usize == data
            && dims(h) == shape.as_slice()
            && h.nd as usize == shape.len()
            && std::ptr::eq(h.descr, p.getattr(intern!(py, "dtype"))?.as_ptr())
            && (h.flags & NPY_ARRAY_C_CONTIGUOUS != 0) == c
            && writeable(h.flags) == w;
        if !same {
            return Ok(false);
        }
    }
    Ok(true)
}

/// The bytes of `shape.iter().product() * itemsize` (`nbytes`), checked once when a plan is made: what a
/// direct read takes as the array's length, so a plan whose byte count disagrees with its dtype and shape
/// is refused there, not read past.
/// Only plain numbers and bools (dtype kinds b, i, u, f, c: every dtype `lowtail.shm.payload` carries):
/// bytes another process wrote are never taken as object pointers, strings or dates.
pub(crate) fn nbytes_of(py: Python<'_>, dtype: &Bound<'_, PyAny>, shape: &[isize]) -> PyResult<u64> {
    let kind: String = dtype.getattr(intern!(py, "kind"))?.extract()?;
    if !matches!(kind.as_str(), "b" | "i" | "u" | "f" | "c") {
        return Err(pyo3::exceptions::PyValueError::new_err(format!(
            "dtype {dtype} (kind {kind:?}): expected a bool or number dtype (kind b, i, u, f or c)"
        )));
    }
    let itemsize: u64 = dtype.getattr(intern!(py, "itemsize"))?.extract()?;
    shape.iter().try_fold(itemsize, |n, &d| u64::try_from(d).ok().and_then(|d| n.checked_mul(d))).ok_or_else(|| {
        pyo3::exceptions::PyValueError::new_err(format!("shape {shape:?} of {itemsize}-byte items: expected dimensions >= 0 whose bytes fit 64 bits"))
    })
}

/// An array's bytes as a plan reads or writes them: straight from an exact ndarray's fields (holding the
/// array), or through a buffer export `B`.
pub(crate) enum ArrayBytes<'py, B> {
    Direct { _obj: Bound<'py, PyAny>, ptr: *mut u8, len: usize, writeable: bool },
    Export(B),
}

impl<B: Exported> ArrayBytes<'_, B> {
    pub(crate) fn bytes(&self) -> &[u8] {
        match self {
            ArrayBytes::Direct { ptr, len, .. } if *len > 0 => unsafe { std::slice::from_raw_parts(*ptr, *len) },
            ArrayBytes::Direct { .. } => &[],
            ArrayBytes::Export(b) => b.bytes(),
        }
    }
    pub(crate) fn writeable(&self) -> bool {
        match self {
            ArrayBytes::Direct { writeable, .. } => *writeable,
            ArrayBytes::Export(b) => b.raw().view.readonly == 0,
        }
    }
    pub(crate) fn bytes_mut(&mut self) -> PyResult<&mut [u8]> {
        match self {
            ArrayBytes::Direct { writeable: false, .. } => {
                Err(pyo3::exceptions::PyValueError::new_err("the destination array is read-only"))
            }
            ArrayBytes::Direct { ptr, len, .. } if *len > 0 => Ok(unsafe { std::slice::from_raw_parts_mut(*ptr, *len) }),
            ArrayBytes::Direct { .. } => Ok(&mut []),
            ArrayBytes::Export(b) => b.bytes_mut(),
        }
    }
}

/// `obj`'s bytes when `obj` is exactly an `ndarray` (the type itself, not a subclass) of the dtype
/// object `dtype` and the shape `shape` (`nbytes` bytes, as `nbytes_of` computed when the plan was made):
/// read directly when `direct` (`layout_ok`) and the array is C-contiguous, else through the export
/// `take` makes (a strided source is copied by `SrcBytes`; `RawBuffer` refuses it). None when `obj` is
/// not that array, or `take` refuses it: the caller's Python path handles those.
pub(crate) fn exact_array<'py, B: Exported>(
    obj: Bound<'py, PyAny>,
    direct: bool,
    ndarray: &Bound<'_, PyAny>,
    dtype: &Bound<'_, PyAny>,
    shape: &[isize],
    nbytes: u64,
    take: impl FnOnce(&Bound<'py, PyAny>) -> PyResult<B>,
) -> Option<ArrayBytes<'py, B>> {
    if !obj.get_type().is(ndarray) {
        return None;
    }
    if direct {
        let h = head(&obj);
        if !std::ptr::eq(h.descr, dtype.as_ptr()) || dims(h) != shape || h.nd as usize != shape.len() {
            return None;
        }
        if h.flags & NPY_ARRAY_C_CONTIGUOUS != 0 && (!h.data.is_null() || nbytes == 0) {
            let (ptr, writeable) = (h.data, writeable(h.flags));
            return Some(ArrayBytes::Direct { _obj: obj, ptr, len: nbytes as usize, writeable });
        }
    } else if !matches!(obj.getattr(intern!(obj.py(), "dtype")), Ok(d) if d.is(dtype)) {
        return None;
    }
    let b = take(&obj).ok()?;
    (b.raw().shape() == shape && b.bytes().len() as u64 == nbytes).then_some(ArrayBytes::Export(b))
}

/// numpy's `PyArray_NewFromDescr` (its C API table's entry 94 in ABI 1.x and 2.x, as `rust-numpy` calls
/// it): `(subtype, descr, nd, dims, strides, data, flags, obj)`, stealing a reference to `descr`.
type NewFromDescr = unsafe extern "C" fn(
    *mut ffi::PyTypeObject,
    *mut ffi::PyObject,
    c_int,
    *const isize,
    *const isize,
    *mut std::ffi::c_void,
    c_int,
    *mut ffi::PyObject,
) -> *mut ffi::PyObject;

/// The C API's `PyArray_NewFromDescr` when numpy's `_ARRAY_API` capsule is one of the ABIs whose table
/// has it at entry 94 (checked by entry 0, `PyArray_GetNDArrayCVersion`); None otherwise (`np.empty` is
/// called as before). Held for the process: numpy's module, which owns the table, is never unloaded.
static NEW_FROM_DESCR: GILOnceCell<Option<usize>> = GILOnceCell::new();

/// numpy's C ABI versions (`NPY_ABI_VERSION`) whose table has `PyArray_NewFromDescr` at entry 94.
const KNOWN_ABIS: [u32; 2] = [0x0100_0009, 0x0200_0000];

fn new_from_descr(py: Python<'_>) -> Option<NewFromDescr> {
    let f = NEW_FROM_DESCR.get_or_init(py, || {
        let m = py.import("numpy._core.multiarray").or_else(|_| py.import("numpy.core.multiarray")).ok()?;
        let capsule = m.getattr("_ARRAY_API").ok()?;
        // The capsule's name is NULL for every numpy that has one (numpy/__init__.pxd's _import_array).
        let table = unsafe { ffi::PyCapsule_GetPointer(capsule.as_ptr(), std::ptr::null()) } as *const usize;
        if table.is_null() {
            unsafe { ffi::PyErr_Clear() };
            return None;
        }
        let version: unsafe extern "C" fn() -> u32 = unsafe { std::mem::transmute(*table) };
        KNOWN_ABIS.contains(&unsafe { version() }).then(|| unsafe { *table.add(94) })
    });
    f.map(|p| unsafe { std::mem::transmute::<usize, NewFromDescr>(p) })
}

/// A fresh, uninitialised C-order array of type `ndarray` (numpy's own array type, which the caller
/// checked it is), the dtype object `dtype` and `shape`, as `np.empty(shape, dtype)` makes it, made
/// through numpy's C API without a Python call (about 1,000 instructions less per array: the argument
/// parsing and the shape's conversion). None when the C API is not one this core knows (the caller
/// calls `np.empty`).
pub(crate) fn fresh_array<'py>(
    py: Python<'py>,
    ndarray: &Bound<'_, PyAny>,
    dtype: &Bound<'_, PyAny>,
    shape: &[isize],
) -> Option<PyResult<Bound<'py, PyAny>>> {
    let new = new_from_descr(py)?;
    let nd = c_int::try_from(shape.len()).ok()?;
    let ty = ndarray.as_ptr() as *mut ffi::PyTypeObject;
    // `descr` is stolen: the reference given is a new one. No strides, data nor base: numpy allocates
    // C-order data of the dtype and shape, its flags C-contiguous and writeable.
    let dt = dtype.as_ptr();
    unsafe { ffi::Py_INCREF(dt) };
    let raw = unsafe { new(ty, dt, nd, shape.as_ptr(), std::ptr::null(), std::ptr::null_mut(), 0, std::ptr::null_mut()) };
    Some(unsafe { Bound::from_owned_ptr_or_err(py, raw) })
}
