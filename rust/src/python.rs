//! `rollout_hpc._ring`: the PyO3 face of the ring. rollout_hpc/exchange/ring.py wraps it.
//!
//! Blocking calls release the GIL and wake every CHECK_EVERY to run Python signal handlers
//! (Ctrl-C works). Pushes read any C-contiguous buffer in place; `pop_view` and `reserve`
//! export the record's bytes in shared memory through the buffer protocol (zero copy).

use std::os::raw::{c_int, c_void};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use pyo3::create_exception;
use pyo3::exceptions::{PyBufferError, PyException, PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use crate::{Claim, Ring, RingError, WriteSlot};

create_exception!(_ring, PyRingError, PyException, "Any ring failure; the message names the segment file and the fix.");
create_exception!(_ring, RingTimeout, PyRingError, "Nothing could be pushed or popped before the timeout.");
create_exception!(_ring, RingClosed, PyRingError, "The ring was closed (and, for pops, is drained).");
create_exception!(_ring, RecordTooLarge, PyRingError, "The record is larger than the ring can ever hold.");

const CHECK_EVERY: Duration = Duration::from_millis(100);
/// Copies smaller than this are done holding the GIL (releasing it costs more).
const DETACH_COPY_BYTES: usize = 64 * 1024;

fn to_py(e: RingError) -> PyErr {
    let msg = e.to_string();
    match e {
        RingError::Timeout => RingTimeout::new_err(msg),
        RingError::Closed => RingClosed::new_err(msg),
        RingError::TooLarge { .. } => RecordTooLarge::new_err(msg),
        RingError::Invalid(_) => PyValueError::new_err(msg),
        _ => PyRingError::new_err(msg),
    }
}

fn to_duration(timeout: Option<f64>) -> PyResult<Option<Duration>> {
    match timeout {
        None => Ok(None),
        Some(t) if t.is_nan() || t < 0.0 => Err(PyValueError::new_err(format!("timeout must be >= 0 or None, got {t}"))),
        Some(t) => Ok(Some(Duration::from_secs_f64(t.min(1e9)))),
    }
}

/// Runs a blocking ring operation without the GIL, in slices, checking for signals between them.
fn blocking<T: Send>(
    py: Python<'_>,
    ring: &Ring,
    what: &str,
    timeout: Option<f64>,
    op: impl Fn(Option<Duration>) -> crate::Result<T> + Sync,
) -> PyResult<T> {
    let deadline = to_duration(timeout)?.map(|t| Instant::now() + t);
    // Fast path: most calls need not wait, and releasing the GIL costs more than they do.
    match op(Some(Duration::ZERO)) {
        Err(RingError::Timeout) => {}
        r => return r.map_err(to_py),
    }
    loop {
        let now = Instant::now();
        let (slice, last) = match deadline {
            None => (CHECK_EVERY, false),
            Some(d) => {
                let left = d.saturating_duration_since(now);
                (left.min(CHECK_EVERY), left <= CHECK_EVERY)
            }
        };
        match py.detach(|| op(Some(slice))) {
            Err(RingError::Timeout) if !last => py.check_signals()?,
            Err(RingError::Timeout) => {
                return Err(RingTimeout::new_err(format!(
                    "ring {}: {what} timed out after {} s",
                    ring.path(),
                    timeout.unwrap_or(0.0)
                )))
            }
            r => return r.map_err(to_py),
        }
    }
}

/// A borrowed C-contiguous buffer of any Python object (bytes, bytearray, memoryview, numpy).
struct Buffer(ffi::Py_buffer);

impl Buffer {
    fn get(obj: &Bound<'_, PyAny>) -> PyResult<Buffer> {
        let mut view = std::mem::MaybeUninit::<ffi::Py_buffer>::zeroed();
        if unsafe { ffi::PyObject_GetBuffer(obj.as_ptr(), view.as_mut_ptr(), ffi::PyBUF_C_CONTIGUOUS) } != 0 {
            let cause = PyErr::fetch(obj.py());
            let kind = obj.get_type().name().map(|n| n.to_string()).unwrap_or_default();
            return Err(PyTypeError::new_err(format!(
                "ring records must be bytes, bytearray, memoryview or a C-contiguous numpy array, got {kind} ({cause})"
            )));
        }
        Ok(Buffer(unsafe { view.assume_init() }))
    }
    /// (address, length): plain numbers so the copy can run without the GIL.
    fn raw(&self) -> (usize, usize) {
        (self.0.buf as usize, self.0.len as usize)
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // Always dropped while attached to the interpreter (never inside `detach`).
        unsafe { ffi::PyBuffer_Release(&mut self.0) };
    }
}

fn copy_raw(src: usize, dst: usize, len: usize) {
    unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, len) };
}

