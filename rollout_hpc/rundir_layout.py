"""The run directory's contract: the names of what a run keeps on disk, and the exit codes its ranks give
the batch script. Every layer uses these (the launcher writes the directory, the ranks read and fill it, the
analysis reads it), so they live at the bottom of the package and import nothing of ours.

    RUN_DIR/
      config.yaml            CONFIG_SNAPSHOT: the user's file, byte for byte (the original may change)
      config.resolved.yaml   RESOLVED_CONFIG: the full validated config after --set; what every rank reads
      job.sbatch             JOB_SCRIPT: the rendered job script (Slurm runs)
      manifest.json          MANIFEST: run name, creation time, config digest, launcher, job ids, version, host
      logs/                  LOGS: slurm-<jobid>.out/.err, local-<n>.out
      data/                  DATA: a dataset task's rows, frozen (train.arrow, val.arrow)
      checkpoints/           CHECKPOINTS: step-<n>.h5 or step-<n>/ (rollout_hpc.store.checkpoint)
      trajectories.h5        TRAJECTORY_LOG: every trajectory and the metrics per step (rollout_hpc.store.trajlog)
"""

from __future__ import annotations

from pathlib import Path

CONFIG_SNAPSHOT = "config.yaml"
RESOLVED_CONFIG = "config.resolved.yaml"
JOB_SCRIPT = "job.sbatch"
MANIFEST = "manifest.json"
LOGS = "logs"
DATA = "data"
CHECKPOINTS = "checkpoints"
TRAJECTORY_LOG = "trajectories.h5"


def data_dir(run_dir: str | Path) -> Path | None:
    """RUN_DIR/data when the run froze a dataset there (what load_task's data_dir takes), else None."""
    path = Path(run_dir) / DATA
    return path if path.is_dir() else None


# Exit codes of a rank (and of the job step): the batch script (slurm/rollout.sbatch) and the local launcher read them.
EXIT_OK = 0  # the run finished
EXIT_USER_ERROR = 2  # a UserError: printed as one paragraph, no traceback
EXIT_CONTINUE = 75  # checkpointed before the time limit; continue in a new allocation (EX_TEMPFAIL from sysexits.h)
