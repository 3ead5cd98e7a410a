//! The shared-memory segment: file creation (0600, published atomically), mapping,
//! and the layout of its first page (static header + control block).
//!
//! ```text
//! offset 0     StaticHeader   magic, layout version, capacity, creation time, CRC32 of these
//! offset 64    Control        lock, head/read/tail cursors, wait words, statistics, attach table
//! offset 4096  data area      `capacity` bytes of records (see ring.rs)
//! ```
//! All of the control block and record headers are atomics: zero bytes are a valid empty ring.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::atomic::{AtomicU32, AtomicU64};

use crate::error::{Result, RingError};
use crate::LAYOUT_VERSION;

pub const MAGIC: [u8; 8] = *b"RHRING\x00\x01";
/// The data area starts here; everything before is header and control block.
pub const DATA_OFFSET: usize = 4096;
const CONTROL_OFFSET: usize = 64;
/// Records start on multiples of this; a record header is exactly this long.
pub const ALIGN: u64 = 32;
/// Attach-table size: processes beyond this still work, they just are not counted in stats.
pub const ATTACH_SLOTS: usize = 62;

#[repr(C)]
pub struct StaticHeader {
    pub magic: [u8; 8],
    pub layout_version: u32,
    pub data_offset: u32,
    pub capacity: u64,
    pub created_unix_ns: u64,
    pub checksum: u32,
}

impl StaticHeader {
    fn bytes_to_sum(&self) -> [u8; 32] {
        let mut b = [0u8; 32];
        b[..8].copy_from_slice(&self.magic);
        b[8..12].copy_from_slice(&self.layout_version.to_le_bytes());
        b[12..16].copy_from_slice(&self.data_offset.to_le_bytes());
        b[16..24].copy_from_slice(&self.capacity.to_le_bytes());
        b[24..32].copy_from_slice(&self.created_unix_ns.to_le_bytes());
        b
    }
    fn compute_checksum(&self) -> u32 {
        crc32fast::hash(&self.bytes_to_sum())
    }
}

/// One cache line: keeps counters that different processes hammer apart.
#[repr(C, align(64))]
pub struct Line<T>(pub T);

#[repr(C)]
pub struct Cursor {
    pub head: AtomicU64,
    pub next_id: AtomicU64,
}

/// A futex word (`seq`, bumped to wake sleepers), a bitmask of attach slots sleeping on it,
/// and (space only) how much free space, in ALIGN units, sleepers want before being woken.
#[repr(C)]
pub struct WaitWord {
    pub seq: AtomicU32,
    pub want: AtomicU32,
    pub sleepers: AtomicU64,
}

#[repr(C)]
pub struct Counters {
    pub records_in: AtomicU64,
    pub bytes_in: AtomicU64,
    pub records_out: AtomicU64,
    pub bytes_out: AtomicU64,
}

#[repr(C)]
pub struct Misc {
    pub high_water: AtomicU64,
    pub push_blocked_ns: AtomicU64,
    pub pop_blocked_ns: AtomicU64,
    pub reclaimed_slots: AtomicU64,
    pub requeued_claims: AtomicU64,
    pub stolen_locks: AtomicU64,
}

/// A process attached to the ring: its pid and roles (bit 0 producer, bit 1 consumer).
#[repr(C)]
pub struct AttachSlot {
    pub pid: AtomicU32,
    pub roles: AtomicU32,
}

#[repr(C)]
pub struct Control {
    /// Reservation lock: pid of the holder, 0 when free. Stolen from a dead holder.
    pub lock: Line<AtomicU32>,
    /// Producers' end (only written under the lock) and the next record id.
    pub cursor: Line<Cursor>,
    /// Consumers' end: records before it are claimed, done or skipped.
    pub read: Line<AtomicU64>,
    /// Space before it is free for producers again.
    pub tail: Line<AtomicU64>,
    pub data_wait: Line<WaitWord>,
    pub space_wait: Line<WaitWord>,
    pub closed: Line<AtomicU32>,
    pub counters_in: Line<[AtomicU64; 2]>,
    pub counters_out: Line<[AtomicU64; 2]>,
    pub misc: Line<Misc>,
    pub attach: [AttachSlot; ATTACH_SLOTS],
}

