//! The worker's poll in the core: the round-robin over the lanes' doorbells, the claims and the batch
//! limits of `lowtail.shm.server.QueueWorker._poll` (the reference), in one call per batch.
//!
//! The rule is the Python one, step for step, so both paths take the same requests in the same order:
//! the lanes whose doorbell moved since the last poll and those the last poll left with work, one
//! request per lane per round starting after the lane served last, until the batch's slots or samples
//! are reached; a request that would pass the sample limit after the first is claimed and carried into
//! the next batch. What only Python can do stays Python: a request whose header this poll has not seen
//! accepted (its first appearance, an ndarray segment's payload) stops the poll right after its claim;
//! Python decodes it and `resume_bound` goes on from there with its sample count, so the limits are
//! applied to what Python accepted. Fences and the answers of withdrawn or refused requests are left to
//! Python, in the order they happened; the fence's tail resynchronisation is done here, where the tails
//! live.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::IdHasher;

use pyo3::exceptions::{PyException, PyIndexError, PyValueError};
use pyo3::prelude::*;
use pyo3::ffi;
use pyo3::intern;
use pyo3::types::{PyBool, PyDict, PyList, PyTuple, PyType};

use crate::layout::*;
use crate::Segment;

// What `poll_bound` returns per claimed request (or fenced lane) it did not make an item of: what the
// worker does with it.
const APPEND: u8 = 0; // into this batch (its header accepted, its samples counted)
const CARRY: u8 = 1; // claimed, first in the next batch (it would pass the sample limit)
const WITHDRAWN: u8 = 2; // withdrawn by its client: answer it ST_WITHDRAWN
const REFUSED: u8 = 3; // its header refused by the core: answer it ST_BAD_REQUEST (the str says why)
const DECODE: u8 = 4; // not seen accepted: decode it, then `resume_bound` (always the last entry)
const FENCE: u8 = 5; // an impossible control word in the lane (slot 0, seq = the tail set, str = why)

// The poll's end: every lane looked at fully taken (the doorbells as given are drained), work left
// (a lane after the cut, or more published than taken), or stopped at a DECODE entry.
const DRAINED: u8 = 0;
const LEFT: u8 = 1;
const STOPPED: u8 = 2;

const ACCEPTED_MAX: usize = 4096;
// The longest `spin_bound` spins in one call: the worker's loop gets back to Python (its signals, its
// deadline) at least this often.
const SPIN_SLICE_NS: u64 = 1_000_000;

type Entry = (u8, u64, u64, u64, u64, u64, PyObject);

/// A poll in progress: its round's lanes and where it stands, kept while Python decodes a request.
struct Round {
    heads: Vec<u64>, // each lane's doorbell as this poll read it (the lanes of `look`; by lane)
    look: Vec<u64>,
    pending: Vec<u64>,
    next: usize,
    again: Vec<u64>,
    full: bool,
    items: u64,
    samples: u64,
    max_slots: u64,
    max_samples: u64,
    now: u64,
    stopped: u64, // the lane of the request Python decodes
    direct: bool, // requests are still made items here (no APPEND entry went to Python before them)
}

/// What every poll of one worker works on, bound once (`Poller.bind`): the worker's segment, its batch
/// limits, and what items are made with (`QueueWorker._claim_cache`: views by slot as (header id,
/// views, layout), last-seen stamps by lane, slot word by slot, the item class).
struct Binding {
    seg: Py<Segment>,
    max_slots: u64,
    max_samples: u64,
    views: Py<PyDict>,
    seen: Py<PyList>,
    slot_i: Py<PyList>,
    item: PyObject,
    slots: Option<[usize; ITEM_SLOTS.len()]>, // where `item`'s instances keep ITEM_SLOTS (`item_slots`)
}

/// The poll's state across calls (worker-private): each lane's tail as this worker moved it, the
/// doorbells seen at the last poll, the lanes it left with work, the lane after the last one served.
#[pyclass(module = "lowtail_native")]
pub struct Poller {
    spl: u64,
    tails: Vec<u64>,
    seen: Vec<u64>,
    leftover: Vec<u64>,
    rr: u64,
    accepted: HashMap<u64, u64, IdHasher>, // header id -> samples, for the headers Python decoded inline
    round: Option<Round>,
    bound: Option<Binding>,
}

