//! `rollout_hpc._ring`: the PyO3 face of the ring. rollout_hpc/exchange/ring.py wraps it;
//! rollout_hpc/_ring.pyi types it.
//!
//! A thin layer: it converts arguments (buffers, timeouts) and results (bytes, lists, dicts,
//! exceptions) and calls the core once per method. Timeouts, batching and waiting live in the
//! core; `PyHost` is how the core releases the GIL while it waits or copies a lot, and runs
//! Python signal handlers every `wait::CHECK_EVERY` while blocked (Ctrl-C works). Pushes read
//! any C-contiguous buffer in place; `pop_view` and `reserve` export the record's bytes in
//! shared memory through the buffer protocol (zero copy).

use std::os::raw::{c_int, c_void};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pyo3::exceptions::{PyBufferError, PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyMemoryView, PyTuple};

use crate::wait::Host;
use crate::{Claim, Ring, RingError, WriteSlot};

/// The exceptions, named as Python sees them (`rollout_hpc._ring.RingError`, ...), so that
/// tracebacks read well and they pickle (to cross a multiprocessing boundary).
mod exceptions {
    use pyo3::create_exception;
    use pyo3::exceptions::PyException;

    create_exception!(
        rollout_hpc._ring,
        RingError,
        PyException,
        "Any ring failure; the message names the segment file and the fix."
    );
    create_exception!(
        rollout_hpc._ring,
        RingTimeout,
        RingError,
        "Nothing could be pushed or popped before the timeout."
    );
    create_exception!(rollout_hpc._ring, RingClosed, RingError, "The ring was closed (and, for pops, is drained).");
    create_exception!(
        rollout_hpc._ring,
        RecordTooLarge,
        RingError,
        "The record is larger than the ring can ever hold."
    );
}
use exceptions::{RecordTooLarge, RingClosed, RingError as PyRingError, RingTimeout};

/// The core's waits and long copies run without the GIL; signal handlers run while blocked.
struct PyHost;

impl Host for PyHost {
    fn unlocked(&self, f: &mut (dyn FnMut() + Send)) {
        // Called with the GIL held (the core's entry points are only called from #[pymethods]).
        Python::attach(|py| py.detach(f));
    }
    fn interrupted(&self) -> crate::Result<()> {
        Python::attach(|py| py.check_signals()).map_err(|e| RingError::Host(Box::new(e)))
    }
}

fn to_py(e: RingError) -> PyErr {
    let msg = e.to_string();
    match e {
        RingError::Timeout => RingTimeout::new_err(msg),
        RingError::Closed => RingClosed::new_err(msg),
        RingError::TooLarge { .. } => RecordTooLarge::new_err(msg),
        RingError::Invalid(_) => PyValueError::new_err(msg),
        RingError::Host(e) => match e.downcast::<PyErr>() {
            Ok(e) => *e,
            Err(e) => PyRingError::new_err(e.to_string()),
        },
        _ => PyRingError::new_err(msg),
    }
}

fn to_duration(timeout: Option<f64>) -> PyResult<Option<Duration>> {
    match timeout {
        None => Ok(None),
        Some(t) if t.is_nan() || t < 0.0 => {
            Err(PyValueError::new_err(format!("timeout must be >= 0 or None, got {t}")))
        }
        Some(t) => Ok(Some(Duration::from_secs_f64(t.min(1e9)))),
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

    /// The bytes. (Another Python thread writing to the exporter meanwhile is the caller's race,
    /// as for any buffer consumer.)
    fn bytes(&self) -> &[u8] {
        if self.0.len == 0 {
            return &[];
        }
        // Valid while the buffer is held: PyBUF_C_CONTIGUOUS gives `len` contiguous bytes at `buf`.
        unsafe { std::slice::from_raw_parts(self.0.buf as *const u8, self.0.len as usize) }
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // Always dropped while attached to the interpreter.
        unsafe { ffi::PyBuffer_Release(&mut self.0) };
    }
}

/// A new, uninitialised bytes object for the core to pop a record into.
struct NewBytes<'py> {
    obj: Bound<'py, PyBytes>,
    len: usize,
}