const _: () = assert!(CONTROL_OFFSET + std::mem::size_of::<Control>() <= DATA_OFFSET);
const _: () = assert!(std::mem::size_of::<StaticHeader>() <= CONTROL_OFFSET);

/// A mapped segment file. Unmapped on drop.
pub struct Segment {
    base: *mut u8,
    map_len: usize,
    pub capacity: u64,
    pub path: String,
}

// The mapping is plain shared memory accessed through atomics; it may be used from any thread.
unsafe impl Send for Segment {}
unsafe impl Sync for Segment {}

fn io_err(path: &str, op: &'static str) -> RingError {
    RingError::Io { path: path.to_string(), op, source: std::io::Error::last_os_error() }
}

fn bad(path: &str, what: impl Into<String>) -> RingError {
    RingError::BadHeader { path: path.to_string(), what: what.into() }
}

fn c_path(path: &Path) -> Result<CString> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| RingError::Invalid(format!("ring path {path:?} contains a NUL byte")))
}

/// Capacities are rounded up to the record alignment.
pub fn round_capacity(capacity: u64) -> u64 {
    capacity.div_ceil(ALIGN) * ALIGN
}

struct Fd(libc::c_int);
impl Drop for Fd {
    fn drop(&mut self) {
        unsafe { libc::close(self.0) };
    }
}

fn map(fd: &Fd, len: usize, path: &str) -> Result<*mut u8> {
    let p =
        unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd.0, 0) };
    if p == libc::MAP_FAILED {
        return Err(io_err(path, "mmap"));
    }
    Ok(p as *mut u8)
}

impl Segment {
    /// Creates the segment file. It is built under a temporary name and published with
    /// link(2), so nobody ever opens a half-initialised header, and an existing file is never replaced.
    pub fn create(path: &Path, capacity: u64) -> Result<Segment> {
        let spath = path.display().to_string();
        if capacity < 2 * ALIGN {
            return Err(RingError::Invalid(format!(
                "ring {spath}: capacity {capacity} is too small (at least {} bytes)",
                2 * ALIGN
            )));
        }
        let capacity = round_capacity(capacity);
        let map_len = DATA_OFFSET as u64 + capacity;
        if map_len > isize::MAX as u64 {
            return Err(RingError::Invalid(format!("ring {spath}: capacity {capacity} is too large")));
        }
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        let tmp = format!("{}.{}.{}.tmp", spath, std::process::id(), now);
        let ctmp = c_path(Path::new(&tmp))?;
        let fd =
            unsafe { libc::open(ctmp.as_ptr(), libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | libc::O_CLOEXEC, 0o600) };
        if fd < 0 {
            return Err(io_err(&spath, "create"));
        }
        let fd = Fd(fd);
        let cleanup = |e: RingError| {
            unsafe { libc::unlink(ctmp.as_ptr()) };
            e
        };
        // The umask can only remove bits; set 0600 explicitly anyway.
        if unsafe { libc::fchmod(fd.0, 0o600) } != 0 {
            return Err(cleanup(io_err(&spath, "fchmod")));
        }
        // Reserve the pages now: a full /dev/shm must fail here, not SIGBUS on a later write.
        let rc = unsafe { libc::posix_fallocate(fd.0, 0, map_len as libc::off_t) };
        if rc != 0 {
            return Err(cleanup(RingError::Io {
                path: spath.clone(),
                op: "allocate (is the ring directory full? /dev/shm is RAM-backed)",
                source: std::io::Error::from_raw_os_error(rc),
            }));
        }
        let base = map(&fd, map_len as usize, &spath).map_err(cleanup)?;
        let seg = Segment { base, map_len: map_len as usize, capacity, path: spath.clone() };
        let mut hdr = StaticHeader {
            magic: MAGIC,
            layout_version: LAYOUT_VERSION,
            data_offset: DATA_OFFSET as u32,
            capacity,
            created_unix_ns: now,
            checksum: 0,
        };
        hdr.checksum = hdr.compute_checksum();
        unsafe { std::ptr::write(base as *mut StaticHeader, hdr) };
        let cpath = c_path(path)?;
        if unsafe { libc::link(ctmp.as_ptr(), cpath.as_ptr()) } != 0 {
            let err = std::io::Error::last_os_error();
            unsafe { libc::unlink(ctmp.as_ptr()) };
            if err.raw_os_error() == Some(libc::EEXIST) {
                return Err(RingError::Exists { path: spath });
            }
            return Err(RingError::Io { path: spath, op: "publish (link)", source: err });
        }
        unsafe { libc::unlink(ctmp.as_ptr()) };
        Ok(seg)
    }