fn word(raw: &[u8], lane: u64) -> u64 {
    let at = (lane * 8) as usize;
    u64::from_le_bytes(raw[at..at + 8].try_into().expect("8 bytes"))
}

#[pymethods]
impl Poller {
    /// A poll over lanes whose tails are `tails` (the words as the worker found them), `spl` slots each.
    #[new]
    fn new(tails: Vec<u64>, spl: u64) -> PyResult<Self> {
        if tails.is_empty() || tails.len() as u64 > MAX_LANES || !spl.is_power_of_two() {
            return Err(PyValueError::new_err(format!(
                "{} lanes of {spl} slots: expected 1..{MAX_LANES} lanes and a power of two of slots",
                tails.len()
            )));
        }
        // seen starts at the tails: a lane whose doorbell is not its tail is looked at (also one wrapped to 0)
        let seen = tails.clone();
        Ok(Poller { spl, tails, seen, leftover: Vec::new(), rr: 0, accepted: HashMap::default(), round: None, bound: None })
    }

    /// The tails as this poll moved them (diagnostics, tests).
    #[getter]
    fn tails(&self) -> Vec<u64> {
        self.tails.clone()
    }

    /// Whether the bound item class's items are made without its call (`item_slots`; tests).
    #[getter]
    fn fast_items(&self) -> bool {
        self.bound.as_ref().is_some_and(|b| b.slots.is_some())
    }

    /// Header `id` (from a `poll_bound` entry) decoded by Python into an inline payload of `samples` rows:
    /// later requests with it are counted here, without stopping.
    fn accept(&mut self, id: u64, samples: u64) {
        if self.accepted.len() >= ACCEPTED_MAX {
            self.accepted.clear(); // shapes that vary without bound must not grow memory without bound
        }
        self.accepted.insert(id, samples);
    }

    /// Bind the poll to the worker's segment `seg`, its batch limits and `cache` (the worker's, as
    /// `Binding` says), once, before the first `poll_bound`: the hot path's call then carries only what
    /// changes per poll. The segment must have this poll's lanes and slots per lane; refused while a
    /// stopped poll waits for `resume_bound`. The binding holds its objects strongly and is not seen by
    /// the garbage collector (no `__traverse__`): none of them may refer back to the worker or the
    /// poll, as the worker's dicts, lists and item class do not. An item class whose instances keep
    /// `ITEM_SLOTS` in member slots (`item_slots`, probed here) gets its items made without its call:
    /// its `__init__` must set exactly those slots, as `_Item.__init__` does.
    fn bind(&mut self, py: Python<'_>, seg: &Bound<'_, Segment>, max_slots: u64, max_samples: u64, cache: &Bound<'_, PyTuple>) -> PyResult<()> {
        if self.round.is_some() {
            // its resume would go on with another segment and cache than its round began with
            return Err(PyValueError::new_err("bind while a stopped poll waits for resume_bound"));
        }
        let geo = &seg.try_borrow()?.geo;
        if geo.lanes != self.tails.len() as u64 || geo.spl != self.spl {
            return Err(PyValueError::new_err(format!(
                "a segment of {} lanes x {} slots for a poll of {} lanes x {} slots",
                geo.lanes,
                geo.spl,
                self.tails.len(),
                self.spl
            )));
        }
        if cache.len() != 4 {
            return Err(PyValueError::new_err(format!("a cache of {} parts: expected 4", cache.len())));
        }
        self.bound = Some(Binding {
            seg: seg.clone().unbind(),
            max_slots,
            max_samples,
            views: cache.get_item(0)?.downcast_into::<PyDict>()?.unbind(),
            seen: cache.get_item(1)?.downcast_into::<PyList>()?.unbind(),
            slot_i: cache.get_item(2)?.downcast_into::<PyList>()?.unbind(),
            item: cache.get_item(3)?.unbind(),
            slots: item_slots(py, &cache.get_item(3)?)?,
        });
        Ok(())
    }

