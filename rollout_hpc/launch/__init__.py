"""Launching a run: sbatch rendering, Slurm submission, the local mpirun launcher, run directories.

The exit codes the batch script reads (EXIT_CONTINUE: "checkpointed before the time limit; continue in a
new allocation") are defined in rollout_hpc.rundir_layout, below every layer that uses them.
"""

from rollout_hpc.rundir_layout import EXIT_CONTINUE  # noqa: F401  (re-exported: the launcher's callers use it)
