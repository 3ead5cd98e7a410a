"""Launching a run: sbatch rendering, Slurm submission, the local mpirun launcher, run directories.

EXIT_CONTINUE is the job step's exit code for "checkpointed before the time limit; continue in a
new allocation": the batch script (slurm/rollout.sbatch) requeues the job when it sees it.
"""

EXIT_CONTINUE = 75  # EX_TEMPFAIL from sysexits.h: a temporary failure, try again