impl<'py> NewBytes<'py> {
    fn alloc(py: Python<'py>, len: usize) -> crate::Result<NewBytes<'py>> {
        let obj = unsafe { ffi::PyBytes_FromStringAndSize(std::ptr::null(), len as ffi::Py_ssize_t) };
        unsafe { Bound::from_owned_ptr_or_err(py, obj) }
            .and_then(|b| Ok(b.cast_into::<PyBytes>()?))
            .map(|obj| NewBytes { obj, len })
            .map_err(|e| RingError::Host(Box::new(e)))
    }
}

impl AsMut<[u8]> for NewBytes<'_> {
    fn as_mut(&mut self) -> &mut [u8] {
        // A bytes object nobody else has seen yet: ours to fill.
        unsafe { std::slice::from_raw_parts_mut(ffi::PyBytes_AsString(self.obj.as_ptr()) as *mut u8, self.len) }
    }
}

#[pyclass(module = "rollout_hpc._ring", name = "Ring", frozen)]
struct PyRing {
    ring: Ring,
}

impl PyRing {
    fn new(ring: crate::Result<Ring>) -> PyResult<Self> {
        Ok(PyRing { ring: ring.map_err(to_py)?.with_host(Arc::new(PyHost)) })
    }

    /// Converts a core error; a timeout says which call timed out, after how long.
    fn err(&self, what: &'static str, timeout: Option<f64>) -> impl FnOnce(RingError) -> PyErr + '_ {
        move |e| match e {
            RingError::Timeout => RingTimeout::new_err(format!(
                "ring {}: {what} timed out after {} s",
                self.ring.path(),
                timeout.unwrap_or(0.0)
            )),
            e => to_py(e),
        }
    }
}

#[pymethods]
impl PyRing {
    /// Creates a new segment file (owner-only, 0600). Fails if it exists.
    #[staticmethod]
    fn create(path: std::path::PathBuf, capacity: u64) -> PyResult<Self> {
        PyRing::new(Ring::create(path, capacity))
    }

    #[staticmethod]
    fn open(path: std::path::PathBuf) -> PyResult<Self> {
        PyRing::new(Ring::open(path))
    }

    #[staticmethod]
    fn open_or_create(path: std::path::PathBuf, capacity: u64) -> PyResult<Self> {
        PyRing::new(Ring::open_or_create(path, capacity))
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
    fn push(&self, data: &Bound<'_, PyAny>, timeout: Option<f64>) -> PyResult<u64> {
        let buf = Buffer::get(data)?;
        self.ring.push(buf.bytes(), to_duration(timeout)?).map_err(self.err("push (waiting for space)", timeout))
    }

    fn try_push(&self, data: &Bound<'_, PyAny>) -> PyResult<bool> {
        self.ring.try_push(Buffer::get(data)?.bytes()).map_err(to_py)
    }

    /// Pushes every item in order (reservations batched). Returns the number pushed; on timeout
    /// after some were pushed, raises RingTimeout whose message says how many.
    #[pyo3(signature = (items, timeout=None))]
    fn push_many(&self, items: &Bound<'_, PyAny>, timeout: Option<f64>) -> PyResult<usize> {
        let bufs: Vec<Buffer> = items.try_iter()?.map(|o| Buffer::get(&o?)).collect::<PyResult<_>>()?;
        let data: Vec<&[u8]> = bufs.iter().map(Buffer::bytes).collect();
        let done = self
            .ring
            .push_many(&data, to_duration(timeout)?)
            .map_err(self.err("push_many (waiting for space)", timeout))?;
        if done < data.len() {
            return Err(RingTimeout::new_err(format!(
                "push_many timed out after pushing {done} of {} records",
                data.len()
            )));
        }
        Ok(done)
    }

    /// Pops one record as bytes (copied, then acknowledged).
    #[pyo3(signature = (timeout=None))]
    fn pop<'py>(&self, py: Python<'py>, timeout: Option<f64>) -> PyResult<Bound<'py, PyBytes>> {
        let b = self
            .ring
            .pop_into(to_duration(timeout)?, |len| NewBytes::alloc(py, len))
            .map_err(self.err("pop", timeout))?;
        Ok(b.obj)
    }

