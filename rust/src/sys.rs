//! The few Linux primitives the ring needs: shared futexes and process liveness.

use std::sync::atomic::AtomicU32;
use std::time::Duration;

/// Sleeps while `*word == expected`, at most `timeout`. Shared (not PRIVATE) so it
/// works across processes mapping the same file. Spurious returns are fine: callers loop.
pub fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts =
        libc::timespec { tv_sec: timeout.as_secs() as libc::time_t, tv_nsec: timeout.subsec_nanos() as libc::c_long };
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word as *const AtomicU32,
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

/// Wakes every process sleeping on `word`.
pub fn futex_wake_all(word: &AtomicU32) {
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word as *const AtomicU32,
            libc::FUTEX_WAKE,
            i32::MAX,
            std::ptr::null::<libc::timespec>(),
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

pub fn current_pid() -> u32 {
    std::process::id()
}

/// True while `pid` names a running (not zombie) process. A SIGKILLed child stays a
/// zombie until its parent reaps it; it must already count as dead, so /proc is read too.
pub fn process_alive(pid: u32) -> bool {
    if pid == 0 || pid > i32::MAX as u32 {
        return false;
    }
    let rc = unsafe { libc::kill(pid as libc::pid_t, 0) };
    if rc != 0 && std::io::Error::last_os_error().raw_os_error() != Some(libc::EPERM) {
        return false;
    }
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // "pid (comm) S ..." — comm may contain spaces and parentheses, so split at the last ')'.
        Ok(stat) => match stat.rfind(')').and_then(|i| stat[i + 1..].split_whitespace().next()) {
            Some(state) => state != "Z" && state != "X",
            None => true,
        },
        // No /proc entry: gone by now, unless there is no procfs at all (then trust kill).
        Err(_) => !std::path::Path::new("/proc/self/stat").exists(),
    }
}