    /// Take published requests within the limits, fairly across lanes, from the doorbells `raw` (the
    /// doorbell words as bytes, read once by the caller); `items` (a list) and `samples` are what the
    /// batch holds already. A request taken into this batch whose slot's cached views are for its
    /// header (a sampler's next request) becomes an item `item(lane, g, si, seq, gen, submit_ns, now,
    /// layout, views, True)` appended to `items`, and its lane's last-seen stamp is set to `now`, as
    /// `QueueWorker._polled` does (the bound cache's parts). Returns (entries, end, now): the other
    /// requests, as entries (what, lane, slot, seq, gen, submit_ns, header) in claim order, header an id
    /// or a str; end DRAINED, LEFT or STOPPED (decode the last entry, then `resume_bound`); now the
    /// poll's CLOCK_MONOTONIC stamp, its requests' claim time. Once a request taken into the batch
    /// comes back as an APPEND entry, none after it in this poll is made an item here (a request Python
    /// decodes is appended by `resume_bound`, and the ones after it are made here again), so `items`
    /// keeps the claim order. Never blocks. Refused before `bind`.
    fn poll_bound(&mut self, py: Python<'_>, raw: &[u8], items: &Bound<'_, PyList>, samples: u64) -> PyResult<(Vec<Entry>, u8, u64)> {
        let (seg, max_slots, max_samples, maker) = self.bound_parts(py, items)?;
        let seg = seg.try_borrow()?; // a Segment borrowed mutably (closing) raises, never panics
        let now = crate::now_ns();
        let round = self.start(&seg, raw, items.len() as u64, samples, max_slots, max_samples, now)?;
        let (entries, end) = self.run(py, &seg, round, Vec::new(), &maker)?;
        Ok((entries, end, now))
    }

    /// The worker's spin before it parks (`QueueWorker._wait_native`): until a doorbell of the bound
    /// segment differs from `drained` (the doorbell bytes of the last poll that drained them, as the
    /// worker keeps them; bytes of another length count as moved at once) or the clock passes
    /// `until_ns`, at most `SPIN_SLICE_NS` per call. True when they moved (poll them), false when time
    /// ran out. One load per lane per turn: a request is seen within a turn, not an interpreter loop's
    /// iteration. The GIL stays held (its release and retake cost the round trip about 0.1 us): no
    /// longer than the interpreter's own spin held it, which another thread gets only after its
    /// switch interval (5 ms), more than a slice.
    fn spin_bound(&self, py: Python<'_>, drained: &[u8], until_ns: u64) -> PyResult<bool> {
        let b = self.bound.as_ref().ok_or_else(|| PyValueError::new_err("a spin before bind"))?;
        let seg = b.seg.bind(py).try_borrow()?;
        let lanes = self.tails.len() as u64;
        if drained.len() as u64 != 8 * lanes {
            return Ok(true);
        }
        let first = H_DOORBELLS >> 3;
        seg.w(first + lanes - 1)?; // the last doorbell within the segment: every one is
        // In bounds (checked above), mapped while `seg` is borrowed.
        let bells = unsafe { std::slice::from_raw_parts(seg.w(first)? as *const AtomicU64, lanes as usize) };
        let moved = || bells.iter().zip(drained.chunks_exact(8)).any(|(w, d)| w.load(Ordering::Acquire).to_le_bytes() != d);
        let until = until_ns.min(crate::now_ns().saturating_add(SPIN_SLICE_NS));
        loop {
            if moved() {
                return Ok(true);
            }
            if crate::now_ns() > until {
                return Ok(false);
            }
            for _ in 0..16 {
                std::hint::spin_loop();
                if moved() {
                    return Ok(true);
                }
            }
        }
    }

    /// Go on with the poll that stopped at a DECODE entry: `samples` is what Python decoded it to (None:
    /// it failed, answered already), `last` the item it made, appended to `items` here when it is
    /// taken into the batch, before the requests after it. Returns (what became of it: APPEND or
    /// CARRY, or 255 when not taken; entries; end) as `poll_bound`.
    #[pyo3(signature = (samples, last, items))]
    fn resume_bound(
        &mut self,
        py: Python<'_>,
        samples: Option<u64>,
        last: &Bound<'_, PyAny>,
        items: &Bound<'_, PyList>,
    ) -> PyResult<(u8, Vec<Entry>, u8)> {
        let (seg, _, _, maker) = self.bound_parts(py, items)?;
        let seg = seg.try_borrow()?; // a Segment borrowed mutably (closing) raises, never panics
        let (taken, round) = self.resumed(samples)?;
        if taken == APPEND {
            items.append(last)?;
        }
        let (entries, end) = self.run(py, &seg, round, Vec::new(), &maker)?;
        Ok((taken, entries, end))
    }
}

