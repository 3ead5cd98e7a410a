"""The environment a launcher hands to mpirun or sbatch, without what an MPI process leaves in its own.

A process that has initialised MPI, even alone (mpi4py in a notebook or a test session: an Open MPI "singleton"),
carries OMPI_MCA_ess=singleton, PMIX_SERVER_URI*, OMPI_COMM_WORLD_* and the like in its environment, and its
children inherit them. An mpirun started with them takes itself for a rank of that job and exits with code 1
without printing a word; a rank that srun starts with them looks for the wrong PMIx server. These variables
describe the parent's MPI job, never the one about to start, so the launchers leave them out. A user's own
settings (OMPI_MCA_btl, OMPI_MCA_pml, ...) pass through.

`placement_env`: what colocated ranks add (how their OpenMP workers wait), under either launcher.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from rollout_hpc.config import Config

# What mpirun/orted and the PMIx server set for the processes of a job (Open MPI 4 and 5, PMIx, Slurm's PMI-2).
RANK_PREFIXES = (
    "PMIX_",
    "PMI_",
    "ORTE_",
    "PRTE_",
    "OMPI_COMM_WORLD_",
    "OMPI_APP_CTX_",
    "OMPI_MCA_orte_",
    "OMPI_MCA_ess",
    "OMPI_MCA_pmix",
)
RANK_NAMES = frozenset(
    {
        "OMPI_COMMAND",
        "OMPI_ARGV",
        "OMPI_FILE_LOCATION",
        "OMPI_FIRST_RANKS",
        "OMPI_NUM_APP_CTX",
        "OMPI_UNIVERSE_SIZE",
        "OMPI_MCA_initial_wdir",
        "OMPI_MCA_shmem_RUNTIME_QUERY_hint",
    }
)


def inherited_rank_vars(env: Mapping[str, str]) -> list[str]:
    """The names in env that belong to an MPI job already running (this process's or a parent's)."""
    return sorted(name for name in env if name in RANK_NAMES or name.startswith(RANK_PREFIXES))


def fresh_job_env(env: Mapping[str, str]) -> dict[str, str]:
    """env without the variables of an MPI job already running: what a new, separate job should start with."""
    drop = set(inherited_rank_vars(env))
    return {name: value for name, value in env.items() if name not in drop}


# OpenMP waiting for colocated ranks (below). 50,000 spins: about a millisecond, then the worker sleeps.
COLOCATED_SPINCOUNT = 50_000
_WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


def placement_env(cfg: Config) -> dict[str, str]:
    """Colocated ranks take turns on the same cores, each with all of them. libgomp's default has an OpenMP worker
    spin ~300,000 rounds after each parallel region: a rank that just finished its phase, or that ran one small op
    while it waited, took a core from the rank whose turn it was (measured here: 0.13 s a step, or 0.40-0.45 s
    whenever the spinning overlapped). Sleeping at once (OMP_WAIT_POLICY=PASSIVE) avoided that but made every op a
    futex wake-up: the trainer's step 20-30 % slower in a single process. A short spin keeps the workers awake
    between the ops of a phase and frees the cores within about a millisecond of its end: colocated steps 0.142 s
    against 0.164 s with PASSIVE (medians of 4 alternating runs of 100 steps, tools/bench_e2e.py's task);
    the benchmark itself, 5 rounds each: 1041 [913-1163] against 996 [942-1031] samples/s. Intel's
    OpenMP runtime reads KMP_BLOCKTIME (ms) instead. A user's own setting of any of these wins. The profiling job
    measures the all-cores speed-up that colocated ranks get under the same setting."""
    if any(v in os.environ for v in _WAIT_VARIABLES) or (cfg.placement != "colocated" and cfg.run.program != "profile"):
        return {}
    return {"GOMP_SPINCOUNT": str(COLOCATED_SPINCOUNT), "KMP_BLOCKTIME": "1"}
