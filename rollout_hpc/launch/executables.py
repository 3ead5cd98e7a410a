"""Finding the external commands a launcher runs (mpirun, sbatch) before anything is created."""

from __future__ import annotations

import shutil

from rollout_hpc.errors import UserError


def require_executable(name: str, missing: str) -> str:
    """Full path of `name` on PATH; a UserError saying `missing` (what needs it and how to get it) if absent."""
    path = shutil.which(name)
    if path is None:
        raise UserError(missing)
    return path
