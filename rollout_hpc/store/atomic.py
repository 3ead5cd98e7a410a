"""Crash-safe publication of files: write a temporary sibling, fsync it, rename, fsync the directory.

A reader therefore sees either the previous state or the complete new file,
never a partial one. Temporary names carry `.tmp-<pid>` so a crashed writer's
leftovers are recognisable and never match the published name patterns.
"""

from __future__ import annotations

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
    tmp.write_text(text)
    publish(tmp, final)