    /// Opens and validates an existing segment file.
    pub fn open(path: &Path) -> Result<Segment> {
        let spath = path.display().to_string();
        let cpath = c_path(path)?;
        let fd = unsafe { libc::open(cpath.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
        if fd < 0 {
            return Err(io_err(&spath, "open"));
        }
        let fd = Fd(fd);
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        if unsafe { libc::fstat(fd.0, &mut st) } != 0 {
            return Err(io_err(&spath, "stat"));
        }
        if (st.st_mode & libc::S_IFMT) != libc::S_IFREG {
            return Err(bad(&spath, "not a regular file"));
        }
        let size = st.st_size as u64;
        if size < DATA_OFFSET as u64 {
            return Err(bad(&spath, format!("file is {size} bytes, shorter than the {DATA_OFFSET}-byte header")));
        }
        // Validate the header from a plain read first, so a bogus capacity never sizes a mapping.
        let mut raw = [0u8; std::mem::size_of::<StaticHeader>()];
        let n = unsafe { libc::pread(fd.0, raw.as_mut_ptr() as *mut libc::c_void, raw.len(), 0) };
        if n != raw.len() as isize {
            return Err(io_err(&spath, "read header"));
        }
        let hdr: StaticHeader = unsafe { std::ptr::read_unaligned(raw.as_ptr() as *const StaticHeader) };
        if hdr.magic != MAGIC {
            return Err(bad(&spath, format!("bad magic {:02x?} (expected {:02x?})", hdr.magic, MAGIC)));
        }
        if hdr.layout_version != LAYOUT_VERSION {
            return Err(bad(
                &spath,
                format!("layout version {} (this build reads version {LAYOUT_VERSION})", hdr.layout_version),
            ));
        }
        if hdr.checksum != hdr.compute_checksum() {
            return Err(bad(&spath, "header checksum mismatch (header damaged)"));
        }
        if hdr.data_offset as usize != DATA_OFFSET {
            return Err(bad(&spath, format!("data offset {} (expected {DATA_OFFSET})", hdr.data_offset)));
        }
        let cap = hdr.capacity;
        if cap < 2 * ALIGN || !cap.is_multiple_of(ALIGN) {
            return Err(bad(&spath, format!("capacity {cap} is not a positive multiple of {ALIGN}")));
        }
        if cap.checked_add(DATA_OFFSET as u64) != Some(size) {
            return Err(bad(
                &spath,
                format!(
                    "file is {size} bytes but the header says {} (truncated or extended)",
                    cap + DATA_OFFSET as u64
                ),
            ));
        }
        let base = map(&fd, size as usize, &spath)?;
        Ok(Segment { base, map_len: size as usize, capacity: cap, path: spath })
    }

    pub fn control(&self) -> &Control {
        unsafe { &*(self.base.add(CONTROL_OFFSET) as *const Control) }
    }

    /// Start of the data area (`capacity` bytes).
    pub fn data(&self) -> *mut u8 {
        unsafe { self.base.add(DATA_OFFSET) }
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        unsafe { libc::munmap(self.base as *mut libc::c_void, self.map_len) };
    }
}