impl Poller {
    /// The bound segment, limits and item maker (new references: `self` stays free to change).
    #[allow(clippy::type_complexity)]
    fn bound_parts<'a, 'py>(
        &self,
        py: Python<'py>,
        items: &'a Bound<'py, PyList>,
    ) -> PyResult<(Bound<'py, Segment>, u64, u64, ItemMaker<'a, 'py>)> {
        let b = self.bound.as_ref().ok_or_else(|| PyValueError::new_err("a poll before bind"))?;
        let maker = ItemMaker {
            items,
            views: b.views.bind(py).clone(),
            seen: b.seen.bind(py).clone(),
            slot_i: b.slot_i.bind(py).clone(),
            item: b.item.bind(py).clone(),
            slots: b.slots,
        };
        Ok((b.seg.bind(py).clone(), b.max_slots, b.max_samples, maker))
    }

    /// A new poll's round: the lanes to look at from the doorbells `raw`, in the order served.
    #[allow(clippy::too_many_arguments)]
    fn start(
        &mut self,
        seg: &Segment,
        raw: &[u8],
        items: u64,
        samples: u64,
        max_slots: u64,
        max_samples: u64,
        now: u64,
    ) -> PyResult<Round> {
        let lanes = self.tails.len() as u64;
        if raw.len() as u64 != 8 * lanes || seg.geo.lanes != lanes || seg.geo.spl != self.spl {
            return Err(PyValueError::new_err(format!(
                "{} doorbell bytes for a poll of {lanes} lanes ({} x {} in the segment)",
                raw.len(),
                seg.geo.lanes,
                seg.geo.spl
            )));
        }
        if self.round.is_some() {
            return Err(PyValueError::new_err("poll while a stopped poll waits for resume_bound"));
        }
        let mut look: Vec<u64> = self.leftover.clone();
        for lane in 0..lanes {
            let w = word(raw, lane);
            if w != self.seen[lane as usize] {
                if !look.contains(&lane) {
                    look.push(lane);
                }
                self.seen[lane as usize] = w;
            }
        }
        let mut heads = vec![0u64; lanes as usize];
        for &l in &look {
            heads[l as usize] = word(raw, l);
        }
        let mut order: Vec<u64> = look.iter().copied().filter(|&l| heads[l as usize] != self.tails[l as usize]).collect();
        order.sort_unstable();
        let start = self.rr;
        let pending: Vec<u64> =
            order.iter().copied().filter(|&l| l >= start).chain(order.iter().copied().filter(|&l| l < start)).collect();
        Ok(Round {
            heads,
            look,
            pending,
            next: 0,
            again: Vec::new(),
            full: false,
            items,
            samples,
            max_slots,
            max_samples,
            now,
            stopped: 0,
            direct: true,
        })
    }

    /// The stopped poll's round, its request counted with the `samples` Python decoded it to.
    fn resumed(&mut self, samples: Option<u64>) -> PyResult<(u8, Round)> {
        let mut round = self.round.take().ok_or_else(|| PyValueError::new_err("resume_bound without a stopped poll"))?;
        let lane = round.stopped;
        let taken = match samples {
            Some(n) => Self::count(&mut round, n),
            None => 255,
        };
        self.served(&mut round, lane);
        round.next += 1;
        Ok((taken, round))
    }

    /// The batch limits for a request of `n` samples: into this batch, or carried (the batch is full).
    fn count(round: &mut Round, n: u64) -> u8 {
        if round.items > 0 && round.samples + n > round.max_samples {
            round.full = true;
            CARRY
        } else {
            round.items += 1;
            round.samples += n;
            APPEND
        }
    }

