"""runtime/heap.py on this machine's glibc: a process that frees a step's worth of small blocks and allocates them
again takes page faults every round by default, and next to none once keep_freed_memory() ran; a user's own
allocator settings are left alone."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rollout_hpc.runtime import heap

ROUNDS = """
import ctypes, resource, sys
from rollout_hpc.runtime import heap
kept = heap.keep_freed_memory() if sys.argv[1] == "keep" else None
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def step():  # a step's tensors: 200 blocks of 100 KiB (below the first mmap threshold: heap memory), then freed
    blocks = [ctypes.create_string_buffer(100 << 10) for _ in range(200)]
    del blocks
step()
before = faults()
for _ in range(20):
    step()
print(kept, (faults() - before) / 20)
"""


def _faults_per_round(mode: str, env: dict | None = None) -> tuple[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", ROUNDS, mode], capture_output=True, text=True, check=True, env=env
    ).stdout.split()
    return out[0], float(out[1])


@pytest.mark.skipif(not heap.os.confstr("CS_GNU_LIBC_VERSION"), reason="glibc's malloc only")
def test_a_step_freed_and_allocated_again_faults_only_without_it():
    _, default = _faults_per_round("default")
    kept, tuned = _faults_per_round("keep")
    assert kept == "True"
    # 20 MiB a round is ~5,000 pages: the default trims it at each round's end and faults it back in
    assert default > 1000, default
    assert tuned < 50, tuned


def test_a_users_allocator_settings_stand(monkeypatch):
    assert heap.user_has_allocator_settings({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"})
    assert heap.user_has_allocator_settings({"MALLOC_ARENA_MAX": "2", "MALLOC_TRIM_THRESHOLD_": "0"})
    assert heap.user_has_allocator_settings({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"})
    assert not heap.user_has_allocator_settings({"GLIBC_TUNABLES": "glibc.pthread.rseq=0", "MALLOC_ARENA_MAX": "2"})
    import os

    env = {**os.environ, "GLIBC_TUNABLES": "glibc.malloc.trim_threshold=131072"}
    kept, faults = _faults_per_round("keep", env)
    assert kept == "False" and faults > 1000, (kept, faults)