    fn try_pop<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyBytes>>> {
        match self.ring.pop_into(Some(Duration::ZERO), |len| NewBytes::alloc(py, len)) {
            Ok(b) => Ok(Some(b.obj)),
            Err(RingError::Timeout) => Ok(None),
            Err(e) => Err(to_py(e)),
        }
    }

    /// Waits (up to timeout) for one record, then takes up to max_n that are ready.
    #[pyo3(signature = (max_n, timeout=None))]
    fn pop_many<'py>(&self, py: Python<'py>, max_n: usize, timeout: Option<f64>) -> PyResult<Bound<'py, PyList>> {
        let mut out = Vec::new();
        self.ring
            .pop_many_into(max_n, to_duration(timeout)?, |len| NewBytes::alloc(py, len), &mut out)
            .map_err(self.err("pop_many", timeout))?;
        PyList::new(py, out.into_iter().map(|b| b.obj))
    }

    /// Claims one record and exports it without copying; see RecordView.
    #[pyo3(signature = (timeout=None))]
    fn pop_view(&self, timeout: Option<f64>) -> PyResult<RecordView> {
        let claim = self.ring.claim(to_duration(timeout)?).map_err(self.err("pop_view", timeout))?;
        Ok(RecordView {
            id: claim.id(),
            len: claim.len(),
            claim: Mutex::new(Some(claim)),
            exports: BufferExports::default(),
            entered: Mutex::new(None),
        })
    }

    /// Reserves a record of nbytes to be filled in place; see RecordWriter.
    #[pyo3(signature = (nbytes, timeout=None))]
    fn reserve(&self, nbytes: usize, timeout: Option<f64>) -> PyResult<RecordWriter> {
        let slot = self.ring.reserve(nbytes, to_duration(timeout)?).map_err(self.err("reserve", timeout))?;
        Ok(RecordWriter {
            id: slot.id(),
            len: slot.len(),
            slot: Mutex::new(Some(slot)),
            exports: BufferExports::default(),
        })
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
/// process dies first, another consumer receives the record again. Also a context manager:
/// `with ring.pop_view() as view` gets a memoryview on it, released and acknowledged on exit
/// (in Rust: a Python generator-based context manager cost 0.8 us a record, 7x a 64 B pop).
#[pyclass(module = "rollout_hpc._ring", frozen)]
struct RecordView {
    #[pyo3(get)]
    id: u64,
    len: usize,
    claim: Mutex<Option<Claim>>,
    exports: BufferExports,
    entered: Mutex<Option<Py<PyAny>>>, // the memoryview __enter__ handed out
}

const VIEW_KEPT: &str = "a numpy array or memoryview made from the pop_view buffer is still alive at the end of the \
                         with-block; copy what you keep (bytes(view), np.array(arr)) inside the block";

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

    fn __enter__<'py>(slf: Bound<'py, Self>) -> PyResult<Bound<'py, PyMemoryView>> {
        let view = PyMemoryView::from(slf.as_any())?;
        *slf.get().entered.lock().unwrap() = Some(view.clone().into_any().unbind());
        Ok(view)
    }

    /// Releases the memoryview of __enter__, then acknowledges (also when the block raised).
    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, PyTuple>) -> PyResult<bool> {
        let entered = self.entered.lock().unwrap().take();
        let kept = |e: PyErr| if e.is_instance_of::<PyBufferError>(py) { PyRingError::new_err(VIEW_KEPT) } else { e };
        if let Some(view) = entered {
            view.call_method0(py, "release").map_err(kept)?;
        }
        self.ack().map_err(kept)?;
        Ok(false)
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