    /// After a take in `lane`: the next round starts after it, and it goes again while it has work.
    fn served(&mut self, round: &mut Round, lane: u64) {
        self.rr = (lane + 1) % self.tails.len() as u64;
        if self.tails[lane as usize] != round.heads[lane as usize] {
            round.again.push(lane);
        }
    }

    /// The fence's part that is the poll's: the lane's tail set to its doorbell as read now.
    fn resync(&mut self, seg: &Segment, lane: u64) -> PyResult<u64> {
        let head = seg.ld((H_DOORBELLS >> 3) + lane)?;
        self.tails[lane as usize] = head;
        seg.st(seg.geo.lane_word(lane, L_TAIL), head)?;
        Ok(head)
    }

    fn run(
        &mut self,
        py: Python<'_>,
        seg: &Segment,
        mut round: Round,
        mut out: Vec<Entry>,
        maker: &ItemMaker<'_, '_>,
    ) -> PyResult<(Vec<Entry>, u8)> {
        match self.take_round(py, seg, &mut round, &mut out, maker) {
            Err(e) => {
                // Every lane this poll looked at is looked at again by the next one: a lane whose
                // doorbell this poll marked seen is not left waiting for its doorbell to move again.
                self.leftover = round.look;
                Err(e)
            }
            Ok(true) => {
                self.round = Some(round);
                Ok((out, STOPPED))
            }
            Ok(false) => {
                let tails = &self.tails;
                self.leftover = round.look.iter().copied().filter(|&l| round.heads[l as usize] != tails[l as usize]).collect();
                let left = round.full || !round.again.is_empty();
                Ok((out, if left { LEFT } else { DRAINED }))
            }
        }
    }

    /// The round's lanes taken into `out` (and `maker`'s items); true when stopped at a DECODE entry.
    fn take_round(
        &mut self,
        py: Python<'_>,
        seg: &Segment,
        round: &mut Round,
        out: &mut Vec<Entry>,
        maker: &ItemMaker<'_, '_>,
    ) -> PyResult<bool> {
        let spl = self.spl;
        loop {
            while round.next < round.pending.len() {
                let lane = round.pending[round.next];
                if lane >= self.tails.len() as u64 {
                    return Err(PyIndexError::new_err(format!("lane {lane} of {}", self.tails.len())));
                }
                if round.items >= round.max_slots || round.samples >= round.max_samples {
                    round.full = true;
                    break;
                }
                let (head, tail) = (round.heads[lane as usize], self.tails[lane as usize]);
                if !(1..=spl).contains(&head.wrapping_sub(tail)) {
                    // more published than the lane has slots, or a doorbell behind the tail (both modulo
                    // 2^64: a lane's previous holder may leave its doorbell at the maximum): impossible
                    let why = format!("doorbell {head} with tail {tail} and {spl} slots per lane");
                    let set = self.resync(seg, lane)?;
                    out.push((FENCE, lane, 0, set, 0, 0, why.into_pyobject(py)?.into_any().unbind()));
                    round.next += 1;
                    continue;
                }
                let (kind, s, seq, gen, submit) = seg.claim(lane, tail, round.now)?;
                self.tails[lane as usize] = tail.wrapping_add(1);
                match kind {
                    1 => {
                        let why = format!("ring entry {s} at position {tail}, expected a slot 0..{}", spl - 1);
                        let set = self.resync(seg, lane)?;
                        out.push((FENCE, lane, 0, set, 0, 0, why.into_pyobject(py)?.into_any().unbind()));
                    }
                    2 => {} // claimed or answered already: never twice
                    3 => out.push((WITHDRAWN, lane, s, seq, gen, submit, py.None())),
                    _ => match seg.header_id(lane * spl + s)? {
                        Err(why) => out.push((REFUSED, lane, s, seq, gen, submit, why.into_pyobject(py)?.into_any().unbind())),
                        Ok(id) => {
                            // The header id as Python's: only for an entry (an item made here needs none)
                            let hdr = || id.into_pyobject(py).map(|h| h.into_any().unbind());
                            match self.accepted.get(&id) {
                                Some(&n) => {
                                    let what = Self::count(round, n);
                                    // An item the core could not make (its class raised an Exception)
                                    // goes to Python as an entry, as any other. A BaseException only
                                    // (KeyboardInterrupt) propagates: what this poll claimed stays
                                    // unanswered, as when the Python poll is interrupted.
                                    let made = if what == APPEND && round.direct {
                                        match maker.item(py, lane, lane * spl + s, seq, gen, submit, id, round.now) {
                                            Ok(made) => made,
                                            Err(e) if e.is_instance_of::<PyException>(py) => false,
                                            Err(e) => return Err(e),
                                        }
                                    } else {
                                        false
                                    };
                                    if !made {
                                        round.direct &= what != APPEND;
                                        out.push((what, lane, s, seq, gen, submit, hdr()?));
                                    }
                                }
                                None => {
                                    out.push((DECODE, lane, s, seq, gen, submit, hdr()?));
                                    round.stopped = lane;
                                    return Ok(true);
                                }
                            }
                        }
                    },
                }
                self.served(round, lane);
                round.next += 1;
            }
            if round.full || round.again.is_empty() {
                return Ok(false);
            }
            round.pending = std::mem::take(&mut round.again);
            round.next = 0;
        }
    }
}