/// Copies `len` bytes, releasing the GIL for large copies.
fn copy_maybe_detached(py: Python<'_>, src: usize, dst: usize, len: usize) {
    if len >= DETACH_COPY_BYTES {
        py.detach(|| copy_raw(src, dst, len));
    } else {
        copy_raw(src, dst, len);
    }
}

/// Copies a claimed record into a new bytes object (the caller acknowledges it).
fn copy_to_bytes<'py>(py: Python<'py>, claim: &Claim) -> PyResult<Bound<'py, PyBytes>> {
    let len = claim.len();
    let obj = unsafe { ffi::PyBytes_FromStringAndSize(std::ptr::null(), len as ffi::Py_ssize_t) };
    let bytes = unsafe { Bound::from_owned_ptr_or_err(py, obj)? }.cast_into::<PyBytes>()?;
    let dst = unsafe { ffi::PyBytes_AsString(bytes.as_ptr()) } as usize;
    copy_maybe_detached(py, claim.as_ptr() as usize, dst, len);
    Ok(bytes)
}

#[pyclass(module = "rollout_hpc._ring", name = "Ring", frozen)]
struct PyRing {
    ring: Ring,
}

#[pymethods]
impl PyRing {
    /// Creates a new segment file (owner-only, 0600). Fails if it exists.
    #[staticmethod]
    fn create(path: std::path::PathBuf, capacity: u64) -> PyResult<Self> {
        Ok(PyRing { ring: Ring::create(path, capacity).map_err(to_py)? })
    }

    #[staticmethod]
    fn open(path: std::path::PathBuf) -> PyResult<Self> {
        Ok(PyRing { ring: Ring::open(path).map_err(to_py)? })
    }

    #[staticmethod]
    fn open_or_create(path: std::path::PathBuf, capacity: u64) -> PyResult<Self> {
        Ok(PyRing { ring: Ring::open_or_create(path, capacity).map_err(to_py)? })
    }

    #[getter]
    fn path(&self) -> String {
        self.ring.path().to_string()
    }

    #[getter]
    fn capacity(&self) -> u64 {
        self.ring.capacity()
    }

    #[getter]
    fn max_record_len(&self) -> usize {
        self.ring.max_record_len()
    }

    #[getter]
    fn closed(&self) -> bool {
        self.ring.is_closed()
    }

    /// Pushes one record; returns its id.
    #[pyo3(signature = (data, timeout=None))]
    fn push(&self, py: Python<'_>, data: &Bound<'_, PyAny>, timeout: Option<f64>) -> PyResult<u64> {
        let buf = Buffer::get(data)?;
        let (src, len) = buf.raw();
        let mut slot = blocking(py, &self.ring, "push (waiting for space)", timeout, |t| self.ring.reserve(len, t))?;
        let dst = slot.data_mut().as_mut_ptr() as usize;
        copy_maybe_detached(py, src, dst, len);
        let id = slot.id();
        slot.commit().map_err(to_py)?;
        Ok(id)
    }

    fn try_push(&self, py: Python<'_>, data: &Bound<'_, PyAny>) -> PyResult<bool> {
        match self.push(py, data, Some(0.0)) {
            Ok(_) => Ok(true),
            Err(e) if e.is_instance_of::<RingTimeout>(py) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Pushes every item in order (reservations batched). Returns the number pushed; on timeout
    /// after some were pushed, raises RingTimeout whose message says how many.
    #[pyo3(signature = (items, timeout=None))]
    fn push_many(&self, py: Python<'_>, items: &Bound<'_, PyAny>, timeout: Option<f64>) -> PyResult<usize> {
        let bufs: Vec<Buffer> = items.try_iter()?.map(|o| Buffer::get(&o?)).collect::<PyResult<_>>()?;
        let raws: Vec<(usize, usize)> = bufs.iter().map(Buffer::raw).collect();
        let lens: Vec<usize> = raws.iter().map(|r| r.1).collect();
        let deadline = to_duration(timeout)?.map(|t| Instant::now() + t);
        let mut done = 0;
        while done < raws.len() {
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()).as_secs_f64());
            let reserved = blocking(py, &self.ring, "push_many (waiting for space)", left, |t| {
                let mut out = Vec::new();
                self.ring.reserve_many(&lens[done..], &mut out, t).map(|_| out)
            });
            let mut slots = match reserved {
                Ok(s) => s,
                Err(e) if done > 0 && e.is_instance_of::<RingTimeout>(py) => {
                    return Err(RingTimeout::new_err(format!(
                        "push_many timed out after pushing {done} of {} records",
                        raws.len()
                    )))
                }
                Err(e) => return Err(e),
            };
            let copies: Vec<(usize, usize, usize)> = slots
                .iter_mut()
                .zip(&raws[done..])
                .map(|(s, &(src, len))| (src, s.data_mut().as_mut_ptr() as usize, len))
                .collect();
            let total: usize = copies.iter().map(|c| c.2).sum();
            let copy_all = || copies.iter().for_each(|&(src, dst, len)| copy_raw(src, dst, len));
            if total >= DETACH_COPY_BYTES {
                py.detach(copy_all);
            } else {
                copy_all();
            }
            done += slots.len();
            self.ring.commit_many(&mut slots).map_err(to_py)?;
        }
        Ok(done)
    }

