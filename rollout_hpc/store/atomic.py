"""Crash-safe publication of files: write a temporary sibling, fsync it, rename, fsync the directory.

A reader therefore sees either the previous state or the complete new file,
never a partial one. Temporary names carry `.tmp-<pid>` so a crashed writer's
leftovers are recognisable and never match the published name patterns.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path


def temp_path(final: Path) -> Path:
    return final.with_name(f"{final.name}.tmp-{os.getpid()}")


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp: Path, final: Path) -> None:
    """Make the fully written `tmp` visible as `final` atomically and durably."""
    fsync_file(tmp)
    os.replace(tmp, final)
    fsync_dir(final.parent)


def write_text_atomic(final: Path, text: str) -> None:
    tmp = temp_path(final)
    try:
        tmp.write_text(text)
        publish(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk must not leave a 0-byte temp file behind
        raise


# --- full file systems ----------------------------------------------------------------------------------------


def is_disk_full(exc: BaseException) -> bool:
    """Whether an error (OSError, or h5py's, which names errno 28 only in its text) is a full disk or quota."""
    if not isinstance(exc, OSError):
        return False
    return exc.errno in (errno.ENOSPC, errno.EDQUOT) or any(
        text in str(exc) for text in ("No space left on device", "Disk quota exceeded", "errno = 28", "errno = 122")
    )


def mount_point(path: Path) -> Path:
    """The mount point of the file system holding `path` (or its nearest existing ancestor)."""
    path = Path(os.path.abspath(path))
    while not path.exists():
        path = path.parent
    while not os.path.ismount(path):
        path = path.parent
    return path


def fs_type(mount: Path) -> str:
    """The file system type of a mount point (tmpfs, ext4, lustre, gpfs ...), from /proc/mounts; '' if unknown."""
    try:
        with open("/proc/mounts") as mounts:
            found = [line.split()[2] for line in mounts if line.split()[1:2] == [str(mount)]]
    except OSError:
        return ""
    return found[-1] if found else ""


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged writer may still write on the file system of `path`."""
    st = os.statvfs(mount_point(path))
    return st.f_bavail * st.f_frsize


def human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}" if abs(n) < 10 else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def space_note(path: Path) -> str:
    """'file system /scratch (lustre): 1.2 GB free of 100.0 TB' for the file system of `path`."""
    mount = mount_point(path)
    st = os.statvfs(mount)
    kind = fs_type(mount)
    return (
        f"file system {mount}{f' ({kind})' if kind else ''}: {human(st.f_bavail * st.f_frsize)} free "
        f"of {human(st.f_blocks * st.f_frsize)}"
    )