/// What `poll_bound` makes the worker's items with (the bound cache's parts, see `Binding`).
struct ItemMaker<'a, 'py> {
    items: &'a Bound<'py, PyList>,
    views: Bound<'py, PyDict>,
    seen: Bound<'py, PyList>,
    slot_i: Bound<'py, PyList>,
    item: Bound<'py, PyAny>,
    slots: Option<[usize; ITEM_SLOTS.len()]>,
}

impl<'a, 'py> ItemMaker<'a, 'py> {
    /// The item of the request in slot `g` when its cached views are for header `id`: appended to
    /// `items`, its lane seen `now`; false (nothing done) when they are not.
    #[allow(clippy::too_many_arguments)]
    fn item(&self, py: Python<'py>, lane: u64, g: u64, seq: u64, gen: u64, submit: u64, id: u64, now: u64) -> PyResult<bool> {
        let Some(cached) = self.views.get_item(g)? else {
            return Ok(false);
        };
        let Ok(cached) = cached.downcast::<PyTuple>() else {
            return Ok(false);
        };
        if cached.len() != 3 || cached.get_item(0)?.extract::<u64>().ok() != Some(id) {
            return Ok(false);
        }
        let si = self.slot_i.get_item(g as usize)?;
        let now = now.into_pyobject(py)?;
        self.seen.set_item(lane as usize, &now)?;
        let (layout, inputs) = (cached.get_item(2)?, cached.get_item(1)?);
        let it = match self.slots {
            Some(at) => {
                let int = |v: u64| v.into_pyobject(py).map(|v| v.into_any());
                let t = PyBool::new(py, true).to_owned().into_any();
                let f = PyBool::new(py, false).to_owned().into_any();
                // ITEM_SLOTS' order: `_Item.__init__`'s, and `done` False
                let values = [int(lane)?, int(g)?, si, int(seq)?, int(gen)?, int(submit)?, now.into_any(), layout, inputs, t, f];
                new_item(py, self.item.downcast::<PyType>()?, &at, values)?
            }
            None => self.item.call1((lane, g, si, seq, gen, submit, now, layout, inputs, true))?,
        };
        // Appended last: an error before it leaves nothing in `items` (the request goes to Python,
        // which sets the lane's stamp again)
        self.items.append(it)?;
        Ok(true)
    }
}

/// The slots `_Item.__init__` sets, in its parameters' order, then `done`: what `new_item` fills.
const ITEM_SLOTS: [&str; 11] = ["lane", "g", "si", "seq", "gen", "submit_ns", "claim_ns", "layout", "inputs", "inline", "done"];