    /// Pops one record as bytes (copied, then acknowledged).
    #[pyo3(signature = (timeout=None))]
    fn pop<'py>(&self, py: Python<'py>, timeout: Option<f64>) -> PyResult<Bound<'py, PyBytes>> {
        let claim = blocking(py, &self.ring, "pop", timeout, |t| self.ring.claim(t))?;
        let bytes = copy_to_bytes(py, &claim)?;
        claim.ack();
        Ok(bytes)
    }

    fn try_pop<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyBytes>>> {
        match self.pop(py, Some(0.0)) {
            Ok(b) => Ok(Some(b)),
            Err(e) if e.is_instance_of::<RingTimeout>(py) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Waits (up to timeout) for one record, then takes up to max_n that are ready.
    #[pyo3(signature = (max_n, timeout=None))]
    fn pop_many<'py>(&self, py: Python<'py>, max_n: usize, timeout: Option<f64>) -> PyResult<Bound<'py, PyList>> {
        let claims = blocking(py, &self.ring, "pop_many", timeout, |t| {
            let mut out = Vec::new();
            self.ring.claim_many(max_n, t, &mut out).map(|_| out)
        })?;
        let mut claims = claims;
        let list = PyList::empty(py);
        for c in &claims {
            list.append(copy_to_bytes(py, c)?)?;
        }
        self.ring.ack_many(&mut claims).map_err(to_py)?;
        Ok(list)
    }

    /// Claims one record and exports it without copying; see RecordView.
    #[pyo3(signature = (timeout=None))]
    fn pop_view(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<RecordView> {
        let claim = blocking(py, &self.ring, "pop_view", timeout, |t| self.ring.claim(t))?;
        Ok(RecordView { id: claim.id(), len: claim.len(), claim: Mutex::new(Some(claim)), exports: BufferExports::default() })
    }

    /// Reserves a record of nbytes to be filled in place; see RecordWriter.
    #[pyo3(signature = (nbytes, timeout=None))]
    fn reserve(&self, py: Python<'_>, nbytes: usize, timeout: Option<f64>) -> PyResult<RecordWriter> {
        let slot = blocking(py, &self.ring, "reserve", timeout, |t| self.ring.reserve(nbytes, t))?;
        Ok(RecordWriter { id: slot.id(), len: slot.len(), slot: Mutex::new(Some(slot)), exports: BufferExports::default() })
    }

    fn close(&self) {
        self.ring.close()
    }

    fn unlink(&self) -> PyResult<()> {
        self.ring.unlink().map_err(to_py)
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.ring.stats();
        let d = PyDict::new(py);
        d.set_item("capacity", s.capacity)?;
        d.set_item("records_in", s.records_in)?;
        d.set_item("bytes_in", s.bytes_in)?;
        d.set_item("records_out", s.records_out)?;
        d.set_item("bytes_out", s.bytes_out)?;
        d.set_item("fill_bytes", s.fill_bytes)?;
        d.set_item("fill_records", s.fill_records)?;
        d.set_item("high_water_bytes", s.high_water_bytes)?;
        d.set_item("push_blocked_s", s.push_blocked_s)?;
        d.set_item("pop_blocked_s", s.pop_blocked_s)?;
        d.set_item("producers", s.producers)?;
        d.set_item("consumers", s.consumers)?;
        d.set_item("attached", s.attached)?;
        d.set_item("reclaimed_slots", s.reclaimed_slots)?;
        d.set_item("requeued_claims", s.requeued_claims)?;
        d.set_item("stolen_locks", s.stolen_locks)?;
        d.set_item("closed", s.closed)?;
        Ok(d)
    }
}

/// How many buffer-protocol views (memoryview, numpy array) of a record are still alive.
/// A record's shared memory must not be handed back (ack) or published (commit) under a live view.
#[derive(Default)]
struct BufferExports(AtomicUsize);

impl BufferExports {
    /// Fills `view` with the `len` bytes at `ptr`, owned by `owner`, and counts the export.
    ///
    /// # Safety
    /// `view` is the Py_buffer CPython passed to `__getbuffer__`; `ptr..ptr+len` stays valid
    /// while the export is counted.
    unsafe fn fill(
        &self,
        owner: &Bound<'_, PyAny>,
        view: *mut ffi::Py_buffer,
        ptr: *mut c_void,
        len: usize,
        readonly: bool,
        flags: c_int,
    ) -> PyResult<()> {
        let ro = c_int::from(readonly);
        if unsafe { ffi::PyBuffer_FillInfo(view, owner.as_ptr(), ptr, len as ffi::Py_ssize_t, ro, flags) } != 0 {
            return Err(PyErr::fetch(owner.py()));
        }
        self.0.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }

    /// A view filled by `fill` was released.
    fn release(&self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }

    /// BufferError("`record` is still referenced ...; `fix`") while any view is alive.
    fn ensure_unexported(&self, record: &str, fix: &str) -> PyResult<()> {
        if self.0.load(Ordering::SeqCst) > 0 {
            return Err(PyBufferError::new_err(format!(
                "{record} is still referenced by a memoryview or numpy array; {fix}"
            )));
        }
        Ok(())
    }
}

/// A claimed record in shared memory, exported read-only through the buffer protocol.
/// `ack()` releases it (refused while a memoryview/numpy array still uses it); if this
/// process dies first, another consumer receives the record again.
#[pyclass(module = "rollout_hpc._ring", frozen)]
struct RecordView {
    #[pyo3(get)]
    id: u64,
    len: usize,
    claim: Mutex<Option<Claim>>,
    exports: BufferExports,
}

#[pymethods]
impl RecordView {
    unsafe fn __getbuffer__(slf: Bound<'_, Self>, view: *mut ffi::Py_buffer, flags: c_int) -> PyResult<()> {
        let this = slf.get();
        let guard = this.claim.lock().unwrap();
        let Some(claim) = guard.as_ref() else {
            return Err(PyBufferError::new_err("this ring record was already acknowledged"));
        };
        if flags & ffi::PyBUF_WRITABLE != 0 {
            return Err(PyBufferError::new_err("ring record views are read-only; copy the data to modify it"));
        }
        let ptr = claim.as_ptr() as *mut c_void;
        unsafe { this.exports.fill(slf.as_any(), view, ptr, claim.len(), true, flags) }
    }

    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {
        self.exports.release();
    }

    fn __len__(&self) -> usize {
        self.len
    }

    /// Acknowledges the record: its space returns to producers.
    fn ack(&self) -> PyResult<()> {
        self.exports.ensure_unexported(
            "ring record",
            "copy what you keep (bytes(view) / np.array(arr)) before leaving the pop_view block",
        )?;
        if let Some(c) = self.claim.lock().unwrap().take() {
            c.ack();
        }
        Ok(())
    }
}

/// A reserved record in shared memory, exported writable through the buffer protocol.
/// `commit()` publishes it; `abandon()` (or garbage collection) makes consumers skip it.
#[pyclass(module = "rollout_hpc._ring", frozen)]
struct RecordWriter {
    #[pyo3(get)]
    id: u64,
    len: usize,
    slot: Mutex<Option<WriteSlot>>,
    exports: BufferExports,
}

#[pymethods]
impl RecordWriter {
    unsafe fn __getbuffer__(slf: Bound<'_, Self>, view: *mut ffi::Py_buffer, flags: c_int) -> PyResult<()> {
        let this = slf.get();
        let mut guard = this.slot.lock().unwrap();
        let Some(slot) = guard.as_mut() else {
            return Err(PyBufferError::new_err("this ring record was already committed or abandoned"));
        };
        let ptr = slot.data_mut().as_mut_ptr() as *mut c_void;
        unsafe { this.exports.fill(slf.as_any(), view, ptr, slot.len(), false, flags) }
    }

    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {
        self.exports.release();
    }

    fn __len__(&self) -> usize {
        self.len
    }

    fn commit(&self) -> PyResult<()> {
        self.exports.ensure_unexported("reserved ring record", "release it before commit")?;
        match self.slot.lock().unwrap().take() {
            Some(s) => s.commit().map_err(to_py),
            None => Err(PyRingError::new_err("ring record was already committed or abandoned")),
        }
    }

    fn abandon(&self) {
        drop(self.slot.lock().unwrap().take());
    }
}

#[pymodule]
fn _ring(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("LAYOUT_VERSION", crate::LAYOUT_VERSION)?;
    m.add_class::<PyRing>()?;
    m.add_class::<RecordView>()?;
    m.add_class::<RecordWriter>()?;
    m.add("RingError", py.get_type::<PyRingError>())?;
    m.add("RingTimeout", py.get_type::<RingTimeout>())?;
    m.add("RingClosed", py.get_type::<RingClosed>())?;
    m.add("RecordTooLarge", py.get_type::<RecordTooLarge>())?;
    Ok(())
}