/// Where instances of the item class `cls` keep `ITEM_SLOTS` (byte offsets), when `new_item` may make
/// them: a class of no metaclass of its own (its `__basicsize__` and its call are `type`'s), made by
/// `object.__new__`, of no variable size and no `__dict__`, whose `__init__` stores its ten parameters
/// and `done` False in its slots and nothing else. Found by probing: one instance made by the class
/// call with fresh objects for its parameters, each found exactly once among its words, `done` the
/// one False, every other word past the object's header empty. None otherwise: its items are made by
/// calling it, as `_Item(...)` is called in Python.
fn item_slots(py: Python<'_>, cls: &Bound<'_, PyAny>) -> PyResult<Option<[usize; ITEM_SLOTS.len()]>> {
    let Ok(cls) = cls.downcast::<PyType>() else {
        return Ok(None);
    };
    let object = py.get_type::<PyAny>();
    let object_new = object.getattr(intern!(py, "__new__"))?;
    let plain = cls.get_type().is(&py.get_type::<PyType>())
        && cls.getattr(intern!(py, "__new__"))?.is(&object_new)
        && cls.getattr(intern!(py, "__itemsize__"))?.extract::<usize>()? == 0
        && cls.getattr(intern!(py, "__dictoffset__"))?.extract::<isize>()? == 0;
    if !plain {
        return Ok(None);
    }
    let size: usize = cls.getattr(intern!(py, "__basicsize__"))?.extract()?;
    let marks: Vec<Bound<'_, PyAny>> = (1..ITEM_SLOTS.len()).map(|_| object_new.call1((&object,))).collect::<PyResult<_>>()?;
    let Ok(probe) = cls.call1(PyTuple::new(py, &marks)?) else {
        return Ok(None); // its __init__ takes other parameters, or refused these
    };
    if !probe.get_type().is(cls) {
        return Ok(None);
    }
    let word = std::mem::size_of::<*mut ffi::PyObject>();
    // The words past the object's header (refcount, type) within its basic size: the instance's own.
    // SAFETY: within the probe's `__basicsize__` bytes (its class's own, checked above), word-aligned
    let words: Vec<*mut ffi::PyObject> =
        (2..size / word).map(|w| unsafe { *(probe.as_ptr().cast::<u8>().add(w * word) as *const *mut ffi::PyObject) }).collect();
    let once = |p: *mut ffi::PyObject| {
        let mut found = words.iter().enumerate().filter(|(_, &w)| w == p).map(|(i, _)| (i + 2) * word);
        match (found.next(), found.next()) {
            (Some(off), None) => Some(off),
            _ => None,
        }
    };
    let mut at = [0usize; ITEM_SLOTS.len()];
    for (i, mark) in marks.iter().enumerate() {
        let Some(off) = once(mark.as_ptr()) else {
            return Ok(None);
        };
        at[i] = off;
    }
    let Some(done) = once(PyBool::new(py, false).as_ptr()) else {
        return Ok(None);
    };
    at[ITEM_SLOTS.len() - 1] = done;
    if words.iter().filter(|w| !w.is_null()).count() != ITEM_SLOTS.len() {
        return Ok(None); // its __init__ stored something else too
    }
    Ok(Some(at))
}

/// An instance of `cls` allocated as `object.__new__` allocates one of a class without `__dict__`
/// (zeroed, tracked by the collector).
fn alloc<'py>(py: Python<'py>, cls: &Bound<'py, PyType>) -> PyResult<Bound<'py, PyAny>> {
    // SAFETY: `cls` is a type; PyType_GenericAlloc returns a new reference or NULL with an exception set
    unsafe { Bound::from_owned_ptr_or_err(py, ffi::PyType_GenericAlloc(cls.as_type_ptr(), 0)) }
}

/// An item of `cls` with `values` in its `ITEM_SLOTS` at `at` (`item_slots`' offsets), without the class
/// call (type_call, slot_tp_init and `__init__`'s frame: about 2,600 instructions per request).
fn new_item<'py>(py: Python<'py>, cls: &Bound<'py, PyType>, at: &[usize; ITEM_SLOTS.len()], values: [Bound<'py, PyAny>; ITEM_SLOTS.len()]) -> PyResult<Bound<'py, PyAny>> {
    let it = alloc(py, cls)?;
    for (&off, v) in at.iter().zip(values) {
        // SAFETY: `off` is a member slot of `cls`'s instances (probed at bind), NULL in a fresh one: the
        // slot takes the value's reference, as a member descriptor's set would.
        unsafe { *(it.as_ptr().cast::<u8>().add(off) as *mut *mut ffi::PyObject) = v.into_ptr() };
    }
    Ok(it)
}
